"""Kernel-tuning rig: time copies of csrc/ side by side without building the extension.

    python benchmarks/tile_rig.py cases build/rig/cases              (any machine: the report's geometry)
    python benchmarks/tile_rig.py build CSRC_DIR build/rig/NAME      (a machine with nvcc: sm_90 binary)
    python benchmarks/tile_rig.py run build/rig/cases build/rig/A build/rig/B ...   (the GPU node)
    python benchmarks/tile_rig.py whatif build/rig/src       (copies of csrc/, each with one part left out)

`run` times unfixed, kernel_fix (A) and masked_load (C) of every binary on the same cases in one process each
(median of CUDA-event times, L2 flushed and warm; see tile_rig.cu) and checks that every
binary's output matches the first one's: same NaN positions, finite values within 2e-2.
It is for trying kernel changes quickly; the numbers that count come from `qsa-lab bench`.

`whatif` writes csrc/ as `base` plus copies that each leave one part of the tile out (their
outputs are wrong by design; `run` reports them as DIFFERS): timing them beside `base`
says what each part costs per tile.
"""
import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("unfixed", "kernel_fix", "masked_load")
# whatif: (copy name, text of csrc/grouped_page4.cuh, its replacement)
LEAVE_OUT = (
    ("no_global_reads", "    for (int s = 0; s < kSlots; ++s) cur_src[s] = next_src[s];",
     "    for (int s = 0; s < kSlots; ++s) cur_src[s] = nullptr;"),
    ("no_decode", "      decode_fp8_16B<FMT>(in, first, second);", "      first = in; second = in;"),
    ("no_qk", "      if (mt < m_tiles && ((active >> mt) & 1u)) {  // warp-uniform\n        // This warp's k-steps",
     "      if (false) {\n        // This warp's k-steps"),
    ("no_softmax", "    if (srow < m_tiles * kWmma) {  // warp-uniform", "    if (false) {"),
    ("no_rescale", "        if (!frag_ok(i) || !((active >> frag_mt(i)) & 1u) || flags[frag_mt(i)] == 0u) continue;",
     "        if (true) continue;"),
    ("no_pv", "    if (kShareV && kWarps % d_tiles == 0) {", "    if (true) {} else if (kShareV && kWarps % d_tiles == 0) {"),
)


def write_cases(out: Path, copies: int = 3) -> None:
    sys.path.insert(0, str(ROOT))
    from qsa_lab.model.case import Geometry, build_case
    from qsa_lab.routes.bench import REPORT
    from qsa_lab.model.plan import plan_groups

    for seed in range(copies):
        case = build_case(Geometry(**REPORT).replace(seed=seed))
        plan = plan_groups(case)
        d = out / f"case{seed}"
        d.mkdir(parents=True, exist_ok=True)
        g = case.geometry
        meta = (f"{g.rows} {g.q_heads} {g.head_dim} {plan.groups} {plan.microblocks.shape[1]} "
                f"{case.kv_cache.shape[2]} {case.kv_cache.shape[0]} 0 {case.sm_scale * case.k_scale!r} {case.v_scale!r}\n")
        (d / "meta.txt").write_text(meta)
        for name, t in (("q", case.q), ("kv", case.kv_cache), ("group_rows", plan.members.long()),
                        ("microblocks", plan.microblocks.int()), ("masks", plan.masks.int()), ("seq_len", plan.seq_len.int())):
            (d / f"{name}.bin").write_bytes(t.contiguous().numpy().tobytes())
        print(f"{d}: {plan.groups} groups, tiles {[int(s) // 32 for s in plan.seq_len]}")


def whatif(out: Path) -> None:
    import shutil

    src = ROOT / "csrc"
    text = (src / "grouped_page4.cuh").read_text()
    for name, old, new in (("base", None, None),) + LEAVE_OUT:
        d = out / name
        if d.exists():
            raise SystemExit(f"out: {d} exists (remove it first)")
        if old is not None and text.count(old) != 1:
            raise SystemExit(f"{name}: the text it replaces is not in csrc/grouped_page4.cuh once; update LEAVE_OUT")
        shutil.copytree(src, d)
        if old is not None:
            (d / "grouped_page4.cuh").write_text(text.replace(old, new))
        print(d)


def build(csrc: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-I", str(csrc), str(ROOT / "benchmarks" / "tile_rig.cu"),
           "-o", str(out)]
    subprocess.run(cmd, check=True)


def run(cases: Path, binaries, reps: int) -> int:
    import numpy as np

    outs, bad = {}, 0
    for b in binaries:
        od = Path(str(b) + ".out")
        od.mkdir(exist_ok=True)
        res = subprocess.run([str(b), str(cases), str(od), str(reps)], capture_output=True, text=True)
        print(f"== {b.name}\n{res.stdout}{res.stderr}", end="")
        if res.returncode:
            bad += 1
            continue
        outs[b.name] = {v: np.fromfile(od / f"out_{v}.bin", dtype=np.float16).astype(np.float32) for v in VARIANTS}
    ref_name = next(iter(outs), None)
    for name, o in outs.items():
        for v in VARIANTS:
            a, r = o[v], outs[ref_name][v]
            same_nan = bool((np.isnan(a) == np.isnan(r)).all())
            fin = ~np.isnan(a) & ~np.isnan(r)
            diff = float(np.abs(a[fin] - r[fin]).max()) if fin.any() else 0.0
            ok = same_nan and diff <= 2e-2
            bad += not ok
            print(f"check {name:>16} {v:<12} vs {ref_name}: NaN {int(np.isnan(a).sum()):>6} same positions {same_nan}, "
                  f"max |diff| {diff:.3g} {'ok' if ok else 'DIFFERS'}")
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cases")
    c.add_argument("out", type=Path)
    c.add_argument("--copies", type=int, default=3)
    b = sub.add_parser("build")
    b.add_argument("csrc", type=Path)
    b.add_argument("out", type=Path)
    r = sub.add_parser("run")
    r.add_argument("cases", type=Path)
    r.add_argument("binaries", type=Path, nargs="+")
    r.add_argument("--reps", type=int, default=50)
    w = sub.add_parser("whatif")
    w.add_argument("out", type=Path)
    a = ap.parse_args()
    if a.cmd == "cases":
        write_cases(a.out, a.copies)
    elif a.cmd == "build":
        build(a.csrc, a.out)
    elif a.cmd == "whatif":
        whatif(a.out)
    else:
        sys.exit(run(a.cases, a.binaries, a.reps))
