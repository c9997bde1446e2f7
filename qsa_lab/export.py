"""Export a figure for a bug report: PNG, SVG and PDF with the case, backend, GPU and
qsa_lab version embedded in each file's own metadata. Never overwrites silently.

The same figure and metadata give byte-identical files: no creation dates, a fixed seed for
the SVG element ids, and every file written whole through qsa_lab.outputs."""
from __future__ import annotations

import json
import re
from pathlib import Path

from .outputs import check_folder, writing

FORMATS = ("png", "svg", "pdf")
SVG_HASHSALT = "qsa_lab"  # seeds the SVG element ids, which matplotlib otherwise draws at random
META_KEYS = ("case", "backend", "gpu", "qsa_lab_version")


def gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken CUDA install still lets the figure be saved
        pass
    return "none (CPU)"


def full_meta(meta: dict | None) -> dict:
    """meta plus defaults for the four required keys (gpu and version filled in here)."""
    from . import __version__

    out = {"case": "", "backend": "", "gpu": gpu_name(), "qsa_lab_version": __version__}
    out.update({k: str(v) for k, v in (meta or {}).items()})
    return out


def _paths(out_dir: Path, name: str, suffix: int | None) -> dict:
    stem = name if suffix is None else f"{name}-{suffix}"
    return {f: out_dir / f"{stem}.{f}" for f in FORMATS}


def export_figure(fig, name: str, meta: dict | None = None, out_dir="figures", overwrite: bool = False,
                  dpi: int = 150) -> list[Path]:
    """Write `fig` as out_dir/name.{png,svg,pdf} -> [png, svg, pdf] paths.

    meta: {"case", "backend", ...}; "gpu" and "qsa_lab_version" are filled in when absent.
    If any of the three files exists and overwrite is False, the first free numbered
    stem name-1, name-2, ... is used instead (all three files share it).
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*", name):
        raise ValueError(f"name: must be a plain file stem ([A-Za-z0-9_.+-], not starting with '.': no hidden "
                         f"files), got {name!r}")
    out_dir = check_folder(out_dir, "out_dir", create=True, parents=True)
    m = full_meta(meta)
    blob = json.dumps(m, sort_keys=True)
    title = f"qsa_lab {name}"
    # Date / CreationDate None: no timestamp, so the same inputs give the same bytes
    meta_of = {"png": {"Title": title, "Description": blob, "Software": "qsa_lab",
                       **{f"qsa_lab:{k}": v for k, v in m.items()}},
               "svg": {"Title": title, "Description": blob, "Creator": "qsa_lab", "Date": None,
                       "Keywords": [f"{k}={v}" for k, v in m.items()]},
               "pdf": {"Title": title, "Subject": blob, "Creator": "qsa_lab", "CreationDate": None,
                       "Keywords": "; ".join(f"{k}={v}" for k, v in m.items())}}
    n = 0
    while True:
        paths = _paths(out_dir, name, n or None)
        if overwrite or not any(p.exists() or p.is_symlink() for p in paths.values()):
            try:
                return _write_all(fig, paths, meta_of, dpi, overwrite)
            except FileExistsError:
                if overwrite:
                    raise
        n += 1  # a file of this stem exists (or appeared while writing): the next number


def _write_all(fig, paths: dict, meta_of: dict, dpi: int, overwrite: bool) -> list[Path]:
    """All three files or none: a stem taken half-way is rolled back."""
    import matplotlib

    done = []
    try:
        with matplotlib.rc_context({"svg.hashsalt": SVG_HASHSALT}):
            for f in FORMATS:
                with writing(paths[f], "out_dir", force=overwrite) as tmp:
                    fig.savefig(tmp, format=f, dpi=dpi if f == "png" else "figure", metadata=meta_of[f])
                done.append(paths[f])
    except BaseException:
        if not overwrite:
            for p in done:
                p.unlink(missing_ok=True)
        raise
    return done


def read_png_meta(path) -> dict:
    """The qsa_lab metadata embedded in a PNG written by export_figure."""
    from PIL import Image

    with Image.open(path) as im:
        text = dict(im.text)
    return json.loads(text["Description"])
