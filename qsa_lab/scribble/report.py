"""The scribble's report: one Cell per check x region x payload, the table under it, its legend and
its JSON (schema qsa_lab.scribble/1), on the leak check's report base (qsa_lab.analysis.leaks.LeakReport:
the counts, the verdict line, the exit code, the header with the machine facts). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field

from qsa_lab.analysis.leaks import FAILURES, LEAKS, VERDICTS, LeakReport, spans
from qsa_lab.analysis.leaks import STRAY_WRITE as STRAY  # noqa: F401 - the write guard's verdict, by its old name

from .regions import REGION_TEXT, REGIONS

SCHEMA = "qsa_lab.scribble/1"


@dataclass
class Cell:
    check: str            # "read" | "write"
    region: str
    payload: str          # "-" for the write guard
    verdict: str
    nan: int = 0
    inf: int = 0
    finite_changed: int = 0
    tokens_changed: int = 0
    slots: int = 0        # rows filled over the run (read) / rows guarded (write)
    where: dict = field(default_factory=dict)
    pairs: list = field(default_factory=list)     # other-requests: {"reader", "poisoned", "first_token", ...}
    strays: list = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in ("", [], {}) or k in ("verdict",)}


@dataclass
class ScribbleReport(LeakReport):
    engine: str
    reads_pool: str
    graphs: bool
    model: str
    workload: dict
    cells: list
    control_seconds: float = 0.0
    facts: dict = field(default_factory=dict)
    events: dict = field(default_factory=dict)     # what the clean run's engine did (Generation.events)
    moved_rows: int = 0                            # rows the engine moved between steps in the clean run
    SCHEMA = SCHEMA            # the JSON's (LeakReport.header)

    def verdicts(self) -> list:
        return [c.verdict for c in self.cells]

    def leaks(self) -> list:
        return [c for c in self.cells if c.verdict in LEAKS]

    def failures(self) -> list:
        return [c for c in self.cells if c.verdict in FAILURES]

    def no_check(self) -> str:
        """Why no check ran ('' when one did): every cell n/a, read and write (the exit code is then 3:
        LeakReport.exit_code)."""
        return "no check ran: every cell is n/a (no region asked for held a row in any step)" if self.nothing_checked() else ""

    def to_dict(self) -> dict:
        """The JSON: the header (schema and the machine facts, once), then the report; `facts` holds only
        what the engine adds (its version, the machine and processor, its settings)."""
        return {**self.header(), "engine": self.engine, "reads_pool": self.reads_pool, "graphs": self.graphs,
                "model": self.model, "workload": self.workload, "control_seconds": self.control_seconds,
                "facts": self.facts, "events": self.events, "moved_rows": self.moved_rows, "counts": self.counts(),
                "results": [c.to_dict() for c in self.cells]}

    @classmethod
    def from_dict(cls, doc: dict) -> ScribbleReport:
        """The report a JSON document (to_dict) holds, its header's machine facts those of the machine that
        wrote it."""
        fields = ("engine", "reads_pool", "graphs", "model", "workload", "control_seconds", "facts", "events",
                  "moved_rows")
        report = cls(cells=[Cell(**r) for r in doc["results"]], **{k: doc[k] for k in fields})
        report._facts = {k: v for k, v in doc.items() if k not in fields + ("schema", "counts", "results")}
        return report

    def frame(self):
        import pandas as pd
        return pd.DataFrame([{k: v for k, v in c.to_dict().items() if k not in ("strays", "where", "pairs")} |
                             {"where": _where_text(c)} for c in self.cells])

    def verdict_line(self) -> str:
        """The one line under the table: the leak check's counts (LeakReport.summary), each verdict's cells,
        the regions that leaked, and the exit code."""
        verdicts = self.verdicts()
        found = ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICTS if v in verdicts)
        leaking = sorted({c.region for c in self.leaks()})
        return (f"{self.summary()}: {found}" + (f"; leaks or stray writes in {', '.join(leaking)}" if leaking
                                                    else "") + f"; exit code {self.exit_code()}")

    def legend(self) -> list:
        """One line per region in the report: the rows one read run filled (summed over steps), what it holds."""
        slots = {}
        for c in self.cells:
            if c.check == "read":
                slots[c.region] = max(slots.get(c.region, 0), c.slots)
        return [f"  {r:15} {slots[r]:7d}  {REGION_TEXT[r]}" for r in REGIONS if r in slots]

    def table(self) -> str:
        lines = [f"{self.engine} ({self.reads_pool}{', graphs' if self.graphs else ''}) on {self.model}, "
                 f"workload {self.workload.get('name')}"]
        lines.append(f"{'check':6} {'region':15} {'payload':7} {'verdict':17} {'nan':>5} {'inf':>5} "
                     f"{'changed':>7} {'tokens':>6}  where")
        for c in self.cells:
            lines.append(f"{c.check:6} {c.region:15} {c.payload:7} {c.verdict:17} {c.nan:5d} {c.inf:5d} "
                         f"{c.finite_changed:7d} {c.tokens_changed:6d}  {_where_text(c)}")
        lines.append(f"summary: {self.verdict_line()}")
        legend = self.legend()
        if legend:
            lines += ["regions (rows filled per read run, summed over steps):"] + legend
        return "\n".join(lines)


def _where_text(c: Cell) -> str:
    if c.error:
        return c.error.strip().splitlines()[-1][:160]
    if c.strays:
        s = c.strays[0]
        call = f" in {s['call']}" if s.get("call") else ""
        more = s.get("count", len(s["rows"])) - len(s["rows"])
        return f"{s['when']}{call}: {s['region']}, {s['where']}, rows {spans(s['rows'])}" + (
            f" (+{more} more rows)" if more > 0 else "") + (
            f" (+{len(c.strays) - 1} more)" if len(c.strays) > 1 else "")
    if c.pairs:
        p = c.pairs[0]
        at = f" at step {p['step']} layer {p['layer']}" if "step" in p else f" from its token {p['first_token']}"
        return f"{p['reader']} read {p['poisoned']}'s rows{at}" + (
            f" (+{len(c.pairs) - 1} more pairs)" if len(c.pairs) > 1 else "")
    w = c.where
    if w:
        return (f"step {w['step']} layer {w['layer']} requests {w['requests']} heads {spans(w['heads'])} "
                f"dims {spans(w['dims'])}")
    return ""
