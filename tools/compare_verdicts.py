"""Do two leak-check documents give the same verdicts and counts? Canary (`qsa_lab.canary/1`) or
scribble (`qsa_lab.scribble/1`) JSON, e.g. one run before and one after a change to the leak check:

    python tools/compare_verdicts.py BEFORE.json AFTER.json

Compares every cell (kernel or check, region, plane, payload) by its verdict and its nan / inf /
finite_changed / tokens_changed counts, and the documents' counts; not the machine facts, timings or
notes. Prints one line per difference and a last line; exit 0 when identical, 1 when not, 2 when a
file is not such a document.
"""
from __future__ import annotations

import json
import sys

SCHEMAS = ("qsa_lab.canary/1", "qsa_lab.scribble/1")
KEY = ("kernel", "check", "region", "plane", "payload")
COUNTS = ("verdict", "nan", "inf", "finite_changed", "tokens_changed")


def cells(doc: dict) -> dict:
    """(kernel or check, region, plane, payload) -> (verdict, nan, inf, finite_changed, tokens_changed)."""
    return {tuple(r.get(k) for k in KEY): tuple(r.get(k, 0) for k in COUNTS) for r in doc["results"]}


def differences(a: dict, b: dict) -> list[str]:
    ca, cb = cells(a), cells(b)
    out = [f"{'/'.join(str(x) for x in k if x is not None)}: {ca.get(k)} -> {cb.get(k)}"
           for k in dict.fromkeys([*ca, *cb]) if ca.get(k) != cb.get(k)]
    if a.get("counts") and b.get("counts") and a["counts"] != b["counts"]:
        out.append(f"counts: {a['counts']} -> {b['counts']}")
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python tools/compare_verdicts.py BEFORE.json AFTER.json", file=sys.stderr)
        return 2
    docs = []
    for path in args:
        try:
            doc = json.loads(open(path).read())
        except (OSError, ValueError) as e:
            print(f"compare_verdicts: error: {path}: {e}", file=sys.stderr)
            return 2
        if not isinstance(doc, dict) or doc.get("schema") not in SCHEMAS:
            print(f"compare_verdicts: error: {path}: not a {' or '.join(SCHEMAS)} document", file=sys.stderr)
            return 2
        docs.append(doc)
    if docs[0]["schema"] != docs[1]["schema"]:
        print(f"compare_verdicts: error: {docs[0]['schema']} against {docs[1]['schema']}", file=sys.stderr)
        return 2
    diff = differences(*docs)
    for line in diff:
        print(line)
    print(f"{len(cells(docs[0]))} and {len(cells(docs[1]))} cells: "
          + ("identical verdicts and counts" if not diff else f"{len(diff)} difference(s)"))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
