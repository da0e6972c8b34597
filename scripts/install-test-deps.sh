#!/usr/bin/env bash
# Installs the external tools the end-to-end tests need (Debian/Ubuntu), and
# what the kernel-side tests (scripts/vm-test.sh) need (Debian 12): a 6.12
# kernel from bookworm-backports, QEMU, busybox-static and virtme-ng.
# Idempotent: does nothing when every tool is already present.
set -euo pipefail

# man-db and systemd: tests/e2e_install.rs (man -l, systemd-analyze verify) and
# scripts/vm-systemd-test.sh (the host's systemd runs the units in the VM).
# ceph-mon, ceph-osd, ceph-common: the throwaway cluster of the RBD tests
# (scripts/ceph-cluster.sh: ceph-mon, ceph-osd, ceph, rbd, ceph-authtool,
# monmaptool); librbd1 and librados2: what loopd's rbd: backend loads at run
# time (and fio's rbd engine links). No -dev package: loopd binds them itself.
PACKAGES=(qemu-utils fio nbdkit libnbd-bin python3-libnbd nbd-client e2fsprogs util-linux fdisk openssl
    fuse3 man-db systemd curl iproute2 ceph-mon ceph-osd ceph-common librbd1 librados2)
TOOLS=(qemu-io qemu-img qemu-nbd fio nbdkit nbdinfo nbdcopy nbdsh nbd-client nbdfuse
    mkfs.ext4 e2fsck fstrim sfdisk openssl fusermount3 man systemd-analyze systemctl
    systemd-socket-activate curl ss ceph-mon ceph-osd ceph rbd ceph-authtool monmaptool)
# Shared libraries checked by name (ldconfig's cache).
LIBS=(librbd.so.1 librados.so.2)
# apt_get: waits for another apt or dpkg to let go of its locks.
# shellcheck source=scripts/apt.sh
. "$(dirname "${BASH_SOURCE[0]}")/apt.sh"
# fsx (asomers' fsx-rs, crates.io), pinned; installed into /usr/local/bin.
FSX_VERSION=0.3.2

# fsx from crates.io: the version pinned above, unless it is already there.
install_fsx() {
    if fsx --version 2>/dev/null | grep -qx "fsx ${FSX_VERSION}"; then
        return 0
    fi
    if ! command -v cargo >/dev/null 2>&1; then
        echo "install-test-deps: ERROR: cargo is needed to install fsx ${FSX_VERSION}" >&2
        exit 1
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-test-deps: ERROR: not root; install fsx first:" >&2
        echo "    cargo install fsx --version ${FSX_VERSION} --locked --root /usr/local" >&2
        exit 1
    fi
    echo "install-test-deps: installing fsx ${FSX_VERSION}"
    cargo install fsx --version "${FSX_VERSION}" --locked --root /usr/local
    if ! fsx --version 2>/dev/null | grep -qx "fsx ${FSX_VERSION}"; then
        echo "install-test-deps: ERROR: fsx ${FSX_VERSION} is not on PATH after install" \
            "(/usr/local/bin)" >&2
        exit 1
    fi
}

# promtool (tests/e2e_metrics.rs checks a scrape with `promtool check metrics`):
# taken out of Debian's prometheus package without installing it (which would
# start a Prometheus server), into /usr/local/bin.
install_promtool() {
    if command -v promtool >/dev/null 2>&1; then
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-test-deps: ERROR: not root; install promtool first (from the" \
            "prometheus package: apt-get download prometheus && dpkg-deb -x ...)" >&2
        exit 1
    fi
    echo "install-test-deps: installing promtool (from the prometheus .deb)"
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download prometheus && dpkg-deb -x prometheus_*.deb x)
    install -m 755 "$tmp/x/usr/bin/promtool" /usr/local/bin/promtool
    rm -rf "$tmp"
    command -v promtool >/dev/null 2>&1 || {
        echo "install-test-deps: ERROR: promtool is not on PATH after install" >&2
        exit 1
    }
}

# /usr/bin first: nbdsh runs `python3`, which must be the system Python that
# has the `nbd` module (not, say, a pyenv shim).
export PATH="/usr/bin:/usr/sbin:/bin:/sbin:${PATH}"

missing=()
for t in "${TOOLS[@]}"; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
done
if ! /usr/bin/python3 -c 'import nbd' >/dev/null 2>&1; then
    missing+=("python3 module nbd")
fi
if ! fio --enghelp=nbd >/dev/null 2>&1; then
    missing+=("fio nbd engine")
fi
if ! fio --enghelp=rbd >/dev/null 2>&1; then
    missing+=("fio rbd engine")
fi
for l in "${LIBS[@]}"; do
    ldconfig -p | grep -F "$l " >/dev/null || missing+=("$l")
done

if [ "${#missing[@]}" -eq 0 ]; then
    install_fsx
    install_promtool
    echo "install-test-deps: all test tools present"
    exec "$(dirname "${BASH_SOURCE[0]}")/install-vm-deps.sh"
fi

echo "install-test-deps: missing: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
    echo "install-test-deps: ERROR: not root; install these packages first:" >&2
    echo "    apt-get install -y ${PACKAGES[*]}" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt_get update
# nbdfuse ships in libnbd-bin up to Debian 12, in a package of its own later.
if apt-cache show nbdfuse >/dev/null 2>&1; then
    PACKAGES+=(nbdfuse)
fi
apt_get install -y --no-install-recommends "${PACKAGES[@]}"

# Check again, so a package that did not provide a tool fails here, clearly.
still=()
for t in "${TOOLS[@]}"; do
    command -v "$t" >/dev/null 2>&1 || still+=("$t")
done
/usr/bin/python3 -c 'import nbd' >/dev/null 2>&1 || still+=("python3 module nbd")
fio --enghelp=nbd >/dev/null 2>&1 || still+=("fio nbd engine")
fio --enghelp=rbd >/dev/null 2>&1 || still+=("fio rbd engine (Debian's fio links librbd)")
for l in "${LIBS[@]}"; do
    ldconfig -p | grep -F "$l " >/dev/null || still+=("$l")
done
if [ "${#still[@]}" -ne 0 ]; then
    echo "install-test-deps: ERROR: still missing after install: ${still[*]}" >&2
    exit 1
fi
echo "install-test-deps: installed ${PACKAGES[*]}"
install_fsx
install_promtool
exec "$(dirname "${BASH_SOURCE[0]}")/install-vm-deps.sh"
