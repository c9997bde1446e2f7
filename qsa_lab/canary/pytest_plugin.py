"""The canary in a kernel library's CI: one pytest test per region x plane x payload.

    # conftest.py
    pytest_plugins = ["qsa_lab.canary.pytest_plugin"]

    # test_leaks.py
    import pytest
    from my_lib import paged_decode

    def my_kernel(call):                    # a qsa_lab.canary.PagedCall -> [rows, q_heads, head_dim]
        return paged_decode(call.q, call.kv_cache, call.block_table, call.seq_lens, call.sm_scale)

    @pytest.mark.qsa_canary(my_kernel, attend="window:8", kv_heads=2, q_heads=8, head_dim=128)
    def test_no_leak(qsa_canary_cell):
        qsa_canary_cell.check()

`pytest` then runs test_no_leak[out-of-window-v-nan], test_no_leak[stale-tail-k-inf], ... one
per region of the spec x plane x payload. The canary runs once per marker (the first cell
runs it; the others read its results). A leak fails its test with a message naming the
kernel, region, plane, payload, the verdict and the NaN / Inf / changed counts; a cell the
call's inputs never reach, or a kernel that cannot run here (KernelSkipped), is skipped with
the reason; a kernel error fails every cell. A gate is never green on nothing: when no cell of
a marker ran a leak check at all (every cell n/a or skipped), its cells fail instead of
skipping, and a marked test that returns without calling `qsa_canary_cell.check()` fails.
`pytest --qsa-canary-report DIR` also writes a leak report (qsa_lab.canary.report) per leaking
marker, and the failure message gives the replay command of its smallest leaking call; a
report folder already there is kept (`--qsa-canary-report-force` replaces it).

A search instead of one case (qsa_lab.canary.leak_search): the marker `qsa_canary_search(kernel,
budget=200, seed=0, **pins)` and the fixture `qsa_canary_search`, whose check() fails with each
finding (its shrunk case and replay line) or when the search could judge nothing:

    @pytest.mark.qsa_canary_search(my_kernel, budget=200, attend="dense")
    def test_no_leak_anywhere(qsa_canary_search):
        qsa_canary_search.check()

Marker arguments: the kernel (a callable or a built-in name such as "flashinfer:decode"), then
the keywords of qsa_lab.canary.run_canary / canary_case: attend, kv_dtype, kv_heads, q_heads,
head_dim, page_size, rows, requests, context, query_len, seed, regions, payloads, planes,
backend, case, timeout (seconds one call of the kernel may take; default the CLI's, 600).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from qsa_lab.analysis.leaks import CLEAN, ERROR, FINITE_LEAK, INF_LEAK, LEAKS, NA, NAN_LEAK

CASE_KEYS = ("kv_heads", "q_heads", "head_dim", "page_size", "rows", "requests", "context", "query_len", "seed",
             "topk", "free_pages", "mla", "v_head_dim")
#: the option a marker's kernel name came from, in its errors
MARKER = "qsa_canary marker"
RUN_KEYS = ("attend", "kv_dtype", "regions", "payloads", "planes", "backend", "case", "dims", "timeout")
_runs: dict = {}


def pytest_addoption(parser):
    parser.addoption("--qsa-canary-report", metavar="DIR", default=None,
                     help="qsa_lab canary: write a leak report (with replayable calls) per leaking kernel under DIR")
    parser.addoption("--qsa-canary-report-force", action="store_true", default=False,
                     help="qsa_lab canary: replace a leak report already under DIR (default: keep it)")


def pytest_configure(config):
    config.addinivalue_line("markers", "qsa_canary(kernel, **options): run the qsa_lab canary on kernel; "
                                       "one test per region x plane x payload (needs the qsa_canary_cell fixture)")
    config.addinivalue_line("markers", "qsa_canary_search(kernel, budget=200, seed=0, **pins): search the "
                                       "kernel's declared geometries for leaks (needs the qsa_canary_search fixture)")


class Search:
    """A marker's search (qsa_lab.canary.leak_search.search); check() fails on a finding, or when
    the search judged nothing or a case failed (exit 3)."""

    def __init__(self, marker, report_dir=None):
        if len(marker.args) != 1:
            raise pytest.UsageError("qsa_canary_search marker: give exactly one kernel (a callable or a kernel name)")
        self.kernel, self.kwargs, self.report_dir = marker.args[0], dict(marker.kwargs), report_dir
        self.kwargs.setdefault("budget", 200)
        self.result = None

    def check(self) -> None:
        from qsa_lab.canary.leak_search import search

        try:
            self.result = search(self.kernel, **self.kwargs)
        except (TypeError, ValueError) as e:
            raise pytest.UsageError(f"qsa_canary_search marker: {e}") from None
        code = self.result.exit_code()
        if code == 1 and self.report_dir:
            from pathlib import Path

            from qsa_lab.canary.calls import slug
            from qsa_lab.canary.leak_search import write_search_report

            folder = Path(self.report_dir) / f"{slug(self.result.kernel)}__search"
            try:   # as the cells' reports: one already there is kept
                replays = write_search_report(self.result, folder)
            except (ValueError, FileExistsError) as e:
                replays = [f"no report written: {e}"]
            else:
                replays = [f"cd {folder} && {line}" for line in replays]
        else:
            replays = []
        if code:
            pytest.fail("\n".join(self.result.lines() + replays), pytrace=False)


@pytest.fixture
def qsa_canary_search(request):
    marker = request.node.get_closest_marker("qsa_canary_search")
    if marker is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the qsa_canary_search fixture needs a "
                                "@pytest.mark.qsa_canary_search(kernel, ...) marker")
    return Search(marker, request.config.getoption("--qsa-canary-report", None))


@dataclass(frozen=True)
class Config:
    kernel: object                       # a callable or a canary.names.KernelName
    options: tuple                       # sorted (key, value) pairs, values made hashable

    @classmethod
    def from_marker(cls, marker) -> "Config":
        if len(marker.args) != 1:
            raise pytest.UsageError("qsa_canary marker: give exactly one kernel (a callable or a kernel name)")
        bad = [k for k in marker.kwargs if k not in CASE_KEYS + RUN_KEYS]
        if bad:
            raise pytest.UsageError(f"qsa_canary marker: unknown option(s) {bad}; "
                                    f"choose from {CASE_KEYS + RUN_KEYS}")
        kernel = marker.args[0]
        if not callable(kernel):   # a name: parsed here, once (qsa_lab.canary.names)
            from qsa_lab.canary.names import parse_kernel

            try:
                kernel = parse_kernel(kernel, MARKER)
            except (TypeError, ValueError) as e:
                raise pytest.UsageError(str(e)) from None
        return cls(kernel, tuple(sorted((k, _hashable(v)) for k, v in marker.kwargs.items())))

    @property
    def kwargs(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.options}

    @property
    def name(self) -> str:
        from qsa_lab.canary.kernels import kernel_name

        return kernel_name(self.kernel)


def _hashable(v):
    if isinstance(v, list):
        return tuple(v)
    try:
        hash(v)
    except TypeError:
        return _Id(v)
    return v


class _Id:
    """A case (or mask) in a marker: hashed by identity."""

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Id) and other.obj is self.obj


def _unwrap(kwargs: dict) -> dict:
    return {k: v.obj if isinstance(v, _Id) else v for k, v in kwargs.items()}


def build_case(cfg: Config):
    """The canary case a marker asks for (its `case`, or canary_case(...) of its options)."""
    from qsa_lab.canary.case import canary_case

    kw = _unwrap(cfg.kwargs)
    if kw.get("case") is not None:
        return kw["case"]
    return canary_case(kw.get("kv_dtype", "fp16"), attend=kw.get("attend", "dense"),
                       **{k: kw[k] for k in CASE_KEYS if k in kw})


def cells(cfg: Config) -> list:
    """(region, plane, payload) of every test the marker makes."""
    from qsa_lab.model.poison import PAYLOADS
    from qsa_lab.model.regions import regions_of
    from qsa_lab.canary.results import available_payloads
    from qsa_lab.canary.runner import DEFAULT_PAYLOADS

    kw = _unwrap(cfg.kwargs)
    case = build_case(cfg)
    regions = kw.get("regions") or regions_of(case.spec)
    planes = kw.get("planes") or ("k", "v")
    payloads = [p for p in (kw.get("payloads") or DEFAULT_PAYLOADS) if p in PAYLOADS
                and p in available_payloads(case.kv_dtype)]
    return [(r, pl, p) for r in ([regions] if isinstance(regions, str) else regions)
            for pl in ([planes] if isinstance(planes, str) else planes) for p in payloads]


def run(cfg: Config, report_dir=None, force: bool = False):
    """The marker's canary report, run once per session -> (report, replay commands by call file,
    why no report was written or '')."""
    if cfg not in _runs:
        from qsa_lab.canary.execution import DEFAULT_TIMEOUT
        from qsa_lab.canary.runner import run_canary

        kw = _unwrap(cfg.kwargs)
        case = build_case(cfg)
        report = run_canary([cfg.kernel], case=case, regions=kw.get("regions"), payloads=kw.get("payloads"),
                            planes=kw.get("planes") or ("k", "v"), backend=kw.get("backend", "auto"),
                            dims=kw.get("dims"), timeout=kw.get("timeout", DEFAULT_TIMEOUT))
        replays, kept = {}, ""
        if report_dir and report.leaks():
            from pathlib import Path

            from qsa_lab.canary.calls import slug
            from qsa_lab.canary.report import write_report

            folder = Path(report_dir) / slug(cfg.name)
            try:   # the same rules as --report: an existing report (perhaps edited by its user) is kept unless asked
                write_report(report, folder, force=force,
                             fns={report.kernels[0]: cfg.kernel} if callable(cfg.kernel) else None)
            except (ValueError, FileExistsError) as e:
                kept = f"no report written: {e}"
            else:
                # replay runs a kernel that is not built in only when the command names it
                builtin = not callable(cfg.kernel) and cfg.kernel.in_process
                named = "" if builtin else f" --kernel {cfg.name}"
                for f in sorted((folder / "calls").glob("*.safetensors")):   # one per region x plane
                    replays[tuple(f.stem.split("__")[1:3])] = (f"cd {folder} && qsa-lab replay "
                                                               f"calls/{f.name}{named}")
        _runs[cfg] = (report, replays, kept)
    return _runs[cfg]


class Cell:
    """One region x plane x payload of a marker's canary run; check() asserts it is clean."""

    def __init__(self, cfg: Config, region: str, plane: str, payload: str, report_dir=None, force: bool = False):
        self.cfg, self.region, self.plane, self.payload, self.report_dir = cfg, region, plane, payload, report_dir
        self.force, self.checked = force, False

    def __repr__(self):
        return f"{self.cfg.name} {self.region}/{self.plane}/{self.payload}"

    def result(self):
        report = run(self.cfg, self.report_dir, self.force)[0]
        for r in report.results:
            if (r.region, r.plane, r.payload) == (self.region, self.plane, self.payload):
                return r
        return None

    def check(self) -> None:
        self.checked = True
        report, replays, kept = run(self.cfg, self.report_dir, self.force)
        name = report.kernels[0]
        r = self.result()
        here = f"{name} {self.region}/{self.plane}/{self.payload}"

        def skip(text):   # only while some other cell of the marker ran a check: never green on nothing
            if report.checks(name) == 0:
                pytest.fail(f"{text}; and no cell of this marker ran a leak check (every one n/a or "
                            "skipped): the gate would pass on nothing (skip the test where the kernel cannot "
                            "run, e.g. pytest.mark.skipif)", pytrace=False)
            pytest.skip(text)

        if r is None:
            why = _reason(report, self.region, self.plane, self.payload)
            if why is None:
                pytest.fail(f"{here}: no result and no reason", pytrace=False)
            kind, text = why
            if kind == "skip":
                skip(f"{here}: {text}")
            pytest.fail(f"{here}: {text}", pytrace=False)
        if r.verdict == CLEAN:
            return
        if r.verdict not in LEAKS:  # n/a and the verdicts of a kernel that cannot be judged
            text = f"{here}: {r.verdict}"
            if r.verdict == NA:
                skip(text + " (the call's inputs reference no byte of this region)")
            pytest.fail(text + _note(r), pytrace=False)
        what = {NAN_LEAK: f"{r.nan} output(s) NaN", INF_LEAK: f"{r.inf} output(s) +-Inf",
                FINITE_LEAK: f"{r.finite_changed} finite output(s) changed"}[r.verdict]
        w = r.where()
        msg = (f"{name} leaks {r.payload} from region {self.region} on the {self.plane.upper()} plane: {r.verdict}, "
               f"{what} ({r.nan} NaN, {r.inf} Inf, {r.finite_changed} finite changed; rows {w['rows'][:12]}, "
               f"heads {w['heads']}) [{report.case.describe()}]")
        if (self.region, self.plane) in replays:
            msg += f"\n  replay: {replays[self.region, self.plane]}"
        elif kept:
            msg += f"\n  {kept}"
        pytest.fail(msg, pytrace=False)


