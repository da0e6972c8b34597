#!/usr/bin/env bash
# Installs what scripts/vm-test.sh needs to boot a kernel with ublk_drv and nbd
# under QEMU (TCG; no KVM needed), on Debian 12 ("bookworm"), as root:
#   - the bookworm-backports apt source (a deb822 file),
#   - linux-image-amd64 from bookworm-backports (6.12, with ublk_drv and nbd),
#   - the newest kernel of trixie-backports (7.3.4 today), chosen here: the
#     highest linux-binary-RELEASE-amd64 (sort -V) that has its
#     linux-modules-RELEASE-amd64, downloaded through a private apt directory
#     ($LOOPD_VM_KERNELS_DIR/apt: its own sources.list, lists and cache; the
#     system's apt sources are not changed), unpacked with dpkg-deb -x (not
#     installed) into $LOOPD_VM_KERNELS_DIR/RELEASE (default
#     /opt/loopd-vm-kernels), its modules linked as /lib/modules/RELEASE and
#     indexed with depmod; scripts/vm-kernels.sh says where it is. A kernel
#     already there is kept; once a day (LOOPD_VM_KERNEL_RECHECK hours, default
#     24) the suite is looked at again, a newer kernel replaces it, and when the
#     look fails (no network) the one there is used, with a warning,
#   - qemu-system-x86 from the same suite as the installed qemu-utils (so apt
#     never replaces qemu-utils with another version),
#   - busybox-static, python3-venv,
#   - virtme-ng (pinned) in a virtualenv, $LOOPD_VNG_VENV (default /opt/loopd-vng).
# Called by scripts/install-test-deps.sh. Idempotent: does nothing when all of
# it is present; checks again after installing and fails clearly. Waits for
# another apt (the system's, or another run of this script on the kernels'
# directory) to let go of its locks, up to $LOOPD_APT_WAIT s (scripts/apt.sh).
set -euo pipefail

export PATH="/usr/bin:/usr/sbin:/bin:/sbin:${PATH}"

VENV=${LOOPD_VNG_VENV:-/opt/loopd-vng}
VNG_VERSION=1.42
BACKPORTS_LIST=/etc/apt/sources.list.d/bookworm-backports.sources

# apt_get: waits for another apt or dpkg to let go of its locks.
# shellcheck source=scripts/apt.sh
. "$(dirname "${BASH_SOURCE[0]}")/apt.sh"
# vm_kernel, vm_kernel_release, vm_kernel_has_modules, VM_KERNELS_DIR.
# shellcheck source=scripts/vm-kernels.sh
. "$(dirname "${BASH_SOURCE[0]}")/vm-kernels.sh"

# The newest kernel: from this suite, this flavour (the VM is x86-64).
NEWEST_SUITE=trixie-backports
NEWEST_FLAVOUR=amd64
RECHECK_HOURS=${LOOPD_VM_KERNEL_RECHECK:-24}
KAPT=$VM_KERNELS_DIR/apt

say() { echo "install-vm-deps: $*"; }
die() {
    echo "install-vm-deps: ERROR: $*" >&2
    exit 1
}

installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

vng_ok() {
    "$VENV/bin/vng" --version 2>/dev/null | grep -qF "$VNG_VERSION"
}

# Whether the newest kernel is there, with its modules where modprobe looks.
newest_ok() {
    local k
    k=$(vm_kernel newest)
    [ -n "$k" ] && vm_kernel_has_modules "$(vm_kernel_release "$k")"
}

# Whether the suite was looked at less than RECHECK_HOURS ago.
newest_fresh() {
    [ -n "$(find "$KAPT/looked" -mmin "-$((RECHECK_HOURS * 60))" 2>/dev/null)" ]
}

check() {
    missing=()
    local k
    k=$(vm_kernel 6.12)
    if [ -z "$k" ]; then
        missing+=("a 6.12 kernel (/boot/vmlinuz-6.12*)")
    elif ! vm_kernel_has_modules "$(vm_kernel_release "$k")"; then
        missing+=("ublk_drv/nbd modules for $k")
    fi
    newest_ok || missing+=("the newest kernel of $NEWEST_SUITE (in $VM_KERNELS_DIR)")
    command -v qemu-system-x86_64 >/dev/null 2>&1 || missing+=(qemu-system-x86)
    installed busybox-static || missing+=(busybox-static)
    vng_ok || missing+=("virtme-ng $VNG_VERSION in $VENV")
}

