"""The scribble's workloads are named for what they exercise; an earlier name is refused with the
name it has now, at the command line (before torch) and in Python. Needs neither torch nor
transformers."""
import subprocess
import sys

import pytest

from qsa_lab.scribble.models import RENAMED_WORKLOADS, WORKLOADS, workload


def test_every_workload_carries_its_own_name_and_no_old_name_is_a_workload():
    assert all(w.name == name for name, w in WORKLOADS.items())
    assert set(RENAMED_WORKLOADS) & set(WORKLOADS) == set() and set(RENAMED_WORKLOADS.values()) <= set(WORKLOADS)


def test_the_chunked_prefill_workload_prefills_a_prompt_in_chunks_with_blocks_to_spare():
    w = workload("chunked-prefill")
    assert sum(w.prompt_lengths) > w.max_batch_tokens                        # the last prompt is chunked
    pages = sum(-(-(n + w.new_tokens) // w.page_size) for n in w.prompt_lengths)
    assert pages < w.num_blocks          # every request fits at once: none waits for a freed block


def test_an_earlier_name_in_python_names_the_new_one():
    with pytest.raises(ValueError, match=r"^workload: 'issue32' is now called 'chunked-prefill'$"):
        workload("issue32")


def test_an_earlier_name_on_the_command_line_is_one_line_naming_the_new_one():
    code = ("import sys; from qsa_lab.app.cli import main; rc = main(['scribble', '--workload', 'issue32']); "
            "print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"]
    assert done.stderr == "qsa-lab: error: --workload: 'issue32' is now called 'chunked-prefill'\n"


def test_help_offers_the_names_of_now():
    done = subprocess.run([sys.executable, "-m", "qsa_lab", "scribble", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "chunked-prefill" in done.stdout and "issue32" not in done.stdout
