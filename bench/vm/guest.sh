#!/bin/bash
# Runs inside the benchmark VM (see bench/vm-run): the seed 000 experiment —
# ext4 on the block device, fio psync inside the filesystem, 16 jobs and 1 job,
# randread/read/randwrite/write — for kernel loop (direct I/O and buffered),
# loopd ublk (direct and buffered), loopd --blockdev nbd and nbd-client -> loopd,
# plus 4k randread/randwrite at QD1 and QD32 and 1 MiB sequential writes (QD4)
# on the raw device; ublk-direct-nozc is ublk-direct with --no-zero-copy (the
# same as ublk-direct on a kernel without UBLK_F_AUTO_BUF_REG). Records IOPS,
# context switches (/proc/stat) and the image's page-cache footprint (fincore).
set -u
OUT=$1          # a host-visible directory for results
LOOPD=$2        # the loopd binary
RUNTIME=${3:-5}
SYSTEMS=${4:-all} # the systems to run (space- or comma-separated), or all
RAW_ONLY=${5:-0}  # 1: only the raw-device cases, no ext4
IMAGE=${6:-sparse} # sparse: a truncated file (writes allocate); falloc: fallocate(1)d
                   # (unwritten extents); written: every block written first
SYSTEMS=${SYSTEMS//,/ }
want() { [ "$SYSTEMS" = all ] || [[ " $SYSTEMS " == *" $1 "* ]]; }
exec > "$OUT/guest.log" 2>&1
set -x
modprobe loop && modprobe ublk_drv && modprobe nbd || { echo "modules missing"; exit 1; }
modprobe virtio_scsi 2>/dev/null; modprobe sd_mod 2>/dev/null
DISK=
for i in $(seq 1 50); do
    DISK=$(ls /dev/vd? /dev/sd? 2>/dev/null | head -1)
    [ -n "$DISK" ] && break
    sleep 0.2
done
[ -n "$DISK" ] || { echo "no benchmark disk (/dev/vdX or /dev/sdX) in the guest"; exit 1; }
mkfs.ext4 -q -F "$DISK" && mkdir -p /run/bench/disk && mount "$DISK" /run/bench/disk || exit 1
RES=$OUT/results.csv
echo "system,case,iops,ctxt,cache_kib" > "$RES"
IMG=/run/bench/disk/img.raw
MNT=/run/bench/fs
mkdir -p $MNT

ctxt() { awk '/^ctxt/ {print $2}' /proc/stat; }

run_fio() { # system case fio-args...
    local sys=$1 case=$2; shift 2
    sync; echo 3 > /proc/sys/vm/drop_caches
    local c0; c0=$(ctxt)
    fio --output-format=json --output=/tmp/fio.json "$@" >/dev/null 2>&1
    local c1; c1=$(ctxt)
    local iops; iops=$(python3 -c "import json;d=json.load(open('/tmp/fio.json'));j=d['jobs'];print(round(sum(x['read']['iops']+x['write']['iops'] for x in j)))" 2>/dev/null || echo 0)
    local cache; cache=$(fincore --bytes --noheadings --output RES "$IMG" 2>/dev/null | awk '{print int($1/1024)}')
    echo "$sys,$case,$iops,$((c1 - c0)),${cache:-0}" >> "$RES"
}

bench_device() { # system device
    local sys=$1 dev=$2
    for rw in randread randwrite; do
        for qd in 1 32; do
            run_fio "$sys" "raw-$rw-4k-qd$qd" --name=r --filename="$dev" --direct=1 --ioengine=io_uring \
                --rw=$rw --bs=4k --iodepth=$qd --size=512M --time_based --runtime="$RUNTIME"
        done
    done
    run_fio "$sys" "raw-write-1m-qd4" --name=s --filename="$dev" --direct=1 --ioengine=io_uring \
        --rw=write --bs=1M --iodepth=4 --size=512M --time_based --runtime="$RUNTIME"
    [ "$RAW_ONLY" = 1 ] && return
    mkfs.ext4 -q -F "$dev" && mount "$dev" $MNT || { echo "mount failed for $sys"; return; }
    for rw in randread read randwrite write; do
        run_fio "$sys" "ext4-$rw-16j" --name=j --directory=$MNT --ioengine=psync --rw=$rw --bs=4k \
            --numjobs=16 --size=24M --time_based --runtime="$RUNTIME" --group_reporting
        run_fio "$sys" "ext4-$rw-1j" --name=one --directory=$MNT --ioengine=psync --rw=$rw --bs=4k \
            --numjobs=1 --size=384M --time_based --runtime="$RUNTIME"
    done
    umount $MNT
}

fresh_image() {
    rm -f "$IMG"
    case $IMAGE in
        sparse) truncate -s 1G "$IMG" ;;
        falloc) fallocate -l 1G "$IMG" ;;
        written) dd if=/dev/zero of="$IMG" bs=4M count=256 oflag=direct status=none && sync ;;
        *) echo "unknown image kind $IMAGE (sparse, falloc or written)"; exit 1 ;;
    esac
}

# kernel loop, direct I/O and buffered
for mode in on off; do
    want "loop-$( [ $mode = on ] && echo dio || echo buffered)" || continue
    fresh_image
    dev=$(losetup --direct-io=$mode -f --show "$IMG")
    bench_device "loop-$( [ $mode = on ] && echo dio || echo buffered)" "$dev"
    losetup -d "$dev"
done

# loopd: ublk direct/buffered, --blockdev nbd, nbd-client -> loopd serve
for sys in ublk-direct ublk-direct-nozc ublk-buffered knbd-direct nbdclient-direct; do
    want "$sys" || continue
    fresh_image
    cache=${sys#*-}
    cache=${cache%-nozc}
    extra=
    case $sys in *-nozc) extra=--no-zero-copy ;; esac
    S=/tmp/b.sock
    case $sys in
        ublk-*) "$LOOPD" serve "$IMG" --cache "$cache" --blockdev ublk $extra --socket $S --state /tmp/b.state > /tmp/serve.out 2>/tmp/serve.err & ;;
        knbd-*) "$LOOPD" serve "$IMG" --cache "$cache" --blockdev nbd --socket $S --state /tmp/b.state > /tmp/serve.out 2>/tmp/serve.err & ;;
        nbdclient-*) "$LOOPD" serve "$IMG" --cache "$cache" --socket $S --state /tmp/b.state > /tmp/serve.out 2>/tmp/serve.err & ;;
    esac
    P=$!
    for i in $(seq 1 200); do grep -q "nbd+unix" /tmp/serve.out 2>/dev/null && break; sleep 0.1; done
    case $sys in
        nbdclient-*) nbd-client -unix $S -N img /dev/nbd5 -b 512 >/dev/null && dev=/dev/nbd5 ;;
        *) dev=$(grep '^/dev/' /tmp/serve.out | head -1) ;;
    esac
    # Which ublk fast paths the device uses (zero copy: auto_buf_reg).
    "$LOOPD" status img 2>&1 | grep -E 'ublk_(fast_paths|kernel_features)' || true
    bench_device "$sys" "$dev"
    case $sys in nbdclient-*) nbd-client -d /dev/nbd5 ;; esac
    kill $P; wait $P
    rm -f /tmp/b.state* $S
done
echo DONE >> "$RES.done"
