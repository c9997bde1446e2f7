"""The canary run: for each kernel x region x plane x payload, a zero-filled control run and a
poisoned run of the same call, compared bit for bit. (The control, the region zero-filled on
that plane, is the same pool for every payload, so it runs once per kernel x region x plane.)

Verdicts: `nan-leak` (an output went NaN), `inf-leak` (an output went +-Inf), `finite-leak`
(finite outputs whose bits changed: the kernel gave unattended bytes weight) or `clean`.
"""
from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..poison import PAYLOADS, payload_bits
from ..regions import REGIONS, region_sizes, region_slots, regions_of
from ..regions import check_region as _check_region
from .case import CANARY_GEOMETRY, FREE_PAGES, CanaryCase, as_canary_case, canary_case
from .kernels import KernelSkipped, PagedCall, builtin_kernels, kernel_name, resolve_kernel

SCHEMA = "qsa_lab.canary/1"
PLANES = {"k": 0, "v": 1}
DEFAULT_PAYLOADS = ("nan", "inf", "max")
VERDICTS = ("clean", "nan-leak", "inf-leak", "finite-leak")
LEAKS = VERDICTS[1:]

@dataclass
class LeakResult:
    """One kernel x region x plane x payload. leak: [rows, q_heads, head_dim] bool, the outputs
    whose bits changed; output: the poisoned run's output as float32 (CPU)."""
    kernel: str
    region: str
    plane: str
    payload: str
    verdict: str
    nan: int
    inf: int
    finite_changed: int
    leak: torch.Tensor = field(repr=False)
    output: torch.Tensor = field(repr=False)

    def where(self) -> dict:
        """The leaking outputs: sorted rows, heads, head dims."""
        idx = torch.nonzero(self.leak)
        return {k: sorted(set(idx[:, i].tolist())) for i, k in enumerate(("rows", "heads", "dims"))}

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "region": self.region, "plane": self.plane, "payload": self.payload,
                "verdict": self.verdict, "nan": self.nan, "inf": self.inf, "finite_changed": self.finite_changed,
                **self.where()}

    def describe(self) -> str:
        w = self.where()
        return (f"{self.kernel} {self.region}/{self.plane}/{self.payload}: {self.verdict} "
                f"({self.nan} NaN, {self.inf} Inf, {self.finite_changed} finite changed; "
                f"rows {w['rows']}, heads {w['heads']}, dims {w['dims']})")


