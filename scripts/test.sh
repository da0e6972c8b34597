#!/usr/bin/env bash
# The project's full test run: tool install, formatting, lints, all tests.
# Used by CI (.ci/run) and by developers: `scripts/test.sh`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== test dependencies"
scripts/install-test-deps.sh

echo "== cargo fmt"
cargo fmt --all -- --check

echo "== bench unit tests (bench/tests: the harness's parsing, statistics, report and RESULTS.md layout; ~1 s)"
/usr/bin/python3 -m unittest discover -s bench/tests

echo "== cargo clippy"
cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --features vm-tests -- -D warnings

echo "== cargo test (release)"
# --no-fail-fast: report failures from every test binary, not just the first.
cargo test --release --no-fail-fast

echo "== kernel-side tests (scripts/vm-test.sh: one VM boot, every tests/kernel_*.rs)"
scripts/vm-test.sh

echo "== systemd units under systemd (scripts/vm-systemd-test.sh: socket activation, reload, stop, in the VM)"
scripts/vm-systemd-test.sh

echo "== fuzz smoke (every parser of untrusted bytes, ${FUZZ_SECONDS:-20}s each)"
scripts/fuzz-smoke.sh "${FUZZ_SECONDS:-20}"

echo "== bench smoke (bench/run --quick: every benchmark case runs; no speed is checked)"
bench/install-deps.sh
bench/run --quick

echo "== all checks passed"
