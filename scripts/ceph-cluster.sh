#!/usr/bin/env bash
# A throwaway single-node Ceph cluster for loopd's RBD tests and benchmarks.
#
#   scripts/ceph-cluster.sh start DIR [--owner PID]   # start; ready when `rbd create` works
#   scripts/ceph-cluster.sh stop DIR                  # stop every daemon of DIR, by PID
#   scripts/ceph-cluster.sh env DIR                   # `eval "$(... env DIR)"`: CEPH_CONF, LOOPD_TEST_CEPH_DIR
#   scripts/ceph-cluster.sh status DIR                # `ceph -s` (bounded)
#   scripts/ceph-cluster.sh stop-mon DIR | start-mon DIR   # the monitor alone (tests of a lost cluster)
#
# The cluster: one monitor (msgr2 only, on a free port in 20000-29999 of
# 127.0.0.1: neither Ceph's default ports nor the kernel's ephemeral range), one
# BlueStore OSD on a sparse file (DIR/osd0/block, $CEPH_CLUSTER_OSD_SIZE,
# default 10G), cephx, pool `rbd` (size 1, `rbd pool init`), no manager. Every
# daemon binds 127.0.0.1 only. Everything lives under DIR: the configuration
# DIR/ceph.conf, the admin keyring DIR/keyring (client.admin), the daemons'
# logs DIR/log/, their PIDs DIR/*.pid, the monitor's store DIR/mon, the OSD's
# DIR/osd0. Clients need only `-c DIR/ceph.conf` (or CEPH_CONF=DIR/ceph.conf):
# the keyring is named in it; the user is `admin` (the default).
#
# Processes are stopped by PID, and only a PID whose command line names DIR
# (a recycled PID is never signalled); a paused (SIGSTOP) daemon is continued so
# it can exit. `--owner PID` starts a watcher (DIR/watcher.pid) that stops the
# cluster when process PID exits (also when it is killed: SIGKILL, a crash), or
# after $CEPH_CLUSTER_MAX_LIFETIME seconds (default 14400): a test binary or a
# test run that dies never leaves a cluster behind.
#
# Every wait is bounded: `start` gives up after $CEPH_CLUSTER_START_TIMEOUT
# seconds (default 60; ~11 s are needed here, ~100 s in the QEMU TCG guest of
# scripts/vm-test.sh) with the tail of the daemons' logs, and stops what it
# started; `start-mon` waits as long; one client command gets at most
# $CEPH_CLUSTER_CMD_TIMEOUT seconds (default 20; the kernel-side tests give 90
# in the TCG guest, where a `ceph` command on a loaded host took longer);
# `stop` waits 10 s per daemon after SIGTERM, then SIGKILLs it. Nothing is
# written outside DIR (the monitor's cluster log, /var/log/ceph by default,
# is off).
#
# Needs ceph-mon, ceph-osd and ceph-common (ceph, rbd, ceph-authtool,
# monmaptool): scripts/install-test-deps.sh installs them. Does not need root.
set -euo pipefail
export PATH="/usr/bin:/usr/sbin:/bin:/sbin:${PATH}"

START_TIMEOUT=${CEPH_CLUSTER_START_TIMEOUT:-60}
MAX_LIFETIME=${CEPH_CLUSTER_MAX_LIFETIME:-14400}
OSD_SIZE=$(numfmt --from=iec "${CEPH_CLUSTER_OSD_SIZE:-10G}")
# One client command (ceph, rbd) may take this long before it is killed.
CMD_TIMEOUT=${CEPH_CLUSTER_CMD_TIMEOUT:-20}

