"""The documentation stays true to the code: the site builds with warnings as errors, every
`qsa-lab` command and option the README and the docs pages show exists in the parser, every
documented Python name still resolves, the README stays short, and the commands a new user copies
from them run (tests/docs/test_readme_commands.py runs the README's first block as written)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import shown

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 150


def hook():
    """docs/hooks/qsa_docs.py: the one place the docs name the CLI module and the evidence folder."""
    spec = importlib.util.spec_from_file_location("qsa_docs", DOCS / "hooks" / "qsa_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    """README, notebooks/README.md and every Markdown page of the site (the generated parts are
    markers in them)."""
    return shown.pages()


def _fences(text: str):
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def commands(page: Path) -> list[str]:
    """The `qsa-lab ...` lines of the page's shell blocks, as tests/docs/shown.py reads them."""
    return [shlex.join(c.argv) for b in shown.shell_blocks(page) for c in b.commands() if c.program == "qsa-lab"]


def _inline_spans(text: str) -> list[str]:
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", outside)


def documented_commands() -> list[tuple[str, str]]:
    return [(p.relative_to(REPO).as_posix(), c) for p in pages() for c in commands(p)]


# --------------------------------------------------------------------------- the README

def test_readme_fits_on_two_screens():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_readme_reaches_the_first_command_the_notebooks_and_the_canary_early():
    text = README.read_text()
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("qsa-lab "))
    assert first < 20, "the first command is more than a screen down"
    for word in ("make lab", "qsa-lab canary", "make demo", "make test", "make docs", "pip install",
                 "conda env create -f environment.yml", "V100"):
        assert word in text, f"README.md no longer shows {word!r}"


def test_readme_links_and_image_point_at_files_that_exist():
    text = README.read_text()
    for target in re.findall(r"\]\(((?!https?://)[^)#\s]+)", text):
        assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def test_the_make_targets_the_docs_show_exist():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for page in pages():
        for lang, body in _fences(page.read_text()):
            for target in re.findall(r"^make ([\w-]+)", body, re.M):
                assert target in targets, f"{page.name} shows `make {target}`, which the Makefile lacks"


def glued_lists(text: str) -> list[tuple[int, str]]:
    """(line, text) of every list that starts right under a paragraph line: Markdown reads it as
    more of the paragraph (one run-on line on the site), so a list needs a blank line above it."""
    bad, in_list, prev, fence = [], False, "", False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence, prev = not fence, line
            continue
        if fence:
            continue
        item = re.match(r"\s*(?:[-*+]|\d+\.)\s", line)
        if item and prev.strip() and not in_list and not prev.lstrip().startswith(("#", "<!--", "|")):
            bad.append((n, line))
        in_list = bool(item) or (in_list and bool(line.strip()))
        prev = line
    return bad


def test_every_list_renders_as_a_list():
    assert glued_lists("Some words:\n- one\n- two\n") == [(2, "- one")]          # the check can fail
    assert glued_lists("Some words:\n\n- one\n  more\n- two\n") == []
    found = [f"{shown.where(p)}:{n}: {line[:60]}" for p in pages() for n, line in glued_lists(p.read_text())]
    assert not found, "a list right under a paragraph line (add a blank line above it):\n" + "\n".join(found)


# --------------------------------------------------------------------------- the CLI

def test_every_documented_command_parses():
    """A `qsa-lab ...` line of the README or a docs page with an option the parser lost (or a
    value it no longer takes) fails here, naming the page."""
    q = hook()
    cli = importlib.import_module(q.CLI_MODULE)
    found = documented_commands()
    assert len(found) >= 10, found                       # the collector itself still finds them
    for where, line in found:
        argv = shlex.split(line)[1:]
        argv = [a for a in argv if a not in ("|", ">")]
        try:
            cli.parse_args(argv)
        except SystemExit as e:                          # --help
            assert e.code == 0, f"{where}: `{line}` exits {e.code}"
        except Exception as e:                           # UsageError: one line naming the option
            pytest.fail(f"{where}: `{line}` no longer parses: {e}")


