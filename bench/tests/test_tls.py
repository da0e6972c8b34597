import unittest

from helpers import BENCH  # noqa: F401
from loopdbench.tls import CASES, ORDER, PAIRS, TLS_SYSTEMS, TlsServed, parse_tls_stat


class TlsStat(unittest.TestCase):
    def test_counters_by_name(self):
        text = "TlsCurrTxSw                     \t2\nTlsCurrRxSw 1\nTlsTxSw 17\n\n"
        self.assertEqual(parse_tls_stat(text), {"TlsCurrTxSw": 2, "TlsCurrRxSw": 1, "TlsTxSw": 17})

    def test_a_line_that_is_not_a_counter_gives_none(self):
        self.assertIsNone(parse_tls_stat("TlsTxSw 1\nsomething else here\n"))
        self.assertIsNone(parse_tls_stat("TlsTxSw many\n"))


class Systems(unittest.TestCase):
    def test_every_system_is_ordered_and_paired_with_a_known_twin(self):
        self.assertEqual(sorted(ORDER), sorted(TLS_SYSTEMS))
        for a, b in PAIRS:
            self.assertIn(a, TLS_SYSTEMS)
            self.assertIn(b, TLS_SYSTEMS)
        self.assertIs(TlsServed.SYSTEMS, TLS_SYSTEMS)
        self.assertEqual([c[0] for c in CASES][:2], ["randread-4k-qd1", "randread-4k-qd32"])

    def test_tls_systems_are_not_added_to_bench_runs(self):
        from loopdbench.systems import SYSTEMS
        self.assertFalse(set(SYSTEMS) & set(TLS_SYSTEMS))


class Pki(unittest.TestCase):
    def test_make_pki_writes_what_loopd_nbdkit_and_libnbd_read(self):
        import os
        import subprocess
        import tempfile

        from loopdbench.session import Session
        from loopdbench.tls import make_pki
        with tempfile.TemporaryDirectory() as d:
            server, home = make_pki(d, Session())
            for name in ("ca-cert.pem", "server-cert.pem", "server-key.pem"):
                self.assertTrue(os.path.exists(os.path.join(server, name)), name)
            client = os.path.join(home, ".pki", "libnbd")
            for name in ("ca-cert.pem", "client-cert.pem", "client-key.pem"):
                self.assertTrue(os.path.exists(os.path.join(client, name)), name)
            for role, d2 in (("server", server), ("client", client)):
                r = subprocess.run(["openssl", "verify", "-CAfile", os.path.join(d2, "ca-cert.pem"),
                                    os.path.join(d2, f"{role}-cert.pem")],
                                   capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
