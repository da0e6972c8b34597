//! How long loopd waits for the kernel to answer one control request of a
//! block device (`serve --kernel-timeout`): every ublk control command
//! ([`crate::frontend::ublk::deadline`]) and every kernel-NBD netlink call,
//! its sending and its answer ([`crate::kernel_nbd::socket`]). One process-wide value, set
//! once by the daemon at start and read by whoever opens a control handle or
//! a netlink socket afterwards. Never blocks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The timeout unless the daemon says otherwise.
pub const DEFAULT: Duration = Duration::from_secs(30);

/// The process's timeout in milliseconds.
static MS: AtomicU64 = AtomicU64::new(30_000);

/// Set the timeout requests made from now on get (at least 1 ms).
pub fn set(d: Duration) {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
    MS.store(ms, Ordering::Relaxed);
}

/// The timeout a request made now gets.
pub fn get() -> Duration {
    Duration::from_millis(MS.load(Ordering::Relaxed))
}
