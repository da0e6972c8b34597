#!/usr/bin/env bash
# The systemd units under real systemd: installs loopd with scripts/install.sh,
# boots the VM of scripts/vm-test.sh (virtme-ng, QEMU TCG) and, inside it, runs
# the host's systemd as PID 1 of new PID, mount and cgroup namespaces
# ("container mode": booting the VM with systemd as init, `vng --systemd`, hung
# under TCG). Then, each step bounded by a timeout:
#
#   1. start loopd.socket and loopd-control.socket: loopd.service stays inactive;
#   2. an NBD client (nbdinfo, nbdcopy) connects: the service is started on
#      demand, reaches active (Type=notify: only after READY=1) and serves the
#      export of devices.toml;
#   3. a device added to devices.toml + `systemctl reload loopd`: `loopd list`
#      shows it and the journal shows the reload; `loopd attach --blockdev ublk`
#      and `--blockdev nbd` work under the unit's hardening;
#   4. `systemctl stop loopd.service` alone leaves the sockets in place, and a
#      `loopd` command starts the service again;
#   5. `systemctl stop loopd.service loopd.socket loopd-control.socket`: no loopd
#      process, no socket file; the state file is kept.
#
#   scripts/vm-systemd-test.sh                       # under every kernel
#   LOOPD_VM_KERNEL=newest scripts/vm-systemd-test.sh  # under one
#
# Runs under each kernel of scripts/vm-test.sh's matrix (6.12 and the newest,
# scripts/vm-kernels.sh), one VM boot each, side by side (LOOPD_VM_PARALLEL=0:
# one after the other); the report names the kernel of each result. Needs what
# scripts/install-test-deps.sh installs, and root. Logs go to
# target/vm-systemd-test/RELEASE/. Environment as scripts/vm-test.sh:
# LOOPD_VM_KERNELS, LOOPD_VM_KERNEL (one kernel: a name or a vmlinuz),
# LOOPD_VNG_VENV, LOOPD_VM_TIMEOUT (one VM run, default 1200 s),
# LOOPD_VM_BOOT_TIMEOUT (300 s), LOOPD_VM_CPUS (2), LOOPD_VM_MEMORY (2G).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=$ROOT/target/vm-systemd-test
VNG=${LOOPD_VNG_VENV:-/opt/loopd-vng}/bin/vng
TIMEOUT=${LOOPD_VM_TIMEOUT:-1200}
BOOT_TIMEOUT=${LOOPD_VM_BOOT_TIMEOUT:-300}
CPUS=${LOOPD_VM_CPUS:-2}
MEMORY=${LOOPD_VM_MEMORY:-2G}

REL=
die() {
    echo "vm-systemd-test${REL:+ on $REL}: ERROR: $*" >&2
    exit 1
}

# --- the kernels: one run of this script each -------------------------------------
# vm_kernel, vm_kernel_release.
# shellcheck source=scripts/vm-kernels.sh
. scripts/vm-kernels.sh
if [ -z "${LOOPD_VM_KERNEL:-}" ]; then
    read -r -a kernel_names <<<"${LOOPD_VM_KERNELS:-6.12 newest}"
    [ "${#kernel_names[@]}" -gt 0 ] || die "LOOPD_VM_KERNELS names no kernel"
    # Side by side (LOOPD_VM_PARALLEL=0: one after the other), each one's
    # output into a file, shown in order when all are done.
    mkdir -p "$OUT"
    cargo build --release
    declare -a pids=() t0s=() outs=()
    for i in "${!kernel_names[@]}"; do
        outs[$i]=$OUT/${kernel_names[$i]//\//_}.out
        t0s[$i]=$(date +%s)
        (
            rc=0
            LOOPD_VM_KERNEL=${kernel_names[$i]} "$ROOT/scripts/vm-systemd-test.sh" >"${outs[$i]}" 2>&1 || rc=$?
            date +%s >"${outs[$i]}.end"
            exit "$rc"
        ) &
        pids[$i]=$!
        if [ "${LOOPD_VM_PARALLEL:-1}" != 1 ]; then
            wait "${pids[$i]}" && pids[$i]=ok || pids[$i]=failed
        fi
    done
    failed=()
    results=()
    for i in "${!kernel_names[@]}"; do
        n=${kernel_names[$i]}
        case ${pids[$i]} in
        ok) rc=0 ;;
        failed) rc=1 ;;
        *) wait "${pids[$i]}" && rc=0 || rc=$? ;;
        esac
        echo "==== vm-systemd-test under $n (${outs[$i]})"
        cat "${outs[$i]}"
        secs=$(($(cat "${outs[$i]}.end") - t0s[i]))
        if [ "$rc" -eq 0 ]; then
            results+=("$n: passed in $secs s")
        else
            results+=("$n: FAILED after $secs s")
            failed+=("$n")
        fi
    done
    echo "== vm-systemd-test: results by kernel"
    printf '  %s\n' "${results[@]}"
    [ "${#failed[@]}" -eq 0 ] || die "failed under: ${failed[*]}"
    echo "== vm-systemd-test: passed under ${#kernel_names[@]} kernel(s)"
    exit 0
