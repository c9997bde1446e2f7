"""Do two leak-check documents give the same verdicts and counts? Canary (`qsa_lab.canary/1`),
scribble (`qsa_lab.scribble/1`) or cross-request (`qsa_lab.cross_request/1`) JSON, e.g. one run
before and one after a change to the leak check:

    python tools/compare_verdicts.py BEFORE.json AFTER.json [--verdict-map OLD=NEW,..]

Compares every cell by its verdict and its counts: a canary or scribble cell (kernel or check,
region, plane, payload) by verdict, nan, inf, finite_changed and tokens_changed, a cross-request
record (query heads, kv dtype, route, payload, poisoned request, request) by verdict, elements,
rows and as_reference; and the documents' counts. Not the machine facts, timings or notes. Prints
one line per difference, the verdict changes counted (a renamed verdict shows as one line), and a
last line; exit 0 when identical, 1 when not, 2 when a file is not such a document.
--verdict-map renames BEFORE's verdicts first (a change that renames verdicts on purpose).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

#: schema -> (the list of cells, the fields naming a cell, the fields compared, the document's counts)
CELLS = ("verdict", "nan", "inf", "finite_changed", "tokens_changed")
KEY = ("kernel", "check", "region", "plane", "payload")
SCHEMAS = {
    "qsa_lab.canary/1": ("results", KEY, CELLS, "counts"),
    "qsa_lab.scribble/1": ("results", KEY, CELLS, "counts"),
    "qsa_lab.cross_request/1": ("records", ("q_heads", "kv_dtype", "route", "payload", "poisoned_request", "request"),
                                ("verdict", "elements", "rows", "as_reference"), "must_be_clean_leaks"),
}
# /2 (the leak check's vocabulary and report header) compares the same records: a /1 document read beside
# a /2 one shows the renamed verdicts (own -> n/a, leak -> nan-leak), which --verdict-map maps
SCHEMAS["qsa_lab.cross_request/2"] = SCHEMAS["qsa_lab.cross_request/1"]


def cells(doc: dict, verdict_map: dict | None = None) -> dict:
    """cell key -> (verdict, counts...) in the document's schema; verdicts renamed by verdict_map."""
    items, key, fields, _ = SCHEMAS[doc["schema"]]
    rename = verdict_map or {}
    out = {}
    for r in doc[items]:
        values = [r.get(k, 0) for k in fields]
        values[0] = rename.get(values[0], values[0])
        out[tuple(r.get(k) for k in key)] = tuple(json.dumps(v) if isinstance(v, list) else v for v in values)
    return out


def differences(a: dict, b: dict, verdict_map: dict | None = None) -> list[str]:
    ca, cb = cells(a, verdict_map), cells(b)
    out = [f"{'/'.join(str(x) for x in k if x is not None)}: {ca.get(k)} -> {cb.get(k)}"
           for k in dict.fromkeys([*ca, *cb]) if ca.get(k) != cb.get(k)]
    counts = SCHEMAS[a["schema"]][3]
    if a.get(counts) is not None and b.get(counts) is not None and a[counts] != b[counts]:
        out.append(f"{counts}: {a[counts]} -> {b[counts]}")
    return out


def verdict_changes(a: dict, b: dict, verdict_map: dict | None = None) -> Counter:
    """(verdict before, verdict after) -> how many cells of both documents changed so."""
    ca, cb = cells(a, verdict_map), cells(b)
    return Counter((ca[k][0], cb[k][0]) for k in ca if k in cb and ca[k][0] != cb[k][0])


def parse_map(text: str) -> dict:
    pairs = [p.split("=") for p in text.split(",") if p]
    if not pairs or any(len(p) != 2 or not all(p) for p in pairs):
        raise argparse.ArgumentTypeError(f"expected OLD=NEW[,OLD=NEW..], got {text!r}")
    return dict(pairs)


def load(path: str) -> dict:
    """The document at path; ValueError naming the file when it is none of SCHEMAS."""
    try:
        doc = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") not in SCHEMAS:
        raise ValueError(f"{path}: not a {' or '.join(SCHEMAS)} document")
    return doc


def report(a: dict, b: dict, verdict_map: dict | None = None) -> list[str]:
    """The lines printed: each difference, the verdict changes counted, the last line."""
    diff = differences(a, b, verdict_map)
    changes = verdict_changes(a, b, verdict_map)
    lines = diff + ([f"verdict changes: {', '.join(f'{x} -> {y} ({n})' for (x, y), n in changes.most_common())}"]
                    if changes else [])
    return lines + [f"{len(cells(a))} and {len(cells(b))} cells: "
                    + ("identical verdicts and counts" if not diff else f"{len(diff)} difference(s)")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="compare_verdicts.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("before", metavar="BEFORE.json")
    ap.add_argument("after", metavar="AFTER.json")
    ap.add_argument("--verdict-map", type=parse_map, metavar="OLD=NEW,..", help="rename BEFORE's verdicts first")
    args = ap.parse_args(argv)
    try:
        docs = [load(args.before), load(args.after)]
    except ValueError as e:
        print(f"compare_verdicts: error: {e}", file=sys.stderr)
        return 2
    if docs[0]["schema"] != docs[1]["schema"]:
        print(f"compare_verdicts: error: {docs[0]['schema']} against {docs[1]['schema']}", file=sys.stderr)
        return 2
    lines = report(*docs, args.verdict_map)
    print("\n".join(lines))
    return 0 if lines[-1].endswith("identical verdicts and counts") else 1


if __name__ == "__main__":
    sys.exit(main())
