"""Sizes, durations and number formatting."""

import argparse
import re

MIB = 1 << 20


def fmt_dur(s):
    """Seconds as ``42s`` or ``3m05s``."""
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def parse_size(s):
    """An image size (``2G``, ``256M``, ``512MiB``) in bytes: a whole number of MiB,
    at least 64 MiB. Raises ``argparse.ArgumentTypeError`` (it is an argparse type)."""
    m = re.fullmatch(r"(\d+)([KMGT]?)(i?B)?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (e.g. 2G, 256M)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    v = int(m.group(1)) * mult
    if v < 64 * MIB or v % MIB:
        raise argparse.ArgumentTypeError("size must be a whole number of MiB, at least 64M")
    return v


def size_label(v):
    """Bytes as the label of the image's file name: ``2G`` or ``256M``."""
    return f"{v >> 30}G" if v % (1 << 30) == 0 else f"{v >> 20}M"


def f(v, nd=0, none="—"):
    """A figure for a report table: thousands separators, ``nd`` decimals; ``none``
    for a missing figure; strings as they are."""
    if v is None or v == "":
        return none
    if isinstance(v, str):
        return v
    return f"{v:,.{nd}f}"
