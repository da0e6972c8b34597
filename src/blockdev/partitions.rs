//! Partitions of a whole-disk block device, ready to use: [`settle`] makes
//! sure the kernel has scanned the partition table, reads the partitions it
//! found from sysfs and waits, bounded, until each one's `/dev` node exists
//! and is that partition (a block device with the partition's number), so a
//! caller can print the list and the user can `mkfs` at once.
//!
//! When the kernel scans depends on the driver (Linux 6.12):
//! - loop: `LOOP_CONFIGURE` with `LO_FLAGS_PARTSCAN`, or `LOOP_SET_STATUS64`
//!   turning it on, scans before the ioctl returns → [`Rescan::AlreadyDone`].
//! - ublk: `START_DEV` adds the disk, and `add_disk` scans before it returns
//!   (unless the device is unprivileged, which suppresses scanning)
//!   → [`Rescan::AlreadyDone`].
//! - nbd: setting the size (connect, reconfigure, resize) only marks the disk
//!   `GD_NEED_PART_SCAN`; the scan runs at the next open of the whole disk
//!   → [`Rescan::FirstOpen`]. Our open waits on the disk's open mutex, so if
//!   udev's open got there first, ours returns after its scan has finished.
//! - anything else: [`Rescan::Reread`] (`BLKRRPART`; `EBUSY` while a
//!   partition is open).
//!
//! The `/dev` nodes are made by devtmpfs inside the kernel's `device_add`,
//! before the scan returns, so the wait normally ends at the first look; it
//! is there for a `/dev` populated by something slower, and ends with an error
//! naming the nodes that are missing. udev's symlinks (`/dev/disk/by-*`) are
//! not waited for.
//!
//! Blocking: the open or `BLKRRPART` waits for the kernel to read the
//! partition table through the device, so the device's server must already be
//! serving I/O (call this from a thread other than the one serving it).
//! Nothing is locked here; nothing is left open on return.

use crate::blockdev::uevent::{self, UeventError};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;

/// `BLKRRPART` (`_IO(0x12, 95)`, linux/fs.h).
const BLKRRPART: libc::c_ulong = 0x125F;

/// How often the `/dev` nodes are looked for while waiting.
const POLL: Duration = Duration::from_millis(5);

/// One partition the kernel has on the disk.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Partition {
    /// The `/dev` node, e.g. `/dev/loop3p1`.
    pub device: PathBuf,
    /// The partition number in the table (1-based; `PARTN`).
    pub number: u32,
    /// Start on the whole disk, in bytes.
    pub start: u64,
    /// Size in bytes.
    pub size: u64,
    pub major: u32,
    pub minor: u32,
}

/// What it takes to make the kernel scan the partition table now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rescan {
    /// The kernel has scanned already (loop, ublk): only read and wait.
    AlreadyDone,
    /// Open and close the whole disk read-only: runs a scan the kernel
    /// deferred to the next open (nbd).
    FirstOpen,
    /// `BLKRRPART`: drop the partitions and scan again.
    Reread,
}

