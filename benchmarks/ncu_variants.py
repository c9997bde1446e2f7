"""Launch each grouped variant on the report's geometry (16 rows, 8192 tokens, E4M3) for ncu.

    ncu --clock-control none -k regex:grouped_page4_forward --metrics ... python benchmarks/ncu_variants.py

Explains the variants' cost differences by counters rather than by time alone
(see benchmarks/ncu_variants.sh for the metric list).
"""
import torch

from qsa_lab import kernels
from qsa_lab.case import Geometry, build_case
from qsa_lab.plan import plan_groups
from qsa_lab.poison import apply_poison

case = apply_poison(build_case(Geometry(rows=16)), "random", plane="kv").to("cuda")
plan = plan_groups(case)
args = (case.q, case.kv_cache, case.k_scale, case.v_scale, plan.group_rows, plan.microblocks, plan.masks,
        plan.seq_len)
for variant in ("unfixed", "kernel_fix", "masked_load"):
    kernels.grouped_forward(*args, kv_format="e4m3", sm_scale=case.sm_scale, variant=variant)
torch.cuda.synchronize()
print("launched unfixed, kernel_fix, masked_load")
