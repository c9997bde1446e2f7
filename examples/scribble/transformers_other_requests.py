"""transformers continuous batching: one request's NaN KV turns the other requests of its batch NaN.

Standalone: needs only transformers and torch. Written by qsa_lab's scribble report; qsa_lab
itself is not needed. No network, no tokenizer.

    python transformers_other_requests.py                 # exit 1: the leak reproduces
    python transformers_other_requests.py --workaround    # exit 0: an attention that selects, not adds, its mask
    python transformers_other_requests.py --attn sdpa     # the other implementation that leaks
    python transformers_other_requests.py --device cuda --cuda-graph   # on a GPU, with CUDA graphs
    python transformers_other_requests.py --params '{"new_tokens": 2}' # another workload (JSON)

What it does:
1. Builds a tiny random Llama from a config (seeded), sets the embedding row of one token (BAD) to
   NaN and saves it as a checkpoint in a temporary folder, then loads it back: a checkpoint with one
   non-finite row, as an overflowed fine-tune can leave.
2. Runs greedy continuous batching (`generate_batch`, synchronous, no sampling) three times:
   - clean:   the reader prompts alone;
   - control: request A' (A with BAD replaced by an ordinary token) batched with the readers;
   - leak:    request A, which holds BAD (so its own KV is NaN), batched with the readers. No
     reader holds BAD. `paged|eager` and `sdpa` pack the step's requests into one attention call
     with an additive mask: a reader's row gives A's columns a probability of exactly 0, and
     0 x NaN = NaN.
3. Exit 1 when a reader's tokens or logprobs differ from the control (A and A' have the same
   length, so the batches have the same shapes), 0 when identical, 3 when it cannot run or cannot
   tell here (transformers missing or another version, a clean or control run that is not finite,
   or A itself finite: the NaN row did not reach the KV).

--workaround registers, in place of the implementation used, an attention that keeps every column
masked for a row out of that row's arithmetic: the mask selects (a masked score is replaced, not
added to) and P @ V sums only the attended columns, so no other request's value enters a row's sum.
It has no host synchronisation, so it runs under CUDA graphs as well.
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

PARAMS = {'prompt_lengths': [1, 1],
          'new_tokens': 1,
          'layers': 1,
          'page_size': 8,
          'blocks': 2,
          'batch_tokens': 8,
          'bad': 7,
          'bad_at': 0,
          'vocab': 128,
          'seed': 0,
          'attn': 'paged|eager'}
TESTED = "5.24.0,5.25.0"     # the transformers versions this script was generated and checked with


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


def isolated_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    """The workaround: no column masked for a query row enters that row's arithmetic.
    query [1, heads, q_rows, dim]; key, value [1, kv_heads, k_rows, dim] (every request's rows, one
    after another); the mask [1, 1, q_rows, k_rows] (additive, or True where attended).
    -> (output [1, q_rows, heads, dim], None). A masked score is replaced (not added to), and P @ V
    sums only the attended columns, so 0 x NaN never happens; rows with no attended column (padding)
    get zeros. No host synchronisation: it runs under CUDA graphs too."""
    import torch

    rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(rep, dim=1).float(), value.repeat_interleave(rep, dim=1).float()
    scores = (query.float() @ k.transpose(-1, -2)) * scaling
    if attention_mask is None:
        allowed = torch.ones_like(scores, dtype=torch.bool)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, 0.0)
    terms = torch.where(allowed[..., None], probs[..., None] * v[:, :, None], 0.0)
    return terms.sum(dim=-2).transpose(1, 2).to(query.dtype), None


def build_model(folder, p, torch, transformers, device):
    config = transformers.LlamaConfig(vocab_size=p["vocab"], hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=p["layers"], num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512)
    torch.manual_seed(p["seed"])
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[p["bad"]] = float("nan")
    model.save_pretrained(folder)
    return transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation=p["attn"]).eval().to(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workaround", action="store_true",
                    help="register an attention that keeps masked columns out of each row (expect exit 0)")
    ap.add_argument("--attn", choices=("paged|eager", "sdpa"), help="the attention implementation (default PARAMS)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--cuda-graph", action="store_true", help="capture CUDA graphs (with --device cuda)")
    ap.add_argument("--params", default="{}", help="JSON object overriding PARAMS (another workload)")
    ap.add_argument("--any-version", action="store_true", help=f"run on a transformers other than {TESTED}")
    opts = ap.parse_args(argv)
    try:
        p = read_params(opts.params)
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: --params: {e}\n")
    p["attn"] = opts.attn or p["attn"]
    try:
        import torch
        import transformers
        from transformers import AttentionInterface, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.utils import logging
    except Exception as e:  # noqa: BLE001 - not installed, or a broken install
        cannot_run(f"transformers (with torch) does not import here ({type(e).__name__}: {e})")
    if transformers.__version__ not in TESTED.split(",") and not opts.any_version:
        cannot_run(f"transformers {transformers.__version__} is installed; this script was checked with "
                   f"{TESTED.replace(',', ' and ')} (--any-version runs it)")
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        cannot_run("--device cuda: no CUDA GPU is visible")
    if opts.cuda_graph and not opts.device.startswith("cuda"):
        cannot_run("--cuda-graph needs --device cuda")
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if opts.workaround:
        AttentionInterface.register(p["attn"], isolated_attention)
    a, control, readers = prompts(p, torch, p["vocab"])
    with tempfile.TemporaryDirectory(prefix="transformers-cb-") as folder:
        model = build_model(folder, p, torch, transformers, opts.device)
    gen = GenerationConfig(max_new_tokens=p["new_tokens"], do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=p["page_size"], num_blocks=p["blocks"],
                                  max_batch_tokens=p["batch_tokens"], return_logprobs=True,
                                  use_cuda_graph=opts.cuda_graph, use_async_batching=False,
                                  auto_switch_to_flash=False, seed=p["seed"])

    def run(batch):
        out = model.generate_batch(batch, generation_config=gen, continuous_batching_config=cb)
        done = [out.get(f"req_{i}") for i in range(len(batch))]
        if any(r is None or r.error for r in done):
            cannot_run(f"generate_batch failed: {[r.error if r else 'no result' for r in done]}")
        return [(list(r.generated_tokens), [float(v) for v in r.logprobs]) for r in done]

    clean = run(readers)
    with_control = run([control] + readers)
    with_bad = run([a] + readers)

    def finite(outs):
        return all(math.isfinite(v) for _, lps in outs for v in lps)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {p['attn']} on {opts.device}"
          + (" with CUDA graphs" if opts.cuda_graph else "") + f", params {json.dumps(p)}"
          + (", workaround: masked columns kept out of each row" if opts.workaround else ""))
    if not finite(clean) or not finite(with_control):
        cannot_run("the clean or control run is not finite: cannot tell")
    if finite(with_bad[:1]):
        cannot_run("request A's own logprobs are finite: the NaN row did not reach its KV")
    changed = [i for i, (x, y) in enumerate(zip(with_control[1:], with_bad[1:])) if x != y]
    for i, ((t0, _), (tc, _), (t1, l1)) in enumerate(zip(clean, with_control[1:], with_bad[1:])):
        nan = sum(not math.isfinite(v) for v in l1)
        print(f"reader {i} ({len(readers[i])} tokens): alone {t0}, beside A' {tc}, beside A {t1}; {nan} of "
              f"{len(l1)} logprobs non-finite")
    if changed:
        print(f"LEAK: reader(s) {changed} changed when batched with request A (which alone holds the NaN row)")
        return 1
    print("CLEAN: every reader is identical to the control")
    return 0


if __name__ == "__main__":
    run_main(main)
