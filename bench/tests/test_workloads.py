import unittest

from helpers import BENCH  # noqa: F401
from loopdbench.config import Config
from loopdbench.systems import SYSTEMS
from loopdbench.workloads import Case, build_cases, estimate, latency_systems


def cfg(**kw):
    return Config(systems=list(SYSTEMS), **kw)


class Cases(unittest.TestCase):
    def test_full_run_counts(self):
        c = build_cases(cfg())
        by_w = {w: [x for x in c if x.workload == w] for w in range(1, 5)}
        self.assertEqual(len(by_w[1]), 6 * 8 + 1)          # 6 shapes x 8 systems + nosplice
        self.assertEqual(len(by_w[2]), 4 * 8 + 4 * 10)     # 16 jobs: 8 systems; 1 job: +2 nopoll
        self.assertEqual(len(by_w[3]), 2 * 7 * 2)          # 2 sizes x 7 job counts x 2 locks
        self.assertEqual(len(by_w[4]), 3)
        self.assertEqual(latency_systems(cfg()), ["loopd-direct", "nbdkit-default", "qemu-nbd"])

    def test_quick_run_has_short_job_lists(self):
        c = build_cases(cfg(quick=True))
        self.assertEqual(sorted({x.jobs for x in c if x.workload == 2}), [1, 2])
        self.assertEqual(sorted({x.jobs for x in c if x.workload == 3}), [1, 4])

    def test_only_and_systems_select(self):
        c = build_cases(Config(only=[1], systems=["loopd-direct", "raw"]))
        self.assertEqual({x.system for x in c}, {"loopd-direct", "raw"})
        self.assertEqual({x.workload for x in c}, {1})
        self.assertEqual(latency_systems(Config(only=[1], systems=["loopd-direct"])), [])

    def test_workload_3_alternates_which_lock_runs_first(self):
        c = [x for x in build_cases(cfg(only=[3])) if x.workload == 3]
        firsts = [c[i].system for i in range(0, len(c), 2)]
        self.assertEqual(firsts[:4], ["loopd-direct", "loopd-direct-wholelock"] * 2)

    def test_the_1_job_randread_is_the_same_measurement_as_workload_1s(self):
        c = build_cases(cfg(only=[1, 2]))
        w1 = {x.key() for x in c if x.workload == 1}
        shared = [x for x in c if x.workload == 2 and x.key() in w1]
        self.assertEqual({x.name for x in shared}, {"randread-1j"})

    def test_case_split_and_shape(self):
        k = Case(1, "randread-4k-qd32", "raw", "randread", "4k", 32)
        s = k.split()
        self.assertEqual((s.qd, s.jobs, s.name), (16, 2, k.name))
        self.assertEqual(k.shape(), "randread bs=4k QD32 x 1 job")
        self.assertEqual(Case(1, "m", "raw", "randrw", "4k", 8, 4, 50).shape(),
                         "randrw bs=4k QD8 x 4 jobs rwmixread=50")


class Estimate(unittest.TestCase):
    def test_counts_distinct_cases_once(self):
        a = Case(1, "x", "raw", "read", "4k", 1)
        b = Case(2, "y", "raw", "read", "4k", 1)  # same key
        self.assertEqual(estimate([a, b], 0, 10, 2, 1 << 30, 10), estimate([a], 0, 10, 2, 1 << 30, 10))
        self.assertAlmostEqual(estimate([a], 0, 10, 2, 1 << 30, 10), 12.5 + 20)

    def test_buffered_writes_add_writeback_and_latency_adds_reps(self):
        w = Case(1, "x", "loopd-buffered", "randwrite", "4k", 1)
        self.assertAlmostEqual(estimate([w], 0, 10, 2, 2 << 30, 10), 12.5 + 3.0 + 20)
        self.assertAlmostEqual(estimate([], 3, 10, 2, 2 << 30, 10), 3 * 10 * 0.2 + 20)
