import os
import signal
import time
import unittest

from helpers import BENCH  # noqa: F401
from loopdbench.session import Session


class Null:
    def write(self, s):
        pass

    def flush(self):
        pass

    def isatty(self):
        return False


class Lifecycle(unittest.TestCase):
    def test_cleanup_stops_every_process_and_removes_temp_dirs(self):
        s = Session(stream=Null())
        p = s.spawn(["sleep", "30"], "sleeper")
        d = s.mkdtemp("lb-test-")
        self.assertIn(p.pid, s.procs)
        s.cleanup()
        self.assertEqual(s.procs, {})
        self.assertIsNotNone(p.returncode)  # reaped
        self.assertEqual(p.returncode, -signal.SIGTERM)
        self.assertFalse(os.path.exists(d))

    def test_stop_proc_returns_the_rusage(self):
        s = Session(stream=Null())
        p = s.spawn(["sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; exec sleep 30"], "busy")
        ru = s.stop_proc(p, "busy", timeout=0.5)
        self.assertIsNotNone(ru)
        self.assertNotIn(p.pid, s.procs)

    def test_a_process_that_ignores_sigterm_is_killed(self):
        s = Session(stream=Null())
        d = s.mkdtemp("lb-test-")
        flag = os.path.join(d, "ready")
        p = s.spawn(["python3", "-c", "import signal, sys, time\n"
                     "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                     "open(sys.argv[1], 'w').close()\ntime.sleep(30)", flag], "stubborn")
        for _ in range(500):  # SIGTERM is ignored once the file exists
            if os.path.exists(flag):
                break
            time.sleep(0.01)
        self.assertTrue(os.path.exists(flag))
        s.stop_proc(p, "stubborn", quiet=True, timeout=0.2)
        self.assertEqual(p.returncode, -signal.SIGKILL)
        s.cleanup()

    def test_a_signal_while_deferring_is_raised_after_the_block(self):
        s = Session(stream=Null())
        done = []
        with self.assertRaises(KeyboardInterrupt):
            with s.deferring_signals():
                s._on_signal(signal.SIGTERM, None)  # what the handler does on SIGTERM
                done.append(1)
        self.assertEqual(done, [1])
        self.assertEqual(s.interrupted, [signal.SIGTERM])
        with self.assertRaises(KeyboardInterrupt):
            s.check_interrupted()

    def test_a_signal_outside_raises_at_once(self):
        s = Session(stream=Null())
        with self.assertRaises(KeyboardInterrupt):
            s._on_signal(signal.SIGINT, None)