fi

# --- host prerequisites -------------------------------------------------------
KERNEL=$(vm_kernel "$LOOPD_VM_KERNEL")
[ -n "$KERNEL" ] && [ -r "$KERNEL" ] ||
    die "no readable kernel '$LOOPD_VM_KERNEL' (6.12: /boot/vmlinuz-6.12*; newest: in ${VM_KERNELS_DIR}; run scripts/install-test-deps.sh, or set LOOPD_VM_KERNEL to a vmlinuz)"
REL=$(vm_kernel_release "$KERNEL")
[ -x "$VNG" ] || die "virtme-ng not found at $VNG (run scripts/install-test-deps.sh)"
for t in qemu-system-x86_64 busybox nbdinfo nbdcopy unshare nsenter systemctl journalctl; do
    command -v "$t" >/dev/null || die "$t missing (run scripts/install-test-deps.sh)"
done
[ -x /lib/systemd/systemd ] || die "/lib/systemd/systemd missing (package systemd)"
[ "$(id -u)" -eq 0 ] || die "must run as root (the guest runs as the same user; systemd needs root)"

# --- build and install ----------------------------------------------------------
echo "== vm-systemd-test: build"
cargo build --release
RUN=$OUT/$REL
rm -rf "$RUN"
mkdir -p "$RUN/scratch"
# Installed for real under $RUN (the VM sees the host's file system read-only,
# and $RUN read-write): the units name $INST/usr/bin/loopd and
# $INST/etc/loopd/devices.toml.
INST=$RUN/inst
scripts/install.sh --no-build --prefix "$INST/usr" --unitdir "$INST/units" --sysconfdir "$INST/etc" \
    >"$RUN/install.log"
LOOPD=$INST/usr/bin/loopd
CONFIG=$INST/etc/loopd/devices.toml

