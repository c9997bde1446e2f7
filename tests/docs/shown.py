"""What the README, the site's pages and notebooks/README.md show a reader: their code blocks,
read the way a reader reads them (tests/docs/test_docs_run.py runs them, tests/docs/test_docs.py
checks their options).

A page's fenced blocks:

    ```python         run as a script; a first line `# NAME.py` writes it to NAME.py instead
                      (a module or a test file that a later block of the page uses)
    ``` / ```bash     shell: each line is a command (`#` starts a comment; a trailing `\\` joins
                      lines); with `$ ` prompts, the `$` lines are the commands and the lines under
                      a command are what it prints (`...` stands for any text)
    ```text / json    shown, never run (diagrams, schemas)

Every line of a shell block without prompts must start with a program a reader runs
(PROGRAMS); anything else is an error of the page, so a new block says what it is.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL = ("", "bash", "sh", "console")
SHOWN_ONLY = ("text", "json", "yaml", "toml", "diff", "ini")
#: the first word of a command line; `.venv/bin/...` counts as its program
PROGRAMS = ("qsa-lab", "python", "python3", "pytest", "make", "pip", "conda", "source", "cd", "bash", "module",
            "export", "unzip", "zip", "jupyter")


def pages() -> list[Path]:
    """README, notebooks/README.md and every Markdown page of the site."""
    return [REPO / "README.md", REPO / "notebooks" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def where(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@dataclass
class Command:
    line: str                  # as shown, continuations joined, comment and prompt dropped
    comment: str = ""          # its trailing `# ...`, the block's words about it
    output: list[str] = field(default_factory=list)   # the lines shown under a `$ ` prompt

    @property
    def argv(self) -> list[str]:
        """The words of the command, past any `NAME=value` settings before it (`env`)."""
        words = shlex.split(self.line)
        return words[len(self.env):]

    @property
    def env(self) -> dict:
        words = shlex.split(self.line)
        n = next((i for i, w in enumerate(words) if not ENV_SETTING.fullmatch(w)), len(words))
        return dict(w.split("=", 1) for w in words[:n])

    @property
    def program(self) -> str:
        """`.venv/bin/pip` (any `.venv*/bin/`) counts as `pip`."""
        first = self.argv[0] if self.argv else ""
        return first.rsplit("/", 1)[-1] if re.match(r"\.venv[\w-]*/bin/", first) else first


ENV_SETTING = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")


@dataclass
class Block:
    page: Path
    lang: str
    body: str
    lineno: int                # where the block starts in the page (1-based, the fence line)
    before: str                # the paragraph just above the block (what it says about the block)

    @property
    def where(self) -> str:
        return f"{where(self.page)}:{self.lineno}"

    def commands(self) -> list[Command]:
        """The shell block's commands; ValueError for a line that is neither command nor output."""
        body = self.body.replace("\\\n", " ")
        lines = body.splitlines()
        prompts = any(line.startswith("$ ") for line in lines)
        out: list[Command] = []
        for line in lines:
            if prompts:
                if line.startswith("$ "):
                    out.append(_command(line[2:]))
                elif line.strip() and out:
                    out[-1].output.append(line.strip())
                continue
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            cmd = _command(line)
            if cmd.program not in PROGRAMS:
                raise ValueError(f"{self.where}: `{line.strip()}` is not a command a reader runs "
                                 f"(a block that is not shell code needs a language: ```text, ```json)")
            out.append(cmd)
        return out

    def file_name(self) -> str | None:
        """A python block whose first line is `# NAME.py ...`: the file it is."""
        m = re.match(r"#\s*([\w.-]+\.py)\b", self.body)
        return m.group(1) if m else None


def _command(text: str) -> Command:
    m = re.search(r"\s+#\s?(.*)$", text)
    comment = m.group(1).strip() if m else ""
    line = text[:m.start()] if m else text
    return Command(" ".join(line.split()), comment)


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        head = text[:m.start()].rstrip("\n")
        para = head.split("\n\n")[-1]
        found.append(Block(page, m.group(1), m.group(2), head.count("\n") + 2 if head else 1, para))
    return found


def shell_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in SHELL]


def shown_commands() -> list[tuple[str, Command]]:
    """(where, command) for every command of every shell block of every page."""
    return [(b.where, c) for p in pages() for b in shell_blocks(p) for c in b.commands()]
