//! What `list`, `status`, `attach` and `set` report: serialisable snapshots.

use super::endpoints::Endpoints;
use crate::control::proto::DeviceSpec;
use crate::device::CacheMode;
use crate::device::export::Export;
use crate::device::stats::{Group, Snapshot};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Whether a device serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    /// Attached and serving.
    #[default]
    Live,
    /// Recorded in the state file, but its image cannot be opened (yet): see
    /// `reason`. Retried until it can.
    Missing,
}

/// One device, as `loopd list` shows it. Fields in sorted order: replies
/// keep their keys sorted, and lists are written straight from these
/// (`crate::control::proto::sorted_reply`; a test checks the order).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub autoclear: bool,
    pub block_size: u32,
    /// The kernel block device the device is handed to (`/dev/ublkbN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blockdev: Option<PathBuf>,
    /// The cache mode asked for.
    pub cache: CacheMode,
    pub clients: u32,
    /// Whether direct I/O is really in use.
    pub direct: bool,
    pub image: PathBuf,
    pub name: String,
    /// Something the user should know about this attach (an existing image
    /// kept in spite of `create`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    pub offset: u64,
    /// Its partition devices, as the kernel has them now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PathBuf>,
    pub read_only: bool,
    /// Why a missing device is not attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub size: u64,
    pub size_limit: Option<u64>,
    #[serde(default)]
    pub state: DeviceState,
    /// The block size is advertised as the NBD minimum (else 1).
    #[serde(default)]
    pub strict_block_size: bool,
    /// TLS client identities allowed to open it (empty: every client).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tls_allow: Vec<String>,
    /// ublk: the kernel's optional fast paths this device uses (feature
    /// names, e.g. `auto_buf_reg`); empty when none. Absent for other devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_fast_paths: Option<Vec<String>>,
    /// ublk: every `UBLK_F_*` feature the running kernel offers (names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_kernel_features: Option<Vec<String>>,
    pub uris: Vec<String>,
    /// Read-only because the image cannot be written (a read-only mount, mode
    /// 0444), not because it was asked.
    #[serde(default)]
    pub write_protected: bool,
}

impl DeviceInfo {
    pub fn of(e: &Export, ep: &Endpoints) -> DeviceInfo {
        let (d, _) = e.current();
        let spec = e.spec();
        DeviceInfo {
            name: e.name.clone(),
            note: None,
            image: d.path.clone(),
            size: d.size,
            offset: d.offset,
            size_limit: spec.size_limit,
            block_size: d.block_size,
            strict_block_size: d.strict_block_size,
            cache: spec.cache,
            direct: d.direct,
            read_only: d.read_only,
            write_protected: d.write_protected,
            autoclear: spec.autoclear,
            clients: e.clients(),
            uris: ep.uris(&e.name),
            state: DeviceState::Live,
            reason: None,
            blockdev: None,
            partitions: Vec::new(),
            tls_allow: spec.tls_allow,
            ublk_fast_paths: None,
            ublk_kernel_features: None,
        }
    }

    /// A recorded device that is not attached: its recorded configuration.
    pub fn missing(name: &str, spec: &DeviceSpec, reason: &str) -> DeviceInfo {
        DeviceInfo {
            name: name.to_owned(),
            note: None,
            image: spec.image.clone(),
            size: 0,
            offset: spec.offset,
            size_limit: spec.size_limit,
            block_size: spec.block_size.unwrap_or(0),
            strict_block_size: spec.strict_block_size,
            cache: spec.cache,
            direct: false,
            read_only: spec.read_only,
            write_protected: false,
            autoclear: spec.autoclear,
            clients: 0,
            uris: Vec::new(),
            state: DeviceState::Missing,
            reason: Some(reason.to_owned()),
            blockdev: None,
            partitions: Vec::new(),
            tls_allow: spec.tls_allow.clone(),
            ublk_fast_paths: None,
            ublk_kernel_features: None,
        }
    }
}

/// Request latency summary, in microseconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Latency {
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

/// `loopd status`: the configuration plus live counters.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceStatus {
    #[serde(flatten)]
    pub info: DeviceInfo,
    pub in_flight: u64,
    pub requests: BTreeMap<String, u64>,
    /// Bytes covered, by command (read, write, trim, write_zeroes, cache).
    pub bytes: BTreeMap<String, u64>,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// The backing file's (or image's) size, read when the status is made
    /// (0 for a missing device).
    #[serde(default)]
    pub file_size: u64,
    /// Reads, writes, trims and write-zeroes not aligned to the block size
    /// (offset or length), served all the same.
    #[serde(default)]
    pub unaligned: u64,
    /// How reads and writes reached the file.
    pub paths: BTreeMap<String, u64>,
    /// Connections moved to the reactor on the CPU their client runs on.
    pub moves: u64,
    /// Connections cut off for not taking a reply in time while holding
    /// memory budget others waited for.
    #[serde(default)]
    pub stalled_clients: u64,
    /// Bytes of the daemon's memory budget this device's requests hold now.
    #[serde(default)]
    pub budget_held: u64,
    pub errors: BTreeMap<String, u64>,
    pub latency: Latency,
}

