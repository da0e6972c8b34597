"""bench/run's report: report.md (machine facts, one table per workload, issue 4's
targets) and results.csv. ``workload_section`` is also what bench/RESULTS.md's
current table of a workload is made of (see ``results_md``)."""

import csv
import os

from .host import machine_facts
from .stats import ratio, seed001_pairs, rate_of
from .systems import BASELINE, BASELINES, SYSTEMS, baseline_of
from .units import MIB, f
from .workloads import RAW_CPU_BOUND_PCT, WORKLOAD_TITLES

CSV_FIELDS = ["workload", "case", "system", "rw", "bs", "iodepth", "numjobs", "cache",
              "iops", "read_iops", "write_iops", "mib_s", "lat_mean_us", "lat_p99_us",
              "ratio_iops_vs_baseline", "baseline", "fio_cpu_s", "fio_usr_pct", "fio_sys_pct", "fio_ctx",
              "server_cpu_s", "server_us_per_io", "server_ctx", "sys_cpu_s", "sys_ctx", "wall_s", "writeback_s",
              "pagecache_before_bytes", "pagecache_bytes", "rss_kib", "hwm_kib",
              "setup_median_ms", "setup_min_ms", "setup_max_ms", "libnbd_median_ms", "nbdinfo_alone_ms", "reps",
              "ios", "fio_elapsed_s", "iops_by_wall", "fio_json", "note", "error"]


def targets_section(cfg, rows, h2):
    """Issue 4's targets checked against this run's rows: a table of target, measured,
    met. Rates are `rate_of` each row."""
    ok = {(r["workload"], r["case"], r["system"]): r for r in rows
          if r.get("iops") is not None and not r.get("error")}

    def rate(w, case, system):
        r = ok.get((w, case, system))
        return rate_of(r) if r else None

    def cost(w, case, system):
        r = ok.get((w, case, system))
        return r.get("server_us_per_io") if r else None

    def verdict(cond):
        return "—" if cond is None else ("yes" if cond else "**no**")

    def x(a, b):
        return f"{a / b:.2f}×" if a and b else "—"

    T = []
    for case, what in (("randread-4k-qd32", "4k randread QD32"),
                       ("randwrite-4k-qd32", "4k randwrite QD32"),
                       ("randrw-4k-4jx8", "4k randrw 4 jobs × QD8")):
        ld = rate(1, case, "loopd-direct")
        nbds = [(s, v) for s in ("nbdkit-none", "qemu-nbd") if (v := rate(1, case, s))]
        best = max(nbds, key=lambda t: t[1]) if nbds else None
        cheap = [(s, v) for s in ("nbdkit-none", "qemu-nbd") if (v := cost(1, case, s))]
        cheapest = min(cheap, key=lambda t: t[1]) if cheap else None
        lc = cost(1, case, "loopd-direct")
        m = f"{f(ld)} vs {best[0]} {f(best[1])} = {x(ld, best[1])}" if ld and best else "—"
        if lc and cheapest:
            k = cheapest[1] / lc
            rel = f"{k:.1f}× less" if k >= 1 else f"{1 / k:.1f}× more"
            m += f"; server CPU per request {lc:.1f} µs vs {cheapest[0]} {cheapest[1]:.1f} ({rel})"
        T.append((f"≥ 2.5× best NBD, {what}", m,
                  verdict(ld / best[1] >= 2.5 if ld and best else None)))
        loop = rate(1, case, "loop-dio")
        T.append((f"≥ 0.5× kernel loop dio, {what}", f"{f(ld)} vs {f(loop)} = {x(ld, loop)}",
                  verdict(ld / loop >= 0.5 if ld and loop else None)))
    for case, what, need in (("read-1m-qd8", "1 MiB seq read QD8", 0.65),
                             ("write-1m-qd8", "1 MiB seq write QD8", 0.85)):
        ld, raw = rate(1, case, "loopd-direct"), rate(1, case, "raw")
        T.append((f"≥ {need}× raw, {what}", f"{f(ld)} vs {f(raw)} IOPS = {x(ld, raw)}",
                  verdict(ld / raw >= need if ld and raw else None)))
    ld = rate(1, "randread-4k-qd1", "loopd-direct")
    nk = [v for v in (rate(1, "randread-4k-qd1", s) for s in ("nbdkit-none", "nbdkit-default")) if v]
    T.append(("≥ nbdkit, 4k randread QD1", f"{f(ld)} vs {f(max(nk)) if nk else '—'}",
              verdict(ld >= max(nk) if ld and nk else None)))
    # Rows copied from another workload's case share its fio JSON: count them once.
    direct = list({r.get("fio_json") or id(r): r for r in ok.values()
                   if r["system"].startswith("loopd-direct")
                   and r.get("pagecache_bytes") is not None}.values())
    worst = max((r["pagecache_bytes"] for r in direct), default=None)
    T.append(("image in page cache after every direct case < 1%",
              f"at most {worst / MIB:.0f} MiB of {cfg.size / MIB:.0f} in {len(direct)} cases"
              if worst is not None else "—",
              verdict(worst < 0.01 * cfg.size if worst is not None else None)))
    for w in (1, 2, 4):
        cases = list(dict.fromkeys(c for (ww, c, s) in ok if ww == w and s == "loopd-buffered"))
        pairs = [(c, rate(w, c, "loopd-buffered"), rate(w, c, "nbdkit-default")) for c in cases]
        pairs = [p for p in pairs if p[2]]
        if not pairs:
            continue
        met = sum(1 for _, a, b in pairs if a >= b)
        T.append((f"`--cache buffered` ≥ nbdkit default, workload {w}",
                  ", ".join(f"{c} {a / b:.2f}×" for c, a, b in pairs),
                  f"{met} of {len(pairs)}"))
    T = [t for t in T if t[2] != "—"]  # targets this run has no figures for
    if not T:
        return []
    L = [f"{h2} Issue 4 targets in this run\n",
         "`loopd --cache direct` unless stated; \"best NBD\" = the better of nbdkit "
         "`cache=none` and qemu-nbd; server CPU per request from `server µs/IO`.\n",
         "| target | measured | met? |", "|---|---|---|"]
    L += [f"| {a} | {b} | {c} |" for a, b, c in T]
    L.append("")
    return L


