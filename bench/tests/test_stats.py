import unittest

from helpers import BENCH  # noqa: F401
from loopdbench.config import Config
from loopdbench.stats import (client_us_per_io, median_rows, rate_of, ratio, seed001_pairs,
                              server_us_per_io, stretch_note)


class PerRequest(unittest.TestCase):
    def test_server_us_per_io_is_cpu_over_the_cases_io(self):
        row = dict(iops=10000.0, wall_s=12.0, server_cpu_s=6.0)
        self.assertAlmostEqual(server_us_per_io(row), 6.0 / (10000 * 12) * 1e6)

    def test_client_us_per_io_uses_fio_cpu(self):
        row = dict(iops=1000.0, wall_s=10.0, fio_cpu_s=1.0)
        self.assertAlmostEqual(client_us_per_io(row), 100.0)

    def test_missing_figures_give_none(self):
        for row in (dict(iops=1.0, wall_s=1.0), dict(iops=0.0, wall_s=1.0, server_cpu_s=1.0),
                    dict(iops=1.0, server_cpu_s=1.0), {}):
            self.assertIsNone(server_us_per_io(row), row)
        self.assertIsNone(client_us_per_io(dict(iops=1.0, wall_s=1.0)))

    def test_rate_prefers_iops_by_wall(self):
        self.assertEqual(rate_of(dict(iops=100.0)), 100.0)
        self.assertEqual(rate_of(dict(iops=100.0, iops_by_wall=40.0)), 40.0)
        row = dict(iops=100.0, iops_by_wall=40.0, wall_s=10.0, server_cpu_s=0.004)
        self.assertAlmostEqual(server_us_per_io(row), 0.004 / 400 * 1e6)


class Stretch(unittest.TestCase):
    cfg = Config(runtime=10, ramp=2)

    def test_jobs_side_by_side_get_no_note(self):
        row = dict(numjobs=16, wall_s=13.4, ios=1000, iops=100.0)
        self.assertEqual(stretch_note(row, self.cfg), "")
        self.assertNotIn("iops_by_wall", row)

    def test_one_job_never_gets_a_note(self):
        self.assertEqual(stretch_note(dict(numjobs=1, wall_s=100.0, ios=10, iops=1.0), self.cfg), "")

    def test_a_stretched_case_says_so_with_the_wall_clock_rate(self):
        row = dict(numjobs=16, wall_s=42.0, ios=80000, iops=16000.0)
        note = stretch_note(row, self.cfg)
        self.assertAlmostEqual(row["iops_by_wall"], 80000 / 40.0)
        self.assertIn("42.0 s for 12 s", note)
        self.assertIn("2,000 IOPS", note)
        self.assertIn("16,000", note)

    def test_the_threshold_is_the_larger_of_1_5_s_and_10_percent(self):
        cfg = Config(runtime=30, ramp=0)  # 10% = 3 s
        self.assertEqual(stretch_note(dict(numjobs=2, wall_s=32.9, ios=1, iops=1.0), cfg), "")
        self.assertNotEqual(stretch_note(dict(numjobs=2, wall_s=33.1, ios=1, iops=1.0), cfg), "")


class Ratios(unittest.TestCase):
    def test_ratio_to_loopd_direct_and_to_loopd_buffered_in_workload_4(self):
        rows = [dict(workload=1, case="c", system="loopd-direct", iops=200.0),
                dict(workload=1, case="c", system="raw", iops=300.0),
                dict(workload=4, case="w", system="loopd-buffered", iops=50.0),
                dict(workload=4, case="w", system="nbdkit-default", iops=25.0)]
        by = {(r["workload"], r["case"], r["system"]): r for r in rows}
        self.assertEqual(ratio(by, rows[1]), 1.5)
        self.assertEqual(ratio(by, rows[0]), 1.0)
        self.assertEqual(ratio(by, rows[3]), 0.5)

    def test_no_baseline_no_ratio(self):
        r = dict(workload=1, case="c", system="raw", iops=300.0)
        self.assertIsNone(ratio({}, r))
        base = dict(workload=1, case="c", system="loopd-direct", iops=0.0)
        self.assertIsNone(ratio({(1, "c", "loopd-direct"): base}, r))

    def test_seed001_pairs_4k_first_then_by_jobs(self):
        rows = [dict(bs=bs, numjobs=j, system=s, iops=1.0)
                for bs in ("1m", "4k") for j in (4, 1)
                for s in ("loopd-direct", "loopd-direct-wholelock")]
        rows.append(dict(bs="4k", numjobs=2, system="loopd-direct", error="x"))
        pairs = seed001_pairs(rows)
        self.assertEqual([(bs, j) for bs, j, _, _ in pairs],
                         [("4k", 1), ("4k", 2), ("4k", 4), ("1m", 1), ("1m", 4)])
        self.assertEqual(pairs[1][2:], (None, None))  # the failed row is left out
        self.assertEqual(pairs[0][2]["system"], "loopd-direct")
        self.assertEqual(pairs[0][3]["system"], "loopd-direct-wholelock")


class Medians(unittest.TestCase):
    def test_median_over_rounds_leaves_failures_out(self):
        rows = [dict(case="c", system="s", iops=v, server_us_per_io=u)
                for v, u in ((100.0, 5.0), (300.0, None), (200.0, 7.0))]
        rows.append(dict(case="c", system="s", iops=1e9, error="boom"))
        rows.append(dict(case="c", system="t", iops=1.0))
        m = median_rows(rows)
        self.assertEqual(m[("c", "s")]["iops"], 200.0)
        self.assertEqual(m[("c", "s")]["server_us_per_io"], 6.0)
        self.assertEqual(m[("c", "s")]["rounds"], 3)
        self.assertIsNone(m[("c", "t")]["lat_p99_us"])
        self.assertEqual(m[("c", "t")]["rounds"], 1)
