"""FlashInfer's paged decode and prefill wrappers as canary kernels.

The call's pool is FlashInfer's own "NHD" paged layout already ([pages, 2, page_size,
kv_heads, head_dim], plane 0 K, 1 V), so it is passed as is (fp8 codes viewed as
torch.float8_e4m3fn / float8_e5m2, with k_scale / v_scale given to run()). FlashInfer reads
only the pages listed for each request (`PagedCall.page_table()`: indptr, indices,
last_page_len), so the null block and free pages are never in its inputs: every kernel here
declares `paged_inputs = "page_table"`, and a clean null-block cell says n/a, not clean.

Spec mapping:
    dense            decode: the whole request; prefill: causal=True
    window:W         window_left = W - 1 (FlashInfer's left bound is inclusive of W - 1
                     tokens before the row's own)
    window:W,sink:S  prefill: custom_mask (the window and the sink tokens); decode: skipped
    sparse, mask     prefill: custom_mask (the call's attended tokens); decode: skipped, the
                     decode wrapper takes no mask
Decode takes one query row per request (a prefill chunk is skipped: use a prefill kernel).
"""
from __future__ import annotations

import functools

import torch

from qsa_lab.canary.call import KernelSkipped

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
FP8 = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
CPU_OK = False  # tests run a stand-in library on the CPU; FlashInfer itself needs a CUDA GPU


def _library():
    try:
        import flashinfer
    except ImportError as e:
        raise KernelSkipped(f"flashinfer is not installed (pip install flashinfer-python): {e}") from None
    except Exception as e:  # noqa: BLE001 - a broken install (missing CUDA libraries, ...) is a skip reason
        raise KernelSkipped(f"flashinfer cannot be imported here: {type(e).__name__}: {e}") from None
    return flashinfer


def version() -> str | None:
    try:
        import flashinfer
    except Exception:  # noqa: BLE001
        return None
    return str(getattr(flashinfer, "__version__", "unknown"))


@functools.lru_cache(maxsize=None)
def _workspace(device: str) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _check(call, what: str):
    fi = _library()
    if call.device.type != "cuda" and not CPU_OK:
        raise KernelSkipped(f"{what} needs a CUDA GPU (the call is on {call.device})")
    if getattr(call, "mla", False):
        raise KernelSkipped(f"{what}: an MLA latent pool needs FlashInfer's MLA wrapper, not adapted here")
    return fi


def kv_pool(call) -> tuple[torch.Tensor, torch.dtype]:
    """(pool as FlashInfer reads it, its dtype): fp16 as is, fp8 codes viewed as torch fp8."""
    if call.kv_dtype == "fp16":
        return call.kv_cache, torch.float16
    dtype = getattr(torch, FP8[call.kv_dtype])
    return call.kv_cache.view(dtype), dtype


def _scales(call) -> dict:
    return {k: float(getattr(call, k)) for k in ("k_scale", "v_scale") if float(getattr(call, k)) != 1.0}


def window_left(spec) -> int | None:
    """FlashInfer's window_left for a spec it can express without a mask (None: it needs one)."""
    if spec.kind == "dense":
        return -1
    if spec.kind == "window" and not spec.sink:
        return spec.window - 1
    return None


def custom_mask(call) -> torch.Tensor:
    """FlashInfer's flattened custom_mask: for each request in order, its query rows x its
    seq_len tokens (row-major), True where the row attends the token."""
    attend = call.attend_mask()                                   # [rows, max_tokens] on call.device
    qo = call.qo_indptr().tolist()
    seq = call.seq_lens.tolist()
    return torch.cat([attend[qo[r]:qo[r + 1], :seq[r]].reshape(-1) for r in range(len(seq))]).contiguous()


def _run(call, wrapper) -> torch.Tensor:
    kv, _ = kv_pool(call)
    return wrapper.run(call.q, kv, **_scales(call))


def _decode(call, tensor_cores: bool, name: str) -> torch.Tensor:
    fi = _check(call, name)
    lens = call.query_lens()
    if bool((lens != 1).any()):
        raise KernelSkipped(f"{name} takes one query row per request; this case has query lengths "
                            f"{sorted(set(lens.tolist()))} (use flashinfer:prefill)")
    left = window_left(call.spec)
    if left is None:
        raise KernelSkipped(f"{name}: the decode wrapper takes no custom mask, so spec {call.spec} "
                            "cannot be expressed (use flashinfer:prefill)")

    def make():
        _, kv_dtype = kv_pool(call)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(str(call.device)), "NHD",
                                                  use_tensor_cores=tensor_cores)
        indptr, indices, last = call.page_table()
        w.plan(indptr, indices, last, call.q_heads, call.kv_heads, call.head_dim, call.page_size,
               window_left=left, q_data_type=torch.float16, kv_data_type=kv_dtype,
               o_data_type=torch.float16, sm_scale=float(call.sm_scale))
        return w
    return _run(call, call.cached(f"flashinfer.decode.tc={tensor_cores}", make))


def _prefill(call, backend: str, name: str) -> torch.Tensor:
    fi = _check(call, name)
    left = window_left(call.spec)

    def make():
        _, kv_dtype = kv_pool(call)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(str(call.device)), "NHD", backend=backend)
        indptr, indices, last = call.page_table()
        how = {"causal": True, "window_left": left} if left is not None else {"custom_mask": custom_mask(call)}
        w.plan(call.qo_indptr(), indptr, indices, last, call.q_heads, call.kv_heads, call.head_dim,
               call.page_size, q_data_type=torch.float16, kv_data_type=kv_dtype, o_data_type=torch.float16,
               sm_scale=float(call.sm_scale), **how)
        return w
    return _run(call, call.cached(f"flashinfer.prefill.{backend}", make))


def decode(call) -> torch.Tensor:
    """flashinfer:decode: BatchDecodeWithPagedKVCacheWrapper on CUDA cores."""
    return _decode(call, False, "flashinfer:decode")


def decode_tc(call) -> torch.Tensor:
    """flashinfer:decode-tc: BatchDecodeWithPagedKVCacheWrapper with use_tensor_cores=True."""
    return _decode(call, True, "flashinfer:decode-tc")


def prefill(call) -> torch.Tensor:
    """flashinfer:prefill: BatchPrefillWithPagedKVCacheWrapper, backend auto."""
    return _prefill(call, "auto", "flashinfer:prefill")


def prefill_fa2(call) -> torch.Tensor:
    """flashinfer:prefill-fa2: BatchPrefillWithPagedKVCacheWrapper, backend fa2."""
    return _prefill(call, "fa2", "flashinfer:prefill-fa2")


for _kernel in (decode, decode_tc, prefill, prefill_fa2):
    _kernel.paged_inputs = "page_table"   # page_table(): each request's used pages, never a padding entry
