#!/bin/bash
# Runs inside the VM of bench/vm-scale, as root: raises the file limits, then
# the scale rows this host cannot run (its hard RLIMIT_NOFILE is 20,000):
# block devices made at once (ublk batch and restart, kernel loop), restart
# with N devices, many devices in one daemon, idle NBD connections. Images, state files and sockets on ext4 on the VM's virtio
# disk (see bench/vm-scale for why). Each step's markdown goes to OUT/*.md.
set -u
OUT=$1          # a host-visible directory for results
BIN=$2          # loopd, examples/scale, idle-connections (copies; see bench/vm-scale)
RESTART=$3      # e.g. 4900,10000
MANY=$4         # e.g. 50000
CONNS=$5        # e.g. 100000
UBLK=$6         # e.g. 100
BEFORE=${7:-}   # optional: another loopd binary for the ublk step (before/after)
# The log to the results and to the console (seen on the host as it goes).
exec > >(tee -a "$OUT/guest.log") 2>&1
date +%s > "$OUT/booted"
echo "guest: kernel $(uname -r), $(nproc) cpus, $(awk '/MemTotal/ {print $2}' /proc/meminfo) KiB"
uname -r > "$OUT/guest-kernel"
for m in loop ublk_drv nbd; do
    modprobe "$m" || { echo "kernel module $m cannot be loaded" > "$OUT/setup-failed"; exit 1; }
done
modprobe virtio_blk 2>/dev/null
DISK=
for _ in $(seq 1 50); do
    DISK=$(ls /dev/vd? /dev/sd? 2>/dev/null | head -1)
    [ -n "$DISK" ] && break
    sleep 0.2
done
[ -n "$DISK" ] || { echo "no disk (/dev/vdX or /dev/sdX) in the guest" > "$OUT/setup-failed"; exit 1; }
mkdir -p /run/bench/disk
mkfs.ext4 -q -F "$DISK" && mount "$DISK" /run/bench/disk ||
    { echo "cannot make ext4 on $DISK" > "$OUT/setup-failed"; exit 1; }
export TMPDIR=/run/bench/disk
SCALE=$BIN/examples/scale
LOOPD=$BIN/loopd
# Read once, so the first daemon's start is not the 9p transfer of its binary.
cat "$SCALE" "$LOOPD" > /dev/null

limits() {
    echo "| fs.nr_open | $(cat /proc/sys/fs/nr_open) |"
    echo "| fs.file-max | $(cat /proc/sys/fs/file-max) |"
    echo "| RLIMIT_NOFILE (soft / hard) | $(ulimit -Sn) / $(ulimit -Hn) |"
    echo "| net.core.somaxconn | $(cat /proc/sys/net/core/somaxconn) |"
    echo "| vm.max_map_count | $(cat /proc/sys/vm/max_map_count) |"
    echo "| ublk_drv ublks_max | $(cat /sys/module/ublk_drv/parameters/ublks_max) |"
    echo "| nbd nbds_max | $(cat /sys/module/nbd/parameters/nbds_max) |"
    echo "| loop max_loop | $(cat /sys/module/loop/parameters/max_loop) |"
}
{
    echo "**Limits at boot**"
    echo
    echo "| limit | value |"
    echo "|---|---|"
    limits
} > "$OUT/limits-boot.md"
# The open-file limits: the hard limit may be raised by root up to
# fs.nr_open, which root may raise too.
sysctl -q -w fs.nr_open=1048576
ulimit -Hn 1048576 && ulimit -Sn 1048576 || { echo "cannot raise RLIMIT_NOFILE" > "$OUT/setup-failed"; exit 1; }

step() { # name timeout command...
    local name=$1 to=$2
    shift 2
    echo "guest: $(date -u +%T) $name: $*"
    local t0 mem0
    t0=$(date +%s.%N)
    mem0=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
    timeout --kill-after=10 "$to" "$@" > "$OUT/$name.md" 2> "$OUT/$name.err"
    local rc=$?
    local t1
    t1=$(date +%s.%N)
    echo "| $name | $rc | $(python3 -c "print(f'{$t1 - $t0:.0f}')") | $(((mem0 - $(awk '/MemAvailable/ {print $2}' /proc/meminfo)) / 1024)) |" >> "$OUT/steps.md"
    echo "guest: $(date -u +%T) $name exited $rc"
    tail -n 5 "$OUT/$name.err"
}

echo "| step | exit | s | MemAvailable lost, MiB (after − before) |" > "$OUT/steps.md"
echo "|---|---:|---:|---:|" >> "$OUT/steps.md"
step restart 900 "$SCALE" --only restart --restart "$RESTART" --rounds 1
step many 1200 "$SCALE" --only many --many "$MANY" --rounds 1
step idle 1200 python3 "$BIN/idle-connections" --loopd "$LOOPD" --label loopd \
    --n "$CONNS" --fresh 20 --batch 512 --past-limit
# Block devices at the kernel's default ublks_max (64: on 6.12 it limits
# only unprivileged devices, so root's 100 are made).
step ublk 900 "$SCALE" --only ublk --ublk "$UBLK" ${BEFORE:+--before "$BEFORE"}
{
    echo "**Limits during the run** (raised by this script: fs.nr_open, RLIMIT_NOFILE)"
    echo
    echo "| limit | value |"
    echo "|---|---|"
    limits
} > "$OUT/limits-run.md"
dmesg | tail -n 60 > "$OUT/dmesg.txt"
umount /run/bench/disk
date +%s > "$OUT/finished"
