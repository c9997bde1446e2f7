"""Call files and running one call: what a leak report's calls/ folder holds and how replay and
the report's minimisation call a kernel (qsa_lab.canary.report writes the folder,
qsa_lab.canary.replay reads a file back).

    kernel_runner(kernel)        the canary's own runner for a kernel (runner.runner_of), loaded
    run_call(runner, case)       one call on fresh copies of the case's tensors -> its output
    smallest_leak(runner, ...)   the fewest slots of a region whose poison still leaks the same way
    save_call / load_call        one poisoned call as safetensors (schema qsa_lab.canary-call/1):
                                 the control case (a case file for `qsa-lab canary --case`), the
                                 poisoned pool, the slots, and what was seen, in the metadata

A call file is data: the kernel it records is text (replay looks built-in names up and runs
nothing else unless the user names it).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from qsa_lab.analysis.leaks import LEAKS, compare
from qsa_lab.model.regions import AttentionSpec, attended_tokens, region_slots
from qsa_lab.canary.case import load_case
from qsa_lab.canary.execution import INPUTS
from qsa_lab.canary.names import FILE, KernelName
from qsa_lab.canary.runner import PLANES, call_meta, runner_of, write_region

SCHEMA = "qsa_lab.canary-call/1"
MAX_STEPS = 24  # halving steps: enough for 2**24 slots


def poisoned_case(case, slots: torch.Tensor, plane: str, payload: str, dims):
    """A copy of `case` with `payload` written into `slots` ([pages, page_size] bool) of one plane."""
    out = case.clone()
    write_region(out.kv_cache, slots, PLANES[plane], case.kv_dtype, payload, dims,
                 case.v_head_dim if case.mla else None)
    return out


def kernel_runner(kernel, backend=None, timeout: float = 600.0):
    """The canary's own way of calling a kernel (a canary.names.KernelName, a name or a callable;
    qsa_lab.canary.runner.runner_of): built-ins and callables in this process, a user's
    `module:function` / `file.py:function` in a worker process; loaded."""
    reason = None if backend else "the qsa routes did not run in this report's canary run"
    runner = runner_of(kernel, backend, reason, timeout)
    runner.load()
    return runner


def run_call(runner, case, device) -> torch.Tensor:
    """One call of `runner` on `case` (fresh copies of its tensors); the output on the CPU."""
    t = case.tensors()
    out = runner.call({k: t[k].detach().cpu() for k in INPUTS}, call_meta(case), device)
    if out.kind != "ok":
        raise RuntimeError(f"the kernel {out.kind}: {out.error}")
    return out.output


def leaks_with(runner, case, slots, plane, payload, dims, device) -> tuple[str, dict, torch.Tensor]:
    """(verdict, counts, poisoned output) of one control + poisoned pair poisoning `slots`."""
    control = run_call(runner, poisoned_case(case, slots, plane, "zero", dims), device)
    out = run_call(runner, poisoned_case(case, slots, plane, payload, dims), device)
    verdict, counts, _ = compare(control, out)
    return verdict, counts, out


def smallest_leak(runner, case, region: str, plane: str, payload: str, dims=None, device="cpu"):
    """The fewest slots of `region` found whose poison still gives the same verdict: halve
    while one half alone does. -> (slots [pages, page_size] bool, verdict, counts)."""
    full = region_slots(case, region)
    verdict, counts, _ = leaks_with(runner, case, full, plane, payload, dims, device)
    if verdict not in LEAKS:
        return full, verdict, counts
    coords = torch.nonzero(full)
    for _ in range(MAX_STEPS):
        if len(coords) <= 1:
            break
        half = len(coords) // 2
        for part in (coords[:half], coords[half:]):
            slots = torch.zeros_like(full)
            slots[part[:, 0], part[:, 1]] = True
            v, c, _ = leaks_with(runner, case, slots, plane, payload, dims, device)
            if v == verdict:
                coords, counts = part, c
                break
        else:
            break  # neither half alone leaks this way: the leak needs slots from both
    slots = torch.zeros_like(full)
    slots[coords[:, 0], coords[:, 1]] = True
    return slots, verdict, counts


def save_call(path, case, kernel: str, region: str, plane: str, payload: str, slots: torch.Tensor, dims,
              verdict: str, counts: dict, env: dict, copy: str | None = None) -> Path:
    """One poisoned call as safetensors: the control case (a case file: kv_cache holds the
    slots zero-filled), kv_cache_poisoned, the slots, the attended tokens ([rows, max_tokens]
    uint8, what a standalone script builds the library's mask from), and what was seen, in the
    metadata. `copy`: where the report keeps the kernel's file ('kernels/f.py:fn'), which replay
    names in its hint. Written as a plain new file (the umask's mode, like the rest of the report)."""
    from safetensors.torch import save

    control = poisoned_case(case, slots, plane, "zero", dims)
    poisoned = poisoned_case(case, slots, plane, payload, dims)
    t = {k: v.contiguous().cpu() for k, v in control.tensors().items()}
    t["kv_cache_poisoned"] = poisoned.kv_cache.contiguous().cpu()
    t["poisoned_slots"] = slots.to(torch.uint8).cpu()
    t["query_lens"] = case.query_lens().to(torch.int32)
    t["attend"] = attended_tokens(case).to(torch.uint8).contiguous()
    if case.spec.kind == "mask":
        t["attend_mask"] = case.spec.mask.cpu()
    meta = {"schema": SCHEMA, "kernel": str(kernel), "region": region, "plane": plane, "payload": payload,
            "dims": json.dumps(None if dims is None else [int(d) for d in dims]), "verdict": verdict,
            "counts": json.dumps(counts), "kv_dtype": case.kv_dtype, "attend": str(case.spec),
            "k_scale": repr(float(case.k_scale)), "v_scale": repr(float(case.v_scale)),
            "sm_scale": repr(float(case.sm_scale)), "mla": json.dumps(bool(case.mla)),
            "v_head_dim": json.dumps(case.v_head_dim), "environment": json.dumps(env)}
    if case.geometry is not None:
        meta["geometry"] = json.dumps(case.geometry.to_dict())
    if copy:
        meta["kernel_copy"] = copy
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(save(t, metadata=meta))
    return path


def load_call(path) -> tuple:
    """A call file -> (control CanaryCase, poisoned CanaryCase, metadata dict)."""
    import os

    from safetensors import safe_open

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected the path of a call file (str or Path), got {type(path).__name__}")
    if not Path(path).is_file():   # a FIFO or a device would block the read
        raise ValueError(f"path: {path} is not a regular file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            extra = {k: f.get_tensor(k) for k in ("kv_cache_poisoned", "attend_mask") if k in f.keys()}
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise ValueError(f"path: {path} is not a safetensors file ({type(e).__name__})") from None
    needed = {"attend", "mla", "v_head_dim"}
    if meta.get("schema") != SCHEMA or "kv_cache_poisoned" not in extra or not needed <= set(meta):
        raise ValueError(f"path: {path} is not a {SCHEMA} call file (written by --report)")
    mla, v_head_dim = _json(meta, "mla", path), _json(meta, "v_head_dim", path)
    if not isinstance(mla, bool) or not (v_head_dim is None or (type(v_head_dim) is int and v_head_dim > 0)):
        raise ValueError(f"path: {path}: its header's mla / v_head_dim ({meta['mla']!r}, {meta['v_head_dim']!r}) are "
                         f"not true/false and a positive integer or null")
    spec = meta["attend"]
    try:   # a header that passed the checks above can still be corrupt: bad input (exit 2), not a kernel's fault
        if spec.startswith("mask"):
            spec = AttentionSpec("mask", mask=extra["attend_mask"])
        control = load_case(path, attend=spec)   # scales and sm_scale from the metadata; MLA is the call file's own
        control = dataclasses.replace(control, mla=mla, v_head_dim=v_head_dim)
        if mla and (v_head_dim is None or v_head_dim > control.head_dim):
            raise ValueError(f"path: {path}: its header says MLA with v_head_dim {v_head_dim}: it needs one of at most "
                             f"the head dim {control.head_dim}")
        hit = extra["kv_cache_poisoned"]
        if hit.shape != control.kv_cache.shape or hit.dtype != control.kv_cache.dtype:
            raise ValueError(f"path: {path}: kv_cache_poisoned: expected kv_cache's {list(control.kv_cache.shape)} "
                             f"{control.kv_cache.dtype}, got {list(hit.shape)} {hit.dtype}")
        poisoned = dataclasses.replace(control.clone(), kv_cache=hit.contiguous())
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable header is bad input
        raise ValueError(f"path: {path}: a corrupt {SCHEMA} call file ({type(e).__name__}: {e})") from None
    return control, poisoned, meta


def _json(meta: dict, key: str, path):
    try:
        return json.loads(meta[key])
    except ValueError:
        raise ValueError(f"path: {path}: its header's {key} is not JSON: {meta[key]!r}") from None


def slug(text: str) -> str:
    """`text` as a file name: runs of anything but letters, digits, '.', '_', '-' become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:80]


def call_stem(kernel, region: str, plane: str, payload: str) -> str:
    """A call file's name without .safetensors: '<kernel>__<region>__<plane>__<payload>', a
    user's kernel file (a KernelName of kind FILE) named by its stem only (no path of the machine
    that wrote it)."""
    is_file = isinstance(kernel, KernelName) and kernel.kind == FILE
    name = f"{Path(kernel.source).stem}.{kernel.function}" if is_file else str(kernel)
    return slug(f"{name}__{region}__{plane}__{payload}")
