"""Save a case and its route outputs as one safetensors file (CONTRACT `--save`), and load it back."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import __version__
from .case import Case, Geometry, validate_case
from .plan import GroupedPlan, plan_groups

CASE_TENSORS = ("q", "kv_cache", "block_table", "seq_lens", "token_to_req", "positions", "selected")


def save(result, path, overwrite: bool = False) -> Path:
    """Write the case, the grouped plan before any fix and `out.<route>` for every route run.

    Refuses to replace an existing file unless overwrite=True.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"path: {path} exists; pass overwrite=True (CLI: --force) to replace it")
    case, plan = result.case.to("cpu"), result.plan.to("cpu")
    tensors = {name: getattr(case, name).contiguous() for name in CASE_TENSORS}
    tensors["k_scale"] = torch.tensor(case.k_scale, dtype=torch.float32)
    tensors["v_scale"] = torch.tensor(case.v_scale, dtype=torch.float32)
    tensors["plan.microblocks"] = plan.microblocks.contiguous()
    tensors["plan.masks"] = plan.masks.contiguous()
    tensors["plan.seq_len"] = plan.seq_len.contiguous()
    for route, out in result.outputs.items():
        tensors[f"out.{route}"] = out.contiguous()
    meta = {"geometry": json.dumps(case.geometry.to_dict()), "kv_dtype": case.kv_format,
            "sm_scale": repr(case.sm_scale), "qsa_lab_version": __version__,
            "poison": json.dumps(case.poison), "backend": result.backend,
            # float32 0-d tensors cannot hold the exact double scale: keep it here too
            "k_scale": repr(case.k_scale), "v_scale": repr(case.v_scale)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load(path):
    """-> (case, plan, outputs{route: tensor}, metadata). Raises ValueError on a file that is not a
    complete qsa_lab case."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path: {path} does not exist")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    missing = [k for k in CASE_TENSORS + ("plan.microblocks", "plan.masks", "plan.seq_len") if k not in tensors]
    if "geometry" not in meta or missing:
        raise ValueError(f"path: {path} is not a qsa_lab case file (missing {missing or ['geometry metadata']})")
    geometry = Geometry(**json.loads(meta["geometry"]))
    scales = {k: float(meta[k]) if k in meta else float(tensors[k]) for k in ("k_scale", "v_scale")}
    case = Case(geometry, **{k: tensors[k] for k in CASE_TENSORS}, **scales,
                poison=json.loads(meta.get("poison", "{}")) or Case.__dataclass_fields__["poison"].default_factory())
    validate_case(case)
    plan = plan_groups(case)
    saved = GroupedPlan(plan.group_rows, plan.xqa_rows, tensors["plan.microblocks"], tensors["plan.masks"],
                        plan.categories, tensors["plan.seq_len"], geometry.q_heads)
    outputs = {k[4:]: v for k, v in tensors.items() if k.startswith("out.")}
    return case, saved, outputs, meta
