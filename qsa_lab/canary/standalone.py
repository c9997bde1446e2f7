"""Standalone repros: for a leak found in a built-in third-party kernel (FlashInfer, vLLM), a
short script that needs only that library, torch and safetensors — not qsa_lab — so the
library's maintainers can run it as is.

    write_script(path, kernel, case, call_file)   # -> the script's path, or None (no generator)

The script loads the saved call (calls/<cell>.safetensors: the control pool and the poisoned
pool, which differ only in bytes no row attends), calls the library's own API with exactly the
arguments the adapter (qsa_lab.canary.adapters) passed, and compares the two outputs bit for
bit (two NaNs count as equal). Its exit code is the canary's rule for every script and replay:

    1  the leak reproduces (an output changed)
    0  the outputs are identical (no leak here)
    3  it cannot run or cannot tell: the library does not import, no GPU, plan / compile /
       launch failed, or the control output already holds NaN / Inf

Everything the script does is written in it: the library's arguments are literals, and the call
file is read only as tensors (its metadata chooses nothing).
"""
from __future__ import annotations

from pathlib import Path
from string import Template

from qsa_lab.canary.adapters import flashinfer as _fi
from qsa_lab.canary.adapters import vllm as _vllm
from qsa_lab.canary.call import KernelSkipped
from qsa_lab.canary.names import ADAPTER, REGISTERED, as_kernel_name

EXIT_LEAK, EXIT_CLEAN, EXIT_CANNOT_RUN = 1, 0, 3

_HEAD = Template('''"""$title

Standalone: needs only torch, safetensors and $library (written by qsa_lab's canary leak
report; qsa_lab itself is not needed).

    python $script [CALL_FILE] [--device cuda]$usage

Loads the saved call (default ../calls/$call_name beside this script): the control pool and a
poisoned pool that differs from it only in $slots token slot(s) holding $payload on the
$plane plane, bytes no query row attends ($region, attention spec $attend). Runs
$api
with the arguments below, once per pool, and compares the outputs bit for bit.
Exit 1: the leak reproduces; 0: the outputs are identical; 3: cannot run or cannot tell here.
"""
import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ARGS = $args    # what the canary's adapter passed, for this call

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("call", nargs="?", default=str(Path(__file__).resolve().parent.parent / "calls" / "$call_name"))
p.add_argument("--device", default="cuda", help="where to run (default cuda)")
$options
opts = p.parse_args()


def cannot_run(what, e=None):
    print(f"CANNOT RUN: {what}" + (f": {type(e).__name__}: {e}" if e is not None else ""))
    sys.exit(3)


try:
    t = {k: v.to(opts.device) for k, v in load_file(opts.call).items()}
except Exception as e:  # noqa: BLE001 - no call file, no device
    cannot_run(f"load {opts.call} onto {opts.device}", e)
if torch.device(opts.device).type == "cuda" and not torch.cuda.is_available():
    cannot_run("no CUDA GPU is visible")
q, seq_lens, block_table = t["q"], t["seq_lens"].to(torch.int32), t["block_table"].to(torch.int32)
query_lens = t["query_lens"].to(torch.int32)
qo_indptr = torch.cat([query_lens.new_zeros(1), query_lens.cumsum(0)]).to(torch.int32)
fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(ARGS["kv_dtype"])
kv_dtype = fp8 or torch.float16


def pool(kv):
    """The pool as the library reads it: fp16 as is, fp8 codes viewed as torch fp8."""
    return kv.view(fp8) if fp8 else kv
''')

