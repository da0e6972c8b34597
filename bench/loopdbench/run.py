"""bench/run: the side-by-side benchmark's command line and main loop."""

import argparse
import datetime
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import time

from .config import BENCH, REPO, Config
from .fio import measure_setup_latency, run_case
from .host import ensure_image, loadavg
from .plots import make_plots
from .report import write_csv, write_report
from .results_md import update_results_md
from .session import Session
from .systems import SYSTEMS
from .units import MIB, fmt_dur, parse_size
from .workloads import (RAW_CPU_BOUND_PCT, SETUP_OVERHEAD_S, build_cases, estimate,
                        latency_systems)

TOOLS = ["fio", "nbdkit", "qemu-nbd", "nbdinfo", "losetup", "fincore", "findmnt"]


def check_tools(cfg, session):
    missing = [t for t in TOOLS if shutil.which(t) is None]
    r = subprocess.run(["fio", "--enghelp=nbd"], capture_output=True) if "fio" not in missing else None
    if r is not None and r.returncode != 0:
        missing.append("fio nbd engine")
    # find_spec, not import: a smaller harness process forks faster (workload 5).
    for mod, pkg in (("matplotlib", "python3-matplotlib"), ("nbd", "python3-libnbd")):
        if importlib.util.find_spec(mod) is None:
            missing.append(pkg)
    if missing:
        session.die(f"missing: {', '.join(missing)}; run bench/install-deps.sh (as root)")
    if os.geteuid() != 0 and any(SYSTEMS[s]["kind"] == "loop" for s in cfg.systems):
        session.die("kernel loop systems need root (losetup); run as root or pass --systems without loop-*")


def build_loopd(cfg, session):
    if cfg.loopd_given:
        return
    session.warn("cargo build --release")
    r = subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=REPO)
    if r.returncode != 0:
        session.die("cargo build --release failed (pass --loopd PATH to use a prebuilt binary)")


def parse_args(argv, session):
    """The command line as a ``Config`` (exits 2 on a usage error); and ``--list``."""
    ap = argparse.ArgumentParser(
        description="Side-by-side benchmark: loopd vs kernel loop, nbdkit, qemu-nbd, raw file.")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: ~1 s per case, 256 MiB image, reduced job lists")
    ap.add_argument("--runtime", type=int, help="seconds per case (default 10; --quick: 1)")
    ap.add_argument("--ramp", type=int, help="ramp seconds per case (default 2; --quick: 0)")
    ap.add_argument("--size", type=parse_size, help="image size (default 2G; --quick: 256M)")
    ap.add_argument("--only", help="workloads to run, e.g. 1,3 (default: 1,2,3,4,5)")
    ap.add_argument("--systems", help=f"systems to run (default: all): {', '.join(SYSTEMS)}")
    ap.add_argument("--setup-reps", type=int, help="runs per system in workload 5 (default 10)")
    ap.add_argument("--out", help="output directory (default bench/results/<date>[-quick])")
    ap.add_argument("--loopd", help="loopd binary (default: cargo build --release, target/release/loopd)")
    ap.add_argument("--update-results", action="store_true",
                    help="also put the report's tables into bench/RESULTS.md as the current ones")
    ap.add_argument("--list", action="store_true", help="print the cases and the estimate, run nothing")
    a = ap.parse_args(argv)
    cfg = Config(
        quick=a.quick,
        command=shlex.join(["bench/run"] + argv),
        runtime=a.runtime if a.runtime is not None else (1 if a.quick else 10),
        ramp=a.ramp if a.ramp is not None else (0 if a.quick else 2),
        size=a.size or (256 * MIB if a.quick else 2 << 30),
        setup_reps=a.setup_reps or (3 if a.quick else 10),
        update_results=a.update_results,
        loopd_given=a.loopd is not None,
    )
    if cfg.runtime < 1 or cfg.ramp < 0:
        session.die("--runtime must be >= 1 and --ramp >= 0")
    try:
        cfg.only = sorted({int(x) for x in (a.only or "1,2,3,4,5").split(",") if x})
    except ValueError:
        session.die("--only takes workload numbers, e.g. 1,3")
    if not set(cfg.only) <= {1, 2, 3, 4, 5}:
        session.die("--only: workloads are 1 to 5")
    cfg.systems = a.systems.split(",") if a.systems else list(SYSTEMS)
    bad = [s for s in cfg.systems if s not in SYSTEMS]
    if bad:
        session.die(f"unknown system(s) {', '.join(bad)}; known: {', '.join(SYSTEMS)}")
    if cfg.update_results and cfg.quick:
        session.die("--update-results with --quick: smoke-run numbers do not belong in RESULTS.md")
    if a.loopd:
        cfg.loopd = os.path.abspath(a.loopd)
    cfg.outdir = a.out or ""
    return cfg, a.list


