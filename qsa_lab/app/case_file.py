"""Save a case and its route outputs as one safetensors file (`--save`), and load it back.

Loading trusts nothing in the file: it is read only if it is a regular file (a FIFO or a
device is refused before it is opened for reading, and it is opened non-blocking in case it
was swapped meanwhile), the safetensors header is parsed and checked here, and every tensor
and metadata field is checked against the geometry it claims. safetensors holds raw tensor
bytes and a JSON header only, so loading never executes code from the file.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

import torch

from qsa_lab.support.version import __version__
from qsa_lab.model.case import Case, Geometry, no_poison, validate_case
from qsa_lab.model.paged import SCALES, TENSORS
from qsa_lab.support.outputs import _show, check_output, writing
from qsa_lab.model.plan import GroupedPlan, plan_groups

#: the file holds the paged record's tensors by name (TENSORS) and its scales (SCALES) as 0-d float32
PLAN_TENSORS = ("plan.microblocks", "plan.masks", "plan.seq_len")
MAX_HEADER_BYTES = 1 << 24  # our headers are a few KiB; safetensors itself caps at 100 MB


ORIGINS = ("geometry", "custom")
#: every metadata key save() writes (older files: all but origin and checksum)
META_KEYS = ("geometry", "kv_dtype", "sm_scale", "qsa_lab_version", "poison", "backend", "k_scale", "v_scale",
             "origin", "checksum")


def save(result, path, overwrite: bool = False, arg: str = "path", origin: str | None = None) -> Path:
    """Write the case, the grouped plan before any fix and `out.<route>` for every route run.

    Refuses to replace an existing file unless overwrite=True; the file is written whole or
    not at all (qsa_lab.support.outputs). The header carries a sha256 checksum of everything else in
    the file, which load() verifies. origin: 'geometry' when the case is what build_case(its
    geometry) plus apply_poison(its poison record) give (load checks this), 'custom' for
    tensors of your own; None finds out by rebuilding the case.
    """
    path = check_output(path, arg, force=overwrite)
    blob = encode(result, origin)
    with writing(path, arg, force=overwrite) as tmp:
        tmp.write_bytes(blob)
    return path


def encode(result, origin: str | None = None) -> bytes:
    """The bytes save() writes (see there)."""
    from safetensors.torch import save as save_bytes

    if origin is not None and origin not in ORIGINS:
        raise ValueError(f"origin: must be one of {ORIGINS} or None, got {origin!r}")
    case, plan = result.case.to("cpu"), result.plan.to("cpu")
    tensors = {name: t.contiguous() for name, t in case.tensors().items()}
    tensors.update({name: torch.tensor(getattr(case, name), dtype=torch.float32) for name in SCALES})
    tensors["plan.microblocks"] = plan.microblocks.contiguous()
    tensors["plan.masks"] = plan.masks.contiguous()
    tensors["plan.seq_len"] = plan.seq_len.contiguous()
    for route, out in result.outputs.items():
        tensors[f"out.{route}"] = out.contiguous()
    meta = {"geometry": json.dumps(case.geometry.to_dict(), sort_keys=True), "kv_dtype": case.kv_dtype,
            "sm_scale": repr(case.sm_scale), "qsa_lab_version": __version__,
            "poison": json.dumps(case.poison, sort_keys=True), "backend": result.backend,
            # float32 0-d tensors cannot hold the exact double scale: keep it here too
            "k_scale": repr(case.k_scale), "v_scale": repr(case.v_scale),
            "origin": origin or ("geometry" if not rebuild_mismatch(case) else "custom")}
    return _sorted_header(save_bytes(tensors, metadata=meta), sign=True)


def checksum(header: dict, body: bytes) -> str:
    """'sha256:<hex>' of the header (without its checksum entry) and the tensor bytes after it."""
    import hashlib

    head = {k: v for k, v in header.items() if k != "__metadata__"}
    head["__metadata__"] = {k: v for k, v in (header.get("__metadata__") or {}).items() if k != "checksum"}
    h = hashlib.sha256(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
    h.update(body)
    return "sha256:" + h.hexdigest()


def sign(blob: bytes) -> bytes:
    """A safetensors file's bytes with the checksum of its current contents in its header (for
    files edited on purpose, e.g. saved outputs replaced to test a replay)."""
    return _sorted_header(blob, sign=True)


def _sorted_header(blob: bytes, sign: bool = False) -> bytes:
    """The same safetensors file with its header's keys sorted, so that the same case gives the
    same bytes (the library writes metadata in hash order), and with sign=True its checksum.
    Offsets count from the end of the header, so they stay valid; the header is padded to 8
    bytes as the format asks."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    if sign:
        header.setdefault("__metadata__", {})["checksum"] = checksum(header, blob[8 + n:])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + n:]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rebuild_mismatch(case: Case) -> list[str]:
    """What differs between `case` and build_case(case.geometry) poisoned as case.poison records
    (empty: the geometry and poison record describe these tensors exactly)."""
    from qsa_lab.model.case import build_case
    from qsa_lab.model.poison import ATTENDED_SITES, DIM_SITES, QUERY_SITE, apply_poison

    case = case.to("cpu")
    p = dict(case.poison)
    try:
        built = build_case(case.geometry)
        if p != built.poison:  # the CLI and apply_poison record the full poison; build_case a stub
            site = p.get("site")
            own_plane = site in ATTENDED_SITES or site == QUERY_SITE
            built = apply_poison(built, site, plane="v" if own_plane else p.get("plane", "v"),
                                 dims=p.get("dims") if site in DIM_SITES else None, seed=p.get("seed", 0),
                                 payload=p.get("payload"))
    except (TypeError, ValueError) as e:
        return [f"poison ({str(e).splitlines()[0]})"]
    bad = [k for k in TENSORS if not _same(getattr(case, k), getattr(built, k))]
    bad += [k for k in SCALES if getattr(case, k) != getattr(built, k)]
    if json.dumps(p, sort_keys=True) != json.dumps(built.poison, sort_keys=True):
        bad.append("poison")
    return bad