_FLASHINFER = '''
try:
    import flashinfer
except Exception as e:  # noqa: BLE001 - not installed, or a broken install
    cannot_run("import flashinfer", e)

# FlashInfer's paged layout: each request's used pages only (indptr, indices, last_page_len)
ps = ARGS["page_size"]
used = (seq_lens.long() + ps - 1) // ps
keep = torch.arange(block_table.shape[1], device=used.device)[None, :] < used[:, None]
indptr = torch.cat([used.new_zeros(1), used.cumsum(0)]).to(torch.int32)
indices = block_table[keep].to(torch.int32)
last_page_len = (seq_lens.long() - (used - 1) * ps).to(torch.int32)
workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=opts.device)
sizes = (ARGS["q_heads"], ARGS["kv_heads"], ARGS["head_dim"], ps)   # num_qo_heads, num_kv_heads, head_dim, page_size
dtypes = dict(q_data_type=torch.float16, kv_data_type=kv_dtype, o_data_type=torch.float16, sm_scale=ARGS["sm_scale"])
if ARGS["window_left"] is not None:
    how = {"window_left": ARGS["window_left"]} if ARGS["wrapper"] == "decode" else \\
          {"causal": True, "window_left": ARGS["window_left"]}
else:  # custom_mask: each request's query rows x its seq_len tokens, row-major, True = attended
    attend, qo, seq = t["attend"].bool(), qo_indptr.tolist(), seq_lens.tolist()
    how = {"custom_mask": torch.cat([attend[qo[r]:qo[r + 1], :seq[r]].reshape(-1) for r in range(len(seq))])}
try:
    if ARGS["wrapper"] == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=opts.tensor_cores)
        wrapper.plan(indptr, indices, last_page_len, *sizes, **dtypes, **how)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=opts.backend)
        wrapper.plan(qo_indptr, indptr, indices, last_page_len, *sizes, **dtypes, **how)
    scales = ARGS["scales"]
    control = wrapper.run(q, pool(t["kv_cache"]), **scales)
    poisoned = wrapper.run(q, pool(t["kv_cache_poisoned"]), **scales)
    if control.is_cuda:
        torch.cuda.synchronize()
except Exception as e:  # noqa: BLE001 - a module that does not compile or launch is not a leak
    cannot_run(f"flashinfer {ARGS['wrapper']} plan / run", e)
library = (f"flashinfer {getattr(flashinfer, '__version__', '?')}, " +
           (f"tensor cores {opts.tensor_cores}" if ARGS["wrapper"] == "decode" else f"backend {opts.backend}"))
'''

_VLLM = '''
try:
    import inspect

    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
except Exception as e:  # noqa: BLE001 - not installed, or a broken install
    cannot_run("import vLLM's triton_unified_attention", e)

kv = {name: pool(t[name]) for name in ("kv_cache", "kv_cache_poisoned")}
params = inspect.signature(unified_attention).parameters


def descale(s):
    return torch.tensor([s], dtype=torch.float32, device=opts.device)


def run(cache):
    rows, hq, d = q.shape
    kw = dict(q=q, k=cache[:, 0], v=cache[:, 1], out=torch.empty_like(q), cu_seqlens_q=qo_indptr,
              max_seqlen_q=int(query_lens.max()), seqused_k=seq_lens, max_seqlen_k=int(seq_lens.max()),
              softmax_scale=ARGS["sm_scale"], causal=True, window_size=tuple(ARGS["window_size"]),
              block_table=block_table, softcap=0.0, q_descale=None, k_descale=descale(ARGS["k_scale"]),
              v_descale=descale(ARGS["v_scale"]))
    if "kv_quant_mode" in params:
        from vllm.v1.kv_cache_interface import KVQuantMode

        kw["kv_quant_mode"] = KVQuantMode(1 if fp8 else 0)   # FP8_PER_TENSOR / NONE
    if ARGS["segments"]:    # the split (3D) decode launch
        n, dp = ARGS["segments"], 1 << (d - 1).bit_length()
        kw.update(seq_threshold_3D=seq_lens.numel(), num_par_softmax_segments=n,
                  softmax_segm_output=torch.empty(rows, hq, n, dp, dtype=torch.float32, device=q.device),
                  softmax_segm_max=torch.empty(rows, hq, n, dtype=torch.float32, device=q.device),
                  softmax_segm_expsum=torch.empty(rows, hq, n, dtype=torch.float32, device=q.device))
    unified_attention(**kw)
    return kw["out"]


try:
    control, poisoned = run(kv["kv_cache"]), run(kv["kv_cache_poisoned"])
    if control.is_cuda:
        torch.cuda.synchronize()
except Exception as e:  # noqa: BLE001 - a kernel that does not compile or launch is not a leak
    cannot_run("vLLM unified_attention", e)
import vllm  # noqa: E402 - imported above through its kernel module

library = f"vllm {getattr(vllm, '__version__', '?')}"
'''

