"""bench/tls: TLS cost per request — loopd plaintext vs loopd TLS vs nbdkit TLS,
side by side (its systems, the throwaway PKI, /proc/net/tls_stat, its report and
main loop). The measurement is bench/run's: ``fio.run_case`` with ``TlsServed``.
See bench/README.md."""

import argparse
import datetime
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time

from .config import BENCH, EXPORT, TlsConfig
from .fio import run_case
from .run import build_loopd
from .host import ensure_image, loadavg, machine_facts, run_out
from .report import write_csv
from .session import Session
from .stats import client_us_per_io, median_rows
from .systems import Served
from .units import MIB, f as fx, fmt_dur, parse_size
from .workloads import SETUP_OVERHEAD_S, Case

TLS_STAT = "/proc/net/tls_stat"
# fio runs as this user when the benchmark runs as root: libnbd (fio's nbd engine
# cannot pass `tls-certificates=` in its URI, libnbd refuses local files there)
# reads the client certificate from $HOME/.pki/libnbd only for a non-root user.
CLIENT_UID = 65534

# --- systems -----------------------------------------------------------------

TLS_SYSTEMS = {}
for _cache in ("direct", "buffered"):
    TLS_SYSTEMS[f"loopd-unix-{_cache}"] = dict(
        kind="loopd", cache=_cache, transport="unix", tls=None,
        desc=f"`loopd serve --cache {_cache}`, Unix socket, no TLS")
    TLS_SYSTEMS[f"loopd-tcp-{_cache}"] = dict(
        kind="loopd", cache=_cache, transport="tcp", tls=None,
        desc=f"`loopd serve --cache {_cache} --listen 127.0.0.1:PORT`, no TLS")
    TLS_SYSTEMS[f"loopd-tls-{_cache}"] = dict(
        kind="loopd", cache=_cache, transport="tcp", tls="user",
        desc=f"the same with `--tls require --tls-verify-peer --no-ktls` (userspace records)")
    TLS_SYSTEMS[f"loopd-ktls-{_cache}"] = dict(
        kind="loopd", cache=_cache, transport="tcp", tls="ktls",
        desc=f"the same with `--tls require --tls-verify-peer` (kTLS where the kernel takes the keys)")
TLS_SYSTEMS["nbdkit-tcp"] = dict(kind="nbdkit", transport="tcp", tls=None,
                             desc="`nbdkit -p PORT -i 127.0.0.1 file` (default cache), no TLS")
TLS_SYSTEMS["nbdkit-tls"] = dict(kind="nbdkit", transport="tcp", tls="user",
                             desc="the same with `--tls=require --tls-certificates DIR --tls-verify-peer`")
ORDER = ["loopd-unix-direct", "loopd-tcp-direct", "loopd-tls-direct", "loopd-ktls-direct",
         "loopd-unix-buffered", "loopd-tcp-buffered", "loopd-tls-buffered", "loopd-ktls-buffered",
         "nbdkit-tcp", "nbdkit-tls"]
# (TLS system, its plaintext twin): the ratios the report is about.
PAIRS = [("loopd-tls-direct", "loopd-tcp-direct"), ("loopd-ktls-direct", "loopd-tcp-direct"),
         ("loopd-tls-buffered", "loopd-tcp-buffered"), ("loopd-ktls-buffered", "loopd-tcp-buffered"),
         ("nbdkit-tls", "nbdkit-tcp"),
         ("loopd-tcp-direct", "loopd-unix-direct"), ("loopd-tcp-buffered", "loopd-unix-buffered")]

CASES = [  # name, rw, bs, qd
    ("randread-4k-qd1", "randread", "4k", 1),
    ("randread-4k-qd32", "randread", "4k", 32),
    ("randwrite-4k-qd32", "randwrite", "4k", 32),
    ("read-1m-qd8", "read", "1m", 8),
]

# --- the throwaway PKI ---------------------------------------------------------------


def openssl(session, *args):
    r = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if r.returncode != 0:
        session.die(f"openssl {' '.join(args)} failed: {r.stderr.strip()}")