# --- the guest script ----------------------------------------------------------
GUEST=$RUN/guest.sh
{
    echo '#!/bin/bash'
    echo "# Generated by scripts/vm-systemd-test.sh; runs inside the VM as root."
    echo "RUN='$RUN'"
    echo "INST='$INST'"
    echo "LOOPD='$LOOPD'"
    echo "CONFIG='$CONFIG'"
    cat <<'EOF'
exec >"$RUN/guest.log" 2>&1
set -u
echo "guest: kernel $(uname -r), $(nproc) cpus"
date +%s >"$RUN/booted"
SD=
fail() {
    echo "vm-systemd-test: FAILED: $*"
    if [ -n "$SD" ]; then
        echo "---- systemctl status loopd.service loopd.socket loopd-control.socket"
        c systemctl --no-pager -l status loopd.service loopd.socket loopd-control.socket
        echo "---- journal of the loopd units (last 60 lines)"
        c journalctl --no-pager -o short-monotonic -n 60 -u loopd.service -u loopd.socket -u loopd-control.socket
        echo "---- systemctl --failed"
        c systemctl --no-pager --failed
        kill -KILL "$SD" 2>/dev/null
    fi
    echo 1 >"$RUN/result"
    exit 1
}
ok() { echo "ok: $*"; }
# A command inside the systemd container, bounded.
c() { timeout --kill-after=5 "${T:-60}" nsenter -t "$SD" -m -p -C -- "$@"; }
# Wait up to $1 seconds for the command after it to succeed.
until_ok() {
    local n=$1 i=0
    shift
    while ! "$@" >/dev/null 2>&1; do
        i=$((i + 1))
        [ "$i" -lt "$n" ] || return 1
        sleep 1
    done
}
active_state() { c systemctl show -P ActiveState "$1"; }
is_state() { [ "$(active_state "$1")" = "$2" ]; }

for m in loop nbd ublk_drv; do
    modprobe "$m" || fail "kernel module $m cannot be loaded"
done
mount -t tmpfs -o size=256M,mode=1777 loopd-vm-scratch "$RUN/scratch" || fail "cannot mount a tmpfs on $RUN/scratch"
IMG=$RUN/scratch
truncate -s 16M "$IMG/a.img" "$IMG/b.img" "$IMG/c.img"
printf 'loopd-systemd-a!' | dd of="$IMG/a.img" conv=notrunc status=none
printf '[[device]]\nimage = "%s"\nname = "a"\n' "$IMG/a.img" >"$CONFIG"

# --- systemd in a container -------------------------------------------------------
# A target that pulls in nothing: the test starts what it needs. The host's
# sysinit units that make no sense here (udev, ldconfig, ...) are masked.
UNITS=$RUN/scratch/units
mkdir -p "$UNITS"
cp "$INST"/units/* "$UNITS/"
printf '[Unit]\nDescription=loopd systemd test\n' >"$UNITS/loopd-vm.target"
for u in /lib/systemd/system/sysinit.target.wants/* /lib/systemd/system/sockets.target.wants/*; do
    u=$(basename "$u")
    case $u in systemd-journald.service | systemd-journald.socket | systemd-journald-dev-log.socket) continue ;; esac
    ln -sf /dev/null "$UNITS/$u"
done
# The container's PID 1: fresh /run, units from $UNITS, a writable /var/lib and
# /var/log, its own cgroup tree; then systemd.
cat >"$RUN/scratch/init.sh" <<INIT
#!/bin/bash
set -e
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=0755 tmpfs /var/lib
mount -t tmpfs -o mode=0755 tmpfs /var/log
mount --bind "$UNITS" /etc/systemd/system
umount -l /sys/fs/cgroup 2>/dev/null || true
mount -t cgroup2 cgroup2 /sys/fs/cgroup
exec /lib/systemd/systemd --system --unit=loopd-vm.target
INIT
chmod +x "$RUN/scratch/init.sh"
t0=$(date +%s)
container=loopd-vm-test unshare --pid --fork --mount --mount-proc --cgroup --propagation private \
    "$RUN/scratch/init.sh" </dev/null >"$RUN/systemd.log" 2>&1 &
US=$!
# systemd is unshare's child (PID 1 inside).
for _ in $(seq 1 50); do
    SD=$(cat /proc/"$US"/task/*/children 2>/dev/null | tr -d ' ')
    [ -n "$SD" ] && break
    sleep 0.2
done
[ -n "$SD" ] || fail "systemd did not start in the container (see $RUN/systemd.log)"
echo "guest: systemd runs as PID $SD"
state=
for _ in $(seq 1 300); do
    state=$(T=10 c systemctl is-system-running 2>/dev/null)
    case $state in running | degraded) break ;; esac
    kill -0 "$SD" 2>/dev/null || fail "systemd exited (see $RUN/systemd.log)"
    sleep 1
done
case $state in running | degraded) ;; *) fail "systemd not up after 300 s (state '$state')" ;; esac
ok "systemd is up ($state) after $(($(date +%s) - t0)) s"
T=120 c systemctl start systemd-journald.socket systemd-journald.service || fail "cannot start journald"
T=30 c systemctl is-active systemd-journald.service >/dev/null || fail "journald is not running"

# --- 1. sockets first, no service ---------------------------------------------
T=120 c systemctl start loopd.socket loopd-control.socket || fail "systemctl start loopd.socket loopd-control.socket"
is_state loopd.socket active || fail "loopd.socket is $(active_state loopd.socket)"
is_state loopd-control.socket active || fail "loopd-control.socket is $(active_state loopd-control.socket)"
c test -S /run/loopd/loopd.sock || fail "no socket /run/loopd/loopd.sock"
c test -S /run/loopd/loopd.ctl || fail "no socket /run/loopd/loopd.ctl"
is_state loopd.service inactive || fail "loopd.service is $(active_state loopd.service) before any client"
ok "sockets listen; loopd.service inactive"

