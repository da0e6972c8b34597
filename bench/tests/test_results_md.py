import datetime
import os
import re
import shutil
import tempfile
import unittest

from helpers import BENCH, stored_rows
from loopdbench.config import Config
from loopdbench.results_md import (SKELETON, add_history, archive, archived, current_body,
                                   replace_current, run_line, title_of, update_results_md)
from loopdbench.systems import SYSTEMS

RESULTS_MD = os.path.join(BENCH, "RESULTS.md")


class Blocks(unittest.TestCase):
    def test_replace_keeps_the_rest(self):
        text = SKELETON.replace("## History", "<!-- current:w1 -->\nold\n<!-- /current:w1 -->\n\n"
                                "<!-- current:w2 -->\nkeep\n<!-- /current:w2 -->\n\n## History")
        out = replace_current(text, "w1", "new table\n")
        self.assertEqual(current_body(out, "w1"), "new table")
        self.assertEqual(current_body(out, "w2"), "keep")
        self.assertEqual(out.count("<!-- current:w1 -->"), 1)

    def test_a_new_block_goes_before_the_history(self):
        out = replace_current(SKELETON, "w3", "t3")
        self.assertLess(out.index("<!-- current:w3 -->"), out.index("## History"))
        self.assertGreater(out.index("<!-- current:w3 -->"), out.index("## Current figures"))
        self.assertEqual(current_body(out, "w3"), "t3")

    def test_bodies_with_regex_characters_are_kept_as_they_are(self):
        body = r"| a \1 $0 | (b) |"
        out = replace_current(replace_current(SKELETON, "w1", "x"), "w1", body)
        self.assertEqual(current_body(out, "w1"), body)

    def test_history_is_newest_first(self):
        out = add_history(add_history(SKELETON, "- old"), "- new")
        self.assertLess(out.index("- new"), out.index("- old"))

    def test_missing_markers_are_refused(self):
        with self.assertRaises(ValueError):
            add_history("# x\n", "- y")
        with self.assertRaises(ValueError):
            replace_current("# x\n", "w1", "y")

    def test_run_line(self):
        facts = {"date": "2026-11-23 06:07 UTC", "loopd": "loopd 0.1.0, git bf01b13, release build",
                 "CPU": "Xeon, 2 online (`nproc`)", "RAM": "23.5 GiB", "kernel": "6.18",
                 "image": "`/var/tmp/x.raw`, 2048 MiB of random data, on ext4   /dev/vda"}
        line = run_line(facts, "results/r/report.md")
        self.assertEqual(line, "Run 2026-11-23 06:07 UTC · loopd bf01b13 · Xeon, 2 online "
                               "(`nproc`), 23.5 GiB, kernel 6.18, image on ext4 /dev/vda · "
                               "[full report](results/r/report.md)")
        facts["loopd"] = "loopd 0.1.0, git abc1234 with uncommitted changes in src/, release build"
        self.assertIn("loopd abc1234 + uncommitted changes ·", run_line(facts, "x"))


class Archive(unittest.TestCase):
    SECTION = ("## Issue 99: a check — 2026-12-01\n\nText, [a link](results/x/report.md), "
               "`bench/results/x/` as text.\n\n### Sub\n\n| a |\n|---|\n| 1 |\n")

    def test_headings_go_one_level_up_and_links_become_relative(self):
        out = archived(self.SECTION)
        self.assertTrue(out.startswith("# Issue 99: a check — 2026-12-01\n"))
        self.assertIn("\n## Sub\n", out)
        self.assertIn("[a link](x/report.md)", out)
        self.assertIn("`bench/results/x/` as text", out)
        self.assertEqual(title_of(out), "Issue 99: a check — 2026-12-01")

    def test_archive_writes_the_file_and_links_it_first(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "results"))
            path = os.path.join(d, "RESULTS.md")
            with open(path, "w") as fh:
                fh.write(add_history(SKELETON, "- [old](results/old.md)"))
            dest = archive(path, self.SECTION, "2026-12-01-issue99")
            self.assertEqual(dest, os.path.join(d, "results", "2026-12-01-issue99.md"))
            with open(path) as fh:
                text = fh.read()
            self.assertLess(text.index("(results/2026-12-01-issue99.md)"), text.index("(results/old.md)"))
            with self.assertRaises(FileExistsError):
                archive(path, self.SECTION, "2026-12-01-issue99")


class Update(unittest.TestCase):
    def test_a_run_replaces_its_workloads_tables_and_is_linked(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "RESULTS.md")
            shutil.copy(RESULTS_MD, path)
            with open(path) as fh:
                before = fh.read()
            outdir = os.path.join(d, "results", "2026-12-01-101010")
            os.makedirs(outdir)
            rows = [r for r in stored_rows("2026-11-26-issue14/after-1") if r["workload"] == 1]
            cfg = Config(only=[1], systems=list(SYSTEMS), outdir=outdir, image=d,
                         loopd="/bin/true", size=2 << 30,
                         started=datetime.datetime(2026, 12, 1, 10, 10).astimezone())
            update_results_md(cfg, rows, path)
            with open(path) as fh:
                after = fh.read()
        w1 = current_body(after, "w1")
        self.assertIn("### Workload 1", w1)
        self.assertIn("[full report](results/2026-12-01-101010/report.md)", w1)
        self.assertIn("(results/2026-12-01-101010/w1-iops.png)", w1)
        self.assertIn("| randread-4k-qd1 | loopd-direct | 9,870 |", w1)
        for key in ("w2", "w3", "w4", "w5"):
            self.assertEqual(current_body(after, key), current_body(before, key), key)
        self.assertIn("<!-- history -->\n- [Side-by-side benchmark — 2026-12-01 10:10", after)
        self.assertIn(" (workloads 1)](results/2026-12-01-101010/report.md)\n", after)
        # Everything after the history marker that was there is still there.
        old_hist = before[before.index("<!-- history -->"):].split("\n", 1)[1]
        self.assertTrue(after.endswith(old_hist))


class TheRepositorysResults(unittest.TestCase):
    """bench/RESULTS.md as committed: its blocks are there and its links resolve."""

    def setUp(self):
        with open(RESULTS_MD) as fh:
            self.text = fh.read()

    def test_one_current_table_per_workload(self):
        for key in ("w1", "w2", "w3", "w4", "w5", "targets"):
            body = current_body(self.text, key)
            self.assertIsNotNone(body, key)
            self.assertRegex(body, r"(?m)^Run \d{4}-\d\d-\d\d .* · loopd \w+ · ", key)

    def test_every_link_resolves(self):
        links = re.findall(r"\]\(([^)#]+)\)", self.text)
        self.assertGreater(len(links), 10)
        for link in links:
            self.assertTrue(os.path.exists(os.path.join(BENCH, link)), link)

    def test_every_history_file_is_linked_and_its_links_resolve(self):
        results = os.path.join(BENCH, "results")
        for name in sorted(os.listdir(results)):
            if not name.endswith(".md"):
                continue
            self.assertIn(f"(results/{name})", self.text, name)
            with open(os.path.join(results, name)) as fh:
                for link in re.findall(r"\]\(([^)#]+)\)", fh.read()):
                    if "://" not in link:
                        self.assertTrue(os.path.exists(os.path.join(results, link)),
                                        f"{name}: {link}")
