"""The compiled kernels (csrc/), built just in time for the visible GPU.

Same functions and return conventions as qsa_lab.routes.emulate, so every CUDA
result can be checked against its PyTorch twin:

    grouped_forward(q, kv_cache, k_scale, v_scale, group_rows, microblocks, masks, seq_len,
                    *, kv_dtype, sm_scale, variant, return_lse=False)
        -> out [groups, 8, q_heads, head_dim] fp16 (, lse [groups, 8, q_heads] fp32)
    xqa_forward(q_rows, kv_cache, k_scale, v_scale, token_index, token_count, *, kv_dtype, sm_scale)
        -> out [n, q_heads, head_dim] fp16
    decode_panel(kv_cache, microblocks, *, plane, kv_dtype) -> [len(microblocks) * 4, head_dim] fp16

Build: torch.utils.cpp_extension.load on first use, TORCH_CUDA_ARCH_LIST set to the
visible GPU's major.minor, into ~/.cache/qsa_lab/ext-<torch>-cu<cuda>-sm<arch>
(override: QSA_LAB_BUILD_DIR), with -O3 -lineinfo and ptxas spill warnings. The sources come
from qsa_lab.support.package_data (the installed copy, or the checkout's csrc/). A build says so on
stderr before it starts (it takes a while), and a failed one names the compiler's first error.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from qsa_lab.routes.labels import KERNEL_VARIANTS
from qsa_lab.support import package_data

CSRC = package_data.locate("csrc")  # the installed copy, or the checkout's csrc/
SOURCES = ("bindings.cu",)
HEADERS = ("fp8_decode.cuh", "grouped_page4.cuh", "xqa_page4.cuh")
EXT_NAME = "qsa_lab_kernels"
CUDA_FLAGS = ("-O3", "-lineinfo", "-Xptxas=-warn-spills")
STALE_LOCK_S = 600  # a torch build lock older than this was left by a killed build
# what a first build costs, announced before it starts: 92.6 s on an H200 (sm_90, nvcc 13.0,
# 16 cores; evidence/gpu_check_h200.log, "build wall"); fewer cores take longer
BUILD_ESTIMATE = "about 1.5 minutes on an H200, longer with fewer cores"

KV_DTYPE_CODES = {"e4m3": 0, "e5m2": 1, "fp16": 2}
# Kernel variants of the grouped forward, numbered as csrc/grouped_page4.cuh's enum Variant: the
# routes' (routes.labels.KERNEL_VARIANTS) and two that no route runs: kernel_fix without its
# leading barrier (a race kept for the sanitizer) and early_v, the unfixed kernel with each tile's
# V bytes read together with K (not upstream).
VARIANTS = {"unfixed": 0, "kernel_fix": 1, "masked_load": 2, "kernel_fix_no_leading_barrier": 3, "early_v": 4,
            "finite_pv": 5}
assert set(KERNEL_VARIANTS) <= set(VARIANTS), "every route's kernel variant is compiled"
# __syncthreads() per 32-token tile of each variant (kBarriersPerTile in the header; finite_pv's B4
# is a __syncthreads_or).
BARRIERS_PER_TILE = {"unfixed": 5, "kernel_fix": 7, "masked_load": 5, "kernel_fix_no_leading_barrier": 6, "early_v": 5,
                     "finite_pv": 5}
# barriers more on a tile whose V panel holds a NaN or Inf (finite_pv's F1 and F2; no other variant has such a path)
SLOW_TILE_BARRIERS = {"finite_pv": 2}
MAX_Q_HEADS = 8
MAX_HEAD_DIM = 256

_ext = None
_error: str | None = None
_first_error: str | None = None


# ---------------------------------------------------------------- build and load

def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def build_dir() -> Path:
    """Build folder keyed by torch version, CUDA version and GPU arch."""
    env = os.environ.get("QSA_LAB_BUILD_DIR")
    if env:
        return Path(env).expanduser()
    arch = _arch().replace(".", "") if torch.cuda.is_available() else "none"
    cuda = (torch.version.cuda or "none").replace(".", "")
    torch_v = torch.__version__.split("+")[0]
    return Path.home() / ".cache" / "qsa_lab" / f"ext-{torch_v}-cu{cuda}-sm{arch}"


def _clear_stale_lock(folder: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """torch's FileBaton waits forever on a `lock` file that a killed build left behind."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age > max_age_s:
        lock.unlink(missing_ok=True)
        return True
    return False


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


