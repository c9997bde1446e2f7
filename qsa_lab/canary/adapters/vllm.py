"""vLLM's Triton unified attention (`vllm/v1/attention/ops/triton_unified_attention.py`) as a
canary kernel.

Where the kernel comes from:
    QSA_LAB_VLLM_SRC=PATH (or `qsa-lab canary --vllm-src PATH`, or `set_source(PATH)`): a vLLM
        source checkout (PATH/vllm/v1/attention/ops/triton_unified_attention.py). Only that file
        and the vLLM files it imports for its arithmetic (the `triton_quant_kv` helpers) are
        loaded from PATH; the handful of vLLM runtime modules it imports at the top (vllm.envs,
        vllm.logger, vllm.platforms, vllm.triton_utils, vllm.v1.kv_cache_interface) are
        replaced by a small import shim (STAND_INS below: the batch-invariance flag off, a
        standard logger, e4m3 as the platform's fp8 type, the real triton, and the
        KV-quantization enum's values), so the kernel runs without vLLM's compiled parts or
        its dependencies. The shim changes no arithmetic of the kernel.
    otherwise an installed vllm (`import vllm.v1.attention.ops.triton_unified_attention`).

The call maps onto the kernel's arguments as vLLM's Triton backend passes them: the pool's
planes as key_cache / value_cache [pages, page_size, kv_heads, head_dim] (strided views,
fp8 codes viewed as torch.float8_e4m3fn with per-tensor k/v descales), the block table as
is (padding entries 0, the null block: vLLM's convention), seqused_k = seq_lens,
cu_seqlens_q = cumulative query rows, causal. Spec: dense -> window_size (-1, -1);
window:W -> (W - 1, 0). Sink tokens, sparse and mask specs cannot be expressed (vLLM's
`sinks` argument is a per-head logit, not sink tokens): skipped with the reason.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import torch

from qsa_lab.canary.call import KernelSkipped

ENV = "QSA_LAB_VLLM_SRC"
KERNEL_FILE = Path("vllm/v1/attention/ops/triton_unified_attention.py")
MODULE = "vllm.v1.attention.ops.triton_unified_attention"
SEGMENTS = 16  # KV segments of the 3D (split) decode launch, as vLLM's Triton backend uses
_source: str | None = None
CPU_OK = False  # tests run a stand-in kernel on the CPU; the real kernel needs a CUDA GPU


def set_source(path) -> None:
    """Load the kernel from this vLLM checkout (None: QSA_LAB_VLLM_SRC, else an installed vllm)."""
    global _source
    if path is not None and not (Path(path) / KERNEL_FILE).is_file():
        raise ValueError(f"path: {path} is not a vLLM checkout (no {KERNEL_FILE})")
    _source = None if path is None else str(path)


def source() -> str | None:
    return _source or os.environ.get(ENV) or None


class KVQuantMode(enum.IntEnum):
    """Stand-in for vllm.v1.kv_cache_interface.KVQuantMode: the adapter uses NONE (fp16 pool)
    and FP8_PER_TENSOR (fp8 pool with per-tensor scales), whose values vLLM fixes at 0 and 1."""
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    INT2_PER_TOKEN_HEAD = 5
    NVFP4 = 6


def _stand_ins() -> dict:
    import triton
    import triton.language as tl

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    platform = types.SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn, is_cuda=lambda: True,
                                     is_rocm=lambda: False)
    return {"vllm.envs": module("vllm.envs", VLLM_BATCH_INVARIANT=False),
            "vllm.logger": module("vllm.logger", init_logger=logging.getLogger),
            "vllm.platforms": module("vllm.platforms", current_platform=platform),
            "vllm.triton_utils": module("vllm.triton_utils", tl=tl, triton=triton),
            "vllm.v1.kv_cache_interface": module("vllm.v1.kv_cache_interface", KVQuantMode=KVQuantMode)}


def _load_from_source(src: str):
    """The kernel module from a checkout: vllm's packages point at src, the runtime modules are
    stand-ins; sys.modules is restored afterwards (the loaded functions keep their globals)."""
    path = Path(src) / KERNEL_FILE
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "vllm" or k.startswith("vllm.")}
    try:
        root = Path(src) / "vllm"
        for pkg in ("", ".v1", ".v1.attention", ".v1.attention.ops", ".v1.attention.ops.triton_quant_kv"):
            m = types.ModuleType("vllm" + pkg)
            m.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]
            sys.modules["vllm" + pkg] = m
        sys.modules.update(_stand_ins())
        spec = importlib.util.spec_from_file_location(MODULE, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[MODULE] = mod
        try:
            spec.loader.exec_module(mod)
        except ImportError as e:
            raise KernelSkipped(f"{path} imports something the adapter's shim does not provide: {e}") from None
        return mod
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _triton():
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise KernelSkipped(f"vLLM's unified attention is a Triton kernel and triton is not installed: {e}") from None


@functools.lru_cache(maxsize=None)
def _load(src: str | None):
    """-> (kernel module, where it came from: a description for the report)."""
    if src:
        if not (Path(src) / KERNEL_FILE).is_file():
            raise KernelSkipped(f"{ENV}={src}: no {KERNEL_FILE} there")
        _triton()
        return _load_from_source(src), _describe_source(src)
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as e:
        raise KernelSkipped(f"vllm is not installed (pip install vllm, or point {ENV} / --vllm-src at a vLLM "
                            f"checkout): {e}") from None
    except Exception as e:  # noqa: BLE001 - a broken install is a skip reason
        raise KernelSkipped(f"vllm cannot be imported here: {type(e).__name__}: {e}") from None
    import vllm

    return mod, f"vllm {getattr(vllm, '__version__', 'unknown')}"


def _describe_source(src: str) -> str:
    """'source PATH [@ commit] (triton_unified_attention.py sha256 ...)'; the commit only when
    PATH is itself the root of a git checkout."""
    digest = hashlib.sha256((Path(src) / KERNEL_FILE).read_bytes()).hexdigest()[:12]
    commit = ""
    try:
        def git(*args):
            return subprocess.run(["git", "-C", src, *args], capture_output=True, text=True, timeout=10).stdout.strip()
        top = git("rev-parse", "--show-toplevel")
        if top and Path(top).resolve() == Path(src).resolve():
            commit = git("rev-parse", "--short=12", "HEAD")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"source {src}" + (f" @ {commit}" if commit else "") + f" ({KERNEL_FILE.name} sha256 {digest})"


def version() -> str | None:
    """Where vLLM's kernel comes from (None: not available)."""
    src = source()
    if src:
        return _describe_source(src) if (Path(src) / KERNEL_FILE).is_file() else None
    try:
        import vllm
    except Exception:  # noqa: BLE001
        return None
    return f"vllm {getattr(vllm, '__version__', 'unknown')}"


