"""Tiny models built from a config (fixed seed, no download) and named, seeded workloads.

    model = tiny_model("llama-gqa")          # 2 layers, 4 query heads : 2 KV heads, head_dim 16
    wl = workload("reuse")                   # prompts, new tokens, page size, blocks, batch tokens

The workloads are sized so a small pool does real work: chunked prefill (a prompt longer than
max_batch_tokens), block reuse (fewer blocks than all requests need at once, so later requests take
blocks that finished ones freed), preemption (a request loses its blocks and comes back: prefilled
again, or with `cpu_offload_gib` its blocks copied to a CPU swap pool and restored), prefix sharing
(two prompts with a common first page) and forks (`samples` sequences per prompt: each child starts
from its parent's blocks, the partial last one copied). Which of these a run really did is in its
`Generation.events`; the docs' workload table is checked against them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MODELS = {
    # name: (config class, model class, config fields beyond the shared tiny ones)
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "qwen2-hybrid": ("Qwen2Config", "Qwen2ForCausalLM",
                     {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
                      "layer_types": ["full_attention", "sliding_attention"]}),
    # multi-head latent attention: transformers 5.25 caches the two latents (32 + 8 wide) per token and layer,
    # expanded to every query head after the cache (so as many KV heads as query heads)
    "deepseek-mla": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                     {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
                      "qk_nope_head_dim": 16, "v_head_dim": 16, "first_k_dense_replace": 2, "n_routed_experts": 4,
                      "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 32}),
}
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@dataclass(frozen=True)
class Workload:
    """A seeded generation: prompt lengths, greedy new tokens, and the pool that must hold them.
    shared_prefix: tokens the last two prompts share (prefix sharing); 0 for none. samples: sequences
    per prompt (more than 1: each request forks after its prefill; all greedy, so they are comparable).
    cpu_offload_gib: transformers' CPU swap pool (preempted requests are copied out and restored)."""
    name: str
    prompt_lengths: tuple
    new_tokens: int
    page_size: int
    num_blocks: int
    max_batch_tokens: int
    shared_prefix: int = 0
    seed: int = 0
    samples: int = 1
    cpu_offload_gib: float = 0.0

    def prompts(self, vocab_size: int) -> list:
        import torch
        g = torch.Generator().manual_seed(self.seed)
        out = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in self.prompt_lengths]
        if self.shared_prefix and len(out) >= 2:
            out[-1][: self.shared_prefix] = out[-2][: self.shared_prefix]
        return out

    def to_dict(self) -> dict:
        return asdict(self)


WORKLOADS = {
    # 4 requests on a pool with blocks to spare: one chunked prefill (47 > 64 - 5 - 13 - 30 in the
    # first batch), no block reuse
    "chunked-prefill": Workload("chunked-prefill", (5, 13, 30, 47), 6, 16, 32, 64),
    # 6 requests on 12 blocks of 8 tokens: requests wait for blocks that finished ones free, the
    # 47-token prompt is prefilled in chunks, and the last two share their first 16 tokens
    "reuse": Workload("reuse", (5, 13, 30, 47, 21, 21), 8, 8, 12, 32, shared_prefix=16),
    # the same pool with a CPU swap pool: preempted requests are copied out and restored into other blocks
    "offload": Workload("offload", (5, 13, 30, 47, 21, 21), 8, 8, 12, 32, shared_prefix=16, cpu_offload_gib=0.01),
    # parallel samples: 3 prompts, 2 sequences each; a child shares its parent's full blocks, the partial one copied
    "fork": Workload("fork", (5, 13, 30), 6, 8, 24, 32, samples=2),
}


#: earlier names of a workload -> its name now
RENAMED_WORKLOADS = {"issue32": "chunked-prefill"}


def workload(name: str) -> Workload:
    if name in RENAMED_WORKLOADS:
        raise ValueError(f"workload: {name!r} is now called {RENAMED_WORKLOADS[name]!r}")
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name]


