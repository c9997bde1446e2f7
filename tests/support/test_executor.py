"""The one way a second process is started (qsa_lab.support.executor): the Relay lets the caller
take back only what was not sent yet; the process ignores Ctrl-C, is killed by close() even in
the middle of a call, dies with its caller, and never runs the caller's main script again."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from proc_state import alive
from qsa_lab.support.executor import Relay, SecondProcess

linux = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")


def _gone(pid: int, within: float = 30) -> bool:
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@linux
def test_the_relay_sends_one_call_at_a_time_and_gives_back_the_rest():
    with SecondProcess() as second:
        answered = []
        relay = Relay(second, answered=answered.append)
        relay.add("slow", time.sleep, 1.0)
        relay.add("pid", os.getpid)
        relay.add("last", os.getpid)
        assert relay.take("last") and not relay.take("slow")     # not sent yet / sent already
        assert relay.result("pid") == second.pid != os.getpid()  # run there
        assert relay.result("last") is None and relay.result("slow") is None   # taken back; time.sleep -> None
        assert answered == ["slow", "pid"]
        os.kill(second.pid, signal.SIGINT)                       # Ctrl-C is the caller's
        assert relay.take("pid") is False and second.submit(os.getpid).result(60) == second.pid


@linux
def test_close_kills_it_in_the_middle_of_a_call():
    second = SecondProcess()
    relay = Relay(second)
    relay.add("long", time.sleep, 600)
    relay.add("next", os.getpid)
    t = time.monotonic()
    second.close()
    assert time.monotonic() - t < 30 and _gone(second.pid)
    assert relay.result("long") is None and relay.take("next")   # failed; never sent: the caller's


CALLER = r'''
import os, sys, time
with open(sys.argv[1], "a") as f:           # not guarded by __name__: a second run would show here
    f.write("main ran\n")
from qsa_lab.support.executor import SecondProcess
second = SecondProcess()
print(second.pid, second.submit(os.getpid).result(60), flush=True)
second.submit(time.sleep, 600)
time.sleep(0.5)
os._exit(0)                                  # as a signal ends a command: no clean-up, no close()
'''


@linux
def test_it_dies_with_its_caller_and_never_runs_the_callers_script(tmp_path):
    (tmp_path / "caller.py").write_text(CALLER)     # a script file: spawn would run it again as __mp_main__
    p = subprocess.run([sys.executable, "caller.py", str(tmp_path / "runs")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    pid, answered = map(int, p.stdout.split())
    assert pid == answered and _gone(pid)
    assert (tmp_path / "runs").read_text() == "main ran\n" and p.stderr == ""
