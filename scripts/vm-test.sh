#!/usr/bin/env bash
# Kernel-side tests: builds every tests/kernel_*.rs (feature vm-tests), then,
# for each kernel of the matrix, boots ONE VM with it (virtme-ng, QEMU TCG: no
# KVM needed), runs each test binary inside it as root, and reports every
# result with the kernel it came from.
#
#   scripts/vm-test.sh              # all kernel_* suites, under every kernel
#   scripts/vm-test.sh kernel_x     # only these suites (or just x: tls = kernel_tls)
#   LOOPD_VM_KERNEL=newest scripts/vm-test.sh tls   # under one kernel
#
# The kernels (scripts/vm-kernels.sh): `6.12` (bookworm-backports, installed)
# and `newest` (the newest kernel of trixie-backports, which
# scripts/install-vm-deps.sh chose and unpacked into /opt/loopd-vm-kernels).
# Needs what scripts/install-test-deps.sh installs (those kernels,
# qemu-system-x86, virtme-ng in /opt/loopd-vng). Results (per kernel: one log,
# one exit status and the seconds per binary, the guest's and the console's
# output) go to target/vm-test/RELEASE/ (RELEASE-FEATURES/ with
# LOOPD_VM_FEATURES). Exits non-zero if a VM did not boot, if any suite failed
# under any kernel, or if a suite wrote no result. The VMs of the kernels run
# side by side (LOOPD_VM_PARALLEL=0: one after the other).
# Environment: LOOPD_VM_KERNELS (the matrix: names or vmlinuz paths, default
# "6.12 newest"), LOOPD_VM_KERNEL (one kernel, a name or a vmlinuz; overrides
# the matrix), LOOPD_VNG_VENV (virtme-ng's venv, default /opt/loopd-vng),
# LOOPD_VM_TIMEOUT (seconds for one VM run, default 2400),
# LOOPD_VM_SUITE_TIMEOUT (seconds for one suite, default 1200; exit 124 when
# exceeded), LOOPD_VM_BOOT_TIMEOUT (seconds until the guest must have started,
# default 300), LOOPD_VM_CPUS (2), LOOPD_VM_MEMORY (3G), LOOPD_VM_TEST_ARGS
# (extra arguments for every test binary, e.g. a name filter:
# LOOPD_VM_TEST_ARGS=create_on_9p), LOOPD_VM_FEATURES (cargo features besides
# vm-tests, e.g. test-backend), LOOPD_VM_ENV (one NAME=VALUE exported in the
# guest, e.g. LOOPD_TEST_BACKEND=mem).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=$ROOT/target/vm-test
VNG=${LOOPD_VNG_VENV:-/opt/loopd-vng}/bin/vng
TIMEOUT=${LOOPD_VM_TIMEOUT:-2400}
SUITE_TIMEOUT=${LOOPD_VM_SUITE_TIMEOUT:-1200}
BOOT_TIMEOUT=${LOOPD_VM_BOOT_TIMEOUT:-300}
CPUS=${LOOPD_VM_CPUS:-2}
MEMORY=${LOOPD_VM_MEMORY:-3G}

die() {
    echo "vm-test: ERROR: $*" >&2
    exit 1
}

# --- host prerequisites -------------------------------------------------------
# vm_kernel, vm_kernel_release, vm_kernel_has_modules.
# shellcheck source=scripts/vm-kernels.sh
. scripts/vm-kernels.sh
if [ -n "${LOOPD_VM_KERNEL:-}" ]; then
    kernel_names=("$LOOPD_VM_KERNEL")
else
    read -r -a kernel_names <<<"${LOOPD_VM_KERNELS:-6.12 newest}"
fi
[ "${#kernel_names[@]}" -gt 0 ] || die "LOOPD_VM_KERNELS names no kernel"
kernels=()
for n in "${kernel_names[@]}"; do
    k=$(vm_kernel "$n")
    [ -n "$k" ] && [ -r "$k" ] ||
        die "no readable kernel '$n' (6.12: /boot/vmlinuz-6.12*; newest: in ${VM_KERNELS_DIR}; run scripts/install-test-deps.sh, or set LOOPD_VM_KERNEL to a vmlinuz)"
    vm_kernel_has_modules "$(vm_kernel_release "$k")" ||
        die "kernel $k: no ublk_drv/nbd modules (or no modules.dep) in /lib/modules/$(vm_kernel_release "$k") (run scripts/install-test-deps.sh)"
    kernels+=("$k")