def write_report(cfg, rows, failures, link_prefix="", heading="#"):
    h1, h2 = heading, heading + "#"
    L = []
    L.append(f"{h1} Side-by-side benchmark — {cfg.started:%Y-%m-%d %H:%M %Z}"
             f"{' (quick smoke run)' if cfg.quick else ''}\n")
    L.append("Every system serves the same preallocated image of random data; each case "
             "starts its server (or loop device) fresh and, except in workload 4, drops the "
             "image from the page cache first. fio drives NBD systems with its `nbd` engine "
             "over a Unix socket (one connection per job) and the file and loop devices with "
             "`io_uring`, `direct=1`. Raw fio JSON, `results.csv` and server logs: "
             f"`bench/results/{os.path.basename(cfg.outdir)}/`.\n")
    L.append("| | |\n|---|---|")
    for k, v in machine_facts(cfg):
        L.append(f"| {k} | {v} |")
    L.append("")
    L.append("Systems:\n")
    for s in SYSTEMS:
        if s in cfg.systems:
            L.append(f"- **{s}**: {SYSTEMS[s]['desc']}")
    L.append(f"\nThe raw reference: where one fio job (QD ≥ 2) used ≥ {RAW_CPU_BOUND_PCT:.0f}% of "
             "a core, the case was rerun as 2 jobs at half the queue depth; those rows say so "
             "(see “note” in `results.csv` and below the table), the rest ran as 1 job (`fio CPU` = "
             "client CPU seconds per second of run). Latency is fio's total latency (submission + completion); for mixed "
             "cases the mean is over reads and writes and p99 is the worse of the two. "
             "“× loopd-direct” is IOPS relative to loopd `--cache direct` in the same case "
             "(workload 4: to loopd `--cache buffered`). "
             "Server CPU and context switches cover the whole case (ramp included) from "
             "`/proc/PID/stat` and `wait4`; `server µs/IO` is that CPU over the case's I/O "
             "(IOPS × wall time): the server's cost per request. `sys` columns are machine-wide (`/proc/stat`), so "
             "they include fio and anything else running.\n")
    if failures:
        L.append(f"**{len(failures)} case(s) failed:**\n")
        for fl in failures:
            L.append(f"- {fl}")
        L.append("")
    fill_ratios(rows)
    for w in sorted(cfg.only):
        L += workload_section(cfg, rows, w, h2, link_prefix)
    if {1, 2, 4} & set(cfg.only):
        L += targets_section(cfg, rows, h2)
    return "\n".join(L)


