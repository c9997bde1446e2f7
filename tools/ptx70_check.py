"""Prove the sm_70 build runs: execute the compute_70 PTX of csrc/ on a newer GPU.

Step 1, on any machine with the NVRTC wheels (no GPU):

    python tools/ptx70_check.py generate --out build/ptx70

compiles every grouped and XQA entry point for compute_70 (as the CI check does) into
build/ptx70/ (the PTX + manifest.json: csrc hashes, NVRTC version, lowered names,
parameter sizes).

Step 2, on the GPU machine, in a checkout with the same csrc/ (else it refuses):

    python tools/ptx70_check.py check --ptx build/ptx70 --log evidence/ptx70_h200.log

JIT-loads that PTX through the CUDA driver, launches every entry point as the binding
does, on every GPU test case (every variant, kv dtype, poison site, several q_heads /
head_dim / page_size), and compares each output with the sm_90 extension and with the
emulation: NaN masks bitwise, values within the GPU tests' tolerance. Then it breaks
the PTX on purpose (ptx70.MUTATIONS) and runs the same comparison, which must fail.
One log line per entry point x case, then a summary. Exit 0: everything agreed and
every mutation was caught; 1: something disagreed; 2: bad arguments or stale PTX.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import ptx70   # beside this file (tools/ is sys.path[0] when run as a script)

# The GPU tests' shapes plus head_dim 48 (an odd number of 16-wide k-steps in Q K^T).
SHAPES = ((1, 16, 4), (3, 64, 8), (5, 128, 16), (8, 256, 32), (2, 48, 16))
# Variants the emulation has no twin of, and the one whose result each must equal:
# fix A without its leading barrier is a race for compute-sanitizer to see, not another
# result; early_v is the unfixed kernel with V's bytes read earlier.
EMULATION_TWIN = {"kernel_fix_no_leading_barrier": "kernel_fix", "early_v": "unfixed"}
# Fix A without its leading barrier races on purpose (the racecheck demo): another thread's
# panel store can land after the zeroing and bring an unattended row's NaN back, on one
# run and not the next, in the sm_90 build as in this one (seen on the H200). Its output is
# bounded, not fixed: NaN wherever fix A has NaN, perhaps also where the unfixed kernel has
# NaN, nowhere else; fix A's values everywhere else.
RACY = {"kernel_fix_no_leading_barrier": ("kernel_fix", "unfixed")}
DEVICE = "cuda"


def gpu_tests():
    """tests/gpu/test_kernels_cuda.py: its tolerances, case geometry and comparison."""
    path = ptx70.ROOT / "tests" / "gpu" / "test_kernels_cuda.py"
    spec = importlib.util.spec_from_file_location("qsa_lab_gpu_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case_specs(t, quick: bool):
    """(label, case_for kwargs): every kv dtype x poison site (V plane), a K-plane case, shapes."""
    from qsa_lab.model.poison import SITES

    sites = ("none", "targeted", "stale-tail") if quick else SITES
    shapes = SHAPES[::2] if quick else SHAPES
    for kv in t.KV_DTYPES:
        for site in sites:
            yield f"{kv} {site} v", dict(kv_dtype=kv, site=site)
        yield f"{kv} random k", dict(kv_dtype=kv, site="random", plane="k")
        for hq, d, ps in shapes:
            yield f"{kv} random v Hq{hq} D{d} ps{ps}", dict(kv_dtype=kv, site="random", q_heads=hq, head_dim=d,
                                                               page_size=ps)


class Log:
    def __init__(self, path: Path | None):
        self.file = open(path, "w") if path else None

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def compare_racy(t, got, fixed, unfixed, what: str) -> str | None:
    """None when `got` lies within the race's bounds (RACY): NaN of `fixed` <= NaN of `got`
    <= NaN of `unfixed`, and `fixed`'s values (GPU tests' tolerance) wherever `got` is finite."""
    import torch

    nan = torch.isnan(got)
    if (torch.isnan(fixed) & ~nan).any():
        return f"{what}: finite where fix A has NaN"
    outside = int((nan & ~torch.isnan(unfixed)).sum())
    if outside:
        return f"{what}: {outside} NaN where even the unfixed kernel has none"
    return compare(t, got[~nan], fixed[~nan], what)


def compare(t, got, want, what: str) -> str | None:
    """None when `got` matches `want` as the GPU tests require, else why not."""
    try:
        t.assert_close_to(got, want, t.ATOL, t.RTOL, what)
    except AssertionError as e:
        return str(e)
    return None


class Prepared:
    """One case on the GPU with its plan, and the sm_90 and emulation results (cached:
    the broken-PTX runs compare against the same ones)."""

    def __init__(self, t, spec: dict):
        import torch

        from qsa_lab.model.plan import plan_groups, xqa_tokens

        kw = dict(spec)
        self.case = t.case_for(kw.pop("kv_dtype"), kw.pop("site"), **kw)
        self.gpu = self.case.to(DEVICE)
        self.plan = plan_groups(self.gpu)
        self.plan_cpu = self.plan.to("cpu")
        self.rows = torch.arange(self.case.geometry.rows, device=DEVICE)
        self.xqa_tokens = xqa_tokens(self.gpu, self.rows)
        self.cache = {}

    def grouped_args(self, on_gpu: bool):
        c, p = (self.gpu, self.plan) if on_gpu else (self.case, self.plan_cpu)
        return (c.q, c.kv_cache, c.k_scale, c.v_scale, p.members, p.microblocks, p.masks, p.seq_len)

    def xqa_args(self, on_gpu: bool):
        c = self.gpu if on_gpu else self.case
        rows, (ti, tc) = self.rows, self.xqa_tokens
        if not on_gpu:
            rows, ti, tc = rows.cpu(), ti.cpu(), tc.cpu()
        return (c.q[rows].contiguous(), c.kv_cache, c.k_scale, c.v_scale, ti, tc)

    def run(self, impl, key, on_gpu: bool):
        """Output of entry `key` = (kind, fmt, variant) through `impl` (ptx70.Ptx70,
        qsa_lab.routes.compiled or qsa_lab.routes.emulate)."""
        kind, fmt, variant = key
        kw = dict(kv_dtype=fmt, sm_scale=self.case.sm_scale)
        if kind == "grouped":
            return impl.grouped_forward(*self.grouped_args(on_gpu), variant=variant, **kw)
        return impl.xqa_forward(*self.xqa_args(on_gpu), **kw)

    def references(self, key):
        """(sm_90 extension output, emulation output, emulation variant used, emulation of
        the race's upper bound or None) for `key`."""
        if key not in self.cache:
            from qsa_lab.routes import compiled as kernels
            from qsa_lab.routes import emulate

            kind, fmt, variant = key
            twin = variant if variant in emulate.VARIANTS or kind != "grouped" else EMULATION_TWIN.get(variant)
            ext = self.run(kernels, key, on_gpu=True)  # first: its binding checks every input
            emu = self.run(emulate, (kind, fmt, twin), on_gpu=False) if twin or kind != "grouped" else None
            bound = self.run(emulate, (kind, fmt, RACY[variant][1]), on_gpu=False) if variant in RACY else None
            self.cache[key] = (ext, emu, twin, bound)
        return self.cache[key]


def check_entry(t, prep: Prepared, impl, key, label: str, what: str) -> tuple[bool, str]:
    """Run entry `key` of `impl` on `prep`; (agreed with both, the log line)."""
    import torch

    try:
        ext, emu, twin, bound = prep.references(key)
    except (RuntimeError, ValueError) as e:
        return False, f"FAIL {label:<58} | {what:<28} | sm_90 extension or emulation: {e}"
    try:
        out = prep.run(impl, key, on_gpu=True)
    except RuntimeError as e:  # a launch or kernel error is a failure of this entry, not of the run
        return False, f"FAIL {label:<58} | {what:<28} | launch: {e}"
    problems = []
    if bound is None:
        why = compare(t, out, ext, "vs sm_90")
    else:  # both builds race: compare where neither brought a NaN back
        both = ~torch.isnan(out) & ~torch.isnan(ext)
        why = compare(t, out[both], ext[both], "vs sm_90 (where both finite)")
    problems += [why] if why else []
    if emu is None:
        problems.append(f"vs emulation: it has no twin of variant {key[2]!r}")
    elif bound is None:
        why = compare(t, out.cpu(), emu, "vs emulation")
        problems += [why] if why else []
    else:
        why = compare_racy(t, out.cpu(), emu, bound, "vs emulation")
        problems += [why] if why else []
    bitwise = torch.equal(out.view(torch.int16), ext.view(torch.int16))
    note = "" if twin in (None, key[2]) else f" (emulation: {twin})"
    if bound is not None:
        note += f"; a race: NaN within {RACY[key[2]][1]}'s (sm_90 run: {int(torch.isnan(ext).sum())} NaN)"
    status = "PASS" if not problems else "FAIL"
    detail = "; ".join(problems) if problems else (
        f"sm_90 {'bitwise' if bitwise else 'within tol'}, emulation within tol{note}")
    return not problems, f"{status} {label:<58} | {what:<28} | NaN {int(torch.isnan(out).sum()):>5} | {detail}"


def cmd_generate(a) -> int:
    m = ptx70.generate(a.out, Path(a.root), force=a.force)
    print(f"wrote {Path(a.out) / ptx70.PTX_FILE} ({m['ptx']['bytes']} bytes, sha256 {m['ptx']['sha256'][:16]}) "
          f"and {ptx70.MANIFEST_FILE}: NVRTC {m['nvrtc_version']}, {m['arch']}")
    for e in m["entry_points"]:
        size = f"param .align {e['align']} [{e['size']}]" if e["size"] else f"{e['count']} scalar params"
        print(f"  {e['label']:<58} {e['lowered']:<64} {size}")
    return 0


def cmd_check(a) -> int:
    import torch

    from qsa_lab.routes import compiled as kernels

    t = gpu_tests()
    start = time.perf_counter()
    ptx = ptx70.Ptx70(a.ptx)  # refuses a stale folder before anything is written
    m = ptx.manifest
    log = Log(a.log)
    log(f"# compute_70 PTX on {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
        f", torch {torch.__version__} CUDA {torch.version.cuda}")
    log(f"# PTX {m['ptx']['sha256'][:16]} from NVRTC {m['nvrtc_version']} ({m['arch']}); csrc matches the manifest: "
        + ", ".join(f"{n} {h[:12]}" for n, h in m["csrc"].items()))
    log(f"# JIT-loaded in {time.perf_counter() - start:.1f} s; tolerance |ptx - other| <= {t.ATOL} + {t.RTOL}|other|"
        " (tests/gpu/test_kernels_cuda.py), NaN masks equal")
    bad = ptx.check_smem_replicas()
    if bad:
        log("REFUSED: the shared-memory replicas differ from the headers:\n  " + "\n  ".join(bad[:10]))
        return 2
    log("# shared memory: replicas equal the headers' smem_layout / xqa_smem_bytes for q_heads 1..8 x head_dim 16..256")

    failures, loaded = 0, {}
    worst = {"grouped": max(ptx.smem["grouped"].values()), "xqa_partition": max(ptx.smem["xqa"].values())}
    for key, e in ptx.entries.items():
        info = ptx.function_info(key)
        loaded[key] = 0
        # compute_70 PTX, JIT-compiled here; and the largest dynamic + static shared memory
        # the binding would ask for fits what a V100 can opt in to.
        need = worst.get(key[0], 0) + info["static_smem"]
        ok = info["ptx_version"] == 70 and need <= ptx70.V100_MAX_SMEM_OPTIN
        failures += not ok
        log(f"{'LOAD' if ok else 'FAIL'} {e['label']:<58} | PTX {info['ptx_version']} -> SASS "
            f"sm_{info['binary_version']} | {info['registers']} regs, {info['local_bytes']} B local | smem up to "
            f"{need} B (V100 opt-in {ptx70.V100_MAX_SMEM_OPTIN})")
    t0 = time.perf_counter()
    kernels.load()
    log(f"# sm_90 extension ready in {time.perf_counter() - t0:.1f} s")

    specs = list(case_specs(t, a.quick))
    prepared, lines = [], 0
    for i, (what, spec) in enumerate(specs, 1):
        prep = Prepared(t, spec)
        prepared.append((what, prep))
        g = prep.case.geometry
        for key, e in ptx.entries.items():
            if key[0] in ("probe", "xqa_reduce") or key[1] != g.kv_dtype:
                continue  # the reduce runs inside every XQA line
            reduce = ("xqa_reduce", key[1], None) if ("xqa_reduce", key[1], None) in ptx.entries else \
                ("xqa_reduce", None, None)
            label = e["label"] + (f" + {ptx.entries[reduce]['label']}" if key[0] == "xqa_partition" else "")
            ok, line = check_entry(t, prep, ptx, key, label, what)
            failures += not ok
            loaded[key] += 1
            if key[0] == "xqa_partition":
                loaded[reduce] += 1
            lines += 1
            log(line)
        print(f"# case {i}/{len(specs)} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    unexercised = [ptx.entries[k]["label"] for k, n in loaded.items() if n == 0 and k[0] != "probe"]
    failures += len(unexercised)

    log("# broken PTX: the same comparison must fail")
    caught = []
    for mu in ptx70.MUTATIONS:
        key = ("grouped", ptx70.format_key(mu.fmt), ptx70.variant_key(mu.variant))
        broken, n = ptx70.mutate(ptx.ptx, ptx.entries[key]["lowered"], mu.old, mu.new)
        bad_ptx = ptx70.Ptx70(a.ptx, driver=ptx.driver, only=key, ptx=broken)
        fails = 0
        runs = [(what, prep) for what, prep in prepared if prep.case.geometry.kv_dtype == key[1]]
        for what, prep in runs:
            ok, line = check_entry(t, prep, bad_ptx, key, f"BROKEN[{mu.name}] {ptx.entries[key]['label']}", what)
            fails += not ok
            log(line)
        caught.append(fails > 0)
        log(f"{'CAUGHT' if fails else 'MISSED'} mutation {mu.name} ({mu.old:#010x} -> {mu.new:#010x} at {n} sites "
            f"of {ptx.entries[key]['label']}: {mu.why}): {fails} of {len(runs)} cases disagree")

    n_entries = sum(1 for k in ptx.entries if k[0] != "probe")
    log(f"# summary: {n_entries} entry points loaded from {m['arch']} PTX; {len(specs)} cases, {lines} entry x case "
        f"comparisons, {failures} failure(s)" + (f"; never exercised: {unexercised}" if unexercised else "")
        + f"; broken PTX caught {sum(caught)} of {len(caught)}; {time.perf_counter() - start:.0f} s")
    ok = failures == 0 and all(caught)
    log("# RESULT: " + ("PASS" if ok else "FAIL"))
    ptx.driver.unload()
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ptx70_check", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="NVRTC: write the compute_70 PTX + manifest (no GPU needed)")
    g.add_argument("--out", required=True, help="folder for the PTX and manifest.json")
    g.add_argument("--root", default=str(ptx70.ROOT), help="checkout whose csrc/ to compile (default: this one)")
    g.add_argument("--force", action="store_true", help="replace a PTX / manifest already in --out")
    c = sub.add_parser("check", help="GPU: run the PTX and compare with the sm_90 build and the emulation")
    c.add_argument("--ptx", required=True, help="folder written by the generate step")
    c.add_argument("--log", default=None, help="also write the log here")
    c.add_argument("--quick", action="store_true", help="3 poison sites and 3 shapes per kv dtype")
    c.add_argument("--force", action="store_true", help="replace an existing --log")
    a = ap.parse_args(argv)
    if a.cmd == "generate":
        if not (Path(a.root) / "csrc").is_dir():
            ap.error(f"--root: {a.root} holds no csrc/")
        try:
            return cmd_generate(a)
        except FileExistsError as e:
            ap.error(f"--out: {e}")
        except ptx70.StaleError as e:
            print(f"ptx70_check: error: {e}", file=sys.stderr)
            return 2
    if a.log and Path(a.log).exists() and not a.force:
        ap.error(f"--log: {a.log} exists (pass --force to replace it)")
    if not (Path(a.ptx) / ptx70.MANIFEST_FILE).is_file():
        ap.error(f"--ptx: {a.ptx} holds no {ptx70.MANIFEST_FILE} (run the generate step first)")
    import torch

    if not torch.cuda.is_available():
        print("ptx70_check: error: check: no CUDA GPU visible (the generate step is the part that runs without one)",
              file=sys.stderr)
        return 2
    try:
        return cmd_check(a)
    except ptx70.StaleError as e:
        print(f"ptx70_check: error: --ptx: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