done
[ -x "$VNG" ] || die "virtme-ng not found at $VNG (run scripts/install-test-deps.sh)"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing (run scripts/install-test-deps.sh)"
command -v busybox >/dev/null || die "busybox missing (run scripts/install-test-deps.sh)"
[ "$(id -u)" -eq 0 ] || die "must run as root (the guest runs as the same user; its tests need root)"

# --- build --------------------------------------------------------------------
echo "== vm-test: build"
cargo build --release
mkdir -p "$OUT"

# The suites to run: every tests/kernel_*.rs, or those named on the command line.
suites=()
if [ "$#" -gt 0 ]; then
    suites=("$@")
else
    for f in tests/kernel_*.rs; do
        [ -e "$f" ] || continue
        suites+=("$(basename "$f" .rs)")
    done
fi
[ "${#suites[@]}" -gt 0 ] || die "no tests/kernel_*.rs suite found"
for i in "${!suites[@]}"; do
    s=${suites[$i]}
    # A short name (tls) means tests/kernel_tls.rs.
    [ -e "tests/$s.rs" ] || [ ! -e "tests/kernel_$s.rs" ] || suites[$i]=kernel_$s
    s=${suites[$i]}
    [ -e "tests/$s.rs" ] || die "no suite tests/$s.rs"
done

# Only the kernel suites: the feature changes the library's build, so building
# every test target with it would rebuild the whole host suite.
test_targets=()
for s in "${suites[@]}"; do
    test_targets+=(--test "$s")
done
FEATURES=vm-tests${LOOPD_VM_FEATURES:+,$LOOPD_VM_FEATURES}
cargo test --release --features "$FEATURES" --no-run --message-format=json-render-diagnostics "${test_targets[@]}" >"$OUT/build.json"

# Map each suite to the test binary cargo just built (from cargo's JSON messages).
declare -A bin_of=()
while IFS=$'\t' read -r name exe; do
    bin_of[$name]=$exe
done < <(python3 - "$OUT/build.json" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target") or {}
    if m.get("reason") == "compiler-artifact" and "test" in t.get("kind", []) and m.get("executable"):
        print(f"{t['name']}\t{m['executable']}")
EOF
)
for s in "${suites[@]}"; do
    [ -n "${bin_of[$s]:-}" ] || die "no test binary for suite $s (is tests/$s.rs there, with #![cfg(feature = \"vm-tests\")]?)"
done

# --- the VM runs: one per kernel ------------------------------------------------------
# Per kernel index i: run_dir[i] ($OUT/RELEASE: logs, exit statuses, seconds
# per suite, the guest's and the console's output), vm_pid[i] (the timeout
# that leads the VM's process group), vm_t0[i], vm_end[i], vm_rc[i], no_boot[i].
declare -a run_dir=() rel_of=() vm_pid=() vm_t0=() vm_end=() vm_rc=() no_boot=()

