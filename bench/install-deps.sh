#!/usr/bin/env bash
# Installs what bench/run needs (Debian/Ubuntu), only when something is missing:
# fio (with its nbd engine), nbdkit, qemu-nbd, nbdinfo, losetup/fincore, and
# matplotlib for Debian's /usr/bin/python3 (which bench/run runs under), openssl
# and setpriv for bench/tls.
set -euo pipefail
export PATH="/usr/bin:/usr/sbin:/bin:/sbin:${PATH}"

PACKAGES=(fio nbdkit qemu-utils libnbd-bin python3-libnbd python3-matplotlib util-linux openssl)
missing=()
for t in fio nbdkit qemu-nbd nbdinfo losetup fincore findmnt setpriv openssl; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
done
/usr/bin/python3 -c "import matplotlib" >/dev/null 2>&1 || missing+=("python3-matplotlib")
/usr/bin/python3 -c "import nbd" >/dev/null 2>&1 || missing+=("python3-libnbd")
if command -v fio >/dev/null 2>&1 && ! fio --enghelp=nbd >/dev/null 2>&1; then
    missing+=("fio nbd engine")
fi

if [ "${#missing[@]}" -eq 0 ]; then
    echo "bench/install-deps: all benchmark tools present"
    exit 0
fi
echo "bench/install-deps: missing: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
    echo "bench/install-deps: ERROR: not root; install these packages first:" >&2
    echo "    apt-get install -y ${PACKAGES[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${PACKAGES[@]}"
/usr/bin/python3 -c 'import matplotlib' >/dev/null
fio --enghelp=nbd >/dev/null
echo "bench/install-deps: installed ${PACKAGES[*]}"
