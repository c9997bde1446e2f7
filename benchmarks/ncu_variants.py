"""Hardware counters of the grouped variants on the report's geometry (16 rows, 8192 tokens,
E4M3, default selections): where each variant's cycles per tile go.

    python benchmarks/ncu_variants.py                      launch each variant once (run under ncu)
    python benchmarks/ncu_variants.py --summarize RAW.csv  per-tile table from ncu's --csv output

The bench stage of benchmarks/gpu_check.sh runs both (evidence/ncu_variants_h200.txt).
"""
import argparse
import csv
import json
import re
import sys

VARIANTS = ("unfixed", "kernel_fix", "masked_load", "early_v")
KERNEL_ID = {"0": "unfixed", "1": "kernel_fix", "2": "masked_load", "3": "kernel_fix_no_leading_barrier",
             "4": "early_v"}
STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle", "mio_throttle",
          "not_selected", "selected")


def launch():
    import torch

    from qsa_lab.routes import compiled as kernels
    from qsa_lab.model.case import Geometry, build_case
    from qsa_lab.model.plan import plan_groups
    from qsa_lab.model.poison import apply_poison

    case = apply_poison(build_case(Geometry(rows=16)), "random", plane="kv").to("cuda")
    plan = plan_groups(case)
    args = (case.q, case.kv_cache, case.k_scale, case.v_scale, plan.members, plan.microblocks, plan.masks,
            plan.seq_len)
    for variant in VARIANTS:
        kernels.grouped_forward(*args, kv_dtype="e4m3", sm_scale=case.sm_scale, variant=variant)
    torch.cuda.synchronize()
    tiles = (plan.seq_len // 32).tolist()
    # one line for the summary step (ncu passes the program's output through)
    print("NCU_CASE " + json.dumps({"geometry": case.geometry.to_dict(), "tiles_per_group": tiles,
                                    "warps_per_cta": 16, "variants": list(VARIANTS)}), flush=True)


def _number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(raw_csv, case_line):
    from qsa_lab.routes.compiled import BARRIERS_PER_TILE

    case = json.loads(case_line.split("NCU_CASE ", 1)[1])
    tiles = case["tiles_per_group"]
    longest, groups, warps = max(tiles), len(tiles), case["warps_per_cta"]
    metrics = {}
    with open(raw_csv, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next(i for i, r in enumerate(rows) if "Metric Name" in r)
    cols = rows[header]
    k_name, m_name, m_val = cols.index("Kernel Name"), cols.index("Metric Name"), cols.index("Metric Value")
    m_unit = cols.index("Metric Unit")
    to_us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6,
             "s": 1e6}
    for r in rows[header + 1:]:
        found = re.search(r"grouped_page4_forward<\s*\d+\s*,\s*(\d+)\s*>", r[k_name]) if len(r) > m_val else None
        if not found:
            continue
        value = _number(r[m_val])
        if r[m_name] == "gpu__time_duration.sum" and value is not None:
            value *= to_us.get(r[m_unit], float("nan"))  # -> microseconds
        metrics.setdefault(KERNEL_ID.get(found.group(1), found.group(1)), {})[r[m_name]] = value
    lines = [f"case: {json.dumps(case['geometry'])}",
             f"groups {groups}, tiles per group {tiles} (a launch lasts as long as its longest group: {longest})",
             "",
             f"{'variant':<14}{'barriers':>9}{'us':>9}{'cycles/tile':>13}{'inst/warp/tile':>16}{'regs':>6}  "
             + "  ".join(f"{s[:10]:>10}" for s in STALLS)]
    for variant, m in metrics.items():
        cyc = m.get("sm__cycles_elapsed.max") or 0
        inst = m.get("smsp__inst_executed.sum") or 0
        dur_us = m.get("gpu__time_duration.sum") or float("nan")
        stalls = "  ".join(f"{m.get(f'smsp__warp_issue_stalled_{s}_per_warp_active.pct', float('nan')):>10.1f}"
                           for s in STALLS)
        lines.append(f"{variant:<14}{BARRIERS_PER_TILE.get(variant, 0):>9}{dur_us:>9.1f}{cyc / longest:>13.0f}"
                     f"{inst / (groups * warps) / (sum(tiles) / groups):>16.0f}"
                     f"{m.get('launch__registers_per_thread', 0):>6.0f}  {stalls}")
    lines += ["", "stall columns: % of active warp-cycles stalled for that reason (smsp__warp_issue_stalled_"
              "<reason>_per_warp_active.pct); cycles/tile = sm__cycles_elapsed.max / tiles of the longest group;",
              "inst/warp/tile = smsp__inst_executed.sum / (groups x 16 warps) / mean tiles per group."]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summarize", metavar="RAW_CSV", help="ncu --csv output to turn into the per-tile table")
    ap.add_argument("--case-log", metavar="LOG", help="the launch run's output (holds the NCU_CASE line)")
    a = ap.parse_args()
    if a.summarize:
        text = open(a.case_log).read() if a.case_log else sys.stdin.read()
        line = next(ln for ln in text.splitlines() if "NCU_CASE " in ln)
        print(summarize(a.summarize, line))
    else:
        launch()
