"""FlashInfer paged prefill with `window_left` on the FA3 backend: a NaN in the V of a token
outside the window reaches the output. Standalone: needs only torch and flashinfer-python on
a CUDA GPU with FA3 (sm_90, e.g. an H100 / H200).

    python scripts/flashinfer_prefill_window_nan.py [--backend fa3|fa2|auto] [--kv-dtype fp16|e4m3]

Three requests of 40, 39 and 38 tokens on 16-token pages, 4 query rows each (the requests' last
4 positions), 8 query heads over 2 KV heads, head_dim 128, causal, window_left=7 (each row
attends its last 8 tokens). The control run has finite K/V everywhere; then the V (and,
separately, the K) of each token that no row of its request attends is set to NaN, one token
at a time. Exit 1 when any of those NaNs reaches the output (the leak is there), 0 when the
outputs are unchanged.
"""
import argparse
import sys

import torch
import flashinfer

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--backend", default="fa3", help="BatchPrefillWithPagedKVCacheWrapper backend (default fa3)")
p.add_argument("--kv-dtype", choices=("fp16", "e4m3"), default="fp16")
args = p.parse_args()

dev = "cuda"
QH, KVH, D, PS, Q_LEN, WINDOW_LEFT = 8, 2, 128, 16, 4, 7
seq_lens = [40, 39, 38]
n_pages = [-(-s // PS) for s in seq_lens]
torch.manual_seed(0)
kv = torch.randn(sum(n_pages), 2, PS, KVH, D, dtype=torch.float16, device=dev) * 0.5
q = torch.randn(Q_LEN * len(seq_lens), QH, D, dtype=torch.float16, device=dev)
qo_indptr = torch.arange(0, Q_LEN * len(seq_lens) + 1, Q_LEN, dtype=torch.int32, device=dev)
indptr = torch.tensor([0] + n_pages, device=dev).cumsum(0).to(torch.int32)
indices = torch.arange(sum(n_pages), dtype=torch.int32, device=dev)
last_page_len = torch.tensor([s - (n - 1) * PS for s, n in zip(seq_lens, n_pages)], dtype=torch.int32, device=dev)

kv_dtype = torch.float16 if args.kv_dtype == "fp16" else torch.float8_e4m3fn
wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
    torch.zeros(128 << 20, dtype=torch.uint8, device=dev), "NHD", backend=args.backend)
wrapper.plan(qo_indptr, indptr, indices, last_page_len, QH, KVH, D, PS, causal=True, window_left=WINDOW_LEFT,
             q_data_type=torch.float16, kv_data_type=kv_dtype, o_data_type=torch.float16)


def run(pool):
    return wrapper.run(q, pool.to(kv_dtype)).float()


control = run(kv)
print(f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
      f"prefill backend={args.backend}, causal, window_left={WINDOW_LEFT}, kv {args.kv_dtype}")
print(f"control: {int(torch.isnan(control).sum())} NaN of {control.numel()} outputs")
leaks = {"V": [], "K": []}
for r, s in enumerate(seq_lens):
    first_page, rows = int(indptr[r]), slice(r * Q_LEN, (r + 1) * Q_LEN)
    for tok in range(s - Q_LEN - WINDOW_LEFT):      # before the first row's window: no row attends it
        for plane, name in ((1, "V"), (0, "K")):
            poisoned = kv.clone()
            poisoned[first_page + tok // PS, plane, tok % PS] = float("nan")
            out = run(poisoned)
            if not torch.equal(out, control):
                leaks[name].append((r, tok, int(torch.isnan(out[rows]).sum())))
for name, found in leaks.items():
    for r, tok, n in found[:6]:
        print(f"NaN {name} at request {r} token {tok} (outside every row's window): {n} of {Q_LEN * QH * D} "
              f"outputs of that request NaN")
    print(f"{name}: {len(found)} out-of-window tokens leak")
leaked = any(leaks.values())
print("LEAK REPRODUCED: a token outside window_left reaches the output" if leaked else "clean: no leak")
sys.exit(1 if leaked else 0)
