#!/usr/bin/env python3
"""`loopd attach` (two builds of the CLI) against `losetup -f --show`, and each
one's `--version` (process start alone), interleaved, each round starting with
the next command in turn; the detach after each attach is untimed. Root.

    cli_vs_losetup.py DYNAMIC_LOOPD STATIC_LOOPD ROUNDS

A daemon of DYNAMIC_LOOPD serves both CLIs (state file on the scratch
directory's filesystem, so each attach pays its fdatasync). Times include
Python's fork+exec of the child (the same for every command).
"""
import os, subprocess, sys, tempfile, time

dyn, static, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
d = tempfile.mkdtemp(dir="/var/tmp", prefix="loopd-cli.")
ctl = f"{d}/ctl.sock"
for n in ("a", "b"):
    with open(f"{d}/{n}.img", "wb") as f:
        f.truncate(64 << 20)
srv = subprocess.Popen([dyn, "serve", "-k", f"{d}/nbd.sock", "--control", ctl, "--state", f"{d}/st.state"],
                       stderr=subprocess.DEVNULL)
try:
    for _ in range(100):
        if os.path.exists(ctl):
            break
        time.sleep(0.05)

    def timed(argv):
        t = time.perf_counter()
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        dt = (time.perf_counter() - t) * 1e6
        if p.returncode:
            sys.exit(f"{argv}: {p.stderr.decode()[:300]}")
        return dt, p.stdout.decode().strip()

    kinds = ["loopd attach", "static loopd attach", "losetup -f --show",
             "loopd --version", "static loopd --version", "losetup --version"]
    res = {k: [] for k in kinds}
    for i in range(rounds):
        for k in kinds[i % 6:] + kinds[:i % 6]:
            time.sleep(0.002)
            if k.endswith("loopd attach"):
                b = static if k.startswith("static") else dyn
                dt, _ = timed([b, "attach", "--control", ctl, "--name", f"h{i}", f"{d}/a.img"])
                subprocess.run([dyn, "detach", "--control", ctl, f"h{i}"], stdout=subprocess.DEVNULL)
            elif k == "losetup -f --show":
                dt, dev = timed(["losetup", "-f", "--show", f"{d}/b.img"])
                subprocess.run(["losetup", "-d", dev])
            else:
                b = {"loopd --version": dyn, "static loopd --version": static}.get(k, "losetup")
                dt, _ = timed([b, "--version"])
            res[k].append(dt)
    for k, v in res.items():
        v.sort()
        print(f"| {k} | {v[len(v) // 2]:.0f} | {v[int(len(v) * 0.9)]:.0f} |")
finally:
    srv.terminate()
    srv.wait()
    subprocess.run(["rm", "-rf", d])
