"""fio: its command line for a case, its JSON output, one case run from a cold
(or warm) page cache to the row of figures, and workload 5's setup latency."""

import json
import os
import statistics
import subprocess
import time

from .host import (drop_cache, pagecache_bytes, proc_cpu_s, proc_ctx, proc_mem_kib,
                   system_counters, warm_cache)
from .stats import server_us_per_io, stretch_note
from .systems import Served
from .units import MIB


def fio_argv(case, served, cfg, jsonpath):
    part = (cfg.size // case.jobs) // MIB * MIB
    a = ["fio", f"--name={case.workload}-{case.name}", f"--rw={case.rw}", f"--bs={case.bs}",
         f"--iodepth={case.qd}", f"--numjobs={case.jobs}", "--time_based=1",
         f"--runtime={cfg.runtime}", f"--ramp_time={cfg.ramp}", "--group_reporting=1",
         "--lat_percentiles=1", "--randrepeat=0", "--norandommap=1",
         f"--size={part}", f"--offset_increment={part}",
         "--output-format=json", f"--output={jsonpath}"]
    if case.mix is not None:
        a.append(f"--rwmixread={case.mix}")
    return a + served.fio_target()


def parse_fio_text(text):
    """The figures of fio's JSON output (``--group_reporting``: the first job), which
    may follow notes fio printed first. Raises on a job error."""
    doc = json.loads(text[text.index("{"):])
    j = doc["jobs"][0]
    if j.get("error"):
        raise RuntimeError(f"fio job error {j['error']}")
    iops = bw = ios = 0.0
    lat_sum = 0.0
    p99 = 0.0
    per = {}
    for d in ("read", "write"):
        x = j[d]
        n = x["lat_ns"].get("N", 0) or x.get("total_ios", 0)
        iops += x["iops"]
        bw += x["bw_bytes"]
        per[d] = x["iops"]
        if n:
            ios += n
            lat_sum += x["lat_ns"]["mean"] * n
            p99 = max(p99, x["lat_ns"].get("percentile", {}).get("99.000000", 0))
    return dict(iops=iops, read_iops=per["read"], write_iops=per["write"], mib_s=bw / MIB,
                ios=ios, fio_elapsed_s=j.get("elapsed"),
                lat_mean_us=(lat_sum / ios / 1000) if ios else None, lat_p99_us=p99 / 1000,
                fio_ctx=j.get("ctx"), fio_usr_pct=j.get("usr_cpu"), fio_sys_pct=j.get("sys_cpu"))


def parse_fio(path):
    with open(path) as fh:
        return parse_fio_text(fh.read())


def run_case(case, cfg, session, served_cls=Served):
    """Runs one case; returns its row. Raises on any failure (the server stopped)."""
    served = served_cls(case.system, cfg, session)
    row = dict(workload=case.workload, case=case.name, system=case.system, rw=case.rw,
               bs=case.bs, iodepth=case.qd, numjobs=case.jobs, cache="warm" if case.warm else "cold")
    jsonpath = os.path.join(cfg.outdir, "fio", f"w{case.workload}-{case.name}-{case.system}.json")
    try:
        if case.warm:
            warm_cache(cfg.image)
        else:
            drop_cache(cfg.image)
        row["pagecache_before_bytes"] = pagecache_bytes(cfg.image)
        if case.warm and (row["pagecache_before_bytes"] or 0) < 0.95 * cfg.size:
            served.note = (f"only {row['pagecache_before_bytes'] / MIB:.0f} MiB of the image "
                           "was in the page cache at the start")
        served.start()
        pid = served.proc.pid if served.proc else None
        if pid:
            cpu0, ctx0 = proc_cpu_s(pid), proc_ctx(pid)
        scpu0, sctx0 = system_counters()
        t0 = time.monotonic()
        errpath = os.path.join(served.tmp, "fio.stderr")  # a file: a pipe could fill up
        argv = served.fio_argv(fio_argv(case, served, cfg, jsonpath), jsonpath)
        with open(errpath, "wb") as errf:
            fio = session.spawn(argv, "fio", stdout=subprocess.DEVNULL, stderr=errf)
        limit = cfg.runtime + cfg.ramp + 120
        while True:
            pid_, status, ru = os.wait4(fio.pid, os.WNOHANG)
            if pid_:
                fio.returncode = os.waitstatus_to_exitcode(status)
                session.forget(fio)
                break
            if time.monotonic() - t0 > limit:
                session.stop_proc(fio, "fio")
                raise RuntimeError(f"fio did not finish within {limit}s")
            time.sleep(0.02)
        wall = time.monotonic() - t0
        scpu1, sctx1 = system_counters()
        with open(errpath, errors="replace") as errf:
            err = errf.read().strip()
        if fio.returncode != 0:
            raise RuntimeError(f"fio exited {fio.returncode}: {err[-600:]}")
        if not served.alive():
            raise RuntimeError(f"{case.system} died during the case; see {served.log}")
        row.update(parse_fio(jsonpath))
        row["fio_cpu_s"] = ru.ru_utime + ru.ru_stime
        row["wall_s"] = wall
        row["sys_cpu_s"] = scpu1 - scpu0
        row["sys_ctx"] = sctx1 - sctx0
        row["pagecache_bytes"] = pagecache_bytes(cfg.image)
        if pid:
            row["rss_kib"], row["hwm_kib"] = proc_mem_kib(pid)
        sru = served.stop()
        row.update(served.figures())
        if sru is not None:
            # wait4 covers the server's whole life, including threads that
            # already exited (nbdkit's per-connection threads); minus start-up.
            row["server_cpu_s"] = sru.ru_utime + sru.ru_stime - cpu0
            row["server_ctx"] = sru.ru_nvcsw + sru.ru_nivcsw - ctx0
        # Dirty pages a buffered system left behind, written back outside the
        # measured run (before the next case starts).
        t = time.monotonic()
        fd = os.open(cfg.image, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        row["writeback_s"] = time.monotonic() - t
        row["fio_json"] = os.path.relpath(jsonpath, cfg.outdir)
        stretched = stretch_note(row, cfg)
        if stretched:
            served.note = f"{served.note}; {stretched}" if served.note else stretched
        if served.note:
            row["note"] = served.note
        row["server_us_per_io"] = server_us_per_io(row)
        return row
    finally:
        served.stop()


# --- workload 5: setup latency ---------------------------------------------------

def _spawn_for_latency(served, session):
    os.makedirs(os.path.dirname(served.log), exist_ok=True)
    with open(served.log, "ab") as logf:
        t0 = time.monotonic()
        served.proc = session.spawn(served.argv(), served.system, stdout=subprocess.DEVNULL,
                                    stderr=logf)
    return t0


def _poll_ready(served, session, t0, attempt):
    """Calls attempt() until it returns True; returns the seconds since t0."""
    while True:
        if attempt():
            return time.monotonic() - t0
        if served.proc.poll() is not None:
            session.forget(served.proc)
            raise RuntimeError(f"{served.system} exited at start; see {served.log}")
        if time.monotonic() - t0 > 20:
            raise RuntimeError(f"{served.system}: not serving after 20s")
        time.sleep(0.0002)


def measure_setup_latency(system, cfg, session):
    """Spawn of the server to the first successful `nbdinfo --size` (the measure),
    and to the first successful in-process libnbd connect + size (no client start-up)."""
    import nbd  # python3-libnbd, Debian's /usr/bin/python3

    def nbdinfo_ok(uri):
        return subprocess.run(["nbdinfo", "--size", uri], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0

    def libnbd_ok(uri):
        h = nbd.NBD()
        try:
            h.connect_uri(uri)
            h.get_size()
            h.shutdown()
            return True
        except nbd.Error:
            return False
        finally:
            del h  # closes the handle (the binding has no close())

    times, libnbd_times, alone = [], [], []
    for i in range(cfg.setup_reps):
        for kind in ("nbdinfo", "libnbd"):
            served = Served(system, cfg, session)
            try:
                t0 = _spawn_for_latency(served, session)
                if kind == "nbdinfo":
                    # nbdinfo processes back to back from the spawn on: the client's
                    # start-up overlaps the server's, as it would in a script.
                    times.append(_poll_ready(served, session, t0,
                                             lambda: nbdinfo_ok(served.uri)))
                    t1 = time.monotonic()
                    if nbdinfo_ok(served.uri):
                        alone.append(time.monotonic() - t1)
                else:
                    libnbd_times.append(_poll_ready(served, session, t0,
                                                    lambda: libnbd_ok(served.uri)))
            finally:
                served.stop()
    return dict(workload=5, case="setup-latency", system=system,
                setup_median_ms=statistics.median(times) * 1000,
                setup_min_ms=min(times) * 1000, setup_max_ms=max(times) * 1000,
                libnbd_median_ms=statistics.median(libnbd_times) * 1000,
                nbdinfo_alone_ms=statistics.median(alone) * 1000 if alone else None,
                reps=len(times))
