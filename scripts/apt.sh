# Sourced by the install scripts (scripts/install-test-deps.sh,
# scripts/install-vm-deps.sh, bench/install-deps.sh): `apt_get ARGS…` runs
# apt-get and waits — up to $LOOPD_APT_WAIT seconds, default 600 — for
# another apt or dpkg (unattended-upgrades, a second install, `apt update` in
# another terminal) to let go of its locks, instead of failing at once.
# dpkg's locks are waited for by apt itself (DPkg::Lock::Timeout); the package
# lists' lock, which `apt-get update` takes and that option does not cover,
# by trying again every 5 s. The caller runs under `set -o pipefail`.

apt_get() {
    local wait=${LOOPD_APT_WAIT:-600}
    local deadline=$((SECONDS + wait)) log rc
    log=$(mktemp)
    while :; do
        rc=0
        apt-get -o DPkg::Lock::Timeout="$wait" "$@" 2>&1 | tee "$log" || rc=$?
        if [ "$rc" -ne 0 ] && grep -q 'Could not get lock' "$log" && [ "$SECONDS" -lt "$deadline" ]; then
            echo "apt: another apt or dpkg holds its lock; trying again in 5 s" >&2
            sleep 5
            continue
        fi
        rm -f "$log"
        return "$rc"
    done
}
