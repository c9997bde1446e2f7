"""The standalone script for vLLM's CPU attention reading a reused block's stale tail
(`unwritten-tail` / `other-requests` nan-leak on `--engine vllm`): TEMPLATE, with the workload
written in as PARAMS by qsa_lab.scribble.standalone.scripts."""

TEMPLATE = r'''"""vLLM CPU attention: a request's logprobs turn NaN from a block another request freed.

Standalone: needs only vLLM (its CPU build; torch and safetensors come with it). Written by
qsa_lab's scribble report; qsa_lab itself is not needed. No network, no tokenizer.

    python vllm_cpu_tail.py                # exit 1: the leak reproduces
    python vllm_cpu_tail.py --workaround   # exit 0: vLLM zeroes each block it hands out
    python vllm_cpu_tail.py --params '{"new_tokens": 4}'   # another workload (JSON, over PARAMS)

What it does:
1. Builds a tiny random Llama from a config in a temporary folder (config.json + safetensors),
   head_dim 32 (the CPU attention's smallest), with the embedding row of one token (BAD) set to
   NaN: a checkpoint with one non-finite row, as an overflowed fine-tune can leave.
2. On one engine (blocks of 32 tokens, a pool of PARAMS["blocks"] blocks counting the null block):
   - clean:   the reader prompts alone (no request ever held BAD);
   - control: request A' (A with BAD replaced by an ordinary token) runs to completion and frees
     its blocks, then the reader prompts run: they must equal clean bit for bit;
   - leak:    request A (which holds BAD) runs and frees its blocks, then the reader prompts run.
     None of them holds BAD, but they are handed A's blocks, and the CPU attention loads the slots
     of a request's last block past its length, masks their scores to -inf, then multiplies the
     whole 32-token tile's V by P: 0 x NaN = NaN.
3. Exit 1 when a reader's tokens or logprobs differ from the control (the leak), 0 when they are
   identical, 3 when it cannot run or cannot tell here (vLLM missing or another version, the
   clean or control run not finite, or A itself not NaN: the bad row did not reach the pool).

--workaround switches on vLLM's own zeroing of newly allocated blocks (the scheduler's
new_block_ids_to_zero, which vLLM 0.32 enables only for Mamba and mixed-precision caches), so a
handed-out block holds no previous owner's bytes. The fix in the kernel: zero (or never load) V
rows at or past seq_len in a request's last block before P @ V.
"""
import os
import sys

# Python puts this script's folder first on the import path: in a folder you received, a json.py or
# torch.py lying beside this script must not be imported in place of the real one
_here = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402

PARAMS = __PARAMS__
TESTED = "__TESTED__"     # the vLLM version this script was generated and checked with


__COMMON__


def build_model(folder, p, torch, save_file):
    """A tiny Llama: config.json and model.safetensors, random weights (seeded), BAD's row NaN."""
    hidden, heads, kv_heads, inter, vocab = 128, 4, 2, 256, p["vocab"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": p["layers"],
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
              "bos_token_id": 0, "eos_token_id": vocab - 1}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(p["seed"])

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    dim = hidden // heads
    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": w(vocab, hidden)}
    for i in range(p["layers"]):
        pre = f"model.layers.{i}."
        t |= {pre + "self_attn.q_proj.weight": w(heads * dim, hidden),
              pre + "self_attn.k_proj.weight": w(kv_heads * dim, hidden),
              pre + "self_attn.v_proj.weight": w(kv_heads * dim, hidden),
              pre + "self_attn.o_proj.weight": w(hidden, heads * dim),
              pre + "mlp.gate_proj.weight": w(inter, hidden), pre + "mlp.up_proj.weight": w(inter, hidden),
              pre + "mlp.down_proj.weight": w(hidden, inter),
              pre + "input_layernorm.weight": torch.ones(hidden),
              pre + "post_attention_layernorm.weight": torch.ones(hidden)}
    t["model.embed_tokens.weight"][p["bad"]] = float("nan")
    save_file(t, os.path.join(folder, "model.safetensors"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workaround", action="store_true",
                    help="zero every KV block when vLLM's allocator hands it out (expect exit 0)")
    ap.add_argument("--params", default="{}", help="JSON object overriding PARAMS (another workload)")
    ap.add_argument("--any-version", action="store_true", help=f"run on a vLLM other than {TESTED}")
    opts = ap.parse_args(argv)
    try:
        p = read_params(opts.params)
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: --params: {e}\n")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # one process: the workaround patches it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import torch
        import vllm
        from safetensors.torch import save_file
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 - not installed, or a broken install
        cannot_run(f"vLLM does not import here ({type(e).__name__}: {e})")
    version = vllm.__version__.split("+")[0]
    if version not in TESTED.split(",") and not opts.any_version:
        cannot_run(f"vLLM {version} is installed; this script was checked with {TESTED} (--any-version runs it)")
    torch.set_num_threads(1)
    if opts.workaround:
        from vllm.v1 import kv_cache_interface
        kv_cache_interface.KVCacheConfig.needs_kv_cache_zeroing = property(lambda self: True)

    a, control, readers = prompts(p, torch, p["vocab"] - 1)
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-tail-") as folder:
        build_model(folder, p, torch, save_file)
        longest = max(p["prompt_lengths"]) + p["new_tokens"]
        llm = LLM(model=folder, skip_tokenizer_init=True, dtype=p["dtype"], seed=0, block_size=32,
                  num_gpu_blocks_override=p["blocks"], kv_cache_memory_bytes=64 << 20,
                  max_model_len=-(-longest // 32) * 32, max_num_seqs=4,
                  max_num_batched_tokens=p["batch_tokens"], enable_chunked_prefill=True,
                  enable_prefix_caching=p["prefix_caching"], async_scheduling=False, enforce_eager=True,
                  max_logprobs=-1, disable_log_stats=True)
        params = SamplingParams(max_tokens=p["new_tokens"], temperature=0.0, ignore_eos=True, logprobs=0,
                                detokenize=False)

        def run(batch):
            llm.reset_prefix_cache()
            outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in batch], params, use_tqdm=False)
            return [(list(o.outputs[0].token_ids),
                     [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]) for o in outs]

        clean = run(readers)
        a_control = run([control])
        after_control = run(readers)
        a_bad = run([a])
        after_bad = run(readers)

    def finite(outs):
        return all(math.isfinite(v) for _, lps in outs for v in lps)

    print(f"vLLM {vllm.__version__}, CPU attention, params {json.dumps(p)}"
          + (", workaround: blocks zeroed on hand-out" if opts.workaround else ""))
    if not finite(clean) or not finite(after_control) or after_control != clean:
        cannot_run("the control run is not finite or differs from the clean run: cannot tell")
    if finite(a_bad):
        cannot_run("request A's own logprobs are finite: the NaN row did not reach the KV pool")
    changed = [i for i, (x, y) in enumerate(zip(after_control, after_bad)) if x != y]
    for i, ((t0, l0), (t1, l1)) in enumerate(zip(after_control, after_bad)):
        nan = sum(not math.isfinite(v) for v in l1)
        print(f"reader {i} ({len(readers[i])} tokens): control tokens {t0}, after A {t1}; {nan} of "
              f"{len(l1)} logprobs non-finite")
    if changed:
        print(f"LEAK: reader(s) {changed} changed after request A (which alone held the NaN row) freed its blocks")
        return 1
    print("CLEAN: every reader is identical to the control")
    return 0


if __name__ == "__main__":
    run_main(main)
'''
