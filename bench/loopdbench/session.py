"""``Session``: what one benchmark run owns — every process it started (by PID),
every loop device it attached, its temp dirs — the signal that interrupted it, and
the progress line on stderr. ``cleanup`` stops and removes all of it; it runs
after every case, on Ctrl-C, SIGTERM, SIGHUP and at exit.

A signal becomes a ``KeyboardInterrupt`` so that every ``finally`` runs; while a
process is being started or a loop device attached (``deferring_signals``), the
exception waits until the new process or device is registered, so nothing is
left untracked."""

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


class Session:
    def __init__(self, stream=None):
        self.procs = {}      # pid -> (Popen, label)
        self.loops = set()   # /dev/loopN
        self.tmpdirs = []
        self.interrupted = []  # signals received
        self._deferring = 0
        self._cleaning = False
        self._progress_shown = False
        self.stream = stream or sys.stderr

    # --- messages -----------------------------------------------------------

    def warn(self, msg):
        self.progress_clear()
        print(f"bench: {msg}", file=self.stream, flush=True)

    def die(self, msg, code=2):
        self.progress_clear()
        print(f"bench: ERROR: {msg}", file=self.stream, flush=True)
        sys.exit(code)

    def progress(self, msg):
        if self.stream.isatty():
            self.stream.write("\r\033[K" + msg)
            self._progress_shown = True
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()

    def progress_clear(self):
        if self._progress_shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._progress_shown = False

    # --- signals --------------------------------------------------------------

    def install(self):
        """Signals become KeyboardInterrupt; cleanup runs at exit."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        atexit.register(self.cleanup)

    def _on_signal(self, signum, frame):
        # The flag is checked between cases too, in case library code swallowed it.
        self.interrupted.append(signum)
        if not self._deferring:
            raise KeyboardInterrupt(f"signal {signum}")

    def check_interrupted(self):
        if self.interrupted:
            raise KeyboardInterrupt(f"signal {self.interrupted[0]}")

    @contextlib.contextmanager
    def deferring_signals(self):
        """A signal inside the block is raised when it ends (after registration)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        self.check_interrupted()

    # --- what the run owns ----------------------------------------------------

    def spawn(self, argv, label, stdout=None, stderr=None):
        with self.deferring_signals():
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                 start_new_session=True)
            self.procs[p.pid] = (p, label)
        return p

    def forget(self, p):
        """A process that was reaped elsewhere (it exited on its own)."""
        self.procs.pop(p.pid, None)

    def stop_proc(self, p, label="", quiet=False, timeout=10.0):
        """SIGTERM, wait, SIGKILL; returns the rusage from wait4 (or None)."""
        ru = None
        if p.returncode is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while True:
                try:
                    pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                except ChildProcessError:
                    p.returncode = -1
                    break
                if pid:
                    p.returncode = os.waitstatus_to_exitcode(status)
                    break
                if time.monotonic() > deadline:
                    if not quiet:
                        self.warn(f"{label} (pid {p.pid}) ignored SIGTERM for {timeout:.0f}s; SIGKILL")
                    os.kill(p.pid, signal.SIGKILL)
                    deadline = time.monotonic() + 5
                    timeout = 5
                time.sleep(0.005)
        self.procs.pop(p.pid, None)
        return ru

    def loop_attach(self, image, dio):
        """``losetup -f --show --direct-io=DIO IMAGE``; the device, registered."""
        with self.deferring_signals():
            r = subprocess.run(["losetup", "-f", "--show", f"--direct-io={dio}", image],
                               capture_output=True, text=True)
            if r.returncode == 0:
                self.loops.add(r.stdout.strip())
        if r.returncode != 0:
            raise RuntimeError(f"losetup failed: {r.stderr.strip()}")
        return r.stdout.strip()

    def loop_detach(self, dev):
        r = subprocess.run(["losetup", "-d", dev], capture_output=True, text=True)
        if r.returncode != 0 and os.path.exists(f"/sys/block/{os.path.basename(dev)}/loop"):
            self.warn(f"losetup -d {dev} failed: {r.stderr.strip()}")
        self.loops.discard(dev)

    def detach_stale_loops(self, image):
        """Loop devices left on our bench image by an earlier run killed with SIGKILL."""
        r = subprocess.run(["losetup", "-j", image, "-O", "NAME", "-n"],
                           capture_output=True, text=True)
        for dev in r.stdout.split():
            self.warn(f"detaching stale loop device {dev} on {image}")
            self.loop_detach(dev)

    def mkdtemp(self, prefix):
        d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        self.tmpdirs.append(d)
        return d

    def rmtree(self, d):
        shutil.rmtree(d, ignore_errors=True)
        if d in self.tmpdirs:
            self.tmpdirs.remove(d)

    def cleanup(self):
        if self._cleaning:
            return
        self._cleaning = True
        try:
            for pid, (p, label) in list(self.procs.items()):
                self.stop_proc(p, label, quiet=True)
            for dev in list(self.loops):
                self.loop_detach(dev)
            for d in self.tmpdirs:
                shutil.rmtree(d, ignore_errors=True)
        finally:
            self._cleaning = False
