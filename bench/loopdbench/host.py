"""The machine side of a run: the bench image and its page cache, CPU and
context-switch figures from /proc, and the machine facts a report opens with."""

import os
import platform
import subprocess

from .config import REPO
from .units import MIB, fmt_dur, size_label

CLK_TCK = os.sysconf("SC_CLK_TCK")


def run_out(argv):
    """A command's output (stdout, else stderr), for the report; never raises."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return (r.stdout or r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({e})"


# --- image and page cache ----------------------------------------------------

def ensure_image(image_dir, size, session):
    """``image_dir/image-<size>.raw``: preallocated random data, made once."""
    os.makedirs(image_dir, exist_ok=True)
    path = os.path.join(image_dir, f"image-{size_label(size)}.raw")
    if os.path.exists(path):
        st = os.stat(path)
        if st.st_size == size and st.st_blocks * 512 >= size:
            return path
        session.warn(f"{path} has the wrong size or is sparse; recreating")
        os.unlink(path)
    session.warn(f"creating {path} ({size >> 20} MiB of random data, once)")
    tmp = path + ".tmp"
    with open("/dev/urandom", "rb") as src, open(tmp, "wb") as dst:
        left = size
        while left:
            n = min(left, 8 * MIB)
            dst.write(src.read(n))
            left -= n
        dst.flush()
        os.fsync(dst.fileno())
    os.rename(tmp, path)
    return path


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path):
    with open(path, "rb", buffering=0) as fh:
        while fh.read(8 * MIB):
            pass


def pagecache_bytes(path):
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path],
                       capture_output=True, text=True)
    try:
        return int(r.stdout.strip())
    except ValueError:
        return None


# --- /proc figures -----------------------------------------------------------

def parse_stat_cpu_s(stat_text):
    """utime + stime (all threads) in seconds from the text of /proc/PID/stat."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_s(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return parse_stat_cpu_s(fh.read())


def proc_ctx(pid):
    """Voluntary + nonvoluntary switches of the live threads."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                for line in fh:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total


def proc_mem_kib(pid):
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out.get("VmRSS"), out.get("VmHWM")


def parse_system_counters(stat_text):
    """Machine-wide busy CPU seconds and context switches from /proc/stat's text."""
    cpu = ctx = 0
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            cpu = (v[0] + v[1] + v[2] + v[5] + v[6]) / CLK_TCK  # user nice system irq softirq
        elif line.startswith("ctxt "):
            ctx = int(line.split()[1])
    return cpu, ctx


def system_counters():
    with open("/proc/stat") as fh:
        return parse_system_counters(fh.read())


def loadavg():
    with open("/proc/loadavg") as fh:
        return fh.read().split()[0]


# --- machine facts -----------------------------------------------------------

def machine_facts(cfg):
    cpu = "?"
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    fs = run_out(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", cfg.image])
    git = run_out(["git", "-C", REPO, "rev-parse", "--short", "HEAD"])
    dirty = run_out(["git", "-C", REPO, "status", "--porcelain", "--", "src", "Cargo.toml"])
    return [
        ("CPU", f"{cpu}, {os.cpu_count()} online (`nproc`)"),
        ("RAM", f"{mem / (1 << 30):.1f} GiB"),
        ("kernel", platform.release()),
        ("image", f"`{cfg.image}`, {cfg.size >> 20} MiB of random data, on {fs}"),
        ("fio", run_out(["fio", "--version"])),
        ("nbdkit", run_out(["nbdkit", "--version"])),
        ("qemu-nbd", run_out(["qemu-nbd", "--version"]).splitlines()[0]),
        ("losetup", run_out(["losetup", "--version"])),
        ("loopd", f"{run_out([cfg.loopd, '--version'])}, git {git}"
                  f"{' with uncommitted changes in src/' if dirty else ''}, release build"),
        ("load average", f"{cfg.load_start} at start, {cfg.load_end} at end"),
        ("date", cfg.started.strftime("%Y-%m-%d %H:%M %Z").strip()),
        ("duration", fmt_dur(cfg.elapsed)),
        ("command", f"`{cfg.command}`"),
        ("settings", f"runtime {cfg.runtime}s + ramp {cfg.ramp}s per case"
                     f"{' (--quick: smoke run, numbers are not results)' if cfg.quick else ''}"),
    ]