#: options the pages show that belong to other programs, with where they come from
OTHER_PROGRAMS = {
    "--extra-index-url": "pip", "--force-reinstall": "pip", "--no-deps": "pip", "--group": "pip", "--strict": "mkdocs",
    "--allow-root": "jupyter", "--ip": "jupyter",
    "--ptx": "tools/ptx70_check.py", "--log": "tools/ptx70_check.py",
    "--evidence": "benchmarks/bench_cpu.py", "--reps": "benchmarks/bench_cpu.py and qsa-lab bench",
    "--index-url": "pip",
    "--tensor-cores": "a leak report's generated FlashInfer decode script (repro/*.py)",
    "--verdict-map": "tools/compare_commits.py and tools/compare_verdicts.py",
    "--workaround": "the scribble's standalone scripts (examples/scribble/*.py)",
    "--cuda-graph": "the scribble's standalone transformers script (examples/scribble/*.py)",
    "--params": "the scribble's standalone scripts (examples/scribble/*.py)",
    "--any-version": "the scribble's standalone scripts (examples/scribble/*.py)",
}


def test_every_documented_option_is_in_the_parser():
    """An option written in a page's prose (`--rows`, `--payload nan|inf`) or in a `qsa-lab` line
    must be one the parser takes: removing an option from the parser fails this test."""
    q = hook()
    plugin = (REPO / "qsa_lab" / "canary" / "pytest_plugin.py").read_text()
    known = q.options(q.build_parser()) | set(re.findall(r'addoption\(\s*"(--qsa-[a-z-]+)"', plugin))
    missing = []
    for page in pages():
        text = page.read_text()
        spans = [s for s in _inline_spans(text) if s.startswith(("--", "qsa-lab "))]
        for chunk in spans + commands(page):
            for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", chunk):
                if opt not in known and opt not in OTHER_PROGRAMS:
                    missing.append(f"{page.relative_to(REPO)}: {opt} (in `{chunk}`)")
    assert not missing, "options the docs show but the parser lacks:\n" + "\n".join(missing)


def test_no_page_shows_a_plain_python_m_qsa_lab():
    """A plain `python -m qsa_lab` runs a qsa_lab.py lying in the current folder before any of the package's
    code: the pages, the notebooks and the generated CLI reference show `qsa-lab` or `python -I -m qsa_lab`."""
    texts = {str(p.relative_to(REPO)): p.read_text() for p in pages()}
    texts |= {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "notebooks").glob("*.ipynb"))}
    texts["the generated CLI reference"] = hook().cli_reference()
    plain = re.compile(r"python3? -m qsa_lab")
    shown_plain = [f"{name}: {line.strip()}" for name, text in texts.items() for line in text.splitlines()
                   if plain.search(line)]
    assert not shown_plain, "pages that show a plain python -m qsa_lab:\n" + "\n".join(shown_plain)


def test_the_cli_reference_is_generated_from_the_parser():
    q = hook()
    page = q.cli_reference()
    parser = q.build_parser()
    for name, sub in q.subcommands(parser).items():
        assert f"## `qsa-lab {name}`" in page
        for action in sub._actions:
            for opt in action.option_strings:
                if action.help == argparse.SUPPRESS:     # a removed option still accepted: in no help
                    assert f"`{opt}`" not in page, f"{opt} of {name} is removed but still in the reference"
                elif opt not in ("-h", "--help"):
                    assert f"`{opt}`" in page, f"{opt} of {name} missing from the generated reference"
    assert "<!-- qsa:cli -->" in (DOCS / "cli.md").read_text()


# --------------------------------------------------------------------------- the Python API

