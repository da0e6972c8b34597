//! Per-device counters, updated lock-free by every reactor (relaxed atomics: they
//! are statistics, not synchronisation).

use crate::nbd::wire::{Command, NbdErrno};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// How a data request reached the backing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Straight to the `O_DIRECT` fd through an aligned buffer.
    Direct,
    /// Through an aligned bounce buffer (read-modify-write for writes).
    Bounced,
    /// Through the page cache, via the ring.
    Buffered,
    /// A buffered read served inline from the page cache (`RWF_NOWAIT`).
    InlineCached,
}

#[derive(Default, Debug)]
pub struct Stats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub trims: AtomicU64,
    pub write_zeroes: AtomicU64,
    pub caches: AtomicU64,
    pub block_status: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub direct: AtomicU64,
    pub bounced: AtomicU64,
    pub buffered: AtomicU64,
    pub inline_cached: AtomicU64,
    /// Errors sent to clients, indexed like [`errno_index`].
    pub errors: [AtomicU64; 8],
    pub in_flight: AtomicU64,
    /// Bit per errno index: whether a backing-file error of that kind was logged.
    pub logged_errors: AtomicU64,
}

/// Position of an errno in [`Stats::errors`].
pub fn errno_index(e: NbdErrno) -> usize {
    match e {
        NbdErrno::Perm => 0,
        NbdErrno::Io => 1,
        NbdErrno::NoMem => 2,
        NbdErrno::Inval => 3,
        NbdErrno::NoSpc => 4,
        NbdErrno::Overflow => 5,
        NbdErrno::NotSup => 6,
        NbdErrno::Shutdown => 7,
    }
}

/// Names for [`Stats::errors`], in index order.
pub const ERRNO_NAMES: [&str; 8] = [
    "EPERM",
    "EIO",
    "ENOMEM",
    "EINVAL",
    "ENOSPC",
    "EOVERFLOW",
    "ENOTSUP",
    "ESHUTDOWN",
];

impl Stats {
    pub fn command(&self, cmd: Command, bytes: u64) {
        let c = match cmd {
            Command::Read => {
                self.bytes_read.fetch_add(bytes, Relaxed);
                &self.reads
            }
            Command::Write => {
                self.bytes_written.fetch_add(bytes, Relaxed);
                &self.writes
            }
            Command::Flush => &self.flushes,
            Command::Trim => &self.trims,
            Command::WriteZeroes => &self.write_zeroes,
            Command::Cache => &self.caches,
            Command::BlockStatus => &self.block_status,
            Command::Disc => return,
        };
        c.fetch_add(1, Relaxed);
    }

    pub fn path(&self, p: Path) {
        let c = match p {
            Path::Direct => &self.direct,
            Path::Bounced => &self.bounced,
            Path::Buffered => &self.buffered,
            Path::InlineCached => &self.inline_cached,
        };
        c.fetch_add(1, Relaxed);
    }

    pub fn error(&self, e: NbdErrno) {
        self.errors[errno_index(e)].fetch_add(1, Relaxed);
    }

    /// One line for the log at exit.
    pub fn summary(&self) -> String {
        let g = |a: &AtomicU64| a.load(Relaxed);
        let mut errs = String::new();
        for (i, name) in ERRNO_NAMES.iter().enumerate() {
            let n = g(&self.errors[i]);
            if n > 0 {
                errs.push_str(&format!(" {name}={n}"));
            }
        }
        format!(
            "reads={} writes={} flushes={} trims={} write_zeroes={} bytes_read={} bytes_written={} \
             direct={} bounced={} buffered={} inline_cached={} errors:{}",
            g(&self.reads),
            g(&self.writes),
            g(&self.flushes),
            g(&self.trims),
            g(&self.write_zeroes),
            g(&self.bytes_read),
            g(&self.bytes_written),
            g(&self.direct),
            g(&self.bounced),
            g(&self.buffered),
            g(&self.inline_cached),
            if errs.is_empty() {
                " none".to_string()
            } else {
                errs
            }
        )
    }
}
