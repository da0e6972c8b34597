"""The workloads: ``Case`` (one fio run of one system), the cases each workload
is made of, and the duration estimate."""

from .systems import MAIN_SYSTEMS
from .units import MIB

WORKLOAD_TITLES = {
    1: "Workload 1 — basic shapes (cold cache)",
    2: "Workload 2 — seed 000's table: 16 jobs and 1 job at QD1 (cold cache)",
    3: "Workload 3 — seed 001's curve: range lock vs one device lock, randrw 50/50 at QD1",
    4: "Workload 4 — seed 004: reads from a warm page cache, 4k randread QD32",
    5: "Workload 5 — setup latency: process start to first `nbdinfo --size`",
}

# The raw reference should measure the file, not fio: where one fio job (1 job,
# QD >= 2) uses more than this share of a core (usr+sys), the case is rerun as
# 2 jobs at half the queue depth each and the row says so.
RAW_CPU_BOUND_PCT = 80.0

SETUP_OVERHEAD_S = 0.5   # per case: drop cache, server start/stop, fio start-up


class Case:
    def __init__(self, workload, name, system, rw=None, bs="4k", qd=1, jobs=1, mix=None,
                 warm=False):
        self.workload, self.name, self.system = workload, name, system
        self.rw, self.bs, self.qd, self.jobs, self.mix, self.warm = rw, bs, qd, jobs, mix, warm

    def split(self):
        """The same case as 2 jobs at half the queue depth (for a CPU-bound raw fio job)."""
        return Case(self.workload, self.name, self.system, self.rw, self.bs, self.qd // 2, 2,
                    self.mix, self.warm)

    def key(self):
        return (self.system, self.rw, self.bs, self.qd, self.jobs, self.mix, self.warm)

    def shape(self):
        s = f"{self.rw} bs={self.bs} QD{self.qd} x {self.jobs} job{'s' if self.jobs > 1 else ''}"
        return s + (f" rwmixread={self.mix}" if self.mix is not None else "")


def build_cases(cfg):
    """The fio cases of ``cfg.only``'s workloads for ``cfg.systems`` (reduced lists
    with ``cfg.quick``), in run order."""
    q = cfg.quick
    out = []
    sel = lambda names: [s for s in names if s in cfg.systems]  # noqa: E731
    if 1 in cfg.only:
        shapes = [("randread-4k-qd1", "randread", "4k", 1, 1, None),
                  ("randread-4k-qd32", "randread", "4k", 32, 1, None),
                  ("randwrite-4k-qd32", "randwrite", "4k", 32, 1, None),
                  ("read-1m-qd8", "read", "1m", 8, 1, None),
                  ("write-1m-qd8", "write", "1m", 8, 1, None),
                  ("randrw-4k-4jx8", "randrw", "4k", 8, 4, 50)]
        for name, rw, bs, qd, jobs, mix in shapes:
            extra = ["loopd-buffered-nosplice"] if name == "read-1m-qd8" else []
            for s in sel(MAIN_SYSTEMS + extra):
                out.append(Case(1, name, s, rw, bs, qd, jobs, mix))
    if 2 in cfg.only:
        for jobs in ([2, 1] if q else [16, 1]):
            for rw in ["randread", "read", "randwrite", "write"]:
                extra = ["loopd-direct-nopoll", "loopd-buffered-nopoll"] if jobs == 1 else []
                for s in sel(MAIN_SYSTEMS + extra):
                    out.append(Case(2, f"{rw}-{jobs}j", s, rw, "4k", 1, jobs))
    if 3 in cfg.only:
        pair = sel(["loopd-direct", "loopd-direct-wholelock"])
        points = [(bs, jobs) for bs in ["4k", "1m"]
                  for jobs in ([1, 4] if q else [1, 2, 4, 8, 12, 16, 24])]
        for i, (bs, jobs) in enumerate(points):
            # Alternate which lock runs first from point to point, so an order effect
            # does not favour one side all along the curve (each point still runs in
            # one order): the 1 MiB 1-job point, always run range lock first, read
            # 4-31% below the device lock in five runs in a row, while alternating
            # 6 s trials of it showed no difference.
            for s in (pair if i % 2 == 0 else pair[::-1]):
                out.append(Case(3, f"randrw-{bs}-{jobs}j", s, "randrw", bs, 1, jobs, 50))
    if 4 in cfg.only:
        for s in sel(["loopd-buffered", "loopd-buffered-noinline", "nbdkit-default"]):
            out.append(Case(4, "randread-4k-qd32-warm", s, "randread", "4k", 32, 1, warm=True))
    return out


def latency_systems(cfg):
    return [s for s in ["loopd-direct", "nbdkit-default", "qemu-nbd"] if s in cfg.systems] \
        if 5 in cfg.only else []


def estimate(cases, n_lat, runtime, ramp, size, reps):
    """Seconds the cases and ``n_lat`` setup-latency systems should take."""
    distinct = len({c.key() for c in cases})
    warm = any(c.warm for c in cases)
    # Buffered systems leave dirty pages after write cases; writing them back
    # (~400 MiB/s here) happens between cases.
    buffered = {"loop-buffered", "nbdkit-default", "loopd-buffered"}
    writeback = sum(min(3.0, size / (400 * MIB)) for c in {x.key(): x for x in cases}.values()
                    if c.system in buffered and "write" in c.rw)
    return (distinct * (runtime + ramp + SETUP_OVERHEAD_S) + (size / (400 * MIB) if warm else 0)
            + writeback
            + n_lat * reps * 0.2 + 20)
