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

A folder of outputs (a leak report) is written the same way, whole: `check_new_folder` before
any work, then `writing_folder` hands the caller a fresh folder beside the target and renames
it into place once complete. An interrupted or failed run leaves nothing (the next run is not
refused); with `force` the old folder is replaced only when it holds nothing but the names the
writer owns and none of them is a symlink; a folder holding an input is never replaced.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

_ledgers: list[list] = []   # the open undone_on_failure blocks: [(path, an open descriptor of it)]


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
    made: list = []
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
    _record(path)       # after the unlink: the file is complete and its own


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


def check_new_folder(path, arg: str, force: bool = False, names=(), inputs: dict | None = None,
                     outputs: dict | None = None) -> Path:
    """Refuse, before any work, a folder `writing_folder` may not publish at `path` (ValueError
    naming arg): a symlink, a file, a folder that is not empty (without force), and with force
    one holding anything but `names` or any of them as a symlink; or one that holds an input
    ({option: path}: it would be replaced with the folder) or would hold another output of the
    command ({option: path}, e.g. --json: written first, it would block or be lost with the folder)."""
    if path is None or (isinstance(path, str) and not path.strip()):
        raise ValueError(f"{arg}: empty path")
    folder = Path(os.fspath(path))
    st = _lstat(folder, arg)
    for opt, given in (inputs or {}).items():
        if given is None:
            continue
        real, top = os.path.realpath(os.fspath(given)), os.path.realpath(folder)
        if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
            raise ValueError(f"{arg}: {_show(folder)} holds the input {opt} {_show(given)}; writing the folder "
                             "would replace it (choose another folder)")
    for opt, given in (outputs or {}).items():
        real, top = os.path.realpath(os.fspath(given or "")), os.path.realpath(folder)
        if given is not None and (real == top or real.startswith(top.rstrip(os.sep) + os.sep)):
            raise ValueError(f"{arg}: {_show(folder)} would hold the {opt} file {_show(given)}; the folder is written "
                             f"whole, so write {opt} outside it")
    if st is None:
        parent = folder.parent
        if parent.exists():
            check_folder(parent, arg)
        return folder               # missing parents are made when the folder is written
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{arg}: {_show(folder)} is a symlink; refusing to write through it")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{arg}: {_show(folder)} exists and is not a folder")
    entries = sorted(os.listdir(folder))
    if entries and not force:
        raise ValueError(f"{arg}: {_show(folder)} is not empty (add --force to replace it)")
    for name in entries:
        if name not in names:
            raise ValueError(f"{arg}: {_show(folder)} holds {_show(name)}, which this writer did not write; "
                             "kept the folder (choose another one)")
        if (folder / name).is_symlink():
            raise ValueError(f"{arg}: {_show(folder / name)} is a symlink; refusing to write through it")
    check_folder(folder, arg)
    return folder


@contextlib.contextmanager
def writing_folder(path, arg: str = "path", force: bool = False, names=(), inputs: dict | None = None):
    """Yield a new empty folder beside `path` to fill; on success it becomes `path` by a rename
    (with force an old folder of `names` only is replaced; without, one that appeared meanwhile
    is kept: FileExistsError). On any error, or a signal on the command line, it is removed."""
    import shutil

    from qsa_lab.support import signals

    folder = check_new_folder(path, arg, force, names, inputs)
    clean_leftovers(folder, arg)
    tmp = folder.with_name(f".{folder.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    signals.track(tmp)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(tmp, 0o777)       # 0o777 & ~umask, as any folder a program makes
        yield tmp
        old = None
        if folder.is_dir() and os.listdir(folder):
            check_new_folder(folder, arg, force, names, inputs)   # again: it may have changed during the run
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(folder, old)
        try:
            os.rename(tmp, folder)     # onto nothing or an empty folder: atomic
        except OSError:
            if old is not None:
                os.rename(old, folder)
            raise FileExistsError(f"{arg}: {_show(folder)} appeared during the run; kept it") from None
        _record(folder)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        signals.untrack(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:            # someone else's process: alive
        return True
    return True


def clean_leftovers(folder, arg: str = "path") -> list:
    """What a killed writing_folder left beside `folder` (SIGKILL, a power cut: no handler ran):
    `.NAME.partial-PID-*`, a folder being filled, is removed once process PID is gone;
    `.NAME.old-PID-*`, an earlier folder being replaced, is kept and reported, as is a leftover whose
    writer cannot be told (no PID in its name). Each is said in one warning. -> the messages."""
    import re
    import shutil
    import warnings

    folder = Path(folder)
    said = []
    pattern = re.compile(rf"\.{re.escape(folder.name)}\.(partial|old)-(?:(\d+)-)?[0-9a-f]{{8}}")
    try:
        entries = list(os.scandir(folder.parent))
    except OSError:
        return said
    for e in entries:
        m = pattern.fullmatch(e.name)
        if not m or not e.is_dir(follow_symlinks=False):
            continue
        kind, pid = m.group(1), m.group(2)
        if pid is not None and (int(pid) == os.getpid() or _alive(int(pid))):
            continue           # another run's folder, being written now
        if kind == "partial" and pid is not None:
            shutil.rmtree(e.path, ignore_errors=True)
            said.append(f"{arg}: removed {_show(e.path)}, a partial folder left by a run that was killed "
                        f"(process {pid})")
        elif pid is not None:
            said.append(f"{arg}: {_show(e.path)} holds the earlier folder that a run killed while replacing it "
                        f"(process {pid}) moved aside; kept (move it back or remove it)")
        else:
            said.append(f"{arg}: {_show(e.path)} is the {kind} folder of an older qsa_lab's run, which may still "
                        "be writing it; kept (remove it if none is)")
    for line in said:
        warnings.warn(line, stacklevel=3)
    return said


def write_together(items, force: bool = False) -> list:
    """[(path, bytes, arg)] -> their Paths, each written whole and all published together or none:
    a failure, or a signal before every temporary is written, leaves none of them (nor their
    temporaries); a signal after that waits until all are published (support.signals.Hold)."""
    from qsa_lab.support import signals

    hold = signals.Hold()
    with hold, undone_on_failure(), contextlib.ExitStack() as stack:
        for path, data, arg in items:
            stack.enter_context(writing(path, arg, force)).write_bytes(data)
        hold.start()
    return [Path(path) for path, _, _ in items]


def write_bytes(path, data: bytes, arg: str = "path", force: bool = False) -> Path:
    with writing(path, arg, force) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path, text: str, arg: str = "path", force: bool = False) -> Path:
    return write_bytes(path, text.encode("utf-8"), arg, force)


def check_no_links(folder, names, arg: str) -> None:
    """Refuse, naming it, an entry `names` of `folder` that is a symlink: a write must never
    follow one out of the folder it was given."""
    for name in names:
        p = Path(folder) / name
        if p.is_symlink():
            raise ValueError(f"{arg}: {_show(p)} is a symlink; refusing to write through it (remove the link)")
