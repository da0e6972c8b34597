import csv
import datetime
import os
import tempfile
import unittest

from helpers import RESULTS, assert_tables_match, stored_rows
from loopdbench.config import Config
from loopdbench.report import (CSV_FIELDS, fill_ratios, targets_section, workload_section,
                               write_csv, write_report)
from loopdbench.systems import SYSTEMS

RUN = "2026-11-23-060758"  # a full run: every workload, every system


def stored_section(text, start, end=None):
    i = text.index(start)
    j = text.find(end, i) if end else -1
    return text[i:j] if j >= 0 else text[i:]


class ReportParity(unittest.TestCase):
    """The tables made from a stored run's results.csv are the ones its report.md has."""

    @classmethod
    def setUpClass(cls):
        cls.rows = stored_rows(RUN)
        cls.cfg = Config(size=2 << 30, systems=list(SYSTEMS), setup_reps=10)
        fill_ratios(cls.rows)
        with open(os.path.join(RESULTS, RUN, "report.md")) as fh:
            cls.report = fh.read()

    def test_every_workload_table(self):
        titles = ["## Workload 1", "## Workload 2", "## Workload 3", "## Workload 4",
                  "## Workload 5", "## Issue 4 targets"]
        for w in range(1, 6):
            got = "\n".join(workload_section(self.cfg, self.rows, w, "##"))
            want = stored_section(self.report, titles[w - 1], titles[w])
            with self.subTest(workload=w):
                assert_tables_match(self, got, want)

    def test_issue_4_targets(self):
        got = "\n".join(targets_section(self.cfg, self.rows, "##"))
        assert_tables_match(self, got, stored_section(self.report, "## Issue 4 targets"))

    def test_ratios_are_filled_in(self):
        r = next(r for r in self.rows if r["system"] == "loopd-direct" and r["workload"] == 1)
        self.assertEqual(r["ratio_iops_vs_baseline"], 1.0)
        self.assertEqual(r["baseline"], "loopd-direct")
        w4 = next(r for r in self.rows if r["workload"] == 4)
        self.assertEqual(w4["baseline"], "loopd-buffered")


class ReportShapes(unittest.TestCase):
    def cfg(self, d):
        return Config(only=[1, 5], systems=["loopd-direct", "raw"], outdir=d, image=d,
                      loopd="/bin/true", started=datetime.datetime(2026, 1, 2, 3, 4).astimezone(),
                      command="bench/run --only 1,5")

    def test_failed_cases_are_listed_and_shown_failed(self):
        rows = [dict(workload=1, case="randread-4k-qd1", system="loopd-direct", error="boom"),
                dict(workload=1, case="randread-4k-qd1", system="raw", iops=10.0, mib_s=1.0,
                     lat_mean_us=1.0, lat_p99_us=2.0, fio_cpu_s=0.5, wall_s=1.0, numjobs=1),
                dict(workload=5, case="setup-latency", system="loopd-direct", error="late")]
        with tempfile.TemporaryDirectory() as d:
            text = write_report(self.cfg(d), rows, ["w1 randread-4k-qd1 loopd-direct: boom"])
        self.assertIn("**1 case(s) failed:**", text)
        self.assertIn("| randread-4k-qd1 | loopd-direct | FAILED |", text)
        self.assertIn("| loopd-direct | FAILED |", text)
        self.assertIn("- randread-4k-qd1 · loopd-direct: boom", text)
        self.assertIn("| 10 | 1.0 | 1.0 | 2.0 | 0.50 | — | — | — |", text)  # no baseline: no ratio
        self.assertIn("# Side-by-side benchmark — 2026-01-02", text)
        self.assertNotIn("Issue 4 targets", text)  # no figures for any target

    def test_a_client_bound_case_gets_a_note(self):
        rows = [dict(workload=1, case="c", system="raw", iops=10.0, mib_s=1.0, lat_mean_us=1.0,
                     lat_p99_us=2.0, fio_cpu_s=0.9, wall_s=1.0, numjobs=1)]
        text = "\n".join(workload_section(Config(), rows, 1, "##"))
        self.assertIn("the fio client used 0.90 of a core per job", text)

    def test_csv_has_every_field_and_three_decimals(self):
        rows = [dict(workload=1, case="c", system="raw", iops=1234.56789, note="n", extra="dropped")]
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "r.csv")
            write_csv(p, rows)
            with open(p) as fh:
                got = list(csv.DictReader(fh))
        self.assertEqual(list(got[0]), CSV_FIELDS)
        self.assertEqual(got[0]["iops"], "1234.568")
        self.assertEqual(got[0]["note"], "n")
        self.assertEqual(got[0]["error"], "")
