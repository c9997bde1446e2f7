"""At exit, importing qsa_lab freezes the garbage collector's objects (qsa_lab/__init__.py): the
interpreter's last collections then skip torch's objects, while everything that cleans up by
reference count or by atexit still does."""
import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_qsa_lab_freezes_the_collector_at_exit():
    # a handler registered before the import runs after qsa_lab's (atexit runs them last-in first-out);
    # some interpreters freeze a few hundred objects at start-up, so it is the growth that counts
    code = """
        import atexit, gc
        before = gc.get_freeze_count()
        atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() - before > 10000, flush=True))
        {import_line}
        import torch
    """
    assert _run(code.format(import_line="import qsa_lab")).split() == ["frozen", "at", "exit:", "True"]
    assert _run(code.format(import_line="pass")).split() == ["frozen", "at", "exit:", "False"]   # it can fail


def test_what_cleans_up_by_reference_or_atexit_still_does(tmp_path):
    # a temporary folder (weakref.finalize, run at exit) is removed, and a file object that is
    # never closed is still flushed when the interpreter drops the last reference to it
    out = _run(f"""
        import tempfile
        import qsa_lab, torch
        kept = tempfile.TemporaryDirectory()
        print(kept.name)
        f = open({str(tmp_path / "unclosed.txt")!r}, "w")
        f.write("written " * 1000)
    """)
    from pathlib import Path

    assert not Path(out.strip()).exists()
    assert (tmp_path / "unclosed.txt").read_text() == "written " * 1000