#[derive(Debug, Error)]
pub enum PartitionError {
    #[error("cannot stat {0}")]
    Stat(PathBuf, #[source] io::Error),
    #[error("{0} is not a block device")]
    NotBlock(PathBuf),
    #[error("{0} is a partition, not a whole disk")]
    NotWhole(PathBuf),
    #[error("cannot read {0}")]
    Sysfs(PathBuf, #[source] io::Error),
    #[error("unexpected contents in {0}")]
    Parse(PathBuf, #[source] UeventError),
    #[error("{0}: partition size or start out of range")]
    Range(PathBuf),
    #[error("cannot open {0} to have the kernel scan its partition table")]
    Open(PathBuf, #[source] io::Error),
    #[error("BLKRRPART (re-read partition table) on {0} failed")]
    Reread(PathBuf, #[source] io::Error),
    #[error(
        "the kernel lists partition(s) {} of {disk} in sysfs, but {} did not appear in /dev \
         within {waited:?} (is devtmpfs mounted on /dev?)",
        list(found),
        list(missing)
    )]
    NodesMissing {
        disk: PathBuf,
        found: Vec<PathBuf>,
        missing: Vec<PathBuf>,
        waited: Duration,
    },
}

fn list(paths: &[PathBuf]) -> String {
    let v: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    v.join(", ")
}

/// Makes the kernel scan `whole`'s partition table (as `rescan` says), then
/// waits up to `timeout` until every partition it found has its `/dev` node;
/// returns them by partition number (empty when the disk has no partition
/// table, or when partition scanning is off for it).
pub fn settle(
    whole: &Path,
    rescan: Rescan,
    timeout: Duration,
) -> Result<Vec<Partition>, PartitionError> {
    let sys = sysfs_dir(whole)?;
    match rescan {
        Rescan::AlreadyDone => {}
        Rescan::FirstOpen => drop(open_read(whole)?),
        Rescan::Reread => {
            let f = open_read(whole)?;
            // SAFETY: BLKRRPART takes no argument; `f` is open during the call.
            let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKRRPART, 0) };
            if r < 0 {
                return Err(PartitionError::Reread(
                    whole.to_path_buf(),
                    io::Error::last_os_error(),
                ));
            }
        }
    }
    let start = Instant::now();
    loop {
        let parts = read_partitions(&sys)?;
        let missing: Vec<PathBuf> = parts
            .iter()
            .filter(|p| !node_is(p))
            .map(|p| p.device.clone())
            .collect();
        // Every node present, and the list unchanged since: not a snapshot
        // taken in the middle of somebody else's re-scan.
        if missing.is_empty() && read_partitions(&sys)? == parts {
            return Ok(parts);
        }
        let waited = start.elapsed();
        if waited >= timeout {
            if missing.is_empty() {
                return Ok(parts); // complete, though still changing
            }
            return Err(PartitionError::NodesMissing {
                disk: whole.to_path_buf(),
                found: parts.into_iter().map(|p| p.device).collect(),
                missing,
                waited,
            });
        }
        std::thread::sleep(POLL.min(timeout.saturating_sub(waited)));
    }
}

/// The partitions the kernel has on `whole` right now, from sysfs (no scan,
/// no wait; their `/dev` nodes may not exist yet).
pub fn current(whole: &Path) -> Result<Vec<Partition>, PartitionError> {
    read_partitions(&sysfs_dir(whole)?)
}

fn open_read(whole: &Path) -> Result<File, PartitionError> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(whole)
        .map_err(|e| PartitionError::Open(whole.to_path_buf(), e))
}

/// `/sys/dev/block/MAJOR:MINOR` of a whole-disk block device node.
fn sysfs_dir(whole: &Path) -> Result<PathBuf, PartitionError> {
    let md = std::fs::metadata(whole).map_err(|e| PartitionError::Stat(whole.to_path_buf(), e))?;
    if !md.file_type().is_block_device() {
        return Err(PartitionError::NotBlock(whole.to_path_buf()));
    }
    let rdev = md.rdev();
    let dir = PathBuf::from(format!(
        "/sys/dev/block/{}:{}",
        libc::major(rdev),
        libc::minor(rdev)
    ));
    if !dir.exists() {
        return Err(PartitionError::Sysfs(
            dir,
            io::Error::from(io::ErrorKind::NotFound),
        ));
    }
    if dir.join("partition").exists() {
        return Err(PartitionError::NotWhole(whole.to_path_buf()));
    }
    Ok(dir)
}

/// Whether an error reading sysfs means "this device went away while we
/// looked" (a concurrent re-scan dropped the partition).
fn gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
        || matches!(e.raw_os_error(), Some(libc::ENODEV) | Some(libc::ENXIO))
}

/// Reads one sysfs file; `None` if it is gone.
fn read_sys(path: PathBuf) -> Result<Option<(String, PathBuf)>, PartitionError> {
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(Some((s, path))),
        Err(e) if gone(&e) => Ok(None),
        Err(e) => Err(PartitionError::Sysfs(path, e)),
    }
}

