//! What a scrape exposes: every device's counters (from
//! [`COUNTERS`](crate::device::stats::COUNTERS)), gauges and latency histogram,
//! and facts about the process. Reads atomics only (and the export table's read
//! lock and each export's spec lock, which the data path does not take).

use super::expo::{Encoder, Kind};
use crate::backing::cache;
use crate::backing::rbd::{RbdSpec, spec as rbd_spec};
use crate::daemon::Daemon;
use crate::device::spec::Blockdev;
use crate::device::stats::{COUNTERS, Group, Snapshot};
use crate::engine::budget;

/// Histogram edges: 2^10 ns (about 1 µs) to 2^36 ns (about 69 s).
const LE_LO: u32 = 10;
const LE_HI: u32 = 36;

/// Facts fixed at start.
#[derive(Debug, Clone)]
pub struct Process {
    /// Seconds since the Unix epoch.
    pub start_time: f64,
    pub reactors: usize,
}

/// Family name and label of a counter group.
fn family(g: Group) -> Option<(&'static str, &'static str, &'static str)> {
    match g {
        Group::Requests => Some(("loopd_requests_total", "op", "Requests served, by command.")),
        Group::Bytes => Some(("loopd_bytes_total", "op", "Bytes covered, by command.")),
        Group::Paths => Some((
            "loopd_path_requests_total",
            "path",
            "Reads and writes by how they reached the image.",
        )),
        Group::Single => None,
    }
}

