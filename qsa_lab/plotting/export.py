"""Export a figure for a bug report: PNG, SVG and PDF with the case, backend, GPU, qsa_lab
version, git commit and csrc/ hash embedded in each file's own metadata. Never overwrites
silently.

The same figure and metadata give byte-identical files: no creation dates, a fixed seed for
the SVG element ids, and every file written whole through qsa_lab.support.outputs. So re-running a
notebook reuses its earlier files instead of numbering copies: a new number is taken only when
the content differs (or replace with overwrite=True).

Every figure goes to one folder, figures_dir(): $QSA_LAB_FIGURES, else the checkout's figures/."""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from qsa_lab.support.machine import gpu_name
from qsa_lab.support.outputs import check_folder, writing
from qsa_lab.support.package_data import checkout, locate

FORMATS = ("png", "svg", "pdf")
SVG_HASHSALT = "qsa_lab"  # seeds the SVG element ids, which matplotlib otherwise draws at random
META_KEYS = ("case", "backend", "gpu", "qsa_lab_version", "git_commit", "csrc_sha256")
FIGURES_ENV = "QSA_LAB_FIGURES"


def figures_dir() -> Path:
    """The one folder figures go to: $QSA_LAB_FIGURES, else the checkout's figures/ (beside
    pyproject.toml), else ./figures for an installed package. Always absolute."""
    env = os.environ.get(FIGURES_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return (checkout() or Path.cwd()).resolve() / "figures"


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """The checkout's commit (with '+dirty' when tracked files differ), or 'unknown' for an
    installed package or outside git."""
    repo = checkout()
    if repo is None:
        return "unknown"
    try:
        run = functools.partial(subprocess.run, cwd=repo, capture_output=True, text=True, timeout=20)
        head = run(["git", "rev-parse", "HEAD"])
        if head.returncode:
            return "unknown"
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.lru_cache(maxsize=1)
def csrc_sha256() -> str:
    """SHA-256 over the kernel sources (file names and bytes, sorted): which kernels drew it."""
    CSRC = locate("csrc")
    files = sorted(p for p in Path(CSRC).glob("*") if p.is_file()) if Path(CSRC).is_dir() else []
    if not files:
        return "unknown"
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def full_meta(meta: dict | None) -> dict:
    """meta plus defaults for the required keys (gpu, version, commit and csrc hash filled in here)."""
    from qsa_lab.support.version import __version__

    out = {"case": "", "backend": "", "gpu": gpu_name(), "qsa_lab_version": __version__,
           "git_commit": git_commit(), "csrc_sha256": csrc_sha256()}
    out.update({k: str(v) for k, v in (meta or {}).items()})
    return out


def _paths(out_dir: Path, name: str, suffix: int | None) -> dict:
    stem = name if suffix is None else f"{name}-{suffix}"
    return {f: out_dir / f"{stem}.{f}" for f in FORMATS}


def export_figure(fig, name: str, meta: dict | None = None, out_dir="figures", overwrite: bool = False,
                  dpi: int = 150, tight: bool = False) -> list[Path]:
    """Write `fig` as out_dir/name.{png,svg,pdf} -> [png, svg, pdf] paths.

    meta: {"case", "backend", ...}; gpu, qsa_lab_version, git_commit, csrc_sha256 are filled in
    when absent. If the three files exist with exactly these bytes they are reused (nothing is
    written); if any differs and overwrite is False, the first free stem name-1, name-2, ... whose
    files are absent or identical is used instead (all three files share it). tight: crop the
    files to what the figure draws (a figure with fixed margins keeps no blank band).
    """
    _check_name(name)
    out_dir = check_folder(out_dir, "out_dir", create=True, parents=True)
    return save_rendered(render_figure(fig, name, meta, dpi, tight), out_dir, overwrite)


def show_png(png, fig=None) -> None:
    """In a notebook, show the PNG export_figure wrote in place of `fig`, at the size the inline
    backend gives the figure: the picture is the file itself, and `fig`, closed in pyplot, is not
    drawn twice more for its inline image (each draw solves its layout again)."""
    from IPython.display import Image, display

    width = None
    if fig is not None:
        import matplotlib.pyplot as plt

        width = round(fig.get_figwidth() * fig.dpi)
        plt.close(fig)
    display(Image(filename=str(png), width=width))


def _check_name(name) -> None:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*", name):
        raise ValueError(f"name: must be a plain file stem ([A-Za-z0-9_.+-], not starting with '.': no hidden "
                         f"files), got {name!r}")


@dataclass(frozen=True)
class Rendered:
    """A figure's three files, not yet written: name, full metadata, format -> bytes."""
    name: str
    meta: dict
    blobs: dict


def render_figure(fig, name: str, meta: dict | None = None, dpi: int = 150, tight: bool = False) -> Rendered:
    """The bytes export_figure writes for `fig` (the first half of it; save_rendered the second)."""
    _check_name(name)
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
    return Rendered(name, m, _render(fig, meta_of, dpi, tight))


def save_rendered(r: Rendered, out_dir="figures", overwrite: bool = False) -> list[Path]:
    """Write a rendered figure as export_figure does (reused, numbered or replaced) -> its paths."""
    out_dir = check_folder(out_dir, "out_dir", create=True, parents=True)
    n = 0
    while True:
        paths = _paths(out_dir, r.name, n or None)
        if not overwrite and all(p.is_file() and not p.is_symlink() and p.read_bytes() == r.blobs[f]
                                 for f, p in paths.items()):
            return list(paths.values())     # the same figure, already saved: no numbered copy
        if overwrite or not any(p.exists() or p.is_symlink() for p in paths.values()):
            try:
                return _write_all(r.blobs, paths, overwrite)
            except FileExistsError:
                if overwrite:
                    raise
        n += 1  # a different file of this stem exists (or appeared while writing): the next number


def _render(fig, meta_of: dict, dpi: int, tight: bool = False) -> dict:
    """format -> the file's bytes.

    The layout (constrained or tight) is solved once, for the PNG; the SVG and PDF draw the
    figure at those positions. Solving it again per format cost more than half the time (each
    solve draws the whole figure once more, and for a vector format first starts a file), and
    gave each format slightly different margins (text extents rounded at each format's dpi)."""
    import matplotlib

    out = {}
    engine = fig.get_layout_engine()
    # set_layout_engine(None) removes the engine only while rcParams ask for none by default
    with matplotlib.rc_context({"svg.hashsalt": SVG_HASHSALT, "figure.autolayout": False,
                                "figure.constrained_layout.use": False}):
        try:
            for f in FORMATS:
                buf = io.BytesIO()
                fig.savefig(buf, format=f, dpi=dpi if f == "png" else "figure", metadata=meta_of[f],
                            **({"bbox_inches": "tight", "pad_inches": 0.1} if tight else {}))
                out[f] = buf.getvalue()
                fig.set_layout_engine(None)   # laid out: the next formats keep these positions
        finally:
            fig.set_layout_engine(engine)     # the figure stays the caller's, laid out as before
    return out


def _write_all(blobs: dict, paths: dict, overwrite: bool) -> list[Path]:
    """All three files or none: a stem taken half-way is rolled back."""
    done = []
    try:
        for f in FORMATS:
            with writing(paths[f], "out_dir", force=overwrite) as tmp:
                tmp.write_bytes(blobs[f])
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