# The private apt: only $NEWEST_SUITE, its own lists, cache and (empty)
# preferences; the system's status file is read, nothing is installed.
KAPT_OPTS=(-o "Dir::Etc::SourceList=$KAPT/sources.list" -o "Dir::Etc::SourceParts=$KAPT/sources.list.d"
    -o "Dir::Etc::Preferences=$KAPT/preferences" -o "Dir::Etc::PreferencesParts=$KAPT/preferences.d"
    -o "Dir::State::Lists=$KAPT/lists" -o "Dir::Cache=$KAPT/cache")

# Looks at $NEWEST_SUITE and makes its newest kernel the `newest` one of
# $VM_KERNELS_DIR, unless it is that already. Returns non-zero, having said
# why, when it cannot (the caller decides whether that is fatal).
install_newest_kernel() {
    mkdir -p "$KAPT/lists/partial" "$KAPT/cache/archives/partial" "$KAPT/sources.list.d" "$KAPT/preferences.d"
    echo "deb http://deb.debian.org/debian $NEWEST_SUITE main" >"$KAPT/sources.list"
    : >"$KAPT/preferences"
    say "looking for the newest kernel in $NEWEST_SUITE (apt lists in $KAPT)"
    if ! apt_get "${KAPT_OPTS[@]}" update --error-on=any; then
        say "cannot read the package lists of $NEWEST_SUITE (network? deb.debian.org)"
        return 1
    fi
    # linux-binary-RELEASE-FLAVOUR holds vmlinuz, linux-modules-RELEASE-FLAVOUR
    # the modules; -cloud-amd64 and -rt-amd64 are other flavours.
    local names rel ver
    names=$(apt-cache "${KAPT_OPTS[@]}" pkgnames linux-) || {
        say "apt-cache cannot list the packages of $NEWEST_SUITE"
        return 1
    }
    rel=$(printf '%s\n' "$names" |
        sed -nE "s/^linux-binary-([0-9]+\.[0-9]+[^-]*-$NEWEST_FLAVOUR)\$/\1/p" |
        while read -r r; do
            if printf '%s\n' "$names" | grep -qxF "linux-modules-$r"; then echo "$r"; fi
        done | sort -V | tail -n 1)
    if [ -z "$rel" ]; then
        say "$NEWEST_SUITE has no linux-binary-*-$NEWEST_FLAVOUR with its linux-modules-*-$NEWEST_FLAVOUR"
        return 1
    fi
    ver=$(apt-cache "${KAPT_OPTS[@]}" show --no-all-versions "linux-binary-$rel" | sed -n 's/^Version: //p' | head -n 1)
    local dir=$VM_KERNELS_DIR/$rel
    local mods=$dir/usr/lib/modules/$rel
    if [ "$(cat "$dir/.package-version" 2>/dev/null)" = "$ver" ] && [ -r "$mods/vmlinuz" ]; then
        say "the newest kernel of $NEWEST_SUITE is $rel ($ver): already in $dir"
    else
        say "the newest kernel of $NEWEST_SUITE is $rel ($ver): downloading linux-binary-$rel and linux-modules-$rel"
        local tmp
        tmp=$(mktemp -d "$VM_KERNELS_DIR/.new.XXXXXX")
        # apt's download runs as the user _apt where it can write.
        chown _apt "$tmp" 2>/dev/null || true
        if ! (cd "$tmp" && apt_get "${KAPT_OPTS[@]}" download "linux-binary-$rel" "linux-modules-$rel"); then
            rm -rf "$tmp"
            say "cannot download linux-binary-$rel and linux-modules-$rel from $NEWEST_SUITE"
            return 1
        fi
        local deb
        for deb in "$tmp"/*.deb; do
            if ! dpkg-deb -x "$deb" "$tmp/root"; then
                rm -rf "$tmp"
                say "cannot unpack $deb"
                return 1
            fi
        done
        if [ ! -r "$tmp/root/usr/lib/modules/$rel/vmlinuz" ] ||
            ! compgen -G "$tmp/root/usr/lib/modules/$rel/kernel/drivers/block/ublk_drv.ko*" >/dev/null ||
            ! compgen -G "$tmp/root/usr/lib/modules/$rel/kernel/drivers/block/nbd.ko*" >/dev/null; then
            rm -rf "$tmp"
            say "linux-binary-$rel and linux-modules-$rel lack usr/lib/modules/$rel/vmlinuz, ublk_drv or nbd"
            return 1
        fi
        echo "$ver" >"$tmp/root/.package-version"
        rm -rf "$dir"
        mv "$tmp/root" "$dir"
        rm -rf "$tmp"
    fi
    # modprobe in the guest looks in /lib/modules/RELEASE of the shared root.
    # A real directory there is the kernel installed as a package: used as it is.
    local link=/lib/modules/$rel
    if [ -L "$link" ] || [ ! -e "$link" ]; then
        if [ "$(readlink "$link" 2>/dev/null)" != "$mods" ] || [ ! -s "$mods/modules.dep" ]; then
            ln -sfn "$mods" "$link"
            say "indexing the modules of $rel (depmod)"
            # (It warns of modules.order and modules.builtin.modinfo, which
            # the package does not carry: harmless.)
            depmod "$rel" 2>&1 | grep -v -e 'modules.order' -e 'modules.builtin' >&2 || true
            [ -s "$mods/modules.dep" ] || {
                say "depmod $rel wrote no $mods/modules.dep"
                return 1
            }
        fi
    fi
    ln -sfn "$rel" "$VM_KERNELS_DIR/.newest.tmp"
    mv -T "$VM_KERNELS_DIR/.newest.tmp" "$VM_KERNELS_DIR/newest"
    touch "$KAPT/looked"
    # Older kernels unpacked here go, with the links to them.
    local old l
    for old in "$VM_KERNELS_DIR"/*/; do
        old=${old%/}
        [ ! -L "$old" ] || continue
        case $(basename "$old") in apt | "$rel") continue ;; esac
        for l in /lib/modules/*; do
            if [ -L "$l" ] && [[ $(readlink "$l") == "$old"/* ]]; then rm -f "$l"; fi
        done
        say "removing the older kernel $old"
        rm -rf "$old"
    done
    return 0
}

# The newest kernel's step, under a lock of its own: another run of this
# script waits for it (up to $LOOPD_APT_WAIT s) instead of unpacking beside it.
newest_kernel_step() {
    mkdir -p "$VM_KERNELS_DIR"
    local rc=0
    (
        if ! flock -n 9; then
            say "waiting for another install (it holds $VM_KERNELS_DIR/.lock)"
            flock -w "${LOOPD_APT_WAIT:-600}" 9 || {
                say "another install still holds $VM_KERNELS_DIR/.lock"
                exit 1
            }
        fi
        install_newest_kernel
    ) 9>"$VM_KERNELS_DIR/.lock" || rc=$?
    if [ "$rc" -ne 0 ]; then
        newest_ok || die "cannot get the newest kernel of $NEWEST_SUITE into $VM_KERNELS_DIR (see above); the VM tests run every kernel suite under it and under 6.12"
        say "WARNING: keeping the kernel there, $(vm_kernel newest), without knowing whether $NEWEST_SUITE has a newer one"
    fi
}

check
if [ "${#missing[@]}" -eq 0 ] && newest_fresh; then
    say "VM test tools present (kernels $(vm_kernel 6.12) and $(vm_kernel newest), virtme-ng $VNG_VERSION in $VENV)"
    exit 0
fi
if [ "${#missing[@]}" -eq 0 ]; then
    # Only the look for a newer kernel is due.
    if [ "$(id -u)" -ne 0 ]; then
        say "not root: not looking for a kernel newer than $(vm_kernel newest) in $NEWEST_SUITE"
        exit 0
    fi
    newest_kernel_step
    check
    [ "${#missing[@]}" -eq 0 ] || die "still missing: ${missing[*]}"
    say "VM test tools present (kernels $(vm_kernel 6.12) and $(vm_kernel newest), virtme-ng $VNG_VERSION in $VENV)"
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
k=$(vm_kernel 6.12)
if [ -z "$k" ] || ! vm_kernel_has_modules "$(vm_kernel_release "$k")"; then
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

# 6. The newest kernel of trixie-backports, unpacked beside the system's.
newest_kernel_step

check
[ "${#missing[@]}" -eq 0 ] || die "still missing after install: ${missing[*]}"
say "installed: kernels $(vm_kernel 6.12) and $(vm_kernel newest), qemu-system-x86, busybox-static, virtme-ng $VNG_VERSION in $VENV"