def _dotted_names() -> list[tuple[str, str]]:
    names = []
    for page in pages():
        text = page.read_text()
        for m in re.finditer(r"^::: (qsa_lab[\w.]*)", text, re.M):
            names.append((page.name, m.group(1)))
        for span in _inline_spans(text):
            for m in re.finditer(r"(?<![\w/])(qsa_lab(?:\.\w+)+)(?![\w/-])", span):
                names.append((page.name, m.group(1)))
        for _, body in _fences(text):                    # python -m qsa_lab.x, imports, plugin names
            for m in re.finditer(r"(?:-m |-p |from |import |\")(qsa_lab(?:\.\w+)+)", body):
                names.append((page.name, m.group(1)))
    return names


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_documented_api_name_resolves():
    """`::: qsa_lab.x` on the API page and every `qsa_lab.x.y` the pages name: a name that
    disappears (or moves without the docs) fails here, before the site build does."""
    names = _dotted_names()
    api = [n for page, n in names if page == "api.md"]
    for public in ("qsa_lab.build_case", "qsa_lab.Geometry", "qsa_lab.apply_poison", "qsa_lab.plan_groups",
                   "qsa_lab.pad_fix", "qsa_lab.ROUTES", "qsa_lab.run_routes", "qsa_lab.fp8.decode",
                   "qsa_lab.fp8.encode", "qsa_lab.canary.run_canary", "qsa_lab.canary.assert_no_leak",
                   "qsa_lab.canary.PagedCall", "qsa_lab.canary.register_kernel", "qsa_lab.canary.KernelSkipped",
                   "qsa_lab.canary.AttentionSpec", "qsa_lab.canary.canary_case", "qsa_lab.canary.load_case",
                   "qsa_lab.canary.pytest_plugin"):
        assert public in api, f"the API page no longer documents {public}"
    gone = sorted({f"{page}: {n}" for page, n in names if not _resolves(n)})
    assert not gone, "documented names that no longer exist:\n" + "\n".join(gone)
    q = hook()
    for n in api:
        assert q.resolve(n).startswith("qsa_lab"), n


# --------------------------------------------------------------------------- generated parts

def test_generated_tables_come_from_the_committed_evidence():
    q = hook()
    for name, make in q.PERF.items():
        text = make()
        assert any(f"`{d}/" in text for d in q.EVIDENCE_DIRS), f"{name}: the table does not name its source"
    bench = json.loads(q.evidence("bench_h200.json").read_text())
    ms = bench["report_geometry"]["ms"]["unfixed"]
    assert f"{ms:.3f}" in q.perf_h200()                 # the number on the page is the file's
    assert "LEAK REPRODUCED" in q.log_section(
        'canary_thirdparty_h200.log "== python scripts/flashinfer_decode_window_nan.py --kv-dtype fp16"')
    fi = json.loads(q.evidence("canary_other_rows_flashinfer_h200.json").read_text())
    rows = q._matrix_rows(fi["runs"])                    # the per-row FlashInfer table: each run once, as filed
    assert sum(len(r[3].split(", ")) + r[3].count(";") for r in rows) == len(fi["runs"])
    assert {r[2] for r in rows} == {r["summary"] for r in fi["runs"]}
    page = q.other_rows()
    assert all(f"| {r[0]} | {r[1]} | {r[2]} |" in page for r in rows)
    for page in pages():                                 # every marker expands (an unknown one raises)
        q.expand(page.read_text())


def test_doctor_verdicts_on_the_install_page_are_computed():
    q = hook()
    text = q.doctor_table()
    assert text.count("\n| ") == len(q.DOCTOR_STATES) + 1
    assert "conda env create -f environment.yml" in text and "torch==2.14.1+cu126" in text
    assert "<!-- qsa:doctor -->" in (DOCS / "install.md").read_text()


# (the commands and code blocks the pages show run in tests/docs/test_docs_run.py)


# --------------------------------------------------------------------------- the site

@pytest.mark.docs
def test_the_site_builds_with_warnings_as_errors(built_site):
    """`mkdocs build --strict`: a broken link or anchor, a missing page, an API name mkdocstrings
    cannot find, a notebook cell that raises or a marker the hook cannot expand fails it; no
    warning of the build's own (a notebook kernel's included) reaches its output."""
    assert built_site["returncode"] == 0, built_site["stderr"]
    assert "WARNING" not in built_site["stderr"].replace("WARNING: Location", ""), built_site["stderr"]
    site = Path(built_site["site"])
    cli = (site / "cli" / "index.html").read_text()
    assert "qsa-lab canary" in cli and "--poison" in cli
    for nb in sorted((REPO / "notebooks").glob("0*.ipynb")):
        html = (site / "tutorial" / nb.stem / "index.html").read_text()
        assert "Conclusion" in html, f"{nb.name}: rendered without its outputs"
        if nb.stem.startswith("03_"):            # the playground: a widget, interactive in Jupyter only
            continue
        assert figures_in(html), f"{nb.name}: the page shows no figure"
    # the README's figure is the one the code draws today
    import matplotlib.image as mpimg
    import numpy as np

    committed, drawn = mpimg.imread(DOCS / "assets" / "nan_map.png"), mpimg.imread(site / "assets" / "nan_map.png")
    assert committed.shape == drawn.shape, "docs/assets/nan_map.png is stale: python docs/hooks/qsa_docs.py --readme-figure"
    assert float(np.abs(committed - drawn).mean()) < 0.01, "docs/assets/nan_map.png is stale"


