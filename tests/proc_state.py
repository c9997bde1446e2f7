"""Whether a process is still running, read from /proc (a zombie counts as gone): shared by the
tests of the second process (tests/support/test_executor.py, tests/canary/test_canary_overlap.py)."""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
