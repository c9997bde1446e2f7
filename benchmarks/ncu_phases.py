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
    "kernel_fix": ["setup: Q, element map", "setup: M-tile bits", "K panel (B1)", "kernel_fix: zero K rows (A1)",
                   "QK (B2)", "softmax (B3)", "rescale + V panel (A2)", "kernel_fix: zero V rows (B4)", "P@V (B5)",
                   "epilogue: row sums", "output"],
}
PHASES["masked_load"] = PHASES["early_v"] = PHASES["unfixed"]


def _num(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def _reason_columns(cols):
    """Per-stall-reason sample columns of the source page (names differ between ncu versions:
    any column naming a stall, other than the all / not-issued totals)."""
    return [i for i, c in enumerate(cols) if re.search(r"stall", c, re.I) and not re.search(r"All Samples|Not-issued", c)]


def phases(path, variant):
    rows = [r for r in csv.reader(open(path, newline="")) if r]
    h = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
    cols = [c.strip() for c in rows[h]]
    src = cols.index("Source")
    samples = next(i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All"))
    executed = cols.index("Instructions Executed") if "Instructions Executed" in cols else None
    reasons = _reason_columns(cols)
    names = PHASES.get(variant, [])
    out, k = [], 0
    cur = [0.0, 0.0, [0.0] * len(reasons)]
    for r in rows[h + 1:]:
        if len(r) != len(cols):
            continue
        cur[0] += _num(r[samples])
        cur[1] += _num(r[executed]) if executed is not None else 0.0
        for j, c in enumerate(reasons):
            cur[2][j] += _num(r[c])
        if re.search(r"\bBAR\.SYNC\b", r[src]):
            out.append((names[k] if k < len(names) else f"piece {k}", *cur))
            cur, k = [0.0, 0.0, [0.0] * len(reasons)], k + 1
    out.append((names[k] if k < len(names) else "output", *cur))
    total = sum(s for _, s, _, _ in out) or 1.0
    lines = [f"{variant}: share of warp-stall samples (= share of warp time) and warp instructions executed"
             + (", with each phase's three largest stall reasons (% of its samples)" if reasons else ""),
             f"  {'phase (ends at barrier)':<32}{'samples %':>10}{'warp inst':>12}"]
    for n, s_, e, rs in out:
        by_reason = {}  # a reason may have an all-samples and a not-issued column: keep the larger
        for v, c in zip(rs, reasons):
            by_reason[_short(cols[c])] = max(v, by_reason.get(_short(cols[c]), 0.0))
        top = [t for t in sorted(((v, r) for r, v in by_reason.items()), reverse=True)[:3] if t[0] > 0] if s_ else []
        tops = "  " + ", ".join(f"{name} {100 * v / s_:.0f}" for v, name in top) if top else ""
        lines.append(f"  {n:<32}{100 * s_ / total:>10.1f}{e:>12.0f}{tops}")
    lines.append(f"  per-reason columns read: {', '.join(cols[c] for c in reasons)}" if reasons else
                 f"  (no per-reason sample columns on this ncu's source page; columns: {', '.join(cols)})")
    return "\n".join(lines)


def _short(name):
    """'Warp Stall Sampling ... (stall_long_sb)' or 'smsp__pcsamp_warps_issue_stalled_barrier' -> a short reason."""
    m = re.search(r"stall(?:ed)?_(\w+)", name)
    return m.group(1) if m else name


if __name__ == "__main__":
    print(phases(sys.argv[1], sys.argv[2]))
