"""Output files: checked before any work, written whole, never replacing a user's file unasked.

Every writer in qsa_lab (`--json`, `--save`, `repro --out`, `--figures`, figure exports) goes
through here, so they share one set of rules:

- `check_output(path, arg)` runs before any work: an empty path, a name ending in `/`, a
  folder, a special file (FIFO, device, socket), a missing or unwritable parent folder, or an
  existing file without `force` is a ValueError naming `arg`.
- `writing(path)` hands the caller a temporary file beside the target and, once the caller
  has written it whole, publishes it: without `force` by a hard link, which fails if a file
  appeared at the path meanwhile (it is kept, FileExistsError); with `force` by an atomic
  rename. A reader never sees half a file, and a failed write leaves nothing behind (nor does
  Ctrl-C, SIGTERM or SIGHUP on the command line: qsa_lab.support.signals removes the temporary).
- The temporary file is created with mode 0o666, so the user's umask applies as for any
  program that creates a file.
- A symlink at the path counts as an existing file: refused without `force`, and with
  `force` the link itself is replaced by the new file, never written through (a link must
  not redirect a write somewhere the user did not name).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path


def _show(path) -> str:
    """A path as it can appear in a one-line message (newlines and control bytes escaped)."""
    text = os.fspath(path)
    return text if text.isprintable() else repr(text)


def _as_path(path, arg: str) -> Path:
    if path is None or (isinstance(path, str) and not path.strip()):
        raise ValueError(f"{arg}: empty path")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{arg}: expected a path, got {type(path).__name__}")
    text = os.fspath(path)
    if "\0" in text:
        raise ValueError(f"{arg}: path contains a NUL byte")
    if text.endswith(("/", os.sep)):
        raise ValueError(f"{arg}: {_show(text)} names a folder (ends with '/'); give a file name")
    return Path(text)


def _lstat(path: Path, arg: str):
    try:
        return path.lstat()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise ValueError(f"{arg}: {_show(path)}: a parent is not a folder") from None
    except OSError as e:
        raise ValueError(f"{arg}: {_show(path)}: {e.strerror}") from None


def check_folder(path, arg: str, create: bool = False, parents: bool = False) -> Path:
    """An output folder: exists, or its parent does (it is made only with create=True;
    parents=True also makes missing parents, for callers in Python that name a new tree)."""
    if path is None or (isinstance(path, str) and not path.strip()):
        raise ValueError(f"{arg}: empty path")
    folder = Path(os.fspath(path))
    st = _lstat(folder, arg)
    if st is not None:
        if not folder.is_dir():
            raise ValueError(f"{arg}: {_show(folder)} exists and is not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"{arg}: cannot write in folder {_show(folder)}")
        return folder
    if parents and create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{arg}: cannot create {_show(folder)}: {e.strerror}") from None
        return folder
    parent = folder.parent
    if not parent.is_dir():
        raise ValueError(f"{arg}: folder {_show(parent)} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{arg}: cannot create {_show(folder)}: folder {_show(parent)} is not writable")
    if create:
        folder.mkdir(exist_ok=True)
    return folder


def check_output(path, arg: str, force: bool = False) -> Path:
    """Refuse, before any work, a path a file cannot be written to (ValueError naming arg)."""
    path = _as_path(path, arg)
    st = _lstat(path, arg)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{arg}: {_show(path)} is a folder")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise ValueError(f"{arg}: {_show(path)} is a special file (FIFO, device or socket)")
        if not force:
            if stat.S_ISLNK(st.st_mode):
                raise ValueError(f"{arg}: {_show(path)} exists as a symlink (add --force to replace the link itself)")
            raise ValueError(f"{arg}: {_show(path)} exists (add --force to replace it)")
    parent = path.parent
    pst = _lstat(parent, arg)
    if pst is None:
        raise ValueError(f"{arg}: folder {_show(parent)} does not exist")
    if not parent.is_dir():
        raise ValueError(f"{arg}: {_show(parent)} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{arg}: cannot write in folder {_show(parent)}")
    return path


def check_distinct(paths: dict) -> None:
    """{arg: path}: refuse two outputs that name the same file."""
    seen = {}
    for arg, path in paths.items():
        if path is None:
            continue
        key = os.path.realpath(os.fspath(path))
        if key in seen:
            raise ValueError(f"{arg}: same file as {seen[key]} ({_show(path)})")
        seen[key] = arg


def _publish(tmp: Path, path: Path, force: bool, arg: str) -> None:
    if force:
        if path.is_dir() and not path.is_symlink():
            raise ValueError(f"{arg}: {_show(path)} became a folder during the run")
        os.replace(tmp, path)      # replaces a symlink itself, never its target
        return
    try:
        os.link(tmp, path)         # atomic and exclusive: fails if anything is there now
    except FileExistsError:
        raise FileExistsError(f"{arg}: {_show(path)} appeared during the run; kept it "
                              "(add --force to replace it)") from None
    except OSError:
        # a filesystem without hard links: exclusive create, then copy the finished bytes in
        with open(path, "xb") as dst, open(tmp, "rb") as src:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    tmp.unlink()


@contextlib.contextmanager
def writing(path, arg: str = "path", force: bool = False):
    """Yield a temporary Path beside `path` (same suffix) to write whole; publish it on success.

    On any error inside the block the temporary file is removed and `path` is untouched.
    """
    from qsa_lab.support import signals

    path = _as_path(path, arg)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp{path.suffix}")
    signals.track(tmp)  # a signal from here on removes it (qsa_lab.support.signals), before it even exists
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 & ~umask
        os.close(fd)
        yield tmp
        _publish(tmp, path, force, arg)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        signals.untrack(tmp)


def write_bytes(path, data: bytes, arg: str = "path", force: bool = False) -> Path:
    with writing(path, arg, force) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path, text: str, arg: str = "path", force: bool = False) -> Path:
    return write_bytes(path, text.encode("utf-8"), arg, force)
