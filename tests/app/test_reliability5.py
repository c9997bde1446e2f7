"""Reliability V (issue 48): this round's new surfaces as a stranger uses them: bad input is one line
naming the argument (exit 2), nothing checked is exit 3, a received file never chooses code to run."""
import pytest

from qsa_lab.app.cli import main


def _one_line(err: str, flag: str) -> None:
    assert err.startswith(f"qsa-lab: error: {flag}: ") and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["0", "99999"])
def test_search_pins_requests_inside_the_canary_range_naming_it(capsys, value):
    """Before: `--requests 0` said `canary --search: max() arg is an empty sequence`, `--requests 99999`
    blamed --rows."""
    assert main(["canary", "--search", "--kernels", "qsa:xqa", "--requests", value, "--budget", "1"]) == 2
    _one_line(capsys.readouterr().err, "--requests")
