"""The standalone scripts: one per confirmed leak kind, generated from a template with the workload
written in (PARAMS), importing only the engine and torch (and, for vLLM, the safetensors it ships).

    text = script_text("vllm-cpu-tail", params)          # the script's source
    write_script(path, "transformers-other-requests")     # DEFAULTS[kind] when params is None

Every script exits 1 when the leak reproduces, 0 when it does not, 3 when it cannot run or cannot
tell here (the engine missing or another version, a control run that is not finite); with
`--workaround` it applies an engine-side fix in its own process and should exit 0.
"""
from __future__ import annotations

import pprint
from pathlib import Path

from .transformers_cb import TEMPLATE as _TRANSFORMERS
from .vllm_cpu_tail import TEMPLATE as _VLLM

EXIT_LEAK, EXIT_CLEAN, EXIT_CANNOT_RUN = 1, 0, 3

#: what every script holds, written in where its template says __COMMON__
COMMON = '''def cannot_run(what):
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
'''

#: kind -> (template, the engine version the template was checked with, the file name in a report)
KINDS = {
    "vllm-cpu-tail": (_VLLM, "0.32.0", "vllm_cpu_tail.py"),
    "transformers-other-requests": (_TRANSFORMERS, "5.24.0,5.25.0", "transformers_other_requests.py"),
}

#: each kind's workload before shrinking: the scribble's default workload (`reuse`) for its engine,
#: its first request holding the bad token, the model the scribble builds (2 layers)
DEFAULTS = {
    "vllm-cpu-tail": {"prompt_lengths": [80, 5, 40, 70, 47, 80], "new_tokens": 24, "layers": 2, "blocks": 8,
                      "batch_tokens": 48, "bad": 7, "bad_at": 4, "vocab": 512, "seed": 0,
                      "dtype": "float32", "prefix_caching": True},
    "transformers-other-requests": {"prompt_lengths": [5, 13, 30, 47, 21, 21], "new_tokens": 8, "layers": 2,
                                    "page_size": 8, "blocks": 12, "batch_tokens": 32, "bad": 7, "bad_at": 4,
                                    "vocab": 128, "seed": 0, "attn": "paged|eager"},
}

#: the parameters a shrinker may make smaller, with their smallest values (qsa_lab.scribble.standalone.shrink)
SHRINKABLE = {
    "vllm-cpu-tail": {"prompt_lengths": 1, "new_tokens": 1, "layers": 1, "blocks": 2, "batch_tokens": 32},
    "transformers-other-requests": {"prompt_lengths": 1, "new_tokens": 1, "layers": 1, "blocks": 2,
                                    "batch_tokens": 8},
}


def _kind(kind: str) -> tuple:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    return KINDS[kind]


def script_text(kind: str, params: dict | None = None) -> str:
    """The script's source for `kind` with `params` (DEFAULTS[kind] when None) written in as PARAMS."""
    template, tested, _ = _kind(kind)
    p = dict(DEFAULTS[kind] if params is None else params)
    unknown = set(p) - set(DEFAULTS[kind])
    if unknown:
        raise ValueError(f"params: unknown for {kind}: {sorted(unknown)}")
    p = {**DEFAULTS[kind], **p}
    literal = pprint.pformat(p, width=100, sort_dicts=False).replace("\n", "\n" + " " * len("PARAMS = "))
    text = template.replace("__PARAMS__", literal, 1).replace("__TESTED__", tested, 1)
    return text.replace("__COMMON__", COMMON.rstrip("\n"), 1)


def script_name(kind: str) -> str:
    """The file name a report gives `kind`'s script."""
    return _kind(kind)[2]


def write_script(path, kind: str, params: dict | None = None) -> Path:
    """Write the script (a plain file; callers writing a report folder write into a fresh folder)."""
    path = Path(path)
    path.write_text(script_text(kind, params))
    return path
