"""The shape of a case (Geometry), its ranges, and the names of the poison and backend options.

Plain Python, no torch: the command line checks its arguments (and prints its help) before
the heavy libraries load. qsa_lab.model.case builds the tensors from a Geometry; qsa_lab.model.poison and
qsa_lab.routes.run take the names defined here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

KV_DTYPES = ("e4m3", "e5m2", "fp16")
LAYOUTS = ("contiguous", "scatter")
GROUPINGS = ("consecutive", "request")
SELECTIONS = ("indexer", "random")
DEFAULT_OVERLAP = 0.8  # target mean overlap of neighbouring rows' indexer selections
#: the one map of old names: a Geometry field's old name -> its name now. The command line still
#: takes the old option (--grouping, not shown in --help) and a file that wrote the old key reads
#: as the new one (Geometry.from_dict).
RENAMED_FIELDS = {"grouping": "group_rows"}
#: inclusive range of every integer Geometry field. The bounds keep each size far beyond the
#: report's (19 rows, 8192 tokens, topk 512, page 32, 6 heads, dim 256) yet small enough that
#: one field alone cannot ask for an absurd allocation; combinations are bounded by the memory
#: estimate in qsa_lab.model.memory.
#: poison sites, planes (plane name -> cache planes: 0 = K, 1 = V) and payloads (qsa_lab.model.poison)
SITES = ("none", "zeros", "targeted", "random", "fp16-state", "stale-tail", "attended-k", "attended-v", "query")
PLANES = {"k": (0,), "v": (1,), "kv": (0, 1)}
PAYLOADS = ("nan", "inf", "max", "zero")
BACKENDS = ("auto", "emulate", "cuda")  # qsa_lab.routes.run: the compiled kernels or the emulation
RANGES = {
    "rows": (1, 1 << 16),
    "requests": (1, 1 << 12),
    "context": (5, 1 << 20),
    "topk": (1, 1 << 16),
    "page_size": (4, 1024),
    "q_heads": (1, 16),
    "head_dim": (16, 1024),
    "seed": (0, (1 << 63) - 1),   # torch.Generator.manual_seed takes 64 bits
}

#: the canary's call geometry (qsa_lab.canary.case) beyond the qsa routes' RANGES: the shapes real
#: models use (query heads 32 for Llama-3 8B, 64 for 70B, 128 for 405B and DeepSeek-V3's MLA; GQA
#: ratios up to 16 and more; head dims 64-256, MLA's 576 latent + rope read with V of 512). The qsa:
#: kernels keep RANGES (1..16 query heads, one KV head): a larger case skips them, saying why.
#: Combinations are bounded by the memory estimate (qsa_lab.model.memory.canary_estimate).
CANARY_RANGES = {
    "q_heads": (1, 256),
    "kv_heads": (1, 256),
    "head_dim": RANGES["head_dim"],     # a multiple of 16, as for the qsa routes
}


@dataclass(frozen=True)
class Geometry:
    """Shape of a case. Defaults are the report's decode-like geometry."""

    rows: int = 19
    requests: int = 1
    layout: str = "contiguous"
    context: int = 8192
    topk: int = 512
    page_size: int = 32
    q_heads: int = 6
    head_dim: int = 256
    kv_dtype: str = "e4m3"
    seed: int = 0
    group_rows: str = "consecutive"
    selection: str = "indexer"
    overlap: float = DEFAULT_OVERLAP
    #: rows of each request, in order (a batch that mixes a prefill chunk with decode rows); empty:
    #: the rows spread evenly over the requests (the first rows % requests get one more)
    request_rows: tuple = ()

    def __post_init__(self):
        def need(ok, arg, what):
            if not ok:
                raise ValueError(f"{arg}: must be {what}, got {getattr(self, arg)!r}")

        if isinstance(self.request_rows, list):  # from JSON
            object.__setattr__(self, "request_rows", tuple(self.request_rows))

        for name in RANGES:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name}: must be an int, got {type(v).__name__} {v!r}")
            lo, hi = RANGES[name]
            need(lo <= v <= hi, name, f"in {lo}..{hi}")
        need(self.rows >= self.requests, "rows", f">= requests ({self.requests})")
        need(self.layout in LAYOUTS, "layout", f"one of {LAYOUTS}")
        need(self.kv_dtype in KV_DTYPES, "kv_dtype", f"one of {KV_DTYPES}")
        need(self.group_rows in GROUPINGS, "group_rows", f"one of {GROUPINGS}")
        need(self.selection in SELECTIONS, "selection", f"one of {SELECTIONS}")
        need(isinstance(self.overlap, (int, float)) and not isinstance(self.overlap, bool)
             and 0.0 <= self.overlap <= 1.0, "overlap", "a number in [0, 1] (mean neighbour overlap)")
        need(self.page_size % 4 == 0, "page_size", "a multiple of 4 (one microblock is 4 tokens)")
        need(self.head_dim % 16 == 0, "head_dim", "a multiple of 16 (one WMMA tile)")
        mix = self.request_rows
        need(isinstance(mix, tuple) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mix)
             and (not mix or (len(mix) == self.requests and sum(mix) == self.rows)), "request_rows",
             f"empty or {self.requests} ints >= 1 (one per request) summing to rows={self.rows}")
        rows_per_req = max(mix) if mix else -(-self.rows // self.requests)
        need(self.context - self.requests + 1 >= rows_per_req + 4, "context",
             f">= rows per request + requests + 3 ({rows_per_req + self.requests + 3})")

    @property
    def m_tiles(self) -> int:
        """16-row M-tiles of one group's 8*q_heads score rows."""
        return -(-8 * self.q_heads // 16)

    def rows_of_requests(self) -> list[int]:
        """Rows of each request: request_rows, or the rows spread evenly (the first rows % requests
        requests get one more)."""
        if self.request_rows:
            return list(self.request_rows)
        return [self.rows // self.requests + (1 if r < self.rows % self.requests else 0) for r in range(self.requests)]

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "Geometry":
        """The Geometry a dict of fields describes (to_dict's, a case file's, a call file's, a JSON
        document's), an old field name (RENAMED_FIELDS) read as its name now. TypeError for an
        unknown field, ValueError for a bad value or a field given under both names."""
        if not isinstance(fields, dict):
            raise TypeError(f"geometry: expected a dict of fields, got {type(fields).__name__}")
        fields = dict(fields)
        for old, new in RENAMED_FIELDS.items():
            if old in fields:
                if new in fields:
                    raise ValueError(f"{new}: given twice, as {new!r} and under its old name {old!r}")
                fields[new] = fields.pop(old)
        return cls(**fields)

    def replace(self, **kw) -> "Geometry":
        return dataclasses.replace(self, **kw)


#: the report's two geometries (the CLI's presets `decode` and `causal3`)
DECODE = Geometry()                                              # 19 rows, contiguous, decode-like
# 24 rows, 3 requests, scatter, causal. The NaN count is 16 rows x 5 dims per M-tile that a padded
# category activates; seed 63 is a seed whose plan pads 8 of the 9 M-tiles, as the report's did
# (640). Most seeds pad all 9 (720): see the README.
CAUSAL3_SEED = 63
CAUSAL3 = Geometry(rows=24, requests=3, layout="scatter", seed=CAUSAL3_SEED)

#: batches that mix requests in one step (the CLI's presets of the same names). Upstream's host route
#: hands the first rows // 8 * 8 rows to the grouped kernel in groups of 8 consecutive rows, so a group
#: can hold rows of several requests. Each request holds its whole context selected (context 2051 =
#: 512 complete 4-token blocks + a 3-token tail for request 0: topk 512 takes every block), as in
#: upstream's regression test of the grouped/XQA split.
MIXES = {
    # upstream's test shape: a 46-row catch-up chunk of request 0, then one decode row from each of
    # three other requests: rows 40-47 form one group holding requests 0, 1 and 2; row 48 goes to XQA
    "upstream-mix": Geometry(rows=49, requests=4, request_rows=(46, 1, 1, 1), context=2051, layout="scatter"),
    # prefill only: three prefill chunks whose boundaries fall inside groups
    "prefill-mix": Geometry(rows=40, requests=3, request_rows=(20, 13, 7), context=2051, layout="scatter"),
    # decode-heavy: 20 requests of 3-4 rows each (speculative decoding verifies a few tokens per request):
    # every group of 8 consecutive rows holds 2 or 3 requests
    "decode-mix": Geometry(rows=61, requests=20, request_rows=(4,) + (3,) * 19, context=2051, layout="scatter"),
}
