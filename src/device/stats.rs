//! Per-device counters, updated lock-free by every reactor (relaxed atomics: they
//! are statistics, not synchronisation).

use crate::block::{Errno, Op};
use std::sync::OnceLock;
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
    /// Connections cut off for holding memory budget others waited for while
    /// making no progress (replies unread).
    pub stalled_clients: AtomicU64,
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

    /// Count a connection cut off by the progress deadline.
    pub fn stalled_client(&self) {
        self.stalled_clients.fetch_add(1, Relaxed);
    }

    /// Count a request not aligned to the block size.
    pub fn unaligned(&self) {
        self.unaligned.fetch_add(1, Relaxed);
    }

    pub fn error(&self, e: Errno) {
        self.errors[e.index()].fetch_add(1, Relaxed);
    }

    /// One line for the log at exit, from [`COUNTERS`].
    pub fn summary(&self) -> String {
        Snapshot::of(self).summary()
    }
}

/// The groups counters are shown in (status JSON objects, metric families).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Requests served, by command.
    Requests,
    /// Bytes covered, by command.
    Bytes,
    /// How reads and writes reached the file.
    Paths,
    /// A counter of its own.
    Single,
}

impl Group {
    /// The status JSON field (and the exit summary's heading).
    pub fn name(self) -> &'static str {
        match self {
            Group::Requests => "requests",
            Group::Bytes => "bytes",
            Group::Paths => "paths",
            Group::Single => "",
        }
    }
}

/// One per-device counter: declared once here, rendered by `loopd status`, the
/// exit summary and the metrics endpoint.
pub struct Counter {
    pub group: Group,
    /// Key within its group (the command, the path) or, for [`Group::Single`],
    /// the counter's own name.
    pub key: &'static str,
    pub help: &'static str,
    pub read: fn(&Stats) -> u64,
}

macro_rules! counter {
    ($g:ident, $k:literal, $f:ident, $h:literal) => {
        Counter {
            group: Group::$g,
            key: $k,
            help: $h,
            read: |s| s.$f.load(Relaxed),
        }
    };
}

/// Every per-device counter but errors (by errno, see [`Errno::ALL`]) and latency.
pub const COUNTERS: &[Counter] = &[
    counter!(Requests, "read", reads, "Read requests served."),
    counter!(Requests, "write", writes, "Write requests served."),
    counter!(Requests, "flush", flushes, "Flush requests served."),
    counter!(Requests, "trim", trims, "Trim requests served."),
    counter!(
        Requests,
        "write_zeroes",
        write_zeroes,
        "Write-zeroes requests served."
    ),
    counter!(
        Requests,
        "cache",
        caches,
        "Cache (read-ahead) requests served."
    ),
    counter!(
        Requests,
        "block_status",
        block_status,
        "Allocation queries served."
    ),
    counter!(Bytes, "read", bytes_read, "Bytes read."),
    counter!(Bytes, "write", bytes_written, "Bytes written."),
    counter!(Bytes, "trim", bytes_trimmed, "Bytes trimmed."),
    counter!(Bytes, "write_zeroes", bytes_zeroed, "Bytes zeroed."),
    counter!(Bytes, "cache", bytes_cached, "Bytes asked to be cached."),
    counter!(Paths, "direct", direct, "Requests through O_DIRECT."),
    counter!(
        Paths,
        "bounced",
        bounced,
        "Requests through an aligned bounce buffer."
    ),
    counter!(
        Paths,
        "buffered",
        buffered,
        "Requests through the page cache."
    ),
    counter!(
        Paths,
        "inline_cached",
        inline_cached,
        "Reads served inline from the page cache."
    ),
    counter!(
        Paths,
        "inline_written",
        inline_written,
        "Small writes copied into the page cache inline."
    ),
    counter!(
        Paths,
        "spliced",
        spliced,
        "Reads spliced from the page cache to the socket."
    ),
    counter!(
        Single,
        "unaligned",
        unaligned,
        "Requests not aligned to the block size."
    ),
    counter!(
        Single,
        "moves",
        moves,
        "Connections moved to the reactor on their client's CPU."
    ),
    counter!(
        Single,
        "stalled_clients",
        stalled_clients,
        "Connections cut off for leaving their replies unread while holding memory budget others waited for."
    ),
];

/// The counters' values at one moment (each read separately, relaxed).
pub struct Snapshot {
    /// In [`COUNTERS`] order.
    pub values: Vec<u64>,
    /// In [`Errno::ALL`] order.
    pub errors: Vec<u64>,
}

impl Snapshot {
    pub fn of(s: &Stats) -> Snapshot {
        Snapshot {
            values: COUNTERS.iter().map(|c| (c.read)(s)).collect(),
            errors: Errno::ALL
                .iter()
                .map(|e| s.errors[e.index()].load(Relaxed))
                .collect(),
        }
    }

    /// Every counter with its value.
    pub fn iter(&self) -> impl Iterator<Item = (&'static Counter, u64)> + '_ {
        COUNTERS.iter().zip(self.values.iter().copied())
    }

    /// One group's `(key, value)` pairs.
    pub fn group(&self, g: Group) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.iter()
            .filter(move |(c, _)| c.group == g)
            .map(|(c, v)| (c.key, v))
    }

    /// A counter by group and key (0 if there is none).
    pub fn get(&self, g: Group, key: &str) -> u64 {
        self.group(g)
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
            .unwrap_or(0)
    }