def figures_in(html: str) -> list[tuple[int, int]]:
    """(width, height) of every inline PNG of a page at least 100 px wide: figures, not icons."""
    import base64
    import struct

    sizes = []
    for data in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html):
        head = base64.b64decode(data[:40] + "=" * (-len(data[:40]) % 4))
        width, height = struct.unpack(">II", head[16:24])
        if width >= 100:
            sizes.append((width, height))
    return sizes


def test_the_performance_and_findings_tables_carry_no_internal_notes():
    """Provenance (the commits measured, a round's note, the targets it was measured against, raw
    load lists, a lent GPU's id) is in evidence/README.md, not on the pages a reader sees."""
    q = hook()
    bench = json.loads(q.evidence("bench_cpu.json").read_text())
    pages_text = "\n".join(q.expand((DOCS / name).read_text()) for name in ("performance.md", "findings.md"))
    for commit in bench["commits"].values():
        assert commit[:7] not in pages_text, commit
    assert bench.get("note", "")[:20] not in pages_text
    for word in (r"round \d", r"\btargets?\b", "UUID", "GPU-[0-9a-f]{8}-", r"\bNote:"):
        assert not re.search(word, pages_text), word
    assert not re.search(r"load \[[\d., ]+\]", pages_text), "a raw load list"


