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
- `undone_on_failure()` records every file and folder this process creates inside the block
  (by `writing`, `check_folder(create=True)`, `writing_folder`); when the block fails it removes
  exactly those, and only while each is still the one it made (same inode): a path that
  appeared during the run, another run's result above all, is never touched.
- `writing_folder(path)` hands the caller a temporary folder beside `path` to fill and renames
  it into place once complete: a reader never sees half a folder, and a failed or interrupted
  run leaves nothing (Ctrl-C, SIGTERM, SIGHUP: qsa_lab.support.signals removes it). Nothing is
  ever written through a symlink: a link at `path` is refused, naming it.
- `check_not_inside(folder, inputs)`: no output folder may equal or contain an input.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from pathlib import Path

_ledgers: list[list] = []   # the open undone_on_failure blocks: [(path, (st_dev, st_ino))]


def _record(path) -> None:
    """A file or folder this process just created: every open undone_on_failure block owns it.
    An open descriptor keeps its inode allocated, so no later file can reuse the inode number
    (tmpfs reuses one at once): (dev, inode) then tells it apart from anything made meanwhile."""
    if _ledgers:
        fd = os.open(path, getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_NOFOLLOW", 0))
        for made in _ledgers:
            made.append((os.fspath(path), fd))


def _same(fd: int, path) -> bool:
    a, b = os.fstat(fd), os.lstat(path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


@contextlib.contextmanager
def undone_on_failure():
    """Inside: every path created through this module is recorded. On an exception those paths
    are removed, newest first (a folder only when empty), each only while it is still the very
    file or folder this process made; then the exception goes on. A file replaced with force
    stays (its old bytes cannot come back), and nothing that appeared meanwhile is touched."""
    made: list = []    # (path, an open descriptor of what was made there)
    _ledgers.append(made)
    try:
        yield
    except BaseException:
        for path, fd in reversed(made):
            with contextlib.suppress(OSError):
                if not _same(fd, path):
                    continue            # not ours any more: someone else's now
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)      # only when empty: what others put in it stays
                else:
                    os.unlink(path)
        raise
    finally:
        _ledgers.remove(made)
        for fd in {fd for _, fd in made} - {fd for m in _ledgers for _, fd in m}:
            os.close(fd)


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
        missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{arg}: cannot create {_show(folder)}: {e.strerror}") from None
        for p in reversed(missing):
            _record(p)
        return folder
    parent = folder.parent
    if not parent.is_dir():
        raise ValueError(f"{arg}: folder {_show(parent)} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{arg}: cannot create {_show(folder)}: folder {_show(parent)} is not writable")
    if create:
        try:
            folder.mkdir()
            _record(folder)
        except FileExistsError:
            pass
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
        existed = os.path.lexists(path)
        os.replace(tmp, path)      # replaces a symlink itself, never its target
        if not existed:
            _record(path)
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
    _record(path)       # after the unlink: it changes the file's link count, and so its change time


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


def check_not_inside(folder, inputs: dict, arg: str) -> None:
    """{name: path}: refuse an output folder that is, or holds, one of the inputs."""
    if folder is None:
        return
    top = os.path.realpath(os.fspath(folder))
    for name, path in inputs.items():
        if path is None:
            continue
        real = os.path.realpath(os.fspath(path))
        if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
            raise ValueError(f"{arg}: {_show(folder)} holds the input {name} {_show(path)}; "
                             "write the output somewhere else")


def check_no_links(folder, names, arg: str) -> None:
    """Refuse, naming it, an entry `names` of `folder` that is a symlink: a write must never
    follow one out of the folder it was given."""
    for name in names:
        p = Path(folder) / name
        if p.is_symlink():
            raise ValueError(f"{arg}: {_show(p)} is a symlink; refusing to write through it (remove the link)")


def _rmtree(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


@contextlib.contextmanager
def writing_folder(path, arg: str = "path", force: bool = False):
    """Yield a new empty folder beside `path` (`.NAME.XXXX.tmp`) to fill; once the block ends
    without an error, rename it into place as `path`. Then:

    - `path` absent: the folder appears whole, in one rename;
    - `path` an existing folder: refused (FileExistsError) unless `force`, which swaps the new
      folder in and only then removes the old one (its files were asked to be replaced);
    - `path` a symlink, a file or a special file: refused before the block runs (ValueError);
      a folder that appeared during the run is kept and the new one dropped without `force`.

    On an error or a signal inside the block the temporary folder is removed: nothing is left.
    The folder is made with mode 0o777 & ~umask, like any folder a program creates."""
    from qsa_lab.support import signals

    if path is None or (isinstance(path, str) and not path.strip()):
        raise ValueError(f"{arg}: empty path")
    path = Path(os.fspath(path))      # a trailing '/' names the same folder
    st = _lstat(path, arg)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{arg}: {_show(path)} is a symlink; refusing to write through it (remove the link)")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{arg}: {_show(path)} exists and is not a folder")
    if st is not None and not force:
        raise FileExistsError(f"{arg}: {_show(path)} exists (add --force to replace it)")
    check_folder(path.parent, arg)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    signals.track_folder(tmp)   # a signal from here on removes it
    try:
        os.mkdir(tmp, 0o777)
        yield tmp
        _publish_folder(tmp, path, force, arg)
    finally:
        _rmtree(tmp)
        signals.untrack_folder(tmp)


def _publish_folder(tmp: Path, path: Path, force: bool, arg: str) -> None:
    st = _lstat(path, arg)
    if st is None:
        try:
            os.rename(tmp, path)   # fails on a non-empty folder or a file that appeared meanwhile
        except OSError as e:
            raise FileExistsError(f"{arg}: {_show(path)} appeared during the run; kept it ({e.strerror})") from None
        _record(path)
        return
    if not force or not stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
        raise FileExistsError(f"{arg}: {_show(path)} appeared during the run; kept it")
    old = path.with_name(f".{path.name}.{secrets.token_hex(4)}.old")
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        os.rename(old, path)       # put the old folder back: the run failed, nothing changed
        raise
    _rmtree(old)
