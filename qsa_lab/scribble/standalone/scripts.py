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
