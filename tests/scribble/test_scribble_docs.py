"""The engine scribble page's statements about workloads and payloads are what a run shows: its tables are
read here and checked against transformers (each supported version: `make test` runs this folder twice)."""
from pathlib import Path

import pytest

from qsa_lab.analysis.leaks import READ_LEAKS
from qsa_lab.scribble.check import scribble
from qsa_lab.scribble.engines.base import NoHooks

pytest.importorskip("transformers")

from qsa_lab.scribble.engines.transformers import TransformersEngine  # noqa: E402
from qsa_lab.scribble.models import WORKLOADS, tiny_model, workload  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "scribble.md"
EVENTS = {"chunked prefill": "chunked_prefill", "preemption": "preempted", "restore": "restored",
          "fork copies": "forked_blocks", "prefix sharing": "prefix_hits"}


def table_after(marker: str) -> list[list[str]]:
    """The markdown table that follows `<!-- marker -->` on the page, as rows of cells (header first)."""
    lines = PAGE.read_text().split(f"<!-- {marker} -->", 1)[1].strip().splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        if not set(line) <= set("|-: "):
            rows.append(cells(line))
    return rows


def cells(line: str) -> list[str]:
    """A table row's cells; a | inside backticks (`paged|eager`) is text, as Python-Markdown reads it."""
    out, cell, code = [], "", False
    for ch in line.strip()[1:]:
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            out.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return out


def names(cell: str) -> set:
    return {x.strip() for x in cell.split(",") if x.strip()}


WORKLOAD_TABLE = table_after("workloads: a test reads this table")
MODELS = [m.strip("`") for m in WORKLOAD_TABLE[0][2:]]


def test_the_workload_table_covers_every_workload_and_names_only_known_events():
    assert sorted(row[0].strip("`") for row in WORKLOAD_TABLE[1:]) == sorted(WORKLOADS)
    assert MODELS == ["llama-gqa", "mistral-swa", "qwen2-hybrid"]
    for row in WORKLOAD_TABLE[1:]:
        for cell in row[2:]:
            assert names(cell) <= set(EVENTS), row


@pytest.mark.parametrize("row", WORKLOAD_TABLE[1:], ids=lambda row: row[0].strip("`"))
def test_what_each_workload_makes_the_engine_do_is_what_the_page_says(row):
    wl = workload(row[0].strip("`"))
    for model, cell in zip(MODELS, row[2:]):
        gen = TransformersEngine(tiny_model(model), wl).generate(NoHooks())
        assert not gen.error
        did = {name for name, key in EVENTS.items() if gen.events[key] > 0}
        assert did == names(cell), (wl.name, model, gen.events)


def test_the_payloads_the_padded_read_trash_leaks_with_are_what_the_page_says():
    rows = table_after("payloads: a test reads this table")
    assert rows[0][0] == "attention" and len(rows) == 3
    for attn, said in rows[1:]:
        attn = attn.strip("`")
        report = scribble(TransformersEngine(tiny_model(), workload("chunked-prefill"), attn=attn, pad=True),
                          regions=("read-trash",), localise_leaks=False)
        leaking = {c.payload for c in report.cells if c.check == "read" and c.verdict in READ_LEAKS}
        assert leaking == names(said), (attn, report.table())
