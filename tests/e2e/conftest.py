"""Fixtures for the JupyterLab end-to-end test: a private `jupyter lab` and a
headless Debian Chromium driven by Playwright.

Why these pieces:
- The server runs on 127.0.0.1 with a random free port and a random token, and
  every directory it could write to (config, data, runtime, lab settings and
  workspaces, IPython, matplotlib) is a temporary one, so the test neither
  reads a developer's own Jupyter set-up nor leaves anything behind.
- It serves a temporary *copy* of the repository's notebooks/, so running all
  cells in the browser cannot modify (or add outputs to) the committed files.
- Teardown must leave no stray process whatever happened: the server is asked
  to shut down (which stops its kernels), then its process group is killed,
  then any descendant recorded while it ran (kernels live in their own
  session, see jupyter_client.launcher) is killed by pid.
- Without Chromium or Playwright the test skips with the reason, except under
  CI=true, where a missing piece is a failure: `make test` installs both
  (scripts/setup_e2e.sh), so their absence in CI means the set-up broke.

Environment knobs (all optional):
  QSA_LAB_CHROMIUM        Chromium binary (default /usr/bin/chromium)
  QSA_LAB_E2E_NOTEBOOKS   folder to copy instead of the repo's notebooks/
  QSA_LAB_E2E_RESULTS     where screenshots go (default results/e2e/)
The rest of the environment passes through to the server, JUPYTER_PATH and
JUPYTER_CONFIG_PATH included: that is how a broken front-end can be staged to
prove the test fails (an ipywidgets 7 labextension earlier on JUPYTER_PATH, or
labconfig/page_config.json disabling @jupyter-widgets/jupyterlab-manager).
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qsa_lab.support import package_data

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("QSA_LAB_CHROMIUM", "/usr/bin/chromium"))
RESULTS = Path(os.environ.get("QSA_LAB_E2E_RESULTS", REPO / "results" / "e2e"))
NOTEBOOKS = Path(os.environ.get("QSA_LAB_E2E_NOTEBOOKS", package_data.locate("notebooks")))
LAB_CONFIG = REPO / "scripts" / "jupyter_lab_config.py"   # what `make lab` passes (absent in a wheel)

# What a sandboxed root machine without a GPU needs; --user-data-dir is given
# by launch_persistent_context (Playwright refuses it inside args).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

SERVER_START_TIMEOUT_S = 90
SERVER_STOP_TIMEOUT_S = 20

# Lab settings written into the temporary settings dir:
# - windowingMode "none": every cell stays in the DOM, so the test can read all
#   prompts and outputs without scrolling the virtualised notebook;
# - no news fetch and no update check: nothing reaches out, no toast covers
#   the notebook in a screenshot.
LAB_SETTINGS = {
    # autoStartDefaultKernel: without it Lab may ask "Select Kernel" in a dialog.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,
    },
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def skip_or_fail(reason: str) -> None:
    """Skip locally; fail under CI=true, where `make test` set everything up."""
    if _ci():
        pytest.fail(f"e2e prerequisite missing under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def _missing_prerequisite() -> str | None:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        return (f"no Chromium at {CHROMIUM} (run `bash scripts/setup_e2e.sh`, "
                "or set QSA_LAB_CHROMIUM)")
    for module in ("playwright.sync_api", "jupyterlab"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{module} not importable ({exc}); run `bash scripts/setup_e2e.sh`"
    return None


# --------------------------------------------------------------------------
# process bookkeeping (by pid and start time, so a reused pid is never hit)
# --------------------------------------------------------------------------

def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of a live pid, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the name may hold spaces
    if fields[0] == "Z":  # a zombie has exited; only its parent's wait is left
        return None
    return int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
            starts[int(entry.name)] = stat[1]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def _alive(pid: int, start: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[1] == start


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the server if pytest itself dies (killed by a CI timeout,
    say), when no fixture teardown runs; jupyter lab then stops its kernels."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@dataclass
class LabServer:
    """A running `jupyter lab`; `url(path)` builds an authenticated URL."""

    proc: subprocess.Popen
    base_url: str
    token: str
    root_dir: Path
    figures_dir: Path
    log_path: Path
    seen: dict[int, int] = field(default_factory=dict)

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}{path.lstrip('/')}{sep}token={self.token}"

    def api(self, path: str):
        """GET /api/<path> -> decoded JSON."""
        self.remember_children()  # kernels come and go: note each for teardown
        with urllib.request.urlopen(self.url(f"api/{path}"), timeout=10) as resp:
            return json.load(resp)

    def log_tail(self, n: int = 40) -> str:
        return _tail(self.log_path, n)

    def remember_children(self) -> None:
        if self.proc.poll() is None:
            self.seen.update(_descendants(self.proc.pid))


def _wait_for_server(proc: subprocess.Popen, runtime: Path, log: Path) -> dict:
    """Block until the server has written its jpserver-<pid>.json and answers."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    info_file = runtime / f"jpserver-{proc.pid}.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with code {proc.returncode} "
                               f"before it served; its log ends:\n{_tail(log)}")
        if info_file.is_file():
            try:
                info = json.loads(info_file.read_text())
                with urllib.request.urlopen(
                        f"{info['url']}api/status?token={info['token']}", timeout=5) as resp:
                    if resp.status == 200:
                        return info
            except (ValueError, KeyError, OSError, urllib.error.URLError):
                pass  # half-written file or not listening yet
        time.sleep(0.25)
    raise RuntimeError(f"jupyter lab did not answer within {SERVER_START_TIMEOUT_S} s; "
                       f"its log ends:\n{_tail(log)}")


