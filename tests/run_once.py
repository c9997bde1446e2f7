"""A test fixture's value built once per test run, even across pytest-xdist's workers."""
import os
import pickle
import shutil


def once_per_run(tmp_path_factory, name: str, make):
    """make(folder) -> a picklable value, computed once per test run even across pytest-xdist's
    workers: the first worker to ask builds it in a folder of the run's shared temporary
    directory, under a file lock, and the others wait and read its pickle. Each worker would
    otherwise build a module fixture of its own (the NVRTC compiles take tens of seconds). The
    folder and anything in it stay there for the run; tests only read them. A build that fails is
    tried again by the next worker to ask, and fails there too."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / f"once-{name}", shared / f"once-{name}.pickle"
    with FileLock(str(shared / f"once-{name}.lock")):
        if done.exists():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)     # left by a build that failed
        folder.mkdir()
        value = make(folder)
        part = done.with_suffix(".part")
        part.write_bytes(pickle.dumps(value))
        part.replace(done)
        return value
