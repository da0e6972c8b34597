#!/usr/bin/env bash
# The project's full test run: tool install, formatting, lints, all tests.
# Used by CI (.ci/run) and by developers: `scripts/test.sh`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Each stage's seconds, printed at the end (also when a stage fails): the
# test command must stay within CI's time (under 60 min), and this says where
# it goes.
STAGE= STAGE_T0=$SECONDS STAGE_TIMES=()
stage_done() {
    [ -n "$STAGE" ] || return 0
    STAGE_TIMES+=("$(printf '%6d s  %s' $((SECONDS - STAGE_T0)) "${STAGE%% (*}")")
    STAGE=
}
stage() {
    stage_done
    STAGE=$1 STAGE_T0=$SECONDS
    echo "== $1"
}
# report_stages [done]: with `done`, every stage finished (none stopped).
report_stages() {
    local failed=$STAGE
    [ "${1:-}" != done ] || failed=
    stage_done
    echo "== seconds per stage (${SECONDS} s in all${failed:+; stopped in: ${failed%% (*}})"
    printf '%s\n' "${STAGE_TIMES[@]}"
}
trap '[ -z "$STAGE" ] || report_stages' EXIT

stage "test dependencies"
scripts/install-test-deps.sh

stage "cargo fmt"
cargo fmt --all -- --check

stage "bench unit tests (bench/tests: the harness's parsing, statistics, report and RESULTS.md layout; ~1 s)"
/usr/bin/python3 -m unittest discover -s bench/tests

stage "cargo clippy"
cargo clippy --all-targets -- -D warnings
# vm-tests and test-backend (the memory backend) together: one run lints both.
cargo clippy --all-targets --features vm-tests,test-backend -- -D warnings

stage "ceph test cluster (scripts/ceph-cluster.sh: ONE for the host tests below; LOOPD_TEST_CEPH_DIR)"
# The RBD tests (tests/common/ceph.rs) use it instead of starting one per test
# binary. Stopped by PID on exit (also on failure or Ctrl-C; should this script
# be killed, the cluster's watcher stops it: --owner), and after the host tests.
CEPH_DIR=$(mktemp -d "${TMPDIR:-/tmp}/loopd-test-ceph.XXXXXX")
stop_ceph() {
    [ -n "${CEPH_DIR:-}" ] || return 0
    scripts/ceph-cluster.sh stop "$CEPH_DIR" && rm -rf "$CEPH_DIR"
    CEPH_DIR=
}
trap 'stop_ceph; [ -z "$STAGE" ] || report_stages' EXIT
trap 'exit 130' INT TERM
ceph_t0=$(date +%s%N)
scripts/ceph-cluster.sh start "$CEPH_DIR" --owner $$
echo "ceph test cluster: started in $((($(date +%s%N) - ceph_t0) / 1000000)) ms in $CEPH_DIR"
export LOOPD_TEST_CEPH_DIR=$CEPH_DIR

stage "cargo test (release)"
# --no-fail-fast: report failures from every test binary, not just the first.
cargo test --release --no-fail-fast

stage "over the test-only memory backend (feature test-backend, LOOPD_TEST_BACKEND=mem)"
# The backend seam's second implementation (src/backing/mem.rs): the engine
# oracle, the backend's own tests, and NBD end-to-end suites run again with
# every image served from memory by the backend's own thread, completing
# through an eventfd on the reactor's ring. (This relinks target/release/loopd
# with the feature; the VM run below builds it again without.)
cargo test --release --features test-backend --no-fail-fast --lib backing::mem
cargo test --release --features test-backend --no-fail-fast --test engine_oracle memory_backend
# Skipped there, and why: what they assert is a file's capability the memory
# backend does not have by design (an allocation map: qemu_img_map_sparse,
# nbdsh_commands_and_flags; bounced and spliced paths: nbdsh_unaligned_ops_*,
# fsx_over_nbdfuse_direct; O_DIRECT open flags: cache_mode_open_flags; a 1 TiB
# image: create_sparse_image_option; blocks allocated by fallocate and a 4 EiB
# preallocation the filesystem refuses: create_preallocate_*).
LOOPD_TEST_BACKEND=mem cargo test --release --features test-backend --no-fail-fast \
    --test e2e_qemu --test e2e_libnbd --test e2e_fio --test e2e_unaligned \
    --test e2e_lifecycle --test e2e_detach -- \
    --skip qemu_img_map_sparse --skip nbdsh_commands_and_flags \
    --skip nbdsh_unaligned_ops_match_a_model --skip fsx_over_nbdfuse_direct \
    --skip cache_mode_open_flags --skip create_sparse_image_option \
    --skip create_preallocate_allocates_every_block_or_leaves_nothing

# The VM's tests cannot reach it (the guest has a loopback of its own;
# tests/kernel_rbd.rs starts a cluster of its own inside the guest), nor does
# anything after this: stop it.
stop_ceph
unset LOOPD_TEST_CEPH_DIR

stage "kernel-side tests (scripts/vm-test.sh: every tests/kernel_*.rs, one VM boot per kernel: 6.12 and the newest of trixie-backports)"
scripts/vm-test.sh

stage "ublk data tests over the test-only memory backend, from a checkout under /tmp (one more VM boot, the newest kernel only, ~4 min)"
# The memory backend sits below the engine: the kernel sees the same ublk
# frontend as with a file, and that runs under both kernels above. Under the
# newest kernel: its ublk has what 6.12 lacks for request buffers (zero copy,
# automatic buffer registration), which is where a backend could see them
# differently.
# Run from this checkout bind-mounted under /tmp: the guest mounts a fresh
# /tmp of its own, and scripts/vm-test.sh must work from a clone there too
# (a user trying loopd clones into /tmp). Same files, so nothing is copied;
# cargo rebuilds only this crate, which the feature change rebuilds anyway.
TMP_CHECKOUT=$(mktemp -d /tmp/loopd-checkout.XXXXXX)
mount --bind "$PWD" "$TMP_CHECKOUT"
unmount_tmp_checkout() {
    [ -n "${TMP_CHECKOUT:-}" ] || return 0
    umount "$TMP_CHECKOUT" && rmdir "$TMP_CHECKOUT"
    TMP_CHECKOUT=
}
trap 'unmount_tmp_checkout; stop_ceph; [ -z "$STAGE" ] || report_stages' EXIT
(cd "$TMP_CHECKOUT" &&
    LOOPD_VM_KERNEL=newest LOOPD_VM_FEATURES=test-backend LOOPD_VM_ENV=LOOPD_TEST_BACKEND=mem \
        LOOPD_VM_TEST_ARGS="ublk_fio_verifies ublk_filesystem ublk_read_only" \
        scripts/vm-test.sh kernel_blockdev)
unmount_tmp_checkout
# Back to the binary users get (the run above linked target/release/loopd
# with the feature).
cargo build --release

stage "systemd units under systemd (scripts/vm-systemd-test.sh: socket activation, reload, stop, in the VM; under both kernels)"
scripts/vm-systemd-test.sh

stage "fuzz smoke (every parser of untrusted bytes, ${FUZZ_SECONDS:-20}s each)"
scripts/fuzz-smoke.sh "${FUZZ_SECONDS:-20}"

stage "bench smoke (bench/run --quick: every benchmark case runs; no speed is checked)"
bench/install-deps.sh
bench/run --quick

report_stages done
echo "== all checks passed"
