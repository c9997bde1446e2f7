"""A small poisoned case through the compiled kernels, for compute-sanitizer (the sanitize stage of
benchmarks/gpu_check.sh).

    python benchmarks/sanitize_case.py --variants unfixed,kernel_fix --kv e4m3 [--trials N] [--mixed]
    python benchmarks/sanitize_case.py --list-variants     # every variant routes.compiled builds, comma-separated

Runs each grouped variant once (plus XQA and decode_panel), prints NaN counts. With
--trials N it also reruns each variant N times and counts runs whose output has a NaN
on a route that should be clean (the leak test for kernel_fix (A) without its leading barrier).
With --mixed the case is upstream's mixed batch (46 + 1 + 1 + 1 rows, a shorter context) with
NaN in request 0's attended V, and each variant also runs on the request-aligned plan whose
remainders are padded groups (empty query slots, group_rows -1): finite_pv's slow path (tiles
with non-finite V) and the padded groups under the sanitizer.
"""
import argparse

import torch

from qsa_lab.routes import compiled as kernels
from qsa_lab.model.case import Geometry, build_case
from qsa_lab.model.geometry import MIXES
from qsa_lab.model.plan import plan_groups, xqa_tokens
from qsa_lab.model.poison import apply_poison, poison_request

ap = argparse.ArgumentParser()
# the variants come from routes.compiled, so a new one is sanitized without editing a script
ap.add_argument("--variants", default=",".join(kernels.VARIANTS), help="comma list (default: every variant)")
ap.add_argument("--list-variants", action="store_true", help="print every variant routes.compiled builds and exit")
ap.add_argument("--kv", default="e4m3")
ap.add_argument("--site", default="random")
ap.add_argument("--context", type=int, default=1030)
ap.add_argument("--trials", type=int, default=0)
ap.add_argument("--mixed", action="store_true")
a = ap.parse_args()
if a.list_variants:
    raise SystemExit(print(",".join(kernels.VARIANTS)))

if a.mixed:
    g = MIXES["upstream-mix"].replace(context=a.context, topk=64, kv_dtype=a.kv)
    case = poison_request(apply_poison(build_case(g), a.site, plane="kv"), 0, "nan").to("cuda")
else:
    g = Geometry(rows=19, requests=2, layout="scatter", context=a.context, topk=64, kv_dtype=a.kv)
    case = apply_poison(build_case(g), a.site, plane="kv").to("cuda")
plan = plan_groups(case)
plans = {"": plan}
if a.mixed:  # request-aligned, every remainder a padded group (empty query slots)
    plans[" padded"] = plan_groups(case, "request", remainder_group_min=1)
kw = dict(kv_dtype=a.kv, sm_scale=case.sm_scale)
for v, (name, pl) in ((v, item) for v in a.variants.split(",") for item in plans.items()):
    args = (case.q, case.kv_cache, case.k_scale, case.v_scale, pl.members, pl.microblocks, pl.masks, pl.seq_len)
    out = kernels.grouped_forward(*args, variant=v, **kw)
    torch.cuda.synchronize()
    line = f"variant {v + name:32s} nan {int(torch.isnan(out).sum())}"
    if a.trials:
        leaks = sum(bool(torch.isnan(kernels.grouped_forward(*args, variant=v, **kw)).any()) for _ in range(a.trials))
        line += f"  runs with NaN: {leaks}/{a.trials}"
    print(line, flush=True)
rows = torch.arange(g.rows, device="cuda")
ti, tc = xqa_tokens(case, rows)
x = kernels.xqa_forward(case.q, case.kv_cache, case.k_scale, case.v_scale, ti, tc, **kw)
p = kernels.decode_panel(case.kv_cache, plan.microblocks[0], plane=1, kv_dtype=a.kv)
torch.cuda.synchronize()
print(f"xqa nan {int(torch.isnan(x).sum())}; decode_panel rows {p.shape[0]}", flush=True)
