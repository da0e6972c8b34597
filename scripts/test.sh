#!/usr/bin/env bash
# The project's full test run: tool install, formatting, lints, all tests.
# Used by CI (.ci/run) and by developers: `scripts/test.sh`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== test dependencies"
scripts/install-test-deps.sh

echo "== cargo fmt"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --all-targets -- -D warnings

echo "== cargo test (release)"
# --no-fail-fast: report failures from every test binary, not just the first.
cargo test --release --no-fail-fast

# ---------------------------------------------------------------------------
# FUZZ SMOKE STEP (to be added): a short, time-bounded fuzz run goes here.
# ---------------------------------------------------------------------------

echo "== all checks passed"
