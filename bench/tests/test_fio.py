import json
import os
import unittest

from helpers import RESULTS
from loopdbench.config import Config
from loopdbench.fio import fio_argv, parse_fio, parse_fio_text
from loopdbench.units import MIB
from loopdbench.workloads import Case

RUN = os.path.join(RESULTS, "2026-11-23-060758")


def job(read_iops=0.0, write_iops=0.0, read_n=0, write_n=0, read_mean=0.0, write_mean=0.0,
        read_p99=0, write_p99=0, error=0):
    def side(iops, n, mean, p99):
        return {"iops": iops, "bw_bytes": int(iops * 4096), "total_ios": n,
                "lat_ns": {"N": n, "mean": mean, "percentile": {"99.000000": p99}}}
    return {"jobs": [{"error": error, "elapsed": 12, "ctx": 345, "usr_cpu": 10.5, "sys_cpu": 20.25,
                      "read": side(read_iops, read_n, read_mean, read_p99),
                      "write": side(write_iops, write_n, write_mean, write_p99)}]}


class ParseFio(unittest.TestCase):
    def test_read_only_job(self):
        r = parse_fio_text(json.dumps(job(read_iops=1000.0, read_n=10000, read_mean=250000.0,
                                          read_p99=900000)))
        self.assertEqual(r["iops"], 1000.0)
        self.assertEqual(r["read_iops"], 1000.0)
        self.assertEqual(r["write_iops"], 0.0)
        self.assertEqual(r["ios"], 10000)
        self.assertAlmostEqual(r["lat_mean_us"], 250.0)
        self.assertAlmostEqual(r["lat_p99_us"], 900.0)
        self.assertAlmostEqual(r["mib_s"], 1000 * 4096 / MIB)
        self.assertEqual((r["fio_ctx"], r["fio_usr_pct"], r["fio_sys_pct"]), (345, 10.5, 20.25))
        self.assertEqual(r["fio_elapsed_s"], 12)

    def test_mixed_job_means_over_both_and_takes_the_worse_p99(self):
        r = parse_fio_text(json.dumps(job(read_iops=300.0, write_iops=100.0, read_n=3000,
                                          write_n=1000, read_mean=100000.0, write_mean=500000.0,
                                          read_p99=200000, write_p99=700000)))
        self.assertEqual(r["iops"], 400.0)
        self.assertEqual(r["ios"], 4000)
        self.assertAlmostEqual(r["lat_mean_us"], (3000 * 100 + 1000 * 500) / 4000)
        self.assertAlmostEqual(r["lat_p99_us"], 700.0)

    def test_notes_before_the_json_are_skipped(self):
        text = "fio: note: both iodepth >= 1 and synchronous I/O engine\n" + json.dumps(
            job(read_iops=5.0, read_n=5, read_mean=1000.0))
        self.assertEqual(parse_fio_text(text)["iops"], 5.0)

    def test_no_io_has_no_mean(self):
        r = parse_fio_text(json.dumps(job()))
        self.assertIsNone(r["lat_mean_us"])
        self.assertEqual(r["iops"], 0.0)

    def test_a_job_error_raises(self):
        with self.assertRaisesRegex(RuntimeError, "fio job error 5"):
            parse_fio_text(json.dumps(job(error=5)))

    def test_stored_fio_output_gives_the_stored_row(self):
        # A real fio 3.33 output of a mixed 4-job case and the row bench/run made of it.
        r = parse_fio(os.path.join(RUN, "fio", "w1-randrw-4k-4jx8-loopd-direct.json"))
        self.assertAlmostEqual(r["iops"], 41412.218, places=2)
        self.assertAlmostEqual(r["read_iops"], 20769.646, places=2)
        self.assertAlmostEqual(r["write_iops"], 20642.571, places=2)
        self.assertAlmostEqual(r["mib_s"], 161.777, places=2)
        self.assertAlmostEqual(r["lat_mean_us"], 772.331, places=2)
        self.assertAlmostEqual(r["lat_p99_us"], 1384.448, places=2)
        self.assertEqual(r["ios"], 414233)
        self.assertEqual(r["fio_ctx"], 61626)


class FioArgv(unittest.TestCase):
    class Target:
        def fio_target(self):
            return ["--ioengine=nbd", "--uri=nbd+unix:///bench?socket=/tmp/s"]

    def test_jobs_get_their_own_slice_of_the_image(self):
        cfg = Config(size=2 << 30, runtime=10, ramp=2)
        a = fio_argv(Case(3, "randrw-4k-12j", "loopd-direct", "randrw", "4k", 1, 12, 50),
                     self.Target(), cfg, "/tmp/x.json")
        part = (2 << 30) // 12 // MIB * MIB
        self.assertIn(f"--size={part}", a)
        self.assertIn(f"--offset_increment={part}", a)
        self.assertIn("--numjobs=12", a)
        self.assertIn("--rwmixread=50", a)
        self.assertIn("--runtime=10", a)
        self.assertIn("--ramp_time=2", a)
        self.assertEqual(a[-2:], self.Target().fio_target())
        self.assertEqual(a[0], "fio")

    def test_no_mix_without_one(self):
        a = fio_argv(Case(1, "read-1m-qd8", "raw", "read", "1m", 8), self.Target(), Config(),
                     "/tmp/x.json")
        self.assertFalse(any(x.startswith("--rwmixread") for x in a))
        self.assertIn("--iodepth=8", a)
