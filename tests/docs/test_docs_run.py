"""Every command and code block the README, the site's pages and notebooks/README.md show runs as
written, page by page, in a fresh folder, on the CPU; what a page shows a command printing is what
it prints, and what its prose says a command prints is checked against the command (CLAIMS).

A page's blocks run in order in one fresh folder (holding a copy of `examples/`, as a checkout
does), so a block may use a file an earlier one wrote. How each command is taken (tests/docs/shown.py
says how blocks are read):

- `qsa-lab ...`, `python -m qsa_lab...`, `python -` scripts, `pytest ...`: run; `--backend cuda`
  runs with `--backend emulate` in its place. Exit status: what the line's comment says
  (`# exit 1: ...`), else 0, or 0 or 1 for a leak check (canary, scribble, replay, pytest: 1 is a
  leak). Output lines shown under a `$ ` prompt must appear, in order (`...`: any text).
- `python benchmarks/...` / `python tools/...`: run from the checkout's copy, in the fresh folder;
  those listed in NOT_RUN (a GPU, minutes of work) are checked against their `--help` instead.
- Commands that need a GPU or a library this machine lacks (NOT_RUN) must say so where they are
  shown (their comment or the paragraph above the block names the GPU or the library); on a GPU
  `test_gpu_commands_run_as_shown` runs them as written.
- `make`, `pip`, `conda`, `source`, `module`, `export`: set-up, not run here (the README's first
  block runs in tests/docs/test_readme_commands.py; `make` targets must exist: test_docs.py).
- `cd DIR`: the block's next commands run there (the next block starts in the page's folder again).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shown import REPO, SHELL, Block, Command, blocks, pages, shell_blocks, where

TIMEOUT_S = 900
SETUP = ("make", "pip", "conda", "source", "module", "export")
LEAK_CHECKS = re.compile(r"^(qsa-lab (canary|scribble)\b|python -m qsa_lab\.canary\.replay\b|pytest\b|python -m pytest\b)")

#: (pattern of a command line, why it is not run here, a word its page must show beside it)
NOT_RUN = [
    (r"^qsa-lab bench\b", "GPU timings", "GPU"),
    (r"flashinfer:|vllm:|--vllm-src|sdpa-(efficient|cudnn|flash)\b", "a GPU and FlashInfer or vLLM", "GPU"),
    (r"^python (repro/\S+\.py|tools/ptx70_check\.py check)\b", "a GPU", "GPU"),
    (r"^bash benchmarks/", "a GPU machine's whole check", "GPU"),
    (r"^python scripts/upstream/", "a GPU and the op under test", "GPU"),
    (r"^qsa-lab lab\b", "JupyterLab, interactive (tests/e2e opens it)", None),
    (r"benchmarks/bench_cpu\.py", "minutes of timed whole processes beside a base commit", None),
    (r"benchmarks/bench_playground\.py", "minutes of timed redraws", None),
    (r"benchmarks/track\.py", "minutes of timed whole processes against their floors", None),
    (r"tools/ptx70_check\.py generate\b", "CUDA 12 NVRTC wheels (`pip install --group nvrtc`)", None),
    (r"benchmarks/tile_rig\.py (build|run)\b", "a GPU", "GPU"),
    (r"^python3? -m venv\b", "set-up: a new environment", None),
    (r"^VLLM_PYTHON=\S*gpu", "vLLM's CUDA wheel and a GPU", "GPU"),
    (r"tools/compare_commits\.py\b", "a git checkout holding both commits, and minutes per commit", None),
]


#: `make vllm-env` has built vLLM's environment here (`make test` does): the `--engine vllm` commands run
if not (REPO / ".venv-vllm" / ".qsa_lab-vllm").exists():
    NOT_RUN.append((r"--engine vllm\b", "vLLM's own environment (make vllm-env, which `make test` builds)", None))


def not_run(cmd: Command) -> tuple[str, str | None] | None:
    for pattern, why, word in NOT_RUN:
        if re.search(pattern, cmd.line):
            return why, word
    return None


def _env(folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["QSA_LAB_FIGURES"] = str(folder / "figures")
    return env


def argv_here(cmd: Command) -> list[str]:
    """The command as this test runs it: this interpreter for `python` and `qsa-lab`, a script of
    the checkout (benchmarks/, tools/) from the checkout, `--backend cuda` on the emulation."""
    argv = cmd.argv
    if cmd.program == "qsa-lab":
        argv = [sys.executable, "-m", "qsa_lab", *argv[1:]]
    elif cmd.program in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    elif cmd.program == "pytest":
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv[1:]]
    if len(argv) > 1 and argv[1].startswith(("benchmarks/", "tools/")):
        argv[1] = str(REPO / argv[1])
    return ["emulate" if a == "cuda" and argv[i - 1] == "--backend" else a for i, a in enumerate(argv)]


def expected_exit(cmd: Command) -> tuple[int, ...]:
    m = re.search(r"\bexit (\d+)\b", cmd.comment)
    if m:
        return (int(m.group(1)),)
    return (0, 1) if LEAK_CHECKS.search(cmd.line) else (0,)


def shows(printed: str, shown: list[str]) -> str | None:
    """None when every shown line appears in `printed`, in order ('...' matches any text); else
    the first shown line that does not."""
    lines = [" ".join(line.split()) for line in printed.splitlines()]
    i = 0
    for want in shown:
        pattern = re.compile(".*".join(re.escape(part) for part in " ".join(want.split()).split("...")))
        while i < len(lines) and not pattern.fullmatch(lines[i]):
            i += 1
        if i == len(lines):
            return want
        i += 1
    return None


#: commands that read only the checkout and write nothing (several pages show them: the vLLM scribble, install.md
#: and scribble.md): each runs once per test run, in a fresh folder of its own, and every page that shows it reads
#: that run (tests/run_once.py)
PURE = re.compile(r"^qsa-lab (canary|diff|doctor|scribble)(\s+(--?[\w-]+|[\w:,.+-]+|examples/[\w./:-]+))*$")
WRITES = re.compile(r"--(json|report|save|out|figures|case)\b")


def shared_run(shared, cmd: Command) -> tuple[int, str]:
    """(exit status, what it printed) of a PURE command, run once per test run."""
    from run_once import once_per_run

    def run(folder: Path) -> tuple[int, str]:
        out = subprocess.run(argv_here(cmd), cwd=fresh_folder(folder), env=_env(folder), capture_output=True,
                             text=True, timeout=TIMEOUT_S)
        return out.returncode, out.stdout + out.stderr
    return once_per_run(shared, "docs-cmd-" + hashlib.sha256(cmd.line.encode()).hexdigest()[:16], run)


def run_block(block: Block, folder: Path, shared=None) -> None:
    """Run one block in `folder` (the page's folder); `shared`: pytest's tmp_path_factory, for PURE commands."""
    if block.lang == "python":
        name = block.file_name()
        if name:
            (folder / name).write_text(block.body)
            return
        out = subprocess.run([sys.executable, "-"], input=block.body, cwd=folder, env=_env(folder),
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        assert out.returncode == 0, f"{block.where}: the python block exits {out.returncode}:\n{out.stderr[-3000:]}"
        return
    for cmd in block.commands():
        if cmd.program == "cd":
            folder, shared = folder / cmd.argv[1], None        # a PURE command's `examples/` is the page folder's
            assert folder.is_dir(), f"{block.where}: `{cmd.line}`: no such folder here"
            continue
        if cmd.program in SETUP:
            continue
        skip = not_run(cmd)
        if skip:
            why, word = skip
            assert word is None or word in cmd.comment or word in block.before, \
                f"{block.where}: `{cmd.line}` needs {why}, and neither its comment nor the paragraph above says {word}"
            if cmd.program in ("python", "python3") and cmd.argv[1].endswith(".py") and (REPO / cmd.argv[1]).exists():
                help_has_options(block, cmd)
            continue
        if shared is not None and PURE.match(cmd.line) and not WRITES.search(cmd.line):
            returncode, printed = shared_run(shared, cmd)
        else:
            out = subprocess.run(argv_here(cmd), cwd=folder, env=_env(folder), capture_output=True, text=True,
                                 timeout=TIMEOUT_S)
            returncode, printed = out.returncode, out.stdout + out.stderr
        assert returncode in expected_exit(cmd), \
            f"{block.where}: `{cmd.line}` exits {returncode}, expected {expected_exit(cmd)}:\n{printed[-3000:]}"
        missing = shows(printed, cmd.output)
        assert missing is None, f"{block.where}: `{cmd.line}` does not print\n  {missing}\nit printed:\n{printed[-3000:]}"


def help_has_options(block: Block, cmd: Command) -> None:
    """A script the test does not run still takes every option the page gives it."""
    out = subprocess.run([sys.executable, str(REPO / cmd.argv[1]), *[a for a in cmd.argv[2:3] if not a.startswith("-")],
                          "--help"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, f"{block.where}: `{cmd.argv[1]} --help` exits {out.returncode}: {out.stderr[-500:]}"
    for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", cmd.line):
        assert opt in out.stdout, f"{block.where}: `{cmd.line}`: {cmd.argv[1]} takes no {opt}"


def fresh_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "fresh"
    folder.mkdir()
    shutil.copytree(REPO / "examples", folder / "examples")
    return folder


RUN_PAGES = [p for p in pages() if any(b.lang == "python" or b.lang in SHELL for b in blocks(p))]


@pytest.mark.parametrize("page", RUN_PAGES, ids=where)
def test_a_page_runs_as_shown(page, tmp_path, tmp_path_factory):
    """Each block of the page, in order, in one fresh folder."""
    folder = fresh_folder(tmp_path)
    for block in blocks(page):
        if block.lang == "python" or block.lang in SHELL:
            run_block(block, folder, tmp_path_factory)


def test_every_block_says_what_it_is():
    """A shell block holds commands (or prompts and output); anything else names its language."""
    for page in pages():
        for block in shell_blocks(page):
            block.commands()                      # raises for a line that is no command


def test_the_runner_fails_a_wrong_output_and_a_wrong_exit():
    """The checks above can fail: a shown line the command does not print, an exit the comment does
    not state."""
    assert shows("a\nb 12 c\nd", ["b ... c", "d"]) is None
    assert shows("a\nb 12 c\nd", ["b 13 c"]) == "b 13 c"
    assert shows("d\nb 12 c", ["b ... c", "d"]) == "d"
    assert expected_exit(Command("qsa-lab canary", "exit 1: it leaks")) == (1,)
    assert expected_exit(Command("qsa-lab diff decode")) == (0,)
    assert argv_here(Command("qsa-lab canary --backend cuda"))[-2:] == ["--backend", "emulate"]


# ----------------------------------------------------------------------------------------- GPU

def _gpu_commands() -> list[tuple[str, Command]]:
    found = []
    for page in pages():
        for block in shell_blocks(page):
            for cmd in block.commands():
                skip = not_run(cmd)
                if (skip and skip[1] == "GPU" and cmd.program == "qsa-lab") or "--backend cuda" in cmd.line:
                    found.append((block.where, cmd))
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("where_, cmd", _gpu_commands(), ids=lambda x: x if isinstance(x, str) else x.line[:60])
def test_gpu_commands_run_as_shown(where_, cmd, tmp_path):
    """On a GPU: each `qsa-lab` command the pages mark as GPU-only runs as written (those naming
    FlashInfer or vLLM where that library is installed)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    for lib, module in (("flashinfer:", "flashinfer"), ("vllm:", "vllm")):
        if lib in cmd.line and importlib.util.find_spec(module) is None and "--vllm-src" not in cmd.line:
            pytest.skip(f"{module} is not installed")
    if "--vllm-src" in cmd.line:
        pytest.skip("needs a vLLM source checkout")
    folder = fresh_folder(tmp_path)
    env = _env(folder)
    if importlib.util.find_spec("qsa_lab").origin.startswith(str(REPO)):   # this checkout, installed or not
        env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-m", "qsa_lab", *cmd.argv[1:]], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode in expected_exit(cmd), f"{where_}: `{cmd.line}` exits {out.returncode}:\n{out.stderr[-3000:]}"


# ------------------------------------------------------------------------------ what prose says

@functools.lru_cache(maxsize=None)
def diff_json(args: str) -> dict:
    """`qsa-lab diff ARGS --json -`, parsed."""
    out = subprocess.run([sys.executable, "-m", "qsa_lab", "diff", *args.split(), "--json", "-"],
                         capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(Path("/nonexistent")))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def nan_of(args: str, route: str) -> int:
    return diff_json(args)["routes"][route]["nan_count"]


def dims_of(args: str, route: str) -> list[int]:
    return diff_json(args)["routes"][route]["nan_dims"]


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


@functools.lru_cache(maxsize=None)
def run_json(args: str) -> tuple[int, dict]:
    """`qsa-lab ARGS --json -` -> (exit status, the JSON)."""
    out = subprocess.run([sys.executable, "-m", "qsa_lab", *shlex.split(args), "--json", "-"], cwd=REPO,
                         capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(Path("/nonexistent")))
    assert out.stdout.strip(), f"`qsa-lab {args}` exits {out.returncode} with no JSON: {out.stderr[-2000:]}"
    return out.returncode, json.loads(out.stdout)


def leaks(args: str) -> set[tuple]:
    """The leaking cells of `qsa-lab canary|scribble ARGS` as (region, plane or check, verdict)."""
    _, doc = run_json(args)
    return {(r["region"], r.get("plane", r.get("check")), r["verdict"]) for r in doc["results"]
            if r["verdict"].endswith("-leak")}


def own_kernel_leaks(m) -> bool:
    line = m.group(1)
    fixed = line.replace(":paged_decode ", ":paged_decode_fixed ")
    found = leaks(line.removeprefix("qsa-lab "))
    return ({r for r, _, _ in found} == {"null-block", "stale-tail", "stale-microblock"}
            and {(p, v) for _, p, v in found} == {("v", "nan-leak")}
            and run_json(line.removeprefix("qsa-lab "))[0] == 1 and run_json(fixed.removeprefix("qsa-lab "))[0] == 0)


NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_every_notebook_has_its_row_in_the_tutorial_and_the_readme():
    for page in ("docs/tutorial/index.md", "README.md", "notebooks/README.md"):
        text = (REPO / page).read_text()
        for nb in NOTEBOOKS:
            assert re.search(rf"^\|[^|\n]*{nb.stem[:2]}(?!\d)", text, re.M), f"{page} has no row for {nb.name}"


def m_prod(m, *groups) -> int:
    out = 1
    for g in groups:
        out *= int(m.group(g))
    return out


#: (page, a pattern of the page's prose with the numbers it states, what they must equal). A
#: sentence rewritten without its number fails (the pattern no longer matches): rewrite the claim.
CLAIMS = [
    *[(page, r"(?i)\bas (\w+) notebooks|the (\w+) notebooks, executed",
       lambda m: NUMBERS.index((m.group(1) or m.group(2)).lower()) == len(NOTEBOOKS))
      for page in ("docs/tutorial/index.md", "docs/index.md")],
    ("README.md", r'it prints "(\d+) NaN bytes"',
     lambda m: int(m.group(1)) == diff_json("decode --poison targeted")["poison"]["nan_bytes"]),
    ("README.md", r"The unfixed `grouped` route shows (\d+) NaN on head dims ([\d, ]+) and (\d+)",
     lambda m: int(m.group(1)) == nan_of("decode --poison targeted", "grouped")
     and _numbers(m.group(2)) + [int(m.group(3))] == dims_of("decode --poison targeted", "grouped")
     and all(nan_of("decode --poison targeted", r) == 0 for r in diff_json("decode --poison targeted")["routes"]
             if r != "grouped")),
    ("README.md", r"`qsa-lab diff causal3 --poison stale-tail`: the pad-fix still shows (\d+) NaN",
     lambda m: int(m.group(1)) == nan_of("causal3 --poison stale-tail", "grouped+pad_fix")
     and nan_of("causal3 --poison stale-tail", "grouped+kernel_fix") == 0),
    ("README.md", r"(qsa-lab canary --kernel examples/mykernels\.py:paged_decode [^`\n]*?) ?#?\s*``` The second "
                  r"line checks a kernel of your own: .* so it exits 1 with NaN leaking from the null block and the "
                  r"stale tail; its `paged_decode_fixed` is clean", own_kernel_leaks),
    ("README.md", r"Unpadded, every region no request owns is clean, but `(paged\|eager)` lets one request's NaN reach "
                  r"every request batched with it; with the padded inputs CUDA graphs use \(`--pad` on the CPU\), "
                  r"NaN in the read-trash block reaches every request's logprobs",
     lambda m: run_json("scribble --payloads nan")[1]["engine"] == f"transformers:{m.group(1)}"
     and leaks("scribble --payloads nan") == {("other-requests", "read", "nan-leak")}
     and leaks("scribble --pad --regions read-trash --payloads nan") == {("read-trash", "read", "nan-leak")}),
    ("docs/index.md", r'it prints "(\d+) NaN bytes": (\d+) dims × (\d+) tokens',
     lambda m: int(m.group(1)) == diff_json("decode --poison targeted")["poison"]["nan_bytes"]
     == int(m.group(2)) * int(m.group(3))),
    ("docs/index.md", r"The unfixed `grouped` route shows (\d+) NaN on head dims ([\d, ]+) and (\d+)",
     lambda m: int(m.group(1)) == nan_of("decode --poison targeted", "grouped")
     and _numbers(m.group(2)) + [int(m.group(3))] == dims_of("decode --poison targeted", "grouped")),
    ("docs/index.md", r"The decode-like case gives the report's (\d+) NaN on its (\d+) dims exactly "
                      r"\((\d+) groups × (\d+) M-tiles × (\d+) rows × (\d+) dims\)",
     lambda m: int(m.group(1)) == nan_of("decode --poison targeted", "grouped")
     == m_prod(m, 3, 4, 5, 6) and int(m.group(2)) == len(dims_of("decode --poison targeted", "grouped"))),
    ("docs/index.md", r"\(`(qsa-lab diff causal3 [^`]*)`: 24 rows, 3 requests, scatter\) gives the report's (\d+)",
     lambda m: int(m.group(2)) == nan_of(m.group(1).removeprefix("qsa-lab diff "), "grouped")),
    ("docs/index.md", r"With other seeds \(`(--seed \d+)`, for one\) every M-tile receives padding and the "
                      r"count is (\d+) \((\d+) × (\d+) × (\d+)\)",
     lambda m: int(m.group(2)) == nan_of(f"causal3 --poison targeted {m.group(1)}", "grouped") == m_prod(m, 3, 4, 5)),
]



@pytest.mark.parametrize("page, pattern, check", CLAIMS, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(CLAIMS)])
def test_what_the_prose_says_a_command_prints(page, pattern, check):
    text = " ".join((REPO / page).read_text().split())
    m = re.search(pattern, text)
    assert m, f"{page} no longer says /{pattern}/: update the claim in tests/docs/test_docs_run.py"
    assert check(m), f"{page}: `{m.group(0)}` is not what the command prints"
