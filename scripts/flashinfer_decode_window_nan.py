"""FlashInfer paged decode with `window_left`: a NaN in the V of a token outside the window
reaches the output. Standalone: needs only torch and flashinfer-python on a CUDA GPU.

    python scripts/flashinfer_decode_window_nan.py [--kv-dtype fp16|e4m3] [--tensor-cores]

Three requests of 40, 33 and 21 tokens on 16-token pages, one query row each (decode), 8 query
heads over 2 KV heads, head_dim 128, window_left=7 (each row attends its last 8 tokens). The
control run has finite K/V everywhere; then the V (and, separately, the K) of each token
outside its request's window is set to NaN, one token at a time. Exit 1 when any of those NaNs
reaches the output (the leak is there), 0 when the outputs are unchanged.
"""
import argparse
import sys

import torch
import flashinfer

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--kv-dtype", choices=("fp16", "e4m3"), default="fp16")
p.add_argument("--tensor-cores", action="store_true", help="use_tensor_cores=True (default: CUDA-core decode)")
args = p.parse_args()

dev = "cuda"
QH, KVH, D, PS, WINDOW_LEFT = 8, 2, 128, 16, 7
seq_lens = [40, 33, 21]
n_pages = [-(-s // PS) for s in seq_lens]
torch.manual_seed(0)
kv = torch.randn(sum(n_pages), 2, PS, KVH, D, dtype=torch.float16, device=dev) * 0.5
q = torch.randn(len(seq_lens), QH, D, dtype=torch.float16, device=dev)
indptr = torch.tensor([0] + n_pages, device=dev).cumsum(0).to(torch.int32)
indices = torch.arange(sum(n_pages), dtype=torch.int32, device=dev)
last_page_len = torch.tensor([s - (n - 1) * PS for s, n in zip(seq_lens, n_pages)], dtype=torch.int32, device=dev)

kv_dtype = torch.float16 if args.kv_dtype == "fp16" else torch.float8_e4m3fn
wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
    torch.zeros(128 << 20, dtype=torch.uint8, device=dev), "NHD", use_tensor_cores=args.tensor_cores)
wrapper.plan(indptr, indices, last_page_len, QH, KVH, D, PS, window_left=WINDOW_LEFT,
             q_data_type=torch.float16, kv_data_type=kv_dtype, o_data_type=torch.float16)


def run(pool):
    return wrapper.run(q, pool.to(kv_dtype)).float()


control = run(kv)
print(f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
      f"{'tensor-core' if args.tensor_cores else 'CUDA-core'} decode, window_left={WINDOW_LEFT}, kv {args.kv_dtype}")
print(f"control: {int(torch.isnan(control).sum())} NaN of {control.numel()} outputs")
leaks = {"V": [], "K": []}
for r, s in enumerate(seq_lens):
    first_page = int(indptr[r])
    for tok in range(s - WINDOW_LEFT - 1):          # tokens 0 .. s-9 are outside the window
        for plane, name in ((1, "V"), (0, "K")):
            poisoned = kv.clone()
            poisoned[first_page + tok // PS, plane, tok % PS] = float("nan")
            out = run(poisoned)
            n = int(torch.isnan(out[r]).sum())
            if n or not torch.equal(out, control):
                leaks[name].append((r, tok, n))
for name, found in leaks.items():
    for r, tok, n in found[:6]:
        print(f"NaN {name} at request {r} token {tok} (outside the window of position {seq_lens[r] - 1}): "
              f"{n} of {QH * D} outputs of that row NaN")
    print(f"{name}: {len(found)} out-of-window tokens leak")
leaked = any(leaks.values())
print("LEAK REPRODUCED: a token outside window_left reaches the output" if leaked else "clean: no leak")
sys.exit(1 if leaked else 0)
