#!/usr/bin/env bash
# Short, time-bounded fuzz run of every cargo-fuzz target in fuzz/.
#
#   scripts/fuzz-smoke.sh [SECONDS_PER_TARGET]     (default 20; or FUZZ_SECONDS)
#
# Installs cargo-fuzz if it is missing (needs the nightly toolchain, which
# libFuzzer's sanitizer flags require). Each target starts from the seeds in
# fuzz/seeds/<target> plus whatever fuzz/corpus/<target> holds from earlier runs.
# Exits non-zero if any target crashes; the crashing input is left in
# fuzz/artifacts/<target>/ and its path printed by libFuzzer. Runs as many
# targets at once as there are cores (libFuzzer uses one; FUZZ_JOBS to choose),
# each one's output shown whole, in order.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

SECONDS_PER_TARGET="${1:-${FUZZ_SECONDS:-20}}"
TOOLCHAIN="${FUZZ_TOOLCHAIN:-nightly}"

if ! rustup run "$TOOLCHAIN" rustc --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing the $TOOLCHAIN toolchain"
    rustup toolchain install "$TOOLCHAIN" --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

targets=$(cargo "+$TOOLCHAIN" fuzz list --fuzz-dir fuzz)
echo "fuzz-smoke: building targets"
if ! cargo "+$TOOLCHAIN" fuzz build --fuzz-dir fuzz; then
    echo "fuzz-smoke: ERROR: the fuzz targets do not build" >&2
    exit 2
fi

JOBS=${FUZZ_JOBS:-$(nproc)}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/loopd-fuzz-smoke.XXXXXX")
trap 'rm -rf "$LOGS"' EXIT

# One target, its output into $LOGS/<target>.log; exit status as cargo fuzz's.
fuzz_one() {
    local t=$1 seeds=()
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    [ -d "fuzz/seeds/$t" ] && seeds=("fuzz/seeds/$t")
    # -rss_limit_mb: a target that allocates without bound fails loudly.
    cargo "+$TOOLCHAIN" fuzz run --fuzz-dir fuzz "$t" "fuzz/corpus/$t" "${seeds[@]}" -- \
        -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -print_final_stats=1 \
        >"$LOGS/$t.log" 2>&1
}

crashed=()
broken=()
# In batches of $JOBS: start them, wait for each, then show each one's output.
batch=()
run_batch() {
    local t pid rc
    declare -A pid_of=() before=()
    for t in "${batch[@]}"; do
        echo "== fuzz $t for ${SECONDS_PER_TARGET}s"
        mkdir -p "fuzz/artifacts/$t"
        before[$t]=$(find "fuzz/artifacts/$t" -type f | wc -l)
        fuzz_one "$t" &
        pid_of[$t]=$!
    done
    for t in "${batch[@]}"; do
        pid=${pid_of[$t]}
        rc=0
        wait "$pid" || rc=$?
        echo "---- fuzz $t (exit $rc)"
        cat "$LOGS/$t.log"
        if [ "$rc" -ne 0 ]; then
            if [ "$(find "fuzz/artifacts/$t" -type f | wc -l)" -gt "${before[$t]}" ]; then
                crashed+=("$t")
            else
                broken+=("$t")
            fi
        fi
    done
    batch=()
}
for t in $targets; do
    batch+=("$t")
    [ "${#batch[@]}" -lt "$JOBS" ] || run_batch
done
[ "${#batch[@]}" -eq 0 ] || run_batch

if [ "${#crashed[@]}" -ne 0 ]; then
    echo "fuzz-smoke: CRASHED: ${crashed[*]} (inputs in fuzz/artifacts/<target>/;" \
        "replay with: cargo +$TOOLCHAIN fuzz run --fuzz-dir fuzz <target> <input>)" >&2
fi
if [ "${#broken[@]}" -ne 0 ]; then
    echo "fuzz-smoke: FAILED without a crash input (build or setup error): ${broken[*]}" >&2
fi
if [ "${#crashed[@]}" -ne 0 ] || [ "${#broken[@]}" -ne 0 ]; then
    exit 1
fi
echo "fuzz-smoke: all targets ran ${SECONDS_PER_TARGET}s without a crash"
