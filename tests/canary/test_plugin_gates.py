"""The pytest plugin's gates cannot be green on nothing (issue 33, item 4): a marker whose
cells all skip (n/a or KernelSkipped) fails, a marked test that never calls check() fails, and
the marker takes a timeout."""
import pytest

pytest_plugins = ["pytester"]

HEADER = '''
import pytest, time, torch
from qsa_lab.canary import KernelSkipped

def reference(call):
    keep = call.attend_mask()
    drop = ~keep.view(*keep.shape, 1, 1)
    k = call.pages("k", heads="q").float().masked_fill(drop, 0.0)
    v = call.pages("v", heads="q").float().masked_fill(drop, 0.0)
    s = torch.einsum("rhd,rshd->rhs", call.q.float(), k) * call.sm_scale
    p = torch.softmax(torch.where(keep.unsqueeze(1), s, -torch.inf), dim=-1)
    return torch.einsum("rhs,rshd->rhd", p, v).to(torch.float16)

def skips(call):
    raise KernelSkipped("no GPU here")

def hangs(call):
    time.sleep(60)
'''


def outcomes(pytester, body, *args):
    pytester.makepyfile(test_gate=HEADER + body)
    result = pytester.runpytest("-p", "qsa_lab.canary.pytest_plugin", "-rfs", *args)
    return result.parseoutcomes(), result.stdout.str()


def test_a_marker_whose_every_cell_is_n_a_fails(pytester):
    got, out = outcomes(pytester, '''
@pytest.mark.qsa_canary(reference, regions=["free-pages"], payloads=["nan"], planes=["v"])
def test_x(qsa_canary_cell):
    qsa_canary_cell.check()
''')
    assert got.get("failed") == 1 and not got.get("passed") and not got.get("skipped"), out
    assert "no cell of this marker ran a leak check" in out


def test_a_marker_whose_kernel_skips_everywhere_fails(pytester):
    got, out = outcomes(pytester, '''
@pytest.mark.qsa_canary(skips, regions=["null-block", "stale-tail"], payloads=["nan"], planes=["v"])
def test_x(qsa_canary_cell):
    qsa_canary_cell.check()
''')
    assert got.get("failed") == 2 and not got.get("skipped"), out
    assert "no GPU here" in out


def test_n_a_cells_still_skip_beside_cells_that_ran(pytester):
    got, out = outcomes(pytester, '''
@pytest.mark.qsa_canary(reference, regions=["free-pages", "stale-tail"], payloads=["nan"], planes=["v"])
def test_x(qsa_canary_cell):
    qsa_canary_cell.check()
''')
    assert got == {"passed": 1, "skipped": 1}, out


def test_a_marked_test_that_never_checks_fails(pytester):
    got, out = outcomes(pytester, '''
@pytest.mark.qsa_canary(reference, regions=["stale-tail"], payloads=["nan"], planes=["v"])
def test_x(qsa_canary_cell):
    pass
''')
    assert got.get("failed") == 1 and not got.get("passed"), out
    assert "never called qsa_canary_cell.check()" in out


def test_the_marker_takes_a_timeout(pytester):
    got, out = outcomes(pytester, '''
@pytest.mark.qsa_canary(hangs, regions=["stale-tail"], payloads=["nan"], planes=["v"], timeout=1)
def test_x(qsa_canary_cell):
    qsa_canary_cell.check()
''', "--durations=1")
    assert got.get("failed") == 1, out
    assert "timed out" in out or "timeout" in out.lower()
