"""Importing qsa_lab changes nothing in the host interpreter (qsa_lab/__init__.py): no atexit
handler (it once registered gc.freeze), no signal handler, no thread, however many of its names
are used. The processes qsa_lab owns need no such handler: the `qsa-lab` program ends with
os._exit once its atexit handlers ran and its output is flushed (qsa_lab.app.cli._leave), so the
interpreter's teardown and its last garbage collections, which gc.freeze made cheaper, never run."""
import subprocess
import sys
import textwrap


def _run(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_qsa_lab_leaves_the_host_interpreter_as_it_was():
    # torch first (its own handlers are not qsa_lab's); then every lazy name, the CLI and the
    # pytest plugin (which pytest loads in every run once qsa_lab is installed)
    code = """
        import atexit, gc, signal, threading
        import torch
        before = gc.get_freeze_count()
        atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() - before > 10000, flush=True))
        {host}
        def state():
            handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
            return atexit._ncallbacks(), handlers, threading.active_count()
        start = state()
        import qsa_lab
        for name in qsa_lab.__all__:
            getattr(qsa_lab, name)
        import qsa_lab.app.cli, qsa_lab.canary.pytest_plugin
        print("unchanged:", state() == start, flush=True)
    """
    assert _run(code.format(host="pass")).split() == ["unchanged:", "True", "frozen", "at", "exit:", "False"]
    # the probe sees a freeze at exit when one is registered (atexit runs handlers last-in first-out)
    assert _run(code.format(host="atexit.register(gc.freeze)")).split()[-1] == "True"


def test_the_program_skips_the_interpreters_teardown():
    # an object alive at exit is finalised by a normal interpreter exit, never by the program's
    code = """
        import sys
        from qsa_lab.app import cli

        class Kept:
            def __del__(self):
                print("finalised at teardown", flush=True)

        kept = Kept()
        sys.exit(cli.main() if sys.argv[1:] else 0)
    """
    assert "finalised at teardown" in _run(code)                  # plain exit: the teardown runs
    out = _run(code, "--help")
    assert "usage: qsa-lab" in out and "finalised at teardown" not in out
