"""Figures derived from a case's row (a dict of what fio, /proc and wait4 gave):
the rate, CPU per request, the ratio to the baseline, the workload 3 pairs, and
medians over rounds. Pure functions: tested in bench/tests/test_stats.py."""

import statistics

from .systems import baseline_of


def rate_of(row):
    """The case's I/O rate: IOPS by wall clock where the jobs did not run side by side
    (see `stretch_note`), else fio's IOPS."""
    return row.get("iops_by_wall") or row.get("iops")


def server_us_per_io(row):
    """Server CPU per request, µs: the server's CPU over the whole case (ramp included)
    divided by the I/O of the whole case at its rate (`rate_of`). The cost per request
    the issue's baseline says decides when a server is CPU-bound."""
    rate = rate_of(row)
    if row.get("server_cpu_s") is None or not rate or not row.get("wall_s"):
        return None
    return row["server_cpu_s"] / (rate * row["wall_s"]) * 1e6


def client_us_per_io(row):
    """fio's CPU per request, µs, the same way as `server_us_per_io`."""
    rate = rate_of(row)
    if row.get("fio_cpu_s") is None or not rate or not row.get("wall_s"):
        return None
    return row["fio_cpu_s"] / (rate * row["wall_s"]) * 1e6


def stretch_note(row, cfg):
    """fio reports IOPS as the sum over jobs of each job's I/O per second of its own
    run. When a server serves some connections and leaves others waiting (jobs then
    run one after another, not side by side), the case takes much longer than
    runtime + ramp and that sum overstates what the server delivered at once. Say so,
    with the I/O per second of wall clock after the ramp (also set as the row's
    ``iops_by_wall``)."""
    planned = cfg.runtime + cfg.ramp
    wall = row.get("wall_s") or 0
    if row.get("numjobs", 1) < 2 or wall <= planned + max(1.5, 0.1 * planned):
        return ""
    by_wall = (row.get("ios") or 0) / max(wall - cfg.ramp, 1e-9)
    row["iops_by_wall"] = by_wall
    return (f"jobs did not run side by side: the case took {wall:.1f} s for {planned} s "
            f"of planned run; by wall clock {by_wall:,.0f} IOPS, not the {row['iops']:,.0f} "
            "fio sums over jobs")


def ratio(rows_by_case, row):
    """IOPS of ``row`` over its workload's baseline system in the same case."""
    base = rows_by_case.get((row["workload"], row["case"], baseline_of(row["workload"])))
    if base and base.get("iops") and row.get("iops") is not None:
        return row["iops"] / base["iops"]
    return None


def seed001_pairs(wrows):
    """Workload 3: (bs, jobs, range-lock row, whole-device-lock row), 4k first."""
    idx = {(r["bs"], r["numjobs"], r["system"]): r for r in wrows if not r.get("error")}
    keys = sorted({(r.get("bs"), r.get("numjobs")) for r in wrows if r.get("bs")},
                  key=lambda k: (k[0] != "4k", k[1]))
    return [(bs, j, idx.get((bs, j, "loopd-direct")), idx.get((bs, j, "loopd-direct-wholelock")))
            for bs, j in keys]


MEDIAN_FIGURES = ("iops", "mib_s", "lat_mean_us", "lat_p99_us", "server_us_per_io",
                  "client_us_per_io")


def median_rows(rows, figures=MEDIAN_FIGURES):
    """One row per (case, system): the median of each figure over the rounds
    (failed rows left out; ``rounds`` = how many rows it is the median of)."""
    groups = {}
    for r in rows:
        if not r.get("error"):
            groups.setdefault((r["case"], r["system"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        m = dict(rs[0], rounds=len(rs))
        for k in figures:
            vals = [r[k] for r in rs if r.get(k) is not None]
            m[k] = statistics.median(vals) if vals else None
        out[key] = m
    return out