def _window(spec, name: str) -> tuple[int, int]:
    if spec.kind == "dense":
        return (-1, -1)
    if spec.kind == "window" and not spec.sink:
        return (spec.window - 1, 0)
    why = ("no sink tokens (its `sinks` argument is a per-head logit)" if spec.kind == "window"
           else f"no mask argument for a {spec.kind} spec")
    raise KernelSkipped(f"{name}: vLLM's unified attention has a sliding window but {why}")


def _run(call, split: bool, name: str) -> torch.Tensor:
    mod, _ = _load(source())
    if call.device.type != "cuda" and not CPU_OK:
        raise KernelSkipped(f"{name} needs a CUDA GPU (the call is on {call.device})")
    if getattr(call, "mla", False):
        raise KernelSkipped(f"{name}: an MLA latent pool is not vLLM's unified attention layout")
    window = _window(call.spec, name)
    lens = call.query_lens()
    if split and bool((lens != 1).any()):
        raise KernelSkipped(f"{name}: the split (3D) launch is vLLM's decode path, one query row per request; "
                            f"this case has query lengths {sorted(set(lens.tolist()))} (use vllm:unified)")
    fp8 = call.kv_dtype != "fp16"
    if call.kv_dtype == "e5m2":
        raise KernelSkipped(f"{name}: vLLM's fp8 KV cache path here is e4m3")
    kv = call.kv_cache.view(torch.float8_e4m3fn) if fp8 else call.kv_cache
    dev = call.device
    params = inspect.signature(mod.unified_attention).parameters

    def scale(s):
        return torch.tensor([float(s)], dtype=torch.float32, device=dev)

    kwargs = dict(q=call.q, k=kv[:, 0], v=kv[:, 1], out=torch.empty_like(call.q),
                  cu_seqlens_q=call.qo_indptr(), max_seqlen_q=int(lens.max()), seqused_k=call.seq_lens,
                  max_seqlen_k=int(call.seq_lens.max()), softmax_scale=float(call.sm_scale), causal=True,
                  window_size=window, block_table=call.block_table, softcap=0.0, q_descale=None,
                  k_descale=scale(call.k_scale), v_descale=scale(call.v_scale))
    if "kv_quant_mode" in params:
        kwargs["kv_quant_mode"] = getattr(mod, "KVQuantMode", KVQuantMode)(1 if fp8 else 0)
    elif not fp8 and (call.k_scale != 1.0 or call.v_scale != 1.0):
        raise KernelSkipped(f"{name}: this kernel version applies no scale to an fp16 pool")
    if split:
        rows, hq, d = call.q.shape
        dp = 1 << (d - 1).bit_length()
        kwargs.update(seq_threshold_3D=call.seq_lens.numel(), num_par_softmax_segments=SEGMENTS,
                      softmax_segm_output=torch.empty(rows, hq, SEGMENTS, dp, dtype=torch.float32, device=dev),
                      softmax_segm_max=torch.empty(rows, hq, SEGMENTS, dtype=torch.float32, device=dev),
                      softmax_segm_expsum=torch.empty(rows, hq, SEGMENTS, dtype=torch.float32, device=dev))
    missing = [k for k in kwargs if k not in params]
    if missing:
        raise KernelSkipped(f"{name}: this unified_attention has no argument(s) {missing}")
    mod.unified_attention(**kwargs)
    return kwargs["out"]


def unified(call) -> torch.Tensor:
    """vllm:unified: one program per query block and KV head over all of the row's tiles."""
    return _run(call, False, "vllm:unified")


def unified_3d(call) -> torch.Tensor:
    """vllm:unified-3d: decode split over 16 KV segments, then reduce_segments."""
    return _run(call, True, "vllm:unified-3d")


for _kernel in (unified, unified_3d):
    _kernel.paged_inputs = "block_table"  # the block table as is: its padding entries point at the null block