# start_vm I: writes the guest script for kernel I and boots it in the background.
start_vm() {
    local i=$1 kernel=${kernels[$1]} rel RUN GUEST s
    rel=$(vm_kernel_release "$kernel")
    # (A run with extra features, e.g. the memory backend's, keeps its own.)
    RUN=$OUT/$rel${LOOPD_VM_FEATURES:+-${LOOPD_VM_FEATURES//,/-}}
    rel_of[$i]=$rel
    run_dir[$i]=$RUN
    rm -rf "$RUN"
    mkdir -p "$RUN/logs" "$RUN/status" "$RUN/time" "$RUN/9p"
    GUEST=$RUN/guest.sh
    {
        echo '#!/bin/sh'
        echo "# Generated by scripts/vm-test.sh; runs inside the VM as root."
        echo "RUN='$RUN'"
        echo "ROOT='$ROOT'"
        echo "SUITES='${suites[*]}'"
        echo "TEST_ARGS='${LOOPD_VM_TEST_ARGS:-}'"
        echo "GUEST_ENV='${LOOPD_VM_ENV:-}'"
        echo "SUITE_TIMEOUT='$SUITE_TIMEOUT'"
        for s in "${suites[@]}"; do
            echo "BIN_$s='${bin_of[$s]}'"
        done
        cat <<'EOF'
exec >"$RUN/guest.log" 2>&1
echo "guest: kernel $(uname -r), $(nproc) cpus"
date +%s >"$RUN/booted"
for m in loop nbd ublk_drv tls; do
    if ! modprobe "$m"; then
        echo "kernel module $m cannot be loaded in the VM (kernel $(uname -r))" >"$RUN/setup-failed"
        exit 1
    fi
done
# Test scratch on a tmpfs (the shared root is read-only 9p), at a short path
# under the guest's own /run (a tmpfs virtme-ng mounts): the tests' Unix
# sockets live there, and a socket's path must fit in 108 bytes whatever the
# checkout's path is. 9p scratch for the tests that need a 9p directory.
SCRATCH=/run/loopd-vm-scratch
if ! mkdir -p "$SCRATCH" || ! mount -t tmpfs -o size=1200M,mode=1777 loopd-vm-scratch "$SCRATCH"; then
    echo "cannot mount a tmpfs on $SCRATCH" >"$RUN/setup-failed"
    exit 1
fi
export TMPDIR="$SCRATCH"
export LOOPD_VM_9P_DIR="$RUN/9p"
export RUST_BACKTRACE=1
# shellcheck disable=SC2163 # the variable holds NAME=VALUE
[ -z "$GUEST_ENV" ] || export "$GUEST_ENV"
# diagnose SUITE: what a suite that does not end is waiting for: the test it
# is in (its log's last lines), every process with its kernel wait channel,
# the kernel stacks of loopd's and the test binary's threads and of every
# thread in uninterruptible sleep, and the kernel's report of blocked tasks.
diagnose() {
    echo "== $1: running for $(($(date +%s) - start)) s; its log ends with:"
    tail -n 3 "$RUN/logs/$1.log"
    echo
    echo "== threads of loopd, of the test binary, and in uninterruptible sleep (D): pid/tid comm state wchan, then the kernel stack"
    # Shell built-ins only in the loop (a fork per thread is slow under TCG).
    for t in /proc/[0-9]*/task/[0-9]*; do
        st=
        pcomm=
        # (A thread that ended meanwhile has no files: skipped, silently.)
        {
            while read -r key val rest; do
                [ "$key" = State: ] && st=$val && break
            done <"$t/status"
            read -r pcomm <"${t%/task/*}/comm"
        } 2>/dev/null
        [ -n "$st" ] && [ -n "$pcomm" ] || continue
        case "$st:$pcomm" in
        D:* | *:loopd* | *:kernel_*) ;;
        *) continue ;;
        esac
        tid=${t##*/}
        pid=${t%/task/*}
        echo "-- ${pid#/proc/}/$tid $(cat "$t/comm" 2>/dev/null) ($pcomm) $st $(cat "$t/wchan" 2>/dev/null)"
        cat "$t/stack" 2>/dev/null | head -n 12
    done
    echo
    echo "== processes"
    ps -eo pid,ppid,stat,etimes,wchan:30,args 2>&1
    echo
    echo "== block devices, mounts"
    ls /sys/block 2>&1 | tr '\n' ' '
    echo
    findmnt -rn -o TARGET,SOURCE,FSTYPE 2>&1 | grep -v -e ' proc$' -e ' sysfs$' -e ' cgroup2$' | tail -n 30
    echo
    echo "== the kernel's blocked tasks (sysrq w) and its last messages"
    echo w >/proc/sysrq-trigger 2>/dev/null
    sleep 1
    dmesg | tail -n 150
}
cd "$ROOT"
for s in $SUITES; do
    eval "bin=\$BIN_$s"
    echo "guest: running $s"
    start=$(date +%s)
    rm -f "$RUN/suite-done"
    # The watcher: shortly before the suite's time is up, it writes what the
    # suite waits for to logs/SUITE.hang (the harness has no per-test limit,
    # so a hang shows only as the suite's timeout). It polls, bounded, and
    # ends within 2 s of the suite.
    diag_at=$((SUITE_TIMEOUT > 60 ? SUITE_TIMEOUT - 30 : SUITE_TIMEOUT / 2))
    (
        while [ ! -e "$RUN/suite-done" ] && [ "$(date +%s)" -lt $((start + diag_at)) ]; do
            sleep 2
        done
        [ -e "$RUN/suite-done" ] || diagnose "$s" >"$RUN/logs/$s.hang" 2>&1
    ) &
    watcher=$!
    # shellcheck disable=SC2086 # TEST_ARGS is split on purpose
    timeout --kill-after=10 "$SUITE_TIMEOUT" "$bin" --test-threads=1 $TEST_ARGS >"$RUN/logs/$s.log" 2>&1
    rc=$?
    : >"$RUN/suite-done"
    wait "$watcher"
    echo "guest: $s exited $rc after $(($(date +%s) - start)) s"
    # What a killed suite left on the scratch tmpfs (its temporary
    # directories: images, a Ceph cluster's block file) must not fill it
    # for the suites after it.
    rm -rf --one-file-system "${SCRATCH:?}"/* 2>/dev/null
    echo "$(($(date +%s) - start))" >"$RUN/time/$s"
    echo "$rc" >"$RUN/status/$s"
done
umount "$SCRATCH"
date +%s >"$RUN/finished"
EOF
    } >"$GUEST"
    chmod +x "$GUEST"

    echo "== vm-test: booting $kernel (TCG, $CPUS cpus, $MEMORY) for: ${suites[*]}"
    vm_t0[$i]=$(date +%s)
    vm_end[$i]=
    no_boot[$i]=
    # In the background, so that a guest that never starts is caught early;
    # timeout leads its own process group (vng, qemu), which stop_vms ends if
    # this script is interrupted.
    PATH=$(dirname "$VNG"):$PATH timeout --kill-after=30 "$TIMEOUT" \
        "$VNG" --run "$kernel" --disable-kvm --verbose --cpus "$CPUS" --memory "$MEMORY" \
        --rwdir "$RUN" --exec "$GUEST" </dev/null >"$RUN/console.log" 2>&1 &
    vm_pid[$i]=$!
}

stop_vms() {
    local p
    for p in "${vm_pid[@]}"; do
        kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null || true
    done
}

# wait_vms I...: until these VMs have exited; stops one whose guest did not
# start within BOOT_TIMEOUT.
wait_vms() {
    local i alive
    while :; do
        alive=0
        for i in "$@"; do
            [ -z "${vm_end[$i]}" ] || continue
            if ! kill -0 "${vm_pid[$i]}" 2>/dev/null; then
                vm_end[$i]=$(date +%s)
                continue
            fi
            alive=1
            if [ -z "${no_boot[$i]}" ] && [ ! -e "${run_dir[$i]}/booted" ] &&
                [ "$(date +%s)" -ge $((vm_t0[$i] + BOOT_TIMEOUT)) ]; then
                no_boot[$i]="the guest did not start its script within $BOOT_TIMEOUT s"
                kill -TERM -- "-${vm_pid[$i]}" 2>/dev/null || kill -TERM "${vm_pid[$i]}" 2>/dev/null || true
            fi
        done
        [ "$alive" -eq 1 ] || break
        sleep 1
    done
    for i in "$@"; do
        set +e
        wait "${vm_pid[$i]}"
        vm_rc[$i]=$?
        set -e
    done
}

# retry_unbooted I...: boots again, once, each of these VMs whose guest script
# never started (QEMU 7.2 under TCG has aborted now and then while the newest
# kernel set up its PCI devices: "msix_table_mmio_write: Assertion ... failed").
# Its first console log is kept as console-first-boot.log. A kernel that does
# not boot twice fails.
retry_unbooted() {
    local i again=()
    for i in "$@"; do
        [ ! -e "${run_dir[$i]}/booted" ] || continue
        echo "== vm-test: the VM on ${rel_of[$i]} did not boot (${no_boot[$i]:-"vng exited ${vm_rc[$i]}"}); its console:"
        tail -n 20 "${run_dir[$i]}/console.log" || true
        cp "${run_dir[$i]}/console.log" "$OUT/${rel_of[$i]}-console-first-boot.log" 2>/dev/null || true
        echo "== vm-test: booting it again, once"
        start_vm "$i"
        again+=("$i")
    done
    [ "${#again[@]}" -eq 0 ] || wait_vms "${again[@]}"
}

# why_failed RUN SUITE REL: appends to `digest` the lines that say why a suite
# failed (printed last, so they are in the tail of a long output): the end of
# its log (the test it was in, its panic), and for a suite that hung, the
# watcher's threads (state, wait channel, the first kernel frames) and the
# kernel's hung-task and blocked-task lines.
why_failed() {
    local RUN=$1 s=$2 rel=$3 f=$1/logs/$2.hang
    [ -s "$RUN/logs/$s.log" ] || return 0
    digest+=("---- why $s on $rel failed ($RUN/logs/$s.log): each failed test's panic, the result, or the log's end")
    mapfile -t -O "${#digest[@]}" digest < <(awk '
        /^---- .* stdout ----$/ { print; next }
        /panicked at/ { print; c = 6; next }
        c > 0 { print; c--; next }
        /^test result:/ { print; done = 1 }
        { last[NR % 3] = $0 }
        END { if (!done) for (i = NR - 2; i <= NR; i++) if (i > 0) print last[i % 3] }
    ' "$RUN/logs/$s.log" 2>/dev/null | head -n 60)
    [ -e "$f" ] || return 0
    digest+=("---- $s on $rel was still running near its time limit; what it waited for ($f, abridged)")
    mapfile -t -O "${#digest[@]}" digest < <(awk '
        /^== .*running for/ { p = 1 }
        /^== processes/ { p = 0 }
        /^== the kernel/ { k = 1; next }
        p && !/^== threads/ { if (/^-- /) n = 0; if (n++ < 6) print }
        k && /blocked for more than|task:.*state:D|INFO:|BUG|WARNING|Call Trace|^\[ *[0-9.]+\]  [a-z_]+\+0x/ { if (kn++ < 60) print }
    ' "$f")
}

# report_vm I: prints the logs of kernel I's run; appends what failed to
# `failed` and its lines to `summary`.
report_vm() {
    local i=$1 rel=${rel_of[$1]} RUN=${run_dir[$1]} vng_rc=${vm_rc[$1]} s st tm vm_wall boot_s
    vm_wall=$((vm_end[$i] - vm_t0[$i]))
    boot_s=-
    [ ! -e "$RUN/booted" ] || boot_s=$(($(cat "$RUN/booted") - vm_t0[$i]))
    echo "== vm-test: the VM on $rel exited ($vng_rc) after $vm_wall s (its script started after $boot_s s); logs in $RUN"
    summary+=("$(printf '%s: %s s of VM wall time (its script started after %s s)' "$rel" "$vm_wall" "$boot_s")")
    if [ ! -e "$RUN/booted" ]; then
        echo "---- console ($RUN/console.log, last 40 lines)"
        tail -n 40 "$RUN/console.log" || true
        failed+=("every suite on $rel: the VM did not boot: ${no_boot[$i]:-"vng exited $vng_rc"}, see $RUN/console.log")
        summary+=("  (did not boot)")
        return 0
    fi
    if [ -e "$RUN/setup-failed" ]; then
        cat "$RUN/guest.log" || true
        failed+=("every suite on $rel: VM setup failed: $(cat "$RUN/setup-failed"), see $RUN/guest.log")
        summary+=("  (setup failed)")
        return 0
    fi
    for s in "${suites[@]}"; do
        echo "---- $s on $rel ($RUN/logs/$s.log)"
        cat "$RUN/logs/$s.log" 2>/dev/null || echo "(no log)"
        if [ ! -e "$RUN/status/$s" ]; then
            failed+=("$s on $rel (no result: the VM stopped before it finished; see $RUN/guest.log, $RUN/console.log)")
            why_failed "$RUN" "$s" "$rel"
        elif [ "$(cat "$RUN/status/$s")" != 0 ]; then
            failed+=("$s on $rel (exit $(cat "$RUN/status/$s"))")
            why_failed "$RUN" "$s" "$rel"
        fi
    done
    echo "---- guest on $rel ($RUN/guest.log)"
    cat "$RUN/guest.log" || true
    if [ "$vng_rc" -eq 124 ]; then
        failed+=("the VM run on $rel (timed out after ${TIMEOUT} s)")
    fi
    if [ ! -e "$RUN/finished" ]; then
        # The VM ended (or was stopped) before its script did: the kernel's
        # last words (an oops, a panic, hung tasks) are on its console.
        digest+=("---- the VM on $rel ended before its script did (vng exit $vng_rc); the kernel's console ($RUN/console.log), its problems and last lines:")
        mapfile -t -O "${#digest[@]}" digest < <(grep -E -A 10 '\] (BUG:|Oops|Kernel panic|INFO: task .* blocked for more than|WARNING:|kernel BUG)' "$RUN/console.log" 2>/dev/null | head -n 60)
        mapfile -t -O "${#digest[@]}" digest < <(tail -n 15 "$RUN/console.log" 2>/dev/null)
    fi
    for s in "${suites[@]}"; do
        st=$(cat "$RUN/status/$s" 2>/dev/null || echo none)
        tm=$(cat "$RUN/time/$s" 2>/dev/null || echo -)
        case $st in 0) st=ok ;; none) st="no result" ;; *) st="FAILED (exit $st)" ;; esac
        summary+=("$(printf '  %-20s %5s s  %s' "$s" "$tm" "$st")")
    done
}

# CPU seconds (user + system) of this script's finished children: the VMs'
# qemu among them once reaped, into CHILD_CPU. (`times` must run in this
# shell: in a subshell it would count the subshell's children.)
children_cpu() {
    local f
    f=$(mktemp)
    times >"$f"
    CHILD_CPU=$(awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); sub("s", "", p[2]); t += p[1] * 60 + p[2] } printf "%d", t }' "$f")
    rm -f "$f"
}

PARALLEL=${LOOPD_VM_PARALLEL:-1}
trap stop_vms EXIT
trap 'stop_vms; exit 130' INT TERM
failed=()
summary=()
digest=()
T0=$(date +%s)
children_cpu
cpu0=$CHILD_CPU
if [ "$PARALLEL" = 1 ] && [ "${#kernels[@]}" -gt 1 ]; then
    # Both at once: under TCG one VM leaves much of two cores idle (boot,
    # single-threaded tools, waits), which the other fills.
    for i in "${!kernels[@]}"; do start_vm "$i"; done
    wait_vms "${!kernels[@]}"
    retry_unbooted "${!kernels[@]}"
    for i in "${!kernels[@]}"; do report_vm "$i"; done
else
    for i in "${!kernels[@]}"; do
        start_vm "$i"
        wait_vms "$i"
        retry_unbooted "$i"
        report_vm "$i"
    done
fi
trap - EXIT INT TERM
T1=$(date +%s)

children_cpu
cpu=$((CHILD_CPU - cpu0))
echo "== vm-test: results by kernel (seconds in the guest per suite); the VMs took $((T1 - T0)) s of wall time and $cpu s of CPU time$([ "$PARALLEL" = 1 ] && [ "${#kernels[@]}" -gt 1 ] && echo ", running side by side")"
printf '%s\n' "${summary[@]}"
[ "${#digest[@]}" -eq 0 ] || printf '%s\n' "${digest[@]}"
if [ "${#failed[@]}" -ne 0 ]; then
    printf 'vm-test: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "== vm-test: all ${#suites[@]} kernel-side suite(s) passed under ${#kernels[@]} kernel(s) in $((T1 - T0)) s (VM wall time)"