def _note(r) -> str:
    for k in ("note", "error", "reason"):
        v = getattr(r, k, None)
        if v:
            return f": {str(v).strip().splitlines()[-1]}"
    return ""


def _reason(report, region, plane, payload):
    """Why a cell has no result: ("skip", text) or ("fail", text); None if nothing says."""
    for s in report.skipped:
        if all(s.get(k) in (None, v) for k, v in (("region", region), ("plane", plane), ("payload", payload))):
            reason = s.get("reason", "")
            error = s.get("verdict") == ERROR or str(reason).startswith("raised ")
            return ("fail" if error else "skip", reason)
    return None


def pytest_generate_tests(metafunc):
    if "qsa_canary_cell" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("qsa_canary")
    if marker is None:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: the qsa_canary_cell fixture needs a "
                                "@pytest.mark.qsa_canary(kernel, ...) marker")
    cfg = Config.from_marker(marker)
    report_dir = metafunc.config.getoption("--qsa-canary-report", None)
    force = metafunc.config.getoption("--qsa-canary-report-force", False)
    params = [Cell(cfg, *c, report_dir=report_dir, force=force) for c in cells(cfg)]
    metafunc.parametrize("qsa_canary_cell", params, ids=[f"{c.region}-{c.plane}-{c.payload}" for c in params])


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A marked test that returns without calling check() fails: it checked nothing."""
    result = yield
    cell = getattr(pyfuncitem, "funcargs", {}).get("qsa_canary_cell")
    if isinstance(cell, Cell) and not cell.checked:
        pytest.fail(f"{cell!r}: the test never called qsa_canary_cell.check(), so it checked nothing",
                    pytrace=False)
    return result