fn read_partitions(sys: &Path) -> Result<Vec<Partition>, PartitionError> {
    let rd = std::fs::read_dir(sys).map_err(|e| PartitionError::Sysfs(sys.to_path_buf(), e))?;
    let mut out = Vec::new();
    for entry in rd {
        let entry = match entry {
            Ok(e) => e,
            Err(e) if gone(&e) => continue,
            Err(e) => return Err(PartitionError::Sysfs(sys.to_path_buf(), e)),
        };
        let dir = entry.path();
        if !dir.join("partition").exists() {
            continue;
        }
        if let Some(p) = read_partition(&dir)? {
            out.push(p);
        }
    }
    out.sort_by_key(|p| p.number);
    Ok(out)
}

fn read_partition(dir: &Path) -> Result<Option<Partition>, PartitionError> {
    let parse = |path: &PathBuf, e| PartitionError::Parse(path.clone(), e);
    let Some((text, path)) = read_sys(dir.join("uevent"))? else {
        return Ok(None);
    };
    let u = uevent::parse_uevent(&text).map_err(|e| parse(&path, e))?;
    let number = match u.partn {
        Some(n) => n,
        None => {
            let Some((text, path)) = read_sys(dir.join("partition"))? else {
                return Ok(None);
            };
            let n = uevent::parse_counter("partition", &text).map_err(|e| parse(&path, e))?;
            u32::try_from(n).map_err(|_| PartitionError::Range(path))?
        }
    };
    let mut sectors = [0u64; 2];
    for (slot, name) in sectors.iter_mut().zip(["start", "size"]) {
        let Some((text, path)) = read_sys(dir.join(name))? else {
            return Ok(None);
        };
        *slot = uevent::parse_counter(name, &text).map_err(|e| parse(&path, e))?;
    }
    // sysfs counts in 512-byte sectors whatever the logical block size.
    let bytes = |s: u64| {
        s.checked_mul(512)
            .ok_or_else(|| PartitionError::Range(dir.to_path_buf()))
    };
    Ok(Some(Partition {
        device: Path::new("/dev").join(&u.devname),
        number,
        start: bytes(sectors[0])?,
        size: bytes(sectors[1])?,
        major: u.major,
        minor: u.minor,
    }))
}

/// Whether `/dev/…` exists and is this partition's block device.
fn node_is(p: &Partition) -> bool {
    match std::fs::metadata(&p.device) {
        Ok(md) => {
            md.file_type().is_block_device()
                && libc::major(md.rdev()) == p.major
                && libc::minor(md.rdev()) == p.minor
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_is_not_a_block_device() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let e = settle(f.path(), Rescan::AlreadyDone, Duration::ZERO).unwrap_err();
        assert!(matches!(e, PartitionError::NotBlock(_)), "{e}");
    }

    #[test]
    fn a_missing_node_is_named() {
        let e = settle(
            Path::new("/dev/loopd-no-such-disk"),
            Rescan::FirstOpen,
            Duration::ZERO,
        )
        .unwrap_err();
        assert!(matches!(e, PartitionError::Stat(..)), "{e}");
        assert!(e.to_string().contains("/dev/loopd-no-such-disk"), "{e}");
    }

    #[test]
    fn nodes_missing_message_names_every_node() {
        let e = PartitionError::NodesMissing {
            disk: "/dev/nbd0".into(),
            found: vec!["/dev/nbd0p1".into(), "/dev/nbd0p2".into()],
            missing: vec!["/dev/nbd0p2".into()],
            waited: Duration::from_secs(10),
        };
        assert_eq!(
            e.to_string(),
            "the kernel lists partition(s) /dev/nbd0p1, /dev/nbd0p2 of /dev/nbd0 in sysfs, but \
             /dev/nbd0p2 did not appear in /dev within 10s (is devtmpfs mounted on /dev?)"
        );
    }
}