    /// Errors by errno name.
    pub fn errors(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        Errno::ALL
            .iter()
            .zip(self.errors.iter().copied())
            .map(|(e, v)| (e.name(), v))
    }

    /// `requests: read=1 … bytes: … paths: … unaligned=0 moves=0 stalled_clients=0 errors: ENOSPC=1`
    /// (errors that are 0 left out; `none` when all are).
    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        let mut last = None;
        for (c, v) in self.iter() {
            if last != Some(c.group) && c.group != Group::Single {
                parts.push(format!("{}:", c.group.name()));
            }
            last = Some(c.group);
            parts.push(format!("{}={v}", c.key));
        }
        let mut out = parts.join(" ");
        out.push_str(" errors:");
        let mut any = false;
        for (name, n) in self.errors().filter(|(_, n)| *n > 0) {
            out.push_str(&format!(" {name}={n}"));
            any = true;
        }
        if !any {
            out.push_str(" none");
        }
        out
    }
}

/// A lock-free latency histogram: four buckets per power of two of nanoseconds
/// (about 19% resolution), plus the exact maximum and the running sum (for
/// the metrics endpoint's `_sum`: one more relaxed add per request).
///
/// The buckets (2 KiB) are allocated by the first request: a daemon with tens
/// of thousands of devices, most of them idle, does not pay for theirs.
#[derive(Default)]
pub struct Histogram {
    buckets: OnceLock<Box<Buckets>>,
    max_ns: AtomicU64,
    sum_ns: AtomicU64,
}

type Buckets = [AtomicU64; 256];

fn no_requests() -> Box<Buckets> {
    Box::new(std::array::from_fn(|_| AtomicU64::new(0)))
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
    /// Every bucket's count (all zeros before the first request).
    fn counts(&self) -> Vec<u64> {
        match self.buckets.get() {
            Some(b) => b.iter().map(|c| c.load(Relaxed)).collect(),
            None => vec![0; 256],
        }
    }

    pub fn record(&self, ns: u64) {
        self.buckets.get_or_init(no_requests)[bucket_of(ns)].fetch_add(1, Relaxed);
        self.max_ns.fetch_max(ns, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    /// Cumulative counts at powers of two of nanoseconds: `(2^k ns, requests
    /// that took less)` for k in `lo..=hi`, then the total count and the sum of
    /// all latencies in nanoseconds. Bucket edges fall on powers of two, so the
    /// cumulative counts there are exact.
    pub fn cumulative(&self, lo: u32, hi: u32) -> (Vec<(u64, u64)>, u64, u64) {
        let counts = self.counts();
        let mut out = Vec::new();
        for k in lo..=hi.min(63) {
            // Buckets below index 4k hold latencies < 2^k (for k >= 2).
            let upto = (4 * k as usize).min(counts.len());
            out.push((1u64 << k, counts[..upto].iter().sum()));
        }
        let total = counts.iter().sum();
        (out, total, self.sum_ns.load(Relaxed))
    }

    /// (p50, p99, max) in microseconds; zeros when nothing was recorded.
    pub fn summary(&self) -> (f64, f64, f64) {
        let counts = self.counts();
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

    #[test]
    fn cumulative_counts_are_exact_at_powers_of_two() {
        let h = Histogram::default();
        for ns in [1u64, 3, 4, 1000, 1023, 1024, 1025, 5000, 1 << 20] {
            h.record(ns);
        }
        let (c, total, sum) = h.cumulative(2, 21);
        assert_eq!(total, 9);
        assert_eq!(
            sum,
            1 + 3 + 4 + 1000 + 1023 + 1024 + 1025 + 5000 + (1 << 20)
        );
        let at = |le: u64| c.iter().find(|(l, _)| *l == le).map(|(_, n)| *n);
        assert_eq!(at(4), Some(2)); // 1, 3
        assert_eq!(at(1024), Some(5)); // .. 1023
        assert_eq!(at(2048), Some(7));
        assert_eq!(at(1 << 20), Some(8));
        assert_eq!(at(1 << 21), Some(9));
        assert!(c.windows(2).all(|w| w[0].1 <= w[1].1), "cumulative");
    }

    #[test]
    fn snapshot_reads_every_counter_once() {
        let s = Stats::default();
        s.op(Op::Read, 4096);
        s.op(Op::Write, 512);
        s.path(Path::Spliced);
        s.error(Errno::ALL[0]);
        let snap = Snapshot::of(&s);
        assert_eq!(snap.get(Group::Requests, "read"), 1);
        assert_eq!(snap.get(Group::Bytes, "read"), 4096);
        assert_eq!(snap.get(Group::Bytes, "write"), 512);
        assert_eq!(snap.get(Group::Paths, "spliced"), 1);
        let line = snap.summary();
        assert!(line.starts_with("requests: read=1 write=1 "), "{line}");
        assert!(
            line.contains(" spliced=1 unaligned=0 moves=0 stalled_clients=0 errors: "),
            "{line}"
        );
        assert!(
            line.contains(&format!("{}=1", Errno::ALL[0].name())),
            "{line}"
        );
        let names: std::collections::HashSet<(&str, &str)> =
            COUNTERS.iter().map(|c| (c.group.name(), c.key)).collect();
        assert_eq!(names.len(), COUNTERS.len(), "no counter declared twice");
    }
}
