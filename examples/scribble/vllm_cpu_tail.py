"""vLLM CPU attention: a request's logprobs turn NaN from a block another request freed.

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

PARAMS = {'prompt_lengths': [2, 1],
          'new_tokens': 1,
          'layers': 1,
          'blocks': 2,
          'batch_tokens': 32,
          'bad': 7,
          'bad_at': 1,
          'vocab': 512,
          'seed': 0,
          'dtype': 'float32',
          'prefix_caching': True}
TESTED = "0.32.0"     # the vLLM version this script was generated and checked with


def cannot_run(what):
    print(f"CANNOT RUN: {what}")
    sys.exit(3)


def prompts(p, torch, top):
    """A (the first length, BAD at position bad_at) and the readers (the other lengths), tokens drawn
    (seeded) from 2 .. top - 1; no token is BAD but A's; A' is A with BAD replaced by token 1."""
    g = torch.Generator().manual_seed(p["seed"] + 1)
    ordinary = [t for t in range(2, top) if t != p["bad"]]
    out = [[ordinary[i] for i in torch.randint(0, len(ordinary), (n,), generator=g).tolist()]
           for n in p["prompt_lengths"]]
    a = list(out[0])
    a[min(p["bad_at"], len(a) - 1)] = p["bad"]
    control = [1 if t == p["bad"] else t for t in a]
    return a, control, out[1:]


#: what --params may set: integers within (low, high), the texts each may be, and the prompt lengths
#: (request A and at least one reader, each 1 .. MAX_PROMPT tokens)
INTS = {"new_tokens": (1, 4096), "layers": (1, 64), "page_size": (1, 1024), "blocks": (1, 1 << 16),
        "batch_tokens": (1, 1 << 16), "vocab": (5, 1 << 17), "bad_at": (0, 1 << 14), "seed": (0, 2 ** 63 - 1)}
TEXTS = {"attn": ("paged|eager", "sdpa"), "dtype": ("float32", "float16", "bfloat16")}
MAX_PROMPT, MAX_REQUESTS = 1 << 14, 64


def read_params(text):
    """PARAMS with the JSON object `text` over them; ValueError naming what is wrong, before anything runs."""
    try:
        given = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(given, dict):
        raise ValueError(f'must be a JSON object such as {{"new_tokens": 2}}, got {type(given).__name__}')
    unknown = sorted(set(given) - set(PARAMS))
    if unknown:
        raise ValueError(f"unknown {unknown}; known: {sorted(PARAMS)}")
    p = {**PARAMS, **given}
    for key, value in p.items():
        if key in INTS:
            low, high = INTS[key]
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"{key} must be an integer from {low} to {high}, got {value!r}")
        elif key in TEXTS and value not in TEXTS[key]:
            raise ValueError(f"{key} must be one of {list(TEXTS[key])}, got {value!r}")
        elif isinstance(PARAMS[key], bool) and type(value) is not bool:
            raise ValueError(f"{key} must be true or false, got {value!r}")
    lengths = p["prompt_lengths"]
    if (not isinstance(lengths, list) or not 2 <= len(lengths) <= MAX_REQUESTS
            or any(type(n) is not int or not 1 <= n <= MAX_PROMPT for n in lengths)):
        raise ValueError(f"prompt_lengths must list 2 to {MAX_REQUESTS} integers from 1 to {MAX_PROMPT} (request A, "
                         f"then the readers), got {lengths!r}")
    if type(p["bad"]) is not int or not 2 <= p["bad"] <= p["vocab"] - 3:
        raise ValueError(f"bad must be an integer from 2 to vocab - 3 ({p['vocab'] - 3}), got {p['bad']!r}")
    return p


def run_main(main):
    """Exit with main()'s code; anything it raises is no verdict: exit 3 (never 1, the leak's code)."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("CANNOT RUN: interrupted")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - an engine's error, whatever it is, tells nothing about the leak
        cannot_run(f"{type(e).__name__}: {' '.join(str(e).split())[:500]}")
    sys.exit(code)


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
