import unittest

from helpers import BENCH  # noqa: F401
from loopdbench.host import CLK_TCK, parse_stat_cpu_s, parse_system_counters


class ProcParsing(unittest.TestCase):
    def test_stat_cpu_survives_a_comm_with_spaces_and_parens(self):
        fields = ["S", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "250", "50"] + ["0"] * 30
        text = "1234 (loopd (x) y) " + " ".join(fields)
        self.assertAlmostEqual(parse_stat_cpu_s(text), 300 / CLK_TCK)

    def test_system_counters_busy_time_and_ctxt(self):
        text = ("cpu  100 5 50 1000 20 7 3 0 0 0\n"
                "cpu0 50 2 25 500 10 3 1 0 0 0\n"
                "ctxt 987654\nbtime 1\n")
        cpu, ctx = parse_system_counters(text)
        self.assertAlmostEqual(cpu, (100 + 5 + 50 + 7 + 3) / CLK_TCK)
        self.assertEqual(ctx, 987654)
