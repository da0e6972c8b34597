//! What opening a device takes: the cache mode a user asks for, how the
//! image file is found ([`Opening`]), the parameters ([`DeviceParams`]), and
//! what can go wrong ([`DeviceError`]).

use crate::backing::create::CreateError;
use crate::backing::format::{ImageFormat, RawError};
use crate::backing::identity::{FileIdentity, IdentityError, Pinned};
use crate::backing::lock::LockError;
use crate::text::quoted_path;
use std::path::PathBuf;
use std::sync::Arc;
use thiserror::Error;

/// The cache mode a user asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// Direct I/O where the filesystem allows it, else buffered (and say so).
    #[default]
    Auto,
    /// `O_DIRECT`; fail if the filesystem refuses it. Also read as `none`
    /// (qemu's `cache=none`), as on the command line.
    #[serde(alias = "none")]
    Direct,
    /// Through the page cache. Also read as `writeback` (qemu's).
    #[serde(alias = "writeback")]
    Buffered,
}

/// How a device finds its image file.
#[derive(Debug, Clone, Default)]
pub enum Opening {
    /// By its path, as given (an attach): the file's identity is recorded.
    #[default]
    First,
    /// By its path, only if it names the recorded file (a device of the state
    /// file coming back); `None`: recorded by an older loopd without one.
    Recorded(Option<FileIdentity>),
    /// The file a live device already has (a reconfiguration): no path lookup.
    Same(Arc<Pinned>),
    /// The memory a live memory device already has (a reconfiguration).
    #[cfg(feature = "test-backend")]
    Memory(crate::backing::mem::MemBackend),
    /// The RBD image a live RBD device already has open (a reconfiguration:
    /// the same handle, its exclusive lock kept).
    Rbd(Arc<crate::backing::rbd::RbdImage>),
}

/// Everything needed to open a device.
#[derive(Debug, Clone, Default)]
pub struct DeviceParams {
    pub path: PathBuf,
    /// How the image file is found.
    pub opening: Opening,
    pub name: String,
    pub offset: u64,
    pub size_limit: Option<u64>,
    pub block_size: Option<u32>,
    /// Advertise the block size as the NBD minimum block size (see
    /// [`Device::strict_block_size`]).
    pub strict_block_size: bool,
    pub cache: CacheMode,
    pub read_only: bool,
    /// Create a file of this size if `path` does not exist: sparse, unless
    /// `preallocate`.
    pub create: Option<u64>,
    /// `create` allocates every block of the new file (`fallocate`).
    pub preallocate: bool,
    /// Benchmark switch: one lock for the whole device instead of ranges.
    pub whole_device_lock: bool,
    /// Benchmark switch: buffered reads never try the page cache inline.
    pub no_inline_reads: bool,
    /// Benchmark switch: buffered writes always go through the ring.
    pub no_inline_writes: bool,
    /// Benchmark switch: large buffered reads are copied, never spliced.
    pub no_splice: bool,
    /// Share the image with other writers on purpose (QEMU's force-share).
    pub shared: bool,
    /// The format the user declared; `None`: probe, and refuse a non-raw image.
    pub format: Option<ImageFormat>,
    /// An `rbd:` image: the Ceph configuration file (default
    /// `/etc/ceph/ceph.conf`).
    pub ceph_conf: Option<PathBuf>,
    /// An `rbd:` image: the Ceph client id, without `client.` (default `admin`).
    pub ceph_id: Option<String>,
    /// An `rbd:` image: the RADOS operation timeout in seconds (default 8).
    pub ceph_timeout: Option<u64>,
    /// An `rbd:` image: the exclusive-lock owner this daemon's previous run
    /// recorded, whose lock is taken back if it still holds it (see
    /// `crate::backing::rbd::lock`). Only from the daemon's own state file.
    pub rbd_take_back: Option<String>,
}

#[derive(Debug, Error)]
pub enum DeviceError {
    #[error("block size {0} is not a power of two between 512 and 4096")]
    BadBlockSize(u32),
    #[error("cannot create {}", quoted_path(.path))]
    Create {
        path: PathBuf,
        #[source]
        source: CreateError,
    },
    #[error("cannot open {}", quoted_path(.path))]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{}: the filesystem refuses direct I/O (O_DIRECT); use --cache buffered or auto",
        quoted_path(.path)
    )]
    DirectRefused {
        path: PathBuf,
        #[source]
        source: Option<std::io::Error>,
    },
    #[error("{} is not a regular file or block device", quoted_path(.path))]
    NotAFile { path: PathBuf },
    #[error(
        "offset {offset} is beyond the end of {} ({size} bytes); give --size-limit to serve past the end",
        quoted_path(.path)
    )]
    OffsetPastEnd {
        path: PathBuf,
        offset: u64,
        size: u64,
    },
    #[error("offset {offset} is not a multiple of the block size {block_size}")]
    UnalignedOffset { offset: u64, block_size: u32 },
    #[error("size limit {0} is not a positive multiple of the block size {1}")]
    BadSizeLimit(u64, u32),
    #[error("the export would be empty")]
    Empty,
    #[error("a window of {size} bytes at offset {offset} reaches past the largest possible file")]
    TooLarge { offset: u64, size: u64 },
    #[error("cannot stat {}", quoted_path(.path))]
    Stat {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error(transparent)]
    Raw(#[from] RawError),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(transparent)]
    Rbd(#[from] crate::backing::rbd::RbdError),
    #[error("{spec}: {what}")]
    NotForRbd { spec: String, what: &'static str },
}
