"""Shared by the bench unit tests: paths, and rows read back from a stored run."""

import csv
import os
import re
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(TESTS)
RESULTS = os.path.join(BENCH, "results")
FIXTURES = os.path.join(TESTS, "fixtures")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)


def _num(v):
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def stored_rows(run):
    """The rows of a stored run's results.csv, numbers as numbers, derived columns
    (ratio, baseline) left out so the report computes them again."""
    with open(os.path.join(RESULTS, run, "results.csv")) as fh:
        return [{k: _num(v) for k, v in r.items()
                 if v != "" and k not in ("ratio_iops_vs_baseline", "baseline")}
                for r in csv.DictReader(fh)]


_NUM = re.compile(r"^[+-]?[\d,]*\.?\d+$")


def assert_tables_match(tc, got, want):
    """Markdown lines equal, except that numbers in table cells may differ by one
    unit of their last digit (results.csv keeps 3 decimals, the report rounded the
    unrounded figure)."""
    g, w = got.strip().split("\n"), want.strip().split("\n")
    tc.assertEqual(len(g), len(w), "line count")
    for a, b in zip(g, w):
        if not (a.startswith("|") and b.startswith("|")):
            tc.assertEqual(a, b)
            continue
        ca, cb = a.split("|"), b.split("|")
        tc.assertEqual(len(ca), len(cb), f"{a!r} vs {b!r}")
        for x, y in zip(ca, cb):
            x, y = x.strip().rstrip("×%"), y.strip().rstrip("×%")
            if _NUM.match(x) and _NUM.match(y):
                nd = len(y.split(".")[1]) if "." in y else 0
                tc.assertAlmostEqual(float(x.replace(",", "")), float(y.replace(",", "")),
                                     delta=1.01 * 10 ** -nd, msg=f"{a!r} vs {b!r}")
            else:
                tc.assertEqual(x, y, f"{a!r} vs {b!r}")