def run_all(cases, lat, cfg, session):
    """Runs every case and setup-latency system; returns (rows, failures)."""
    rows, failures, done = [], [], {}
    total = len(cases) + len(lat)
    per_case = cfg.runtime + cfg.ramp + SETUP_OVERHEAD_S
    t_cases = time.monotonic()
    n_run = 0
    for i, c in enumerate(cases, 1):
        session.check_interrupted()
        left_keys = len({x.key() for x in cases[i - 1:]} - set(done))
        eta = left_keys * per_case + len(lat) * cfg.setup_reps * 0.15
        session.progress(f"[{i}/{total}] w{c.workload} {c.name} · {c.system} · ~{fmt_dur(eta)} left")
        if c.key() in done:
            src = done[c.key()]
            row = dict(src, workload=c.workload, case=c.name,
                       note=f"same measurement as w{src['workload']} {src['case']}")
            rows.append(row)
            continue
        try:
            row = run_case(c, cfg, session)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - report any failure, go on with the others
            msg = f"w{c.workload} {c.name} {c.system}: {e}"
            session.warn(f"FAILED {msg}")
            failures.append(msg)
            row = dict(workload=c.workload, case=c.name, system=c.system, error=str(e))
        pct = (row.get("fio_usr_pct") or 0) + (row.get("fio_sys_pct") or 0)
        if (c.system == "raw" and c.jobs == 1 and c.qd >= 2 and not row.get("error")
                and pct >= RAW_CPU_BOUND_PCT):
            session.warn(f"raw {c.name}: one fio job used {pct:.0f}% of a core; rerunning as 2 jobs")
            try:
                row2 = run_case(c.split(), cfg, session)
                row2["note"] = (f"2 jobs × QD{c.qd // 2}: 1 job × QD{c.qd} was CPU-bound "
                                f"({pct:.0f}% of a core, {row['iops']:,.0f} IOPS)")
                row = row2
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001
                failures.append(f"w{c.workload} {c.name} raw (2 jobs): {e}")
                row = dict(row, error=f"2-job rerun: {e}")
        if not row.get("error") and not (row.get("iops") or 0) > 0:
            failures.append(f"w{c.workload} {c.name} {c.system}: no I/O completed")
            row["error"] = "no I/O completed"
        rows.append(row)
        done[c.key()] = row
        n_run += 1
        per_case = (time.monotonic() - t_cases) / n_run
    for j, s in enumerate(lat, len(cases) + 1):
        session.check_interrupted()
        session.progress(f"[{j}/{total}] w5 setup-latency · {s} · "
                         f"~{fmt_dur((total - j + 1) * cfg.setup_reps * 0.15)} left")
        try:
            rows.append(measure_setup_latency(s, cfg, session))
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001
            session.warn(f"FAILED w5 setup-latency {s}: {e}")
            failures.append(f"w5 setup-latency {s}: {e}")
            rows.append(dict(workload=5, case="setup-latency", system=s, error=str(e)))
    return rows, failures


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    session = Session()
    cfg, list_only = parse_args(argv, session)
    cases = build_cases(cfg)
    lat = latency_systems(cfg)
    if not cases and not lat:
        session.die("nothing to run: --only/--systems select no case")
    est = estimate(cases, len(lat), cfg.runtime, cfg.ramp, cfg.size, cfg.setup_reps)
    if list_only:
        for c in cases:
            print(f"w{c.workload} {c.name:24} {c.system:24} {c.shape()}")
        for s in lat:
            print(f"w5 setup-latency            {s}")
        print(f"{len(cases)} fio cases ({len({c.key() for c in cases})} distinct), "
              f"estimated {fmt_dur(est)}")
        return 0

    check_tools(cfg, session)
    session.install()
    cfg.started = datetime.datetime.now().astimezone()
    t_start = time.monotonic()
    cfg.load_start = loadavg()
    default_out = os.path.join(BENCH, "results",
                               cfg.started.strftime("%Y-%m-%d-%H%M%S") + ("-quick" if cfg.quick else ""))
    cfg.outdir = os.path.abspath(cfg.outdir or default_out)
    os.makedirs(os.path.join(cfg.outdir, "fio"), exist_ok=True)

    if any(SYSTEMS[s]["kind"] == "loopd" for s in {c.system for c in cases} | set(lat)):
        build_loopd(cfg, session)
        if not os.access(cfg.loopd, os.X_OK):
            session.die(f"{cfg.loopd} is not an executable loopd binary")
    cfg.image = ensure_image(cfg.image_dir, cfg.size, session)
    if os.geteuid() == 0:
        session.detach_stale_loops(cfg.image)

    full = Config(quick=False, only=cfg.only, systems=cfg.systems)
    session.warn(f"{len(cases)} fio cases + {len(lat)} setup-latency systems, "
                 f"runtime {cfg.runtime}s + ramp {cfg.ramp}s each: estimated {fmt_dur(est)}"
                 + ("" if not cfg.quick else
                    f" (a full default run: ~{fmt_dur(estimate(build_cases(full), len(lat), 10, 2, 2 << 30, 10))})"))
    session.warn(f"output: {cfg.outdir}")

    try:
        rows, failures = run_all(cases, lat, cfg, session)
    except KeyboardInterrupt:
        session.progress_clear()
        session.cleanup()
        session.die("interrupted; servers stopped and loop devices detached", 130)
    finally:
        session.cleanup()
        session.progress_clear()

    cfg.elapsed = time.monotonic() - t_start
    cfg.load_end = loadavg()
    report = write_report(cfg, rows, failures)  # also fills in the ratios
    write_csv(os.path.join(cfg.outdir, "results.csv"), rows)
    plots = make_plots(cfg, rows)
    with open(os.path.join(cfg.outdir, "report.md"), "w") as fh:
        fh.write(report + "\n")
    if cfg.update_results:
        update_results_md(cfg, rows)
        session.warn("bench/RESULTS.md updated")
    session.warn(f"done in {fmt_dur(cfg.elapsed)}: {len(rows)} rows, plots {', '.join(plots) or 'none'}; "
                 f"report {os.path.join(cfg.outdir, 'report.md')}")
    if failures:
        session.die(f"{len(failures)} case(s) failed:\n  " + "\n  ".join(failures), 1)
    return 0
