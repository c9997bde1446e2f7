"""How far the bit-identity cases move between the CPU paths one machine can be forced onto: the
measurement behind the ulp bounds of tests/test_bit_identity.py.

    .venv/bin/python tests/data/measure_bitid_paths.py --out evidence/bitid_cpu_paths.json

runs every case of tests/bitid_cases.py once per path (PATHS: ATen's CPU capability, MKL's
instruction set and its conditional-numerical-reproducibility modes, torch's thread count), each
in a process of its own, and compares it with the records under tests/data/: per class of values
(route outputs, grouped log-sum-exp, float64 reference, canary outputs) the largest difference in
ulps (bitid_cases.ulps: of the vector's largest value; and of each value's own) and how many values
differ, and every exact part (hashes, plans, verdicts, counts) that differs. A case whose inputs
(kv cache, q, scales) differ is another case: its values are listed, not compared. It also records the smallest margin of the indexer's top-k (how far the last selected
block's score lies above the first unselected one's, in float32 ulps), the quantity that decides
whether a selection could flip with the order of the score's sums (indexer_margins). `--path NAME` runs one path
here and prints its JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

#: name -> (environment, torch threads)
PATHS = {
    "as-is": ({}, None),
    "threads-1": ({}, 1),
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, None),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, None),
    "aten-avx512": ({"ATEN_CPU_CAPABILITY": "avx512"}, None),
    "mkl-avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, None),
    "mkl-sse4_2": ({"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, None),
    "mkl-cbwr-compatible": ({"MKL_CBWR": "COMPATIBLE"}, None),
    "mkl-cbwr-avx2": ({"MKL_CBWR": "AVX2"}, None),
    "mkl-cbwr-avx512": ({"MKL_CBWR": "AVX512"}, None),
    "onednn-avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, None),
    # an AVX2-only machine as far as one process can pretend: ATen and MKL both on AVX2
    "avx2-everywhere": ({"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                         "ONEDNN_MAX_CPU_ISA": "AVX2"}, 2),
    "avx2-everywhere-threads-1": ({"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                   "ONEDNN_MAX_CPU_ISA": "AVX2"}, 1),
    "scalar-everywhere-threads-1": ({"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}, 1),
}
CLASSES = ("outputs", "lse", "reference64", "canary")


def value_class(record_kind: str, value: str) -> str:
    if record_kind == "canary":
        return "canary"
    return "lse" if value.startswith("lse/") else "reference64" if value == "reference64" else "outputs"


def mkl_path() -> dict:
    """MKL's own words for the instruction set and reproducibility mode it runs with."""
    import torch

    r, w = os.pipe()
    saved = os.dup(1)
    os.dup2(w, 1)
    try:
        with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
            torch.ones(8, 8) @ torch.ones(8, 8)
    finally:
        os.dup2(saved, 1)
        os.close(w)
    text = os.read(r, 65536).decode(errors="replace")
    os.close(r)
    isa = next((part.strip() for part in text.split(",") if "architecture" in part), "")
    cnr = next((tok for tok in text.split() if tok.startswith("CNR:")), "")
    return {"isa": isa.split("architecture", 1)[-1].strip(), "cnr": cnr}


def run_path(name: str) -> dict:
    """Every case here, compared with the records."""
    import torch

    from bitid_cases import INPUTS, Baseline, draws, record, value_stats

    env, threads = PATHS[name]
    if threads:
        torch.set_num_threads(threads)
    started = time.time()
    classes = {c: {"max_ulps": 0.0, "max_own_ulps": 0.0, "differ": 0, "values": 0, "mask_differs": 0,
                   "worst": ""} for c in CLASSES}
    exact_differs, inputs_differ = [], []
    for kind in ("report", "small", "canary"):
        base = Baseline(HERE / f"bitid_{kind}.npz")
        for rec in base.names():
            exact, values = record(kind, rec, base.meta.get("specs"))
            want = base.exact(rec)
            if exact != want:
                exact_differs.append(f"{kind}/{rec}: {[k for k in exact if exact[k] != want.get(k)]}")
            if any(exact[k] != want[k] for k in INPUTS):
                inputs_differ.append(f"{kind}/{rec}")     # another case: its values are not compared
                continue
            recorded = base.values(rec)
            for v, got in values.items():
                s = value_stats(got, recorded[v])
                c = classes[value_class(kind, v)]
                c["values"] += s["values"]
                c["differ"] += s["differ"]
                c["mask_differs"] += not (s["nan"] and s["inf"])
                c["max_own_ulps"] = max(c["max_own_ulps"], s["max_own_ulps"])
                if s["max_ulps"] > c["max_ulps"]:
                    c["max_ulps"], c["worst"] = s["max_ulps"], f"{kind}/{rec}/{v}"
    return {"path": name, "env": env, "threads": torch.get_num_threads(),
            "aten": torch.backends.cpu.get_cpu_capability(), "mkl": mkl_path(), "classes": classes,
            "draws": draws(), "exact_differs": exact_differs, "inputs_differ": inputs_differ,
            "indexer": indexer_margins(),
            "seconds": round(time.time() - started, 1)}