def make_pki(root, session):
    """root/ca (CA key stays there), root/server (what loopd's --tls-certs and nbdkit's
    --tls-certificates read), root/home/.pki/libnbd (what libnbd reads for the client)."""
    ca, server = os.path.join(root, "ca"), os.path.join(root, "server")
    client = os.path.join(root, "home", ".pki", "libnbd")
    for d in (ca, server, client):
        os.makedirs(d)
    ca_key, ca_cert = os.path.join(ca, "ca-key.pem"), os.path.join(ca, "ca-cert.pem")
    openssl(session, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", ca_key)
    openssl(session, "req", "-x509", "-new", "-key", ca_key, "-subj", "/CN=loopd bench-tls CA", "-days", "2",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", ca_cert)
    for role, d, eku in (("server", server, "serverAuth"), ("client", client, "clientAuth")):
        key, cert = os.path.join(d, f"{role}-key.pem"), os.path.join(d, f"{role}-cert.pem")
        ext, csr = os.path.join(ca, f"{role}.ext"), os.path.join(ca, f"{role}.csr")
        with open(ext, "w") as fh:
            fh.write("basicConstraints=critical,CA:FALSE\n"
                     "keyUsage=critical,digitalSignature,keyEncipherment\n"
                     f"extendedKeyUsage={eku}\nsubjectKeyIdentifier=hash\n"
                     "authorityKeyIdentifier=keyid\n"
                     "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl(session, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key)
        openssl(session, "req", "-new", "-key", key, "-subj", f"/CN=bench-{role}", "-out", csr)
        openssl(session, "x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key,
                "-set_serial", "0x" + os.urandom(8).hex(), "-days", "2",
                "-extfile", ext, "-out", cert)
        shutil.copy(ca_cert, os.path.join(d, "ca-cert.pem"))
    home = os.path.join(root, "home")
    if os.geteuid() == 0:
        for dirpath, dirs, files in os.walk(home):
            for n in [dirpath] + [os.path.join(dirpath, f) for f in files]:
                os.chown(n, CLIENT_UID, CLIENT_UID)
        os.chmod(root, 0o755)
    return server, home


# --- /proc/net/tls_stat ----------------------------------------------------------------


def parse_tls_stat(text):
    """/proc/net/tls_stat's counters by name; None if a line is not `NAME VALUE`."""
    try:
        return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}
    except ValueError:
        return None


def tls_stat():
    try:
        with open(TLS_STAT) as fh:
            return parse_tls_stat(fh.read())
    except FileNotFoundError:
        return None


class TlsStatWatch:
    """Samples /proc/net/tls_stat while a case runs: the cumulative counters' deltas
    (sockets whose TX/RX the kernel's TLS took) and the highest Curr* gauges seen."""

    def __init__(self, port):
        self.port = port
        self.start = tls_stat()
        self.peak = {}
        self.ss = ""
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.1):
            s = tls_stat() or {}
            for k in ("TlsCurrTxSw", "TlsCurrRxSw", "TlsCurrTxDevice", "TlsCurrRxDevice"):
                self.peak[k] = max(self.peak.get(k, 0), s.get(k, 0))
            if not self.ss and s.get("TlsCurrTxSw", 0) > (self.start or {}).get("TlsCurrTxSw", 0):
                self.ss = ss_ulp(self.port)

    def finish(self):
        self._stop.set()
        self._t.join()
        end = tls_stat()
        if self.start is None or end is None:
            return {}
        out = {f"d_{k}": end[k] - self.start.get(k, 0) for k in ("TlsTxSw", "TlsRxSw", "TlsDecryptError")
               if k in end}
        out.update({f"peak_{k}": v for k, v in self.peak.items()})
        out["ss_ulp"] = self.ss
        return out


def ss_ulp(port):
    """What `ss -tni` says of the server's side of the connection: its ULP
    (`tcp-ulp-tls version: 1.3 cipher: ... rxconf: sw txconf: sw` under kTLS)."""
    r = subprocess.run(["ss", "-tniH", "state", "established", f"( sport = :{port} )"],
                       capture_output=True, text=True)
    words = r.stdout.split()
    if "tcp-ulp-tls" not in words:
        return "no tcp-ulp-tls"
    i = words.index("tcp-ulp-tls")
    return " ".join(words[i:i + 9])


# --- serving -------------------------------------------------------------------


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class TlsServed(Served):
    """bench/run's Served for this benchmark's systems (``fio.run_case`` builds it)."""

    SYSTEMS = TLS_SYSTEMS

    def __init__(self, system, cfg, session):
        super().__init__(system, cfg, session)
        os.chmod(self.tmp, 0o755)  # fio may run as CLIENT_UID and needs the Unix socket
        self.port = free_port() if self.spec["transport"] == "tcp" else None
        scheme = "nbds" if self.spec["tls"] else "nbd"
        self.uri = (f"nbd+unix:///{EXPORT}?socket={self.sock}" if self.port is None
                    else f"{scheme}://127.0.0.1:{self.port}/{EXPORT}")
        self.watch = None
        self.tls = {}

    def argv(self):
        sp, cfg = self.spec, self.cfg
        if sp["kind"] == "nbdkit":
            a = ["nbdkit", "-f", "-p", str(self.port), "-i", "127.0.0.1",
                 "-P", os.path.join(self.tmp, "pid"), "-e", EXPORT]
            if sp["tls"]:
                a += ["--tls=require", f"--tls-certificates={cfg.server_certs}", "--tls-verify-peer"]
            return a + ["file", f"file={self.image}"]
        a = [cfg.loopd, "serve", self.image, "--socket", self.sock, "--socket-mode", "666",
             "--name", EXPORT, "--cache", sp["cache"],
             "--state", os.path.join(self.tmp, "s.state")]
        if self.port is not None:
            a += ["--listen", f"127.0.0.1:{self.port}"]
        if sp["tls"]:
            a += ["--tls", "require", "--tls-certs", cfg.server_certs, "--tls-verify-peer"]
            if sp["tls"] == "user":
                a.append("--no-ktls")
        return a

    def wait_ready(self, outpath, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.session.forget(self.proc)
                raise RuntimeError(f"{self.system} exited with {self.proc.returncode} at start; "
                                   f"see {self.log}")
            if self.spec["kind"] == "nbdkit":
                ready = os.path.exists(os.path.join(self.tmp, "pid"))
            else:  # loopd prints its URIs once it listens
                want = "unix://" if self.port is None else f"127.0.0.1:{self.port}/"
                with open(outpath) as fh:
                    ready = want in fh.read()
            if ready:
                if self.spec["tls"] == "ktls":
                    self.watch = TlsStatWatch(self.port)
                return
            time.sleep(0.005)
        raise RuntimeError(f"{self.system} not ready after {timeout:.0f}s; see {self.log}")

    def fio_argv(self, argv, jsonpath):
        """bench/run's fio command, run with HOME holding the client certificate (and as
        CLIENT_UID when we are root; the JSON file is made writable for it first)."""
        env = ["env", f"HOME={self.cfg.client_home}"]
        if os.geteuid() != 0:
            return env + argv
        open(jsonpath, "w").close()
        os.chown(jsonpath, CLIENT_UID, CLIENT_UID)
        return ["setpriv", f"--reuid={CLIENT_UID}", f"--regid={CLIENT_UID}", "--clear-groups"] + env + argv

    def figures(self):
        """For kTLS: /proc/net/tls_stat's deltas and peaks over the case."""
        return self.tls

    def stop(self):
        if self.watch is not None:
            self.tls = self.watch.finish()
            self.watch = None
        return super().stop()


def write_report(cfg, rows, failures, systems, heading="#"):
    med = median_rows(rows)
    # One line per fact (findmnt lists a filesystem mounted twice on two lines).
    facts = [(k, " ".join(str(v).split())) for k, v in machine_facts(cfg)
             if k not in ("qemu-nbd", "losetup")]
    facts.insert(5, ("libnbd", run_out(["nbdinfo", "--version"]).replace("\n", ", ")))
    facts.insert(6, ("openssl", run_out(["openssl", "version"])))
    facts.append(("rounds", f"{cfg.rounds} (figures are the median over rounds)"))
    facts.append(("kTLS", "kernel TLS available (/proc/net/tls_stat)" if tls_stat() is not None
                  else "no kTLS in this kernel: loopd-ktls-* not run"))
    h2 = heading + "#"
    L = [f"{heading} TLS cost per request — {cfg.started.strftime('%Y-%m-%d %H:%M %Z')}", ""]
    L += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in facts] + [""]
    L += [f"{h2} Systems", "", "| system | what |", "|---|---|"]
    L += [f"| `{s}` | {TLS_SYSTEMS[s]['desc']} |" for s in systems] + [""]
    L += ["TLS is mutual: server and client certificates (EC P-256) from a throwaway CA. fio's nbd engine, "
          "one connection, `--ramp_time` included in the server CPU; client µs/IO is fio's "
          "user+system CPU (wait4) per request, server µs/IO the server's utime+stime "
          "(/proc/PID/stat → wait4) per request, both over the whole case.", ""]
    L += [f"{h2} Per case", "",
          "| case | system | IOPS | MiB/s | mean lat µs | p99 lat µs | client µs/IO | server µs/IO |",
          "|---|---|---|---|---|---|---|---|"]
    for c, *_ in cfg.cases:
        for s in systems:
            r = med.get((c, s))
            if r:
                L.append(f"| {c} | {s} | {fx(r['iops'])} | {fx(r['mib_s'], 1)} | {fx(r['lat_mean_us'], 1)} "
                         f"| {fx(r['lat_p99_us'], 1)} | {fx(r['client_us_per_io'], 1)} "
                         f"| {fx(r['server_us_per_io'], 1)} |")
    L += ["", f"{h2} TLS / plaintext", "",
          "IOPS and CPU per request of each TLS system over its plaintext twin on the same "
          "transport (TCP loopback); the last rows put TCP over the Unix socket for scale. "
          "Δ server µs is what TLS adds to the server's CPU per request.", "",
          "| case | TLS system / plaintext | IOPS ratio | server µs/IO ratio | Δ server µs/IO "
          "| client µs/IO ratio |", "|---|---|---|---|---|---|"]

    def rat(a, b):
        return f"{a / b:.2f}×" if a is not None and b else "—"

    for c, *_ in cfg.cases:
        for a, b in PAIRS:
            ra, rb = med.get((c, a)), med.get((c, b))
            if not (ra and rb):
                continue
            d = (ra["server_us_per_io"] - rb["server_us_per_io"]
                 if ra.get("server_us_per_io") is not None and rb.get("server_us_per_io") is not None
                 else None)
            L.append(f"| {c} | {a} / {b} | {rat(ra['iops'], rb['iops'])} "
                     f"| {rat(ra['server_us_per_io'], rb['server_us_per_io'])} | "
                     f"{'—' if d is None else f'{d:+.1f}'} "
                     f"| {rat(ra['client_us_per_io'], rb['client_us_per_io'])} |")
    kt = [r for r in rows if "ktls" in r["system"] and not r.get("error")]
    if kt:
        L += ["", f"{h2} kTLS: did the kernel carry the records?", "",
              "Deltas of /proc/net/tls_stat over each case (sockets whose TX/RX the kernel's TLS "
              "took), the highest TlsCurrTxSw/TlsCurrRxSw seen while fio ran, and the ULP "
              "`ss -tni` showed on loopd's socket once the kernel had TLS sockets.", "",
              "| round | case | system | ΔTlsTxSw | ΔTlsRxSw | peak TlsCurrTxSw | peak TlsCurrRxSw "
              "| ΔTlsDecryptError | `ss -tni` on loopd's socket |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in kt:
            L.append(f"| {r['workload']} | {r['case']} | {r['system']} | {fx(r.get('d_TlsTxSw'))} "
                     f"| {fx(r.get('d_TlsRxSw'))} | {fx(r.get('peak_TlsCurrTxSw'))} "
                     f"| {fx(r.get('peak_TlsCurrRxSw'))} | {fx(r.get('d_TlsDecryptError'))} "
                     f"| {r.get('ss_ulp') or '—'} |")
    notes = [f"{r['case']} {r['system']} (round {r['workload']}): {r['note']}" for r in rows if r.get("note")]
    if notes:
        L += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    if failures:
        L += ["", "**Failed cases:**", ""] + [f"- {x}" for x in failures]
    return "\n".join(L)


CSV_FIELDS = ["round", "case", "system", "rw", "bs", "iodepth", "iops", "mib_s", "lat_mean_us",
              "lat_p99_us", "fio_cpu_s", "client_us_per_io", "server_cpu_s", "server_us_per_io",
              "wall_s", "ios", "d_TlsTxSw", "d_TlsRxSw", "peak_TlsCurrTxSw", "peak_TlsCurrRxSw",
              "d_TlsDecryptError", "ss_ulp", "fio_json", "note", "error"]


# --- main ----------------------------------------------------------------------------


def parse_args(argv, session):
    ap = argparse.ArgumentParser(description="TLS cost per request: loopd and nbdkit, TLS vs plaintext.")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 s per case, 256 MiB image")
    ap.add_argument("--runtime", type=int, help="seconds per case (default 10; --quick: 1)")
    ap.add_argument("--ramp", type=int, help="ramp seconds per case (default 2; --quick: 0)")
    ap.add_argument("--rounds", type=int, default=1, help="run the whole matrix N times; report medians")
    ap.add_argument("--size", type=parse_size, help="image size (default 2G; --quick: 256M)")
    ap.add_argument("--systems", help=f"systems (default: all that this kernel can run): {', '.join(ORDER)}")
    ap.add_argument("--cases", help=f"cases (default all): {', '.join(c[0] for c in CASES)}")
    ap.add_argument("--out", help="output directory (default bench/results/<date>-tls[-quick])")
    ap.add_argument("--loopd", help="loopd binary (default: cargo build --release)")
    ap.add_argument("--image-dir", help=f"where the image lives (default {TlsConfig.image_dir})")
    ap.add_argument("--list", action="store_true", help="print the cases, run nothing")
    a = ap.parse_args(argv)
    cfg = TlsConfig(
        quick=a.quick,
        command=shlex.join(["bench/tls"] + argv),
        runtime=a.runtime if a.runtime is not None else (1 if a.quick else 10),
        ramp=a.ramp if a.ramp is not None else (0 if a.quick else 2),
        size=a.size or (256 * MIB if a.quick else 2 << 30),
        rounds=a.rounds,
        loopd_given=a.loopd is not None,
    )
    if cfg.runtime < 1 or cfg.ramp < 0 or cfg.rounds < 1:
        session.die("--runtime and --rounds must be >= 1, --ramp >= 0")
    ktls = tls_stat() is not None
    default = [s for s in ORDER if ktls or "ktls" not in s]
    systems = a.systems.split(",") if a.systems else default
    bad = [s for s in systems if s not in TLS_SYSTEMS]
    if bad:
        session.die(f"unknown system(s) {', '.join(bad)}; known: {', '.join(ORDER)}")
    cfg.systems = [s for s in ORDER if s in systems]
    names = a.cases.split(",") if a.cases else [c[0] for c in CASES]
    if set(names) - {c[0] for c in CASES}:
        session.die(f"unknown case(s); known: {', '.join(c[0] for c in CASES)}")
    cfg.cases = [c for c in CASES if c[0] in names]
    if a.loopd:
        cfg.loopd = os.path.abspath(a.loopd)
    if a.image_dir:
        cfg.image_dir = os.path.abspath(a.image_dir)
    cfg.outdir = a.out or ""
    return cfg, a.list, ktls


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    session = Session()
    cfg, list_only, ktls = parse_args(argv, session)
    systems = cfg.systems
    cases = [Case(rnd, name, s, rw, bs, qd) for rnd in range(1, cfg.rounds + 1)
             for name, rw, bs, qd in cfg.cases for s in systems]
    per = cfg.runtime + cfg.ramp + SETUP_OVERHEAD_S + 0.3
    if list_only:
        for c in cases:
            print(f"round {c.workload} {c.name:20} {c.system:22} {c.shape()}")
        print(f"{len(cases)} cases, estimated {fmt_dur(len(cases) * per)}")
        return 0
    missing = [t for t in ("fio", "nbdkit", "nbdinfo", "openssl", "setpriv", "fincore", "findmnt")
               if shutil.which(t) is None]
    if missing:
        session.die(f"missing: {', '.join(missing)}; run bench/install-deps.sh (as root)")
    if "ktls" in ",".join(systems) and not ktls:
        session.die("loopd-ktls-* need kTLS (modprobe tls; /proc/net/tls_stat)")

    session.install()
    cfg.started = datetime.datetime.now().astimezone()
    t_start = time.monotonic()
    cfg.load_start = loadavg()
    default_out = os.path.join(BENCH, "results", cfg.started.strftime("%Y-%m-%d-%H%M%S")
                               + ("-tls-quick" if cfg.quick else "-tls"))
    cfg.outdir = os.path.abspath(cfg.outdir or default_out)
    os.makedirs(os.path.join(cfg.outdir, "fio"), exist_ok=True)
    if any(TLS_SYSTEMS[s]["kind"] == "loopd" for s in systems):
        build_loopd(cfg, session)
        if not os.access(cfg.loopd, os.X_OK):
            session.die(f"{cfg.loopd} is not an executable loopd binary")
    pki = session.mkdtemp("lb-tls-pki-")
    cfg.server_certs, cfg.client_home = make_pki(pki, session)
    cfg.image = ensure_image(cfg.image_dir, cfg.size, session)
    session.warn(f"{len(cases)} cases, runtime {cfg.runtime}s + ramp {cfg.ramp}s each: "
                 f"estimated {fmt_dur(len(cases) * per)}; output {cfg.outdir}")

    rows, failures = [], []
    try:
        for i, c in enumerate(cases, 1):
            session.check_interrupted()
            session.progress(f"[{i}/{len(cases)}] round {c.workload} {c.name} · {c.system} · "
                             f"~{fmt_dur((len(cases) - i + 1) * per)} left")
            try:
                row = run_case(c, cfg, session, served_cls=TlsServed)
                if not (row.get("iops") or 0) > 0:
                    raise RuntimeError("no I/O completed")
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - report any failure, go on with the others
                msg = f"round {c.workload} {c.name} {c.system}: {e}"
                session.warn(f"FAILED {msg}")
                failures.append(msg)
                row = dict(workload=c.workload, case=c.name, system=c.system, error=str(e))
            row["round"] = c.workload
            row["client_us_per_io"] = client_us_per_io(row)
            rows.append(row)
    except KeyboardInterrupt:
        session.progress_clear()
        session.cleanup()
        session.die("interrupted; servers stopped", 130)
    finally:
        session.cleanup()
        session.progress_clear()

    cfg.elapsed = time.monotonic() - t_start
    cfg.load_end = loadavg()
    kt = [r for r in rows if "ktls" in r["system"] and not r.get("error")]
    for r in kt:
        if not r.get("d_TlsTxSw") or not r.get("d_TlsRxSw"):
            failures.append(f"round {r['round']} {r['case']} {r['system']}: /proc/net/tls_stat "
                            "did not count a kernel TLS socket (TlsTxSw/TlsRxSw); loopd fell back "
                            "to the userspace record layer")
    report = write_report(cfg, rows, failures, systems)
    write_csv(os.path.join(cfg.outdir, "results.csv"), rows, CSV_FIELDS)
    with open(os.path.join(cfg.outdir, "report.md"), "w") as fh:
        fh.write(report + "\n")
    print(report)
    session.warn(f"done in {fmt_dur(cfg.elapsed)}; report {os.path.join(cfg.outdir, 'report.md')}")
    if failures:
        session.die(f"{len(failures)} failure(s):\n  " + "\n  ".join(failures), 1)
    return 0