# --- 2. a client starts the service ---------------------------------------------
URI='nbd+unix:///a?socket=/run/loopd/loopd.sock'
size=$(T=180 c nbdinfo --size "$URI") || fail "nbdinfo $URI"
[ "$size" = 16777216 ] || fail "nbdinfo --size says '$size', want 16777216"
is_state loopd.service active || fail "loopd.service is $(active_state loopd.service) after a client connected"
[ "$(c systemctl show -P Type loopd.service)" = notify ] || fail "loopd.service is not Type=notify"
# A Type=notify service is active only once systemd got READY=1.
head=$(T=120 c sh -c "nbdcopy '$URI' - | head -c 16") || fail "nbdcopy $URI"
[ "$head" = 'loopd-systemd-a!' ] || fail "export a reads '$head', not the image's bytes"
ok "nbdinfo started loopd.service on demand (Type=notify, active after READY=1); export a reads the image"
pid1=$(c systemctl show -P MainPID loopd.service)

# --- 3. reload ------------------------------------------------------------------------
printf '[[device]]\nimage = "%s"\nname = "b"\n' "$IMG/b.img" >>"$CONFIG"
T=120 c systemctl reload loopd.service || fail "systemctl reload loopd.service"
until_ok 60 c sh -c "'$LOOPD' list | grep -q '^b '" || fail "device b not listed after reload: $(c "$LOOPD" list 2>&1)"
[ "$(c systemctl show -P MainPID loopd.service)" = "$pid1" ] || fail "the reload restarted the daemon"
# systemd's "Reloading"/"Reloaded" lines and the daemon's reload summary.
until_ok 30 c sh -c "journalctl --no-pager -u loopd.service | grep -q 'Reloaded loopd.service'" ||
    fail "no reload in the journal: $(c journalctl --no-pager -u loopd.service | tail -n 20)"
is_state loopd.service active || fail "loopd.service is $(active_state loopd.service) after the reload"
ok "systemctl reload: device b attached, same process, reload in the journal:"
c journalctl --no-pager -u loopd.service | grep -i reload
T=60 c "$LOOPD" attach --name c "$IMG/c.img" >/dev/null || fail "loopd attach c"
# The hardening (DevicePolicy=closed, capabilities, address families) still
# lets the service make ublk and kernel NBD block devices.
for kind in ublk nbd; do
    truncate -s 16M "$IMG/$kind.img"
    printf 'loopd-systemd-%s' "$kind" | dd of="$IMG/$kind.img" conv=notrunc status=none
    out=$(T=120 c "$LOOPD" attach --name "$kind" --blockdev "$kind" "$IMG/$kind.img" 2>&1) ||
        fail "loopd attach --blockdev $kind under loopd.service: $out"
    dev=$(printf '%s\n' "$out" | grep '^/dev/' | head -n 1)
    [ -n "$dev" ] || fail "attach --blockdev $kind printed no device: $out"
    want="loopd-systemd-$kind"
    got=$(T=60 c dd if="$dev" bs=4096 count=1 iflag=direct status=none | head -c "${#want}")
    [ "$got" = "$want" ] || fail "$dev reads '$got', not '$want'"
    T=120 c "$LOOPD" detach "$kind" >/dev/null || fail "loopd detach $kind"
    ok "attach --blockdev $kind under loopd.service: $dev reads the image"
done

# --- 4. stopping the service keeps the sockets ------------------------------------
T=120 c systemctl stop loopd.service || fail "systemctl stop loopd.service"
is_state loopd.service inactive || fail "loopd.service is $(active_state loopd.service) after stop"
is_state loopd.socket active || fail "loopd.socket is $(active_state loopd.socket) after stopping the service"
c test -S /run/loopd/loopd.sock || fail "the service removed /run/loopd/loopd.sock, which systemd owns"
c test -S /run/loopd/loopd.ctl || fail "the service removed /run/loopd/loopd.ctl, which systemd owns"
list=$(T=180 c "$LOOPD" list) || fail "loopd list (activating the service through the control socket)"
is_state loopd.service active || fail "loopd.service is $(active_state loopd.service) after loopd list"
for d in a b c; do
    printf '%s\n' "$list" | grep -q "^$d " || fail "device $d missing after a restart: $list"
done
ok "stopping loopd.service keeps the sockets; loopd list starts it again with devices a, b (config) and c (state)"