def indexer_margins() -> dict:
    """Could a selection flip with the order of the indexer's float32 sums? A block's score is
    sum over 4 heads of ReLU(q . k) / sqrt(128), each dot a float32 sum of 128 products; summed in
    any order it lies within about 131 u M of its exact value (u = 2**-24, M = sum over heads and dims
    of |q_i k_i| / sqrt(128); 127 for a 128-term dot, 4 for the sum over heads). Over every case that
    uses the indexer, in units of u M:
    - error: the largest |score here - exact score| (the float64 sum of the same float32 inputs);
    - margin: for each row whose selection is cut (more visible blocks than topk), score of the
      last selected block minus that of the first unselected one (over u (M_last + M_first)): a
      selection flips only where the two errors add up to more than this; the smallest;
    - zero_ties: cuts that fall between two scores of exactly 0 (every dot of both blocks <= 0, the
      ReLU's zero; the stable sort breaks the tie by block id); zero_margin: for those rows, how far
      below 0 the largest dot of any zero-scored block lies (over u times that dot's sum of |q_i k_i|):
      a dot that crossed 0 would lift its block above the tie."""
    import torch

    from qsa_lab.model import selection as S
    from qsa_lab.model.case import build_case
    from qsa_lab.report.repro import REPRO_CASES
    from bitid_cases import small_specs, make_case

    u, root = 2.0 ** -24, float(np.sqrt(S.INDEXER_DIM))
    seen = {"rows_cut": 0, "error": 0.0, "margin": float("inf"), "where": "", "zero_ties": 0,
            "zero_margin": float("inf")}
    scores_of, top_blocks = S.indexer_scores, S.top_blocks
    last = {}

    def scores(q, keys):
        s = scores_of(q, keys)
        dots, mags = q.double() @ keys.double().T, q.double().abs() @ keys.double().abs().T   # [n, heads, blocks]
        exact, m = torch.relu(dots).sum(dim=-2) / root, mags.sum(dim=-2) / root
        seen["error"] = max(seen["error"], float(((s.double() - exact).abs() / (u * m)).max()))
        last.update(dots=dots, mags=mags, m=m)
        return s

    def watch(s, complete, topk):
        visible = torch.arange(s.shape[1]) < complete.unsqueeze(1)
        order = torch.sort(torch.where(visible, s, -torch.inf), dim=1, descending=True, stable=True).indices
        for r, n in enumerate(complete.tolist()):
            if n <= topk:
                continue
            a, b = int(order[r, topk - 1]), int(order[r, topk])
            seen["rows_cut"] += 1
            if float(s[r, a]) == float(s[r, b]) == 0.0:
                seen["zero_ties"] += 1
                zero = visible[r] & (s[r] == 0)
                below = (-last["dots"][r][:, zero] / (u * last["mags"][r][:, zero])).min()
                seen["zero_margin"] = min(seen["zero_margin"], float(below))
                continue
            margin = (float(s[r, a]) - float(s[r, b])) / (u * float(last["m"][r, a] + last["m"][r, b]))
            if margin < seen["margin"]:
                seen["margin"], seen["where"] = margin, where[0]
        return top_blocks(s, complete, topk)

    where = [""]
    specs = small_specs()
    S.indexer_scores, S.top_blocks = scores, watch
    try:
        for g in dict.fromkeys(rc.geometry for rc in REPRO_CASES):
            where[0] = f"report geometry {g}"
            build_case(g)
        for i, spec in enumerate(specs):
            where[0] = f"small/{i}"
            make_case(spec)
    finally:
        S.indexer_scores, S.top_blocks = scores_of, top_blocks
    return seen


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=PATHS, help="run one path in this process, print its JSON")
    ap.add_argument("--out", type=Path, help="write every path's JSON here")
    args = ap.parse_args(argv)
    if args.path:
        print(json.dumps(run_path(args.path)))
        return
    if args.out is None:
        ap.error("--out: required without --path")
    if args.out.exists():
        ap.error(f"--out: {args.out} exists; remove it first")
    runs = []
    for name, (env, _) in PATHS.items():
        load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, __file__, "--path", name], env={**os.environ, **env},
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"path {name} failed:\n{out.stderr[-3000:]}")
        runs.append({**json.loads(out.stdout.splitlines()[-1]), "load_before": round(load, 2),
                     "load_after": round(os.getloadavg()[0], 2)})
        print(name, json.dumps({c: (v["max_ulps"], v["max_own_ulps"], v["differ"], v["values"])
                                for c, v in runs[-1]["classes"].items()}),
              f"{len(runs[-1]['exact_differs'])} exact parts differ, e.g.", runs[-1]["exact_differs"][:2],
              f"inputs differ: {len(runs[-1]['inputs_differ'])}", flush=True)
    from bitid_cases import Baseline, machine

    worst = {c: max(r["classes"][c]["max_ulps"] for r in runs) for c in CLASSES}
    records = {k: v for k, v in Baseline(HERE / "bitid_report.npz").meta.items() if k != "records"}
    doc = {"what": __doc__.split("\n\n")[0], "machine": {**machine(), "cores": os.cpu_count()},
           "records": records, "worst_ulps": worst, "runs": runs}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("worst ulps:", worst)


if __name__ == "__main__":
    main()