def fill_ratios(rows):
    """Sets each row's ``ratio_iops_vs_baseline`` and ``baseline``."""
    by_case = {(r["workload"], r["case"], r["system"]): r for r in rows}
    for r in rows:
        if r.get("iops") is not None:
            r["ratio_iops_vs_baseline"] = ratio(by_case, r)
            r["baseline"] = baseline_of(r["workload"])


def fio_table(wrows, extra, base=BASELINE):
    """A workload's table of fio figures, ``extra`` columns after the common ones,
    and the notes below it."""
    L = []
    cols = ["case", "system", "IOPS", "MiB/s", "mean µs", "p99 µs", "fio CPU",
            "server CPU s", "server µs/IO", f"× {base}"] + [c[0] for c in extra]
    L.append("| " + " | ".join(cols) + " |")
    L.append("|" + "---|" * 2 + "---:|" * (len(cols) - 2))
    last = None
    for r in wrows:
        cells = [r["case"] if r["case"] != last else "", r["system"]]
        last = r["case"]
        if r.get("todo"):
            cells += [r["todo"]] + [""] * (len(cols) - 3)
        elif r.get("error"):
            cells += ["FAILED"] + [""] * (len(cols) - 3)
        else:
            fcpu = r["fio_cpu_s"] / r["wall_s"] if r.get("wall_s") else None
            rt = r.get("ratio_iops_vs_baseline")
            cells += [f(r["iops"]), f(r["mib_s"], 1), f(r["lat_mean_us"], 1),
                      f(r["lat_p99_us"], 1), f(fcpu, 2), f(r.get("server_cpu_s"), 2),
                      f(r.get("server_us_per_io"), 1), f"{rt:.2f}×" if rt else "—"]
            cells += [fn(r) for _, fn in extra]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    notes = [f"- {r['case']} · {r['system']}: {r.get('note') or r.get('error')}"
             for r in wrows if r.get("note") or r.get("error")]
    for r in wrows:
        per_job = (r["fio_cpu_s"] / r["wall_s"] / r["numjobs"]
                   if r.get("wall_s") and r.get("fio_cpu_s") is not None else 0)
        if per_job >= 0.8:
            notes.append(f"- {r['case']} · {r['system']}: the fio client used {per_job:.2f} "
                         "of a core per job, so this figure is bounded by the client too")
    if notes:
        L.append("Notes:\n")
        L.extend(notes)
        L.append("")
    return L


def mib(v):
    return f(v / MIB if v is not None else None, 0)


