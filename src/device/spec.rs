//! A device as the user configures it: the shape of `attach`, of `--config`
//! entries and of state-file records (the control protocol carries it as is).
//! Pure data; opening it is [`super::Device::open`]'s job.

use super::CacheMode;
use crate::backing::format::ImageFormat;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A device as configured: used by `attach`, the `--config` file and the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
}

fn is_false(b: &bool) -> bool {
    !*b
}