me=ceph-cluster
say() { echo "$me: $*" >&2; }
die() {
    echo "$me: ERROR: $*" >&2
    exit 1
}
usage() {
    sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# --- processes, by PID ---------------------------------------------------------

# Whether process $1 is alive and ours: its command line has DIR as an argument
# or an argument under DIR/ (a zombie's command line is empty: not alive).
is_ours() {
    local pid=$1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null |
        awk -v d="$DIR" '$0 == d || index($0, d "/") == 1 { found = 1 } END { exit !found }'
}

# Sends TERM to the process in pid file $1 (and CONT, should it be paused),
# waits up to 10 s, then KILL and 5 s more. Removes the pid file. Skips this
# shell's own PID (the watcher runs `stop` itself).
stop_pidfile() {
    local f=$1 pid i
    pid=$(cat "$f" 2>/dev/null || true)
    if [ "$pid" = "$$" ]; then
        rm -f "$f"
        return 0
    fi
    if is_ours "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        kill -CONT "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            is_ours "$pid" || break
            sleep 0.1
        done
        if is_ours "$pid"; then
            say "$(basename "$f" .pid) (pid $pid) still running 10 s after SIGTERM: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                is_ours "$pid" || break
                sleep 0.1
            done
            is_ours "$pid" && say "$(basename "$f" .pid) (pid $pid) survived SIGKILL"
        fi
    fi
    rm -f "$f"
}

# Starts a daemon in the background: $1 = name (its pid file DIR/$1.pid, its
# output DIR/log/$1.out), the rest = the command. No descriptor of ours is
# inherited (a caller reading our output sees it end when we exit).
spawn() {
    local name=$1
    shift
    "$@" </dev/null >"$DIR/log/$name.out" 2>&1 &
    echo $! >"$DIR/$name.pid"
}

# The last lines of every daemon log, for an error message.
log_tails() {
    local f
    for f in "$DIR"/log/*; do
        [ -s "$f" ] || continue
        echo "---- $f (last 15 lines)"
        tail -n 15 "$f"
    done
}

# --- the cluster ---------------------------------------------------------------

C=()
set_dir() {
    [ -n "${1:-}" ] || usage
    [ "$cmd" != start ] || mkdir -p "$1"
    [ -d "$1" ] || die "no directory $1"
    DIR=$(cd "$1" && pwd -P)
    C=(-c "$DIR/ceph.conf")
}

# A TCP port nobody listens on, from 20000-29999 (random start, 200 tries).
free_port() {
    /usr/bin/python3 - <<'EOF'
import random, socket, sys
start = random.randrange(20000, 30000)
for i in range(200):
    port = 20000 + (start - 20000 + i * 37) % 10000
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        s.close()
    print(port)
    sys.exit(0)
sys.exit("no free port in 20000-29999 on 127.0.0.1")
EOF
}

write_conf() {
    local fsid=$1 port=$2
    cat >"$DIR/ceph.conf" <<EOF
# Written by scripts/ceph-cluster.sh: a throwaway test cluster, 127.0.0.1 only.
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$port
ms bind msgr1 = false
ms bind msgr2 = true
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $DIR/keyring
run dir = $DIR/run
crash dir = $DIR/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
osd crush chooseleaf type = 0

[mon]
mon data = $DIR/mon
mon initial members = a
# The cluster log (channels cluster and audit) goes to /var/log/ceph otherwise.
mon cluster log to file = false
log file = $DIR/log/\$name.log
admin socket = $DIR/run/\$name.asok

[osd]
# The monitor binds its monmap address (127.0.0.1:PORT); the OSD would bind
# every address without these.
public addr = 127.0.0.1
cluster addr = 127.0.0.1
osd data = $DIR/osd0
keyring = $DIR/osd0/keyring
log file = $DIR/log/\$name.log
admin socket = $DIR/run/\$name.asok
osd objectstore = bluestore
bluestore block create = true
bluestore block size = $OSD_SIZE
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mount = false
osd memory target = 536870912
bluestore cache autotune = false
bluestore cache size = 67108864
EOF
}

# Seconds to give one attempt before the deadline $1 (SECONDS-based):
# CMD_TIMEOUT, or what is left of the wait, at least 1.
attempt_secs() {
    local left=$(($1 - SECONDS))
    ((left < 1)) && left=1
    ((left > CMD_TIMEOUT)) && left=$CMD_TIMEOUT
    echo "$left"
}

# Runs a ceph/rbd client command, killed after CMD_TIMEOUT seconds.
client() {
    timeout --kill-after=5 "$CMD_TIMEOUT" "$@" "${C[@]}"
}

start_mon_daemon() {
    spawn mon ceph-mon "${C[@]}" -i a -f
}

# Waits (bounded by $1 seconds) until the monitor answers.
wait_mon() {
    local until=$((SECONDS + $1))
    while ((SECONDS < until)); do
        is_ours "$(cat "$DIR/mon.pid")" || die "ceph-mon exited; $(log_tails)"
        # (The python CLI alone takes seconds under QEMU TCG.)
        timeout "$(attempt_secs "$until")" ceph "${C[@]}" mon stat >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    die "the monitor did not answer within $1 s; $(log_tails)"
}

cmd_start() {
    local owner=
    if [ "${1:-}" = --owner ]; then
        owner=${2:-}
        [[ $owner =~ ^[0-9]+$ ]] || usage
    elif [ -n "${1:-}" ]; then
        usage
    fi
    local f
    for f in "$DIR"/*.pid; do
        [ -e "$f" ] || continue
        ! is_ours "$(cat "$f")" || die "a cluster is already running in $DIR ($(basename "$f") $(cat "$f")): stop it first"
    done
    command -v ceph-mon >/dev/null || die "ceph-mon not found: install the Debian package ceph-mon (scripts/install-test-deps.sh)"
    command -v ceph-osd >/dev/null || die "ceph-osd not found: install the Debian package ceph-osd (scripts/install-test-deps.sh)"
    for f in ceph rbd ceph-authtool monmaptool; do
        command -v "$f" >/dev/null || die "$f not found: install the Debian package ceph-common (scripts/install-test-deps.sh)"
    done

    local deadline=$((SECONDS + START_TIMEOUT))
    local started=$EPOCHREALTIME
    # Whatever fails from here on: stop what was started.
    trap 'rc=$?; if [ $rc -ne 0 ]; then for f in "$DIR"/*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done; fi' EXIT
    rm -rf "$DIR/mon" "$DIR/osd0" "$DIR/run" "$DIR/log" "$DIR/crash" "$DIR/ceph.conf" "$DIR/keyring"
    mkdir -p "$DIR/mon" "$DIR/osd0" "$DIR/run" "$DIR/log" "$DIR/crash"

    local fsid port
    fsid=$(uuidgen)
    port=$(free_port)
    write_conf "$fsid" "$port"

    # Keys: the monitor's and client.admin's in DIR/keyring.
    ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$DIR/keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$DIR/monmap" >/dev/null
    ceph-mon "${C[@]}" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring" \
        >"$DIR/log/mon-mkfs.out" 2>&1 || die "ceph-mon --mkfs failed; $(log_tails)"
    start_mon_daemon
    wait_mon $((deadline - SECONDS))

    # The OSD: registered with the monitor, its key, a BlueStore on DIR/osd0/block.
    local uuid secret id
    uuid=$(uuidgen)
    secret=$(ceph-authtool --gen-print-key)
    printf '{"cephx_secret": "%s"}\n' "$secret" >"$DIR/osd-new.json"
    id=$(client ceph osd new "$uuid" -i "$DIR/osd-new.json") || die "ceph osd new failed; $(log_tails)"
    rm -f "$DIR/osd-new.json"
    [ "$id" = 0 ] || die "the new OSD has id '$id', not 0"
    ceph-authtool --create-keyring "$DIR/osd0/keyring" --name osd.0 --add-key "$secret" >/dev/null
    ceph-osd "${C[@]}" -i 0 --mkfs --osd-uuid "$uuid" >"$DIR/log/osd-mkfs.out" 2>&1 ||
        die "ceph-osd --mkfs failed; $(log_tails)"
    spawn osd ceph-osd "${C[@]}" -i 0 -f

    client ceph osd pool create rbd 8 >/dev/null 2>"$DIR/log/pool-create.out" ||
        die "ceph osd pool create rbd failed (status $?, killed after $CMD_TIMEOUT s if 124 or 137): $(tail -n 5 "$DIR/log/pool-create.out"); $(log_tails)"

    # Ready when an image can be created: `rbd pool init` and `rbd create` need
    # the OSD up and the pool's placement groups active.
    local ok=
    while ((SECONDS < deadline)); do
        is_ours "$(cat "$DIR/osd.pid")" || die "ceph-osd exited; $(log_tails)"
        if timeout "$(attempt_secs "$deadline")" rbd "${C[@]}" pool init rbd >/dev/null 2>&1 &&
            { timeout "$(attempt_secs "$deadline")" rbd "${C[@]}" create --size 4M rbd/loopd-probe >/dev/null 2>&1 ||
                timeout "$(attempt_secs "$deadline")" rbd "${C[@]}" info rbd/loopd-probe >/dev/null 2>&1; }; then
            ok=1
            break
        fi
        sleep 0.2
    done
    [ -n "$ok" ] || die "no RBD image could be created within $START_TIMEOUT s; $(log_tails)"
    client rbd rm --no-progress rbd/loopd-probe >/dev/null 2>&1 || die "rbd rm rbd/loopd-probe failed"

    if [ -n "$owner" ]; then
        # Its own command line names DIR (is_ours), so `stop` ends it too.
        "${BASH_SOURCE[0]}" watch "$DIR" "$owner" </dev/null >"$DIR/log/watcher.out" 2>&1 &
        echo $! >"$DIR/watcher.pid"
    fi
    trap - EXIT
    local secs
    secs=$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    echo "$me: ready in $secs s: mon v2:127.0.0.1:$port, osd.0 (pids $(cat "$DIR/mon.pid") $(cat "$DIR/osd.pid")), pool rbd; conf $DIR/ceph.conf" >&2
}

cmd_stop() {
    local f
    # The watcher first (it would otherwise stop the cluster too), then the
    # OSD before the monitor (a clean shutdown reports to it).
    for f in "$DIR/watcher.pid" "$DIR/osd.pid" "$DIR/mon.pid" "$DIR"/*.pid; do
        [ -e "$f" ] && stop_pidfile "$f"
    done
    return 0
}

# The watcher (started by `start --owner`): stops the cluster when the owner
# exits (its start time in /proc is compared, so a recycled PID does not count)
# or after MAX_LIFETIME seconds.
cmd_watch() {
    local owner=${1:-} born now
    [[ $owner =~ ^[0-9]+$ ]] || usage
    born=$(awk '{ print $22 }' "/proc/$owner/stat" 2>/dev/null || true)
    local until=$((SECONDS + MAX_LIFETIME))
    while ((SECONDS < until)); do
        now=$(awk '{ print $22 }' "/proc/$owner/stat" 2>/dev/null || true)
        [ -n "$born" ] && [ "$now" = "$born" ] || break
        # Is the OSD still there? (`stop` was run: nothing left to watch.)
        [ -e "$DIR/mon.pid" ] || [ -e "$DIR/osd.pid" ] || exit 0
        sleep 1
    done
    if ((SECONDS >= until)); then
        say "stopping the cluster in $DIR: it ran past CEPH_CLUSTER_MAX_LIFETIME ($MAX_LIFETIME s)"
    else
        say "stopping the cluster in $DIR: its owner (pid $owner) exited"
    fi
    cmd_stop
}

cmd_env() {
    [ -e "$DIR/ceph.conf" ] || die "no cluster in $DIR (no ceph.conf)"
    printf 'export CEPH_CONF=%q\n' "$DIR/ceph.conf"
    printf 'export LOOPD_TEST_CEPH_DIR=%q\n' "$DIR"
}

cmd_status() {
    [ -e "$DIR/ceph.conf" ] || die "no cluster in $DIR (no ceph.conf)"
    client ceph -s
}

cmd_stop_mon() {
    [ -e "$DIR/mon.pid" ] || die "no monitor pid file in $DIR"
    stop_pidfile "$DIR/mon.pid"
}

cmd_start_mon() {
    [ -e "$DIR/ceph.conf" ] || die "no cluster in $DIR (no ceph.conf)"
    if [ -e "$DIR/mon.pid" ] && is_ours "$(cat "$DIR/mon.pid")"; then
        say "the monitor is running (pid $(cat "$DIR/mon.pid"))"
        return 0
    fi
    # The port may linger in TIME_WAIT for a moment: ceph-mon sets SO_REUSEADDR,
    # and a bind failure shows up as the daemon's exit in wait_mon.
    start_mon_daemon
    wait_mon "$START_TIMEOUT"
}

[ $# -ge 2 ] || usage
cmd=$1
set_dir "$2"
shift 2
case "$cmd" in
start) cmd_start "$@" ;;
stop) cmd_stop ;;
watch) cmd_watch "$@" ;;
env) cmd_env ;;
status) cmd_status ;;
stop-mon) cmd_stop_mon ;;
start-mon) cmd_start_mon ;;
*) usage ;;
esac
