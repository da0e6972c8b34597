#!/bin/bash
# One ad-hoc A/B trial (not part of bench/run): serve the bench image, run fio's nbd
# engine against it, print IOPS, server CPU, fio CPU per request, context switches,
# migrations and IPIs per request (perf stat -a, /proc/interrupts).
# usage: bench/trial-16j.sh nbdkit|qemu-nbd|loopd|loopd-direct RW
#   env: JOBS=16 QD=1 BS=4k RT=8 EXTRA="server args" TAG=label IMG=path
set -euo pipefail
sys=$1; rw=${2:-randwrite}; bs=${BS:-4k}; qd=${QD:-1}; J=${JOBS:-16}; rt=${RT:-8}
IMG=${IMG:-/var/tmp/loopd-bench/image-2G.raw}
LOOPD=${LOOPD:-$(dirname "$0")/../target/release/loopd}
W=$(mktemp -d); S=$W/sock
trap 'rm -rf "$W"' EXIT
python3 -c "
import os; fd=os.open('$IMG',os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)"
case $sys in
 loopd) "$LOOPD" serve "$IMG" --cache buffered --socket "$S" --state "$W/state" ${EXTRA:-} >"$W/srv.log" 2>&1 & ;;
 loopd-direct) "$LOOPD" serve "$IMG" --cache direct --socket "$S" --state "$W/state" ${EXTRA:-} >"$W/srv.log" 2>&1 & ;;
 nbdkit) nbdkit -f -U "$S" file "$IMG" ${EXTRA:-} >"$W/srv.log" 2>&1 & ;;
 qemu-nbd) qemu-nbd --cache=none --aio=io_uring -f raw -k "$S" --shared=$((J + 1)) --persistent ${EXTRA:-} "$IMG" >"$W/srv.log" 2>&1 & ;;
 *) echo "unknown system $sys" >&2; exit 2 ;;
esac
pid=$!
for _ in $(seq 100); do [ -S "$S" ] && break; sleep 0.05; done
ipis() { awk '/^ *(RES|CAL):/{for(i=2;i<=NF;i++) if($i ~ /^[0-9]+$/) s+=$i}END{print s}' /proc/interrupts; }
i0=$(ipis); t0=$(awk '{print $14+$15}' /proc/$pid/stat)
perf stat -a -e context-switches,cpu-migrations -x, -o "$W/pstat" -- \
  fio --name=t --ioengine=nbd --uri="nbd+unix:///?socket=$S" --rw="$rw" --bs="$bs" \
  --iodepth="$qd" --numjobs="$J" --group_reporting=1 --size=$((2048 / J))M \
  --offset_increment=$((2048 / J))M --time_based --runtime="$rt" \
  --output-format=json --output="$W/out.json" >/dev/null 2>&1
i1=$(ipis); t1=$(awk '{print $14+$15}' /proc/$pid/stat)
kill "$pid"; wait "$pid" 2>/dev/null || true
cs=$(awk -F, '/context-switches/{print $1}' "$W/pstat"); mg=$(awk -F, '/cpu-migrations/{print $1}' "$W/pstat")
python3 -c "
import json; d = json.load(open('$W/out.json'))['jobs'][0]
i = d['read']['iops'] + d['write']['iops']; n = i * $rt
fc = (d['usr_cpu'] + d['sys_cpu']) / 100 * $rt * $J
print(f'$sys${TAG:-} $rw: {i/1000:.1f}k IOPS srv_cpu={($t1-$t0)/100:.1f}s fio_cpu={fc:.1f}s '
      f'fio_us/req={fc/n*1e6:.1f} cs/req={$cs/n:.2f} migr/req={$mg/n:.3f} ipi/req={($i1-$i0)/n:.2f}')"