/// The whole exposition.
pub fn render(daemon: &Daemon, p: &Process) -> String {
    let mut exports = daemon.all();
    exports.sort_by(|a, b| crate::text::natural_cmp(&a.name, &b.name));
    let snaps: Vec<(&str, Snapshot)> = exports
        .iter()
        .map(|e| (e.name.as_str(), Snapshot::of(&e.stats)))
        .collect();
    let mut enc = Encoder::default();
    for g in [Group::Requests, Group::Bytes, Group::Paths] {
        let Some((name, label, help)) = family(g) else {
            continue;
        };
        enc.family(name, Kind::Counter, help);
        for (dev, s) in &snaps {
            for (key, v) in s.group(g) {
                enc.sample(name, &[("device", dev), (label, key)], v as f64);
            }
        }
    }
    for c in COUNTERS.iter().filter(|c| c.group == Group::Single) {
        let name = format!("loopd_{}_total", c.key);
        enc.family(&name, Kind::Counter, c.help);
        for (dev, s) in &snaps {
            enc.sample(
                &name,
                &[("device", dev)],
                s.get(Group::Single, c.key) as f64,
            );
        }
    }
    enc.family(
        "loopd_errors_total",
        Kind::Counter,
        "Errors sent to clients, by errno.",
    );
    for (dev, s) in &snaps {
        for (errno, v) in s.errors() {
            enc.sample(
                "loopd_errors_total",
                &[("device", dev), ("errno", errno)],
                v as f64,
            );
        }
    }
    enc.family(
        "loopd_in_flight_requests",
        Kind::Gauge,
        "Requests whose file I/O is under way.",
    );
    for e in &exports {
        enc.sample(
            "loopd_in_flight_requests",
            &[("device", &e.name)],
            e.in_flight() as f64,
        );
    }
    enc.family(
        "loopd_clients",
        Kind::Gauge,
        "Connections using the device.",
    );
    for e in &exports {
        enc.sample(
            "loopd_clients",
            &[("device", &e.name)],
            f64::from(e.clients()),
        );
    }
    enc.family(
        "loopd_device_frontend",
        Kind::Gauge,
        "How the device is offered (value 1): nbd always, ublk or kernel_nbd when a block device is asked for.",
    );
    for e in &exports {
        enc.sample(
            "loopd_device_frontend",
            &[("device", &e.name), ("frontend", "nbd")],
            1.0,
        );
        // The spec's lock is the control plane's; the data path never takes it.
        let kernel = match e.spec().blockdev {
            Some(Blockdev::Ublk) => Some("ublk"),
            Some(Blockdev::Nbd) => Some("kernel_nbd"),
            None => None,
        };
        if let Some(k) = kernel {
            enc.sample(
                "loopd_device_frontend",
                &[("device", &e.name), ("frontend", k)],
                1.0,
            );
        }
    }
    // RBD devices: which image of which pool and namespace, and which
    // snapshot (never a key: the spec has none; the cluster's configuration
    // file and id are not exposed).
    let rbd: Vec<(&str, RbdSpec)> = exports
        .iter()
        .filter_map(|e| {
            let image = e.spec().image.clone();
            let s = image.to_str().filter(|s| rbd_spec::is_rbd(s))?;
            Some((e.name.as_str(), RbdSpec::parse(s).ok()?))
        })
        .collect();
    if !rbd.is_empty() {
        enc.family(
            "loopd_rbd_image_info",
            Kind::Gauge,
            "The RBD image a device serves (value 1): pool, namespace (empty: the default), image and snapshot (empty: the image itself).",
        );
        for (dev, s) in &rbd {
            enc.sample(
                "loopd_rbd_image_info",
                &[
                    ("device", dev),
                    ("pool", &s.pool),
                    ("namespace", s.namespace.as_deref().unwrap_or("")),
                    ("image", &s.image),
                    ("snapshot", s.snap.as_deref().unwrap_or("")),
                ],
                1.0,
            );
        }
    }
    enc.family(
        "loopd_page_cache_bytes",
        Kind::Gauge,
        "Bytes of the device's window of its image in the page cache, by state (cachestat(2); absent on kernels before 6.5).",
    );
    for e in &exports {
        // A reference to the current configuration (no lock held during the
        // call); a 0-byte window holds nothing (and len 0 means "to the end").
        let (dev, _) = e.current();
        let stat = match dev.size {
            0 => Ok(Some(cache::CacheStat::default())),
            n => match dev.backend().as_file() {
                Some(f) => cache::stat(f.plain(), dev.offset, n),
                None => Ok(None),
            },
        };
        if let Ok(Some(c)) = stat {
            for (state, v) in [
                ("cached", c.cached),
                ("dirty", c.dirty),
                ("writeback", c.writeback),
            ] {
                enc.sample(
                    "loopd_page_cache_bytes",
                    &[("device", &e.name), ("state", state)],
                    v as f64,
                );
            }
        }
    }
    let h = "loopd_request_duration_seconds";
    enc.family(
        h,
        Kind::Histogram,
        "Time from a request's header to its reply being queued.",
    );
    for e in &exports {
        let (buckets, count, sum_ns) = e.stats.latency.cumulative(LE_LO, LE_HI);
        let bucket = format!("{h}_bucket");
        for (le_ns, n) in buckets {
            let le = super::expo::number(le_ns as f64 / 1e9);
            enc.sample(&bucket, &[("device", &e.name), ("le", &le)], n as f64);
        }
        enc.sample(
            &bucket,
            &[("device", &e.name), ("le", "+Inf")],
            count as f64,
        );
        enc.sample(
            &format!("{h}_sum"),
            &[("device", &e.name)],
            sum_ns as f64 / 1e9,
        );
        enc.sample(&format!("{h}_count"), &[("device", &e.name)], count as f64);
    }
    enc.family(
        "loopd_devices",
        Kind::Gauge,
        "Devices attached and serving.",
    );
    enc.sample("loopd_devices", &[], exports.len() as f64);
    enc.family(
        "loopd_start_time_seconds",
        Kind::Gauge,
        "When the daemon started, in seconds since the Unix epoch.",
    );
    enc.sample("loopd_start_time_seconds", &[], p.start_time);
    enc.family("loopd_reactors", Kind::Gauge, "Reactor threads.");
    enc.sample("loopd_reactors", &[], p.reactors as f64);
    let b = budget::global();
    enc.family(
        "loopd_memory_budget_limit_bytes",
        Kind::Gauge,
        "Bytes request and reply buffers may take across the daemon.",
    );
    enc.sample("loopd_memory_budget_limit_bytes", &[], b.limit() as f64);
    enc.family(
        "loopd_memory_budget_used_bytes",
        Kind::Gauge,
        "Bytes of request and reply buffers held now: in use by requests or idle in the reactors' pools (released when another reactor waits for budget).",
    );
    enc.sample("loopd_memory_budget_used_bytes", &[], b.used() as f64);
    enc.family(
        "loopd_memory_budget_held_bytes",
        Kind::Gauge,
        "Bytes of request buffers the device's requests hold now (who holds the budget; its clients together may hold the limit less 64 MiB).",
    );
    for e in &exports {
        enc.sample(
            "loopd_memory_budget_held_bytes",
            &[("device", &e.name)],
            e.budget_held() as f64,
        );
    }
    enc.family(
        "loopd_build_info",
        Kind::Gauge,
        "The loopd version (value 1).",
    );
    enc.sample(
        "loopd_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    enc.finish()
}
