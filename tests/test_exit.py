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
    # a handler registered before the import runs after qsa_lab's (atexit runs them last-in first-out)
    code = """
        import atexit, gc, sys
        atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
        print("frozen now:", gc.get_freeze_count() > 0)
        {import_line}
    """
    assert _run(code.format(import_line="import qsa_lab")).split() == ["frozen", "now:", "False", "frozen", "at",
                                                                       "exit:", "True"]
    assert "at exit: False" in _run(code.format(import_line="pass"))      # the check itself can fail


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
