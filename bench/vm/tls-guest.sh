#!/bin/bash
# Runs inside the VM of bench/vm-tls: loads the kernel's TLS (kTLS), puts the
# bench image on ext4 on the virtio disk and a tmpfs on /tmp (the shared root
# is read-only), runs bench/tls with every system (loopd-ktls-* included) and
# copies its output to the host-visible directory.
set -u
OUT=$1          # a host-visible directory for results
LOOPD=$2        # the loopd binary
RUNTIME=${3:-5}
exec > "$OUT/guest.log" 2>&1
set -x
modprobe tls || { echo "the kernel has no tls module"; exit 1; }
modprobe virtio_scsi 2>/dev/null; modprobe sd_mod 2>/dev/null
DISK=
for i in $(seq 1 50); do
    DISK=$(ls /dev/vd? /dev/sd? 2>/dev/null | head -1)
    [ -n "$DISK" ] && break
    sleep 0.2
done
[ -n "$DISK" ] || { echo "no benchmark disk (/dev/vdX or /dev/sdX) in the guest"; exit 1; }
mkfs.ext4 -q -F "$DISK" && mkdir -p /run/bench/disk && mount "$DISK" /run/bench/disk || exit 1
mount -t tmpfs -o size=512M,mode=1777 tlsbench-tmp /tmp || exit 1
mkdir -p /run/bench/res && mount -t tmpfs -o size=256M tlsbench-res /run/bench/res || exit 1
cat /proc/net/tls_stat
cd "$(dirname "$0")/../.."
/usr/bin/python3 bench/tls --runtime "$RUNTIME" --ramp 1 --size 512M --image-dir /run/bench/disk \
    --loopd "$LOOPD" --out /run/bench/res
rc=$?
cat /proc/net/tls_stat
cp -r /run/bench/res/. "$OUT/"
echo "$rc" > "$OUT/bench-tls.rc"
