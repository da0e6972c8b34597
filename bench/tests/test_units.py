import argparse
import unittest

from helpers import BENCH  # noqa: F401 (puts bench/ on sys.path)
from loopdbench.units import MIB, f, fmt_dur, parse_size, size_label


class Units(unittest.TestCase):
    def test_parse_size_accepts_suffixes(self):
        self.assertEqual(parse_size("2G"), 2 << 30)
        self.assertEqual(parse_size("256M"), 256 * MIB)
        self.assertEqual(parse_size("512MiB"), 512 * MIB)
        self.assertEqual(parse_size(" 1g "), 1 << 30)
        self.assertEqual(parse_size(str(64 * MIB)), 64 * MIB)

    def test_parse_size_refuses_small_unaligned_and_garbage(self):
        for bad in ("63M", "1000000000", "1.5G", "2X", "", "-1G"):
            with self.assertRaises(argparse.ArgumentTypeError, msg=bad):
                parse_size(bad)

    def test_size_label_is_the_image_file_name(self):
        self.assertEqual(size_label(2 << 30), "2G")
        self.assertEqual(size_label(256 * MIB), "256M")
        self.assertEqual(size_label(1536 * MIB), "1536M")

    def test_fmt_dur(self):
        self.assertEqual(fmt_dur(0), "0s")
        self.assertEqual(fmt_dur(59.4), "59s")
        self.assertEqual(fmt_dur(60), "1m00s")
        self.assertEqual(fmt_dur(1827), "30m27s")

    def test_f_formats_figures_for_tables(self):
        self.assertEqual(f(None), "—")
        self.assertEqual(f(""), "—")
        self.assertEqual(f(None, none="-"), "-")
        self.assertEqual(f("FAILED"), "FAILED")
        self.assertEqual(f(1234567.8), "1,234,568")
        self.assertEqual(f(0.125, 2), "0.12")
        self.assertEqual(f(3.14159, 1), "3.1")
