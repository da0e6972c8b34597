#!/bin/bash
# Runs inside the benchmark VM (see bench/vm-rbd): one RBD image of a throwaway
# Ceph cluster started in the guest (scripts/ceph-cluster.sh on a tmpfs; the
# guest has no network), served as a kernel block device by
#   loopd-ublk   loopd serve rbd:rbd/bench --blockdev ublk --cache direct
#   loopd-knbd   loopd serve rbd:rbd/bench --blockdev nbd  --cache direct
#   rbd-nbd      rbd-nbd map rbd/bench (Ceph's own; librbd's cache off, as loopd's)
# and fio (io_uring, O_DIRECT) on the device: 4k randread/randwrite at QD1 and
# QD16, 1 MiB sequential read at QD8. ROUNDS rounds, the systems in turn inside
# each. Writes OUT/results.csv (system,round,case,iops) and OUT/results.csv.done.
set -u
OUT=$1          # a host-visible directory for results
LOOPD=$2        # the loopd binary
ROOT=$3         # the source tree (scripts/ceph-cluster.sh)
RUNTIME=${4:-8}
ROUNDS=${5:-2}
exec > "$OUT/guest.log" 2>&1
set -x
modprobe ublk_drv && modprobe nbd || { echo "modules missing"; exit 1; }
S=$OUT/scratch
mkdir -p "$S" && mount -t tmpfs -o size=1500M,mode=1777 loopd-bench-rbd "$S" || exit 1
C=$S/ceph
CEPH_CLUSTER_START_TIMEOUT=300 CEPH_CLUSTER_CMD_TIMEOUT=90 "$ROOT/scripts/ceph-cluster.sh" start "$C" || { echo "no cluster"; exit 1; }
CONF=$C/ceph.conf
# rbd-nbd with librbd's cache off, as loopd's --cache direct.
NOCACHE=$C/nocache.conf
{ cat "$CONF"; printf '\n[client]\nrbd cache = false\nlog file = %s\n' "$C/log/rbd-nbd.log"; } > "$NOCACHE"
rbd -c "$CONF" create --size 256M rbd/bench || exit 1
# Every object written once, so reads hit data.
rbd -c "$CONF" bench --io-type write --io-size 1M --io-threads 8 --io-total 256M \
    --io-pattern seq rbd/bench >/dev/null || exit 1
RES=$OUT/results.csv
echo "system,round,case,iops" > "$RES"

run_fio() { # system round case dev fio-args...
    local sys=$1 round=$2 case=$3 dev=$4; shift 4
    fio --output-format=json --output="$S/fio.json" --name=b --filename="$dev" --direct=1 \
        --ioengine=io_uring --size=256M --time_based --runtime="$RUNTIME" --ramp_time=2 "$@" \
        >/dev/null 2>"$S/fio.err"
    local iops
    iops=$(python3 -c "import json;d=json.load(open('$S/fio.json'));j=d['jobs'];print(round(sum(x['read']['iops']+x['write']['iops'] for x in j)))" 2>/dev/null || echo 0)
    echo "$sys,$round,$case,$iops" >> "$RES"
}

bench_device() { # system round device
    local sys=$1 round=$2 dev=$3
    run_fio "$sys" "$round" randread-4k-qd1 "$dev" --rw=randread --bs=4k --iodepth=1
    run_fio "$sys" "$round" randread-4k-qd16 "$dev" --rw=randread --bs=4k --iodepth=16
    run_fio "$sys" "$round" randwrite-4k-qd1 "$dev" --rw=randwrite --bs=4k --iodepth=1
    run_fio "$sys" "$round" randwrite-4k-qd16 "$dev" --rw=randwrite --bs=4k --iodepth=16
    run_fio "$sys" "$round" read-1m-qd8 "$dev" --rw=read --bs=1M --iodepth=8
}

for round in $(seq 1 "$ROUNDS"); do
    for sys in loopd-ublk loopd-knbd rbd-nbd; do
        case $sys in
        loopd-*)
            rm -f "$S"/b.*
            kind=ublk
            [ "$sys" = loopd-knbd ] && kind=nbd
            "$LOOPD" serve rbd:rbd/bench --name bench --blockdev "$kind" --cache direct \
                --ceph-conf "$CONF" --ceph-id admin --socket "$S/b.sock" --state "$S/b.state" \
                >"$S/serve.out" 2>"$S/serve.err" &
            P=$!
            dev=
            for _ in $(seq 1 600); do
                dev=$(grep '^/dev/' "$S/serve.out" 2>/dev/null | head -1)
                [ -n "$dev" ] && break
                kill -0 $P 2>/dev/null || break
                sleep 0.1
            done
            [ -n "$dev" ] || { cat "$S/serve.err"; echo "loopd did not start"; exit 1; }
            bench_device "$sys" "$round" "$dev"
            kill $P; wait $P
            ;;
        rbd-nbd)
            dev=$(rbd-nbd map -c "$NOCACHE" --id admin rbd/bench) || { echo "rbd-nbd map failed"; exit 1; }
            bench_device "$sys" "$round" "$dev"
            rbd-nbd unmap "$dev" || exit 1
            ;;
        esac
    done
done
"$ROOT/scripts/ceph-cluster.sh" stop "$C"
umount "$S"
echo DONE > "$RES.done"
