"""bench/RESULTS.md: one current table per workload, then the dated history.

The current tables sit between markers, ``<!-- current:KEY -->`` …
``<!-- /current:KEY -->`` (KEY: ``w1``…``w5``, ``targets``, and hand-kept ones
such as ``tls``); the history is a list of links after ``<!-- history -->``,
newest first. ``bench/run --update-results`` replaces the current table of each
workload the run measured (a heading, a line with the run's date, loopd's commit
and the machine, the table) and adds a link to the run's report.md to the
history. The functions on text are pure (tested in bench/tests)."""

import os
import re
import sys

from .config import BENCH
from .host import machine_facts
from .report import fill_ratios, targets_section, workload_section

SKELETON = """# loopd benchmark results

## Current figures

## History

<!-- history -->
"""


def current_block(key, body):
    return f"<!-- current:{key} -->\n{body.strip()}\n<!-- /current:{key} -->"


def replace_current(text, key, body):
    """``text`` with the current block ``key`` holding ``body``; a block not there
    yet is added at the end of the current figures (before ``## History``)."""
    block = current_block(key, body)
    pat = re.compile(rf"<!-- current:{re.escape(key)} -->\n.*?<!-- /current:{re.escape(key)} -->",
                     re.S)
    if pat.search(text):
        return pat.sub(lambda _: block, text, count=1)
    m = re.search(r"^## History", text, re.M)
    if not m:
        raise ValueError("RESULTS.md has no '## History' heading")
    return text[:m.start()] + block + "\n\n" + text[m.start():]


def current_body(text, key):
    """What the current block ``key`` holds, or None."""
    m = re.search(rf"<!-- current:{re.escape(key)} -->\n(.*?)\n<!-- /current:{re.escape(key)} -->",
                  text, re.S)
    return m.group(1) if m else None


def add_history(text, line):
    """``text`` with ``line`` first in the history list."""
    marker = "<!-- history -->\n"
    i = text.find(marker)
    if i < 0:
        raise ValueError("RESULTS.md has no '<!-- history -->' marker")
    i += len(marker)
    return text[:i] + line.rstrip("\n") + "\n" + text[i:]


def run_line(facts, report_link):
    """The line under a current table's heading: when, which loopd, which machine."""
    loopd = facts.get("loopd", "?")
    m = re.search(r"git (\w+)( with uncommitted changes in src/)?", loopd)
    commit = (m.group(1) + (" + uncommitted changes" if m.group(2) else "")) if m else "?"
    image = facts.get("image", "")
    fs = image.split(", on ", 1)[1] if ", on " in image else "?"
    return (f"Run {facts.get('date', '?')} · loopd {commit} · {facts.get('CPU', '?')}, "
            f"{facts.get('RAM', '?')}, kernel {facts.get('kernel', '?')}, image on "
            f"{' '.join(fs.split())} · [full report]({report_link})")


def with_run_line(section_lines, line):
    """A workload section (heading first) with the run line under its heading."""
    return "\n".join([section_lines[0], line + "\n"] + section_lines[1:])


def update_results_md(cfg, rows, path=None):
    """Puts this run's tables into RESULTS.md as the current ones and links its
    report.md from the history."""
    path = path or os.path.join(BENCH, "RESULTS.md")
    text = SKELETON
    if os.path.exists(path):
        with open(path) as fh:
            text = fh.read()
    prefix = os.path.relpath(cfg.outdir, os.path.dirname(path)) + "/"
    link = prefix + "report.md"
    line = run_line(dict(machine_facts(cfg)), link)
    fill_ratios(rows)
    for w in sorted(cfg.only):
        sec = workload_section(cfg, rows, w, "###", prefix)
        if sec:
            text = replace_current(text, f"w{w}", with_run_line(sec, line))
    if {1, 2, 4} & set(cfg.only):
        sec = targets_section(cfg, rows, "###")
        if sec:
            text = replace_current(text, "targets", with_run_line(sec, line))
    ws = ", ".join(str(w) for w in sorted(cfg.only))
    text = add_history(text, f"- [Side-by-side benchmark — {cfg.started:%Y-%m-%d %H:%M %Z} "
                             f"(workloads {ws})]({link})")
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


# --- the history: a section moved out of RESULTS.md -----------------------------

def archived(section):
    """A RESULTS.md section as a file of its own in bench/results/: headings one level
    up (``## X`` becomes ``# X``), links made relative to bench/results/."""
    lines = [line[1:] if line.startswith("##") else line for line in section.split("\n")]
    return "\n".join(lines).replace("](results/", "](")


def title_of(text):
    """The text of the first heading."""
    for line in text.split("\n"):
        if line.startswith("#"):
            return line.lstrip("#").strip()
    raise ValueError("no heading")


def archive(results_md, section, name):
    """Moves ``section`` (text that was a ``## `` section of RESULTS.md) to
    bench/results/NAME.md and links it first in the history; returns the file."""
    dest = os.path.join(os.path.dirname(results_md), "results", name + ".md")
    if os.path.exists(dest):
        raise FileExistsError(dest)
    body = archived(section).rstrip("\n") + "\n"
    with open(dest, "w") as fh:
        fh.write(body)
    with open(results_md) as fh:
        text = fh.read()
    text = add_history(text, f"- [{title_of(body)}](results/{name}.md)")
    with open(results_md + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(results_md + ".tmp", results_md)
    return dest


def main(argv):
    """``python3 -m loopdbench.results_md archive NAME FILE``: FILE holds a section
    cut from an older RESULTS.md (say, one added on another branch): it becomes
    bench/results/NAME.md, linked first in the history."""
    if len(argv) != 3 or argv[0] != "archive":
        print(main.__doc__, file=sys.stderr)
        return 2
    with open(argv[2]) as fh:
        print(archive(os.path.join(BENCH, "RESULTS.md"), fh.read(), argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