def _read_regular(path: Path, arg: str, max_bytes: int | None) -> bytes:
    """The bytes of a regular file; never blocks on a FIFO or a device."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{arg}: {_show(path)} does not exist") from None
    except OSError as e:
        raise ValueError(f"{arg}: {_show(path)}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{arg}: {_show(path)} is a folder, not a saved case")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{arg}: {_show(path)} is a special file (FIFO, device or socket), not a saved case")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ValueError(f"{arg}: cannot open {_show(path)}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # swapped for something else since the check
            raise ValueError(f"{arg}: {_show(path)} is not a regular file")
        if st.st_size == 0:
            raise ValueError(f"{arg}: {_show(path)} is empty")
        if max_bytes is not None and st.st_size > max_bytes:
            raise ValueError(f"{arg}: {_show(path)} is {st.st_size} bytes, above the memory budget of "
                             f"{max_bytes} (raise --max-memory)")
        return f.read()


def _header(data: bytes, path: Path, arg: str) -> dict:
    where = f"{arg}: {_show(path)}"
    if len(data) < 8:
        raise ValueError(f"{where} is not a safetensors file (only {len(data)} bytes; truncated?)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise ValueError(f"{where} is not a safetensors file (header of {n} bytes in a file of "
                         f"{len(data)}; truncated or another format)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{where} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where} is not a safetensors file (its header is not a JSON object)")
    return header


def _tensors(data: bytes, header: dict, path: Path, arg: str) -> dict:
    from safetensors.torch import load as load_bytes

    end = max((v["data_offsets"][1] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
               and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)), default=0)
    body = len(data) - 8 - struct.unpack("<Q", data[:8])[0]
    if end > body:
        raise ValueError(f"{arg}: {_show(path)} is truncated ({body} bytes of tensor data, the header "
                         f"promises {end})")
    try:
        return load_bytes(data)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type on any malformed header
        raise ValueError(f"{arg}: {_show(path)} is not a valid safetensors file "
                         f"({str(e).splitlines()[0][:200]})") from None


def _meta_json(meta: dict, key: str, where: str, kind=dict):
    try:
        value = json.loads(meta[key])
    except (ValueError, TypeError):
        raise ValueError(f"{where}: metadata '{key}' is not JSON") from None
    if not isinstance(value, kind):
        raise ValueError(f"{where}: metadata '{key}' must be a JSON {kind.__name__}")
    return value


def _meta_float(meta: dict, key: str, where: str) -> float:
    try:
        x = float(meta[key])
    except (ValueError, TypeError):
        raise ValueError(f"{where}: metadata '{key}' is not a number: {meta[key][:40]!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{where}: metadata '{key}' must be a finite number > 0, got {x!r}")
    return x


def load(path, arg: str = "path", max_bytes: int | None = None):
    """-> (case, plan, outputs{route: tensor}, metadata).

    Raises ValueError naming `arg` and what is wrong for anything that is not a complete case
    saved by qsa_lab (FileNotFoundError when nothing is there); never blocks on special files.
    """
    from qsa_lab.routes.run import ROUTES

    if path is None or not os.fspath(path).strip():
        raise ValueError(f"{arg}: empty path")
    path = Path(os.fspath(path))
    where = f"{arg}: {_show(path)}"
    data = _read_regular(path, arg, max_bytes)
    header = _header(data, path, arg)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{where}: malformed metadata (expected string values)")
    tensors = _tensors(data, header, path, arg)

    required = TENSORS + SCALES + PLAN_TENSORS
    missing = [k for k in required if k not in tensors]
    missing_meta = [k for k in ("geometry", "kv_dtype", "qsa_lab_version") if k not in meta]
    if missing or missing_meta:
        raise ValueError(f"{where} is not a qsa_lab case: missing "
                         + ", ".join([f"tensor {k}" for k in missing] + [f"metadata '{k}'" for k in missing_meta]))
    extra = [k for k in tensors if k not in required and not (k.startswith("out.") and k[4:] in ROUTES)]
    if extra:
        raise ValueError(f"{where}: unexpected tensor(s) {sorted(extra)[:5]}; routes are {list(ROUTES)}")
    outputs = {k[4:]: v for k, v in tensors.items() if k.startswith("out.")}
    if not outputs:
        raise ValueError(f"{where} holds no route outputs (out.<route>); nothing to replay")

    geo = _meta_json(meta, "geometry", where)
    try:
        geometry = Geometry.from_dict(geo)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: metadata 'geometry': {str(e).splitlines()[0]}") from None
    if meta["kv_dtype"] != geometry.kv_dtype:
        raise ValueError(f"{where}: metadata 'kv_dtype' {meta['kv_dtype']!r} contradicts the geometry's "
                         f"{geometry.kv_dtype!r}")
    if "sm_scale" in meta and not math.isclose(_meta_float(meta, "sm_scale", where), geometry.sm_scale,
                                               rel_tol=1e-12):
        raise ValueError(f"{where}: metadata 'sm_scale' {meta['sm_scale']} contradicts head_dim "
                         f"{geometry.head_dim} (expected {geometry.sm_scale!r})")
    scales = {}
    for k in SCALES:
        t = tensors[k]
        if t.dtype != torch.float32 or t.dim() != 0:
            raise ValueError(f"{where}: tensor {k} must be a 0-d float32, got {list(t.shape)} {t.dtype}")
        scales[k] = _meta_float(meta, k, where) if k in meta else float(t)
        if float(torch.tensor(scales[k], dtype=torch.float32)) != float(t):
            raise ValueError(f"{where}: metadata '{k}' {scales[k]!r} contradicts tensor {k} {float(t)!r}")
    poison = _meta_json(meta, "poison", where) if "poison" in meta else {}
    poison = {**no_poison(), **poison}

    case = Case(**{k: tensors[k] for k in TENSORS}, **scales, geometry=geometry, poison=poison)
    try:
        validate_case(case)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: tensor {str(e).splitlines()[0]}") from None
    _check_poison_record(poison, geometry, where)
    plan = plan_groups(case)
    for k in PLAN_TENSORS:
        t, ref = tensors[k], getattr(plan, k.split(".")[1])
        if t.dtype != torch.int32 or t.shape != ref.shape:
            raise ValueError(f"{where}: tensor {k} must be {list(ref.shape)} int32 for this case, "
                             f"got {list(t.shape)} {t.dtype}")
    shape = (geometry.rows, geometry.q_heads, geometry.head_dim)
    for route, t in outputs.items():
        if t.dtype != torch.float16 or tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor out.{route} must be {list(shape)} float16, got "
                             f"{list(t.shape)} {t.dtype}")
    saved = GroupedPlan(plan.members, plan.xqa_rows, tensors["plan.microblocks"], tensors["plan.masks"],
                        plan.categories, tensors["plan.seq_len"], geometry.q_heads)
    unknown = sorted(set(meta) - set(META_KEYS))
    if unknown:
        raise ValueError(f"{where}: metadata {unknown[0][:40]!r} is not one qsa_lab writes (damaged or edited?)")
    if "origin" in meta and "checksum" not in meta:   # origin and checksum came together: one is gone
        raise ValueError(f"{where}: metadata 'checksum' is missing from a file that has 'origin' (damaged or edited?)")
    if "checksum" in meta and meta["checksum"] != checksum(header, data[8 + struct.unpack("<Q", data[:8])[0]:]):
        raise ValueError(f"{where}: checksum mismatch: the file changed while it was read, or was edited or "
                         "damaged after it was saved (read it again once nothing writes it)")
    origin = meta.get("origin")
    if origin is not None and origin not in ORIGINS:
        raise ValueError(f"{where}: metadata 'origin' must be one of {ORIGINS}, got {origin[:40]!r}")
    if origin != "custom":
        bad = rebuild_mismatch(case)
        if bad:
            raise ValueError(f"{where}: its metadata does not describe its tensors: {', '.join(bad)} differ from "
                             f"what metadata 'geometry' (seed {geometry.seed}) and 'poison' (site "
                             f"{poison.get('site')!r}) build (a case of your own: io.save(..., origin='custom'))")
    return case, saved, outputs, meta


def _check_poison_record(poison: dict, geometry: Geometry, where: str) -> None:
    """The poison metadata names a real site and plane, and head dims of this geometry."""
    from qsa_lab.model.poison import PLANES, SITES

    if poison.get("site") not in SITES:
        raise ValueError(f"{where}: metadata 'poison' site must be one of {SITES}, got {poison.get('site')!r}")
    if poison.get("plane") not in (*PLANES, "q"):
        raise ValueError(f"{where}: metadata 'poison' plane must be one of {(*PLANES, 'q')}, "
                         f"got {poison.get('plane')!r}")
    for key in ("dims", "poisoned_dims", "nonfinite_dims"):
        dims = poison.get(key, [])
        if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                 and 0 <= d < geometry.head_dim for d in dims):
            raise ValueError(f"{where}: metadata 'poison' {key} must be a list of head dims in "
                             f"[0, {geometry.head_dim})")