def test_the_build_leaves_no_folder_or_variable_behind(monkeypatch):
    """What the hook sets up for a build (the kernels' socket folder, the notebooks' figure folder,
    their variables) is gone after it, so `mkdocs serve` builds again from the same start."""
    q = hook()
    for key in ("QSA_LAB_BACKEND", "QSA_LAB_FIGURES", "JUPYTER_CONFIG_PATH"):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    q.on_config({})
    made = [Path(os.environ["QSA_LAB_FIGURES"]), Path(os.environ["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0])]
    assert all(folder.is_dir() for folder in made) and os.environ["QSA_LAB_BACKEND"] == "emulate"
    q.on_post_build({})
    assert not any(folder.exists() for folder in made)
    assert dict(os.environ) == before


# --------------------------------------------------------------------------- what a reader sees

def visible_text(page: str, code: bool = True) -> str:
    """The text of an HTML page as a reader sees it, a line per block (code blocks, a page's and a
    notebook cell's source, left out unless `code`: a page may show a JSON document in a code block,
    on purpose; a notebook cell's output stays)."""
    import html

    text = re.sub(r"<script.*?</script>|<style.*?</style>", "", page, flags=re.S)
    if not code:
        text = re.sub(r"<div class=\"highlight[^\"]*\"><pre>.*?</pre></div>|<div class=\"clipboard-copy-txt\"[^>]*>.*?</div>",
                      "", text, flags=re.S)
    text = re.sub(r"<(br|/p|/div|/li|/tr|/h\d|/pre|/td|/th)\b[^>]*>", "\n", text)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


RAW_TABLE = re.compile(r"^[ \t]*\|.*\|[ \t]*$", re.M)          # a Markdown table row that never became a table
RAW_DICT = re.compile(r"^[ \t]*[\[(]?\{'[^']*': ", re.M)     # a Python dict's repr (a notebook cell's raw output)


def test_raw_tables_and_dicts_are_found():
    page = ("<p>| a | b |</p><table><tr><td>1</td></tr></table>"
            "<div class=\"jp-RenderedText jp-OutputArea-output\"><pre>{'backend': 'emulate'}</pre></div>"
            "<div class=\"highlight\"><pre><span></span><code>{'schema': 1}</code></pre></div>"
            "<div class=\"highlight-ipynb hl-python\"><pre>{'source': 1}</pre></div>"
            "<div class=\"clipboard-copy-txt\" id=\"cell-4\">{'source': 2}</div>")
    text = visible_text(page, code=False)
    assert RAW_TABLE.findall(text) == ["| a | b |"]
    assert RAW_DICT.findall(text) == ["{'backend': "]
    assert not RAW_TABLE.search(visible_text("<table><tr><td>| not a row</td></tr></table>"))


@pytest.mark.docs
def test_no_page_shows_a_raw_table_a_raw_dict_or_a_temporary_path(built_site):
    """Every built page: no Markdown table left as pipes (an unescaped `|` in a header did that),
    no Python dict printed raw by a notebook, no temporary folder of the build."""
    assert built_site["returncode"] == 0, built_site["stderr"]
    site = Path(built_site["site"])
    found = []
    for page in sorted(site.rglob("*.html")):
        text = visible_text(page.read_text(), code=False)
        found += [(str(page.relative_to(site)), "raw table", m[:100]) for m in RAW_TABLE.findall(text)]
        found += [(str(page.relative_to(site)), "raw dict", m[:100]) for m in RAW_DICT.findall(text)]
        found += [(str(page.relative_to(site)), "temporary path", m[:100])
                  for m in re.findall(r"\S*(?:/tmp/|qsa_docs_figures)\S*", text)]
    assert not found, found
    assert "Formatting signatures" not in built_site["stderr"], "make docs prints mkdocstrings' formatter note"


#: a fix as an item of a listing: a table row or list item that starts with it, a checkbox, a key
#: "A = `grouped+kernel_fix`"
LISTED = re.compile(r"(?:^[ \t]*[|*-][ \t]*`?(?:grouped\+)?|☑ |[A-Z+]+ = `grouped\+)([a-z_]+)", re.M)


def test_every_page_that_lists_fixes_lists_all_of_them():
    """A table, list or key (of the README, notebooks/README.md, a docs page with its generated
    parts, a notebook's text) that lists four or more of the fixes lists every one: the home page's
    table listed 7 of the 9 routes, notebook 04 and notebooks/README.md four fixes. (A table of
    measurements lists the routes measured: its rows are shapes, not routes.)"""
    from qsa_lab.routes import labels

    fixes = set(labels.FIXES)
    q = hook()
    texts = {p.name: q.expand(p.read_text()) for p in pages()}
    for nb in sorted((REPO / "notebooks").glob("0*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        texts[nb.name] = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    short = []
    for name, text in texts.items():
        for paragraph in re.split(r"\n\s*\n", text):          # a table or a list is one paragraph
            named = {m.group(1) for m in LISTED.finditer(paragraph)} & fixes
            if len(named) >= 4 and named != fixes:
                short.append((name, sorted(fixes - named), paragraph[:80]))
    assert not short, short
    assert "<!-- qsa:routes -->" in (DOCS / "index.md").read_text(), "the home page's route table is generated"
    table_ = q.routes_table()
    assert all(f"`{r}`" in table_ for r in labels.ROUTES) and len(labels.ROUTES) == 9


def test_the_home_page_tells_the_cross_request_story():
    text = (DOCS / "index.md").read_text()
    for words in ("Across requests", "qsa-lab cross-request", "request_groups", "finite_pv", "upstream_cross_request.md"):
        assert words in text, words


def test_each_notebook_has_one_title_the_navigation_s():
    """The site's navigation names a tutorial page as its notebook's own title does (05 had two)."""
    nav = dict(re.findall(r'^\s+- "(\d\d · [^"]+)": tutorial/(\S+\.ipynb)$', (REPO / "mkdocs.yml").read_text(), re.M))
    assert len(nav) == 7
    for title, file in nav.items():
        first = json.loads((REPO / "notebooks" / file).read_text())["cells"][0]["source"][0]
        assert first.startswith(f"# {title}"), (file, first, title)


def test_the_header_link_goes_to_no_bug_report():
    config = (REPO / "mkdocs.yml").read_text()
    assert "1Cat-vLLM/pull" not in config and "bug report" not in config


def test_install_page_installs_a_cpu_torch_on_the_pip_path_as_the_readme_does():
    line = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert line in README.read_text()
    install = (DOCS / "install.md").read_text()
    pip_path = install[install.index("## With pip"):]
    assert pip_path.index(line) < pip_path.index("pip install .")
