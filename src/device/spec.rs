//! A device as the user configures it: the shape of `attach`, of `--config`
//! entries and of state-file records (the control protocol carries it as is).
//! Pure data; opening it is [`super::Device::open`]'s job.

use super::params::CacheMode;
use crate::backing::format::ImageFormat;
use crate::backing::identity::FileIdentity;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A device as configured: used by `attach`, the `--config` file and the state file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub image: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Sizes are numbers of bytes, or strings with a suffix (`"1G"`, `"4k"`)
    /// as on the command line; they are written back as numbers.
    #[serde(default, deserialize_with = "sizes::bytes")]
    pub offset: u64,
    /// The window's size: as on the command line ([`crate::size::parse_limit`]),
    /// `"none"` or `0` is no limit (to the end of the file).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "sizes::opt_limit"
    )]
    pub size_limit: Option<u64>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "sizes::opt_block"
    )]
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
    /// Create a sparse image of this size if `image` does not exist.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "sizes::opt_bytes"
    )]
    pub create: Option<u64>,
    /// With `create`: allocate every block of the new image (`fallocate`)
    /// instead of making it sparse. Not recorded (like `create`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub preallocate: bool,
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
    /// ublk: never use zero copy (`UBLK_F_AUTO_BUF_REG`, Linux 6.16+), where
    /// the device would have it (`--cache direct` on a local file, aligned):
    /// every request's data is copied through a buffer of loopd's.
    #[serde(default, skip_serializing_if = "is_false")]
    pub no_zero_copy: bool,
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
    /// Recorded by the daemon: the identity of the image file the first open
    /// found (see `crate::backing::identity`), so that a restart or a retry
    /// opens that file or nothing. Ignored in an `attach` request and a
    /// config file: an attach records what it opens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<FileIdentity>,
    /// An `rbd:` image: the Ceph configuration file (default
    /// `/etc/ceph/ceph.conf`). Keys stay in the keyring it names, never here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceph_conf: Option<PathBuf>,
    /// An `rbd:` image: the Ceph client id, without `client.` (default `admin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceph_id: Option<String>,
    /// An `rbd:` image: the RADOS operation timeout, seconds (default 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceph_timeout: Option<u64>,
    /// Recorded by the daemon: the owner (RADOS client address) its open
    /// took the `rbd:` image's exclusive lock as, so that a daemon restarted
    /// after a crash takes the lock back from its dead self at once (see
    /// `crate::backing::rbd::lock`). Ignored in an `attach` request and a
    /// config file: only the daemon's own record is believed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rbd_lock_owner: Option<String>,
}

impl DeviceSpec {
    /// Whether the image is an RBD image (`rbd:...`), not a file.
    pub fn is_rbd(&self) -> bool {
        self.image
            .to_str()
            .is_some_and(crate::backing::rbd::spec::is_rbd)
    }
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

/// Sizes in config files and requests: a number of bytes or a string such as
/// `"1G"` or `"1.5M"` (see [`crate::size::parse_size`]).
mod sizes {
    use serde::{Deserialize, Deserializer, de::Error};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }

    fn value(s: Size) -> Result<u64, String> {
        match s {
            Size::Bytes(n) => Ok(n),
            Size::Text(t) => crate::size::parse_size(&t).map_err(|e| e.to_string()),
        }
    }

    pub fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        value(Size::deserialize(d)?).map_err(D::Error::custom)
    }

    pub fn opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Option::<Size>::deserialize(d)?
            .map(value)
            .transpose()
            .map_err(D::Error::custom)
    }

    /// A size limit: a number (0: none), `"none"` or a size string, read by
    /// the command line's parser.
    pub fn opt_limit<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match Option::<Size>::deserialize(d)? {
            None => Ok(None),
            Some(Size::Bytes(n)) => Ok(crate::size::limit_of(n)),
            Some(Size::Text(t)) => crate::size::parse_limit(&t).map_err(D::Error::custom),
        }
    }

    pub fn opt_block<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        match opt_bytes(d)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| D::Error::custom(format!("block size {n} is too large"))),
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_numbers_or_suffixed_strings() {
        let t: DeviceSpec = toml::from_str(
            "image = \"/a.img\"\noffset = \"1M\"\nsize_limit = \"2G\"\nblock_size = \"4k\"\ncreate = 4096\n",
        )
        .unwrap();
        assert_eq!(t.offset, 1 << 20);
        assert_eq!(t.size_limit, Some(2 << 30));
        assert_eq!(t.block_size, Some(4096));
        assert_eq!(t.create, Some(4096));
        // Written back as numbers; read back the same.
        let j = serde_json::to_string(&t).unwrap();
        assert!(j.contains("\"size_limit\":2147483648"), "{j}");
        assert_eq!(serde_json::from_str::<DeviceSpec>(&j).unwrap(), t);
        let e = toml::from_str::<DeviceSpec>("image = \"/a\"\nsize_limit = \"lots\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a size"), "{e}");
        // A limit of `none` or 0 is no limit, as on the command line.
        for none in ["\"none\"", "0", "\"0\""] {
            let t: DeviceSpec =
                toml::from_str(&format!("image = \"/a\"\nsize_limit = {none}\n")).unwrap();
            assert_eq!(t.size_limit, None, "{none}");
        }
        // qemu's cache names, as on the command line.
        for (qemu, mode) in [
            ("none", CacheMode::Direct),
            ("writeback", CacheMode::Buffered),
        ] {
            let t: DeviceSpec =
                toml::from_str(&format!("image = \"/a\"\ncache = \"{qemu}\"\n")).unwrap();
            assert_eq!(t.cache, mode, "{qemu}");
        }
        let d: DeviceSpec = serde_json::from_str(r#"{"image":"/a"}"#).unwrap();
        assert_eq!((d.offset, d.size_limit), (0, None));
    }
}