impl DeviceStatus {
    /// Every counter from [`COUNTERS`](crate::device::stats::COUNTERS), by group.
    pub fn of(e: &Export, ep: &Endpoints) -> DeviceStatus {
        let snap = Snapshot::of(&e.stats);
        let group = |g: Group| -> BTreeMap<String, u64> {
            snap.group(g).map(|(k, v)| (k.to_string(), v)).collect()
        };
        let (p50, p99, max) = e.stats.latency.summary();
        DeviceStatus {
            info: DeviceInfo::of(e, ep),
            in_flight: e.in_flight(),
            requests: group(Group::Requests),
            bytes: group(Group::Bytes),
            bytes_read: snap.get(Group::Bytes, "read"),
            bytes_written: snap.get(Group::Bytes, "write"),
            file_size: e.current().0.file_size_now(),
            unaligned: snap.get(Group::Single, "unaligned"),
            paths: group(Group::Paths),
            moves: snap.get(Group::Single, "moves"),
            stalled_clients: snap.get(Group::Single, "stalled_clients"),
            budget_held: e.budget_held() as u64,
            errors: snap.errors().map(|(k, v)| (k.to_string(), v)).collect(),
            latency: Latency {
                p50_us: p50,
                p99_us: p99,
                max_us: max,
            },
        }
    }
}

impl DeviceStatus {
    /// A missing device: its recorded configuration and no counters.
    pub fn missing(info: DeviceInfo) -> DeviceStatus {
        DeviceStatus {
            info,
            in_flight: 0,
            requests: BTreeMap::new(),
            bytes: BTreeMap::new(),
            bytes_read: 0,
            bytes_written: 0,
            file_size: 0,
            unaligned: 0,
            paths: BTreeMap::new(),
            moves: 0,
            stalled_clients: 0,
            budget_held: 0,
            errors: BTreeMap::new(),
            latency: Latency {
                p50_us: 0.0,
                p99_us: 0.0,
                max_us: 0.0,
            },
        }
    }
}

/// The answer to `set` and `resize`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SetResult {
    #[serde(flatten)]
    pub device: DeviceInfo,
    /// Whether anything the data path sees changed.
    pub changed: bool,
    /// How long this device's requests were held (0 when nothing was frozen).
    pub quiesced_us: u64,
    /// The backing file's size, read when the answer is made.
    pub file_size: u64,
    /// The size limit makes the device smaller than the file (past its offset).
    pub capped_by_size_limit: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lists and batches are written straight from `DeviceInfo`
    /// (`devices_reply`): its keys must come out in the sorted order of the
    /// JSON tree replies are otherwise made from.
    #[test]
    fn device_info_serializes_in_sorted_order() {
        let full = DeviceInfo {
            autoclear: true,
            block_size: 4096,
            blockdev: Some("/dev/ublkb0".into()),
            cache: CacheMode::Direct,
            clients: 2,
            direct: true,
            image: "/img".into(),
            name: "d".into(),
            note: Some("kept".into()),
            offset: 512,
            partitions: vec!["/dev/ublkb0p1".into()],
            read_only: false,
            reason: Some("gone".into()),
            size: 1 << 20,
            size_limit: Some(1 << 20),
            state: DeviceState::Missing,
            strict_block_size: true,
            tls_allow: vec!["cn".into()],
            ublk_fast_paths: Some(vec!["auto_buf_reg".into()]),
            ublk_kernel_features: Some(vec!["user_recovery".into()]),
            uris: vec!["nbd://x".into()],
            write_protected: true,
        };
        let bare = DeviceInfo {
            blockdev: None,
            note: None,
            partitions: Vec::new(),
            reason: None,
            size_limit: None,
            tls_allow: Vec::new(),
            ublk_fast_paths: None,
            ublk_kernel_features: None,
            ..full.clone()
        };
        for info in [full, bare] {
            let direct = serde_json::to_string(&info).unwrap();
            let tree = serde_json::to_value(&info).unwrap().to_string();
            assert_eq!(direct, tree);
            assert_eq!(
                crate::control::proto::sorted_reply(&info),
                crate::control::proto::ok_reply(&info)
            );
        }
    }
}
