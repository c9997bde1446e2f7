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


def local_model(path: str, dtype=None, device=None):
    """A user's checkpoint from a local folder (never downloads)."""
    from pathlib import Path
    if not Path(path).is_dir():
        raise ValueError(f"model: {path} is not a folder")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()
    return model.to(device) if device is not None else model
