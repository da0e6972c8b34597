#!/usr/bin/env bash
# Where one durable attach's time goes inside the daemon: recv of the request ->
# fdatasync of the state record -> its end -> the reply's send, from syscall
# tracepoints (perf record -e syscalls:...), one attach at a time from a client
# that sleeps 1 ms between requests. Root; needs perf and python3.
#   attach_phases.sh LOOPD_BINARY [N]
set -euo pipefail
BIN=$1; N=${2:-250}
D=$(mktemp -d /var/tmp/loopd-phases.XXXXXX)
trap 'kill "$P" 2>/dev/null; rm -rf "$D"' EXIT
for i in $(seq 1 "$N"); do truncate -s 64M "$D/img$i.img"; done
"$BIN" serve -k "$D/nbd.sock" --control "$D/ctl.sock" --state "$D/st.state" 2>"$D/log" &
P=$!
for _ in $(seq 50); do [ -S "$D/ctl.sock" ] && break; sleep 0.1; done
perf record -e syscalls:sys_exit_recvfrom,syscalls:sys_enter_sendto,syscalls:sys_enter_fdatasync,syscalls:sys_exit_fdatasync \
    -p "$P" -o "$D/perf.data" >/dev/null 2>&1 &
PR=$!
sleep 1
python3 - "$D" "$N" <<'PY'
import json, socket, sys, time
d, n = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_UNIX); s.connect(f"{d}/ctl.sock"); f = s.makefile("rwb")
ts = []
for i in range(1, n + 1):
    time.sleep(0.001)
    m = (json.dumps({"v": 1, "op": "attach", "image": f"{d}/img{i}.img", "name": f"d{i}"}) + "\n").encode()
    t = time.perf_counter(); f.write(m); f.flush(); r = f.readline(); ts.append((time.perf_counter() - t) * 1e6)
    assert b'"ok":true' in r, r
ts.sort(); print(f"client (python) round trip, median: {ts[len(ts)//2]:.0f} us")
PY
kill -INT "$PR"; wait "$PR" || true
perf script -i "$D/perf.data" -F time,event 2>/dev/null | python3 -c '
import sys
r = fs = fe = None; pre, sync, post, tot = [], [], [], []
for l in sys.stdin:
    p = l.split(); t = float(p[0].rstrip(":")) * 1e6; e = p[1]
    if "exit_recvfrom" in e: r = t
    elif "enter_fdatasync" in e: fs = t
    elif "exit_fdatasync" in e: fe = t
    elif "enter_sendto" in e and r and fs and fe:
        pre.append(fs - r); sync.append(fe - fs); post.append(t - fe); tot.append(t - r); r = fs = fe = None
m = lambda v: sorted(v)[len(v) // 2]
print(f"daemon, medians of {len(tot)}: request read -> fdatasync {m(pre):.0f} us, fdatasync {m(sync):.0f} us, "
      f"fdatasync end -> reply sent {m(post):.0f} us, in all {m(tot):.0f} us")'
python3 - "$D" <<'PY'
import os, sys, time
f = os.open(f"{sys.argv[1]}/bare", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
ts = []
for _ in range(200):
    time.sleep(0.001); t = time.perf_counter(); os.write(f, b"x" * 234); os.fdatasync(f); ts.append((time.perf_counter() - t) * 1e6)
ts.sort(); print(f"bare write + fdatasync of a 234-byte record, same filesystem, median: {ts[100]:.0f} us")
PY
