"""`qsa-lab diff` prints its route table without pandas: the text must be what pandas'
DataFrame.to_string printed before (the same columns, widths, NaN / None cells)."""
from __future__ import annotations

import math
import random

import pandas as pd

from qsa_lab.analysis.fingerprints import route_rows, route_table_text
from qsa_lab.routes.run import ROUTES


def pandas_text(rows):
    t = pd.DataFrame(rows).set_index("route")
    t["nan_dims"] = t["nan_dims"].map(lambda d: ",".join(map(str, d[:12])) + (" ..." if len(d) > 12 else ""))
    with pd.option_context("display.width", 200, "display.max_columns", 10, "display.float_format", "{:.3g}".format):
        return t.to_string()


def test_report_case_table_as_pandas_printed_it(report_result):
    rows = route_rows(report_result)
    assert route_table_text(rows) == pandas_text(rows)
    assert "NaN" in route_table_text(rows)  # the unfixed route's NaN output has no max |diff|


def test_random_tables_as_pandas_prints_them():
    rng = random.Random(0)

    def value(kind):
        return {"none": lambda: None, "float": lambda: rng.choice([0.0, 5.42e-05, 1.0, 123456.0, 1e-12, 99999.9]),
                "mixed": lambda: rng.choice([None, 0.5, 6.1e-05]),
                "special": lambda: rng.choice([math.inf, -math.inf, math.nan, -0.0, None, 0.25])}[kind]()

    for _ in range(300):
        kinds = [rng.choice(["float", "none", "mixed", "special"]) for _ in range(2)]
        rows = [{"route": r, "nan_count": rng.choice([0, 480, 12345678]),
                 "nan_dims": sorted(rng.sample(range(300), rng.choice([0, 1, 5, 12, 13, 40]))),
                 "max_abs_diff_vs_reference": value(kinds[0]), "max_abs_diff_vs_xqa": value(kinds[1])}
                for r in rng.sample(ROUTES, rng.randint(1, len(ROUTES)))]
        assert route_table_text(rows) == pandas_text(rows), rows