_TAIL = '''
control, poisoned = control.float().cpu(), poisoned.float().cpu()
print(f"{library}, torch {torch.__version__}, {opts.device}; {ARGS['api']}")
bad = int((~torch.isfinite(control)).sum())
if bad:
    cannot_run(f"the control output already holds {bad} NaN / Inf of {control.numel()}: no leak can be told")
changed = (control != poisoned) & ~(torch.isnan(control) & torch.isnan(poisoned))
nan = changed & torch.isnan(poisoned)
print(f"control 0 NaN; poisoned {int(nan.sum())} NaN, {int((changed & torch.isinf(poisoned)).sum())} Inf, "
      f"{int((changed & torch.isfinite(poisoned)).sum())} finite changed of {control.numel()} outputs")
if changed.any():
    idx = torch.nonzero(changed)
    rows, heads, dims = (sorted(set(idx[:, i].tolist())) for i in range(3))
    first = torch.nonzero(nan)[0].tolist() if nan.any() else None
    print(f"changed: rows {rows}, heads {heads}, dims {dims[:16]}{' ...' if len(dims) > 16 else ''}; "
          f"first NaN at [row, head, dim] {first}")
    print("LEAK REPRODUCED: bytes no row attends reach the output")
    sys.exit(1)
print("no leak: the outputs are identical")
sys.exit(0)
'''


# the one knob each FlashInfer wrapper offers a maintainer: the same call on another backend
_USAGE = {"decode": " [--tensor-cores | --no-tensor-cores]", "prefill": " [--backend fa2|fa3|auto]"}
_OPTIONS = {"decode": 'p.add_argument("--tensor-cores", action=argparse.BooleanOptionalAction, '
                      'default=ARGS["tensor_cores"], help="use_tensor_cores (default: as the canary ran)")',
            "prefill": 'p.add_argument("--backend", default=ARGS["backend"], help="prefill backend (default: as the '
                       'canary ran)")'}


def library_args(kernel, case) -> dict | None:
    """The library arguments the adapter of `kernel` (a KernelName, or a name parsed here)
    passes for `case` (None: no kernel, no generator, or the adapter would not run this case)."""
    kernel = None if kernel is None else as_kernel_name(kernel)
    if kernel is None or kernel.kind != ADAPTER or kernel.text in REGISTERED:   # a registered name runs its own code
        return None
    base = {"kv_dtype": case.kv_dtype, "q_heads": case.q_heads, "kv_heads": case.kv_heads,
            "head_dim": case.head_dim, "page_size": case.page_size, "sm_scale": float(case.sm_scale)}
    library, name = kernel.source, kernel.function
    if library == "flashinfer" and name in ("decode", "decode-tc", "prefill", "prefill-fa2"):
        decode = name.startswith("decode")
        left = _fi.window_left(case.spec)
        if decode and left is None:
            return None
        scales = {k: float(getattr(case, k)) for k in ("k_scale", "v_scale") if float(getattr(case, k)) != 1.0}
        wrapper = "BatchDecodeWithPagedKVCacheWrapper" if decode else "BatchPrefillWithPagedKVCacheWrapper"
        how = f"window_left={left}" if left is not None else "custom_mask"
        return {**base, "wrapper": "decode" if decode else "prefill", "tensor_cores": name == "decode-tc",
                "backend": {"prefill": "auto", "prefill-fa2": "fa2"}.get(name), "window_left": left,
                "scales": scales, "api": f"flashinfer.{wrapper} ({kernel}), {how}"}
    if library == "vllm" and name in ("unified", "unified-3d"):
        try:
            window = _vllm._window(case.spec, kernel)
        except KernelSkipped:
            return None
        split = name == "unified-3d"
        return {**base, "window_size": list(window), "segments": _vllm.SEGMENTS if split else 0,
                "k_scale": float(case.k_scale), "v_scale": float(case.v_scale),
                "api": f"vllm unified_attention ({kernel}), window_size={tuple(window)}"}
    return None


def script_text(kernel, case, call_name: str, cell: dict) -> str | None:
    """The standalone script for one saved call of `kernel` (a KernelName or a name; cell: region,
    plane, payload, slots)."""
    args = library_args(kernel, case)
    if args is None:
        return None
    kernel = as_kernel_name(kernel)
    library = kernel.source
    head = _HEAD.substitute(
        title=f"{kernel}: {cell['payload']} on the {cell['plane'].upper()} plane of {cell['region']} slots "
              "reaches the output", library=library, script=f"repro/{Path(call_name).stem}.py",
        call_name=call_name, slots=cell["slots"], payload=cell["payload"], plane=cell["plane"].upper(),
        region=cell["region"], attend=case.spec, api=f"    {args['api']}", args=repr(args),
        usage=_USAGE.get(args.get("wrapper"), ""), options=_OPTIONS.get(args.get("wrapper"), ""))
    return head + (_FLASHINFER if library == "flashinfer" else _VLLM) + _TAIL


def write_script(path, kernel, case, call_name: str, cell: dict) -> Path | None:
    """script_text written to `path` (a fresh file in a report folder being written); None when
    `kernel` has no standalone generator."""
    text = script_text(kernel, case, call_name, cell)
    if text is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
