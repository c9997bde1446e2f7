"""FlashInfer FA2 paged prefill with `custom_mask`: a NaN in the V of a token the mask excludes
reaches the output. Standalone: needs only torch and flashinfer-python on a CUDA GPU.

    python scripts/flashinfer_fa2_custom_mask_nan.py [--kv-dtype fp16|e4m3] [--backend fa2|auto]

One request of 40 tokens on 16-token pages (3 pages, 8 tokens in the last), 4 query rows (the
request's last 4 positions), 8 query heads over 2 KV heads, head_dim 128. The mask is causal
except that no row attends token 5. The control run has finite V everywhere; then token 5's V
(and, separately, its K) is set to NaN. Exit 1 when NaN reaches the output (the leak is there),
0 when the outputs are unchanged.
"""
import argparse
import sys

import torch
import flashinfer

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--kv-dtype", choices=("fp16", "e4m3"), default="fp16")
p.add_argument("--backend", default="fa2", help="BatchPrefillWithPagedKVCacheWrapper backend (default fa2)")
args = p.parse_args()

dev = "cuda"
QH, KVH, D, PS, KV_LEN, Q_LEN, MASKED = 8, 2, 128, 16, 40, 4, 5
pages = -(-KV_LEN // PS)
torch.manual_seed(0)
q = torch.randn(Q_LEN, QH, D, dtype=torch.float16, device=dev)
kv = torch.randn(pages, 2, PS, KVH, D, dtype=torch.float16, device=dev) * 0.5
qo_indptr = torch.tensor([0, Q_LEN], dtype=torch.int32, device=dev)
kv_indptr = torch.tensor([0, pages], dtype=torch.int32, device=dev)
kv_indices = torch.arange(pages, dtype=torch.int32, device=dev)
last_page_len = torch.tensor([KV_LEN - (pages - 1) * PS], dtype=torch.int32, device=dev)
# row i sits at position KV_LEN - Q_LEN + i and attends tokens <= its position, except MASKED
pos = torch.arange(KV_LEN - Q_LEN, KV_LEN, device=dev)
mask = torch.arange(KV_LEN, device=dev)[None, :] <= pos[:, None]
mask[:, MASKED] = False

kv_dtype = torch.float16 if args.kv_dtype == "fp16" else torch.float8_e4m3fn
wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
    torch.zeros(128 << 20, dtype=torch.uint8, device=dev), "NHD", backend=args.backend)
wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, QH, KVH, D, PS, custom_mask=mask.reshape(-1),
             q_data_type=torch.float16, kv_data_type=kv_dtype, o_data_type=torch.float16)


def run(pool):
    return wrapper.run(q, pool.to(kv_dtype)).float()


control = run(kv)
print(f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
      f"backend={args.backend}, kv {args.kv_dtype}")
print(f"control: {int(torch.isnan(control).sum())} NaN of {control.numel()} outputs")
leaked = False
for plane, name in ((1, "V"), (0, "K")):
    poisoned = kv.clone()
    poisoned[MASKED // PS, plane, MASKED % PS] = float("nan")  # every KV head, every dim of the masked token
    out = run(poisoned)
    n = int(torch.isnan(out).sum())
    rows = sorted(set(torch.nonzero(torch.isnan(out))[:, 0].tolist()))
    changed = int(((out != control) & ~torch.isnan(out)).sum())
    print(f"NaN {name} at masked token {MASKED} (page {MASKED // PS} slot {MASKED % PS}): {n} of {out.numel()} "
          f"outputs NaN (rows {rows}); {changed} finite outputs changed")
    leaked |= n > 0 or changed > 0
print("LEAK REPRODUCED: a token the custom_mask excludes reaches the output" if leaked else "clean: no leak")
sys.exit(1 if leaked else 0)