def _stop_server(server: LabServer) -> list[str]:
    """Stop the server and everything it started; returns what had to be forced."""
    notes: list[str] = []
    proc = server.proc
    server.remember_children()
    if proc.poll() is None and server.base_url:
        # The polite way: the server shuts its kernels down, then exits.
        req = urllib.request.Request(server.url("api/shutdown"), method="POST", data=b"")
        try:
            urllib.request.urlopen(req, timeout=5).close()
        except OSError as exc:
            notes.append(f"POST /api/shutdown failed: {exc}")
        try:
            proc.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            notes.append("server ignored /api/shutdown; killing its process group")
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)  # start_new_session=True: pgid == pid
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # Kernels run in sessions of their own: kill any survivor by pid.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = [pid for pid, start in server.seen.items() if _alive(pid, start)]
        if not left:
            break
        notes.append(f"{sig.name} to leftover pids {left}")
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p, server.seen[p]) for p in left):
            time.sleep(0.1)
    return notes


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def e2e_prerequisites() -> None:
    reason = _missing_prerequisite()
    if reason:
        skip_or_fail(reason)


@pytest.fixture(scope="session")
def results_dir() -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for old in [*RESULTS.glob("failure-*.png"), *RESULTS.glob("playground-*.png")]:
        old.unlink()  # this run's screenshots only, never a stale one beside them
    return RESULTS


@pytest.fixture(scope="module")
def lab_server(e2e_prerequisites, tmp_path_factory) -> LabServer:
    if not NOTEBOOKS.is_dir():
        skip_or_fail(f"no notebooks folder at {NOTEBOOKS}")
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "work"
    shutil.copytree(NOTEBOOKS, root / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    if package_data.locate("data").is_dir():  # notebooks may read ../data; read-only use
        (root / "data").symlink_to(package_data.locate("data"), target_is_directory=True)
    dirs = {name: tmp / name for name in
            ("config", "data", "runtime", "settings", "workspaces", "ipython", "mpl", "figures")}
    for path in dirs.values():
        path.mkdir()
    for rel, value in LAB_SETTINGS.items():
        target = dirs["settings"] / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(value))

    env = dict(os.environ)
    env.update({
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        "IPYTHONDIR": str(dirs["ipython"]),
        "MPLCONFIGDIR": str(dirs["mpl"]),
        "QSA_LAB_FIGURES": str(dirs["figures"]),
        # the kernel must be this interpreter (kernel.json says plain "python")
        "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        "PYTHONUNBUFFERED": "1",
        "QSA_LAB_SMALL": "1",  # the notebooks' CI switch: shorter context, same findings
    })
    token = secrets.token_hex(24)
    cmd = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={_free_port()}",
        "--ServerApp.port_retries=0",  # a taken port fails loudly, never moves
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root / 'notebooks'}",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.news_url=",
        "--ServerApp.shutdown_no_activity_timeout=900",  # a backstop if all else fails
        "--LabApp.extension_manager=readonly",  # no PyPI queries from the lab
        "--KernelManager.shutdown_wait_time=3",
    ]
    if LAB_CONFIG.is_file():  # as `make lab` starts it: notebooks served and saved as committed
        cmd.append(f"--config={LAB_CONFIG}")
    if os.geteuid() == 0:  # CI containers and many GPU nodes run as root
        cmd.append("--allow-root")
    log_path = tmp / "jupyter-lab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=root, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
    server = None
    try:
        info = _wait_for_server(proc, dirs["runtime"], log_path)
        server = LabServer(proc=proc, base_url=info["url"], token=token,
                           root_dir=root / "notebooks", figures_dir=dirs["figures"],
                           log_path=log_path)
        yield server
    finally:
        notes = _stop_server(server or LabServer(proc, "", token, root, dirs["figures"], log_path))
        if notes:
            print("e2e teardown:", "; ".join(notes))
        if server is not None:
            left = [pid for pid, start in server.seen.items() if _alive(pid, start)]
            assert not left, f"processes left after shutting jupyter lab down: {left}"


@pytest.fixture(scope="module")
def browser_context(e2e_prerequisites, tmp_path_factory):
    """A fresh-profile headless Chromium (Playwright persistent context)."""
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1600, "height": 1200},
            timeout=60_000,
        )
        try:
            yield context
        finally:
            context.close()