_ERROR_WORD = re.compile(r"\b(error|fatal)\b", re.I)
_NOT_A_COMPILER_LINE = ("[", "FAILED:", "ninja:", "Error building extension", "subprocess.CalledProcessError")


def first_error(text: str) -> str:
    """The compiler's first error line in a failed build's output (nvcc, ptxas, the host
    compiler), not ninja's summary lines; else the output's last line."""
    lines = [s.strip() for s in str(text).splitlines() if s.strip()]
    for s in lines:
        if _ERROR_WORD.search(s) and not s.startswith(_NOT_A_COMPILER_LINE):
            return s
    return lines[-1] if lines else "(no compiler output)"


def missing_sources() -> list[str]:
    """The kernel sources (csrc/) that are not where the package looks for them."""
    return [n for n in SOURCES + HEADERS if not (CSRC / n).is_file()]


def _needs_build(folder: Path) -> bool:
    """No built library yet, or a source newer than it (torch rebuilds then)."""
    lib = folder / f"{EXT_NAME}.so"
    if not lib.is_file():
        return True
    built = lib.stat().st_mtime
    return any((CSRC / n).stat().st_mtime > built for n in SOURCES + HEADERS if (CSRC / n).is_file())


def load():
    """Build (first time) and import the extension. Raises RuntimeError with the reason."""
    global _ext, _error, _first_error
    if _ext is not None:
        return _ext
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible: the compiled kernels need one; use backend='emulate'")
    if torch.version.cuda is None:
        raise RuntimeError("this torch is not a CUDA build; use backend='emulate'")
    missing = missing_sources()
    if missing:
        _error = _first_error = (f"qsa_lab's kernel sources are missing from {CSRC} ({', '.join(missing)}): this "
                                 "install is incomplete; reinstall it")
        raise RuntimeError(_error)
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(folder)
    from torch.utils.cpp_extension import load as cpp_load

    sm = "sm_" + _arch().replace(".", "")
    building = _needs_build(folder)
    if building:
        print(f"qsa_lab: building the kernels for {sm} (first use, {BUILD_ESTIMATE}; cached in {folder})",
              file=sys.stderr, flush=True)
    start = time.monotonic()
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = _arch()
    try:
        _ext = cpp_load(name=EXT_NAME, sources=[str(CSRC / s) for s in SOURCES],
                        extra_include_paths=[str(CSRC)], extra_cflags=["-O3"],
                        extra_cuda_cflags=list(CUDA_FLAGS), build_directory=str(folder), verbose=False)
        _error = _first_error = None
    except Exception as exc:  # the compiler's output is in the message: its first error, then its tail
        _first_error = first_error(str(exc))
        _error = (f"building the qsa_lab kernels for {sm} in {folder} failed: {_first_error}\n"
                  f"{_tail(str(exc))}")
        raise RuntimeError(_error) from exc
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    if building:
        print(f"qsa_lab: kernels built for {sm} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return _ext


def available() -> bool:
    """A CUDA GPU is visible and the extension builds and loads (a failure is remembered)."""
    if _ext is not None:
        return True
    if _error is not None or not torch.cuda.is_available():
        return False
    try:
        load()
        return True
    except RuntimeError:
        return False


def _run(cmd) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return (res.stdout or res.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({exc})"


def _torch_arch_list() -> list[str]:
    """The archs this torch was compiled for, also when no GPU is usable (get_arch_list() is
    empty then, which would hide 'this torch has no kernels for your GPU')."""
    if torch.cuda.is_available():
        return torch.cuda.get_arch_list()
    flags = getattr(torch._C, "_cuda_getArchFlags", lambda: None)() if torch.version.cuda else None
    return flags.split() if flags else []


def status() -> dict:
    """What this machine can do, for `qsa-lab doctor` (qsa_lab.support.machine.verdict reads it)."""
    from torch.utils import cpp_extension

    from qsa_lab.support.machine import describe_smi, nvidia_smi

    cuda_home = cpp_extension.CUDA_HOME
    nvcc = shutil.which("nvcc") or (str(Path(cuda_home) / "bin" / "nvcc") if cuda_home else None)
    host_cc = shutil.which(os.environ.get("CXX", "c++"))
    nvcc_host = shutil.which(os.environ.get("CC", "gcc"))  # nvcc's host compiler: torch passes $CC as -ccbin
    gpu = torch.cuda.is_available()
    smi = nvidia_smi()
    info = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": gpu,
        "nvidia_smi_sees": describe_smi(smi) or "no GPU (or no nvidia-smi)",
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "capability": _arch() if gpu else None,
        "torch_arch_list": _torch_arch_list(),
        "build_arch_list": _arch() if gpu else None,
        "kernel_sources": f"{CSRC} ({package_data.origin()})",
        "cuda_home": cuda_home,
        "nvcc": nvcc,
        "nvcc_version": _run([nvcc, "--version"]).splitlines()[-1] if nvcc and Path(nvcc).exists() else None,
        "host_compiler": host_cc,
        "host_compiler_version": _run([host_cc, "--version"]).splitlines()[0] if host_cc else None,
        "nvcc_host_compiler": nvcc_host,
        "nvcc_host_compiler_version": (_run([nvcc_host, "-dumpfullversion", "-dumpversion"])
                                       if nvcc_host and "clang" not in Path(nvcc_host).name else None),
        "build_dir": str(build_dir()),
        "built": _ext is not None,
        "error": _error,
        "build_error": _first_error,
        "sources_missing": missing_sources(),
        "nvidia_smi": smi,
    }
    try:
        from qsa_lab.support.machine import NVRTC_HINT, find_nvrtc

        info["nvrtc_sm70_check"] = "available" if find_nvrtc() else f"wheels missing ({NVRTC_HINT})"
    except Exception as exc:  # doctor must never fail
        info["nvrtc_sm70_check"] = f"unavailable ({exc})"
    return info


# ---------------------------------------------------------------- argument checks

def _need(ok: bool, arg: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{arg}: {what}")


def _tensor(t, arg: str, dtypes, dim: int, device=None) -> None:
    _need(isinstance(t, torch.Tensor), arg, f"expected a torch.Tensor, got {type(t).__name__}")
    _need(t.is_cuda, arg, f"expected a CUDA tensor, got device {t.device}")
    if device is not None:
        _need(t.device == device, arg, f"expected device {device}, got {t.device}")
    _need(t.dtype in dtypes, arg, f"expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    _need(t.dim() == dim, arg, f"expected {dim} dimensions, got shape {tuple(t.shape)}")
    _need(t.is_contiguous(), arg, "expected a contiguous tensor")


def _q(q, arg: str) -> None:
    _tensor(q, arg, (torch.float16,), 3)
    _need(1 <= q.shape[1] <= MAX_Q_HEADS, arg, f"q_heads (dim 1) must be in [1, {MAX_Q_HEADS}], got {q.shape[1]}")
    d = q.shape[2]
    _need(16 <= d <= MAX_HEAD_DIM and d % 16 == 0, arg, f"head_dim (dim 2) must be a multiple of 16 in "
          f"[16, {MAX_HEAD_DIM}], got {d}")


def _kv(kv_cache, kv_dtype: str, head_dim: int, device) -> int:
    _need(kv_dtype in KV_DTYPE_CODES, "kv_dtype", f"expected one of {tuple(KV_DTYPE_CODES)}, got {kv_dtype!r}")
    dtype = torch.float16 if kv_dtype == "fp16" else torch.uint8
    _tensor(kv_cache, "kv_cache", (dtype,), 5, device)
    p, two, ps, one, d = kv_cache.shape
    _need(two == 2 and one == 1 and d == head_dim and p > 0, "kv_cache",
          f"expected shape [pages, 2, page_size, 1, head_dim={head_dim}], got {tuple(kv_cache.shape)}")
    _need(ps > 0 and ps % 4 == 0, "kv_cache", f"page_size (dim 2) must be a positive multiple of 4, got {ps}")
    return KV_DTYPE_CODES[kv_dtype]


def _scales(**scales) -> None:
    for name, value in scales.items():
        _need(isinstance(value, (int, float)) and float(value) == float(value) and abs(float(value)) != float("inf"),
              name, f"expected a finite number, got {value!r}")


# ---------------------------------------------------------------- kernels

def grouped_forward(q, kv_cache, k_scale, v_scale, group_rows, microblocks, masks, seq_len, *,
                    kv_dtype, sm_scale, variant, return_lse=False):
    """Grouped page4 forward on the GPU, one CTA per group.

    q [rows, Hq, D] fp16; kv_cache [pages, 2, page_size, 1, D] uint8 codes or fp16;
    group_rows [groups, 8] int64/int32 (-1: an empty query slot); microblocks, masks [groups, cap] int32;
    seq_len [groups] int32 (multiple of 32, <= 4*cap). variant: one of VARIANTS.
    Returns out [groups, 8, Hq, D] fp16 (and lse [groups, 8, Hq] fp32 when return_lse).
    """
    _q(q, "q")
    dtype_code = _kv(kv_cache, kv_dtype, q.shape[2], q.device)
    _need(variant in VARIANTS, "variant", f"expected one of {tuple(VARIANTS)}, got {variant!r}")
    _scales(k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale)
    _tensor(group_rows, "group_rows", (torch.int64, torch.int32), 2, q.device)
    _need(group_rows.shape[1] == 8, "group_rows", f"expected shape [groups, 8], got {tuple(group_rows.shape)}")
    groups = group_rows.shape[0]
    for arg, t in (("microblocks", microblocks), ("masks", masks)):
        _tensor(t, arg, (torch.int32,), 2, q.device)
        _need(t.shape[0] == groups, arg, f"expected shape [groups={groups}, cap], got {tuple(t.shape)}")
    _need(masks.shape == microblocks.shape, "masks",
          f"expected the shape of microblocks {tuple(microblocks.shape)}, got {tuple(masks.shape)}")
    _tensor(seq_len, "seq_len", (torch.int32,), 1, q.device)
    _need(seq_len.shape[0] == groups, "seq_len", f"expected shape [groups={groups}], got {tuple(seq_len.shape)}")
    out, lse = load().grouped_forward(q, kv_cache, float(k_scale), float(v_scale), group_rows, microblocks,
                                      masks, seq_len, dtype_code, float(sm_scale), VARIANTS[variant], bool(return_lse))
    return (out, lse) if return_lse else out


def xqa_forward(q_rows, kv_cache, k_scale, v_scale, token_index, token_count, *, kv_dtype, sm_scale):
    """Row-wise XQA page4 on the GPU: only each row's token_count real tokens.

    q_rows [n, Hq, D] fp16; token_index [n, T] int64 (page*page_size + token, INT64_MAX
    unused, sorted last); token_count [n] int32. Returns [n, Hq, D] fp16.
    """
    _q(q_rows, "q_rows")
    dtype_code = _kv(kv_cache, kv_dtype, q_rows.shape[2], q_rows.device)
    _scales(k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale)
    n = q_rows.shape[0]
    _tensor(token_index, "token_index", (torch.int64,), 2, q_rows.device)
    _need(token_index.shape[0] == n, "token_index", f"expected shape [n={n}, T], got {tuple(token_index.shape)}")
    _tensor(token_count, "token_count", (torch.int32,), 1, q_rows.device)
    _need(token_count.shape[0] == n, "token_count", f"expected shape [n={n}], got {tuple(token_count.shape)}")
    return load().xqa_forward(q_rows, kv_cache, float(k_scale), float(v_scale), token_index, token_count, dtype_code,
                              float(sm_scale))


def decode_panel(kv_cache, microblocks, *, plane, kv_dtype):
    """Debug: microblocks [n] int32 -> [n*4, D] fp16, decoded by the kernels' own decoder (no scale)."""
    _need(plane in (0, 1), "plane", f"expected 0 (K) or 1 (V), got {plane!r}")
    _need(isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 5, "kv_cache",
          "expected a tensor of shape [pages, 2, page_size, 1, head_dim]")
    d = kv_cache.shape[4]
    _need(16 <= d <= MAX_HEAD_DIM and d % 16 == 0, "kv_cache", f"head_dim must be a multiple of 16 in [16, 256], got {d}")
    dtype_code = _kv(kv_cache, kv_dtype, d, kv_cache.device)
    _tensor(microblocks, "microblocks", (torch.int32, torch.int64), 1, kv_cache.device)
    microblocks = microblocks.to(torch.int32)
    return load().decode_panel(kv_cache, microblocks, int(plane), dtype_code)
