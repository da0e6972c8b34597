"""The systems under test, and ``Served``: one running system for one case — a
fio target and, for servers, a process the session tracks by PID.

A benchmark with other systems subclasses ``Served`` and sets ``SYSTEMS`` on the
subclass (bench/tls does); ``fio.run_case`` takes the class to use."""

import datetime
import os
import shlex
import socket
import time

from .config import EXPORT

SYSTEMS = {
    "raw": dict(kind="file", desc="fio io_uring, direct=1, on the image file (reference)"),
    "loop-dio": dict(kind="loop", dio="on", desc="kernel loop, `losetup --direct-io=on`"),
    "loop-buffered": dict(kind="loop", dio="off", desc="kernel loop, `losetup --direct-io=off`"),
    "nbdkit-none": dict(kind="nbdkit", cache="none", desc="`nbdkit file cache=none`"),
    "nbdkit-default": dict(kind="nbdkit", cache=None, desc="`nbdkit file` (default cache)"),
    "qemu-nbd": dict(kind="qemu", desc="`qemu-nbd --cache=none --aio=io_uring -f raw`"),
    "loopd-direct": dict(kind="loopd", cache="direct", desc="`loopd serve --cache direct`"),
    "loopd-buffered": dict(kind="loopd", cache="buffered", desc="`loopd serve --cache buffered`"),
    "loopd-direct-wholelock": dict(
        kind="loopd", cache="direct", extra=["--whole-device-lock"],
        desc="`loopd serve --cache direct --whole-device-lock` (one lock per device)"),
    "loopd-buffered-noinline": dict(
        kind="loopd", cache="buffered", extra=["--no-inline-reads"],
        desc="`loopd serve --cache buffered --no-inline-reads` (every read through the ring)"),
    "loopd-buffered-nosplice": dict(
        kind="loopd", cache="buffered", extra=["--no-splice"],
        desc="`loopd serve --cache buffered --no-splice` (large reads copied, not spliced; "
             "workload 1's 1 MiB read only)"),
    "loopd-direct-nopoll": dict(
        kind="loopd", cache="direct", extra=["--poll-us", "0"],
        desc="`loopd serve --cache direct --poll-us 0` (reactors never busy-poll; 1-job cases of workload 2)"),
    "loopd-buffered-nopoll": dict(
        kind="loopd", cache="buffered", extra=["--poll-us", "0"],
        desc="`loopd serve --cache buffered --poll-us 0` (reactors never busy-poll; 1-job cases of workload 2)"),
}
MAIN_SYSTEMS = ["raw", "loop-dio", "loop-buffered", "nbdkit-none", "nbdkit-default",
                "qemu-nbd", "loopd-direct", "loopd-buffered"]
BASELINE = "loopd-direct"
# Workload 4 has no loopd-direct (it is about the page cache): compare with loopd-buffered.
BASELINES = {4: "loopd-buffered"}


def baseline_of(workload):
    return BASELINES.get(workload, BASELINE)


class Served:
    """One running system for one case: a fio target and, for servers, a PID."""

    SYSTEMS = SYSTEMS

    def __init__(self, system, cfg, session):
        self.system = system
        self.spec = self.SYSTEMS[system]
        self.image = cfg.image
        self.cfg = cfg
        self.session = session
        self.proc = None
        self.loop = None
        self.note = ""
        self.tmp = session.mkdtemp("lb-")
        self.sock = os.path.join(self.tmp, "s.sock")
        self.log = os.path.join(cfg.outdir, "logs", f"{system}.log")
        self.uri = f"nbd+unix:///{EXPORT}?socket={self.sock}"

    def argv(self):
        k = self.spec["kind"]
        if k == "nbdkit":
            a = ["nbdkit", "-f", "-U", self.sock, "-P", os.path.join(self.tmp, "pid"),
                 "-e", EXPORT, "file", f"file={self.image}"]
            if self.spec["cache"]:
                a.append(f"cache={self.spec['cache']}")
            return a
        if k == "qemu":
            return ["qemu-nbd", "-k", self.sock, "-x", EXPORT, "-f", "raw", "--cache=none",
                    "--aio=io_uring", "--shared=64", "--persistent", self.image]
        if k == "loopd":
            return [self.cfg.loopd, "serve", self.image, "--socket", self.sock, "--name", EXPORT,
                    "--cache", self.spec["cache"], "--state", os.path.join(self.tmp, "s.state")] + self.spec.get("extra", [])
        raise AssertionError(k)

    def start(self):
        k = self.spec["kind"]
        if k == "file":
            return
        if k == "loop":
            self.loop = self.session.loop_attach(self.image, self.spec["dio"])
            with open(f"/sys/block/{os.path.basename(self.loop)}/loop/dio") as fh:
                dio = fh.read().strip()
            want = "1" if self.spec["dio"] == "on" else "0"
            if dio != want:
                raise RuntimeError(f"{self.loop}: loop/dio is {dio}, wanted {want}")
            return
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        logf = open(self.log, "ab")
        logf.write(f"\n=== {datetime.datetime.now().isoformat()} {shlex.join(self.argv())}\n".encode())
        logf.flush()
        outpath = os.path.join(self.tmp, "stdout")
        with open(outpath, "wb") as out:
            self.proc = self.session.spawn(self.argv(), self.system, stdout=out, stderr=logf)
        logf.close()
        self.wait_ready(outpath)

    def wait_ready(self, outpath, timeout=20.0):
        k = self.spec["kind"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.session.forget(self.proc)
                raise RuntimeError(f"{self.system} exited with {self.proc.returncode} at start; "
                                   f"see {self.log}")
            if k == "loopd":
                with open(outpath) as fh:
                    for line in fh:
                        if line.startswith("nbd+unix://"):
                            self.uri = line.strip()
                            return
            elif k == "nbdkit":
                if os.path.exists(os.path.join(self.tmp, "pid")):
                    return
            elif k == "qemu" and os.path.exists(self.sock):
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(self.sock)
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            time.sleep(0.002)
        raise RuntimeError(f"{self.system} not ready after {timeout:.0f}s; see {self.log}")

    def fio_target(self):
        k = self.spec["kind"]
        if k == "file":
            return ["--ioengine=io_uring", "--direct=1", f"--filename={self.image}"]
        if k == "loop":
            return ["--ioengine=io_uring", "--direct=1", f"--filename={self.loop}"]
        return ["--ioengine=nbd", f"--uri={self.uri}"]

    def fio_argv(self, argv, jsonpath):
        """The fio command line to run (a subclass may wrap it)."""
        return argv

    def alive(self):
        return self.proc is None or self.proc.poll() is None

    def figures(self):
        """Figures of this system's own for the case's row (after ``stop``)."""
        return {}

    def stop(self):
        """Stops the server; returns its rusage (whole life) or None."""
        ru = None
        if self.proc is not None:
            ru = self.session.stop_proc(self.proc, self.system)
            self.proc = None
        if self.loop:
            self.session.loop_detach(self.loop)
            self.loop = None
        self.session.rmtree(self.tmp)
        return ru
