"""Where a grouped kernel's time goes, phase by phase: ncu's per-instruction (SASS) counters,
summed between the kernel's barriers.

    ncu --section SourceCounters --section WarpStateStats -o REPORT ... python benchmarks/ncu_variants.py
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv
    python benchmarks/ncu_phases.py SOURCE.csv VARIANT

The SASS is cut at every BAR.SYNC; each piece is named by the barrier that ends it (the
per-tile order of csrc/grouped_page4.cuh). Warp-stall samples are taken at a fixed
interval on every warp, so a phase's share of samples is its share of warp time.
"""
import csv
import re
import sys

PHASES = {  # per-tile pieces, in kernel order, named by what runs before each barrier
    "unfixed": ["setup: Q, element map", "setup: M-tile bits", "K panel (B1)", "QK (B2)", "softmax (B3)",
                "rescale + V panel (B4)", "P@V (B5)", "epilogue: row sums", "output"],
    "kernel_fix": ["setup: Q, element map", "setup: M-tile bits", "K panel (B1)", "fix A: zero K rows (A1)",
                   "QK (B2)", "softmax (B3)", "rescale + V panel (A2)", "fix A: zero V rows (B4)", "P@V (B5)",
                   "epilogue: row sums", "output"],
}
PHASES["masked_load"] = PHASES["early_v"] = PHASES["unfixed"]


def _num(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def phases(path, variant):
    rows = [r for r in csv.reader(open(path, newline="")) if r]
    h = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
    cols = [c.strip() for c in rows[h]]
    src = cols.index("Source")
    samples = next(i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All"))
    executed = cols.index("Instructions Executed") if "Instructions Executed" in cols else None
    names = PHASES.get(variant, [])
    out, cur, k = [], [0.0, 0.0], 0
    for r in rows[h + 1:]:
        if len(r) != len(cols):
            continue
        cur[0] += _num(r[samples])
        cur[1] += _num(r[executed]) if executed is not None else 0.0
        if re.search(r"\bBAR\.SYNC\b", r[src]):
            out.append((names[k] if k < len(names) else f"piece {k}", *cur))
            cur, k = [0.0, 0.0], k + 1
    out.append((names[k] if k < len(names) else "output", *cur))
    total = sum(s for _, s, _ in out) or 1.0
    lines = [f"{variant}: share of warp-stall samples (= share of warp time) and warp instructions executed",
             f"  {'phase (ends at barrier)':<32}{'samples %':>10}{'warp inst':>12}"]
    lines += [f"  {n:<32}{100 * s / total:>10.1f}{e:>12.0f}" for n, s, e in out]
    return "\n".join(lines)


if __name__ == "__main__":
    print(phases(sys.argv[1], sys.argv[2]))