def tiny_model(name: str = "llama-gqa", seed: int = 0, dtype=None, device=None):
    """A randomly initialised tiny causal LM (torch.manual_seed(seed) before construction)."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)} or a local checkpoint folder, got {name!r}")
    import torch
    import transformers
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**(TINY | extra))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model


class CheckpointError(ValueError):
    """A local checkpoint folder that cannot be a model: 'model: <problem>' (bad input, not a failure)."""


#: config fields that are counts, under the names configs give them: each must be an int >= 1
CONFIG_COUNTS = ("num_attention_heads", "num_key_value_heads", "hidden_size", "num_hidden_layers", "vocab_size",
                 "head_dim", "intermediate_size", "n_head", "n_embd", "n_layer", "num_heads", "d_model")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
_SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def check_checkpoint(path) -> dict:
    """A local checkpoint folder, checked before anything loads it (plain Python: the command line runs
    it before torch, and every engine's loader runs it again): a config.json holding a JSON object with
    a model_type and counts that are ints >= 1 (heads dividing the hidden size and each other), and
    weights whose safetensors files are whole. -> the config; CheckpointError ('model: ...') otherwise."""
    import json
    from pathlib import Path

    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise CheckpointError(f"model: expected a checkpoint folder, got {path!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model: {_text(folder)} is not a folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"model: {_text(folder)} holds no config.json: not a checkpoint folder")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"model: {_text(config_file)} is not JSON ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise CheckpointError(f"model: {_text(config_file)} cannot be read ({e.strerror})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"model: {_text(config_file)} holds a {type(config).__name__}, not a JSON object")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise CheckpointError(f"model: {_text(config_file)} names no model_type")
    for key in CONFIG_COUNTS:
        v = config.get(key)
        if key in config and v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise CheckpointError(f"model: {_text(config_file)}: {key} must be an int >= 1, got {v!r}")
    heads, kv, hidden = (config.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    if heads and kv and heads % kv:
        raise CheckpointError(f"model: {_text(config_file)}: num_key_value_heads ({kv}) must divide "
                              f"num_attention_heads ({heads})")
    if heads and hidden and not config.get("head_dim") and hidden % heads:
        raise CheckpointError(f"model: {_text(config_file)}: num_attention_heads ({heads}) must divide hidden_size "
                              f"({hidden}) when no head_dim is given")
    weight_bytes = _check_weights(folder)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab, hidden, layers = (text.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    if all(isinstance(v, int) and v >= 1 for v in (vocab, hidden, layers)):
        # every causal LM holds an embedding (vocab x hidden) and, per layer, at least one projection
        # from the hidden size: at even one bit a weight, weights smaller than that cannot be this model
        least = vocab * hidden + layers * hidden
        if least > 8 * weight_bytes:
            raise CheckpointError(f"model: {_text(config_file)} describes at least {least:.3g} weights (vocab_size x "
                                  f"hidden_size + num_hidden_layers x hidden_size), but the folder's weights are "
                                  f"{weight_bytes} bytes")
    return config


def _text(path) -> str:
    text = str(path)
    return text if text.isprintable() else repr(text)


def _check_weights(folder) -> int:
    """Weights are there, and each safetensors file is whole: its header parses and every tensor's
    bytes lie inside the file (a truncated download is caught here, not by the loader). -> their bytes."""
    import json
    import struct

    present = [folder / n for n in WEIGHT_FILES if (folder / n).is_file()]
    if not present:
        raise CheckpointError(f"model: {_text(folder)} holds no weights ({', '.join(WEIGHT_FILES)})")
    files = set()
    for f in present:
        if f.name.endswith(".index.json"):
            try:
                shards = json.loads(f.read_text(encoding="utf-8"))["weight_map"].values()
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
                raise CheckpointError(f"model: {_text(f)} is not a weight index (a JSON weight_map)") from None
            for shard in set(shards):
                if not isinstance(shard, str) or "/" in shard or not (folder / shard).is_file():
                    raise CheckpointError(f"model: {_text(f)} names a shard that is not in the folder: {shard!r}")
                files.add(folder / shard)
        else:
            files.add(f)
    total = 0
    for f in sorted(files):
        size = f.stat().st_size
        total += size
        if size == 0:
            raise CheckpointError(f"model: {_text(f)} is empty")
        if f.suffix != ".safetensors":
            continue
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            try:
                header = json.loads(fh.read(n)) if 0 < n <= size - 8 else None
            except (UnicodeDecodeError, ValueError):
                header = None
        if not isinstance(header, dict):
            raise CheckpointError(f"model: {_text(f)} is not a whole safetensors file (its header does not parse)")
        body = size - 8 - n
        for name, t in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = t["data_offsets"]
                elems = 1
                for d in t["shape"]:
                    elems *= d
                ok = 0 <= begin <= end <= body and end - begin == elems * _SAFETENSORS_BYTES.get(t["dtype"], 0)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CheckpointError(f"model: {_text(f)} is truncated or damaged: tensor {name!r} does not lie "
                                      f"whole inside its {size} bytes")
    return total


def local_model(path: str, dtype=None, device=None):
    """A user's checkpoint from a local folder (never downloads), checked first (check_checkpoint);
    the loader's own output (progress bars, warnings) is kept off the terminal, and weights that do not
    match the config (missing, unexpected or differently shaped tensors) are a CheckpointError."""
    import contextlib
    import io
    import warnings

    check_checkpoint(path)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            model, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                               output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - whatever the loader refuses is this folder's problem
        text = str(e).strip().splitlines()
        raise CheckpointError(f"model: {_text(path)} does not load ({type(e).__name__}: "
                              f"{text[0] if text else ''})") from None
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    wrong = {k: sorted(info.get(k) or ())[:3] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    wrong = {k: v for k, v in wrong.items() if v}
    if wrong:
        raise CheckpointError(f"model: {_text(path)}'s weights do not match its config ("
                              + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in wrong.items()) + ")")
    model = model.eval()
    return model.to(device) if device is not None else model
