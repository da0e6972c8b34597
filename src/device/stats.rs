//! Per-device counters, updated lock-free by every reactor (relaxed atomics: they
//! are statistics, not synchronisation).

use crate::block::{Errno, Op};
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
    /// A small whole-page buffered write copied into the page cache inline.
    InlineWritten,
    /// A large buffered read spliced from the page cache to the socket.
    Spliced,
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
    pub bytes_trimmed: AtomicU64,
    pub bytes_zeroed: AtomicU64,
    pub bytes_cached: AtomicU64,
    pub direct: AtomicU64,
    pub bounced: AtomicU64,
    pub buffered: AtomicU64,
    pub inline_cached: AtomicU64,
    pub inline_written: AtomicU64,
    pub spliced: AtomicU64,
    /// Reads, writes, trims and write-zeroes whose offset or length is not a
    /// multiple of the device's block size.
    pub unaligned: AtomicU64,
    /// Connections moved to the reactor on their client's CPU.
    pub moves: AtomicU64,
    /// Errors sent to clients, indexed by [`Errno::index`].
    pub errors: [AtomicU64; Errno::ALL.len()],
    /// Bit per errno index: whether a backing-file error of that kind was logged.
    pub logged_errors: AtomicU64,
    /// Time from a request's header to its reply being queued.
    pub latency: Histogram,
}

impl Stats {
    /// Count an operation of `bytes` (0 for a flush).
    pub fn op(&self, op: Op, bytes: u64) {
        let c = match op {
            Op::Read => {
                self.bytes_read.fetch_add(bytes, Relaxed);
                &self.reads
            }
            Op::Write => {
                self.bytes_written.fetch_add(bytes, Relaxed);
                &self.writes
            }
            Op::Flush => &self.flushes,
            Op::Trim => {
                self.bytes_trimmed.fetch_add(bytes, Relaxed);
                &self.trims
            }
            Op::WriteZeroes => {
                self.bytes_zeroed.fetch_add(bytes, Relaxed);
                &self.write_zeroes
            }
            Op::Cache => {
                self.bytes_cached.fetch_add(bytes, Relaxed);
                &self.caches
            }
        };
        c.fetch_add(1, Relaxed);
    }

    /// Count an allocation query (NBD's BLOCK_STATUS).
    pub fn status_query(&self) {
        self.block_status.fetch_add(1, Relaxed);
    }

    pub fn path(&self, p: Path) {
        let c = match p {
            Path::Direct => &self.direct,
            Path::Bounced => &self.bounced,
            Path::Buffered => &self.buffered,
            Path::InlineCached => &self.inline_cached,
            Path::InlineWritten => &self.inline_written,
            Path::Spliced => &self.spliced,
        };
        c.fetch_add(1, Relaxed);
    }

    /// Count a request not aligned to the block size.
    pub fn unaligned(&self) {
        self.unaligned.fetch_add(1, Relaxed);
    }

    pub fn error(&self, e: Errno) {
        self.errors[e.index()].fetch_add(1, Relaxed);
    }

    /// One line for the log at exit.
    pub fn summary(&self) -> String {
        let g = |a: &AtomicU64| a.load(Relaxed);
        let mut errs = String::new();
        for e in Errno::ALL {
            let n = g(&self.errors[e.index()]);
            if n > 0 {
                errs.push_str(&format!(" {}={n}", e.name()));
            }
        }
        format!(
            "reads={} writes={} flushes={} trims={} write_zeroes={} bytes_read={} bytes_written={} \
             direct={} bounced={} buffered={} inline_cached={} inline_written={} spliced={} unaligned={} moves={} errors:{}",
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
            g(&self.inline_written),
            g(&self.spliced),
            g(&self.unaligned),
            g(&self.moves),
            if errs.is_empty() {
                " none".to_string()
            } else {
                errs
            }
        )
    }
}

/// A lock-free latency histogram: four buckets per power of two of nanoseconds
/// (about 19% resolution), plus the exact maximum.
pub struct Histogram {
    buckets: [AtomicU64; 256],
    max_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            max_ns: AtomicU64::new(0),
        }
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Histogram {{ max_ns: {} }}", self.max_ns.load(Relaxed))
    }
}

fn bucket_of(ns: u64) -> usize {
    if ns < 4 {
        return usize::try_from(ns).unwrap_or(0);
    }
    let b = 63 - ns.leading_zeros() as usize; // >= 2
    let sub = usize::try_from((ns >> (b - 2)) & 3).unwrap_or(0);
    b * 4 + sub
}

/// The middle of a bucket's range, in nanoseconds.
fn bucket_value(i: usize) -> f64 {
    if i < 4 {
        return i as f64;
    }
    let (b, sub) = (i / 4, i % 4);
    let lo = (4 + sub as u64) << (b - 2);
    lo as f64 + (1u64 << (b - 2)) as f64 / 2.0
}

impl Histogram {
    pub fn record(&self, ns: u64) {
        self.buckets[bucket_of(ns)].fetch_add(1, Relaxed);
        self.max_ns.fetch_max(ns, Relaxed);
    }

    /// (p50, p99, max) in microseconds; zeros when nothing was recorded.
    pub fn summary(&self) -> (f64, f64, f64) {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return (0.0, 0.0, 0.0);
        }
        let pct = |p: u64| {
            // Rank ceil(total * p / 1000), p in thousandths.
            let want = total.saturating_mul(p).div_ceil(1000).max(1);
            let mut seen = 0;
            for (i, c) in counts.iter().enumerate() {
                seen += c;
                if seen >= want {
                    return bucket_value(i) / 1000.0;
                }
            }
            0.0
        };
        let max = self.max_ns.load(Relaxed) as f64 / 1000.0;
        (pct(500).min(max), pct(990).min(max), max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_percentiles_are_within_a_bucket() {
        let h = Histogram::default();
        for ns in 1..=1000u64 {
            h.record(ns * 1000); // 1 µs ..= 1 ms
        }
        let (p50, p99, max) = h.summary();
        assert!((400.0..=600.0).contains(&p50), "p50 {p50}");
        assert!((850.0..=1000.0).contains(&p99), "p99 {p99}");
        assert_eq!(max, 1000.0);
    }

    #[test]
    fn bucket_index_is_monotonic() {
        let mut last = 0;
        for ns in (0..1_000_000u64).step_by(7) {
            let b = bucket_of(ns);
            assert!(b >= last);
            last = b;
        }
        assert!(bucket_of(u64::MAX) < 256);
    }
}
