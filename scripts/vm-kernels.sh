# Sourced by scripts/vm-test.sh, scripts/vm-systemd-test.sh and
# scripts/install-vm-deps.sh: where the VM's kernels are.
#
# Two kernels, by name:
#   6.12    the newest installed /boot/vmlinuz-6.12* (bookworm-backports'
#           linux-image-amd64, installed as a package);
#   newest  the newest kernel of trixie-backports that scripts/install-vm-deps.sh
#           found and unpacked (not installed as a package) into
#           $LOOPD_VM_KERNELS_DIR (default /opt/loopd-vm-kernels): there
#           RELEASE/usr/lib/modules/RELEASE/{vmlinuz,kernel/...}, and the link
#           `newest` -> RELEASE; /usr/lib/modules/RELEASE links to its modules so
#           that modprobe finds them in the guest (which sees the host's root).
# Not under /var/cache: virtme-ng's guest mounts a tmpfs there.
#
# vm_kernel NAME|PATH prints the vmlinuz a name stands for (a path is taken as
# it is), or nothing when it is not there; vm_kernel_release VMLINUZ prints the
# kernel's release (from the modules directory it sits in, or /boot's name).

VM_KERNELS_DIR=${LOOPD_VM_KERNELS_DIR:-/opt/loopd-vm-kernels}

vm_kernel() {
    local rel
    case $1 in
    6.12)
        # (ls fails when there is none: not an error here, under pipefail.)
        { ls -1 /boot/vmlinuz-6.12* 2>/dev/null || true; } | sort -V | tail -n 1
        ;;
    newest)
        rel=$(readlink "$VM_KERNELS_DIR/newest" 2>/dev/null) || return 0
        [ -r "$VM_KERNELS_DIR/$rel/usr/lib/modules/$rel/vmlinuz" ] &&
            echo "$VM_KERNELS_DIR/$rel/usr/lib/modules/$rel/vmlinuz"
        ;;
    *)
        echo "$1"
        ;;
    esac
    return 0
}

vm_kernel_release() {
    local base
    base=$(basename "$1")
    case $base in
    vmlinuz-*) echo "${base#vmlinuz-}" ;;
    *) basename "$(dirname "$1")" ;;
    esac
}

# Whether the kernel of release $1 has ublk_drv and nbd where modprobe looks.
vm_kernel_has_modules() {
    compgen -G "/lib/modules/$1/kernel/drivers/block/ublk_drv.ko*" >/dev/null &&
        compgen -G "/lib/modules/$1/kernel/drivers/block/nbd.ko*" >/dev/null &&
        [ -s "/lib/modules/$1/modules.dep" ]
}
