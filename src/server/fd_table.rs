//! The daemon's descriptor table, grown once at start.
//!
//! The kernel grows a process's descriptor table by doubling it when a new
//! descriptor does not fit, and in a process of several threads each growth
//! waits for an RCU grace period (milliseconds) while every other thread that
//! opens a descriptor waits for it. An attach takes three or four
//! descriptors, so a daemon taking on its first thousands of devices went
//! through one such stall after another (measured: 11–22 ms pauses of every
//! control thread during sixteen concurrent attach streams). [`reserve`]
//! grows the table to its working size up front, before any thread starts,
//! when growing costs no grace period; the kernel never shrinks it.
//!
//! Contract: call before starting threads (it works later too, only slower);
//! never fails the caller (a table that cannot grow now grows later, as
//! before). Costs the kernel 8 bytes and two bits per slot: 16,384 slots,
//! the most reserved, are 130 KiB.

use rustix::fd::AsFd;

/// Slots reserved at most (the table grows past them as needed).
pub const MAX_RESERVED: u64 = 16_384;

/// Grow this process's descriptor table to hold `min(open-file limit,
/// MAX_RESERVED)` descriptors; returns the table size asked for (0: nothing
/// done). Duplicates a descriptor of `/` with `F_DUPFD_CLOEXEC` at that
/// lowest number, then closes both.
pub fn reserve() -> u64 {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(MAX_RESERVED);
    let slots = limit.min(MAX_RESERVED);
    // The table already holds 64 (and a duplicate past the limit fails).
    if slots <= 64 {
        return 0;
    }
    let Ok(lowest) = i32::try_from(slots - 1) else {
        return 0;
    };
    // Any descriptor will do; one of its own, so a closed stderr is no matter.
    let Ok(root) = rustix::fs::open(
        "/",
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) else {
        return 0;
    };
    match rustix::io::fcntl_dupfd_cloexec(root.as_fd(), lowest) {
        // Dropped at once: the slot is free again, the table stays grown.
        Ok(copy) => {
            drop(copy);
            slots
        }
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_grown_to_the_reserved_size_and_no_descriptor_is_left() {
        let slots = reserve();
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(MAX_RESERVED)
            .min(MAX_RESERVED);
        assert_eq!(slots, if limit <= 64 { 0 } else { limit });
        if slots > 0 {
            // The kernel says how big the table is now: FDSize in status.
            let status = std::fs::read_to_string("/proc/self/status").expect("status");
            let size: u64 = status
                .lines()
                .find_map(|l| l.strip_prefix("FDSize:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("FDSize");
            assert!(size >= slots, "FDSize {size} < {slots}");
            // The copy in the last slot was closed again (other tests of
            // this process open descriptors meanwhile, but not that high).
            let last = std::path::PathBuf::from(format!("/proc/self/fd/{}", slots - 1));
            assert!(!last.exists(), "{} is still open", last.display());
        }
    }
}