# --- 5. stop everything ------------------------------------------------------------
T=120 c systemctl stop loopd.service loopd.socket loopd-control.socket || fail "systemctl stop"
for u in loopd.service loopd.socket loopd-control.socket; do
    is_state "$u" inactive || fail "$u is $(active_state "$u") after stop"
done
if pgrep -x loopd >/dev/null; then fail "a loopd process is left: $(pgrep -a -x loopd)"; fi
c test ! -e /run/loopd/loopd.sock || fail "/run/loopd/loopd.sock left behind"
c test ! -e /run/loopd/loopd.ctl || fail "/run/loopd/loopd.ctl left behind"
c test -s /var/lib/loopd/loopd.state || fail "the state file /var/lib/loopd/loopd.state is gone"
c grep -q c.img /var/lib/loopd/loopd.state || fail "the state file does not record device c"
ok "systemctl stop: no loopd process, no socket file; the state file is kept"

echo "---- journal of loopd.service"
c journalctl --no-pager -o short-monotonic -u loopd.service
# In a container, exit.target makes systemd exit.
T=30 c systemctl --no-block start exit.target
for _ in $(seq 1 30); do kill -0 "$SD" 2>/dev/null || break; sleep 1; done
kill -KILL "$SD" 2>/dev/null
wait "$US" 2>/dev/null
umount "$RUN/scratch"
echo 0 >"$RUN/result"
echo "vm-systemd-test: all checks passed"
EOF
} >"$GUEST"
chmod +x "$GUEST"

# --- boot, run, report ------------------------------------------------------------
# A VM whose guest script never started is booted again, once (QEMU 7.2 under
# TCG has aborted now and then while the newest kernel set up its PCI devices:
# "msix_table_mmio_write: Assertion ... failed"); its first console log is kept
# as console-first-boot.log.
for attempt in 1 2; do
    echo "== vm-systemd-test: booting $KERNEL ($REL, TCG, $CPUS cpus, $MEMORY)"
    t0=$(date +%s)
    PATH=$(dirname "$VNG"):$PATH timeout --kill-after=30 "$TIMEOUT" \
        "$VNG" --run "$KERNEL" --disable-kvm --cpus "$CPUS" --memory "$MEMORY" \
        --rwdir "$RUN" --exec "$GUEST" </dev/null >"$RUN/console.log" 2>&1 &
    vm_pid=$!
    stop_vm() { kill -TERM -- "-$vm_pid" 2>/dev/null || kill -TERM "$vm_pid" 2>/dev/null || true; }
    trap stop_vm EXIT
    trap 'stop_vm; exit 130' INT TERM
    no_boot=
    while kill -0 "$vm_pid" 2>/dev/null; do
        if [ -z "$no_boot" ] && [ ! -e "$RUN/booted" ] && [ "$(date +%s)" -ge $((t0 + BOOT_TIMEOUT)) ]; then
            no_boot="the guest did not start its script within $BOOT_TIMEOUT s"
            stop_vm
        fi
        sleep 1
    done
    set +e
    wait "$vm_pid"
    vng_rc=$?
    set -e
    trap - EXIT INT TERM
    [ ! -e "$RUN/booted" ] && [ "$attempt" -eq 1 ] || break
    echo "== vm-systemd-test: the VM on $REL did not boot (${no_boot:-vng exited $vng_rc}); its console:"
    tail -n 20 "$RUN/console.log" || true
    mv "$RUN/console.log" "$RUN/console-first-boot.log"
    echo "== vm-systemd-test: booting it again, once"
done
echo "== vm-systemd-test: the VM on $REL exited ($vng_rc) after $(($(date +%s) - t0)) s; logs in $RUN"
if [ ! -e "$RUN/booted" ]; then
    tail -n 40 "$RUN/console.log" || true
    die "VM did not boot: ${no_boot:-vng exited $vng_rc}, see $RUN/console.log"
fi
echo "---- guest ($RUN/guest.log)"
cat "$RUN/guest.log" || true
if [ "$(cat "$RUN/result" 2>/dev/null)" != 0 ]; then
    echo "---- systemd ($RUN/systemd.log, last 40 lines)"
    tail -n 40 "$RUN/systemd.log" 2>/dev/null || true
    [ "$vng_rc" -ne 124 ] || die "the VM run timed out after $TIMEOUT s"
    die "the systemd checks failed (see above and $RUN)"
fi
echo "== vm-systemd-test: passed on $REL"
