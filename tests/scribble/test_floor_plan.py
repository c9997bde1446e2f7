"""The scribble's floor plan, read from the source: one folder entry per engine under scribble/engines,
each with an adapter class on the one protocol (engines/base.py); the regions and their precedence
defined once; one patch-and-restore helper; one version gate; one user-function grammar that the
canary's kernel names and the scribble's --attn both read; no verdict written as a literal outside
analysis/leaks.py. Plain Python where it can be: torch is imported only to check an adapter's
signature and the label precedence."""
import ast
import importlib
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_lab.analysis.leaks import ERROR, VERDICTS
from qsa_lab.scribble import patching, regions
from qsa_lab.scribble.versions import UnsupportedVersion, VersionGate
from qsa_lab.support.loading import FILE, MODULE, FunctionNameError, parse_function_name, user_function_kind

PACKAGE = Path(__file__).resolve().parents[2] / "qsa_lab"
SCRIBBLE = PACKAGE / "scribble"
ENGINES = SCRIBBLE / "engines"
#: the scribble's wing: no verdict literal at all here, 'error' included
WING = [*SCRIBBLE.rglob("*.py"), PACKAGE / "app" / "scribble.py"]


# -- verdicts: names, never literals ---------------------------------------------------------------------

def _constants(path: Path) -> list:
    return [(n.value, n.lineno) for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def test_no_verdict_is_a_string_literal_outside_the_leak_check():
    """Every module takes the verdicts' names from qsa_lab.analysis.leaks. Outside the scribble's wing
    'error' is not looked for (the word also names error fields and message kinds there), nor
    model/case.py's 'n/a' (a missing measurement, not a verdict)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "analysis/leaks.py":
            continue
        for value, line in _constants(path):
            if value not in VERDICTS or (value == "n/a" and rel == "model/case.py"):
                continue
            if value != ERROR or path in WING:
                found.append(f"{rel}:{line}: {value!r}")
    assert found == []


def test_the_check_would_see_a_verdict_literal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('cells = [Cell("read", r, p, "error") for r in regions]\nOK = "clean-ish"\n')
    assert [v for v, _ in _constants(bad) if v in VERDICTS] == ["error"]


# -- one folder entry per engine, each on the one protocol ----------------------------------------------

def _engine_entries() -> dict:
    """{engine name: its source files} for every module or package under scribble/engines but base.py."""
    out = {}
    for entry in sorted(ENGINES.iterdir()):
        if entry.name.startswith(("_", ".")) or entry.name == "base.py":
            continue
        if entry.is_dir():
            out[entry.name] = sorted(entry.glob("*.py"))
        elif entry.suffix == ".py":
            out[entry.stem] = [entry]
    return out


def _protocol() -> tuple[set, list]:
    """The attributes EngineAdapter declares and generate's parameters, read from engines/base.py."""
    tree = ast.parse((ENGINES / "base.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineAdapter")
    attrs = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    generate = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "generate")
    return attrs, [a.arg for a in generate.args.args]


def _assigned(cls: ast.ClassDef) -> set:
    """Names a class body binds and attributes its methods set on self."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(leaf, ast.Name) and node in cls.body:
                    names.add(leaf.id)
                elif isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def _generating_classes(path: Path) -> list:
    """(class name, attributes it sets) of each class in `path` with a `generate` method."""
    return [(n.name, _assigned(n)) for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)
            and any(isinstance(f, ast.FunctionDef) and f.name == "generate" for f in n.body)]


def _adapters(files: list) -> list:
    """(module name, class name, attributes it sets) of each class with a `generate` method in `files`."""
    return [(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts), name, assigned)
            for p in files for name, assigned in _generating_classes(p)]


def test_each_engine_is_one_module_or_folder_with_one_adapter_on_the_protocol():
    entries = _engine_entries()
    assert set(entries) >= {"transformers", "vllm"}, entries
    attrs, params = _protocol()
    assert attrs == {"name", "reads_pool", "graphs", "model", "workload"}
    assert params == ["self", "hooks", "record_attention"]
    for engine, files in entries.items():
        adapters = _adapters(files)
        assert len(adapters) == 1, (engine, adapters)
        module, cls_name, assigned = adapters[0]
        assert attrs <= assigned, (engine, attrs - assigned)
        cls = getattr(importlib.import_module(module), cls_name)     # imports torch, never the engine itself
        got = inspect.signature(cls.generate)
        assert list(got.parameters) == params, (engine, got)
        assert got.parameters["hooks"].default is None and got.parameters["record_attention"].default is False


def test_the_protocol_check_would_see_an_adapter_that_misses_an_attribute(tmp_path):
    half = tmp_path / "half.py"
    half.write_text("class Half:\n    graphs = False\n    def __init__(self):\n        self.name, self.model = 'h', None\n"
                    "    def generate(self, hooks=None, record_attention=False):\n        pass\n")
    ((name, assigned),) = _generating_classes(half)
    assert name == "Half" and assigned >= {"graphs", "name", "model"} and "reads_pool" not in assigned


def test_vllm_loads_the_connector_from_a_module_that_defines_it():
    """vLLM imports the KV connector by its module path string (kv_connector_module_path): the string
    must name the module that defines the class it names."""
    tree = ast.parse((ENGINES / "vllm" / "engine.py").read_text())
    module = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "CONNECTOR_MODULE")
    spec = importlib.util.find_spec(module)           # finds the file; vLLM itself is not imported
    assert spec is not None and spec.origin == str(ENGINES / "vllm" / "connector.py")
    classes = {n.name for n in ast.parse(Path(spec.origin).read_text()).body if isinstance(n, ast.ClassDef)}
    assert "ScribbleConnector" in classes and '"kv_connector": "ScribbleConnector"' in (
        ENGINES / "vllm" / "engine.py").read_text()


def test_the_modules_the_command_line_reads_first_import_no_torch():
    code = ("import sys; import qsa_lab.scribble.regions, qsa_lab.scribble.versions, qsa_lab.scribble.report, "
            "qsa_lab.scribble.engines.vllm.env, qsa_lab.app.scribble; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


# -- the regions and their precedence, once -------------------------------------------------------------

def test_precedence_names_every_pool_region_and_owned_once_and_the_engines_question_decides_one_pair():
    for reads_first in (True, False):
        order = regions.precedence(reads_first)
        assert sorted(order) == sorted(regions.POOL_REGIONS + (regions.OWNED,))
        assert order.index("free-blocks") == 0 and order[-2:] == ("read-trash", "write-trash")
        assert set(regions.UNOWNED) <= set(order)
    assert regions.precedence(True).index(regions.OWNED) > regions.precedence(True).index("step-writes")
    assert regions.precedence(False).index(regions.OWNED) < regions.precedence(False).index("step-writes")


def test_row_labels_keep_the_most_protected_label_whatever_the_order_of_the_marks():
    torch = pytest.importorskip("torch")
    order = regions.precedence(reads_before_write=True)
    marks = [(slice(0, 6), "unwritten-tail"), ([2, 3], regions.OWNED), ([3, 4], "step-writes"),
             ([1, 2], "out-of-window"), ([7], "prefix-cache")]
    results = []
    for sequence in (marks, marks[::-1]):
        labels = regions.RowLabels(torch.zeros(8, dtype=torch.int8), order)
        for index, label in sequence:
            labels.mark(index, label)
        results.append({k: v.tolist() for k, v in labels.regions().items()} | {"owned": labels.rows("owned").tolist()})
    assert results[0] == results[1]
    got = results[0]
    assert got["owned"] == [2, 3] and got["step-writes"] == [4] and got["out-of-window"] == [1]
    assert got["unwritten-tail"] == [0, 5] and got["prefix-cache"] == [7] and got["free-blocks"] == [6]


# -- one patch-and-restore helper ----------------------------------------------------------------------

class _Base:
    def step(self):
        return "base"


class _Engine(_Base):
    def warmup(self):
        return "own"


def test_patches_give_every_attribute_back_as_it_was_even_after_an_exception():
    with pytest.raises(RuntimeError, match="mid-generation"):
        with patching.patched() as patch:
            patch.wrap(_Engine, "step", lambda orig: lambda self: f"wrapped {orig(self)}")
            patch.set(_Engine, "warmup", lambda self: "patched")
            assert _Engine().step() == "wrapped base" and _Engine().warmup() == "patched"
            raise RuntimeError("mid-generation")
    assert "step" not in vars(_Engine) and _Engine().step() == "base"     # inherited: deleted again
    assert _Engine().warmup() == "own"


# -- one version gate ----------------------------------------------------------------------------------

def test_one_version_gate_refuses_in_one_line_and_reads_a_local_tag_as_its_release(monkeypatch):
    gate = VersionGate("enginex", ("1.2.0",), who="the scribble's X adapter", reads="the pool of",
                       install="pip install enginex==1.2.0", label="EngineX", distributions=("enginex", "enginex-cpu"))
    monkeypatch.setattr("qsa_lab.scribble.versions.package_version",
                        lambda dist: {"enginex-cpu": "1.2.0+cpu"}.get(dist))
    assert gate.installed() == "1.2.0" and gate.refusal() is None
    line = gate.refusal("1.3.0")
    assert line == ("enginex: version 1.3.0 is not supported; the scribble's X adapter reads the pool of "
                    "EngineX 1.2.0 (pip install enginex==1.2.0)")
    with pytest.raises(UnsupportedVersion, match="^enginex: version 1.1.0 is not supported"):
        gate.require("1.1.0")
    monkeypatch.setattr("qsa_lab.scribble.versions.package_version", lambda dist: None)
    assert gate.refusal() == "enginex: not installed; the scribble's X adapter needs EngineX 1.2.0 (pip install " \
                             "enginex==1.2.0)"


# -- one grammar for a user's function -----------------------------------------------------------------

NAMES = ["my_attn.py:attention", "dir/my attn.py:fn", "pkg.mod:fn", "mod:fn", "paged|eager", "sdpa",
         "org/repo:kernel", "k.py", "mod:", ":fn", "my-mod:fn", "pkg..mod:fn", "mod:Cls.fn", "k.py:fn-1"]


@pytest.mark.parametrize("text", NAMES)
def test_the_canary_and_the_attn_option_read_one_grammar(text):
    from qsa_lab.canary.names import KernelNameError, parse_kernel
    from qsa_lab.scribble.isolated import is_user_attention

    try:
        parsed = parse_function_name(text)
    except FunctionNameError as e:
        parsed, problem = None, e
    try:
        kernel = parse_kernel(text, "--kernels")
    except KernelNameError as e:
        kernel, kernel_problem = None, e.problem
    if parsed is not None:
        assert kernel is not None and (kernel.kind, kernel.source, kernel.function) == parsed
        assert parsed[0] == (FILE if parsed[1].endswith(".py") else MODULE)
    else:
        assert kernel is None
        if problem.shape_ok:
            assert kernel_problem == str(problem)
    assert is_user_attention(text) == (user_function_kind(text) is not None)
    if parsed is not None or not problem.shape_ok:     # a name of the right form, or not a function name at all
        assert is_user_attention(text) == (parsed is not None)


# -- machine facts, once -------------------------------------------------------------------------------

def test_a_report_states_the_machine_facts_once_and_its_json_reads_back_whole():
    pytest.importorskip("torch")
    from qsa_lab.scribble.report import Cell, ScribbleReport
    from qsa_lab.support.machine import host_facts

    report = ScribbleReport(engine="transformers:paged|eager", reads_pool="gather", graphs=False, model="tiny",
                            workload={"name": "reuse"}, cells=[Cell("read", "free-blocks", "nan", "clean", slots=3)],
                            facts=host_facts("transformers") | {"threads": 1})
    doc = report.to_dict()
    header = {k for k in doc if k not in ("engine", "reads_pool", "graphs", "model", "workload", "control_seconds",
                                          "facts", "events", "moved_rows", "counts", "results")}
    assert {"schema", "torch", "python", "date"} <= header and not header & set(doc["facts"])
    assert {"transformers", "machine", "processor", "threads"} == set(doc["facts"])
    again = ScribbleReport.from_dict({**doc, "date": "2000-01-01T00:00:00Z"})   # as another machine wrote it
    assert again.to_dict() == {**doc, "date": "2000-01-01T00:00:00Z"}