@dataclass
class CanaryReport:
    backend: str               # what the qsa routes ran on: "cuda" | "emulate" (or None: could not run)
    device: str                # where the torch kernels ran
    case: CanaryCase
    kernels: list
    results: list
    skipped: list              # {"kernel"?, "region"?, "payload"?, "reason"}

    def leaks(self) -> list:
        return [r for r in self.results if r.verdict != "clean"]

    def to_json(self) -> dict:
        from ..export import gpu_name

        c = self.case
        return {"schema": SCHEMA, "backend": self.backend, "device": self.device, "gpu": gpu_name(),
                "torch": torch.__version__, "python": platform.python_version(), "qsa_lab_version": __version__,
                "kv_dtype": c.kv_dtype, "geometry": c.geometry_dict(), "pool_pages": int(c.kv_cache.shape[0]),
                "regions": region_sizes(self.case),
                "payload_bits": {p: f"0x{payload_bits(c.kv_dtype, p):X}" for p in PAYLOADS
                                 if p in _available_payloads(c.kv_dtype)},
                "kernels": list(self.kernels), "results": [r.to_dict() for r in self.results],
                "skipped": list(self.skipped)}

    def frame(self):
        """One row per result (pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame([r.to_dict() for r in self.results],
                            columns=["kernel", "region", "plane", "payload", "verdict", "nan", "inf",
                                     "finite_changed", "rows", "heads", "dims"])

    def find(self, kernel: str, region: str, plane: str, payload: str) -> LeakResult:
        for r in self.results:
            if (r.kernel, r.region, r.plane, r.payload) == (kernel, region, plane, payload):
                return r
        raise KeyError(f"no result for {kernel} {region}/{plane}/{payload}")


def _available_payloads(kv_dtype: str) -> tuple:
    out = []
    for p in PAYLOADS:
        try:
            payload_bits(kv_dtype, p)
            out.append(p)
        except ValueError:
            pass
    return tuple(out)


def _as_bits(x: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()])


def compare(control: torch.Tensor, poisoned: torch.Tensor) -> tuple[str, dict, torch.Tensor]:
    """-> (verdict, {"nan", "inf", "finite_changed"}, changed mask). Two NaNs count as equal
    whatever their payload bits; anything else must be bit-identical."""
    if control.shape != poisoned.shape or control.dtype != poisoned.dtype:
        raise ValueError(f"poisoned output {list(poisoned.shape)} {poisoned.dtype} does not match the control "
                         f"{list(control.shape)} {control.dtype}")
    if not control.is_floating_point():
        raise TypeError(f"kernel output must be a floating-point tensor, got {control.dtype}")
    both_nan = torch.isnan(control) & torch.isnan(poisoned)
    changed = (_as_bits(control) != _as_bits(poisoned)) & ~both_nan
    counts = {"nan": int((changed & torch.isnan(poisoned)).sum()),
              "inf": int((changed & torch.isinf(poisoned)).sum()),
              "finite_changed": int((changed & torch.isfinite(poisoned)).sum())}
    verdict = ("nan-leak" if counts["nan"] else "inf-leak" if counts["inf"] else
               "finite-leak" if counts["finite_changed"] else "clean")
    return verdict, counts, changed


def _choices(arg: str, given, allowed, default) -> tuple:
    if given is None:
        return tuple(default)
    if isinstance(given, str):
        given = [given]
    given = tuple(given)
    bad = [g for g in given if g not in allowed]
    if bad or not given:
        raise ValueError(f"{arg}: unknown {bad or 'empty list'}; choose from {tuple(allowed)}")
    return given


def resolve_devices(backend: str, geometry) -> tuple[torch.device, str | None, str | None]:
    """-> (device for torch kernels, qsa backend or None, why the qsa routes cannot run)."""
    from ..routes import BACKENDS, resolve_backend

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpu = torch.cuda.is_available()
    if backend == "cuda" and not gpu:
        raise ValueError("backend: 'cuda' needs a CUDA GPU and none is visible (use 'emulate' or 'auto')")
    device = torch.device("cuda" if backend == "cuda" or (backend == "auto" and gpu) else "cpu")
    try:
        return device, resolve_backend(backend, geometry), None
    except ValueError as e:  # the compiled kernels cannot run: the torch kernels still can
        return device, None, str(e).splitlines()[0]


def _run(fn, case: CanaryCase, device, memo: dict) -> torch.Tensor:
    out = fn(PagedCall.from_case(case, device, memo))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"returned {type(out).__name__}, expected a tensor [rows, q_heads, head_dim]")
    want = (case.rows, case.q_heads, case.out_dim)
    if tuple(out.shape) != want:
        raise ValueError(f"returned shape {list(out.shape)}, expected [rows, q_heads, head_dim] = {list(want)}")
    return out.detach().cpu()


def check_region_of(region: str, spec) -> None:
    try:
        _check_region(region, spec)
    except ValueError as e:
        raise ValueError(f"regions: {e}") from None


def _why(e: BaseException) -> str:
    if isinstance(e, KernelSkipped):
        return str(e)
    lines = str(e).strip().splitlines()
    return f"raised {type(e).__name__}: {lines[0] if lines else ''}"


def write_region(kv_cache: torch.Tensor, slots: torch.Tensor, plane: int, kv_dtype: str, payload: str, dims=None,
                 mla_v_dim: int | None = None) -> None:
    """Write `payload` as whole elements of the storage dtype into `slots` ([pages, page_size]
    bool) of one plane, every KV head, at every head dim or only `dims`, in place. MLA
    (`mla_v_dim`): both planes are the latent plane 0, "v" its first mla_v_dim dims."""
    bits = payload_bits(kv_dtype, payload)
    D = kv_cache.shape[-1]
    cols = torch.zeros(D, dtype=torch.bool)
    cols[list(range(D if mla_v_dim is None or plane == 0 else mla_v_dim)) if dims is None else list(dims)] = True
    if mla_v_dim is not None and plane == 1:
        cols[mla_v_dim:] = False
    target = 0 if mla_v_dim is not None else plane
    elems = kv_cache.view(torch.int16 if kv_dtype == "fp16" else torch.uint8)[:, target]    # [pages, ps, H, D]
    where = (slots.unsqueeze(-1) & cols).unsqueeze(2).expand(-1, -1, kv_cache.shape[3], -1)
    elems[where.to(kv_cache.device)] = bits - 0x10000 if bits >= 0x8000 and kv_dtype == "fp16" else bits


def _filled(case: CanaryCase, slots, plane: int, payload: str, dims) -> CanaryCase:
    out = case.clone()
    write_region(out.kv_cache, slots, plane, case.kv_format, payload, dims, case.v_head_dim if case.mla else None)
    return out


def run_canary(kernels=None, regions=None, payloads=None, planes=("k", "v"), backend: str = "auto",
               case=None, kv_dtype: str = "fp16", dims=None, progress: bool = False, attend=None) -> CanaryReport:
    """Run the canary matrix.

    kernels: names (`qsa:<route>`, `torch:...`, `module:function`, `file.py:function`) or
        callables fn(PagedCall) -> [rows, q_heads, head_dim]; default every built-in kernel.
    regions: of qsa_lab.regions.REGIONS (default all); payloads: of nan, inf, max, zero
        (default nan, inf, max); planes: "k", "v".
    backend: "auto" | "emulate" | "cuda": the qsa routes' backend, and the torch kernels run
        on the GPU unless it is "emulate" (or none is visible).
    case: default canary_case(kv_dtype). dims: head dims to poison (default every dim; one dim
        shows a kernel's leak pattern: a V leak stays on that dim, a K leak spreads over the row).
    Kernels that cannot run here, payloads the kv dtype has no code for and regions empty in
    this case are listed in `skipped` with the reason, never raised.
    """
    kernels = builtin_kernels() if kernels is None else ([kernels] if isinstance(kernels, str) or callable(kernels)
                                                         else list(kernels))
    if not kernels:
        raise ValueError("kernels: empty list")
    case = canary_case(kv_dtype, attend="sparse" if attend is None else attend) if case is None \
        else as_canary_case(case, attend)
    regions = _choices("regions", regions, REGIONS, regions_of(case.spec))
    for r in regions:
        check_region_of(r, case.spec)
    payloads = _choices("payloads", payloads, PAYLOADS, DEFAULT_PAYLOADS)
    planes = _choices("planes", planes, PLANES, PLANES)
    D = case.head_dim
    if dims is not None:
        dims = [int(d) for d in dims]
        if not dims or any(not 0 <= d < D for d in dims):
            raise ValueError(f"dims must be a non-empty list of head dims in [0, {D}), got {dims}")
    device, qsa_backend, qsa_reason = resolve_devices(backend, case.geometry)
    why = case.qsa_unsupported()
    qsa_reason, qsa_backend = (why, None) if why else (qsa_reason, qsa_backend)
    fns = {kernel_name(k): resolve_kernel(k, qsa_backend, qsa_reason) for k in kernels}

    skipped = []
    usable = _available_payloads(case.kv_format)
    for p in payloads:
        if p not in usable:
            skipped.append({"payload": p, "reason": f"{case.kv_format} has no {p} code"})
    payloads = [p for p in payloads if p in usable]
    slots = {r: region_slots(case, r) for r in regions}
    for r in regions:
        if not slots[r].any():
            skipped.append({"region": r, "reason": "empty in this case"})
    regions = [r for r in regions if slots[r].any()]

    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the canary's tensors are tiny: more threads only contend
    try:
        results = _run_matrix(fns, case, slots, regions, planes, payloads, dims, device, skipped, progress)
    finally:
        torch.set_num_threads(threads)
    return CanaryReport(qsa_backend, str(device), case, list(fns), results, skipped)


def _run_matrix(fns, case, slots, regions, planes, payloads, dims, device, skipped, progress) -> list:
    from tqdm.auto import tqdm

    results, memos = [], {}
    jobs = [(k, r, pl) for k in fns for r in regions for pl in planes]
    for name, region, plane in tqdm(jobs, desc="canary", disable=not progress):
        if any(s.get("kernel") == name for s in skipped):
            continue
        fn, p_idx, memo = fns[name], PLANES[plane], memos.setdefault(name, {})
        try:
            control = _run(fn, _filled(case, slots[region], p_idx, "zero", dims), device, memo)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run is reported, never a crash
            skipped.append({"kernel": name, "reason": _why(e)})
            continue
        for payload in payloads:
            try:
                out = _run(fn, _filled(case, slots[region], p_idx, payload, dims), device, memo)
                verdict, counts, changed = compare(control, out)
            except Exception as e:  # noqa: BLE001
                skipped.append({"kernel": name, "region": region, "plane": plane, "payload": payload,
                                "reason": _why(e)})
                continue
            results.append(LeakResult(name, region, plane, payload, verdict, leak=changed, output=out.float(),
                                      **counts))
    return results


def assert_no_leak(kernel, regions=None, payloads=None, planes=("k", "v"), backend: str = "auto",
                   case=None, kv_dtype: str = "fp16", dims=None, attend=None,
                   allow_skipped: bool = False) -> CanaryReport:
    """pytest helper: run the canary for one kernel (a callable fn(PagedCall) -> [rows, q_heads,
    head_dim], or a kernel name) and raise AssertionError listing every leak. A kernel that
    could not run fails too, unless allow_skipped. Returns the report when clean."""
    report = run_canary([kernel], regions=regions, payloads=payloads, planes=planes, backend=backend, case=case,
                        kv_dtype=kv_dtype, dims=dims, attend=attend)
    name = report.kernels[0]
    lines = [r.describe() for r in report.leaks()]
    if not allow_skipped:
        lines += [f"{name} could not run: {s['reason']}" for s in report.skipped if s.get("kernel") == name]
    if lines:
        raise AssertionError(f"{name}: {len(report.leaks())} leak(s) of unattended bytes into the output\n  "
                             + "\n  ".join(lines))
    return report


def load_canary(path) -> dict:
    """A canary JSON document (schema qsa_lab.canary/1), checked."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"path: {path} is not a {SCHEMA} document (schema {doc.get('schema')!r})")
    return doc
