//! A device as the user configures it: the shape of `attach`, of `--config`
//! entries and of state-file records (the control protocol carries it as is).
//! Pure data; opening it is [`super::Device::open`]'s job.

use super::CacheMode;
use crate::backing::format::ImageFormat;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A device as configured: used by `attach`, the `--config` file and the state file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub image: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Advertise the block size as the NBD minimum block size, so clients
    /// refuse unaligned requests themselves; default: minimum 1, the block
    /// size only preferred, every request served.
    #[serde(default, skip_serializing_if = "is_false")]
    pub strict_block_size: bool,
    #[serde(default)]
    pub cache: CacheMode,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub autoclear: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create: Option<u64>,
    /// Let other writers (QEMU, other devices) use the image too (QEMU's
    /// force-share); default: refuse an image another writer holds.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shared: bool,
    /// The declared image format (`raw`); absent: probe and refuse non-raw images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<ImageFormat>,
    /// Also give the device to the kernel as a block device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blockdev: Option<Blockdev>,
    /// ublk: hardware queues (default: one per reactor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<u16>,
    /// ublk: requests in flight per queue (default 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<u16>,
    /// nbd: connections to the kernel's NBD client (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<u16>,
    /// Return from attach only once the partition devices exist.
    #[serde(default, skip_serializing_if = "is_false")]
    pub partscan: bool,
    /// Recorded by the daemon: the ublk device id this device was given, so a
    /// restarted daemon recovers the same `/dev/ublkbN`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_id: Option<u32>,
    /// TLS client identities allowed to open the device over NBD (see
    /// `crate::tls::allowed`); empty: every client. A client that does not
    /// prove one of them is told the device does not exist.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tls_allow: Vec<String>,
}

/// Which kernel block device driver a device is handed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Blockdev {
    /// ublk (`/dev/ublkbN`; Linux 6.0+, module `ublk_drv`).
    Ublk,
    /// The kernel's NBD client (`/dev/nbdN`; module `nbd`), connected to the
    /// device's own export over socket pairs.
    Nbd,
}

fn is_false(b: &bool) -> bool {
    !*b
}
