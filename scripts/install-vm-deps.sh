#!/usr/bin/env bash
# Installs what scripts/vm-test.sh needs to boot a kernel with ublk_drv and nbd
# under QEMU (TCG; no KVM needed), on Debian 12 ("bookworm"), as root:
#   - the bookworm-backports apt source (a deb822 file),
#   - linux-image-amd64 from bookworm-backports (6.12, with ublk_drv and nbd),
#   - qemu-system-x86 from the same suite as the installed qemu-utils (so apt
#     never replaces qemu-utils with another version),
#   - busybox-static, python3-venv,
#   - virtme-ng (pinned) in a virtualenv, $LOOPD_VNG_VENV (default /opt/loopd-vng).
# Called by scripts/install-test-deps.sh. Idempotent: does nothing when all of
# it is present; checks again after installing and fails clearly.
set -euo pipefail

export PATH="/usr/bin:/usr/sbin:/bin:/sbin:${PATH}"

VENV=${LOOPD_VNG_VENV:-/opt/loopd-vng}
VNG_VERSION=1.42
BACKPORTS_LIST=/etc/apt/sources.list.d/bookworm-backports.sources

# apt_get: waits for another apt or dpkg to let go of its locks.
# shellcheck source=scripts/apt.sh
. "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

say() { echo "install-vm-deps: $*"; }
die() {
    echo "install-vm-deps: ERROR: $*" >&2
    exit 1
}

# The newest installed 6.12 kernel, or nothing.
newest_kernel() {
    # (ls fails when there is none: not an error here, under pipefail.)
    { ls -1 /boot/vmlinuz-6.12* 2>/dev/null || true; } | sort -V | tail -n 1
}

# Whether kernel image $1 has its ublk_drv and nbd modules installed.
kernel_has_modules() {
    local rel
    rel=$(basename "$1")
    rel=${rel#vmlinuz-}
    compgen -G "/lib/modules/$rel/kernel/drivers/block/ublk_drv.ko*" >/dev/null &&
        compgen -G "/lib/modules/$rel/kernel/drivers/block/nbd.ko*" >/dev/null
}

installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

vng_ok() {
    "$VENV/bin/vng" --version 2>/dev/null | grep -qF "$VNG_VERSION"
}

check() {
    missing=()
    local k
    k=$(newest_kernel)
    if [ -z "$k" ]; then
        missing+=("a 6.12 kernel (/boot/vmlinuz-6.12*)")
    elif ! kernel_has_modules "$k"; then
        missing+=("ublk_drv/nbd modules for $k")
    fi
    command -v qemu-system-x86_64 >/dev/null 2>&1 || missing+=(qemu-system-x86)
    installed busybox-static || missing+=(busybox-static)
    vng_ok || missing+=("virtme-ng $VNG_VERSION in $VENV")
}

check
if [ "${#missing[@]}" -eq 0 ]; then
    say "VM test tools present (kernel $(newest_kernel), virtme-ng $VNG_VERSION in $VENV)"
    exit 0
fi
say "missing: ${missing[*]}"
[ "$(id -u)" -eq 0 ] || die "not root; run this script as root to install: ${missing[*]}"

# shellcheck disable=SC1091 # the system's own file
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ "$codename" = bookworm ] ||
    die "the VM setup is written for Debian 12 (bookworm), this is '${codename:-unknown}': install a kernel with ublk_drv and nbd (6.x), qemu-system-x86, busybox-static and virtme-ng $VNG_VERSION (in $VENV) by hand"

export DEBIAN_FRONTEND=noninteractive

# 1. The bookworm-backports suite, unless some source already names it.
if ! grep -rqs --include='*.list' --include='*.sources' 'bookworm-backports' \
    /etc/apt/sources.list /etc/apt/sources.list.d/; then
    say "adding $BACKPORTS_LIST"
    cat >"$BACKPORTS_LIST" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi
apt_get update

# 2. The kernel: the newest linux-image-amd64 from backports (6.12 today).
k=$(newest_kernel)
if [ -z "$k" ] || ! kernel_has_modules "$k"; then
    apt_get install -y --no-install-recommends -t bookworm-backports linux-image-amd64
fi

# 3. QEMU from the suite the installed qemu-utils came from: the installed
#    version's line in `apt-cache madison` names its suite. A qemu-utils that no
#    suite offers any more (installed by hand) cannot be matched: say so.
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    qemu_args=(qemu-system-x86)
    if installed qemu-utils; then
        v=$(dpkg-query -W -f='${Version}' qemu-utils)
        suite=$(apt-cache madison qemu-utils |
            awk -F' [|] ' -v v="$v" '$2 == v { split($3, a, " "); print a[2]; exit }')
        [ -n "$suite" ] ||
            die "qemu-utils $v is installed but no apt source offers it; install qemu-system-x86 $v by hand"
        suite=${suite%%/*}
        say "qemu-utils $v is from $suite: installing qemu-system-x86 $v from it"
        qemu_args=(-t "$suite" "qemu-system-x86=$v")
    fi
    apt_get install -y --no-install-recommends "${qemu_args[@]}"
    if [ -n "${v:-}" ] && [ "$(dpkg-query -W -f='${Version}' qemu-utils)" != "$v" ]; then
        die "installing qemu-system-x86 changed qemu-utils from $v to $(dpkg-query -W -f='${Version}' qemu-utils)"
    fi
fi

# 4. busybox-static (virtme-ng's initramfs) and venv support.
installed busybox-static || apt_get install -y --no-install-recommends busybox-static
python3 -c 'import ensurepip' >/dev/null 2>&1 || apt_get install -y --no-install-recommends python3-venv

# 5. virtme-ng, pinned, in its own virtualenv.
if ! vng_ok; then
    [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install --disable-pip-version-check -q "virtme-ng==$VNG_VERSION"
fi

check
[ "${#missing[@]}" -eq 0 ] || die "still missing after install: ${missing[*]}"
say "installed: kernel $(newest_kernel), qemu-system-x86, busybox-static, virtme-ng $VNG_VERSION in $VENV"
