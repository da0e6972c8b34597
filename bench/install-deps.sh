#!/usr/bin/env bash
# Installs what bench/run needs (Debian/Ubuntu), only when something is missing:
# fio (with its nbd engine), nbdkit, qemu-nbd, nbdinfo, losetup/fincore, and
# matplotlib for Debian's /usr/bin/python3 (which bench/run runs under), openssl
# and setpriv for bench/tls; for bench/rbd: the Ceph daemons and CLIs of the
# throwaway cluster (ceph-mon ceph-osd ceph-common), fio's rbd engine, and
# QEMU's rbd driver (qemu-block-extra of the installed qemu-utils' version:
# from the suite that version came from, bookworm-backports for QEMU 10.0);
# for bench/vm-rbd: Ceph's rbd-nbd (Debian package rbd-nbd).
set -euo pipefail
export PATH="/usr/bin:/usr/sbin:/bin:/sbin:${PATH}"

PACKAGES=(fio nbdkit qemu-utils libnbd-bin python3-libnbd python3-matplotlib util-linux openssl
    ceph-mon ceph-osd ceph-common rbd-nbd)
# apt_get: waits for another apt or dpkg to let go of its locks.
# shellcheck source=scripts/apt.sh
. "$(dirname "${BASH_SOURCE[0]}")/../scripts/apt.sh"
missing=()
for t in fio nbdkit qemu-nbd nbdinfo losetup fincore findmnt setpriv openssl ceph-mon ceph-osd ceph rbd rbd-nbd; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
done
/usr/bin/python3 -c "import matplotlib" >/dev/null 2>&1 || missing+=("python3-matplotlib")
/usr/bin/python3 -c "import nbd" >/dev/null 2>&1 || missing+=("python3-libnbd")
if command -v fio >/dev/null 2>&1 && ! fio --enghelp=nbd >/dev/null 2>&1; then
    missing+=("fio nbd engine")
fi
if command -v fio >/dev/null 2>&1 && ! fio --enghelp=rbd >/dev/null 2>&1; then
    missing+=("fio rbd engine")
fi

# QEMU's rbd driver is a module (block-rbd.so) in qemu-block-extra, which must
# be the installed qemu-utils' version (`qemu-img --help` lists rbd either way).
qemu_rbd_ok() {
    local v
    v=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null) || return 1
    [ "$(dpkg-query -W -f='${Version} ${Status}' qemu-block-extra 2>/dev/null)" = "$v install ok installed" ]
}
install_qemu_block_extra() {
    qemu_rbd_ok && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "bench/install-deps: ERROR: not root; install qemu-block-extra of the installed" \
            "qemu-utils' version (QEMU's rbd driver, for bench/rbd's qemu-nbd)" >&2
        exit 1
    fi
    local v suite
    v=$(dpkg-query -W -f='${Version}' qemu-utils)
    suite=$(apt-cache madison qemu-block-extra |
        awk -F' [|] ' -v v="$v" '$2 == v { split($3, a, " "); print a[2]; exit }')
    if [ -z "$suite" ]; then
        echo "bench/install-deps: ERROR: no apt source offers qemu-block-extra $v (the installed" \
            "qemu-utils' version)" >&2
        exit 1
    fi
    suite=${suite%%/*}
    echo "bench/install-deps: installing qemu-block-extra $v from $suite"
    DEBIAN_FRONTEND=noninteractive apt_get install -y --no-install-recommends \
        -t "$suite" "qemu-block-extra=$v"
    qemu_rbd_ok || {
        echo "bench/install-deps: ERROR: qemu-block-extra is not qemu-utils' version after installing it" >&2
        exit 1
    }
}

if [ "${#missing[@]}" -eq 0 ]; then
    install_qemu_block_extra
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
apt_get update
apt_get install -y --no-install-recommends "${PACKAGES[@]}"
/usr/bin/python3 -c 'import matplotlib' >/dev/null
fio --enghelp=nbd >/dev/null
fio --enghelp=rbd >/dev/null
install_qemu_block_extra
echo "bench/install-deps: installed ${PACKAGES[*]}"