def workload_section(cfg, rows, w, h2, link_prefix=""):
    """Workload ``w``'s part of the report: its heading (level ``h2``), table(s) and
    plot link; [] when ``rows`` has none of it."""
    wrows = [r for r in rows if r["workload"] == w]
    if not wrows:
        return []
    L = []
    L.append(f"{h2} {WORKLOAD_TITLES[w]}\n")
    if w == 1:
        L += fio_table(wrows, [])
        L.append(f"![workload 1: IOPS relative to loopd-direct]({link_prefix}w1-iops.png)\n")
    elif w == 2:
        L.append("bs=4k, QD1 per job, one NBD connection per job. Page cache = the image's "
                 "resident bytes after the case (`fincore`); RSS / peak = the server's "
                 "`VmRSS` / `VmHWM` at the end of the case. Writeback = `fdatasync` of the image "
                 "after the case: dirty pages a buffered system left behind, written back "
                 "outside the measured run.\n")
        L += fio_table(wrows, [
            ("fio ctx", lambda r: f(r.get("fio_ctx"))),
            ("server ctx", lambda r: f(r.get("server_ctx"))),
            ("sys ctx", lambda r: f(r.get("sys_ctx"))),
            ("sys CPU s", lambda r: f(r.get("sys_cpu_s"), 2)),
            ("page cache MiB", lambda r: mib(r.get("pagecache_bytes"))),
            ("writeback s", lambda r: f(r.get("writeback_s"), 2)),
            ("RSS / peak MiB", lambda r: (f"{r['rss_kib'] / 1024:.0f} / {r['hwm_kib'] / 1024:.0f}"
                                          if r.get("rss_kib") else "—")),
        ])
        L.append(f"![seed-000: page cache and context switches]({link_prefix}seed000-memory-ctx.png)\n")
    elif w == 3:
        L.append("fio `randrw` 50/50, QD1 per job, one connection per job, against loopd "
                 "`--cache direct` with its byte-range lock and with `--whole-device-lock`. "
                 "Gain = range-lock IOPS / whole-device-lock IOPS − 1.\n")
        L.append("| bs | jobs | range lock IOPS | whole-device lock IOPS | gain | "
                 "range p99 µs | whole p99 µs |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for bs, jobs, a, b in seed001_pairs(wrows):
            g = (a["iops"] / b["iops"] - 1) * 100 if a and b and b.get("iops") else None
            L.append(f"| {bs} | {jobs} | {f(a and a.get('iops'))} | {f(b and b.get('iops'))} | "
                     f"{f(g, 1)}{'%' if g is not None else ''} | "
                     f"{f(a and a.get('lat_p99_us'), 0)} | {f(b and b.get('lat_p99_us'), 0)} |")
        L.append("")
        L.append(f"![seed-001: gain of the range lock]({link_prefix}seed001-gain.png)\n")
        L += fio_table(wrows, [])
    elif w == 4:
        L.append("The image is read once into the page cache before each case and not "
                 "dropped. loopd `--cache buffered` tries `preadv2(RWF_NOWAIT)` inline first.\n")
        L += fio_table(wrows, [("page cache MiB", lambda r: mib(r.get("pagecache_bytes")))],
                  base=BASELINES[4])
    elif w == 5:
        L.append(f"Spawn of the server process to the first successful `nbdinfo --size URI`, "
                 "with `nbdinfo` processes run back to back from the spawn on (so the "
                 f"client's start-up overlaps the server's), {cfg.setup_reps} runs each. "
                 "`libnbd in-process` = the same to the first successful connect + size "
                 "from the harness itself via libnbd's Python binding, polled every 0.2 ms "
                 "(no client start-up: the server's own readiness). `nbdinfo alone` = one "
                 "more `nbdinfo --size` against the running server.\n")
        L.append("| system | median ms | min ms | max ms | libnbd in-process median ms | "
                 "nbdinfo alone ms | × loopd |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        base = next((r for r in wrows if r["system"] == "loopd-direct" and not r.get("error")), None)
        for r in wrows:
            if r.get("error"):
                L.append(f"| {r['system']} | FAILED | | | | | |")
                continue
            rt = (r["setup_median_ms"] / base["setup_median_ms"]) if base else None
            L.append(f"| {r['system']} | {f(r['setup_median_ms'], 1)} | {f(r['setup_min_ms'], 1)} | "
                     f"{f(r['setup_max_ms'], 1)} | {f(r.get('libnbd_median_ms'), 2)} | "
                     f"{f(r['nbdinfo_alone_ms'], 1)} | "
                     f"{f(rt, 2)}{'×' if rt else ''} |")
        L.append("")
    return L


def write_csv(path, rows, fields=CSV_FIELDS):
    """One line per row; floats with 3 decimals; fields a row lacks left empty."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()})
