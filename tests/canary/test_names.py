"""The canary's kernel-name grammar (qsa_lab.canary.names): each kind, each bad form, and the
option a name came from, in the record and in every error about it (--kernels, --kernel, a call
file, the pytest marker, the API)."""
from types import SimpleNamespace

import pytest

from qsa_lab.app.cli import main
from qsa_lab.canary.adapters import KERNELS
from qsa_lab.canary.kernels import builtin_kernels, register_kernel
from qsa_lab.canary.names import (ADAPTER, BUILTIN, FILE, MODULE, PREFIXES, REGISTERED, KernelName, KernelNameError,
                                  parse_kernel)

FAST = ["--regions", "null-block", "--payloads", "nan", "--backend", "emulate"]


def cli(capsys, *argv):
    rc = main(["canary", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("text,kind,source,function", [
    ("qsa:grouped+kernel_fix", BUILTIN, "qsa", "grouped+kernel_fix"),
    ("torch:sdpa-math", BUILTIN, "torch", "sdpa-math"),
    ("torch:no-such", BUILTIN, "torch", "no-such"),           # looked up later, never imported
    ("flashinfer:decode-tc", ADAPTER, "flashinfer", "decode-tc"),
    ("vllm:unified", ADAPTER, "vllm", "unified"),
    ("flashinfer:evil.py:boom", ADAPTER, "flashinfer", "evil.py:boom"),   # a built-in prefix wins
    ("kernels/my_attn.py:decode", FILE, "kernels/my_attn.py", "decode"),
    ("/abs/dir:with:colons/k.py:fn", FILE, "/abs/dir:with:colons/k.py", "fn"),
    ("mypkg.attn:prefill", MODULE, "mypkg.attn", "prefill"),
    ("  mod:fn  ", MODULE, "mod", "fn"),
])
def test_each_kind_parses_into_its_record(text, kind, source, function):
    name = parse_kernel(text, "--kernels")
    assert (name.kind, name.source, name.function, name.option) == (kind, source, function, "--kernels")
    assert name.text == str(name) == text.strip()
    assert name.in_process == (kind in (BUILTIN, ADAPTER))


@pytest.mark.parametrize("text,problem", [
    ("", "an empty kernel name"),
    ("   ", "an empty kernel name"),
    ("nocolon", "'nocolon' is not a known kernel nor module:function / file.py:function"),
    (":fn", "':fn' is not a known kernel nor module:function / file.py:function"),
    ("mod:", "'mod:' is not a known kernel nor module:function / file.py:function"),
    ("k.py", "'k.py' is not a known kernel nor module:function / file.py:function"),
    ("my-mod:fn", "'my-mod:fn': 'my-mod' is neither a module (package.module) nor a file.py"),
    ("pkg..mod:fn", "'pkg..mod:fn': 'pkg..mod' is neither a module (package.module) nor a file.py"),
    ("mod:Cls.fn", "'mod:Cls.fn': 'Cls.fn' is not a function name"),
    ("k.py:fn-1", "'k.py:fn-1': 'fn-1' is not a function name"),
    ("qsa:nope", "unknown qsa route 'nope'; choose from"),
    ("qsa:fixA", "'qsa:fixA' is now called 'qsa:grouped+kernel_fix'"),
])
@pytest.mark.parametrize("option", ["kernels", "--kernel", "call file"])
def test_each_bad_form_is_one_error_naming_the_option(text, problem, option):
    with pytest.raises(KernelNameError) as e:
        parse_kernel(text, option)
    assert str(e.value).startswith(f"{option}: {problem}")
    assert e.value.option == option and str(e.value) == f"{option}: {e.value.problem}"


def test_a_value_that_is_no_string_is_a_type_error_naming_the_option():
    with pytest.raises(TypeError, match="^--kernels: expected a kernel name, got int$"):
        parse_kernel(3, "--kernels")


def test_a_record_is_frozen_and_hashable():
    name = parse_kernel("torch:sdpa-math")
    assert name.option == "kernels" and {name: 1}[parse_kernel("torch:sdpa-math")] == 1
    with pytest.raises(AttributeError):
        name.kind = MODULE


def test_the_prefixes_listed_once_are_those_of_every_builtin_and_adapter_kernel():
    names = [parse_kernel(n) for n in (*builtin_kernels(), *KERNELS)]
    assert all(n.in_process for n in names)
    assert {n.source for n in names} == set(PREFIXES)
    assert {n.source: n.kind for n in names} == PREFIXES


def test_a_registered_name_is_an_adapter_and_only_a_library_kernel_name_registers():
    before = dict(REGISTERED)
    with pytest.raises(KernelNameError):
        parse_kernel("mylib:decode-tc")          # not registered: a module with no function name
    try:
        register_kernel("mylib:decode-tc", lambda call: call.q)
        name = parse_kernel("mylib:decode-tc", "--kernels")
        assert (name.kind, name.source, name.function) == (ADAPTER, "mylib", "decode-tc") and name.in_process
    finally:
        REGISTERED.pop("mylib:decode-tc", None)
    for bad in ("qsa:xqa", "torch:mine", "nocolon", "lib:", ":kernel", " lib:k", 3):
        with pytest.raises(ValueError, match="^name: expected 'library:kernel' outside qsa:, torch:"):
            register_kernel(bad, lambda call: call.q)
    assert REGISTERED == before


# -- the option a name came from, in errors raised long after it was parsed ---------------------------

def test_command_line_errors_name_the_option_each_name_came_from(capsys):
    rc, _, err = cli(capsys, "--kernels", "torch:sdpa-math,nocolon", *FAST)
    assert rc == 2 and err == ("qsa-lab: error: --kernels: 'nocolon' is not a known kernel nor module:function / "
                               "file.py:function\n")
    rc, _, err = cli(capsys, "--kernel", "my-mod:fn", *FAST)
    assert rc == 2 and err == ("qsa-lab: error: --kernel: 'my-mod:fn': 'my-mod' is neither a module "
                               "(package.module) nor a file.py\n")
    # found out later (the lookup, a worker's import): still the option of that name
    rc, _, err = cli(capsys, "--kernels", "torch:sdpa-math", "--kernel", "torch:nope", *FAST)
    assert rc == 2 and err.startswith("qsa-lab: error: --kernel: unknown torch kernel 'torch:nope'")
    rc, _, err = cli(capsys, "--kernels", "torch:sdpa-math", "--kernel", "no_such_module_xyz:fn", *FAST)
    assert rc == 2 and err.startswith("qsa-lab: error: --kernel: 'no_such_module_xyz:fn': cannot import")
    rc, _, err = cli(capsys, "--kernels", "no_such_module_xyz:fn", "--kernel", "canary_kernels:reference", *FAST)
    assert rc == 2 and err.startswith("qsa-lab: error: --kernels: 'no_such_module_xyz:fn': cannot import")
    rc, _, err = cli(capsys, "--kernels", "torch:sdpa-math", "--kernel", "torch:sdpa-math", *FAST)
    assert rc == 2 and err.startswith("qsa-lab: error: --kernel: 'torch:sdpa-math' given twice")


def test_a_kernels_bad_attribute_names_its_option(capsys, tmp_path):
    src = tmp_path / "odd.py"
    src.write_text("import canary_kernels\n\ndef fn(call):\n    return canary_kernels.reference(call)\n\n"
                   "fn.paged_inputs = 'everything'\n")
    rc, _, err = cli(capsys, "--kernel", f"{src}:fn", *FAST)
    assert rc == 2 and err.startswith(f"qsa-lab: error: --kernel: '{src}:fn': paged_inputs must be one of")


def test_api_errors_name_the_api_argument():
    from qsa_lab.canary import run_canary

    with pytest.raises(ValueError, match="^kernels: 'nocolon' is not a known kernel"):
        run_canary(["nocolon"])
    with pytest.raises(ValueError, match="^kernels: unknown flashinfer kernel 'flashinfer:nope'"):
        run_canary(["flashinfer:nope"], backend="emulate", regions=["null-block"], payloads=["nan"])
    given = parse_kernel("torch:nope", "my option")   # a record keeps the option it was parsed with
    with pytest.raises(ValueError, match="^my option: unknown torch kernel 'torch:nope'"):
        run_canary([given], backend="emulate", regions=["null-block"], payloads=["nan"])


def test_the_pytest_marker_parses_its_name_once_and_names_itself():
    from qsa_lab.canary.pytest_plugin import Config

    cfg = Config.from_marker(SimpleNamespace(args=("torch:sdpa-math",), kwargs={}))
    assert isinstance(cfg.kernel, KernelName) and cfg.kernel.option == "qsa_canary marker"
    with pytest.raises(pytest.UsageError, match="^qsa_canary marker: unknown qsa route 'nope'"):
        Config.from_marker(SimpleNamespace(args=("qsa:nope",), kwargs={}))
