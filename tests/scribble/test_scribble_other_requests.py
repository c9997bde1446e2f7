"""Other requests, judged per request, and every leak confirmed by a re-run (transformers, CPU)."""
import random

import pytest
import torch

from qsa_lab.analysis.leaks import LEAKS
from qsa_lab.scribble.check import scribble
from qsa_lab.scribble.regions import OTHER

transformers = pytest.importorskip("transformers")

from qsa_lab.scribble.engines.transformers import TransformersEngine  # noqa: E402
from qsa_lab.scribble.examples import per_request_attention  # noqa: E402
from qsa_lab.scribble.models import tiny_model, workload  # noqa: E402
from user_attention import one_more_key  # noqa: E402


def other(report, payload="nan"):
    return next(c for c in report.cells if c.region == OTHER and c.payload == payload)


def test_a_weight_zero_read_of_another_live_requests_kv_is_a_nan_leak_at_other_requests():
    clean = scribble(TransformersEngine(tiny_model(), workload("chunked-prefill"), attn=per_request_attention),
                     regions=(OTHER, "free-blocks"), payloads=("nan",))
    assert {c.verdict for c in clean.cells} == {"clean"} and other(clean).slots > 0
    report = scribble(TransformersEngine(tiny_model(), workload("chunked-prefill"), attn=one_more_key),
                      regions=(OTHER, "free-blocks"), payloads=("nan",))
    cell = other(report)
    assert cell.verdict == "nan-leak" and cell.nan > 0
    assert {c.verdict for c in report.cells if c is not cell} == {"clean"}
    first = cell.pairs[0]
    assert set(first) == {"reader", "poisoned", "first_token", "step", "layer"}
    assert first["reader"] != first["poisoned"] and first["layer"] == 0
    assert first["step"] >= 1           # at step 0 every request is in its prefill: nothing is written yet
    assert f"{first['reader']} read {first['poisoned']}'s rows at step {first['step']} layer 0" in report.table()
    assert report.exit_code() == 1


def test_stock_paged_eager_lets_one_requests_nan_reach_every_request_batched_with_it():
    """transformers packs a batch into one sequence with a block-diagonal mask: each request's queries
    multiply the other requests' V rows by an exact 0, and 0 * NaN = NaN."""
    report = scribble(TransformersEngine(tiny_model(), workload("chunked-prefill")), regions=(OTHER,))
    for payload in ("nan", "inf", "max"):
        cell = other(report, payload)
        assert cell.verdict == "nan-leak", (payload, cell)
        pairs = {(p["reader"], p["poisoned"]) for p in cell.pairs}
        assert all(r != v for r, v in pairs) and len({v for _, v in pairs}) >= 2
    assert report.exit_code() == 1


class NoisyHead:
    """A head that is noisy in about 1 generation of 5: each generation draws (seeded) whether to add a
    little random noise to every logit it computes."""

    def __init__(self, engine, seed):
        self.engine, self.rng, self.noisy_runs, self.runs = engine, random.Random(seed), 0, 0
        self.name, self.reads_pool, self.graphs = engine.name, engine.reads_pool, engine.graphs
        self.model, self.workload = engine.model, engine.workload
        self._noise = None
        engine.model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self._noise is None:
            return output
        return output + 1e-4 * torch.randn(output.shape, generator=self._noise)

    def generate(self, hooks=None, record_attention=False):
        self.runs += 1
        noisy = self.rng.random() < 0.2
        self.noisy_runs += noisy
        self._noise = torch.Generator().manual_seed(self.rng.randrange(2 ** 31)) if noisy else None
        return self.engine.generate(hooks, record_attention=record_attention)


def test_a_kernel_noisy_in_one_generation_of_five_never_yields_a_leak():
    verdicts, noisy = [], 0
    for seed in range(6):
        eng = TransformersEngine(tiny_model(), workload("chunked-prefill"), attn=per_request_attention)
        eng = NoisyHead(eng, seed)
        report = scribble(eng, regions=("free-blocks", "unwritten-tail", "read-trash", OTHER), payloads=("nan",))
        verdicts += [c.verdict for c in report.cells]
        noisy += eng.noisy_runs
    assert not [v for v in verdicts if v in LEAKS]
    assert noisy > 0 and "unstable-control" in verdicts      # the noise did hit runs, and was called so
    assert "clean" in verdicts


def test_a_leak_that_does_not_reproduce_is_unstable_control():
    """A poisoned run that differs once (the second does not): never a leak."""
    eng = TransformersEngine(tiny_model(), workload("chunked-prefill"), attn=per_request_attention)
    runs = []
    orig = eng.generate

    def generate(hooks=None, record_attention=False):
        gen = orig(hooks, record_attention=record_attention)
        runs.append(hooks)
        if getattr(hooks, "region", None) == "free-blocks" and len(runs) == 3:   # the first poisoned run only
            gen.tokens["req_0"][-1] += 1
        return gen

    eng.generate = generate
    report = scribble(eng, regions=("free-blocks",), payloads=("nan",))
    cell = next(c for c in report.cells if c.check == "read")
    assert cell.verdict == "unstable-control" and "did not reproduce" in cell.error
    assert report.exit_code() == 3


@pytest.mark.parametrize("wl", ["reuse", "offload", "fork"])
def test_shared_prefixes_restores_and_forks_give_no_request_another_ones_rows(wl):
    """A per-request attention stays clean at other-requests through prefix sharing (rows two requests read
    are nobody's alone), restores and forks (a child reads its parent's rows: one family)."""
    eng = TransformersEngine(tiny_model(), workload(wl), attn=per_request_attention)
    report = scribble(eng, regions=(OTHER,), payloads=("nan",))
    assert other(report).verdict == "clean" and other(report).slots > 0, report.table()
