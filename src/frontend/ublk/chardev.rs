//! A device's I/O char device (/dev/ublkcN) and each queue's descriptor array.
//!
//! The driver allows ONE open of /dev/ublkcN at a time (a second gets EBUSY), so
//! a device has one [`UblkChar`], shared by its queues (`Arc` it). Each queue maps
//! its own read-only [`QueueDescs`]; the mapping keeps the char device's file
//! alive, so the device counts as released (needed by DEL_DEV, which waits for it,
//! and by START_USER_RECOVERY) only once the fd AND every mapping are dropped.
//!
//! Reading a descriptor is a volatile copy of 24 bytes. It is meaningful only for
//! a tag in the `Owned` state ([`super::tags`]): the driver writes the descriptor
//! before it posts the CQE that hands the tag over (the CQ tail is read with
//! acquire ordering), and does not touch it again until the tag is committed.

use rustix::io::Errno;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::time::{Duration, Instant};
use thiserror::Error;

use super::sys::{UBLK_MAX_QUEUE_DEPTH, UblksrvIoDesc, queue_desc_bytes, queue_desc_offset};

#[derive(Debug, Error)]
pub enum CharError {
    #[error("{path} did not appear within {waited:?} (is udev/devtmpfs running?)")]
    Missing { path: PathBuf, waited: Duration },
    #[error("{path} is already open: another server is serving this ublk device")]
    Busy { path: PathBuf },
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("queue depth {0} is not in 1..=4096")]
    Depth(u16),
    #[error("cannot map the descriptors of queue {q_id} (depth {depth})")]
    Map {
        q_id: u16,
        depth: u16,
        #[source]
        source: Errno,
    },
}

/// The open /dev/ublkcN of one device.
#[derive(Debug)]
pub struct UblkChar {
    file: File,
    dev_id: u32,
}

impl UblkChar {
    pub fn path(dev_id: u32) -> PathBuf {
        PathBuf::from(format!("/dev/ublkc{dev_id}"))
    }

    /// Open /dev/ublkc`dev_id`, waiting up to `wait` for the node to appear
    /// (udev creates it after ADD_DEV). Blocks the caller for at most `wait`.
    pub fn open(dev_id: u32, wait: Duration) -> Result<Self, CharError> {
        let path = Self::path(dev_id);
        let start = Instant::now();
        loop {
            match OpenOptions::new().read(true).write(true).open(&path) {
                Ok(file) => return Ok(UblkChar { file, dev_id }),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    if start.elapsed() >= wait {
                        return Err(CharError::Missing { path, waited: wait });
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    return Err(CharError::Busy { path });
                }
                Err(source) => return Err(CharError::Open { path, source }),
            }
        }
    }

    pub fn dev_id(&self) -> u32 {
        self.dev_id
    }

    /// The fd to issue I/O commands on.
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl AsFd for UblkChar {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// One queue's descriptor array, mapped read-only; unmapped on drop.
#[derive(Debug)]
pub struct QueueDescs {
    base: NonNull<UblksrvIoDesc>,
    bytes: usize,
    depth: u16,
    q_id: u16,
}

// SAFETY: the mapping is plain shared memory owned by this value; it is only read
// (volatile copies), so moving it to another thread is fine.
unsafe impl Send for QueueDescs {}
// SAFETY: `&QueueDescs` only allows volatile reads of the mapping; concurrent
// reads from several threads are as good as from one.
unsafe impl Sync for QueueDescs {}

impl QueueDescs {
    /// Map queue `q_id`'s `depth` descriptors of `dev`.
    pub fn map(dev: &UblkChar, q_id: u16, depth: u16) -> Result<Self, CharError> {
        if depth == 0 || depth > UBLK_MAX_QUEUE_DEPTH {
            return Err(CharError::Depth(depth));
        }
        let page = rustix::param::page_size();
        let bytes = queue_desc_bytes(depth, page);
        let offset = queue_desc_offset(q_id, page);
        let off = libc::off_t::try_from(offset).map_err(|_| CharError::Map {
            q_id,
            depth,
            source: Errno::OVERFLOW,
        })?;
        // SAFETY: a fresh shared read-only mapping placed by the kernel (null
        // hint): it aliases no Rust object. The driver checks offset and length.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                dev.raw_fd(),
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(CharError::Map {
                q_id,
                depth,
                source: Errno::from_io_error(&std::io::Error::last_os_error())
                    .unwrap_or(Errno::INVAL),
            });
        }
        let base = NonNull::new(ptr.cast::<UblksrvIoDesc>()).ok_or(CharError::Map {
            q_id,
            depth,
            source: Errno::INVAL,
        })?;
        Ok(QueueDescs {
            base,
            bytes,
            depth,
            q_id,
        })
    }

    pub fn q_id(&self) -> u16 {
        self.q_id
    }

    pub fn depth(&self) -> u16 {
        self.depth
    }

    /// A copy of `tag`'s descriptor, or `None` past the depth.
    pub fn get(&self, tag: u16) -> Option<UblksrvIoDesc> {
        if tag >= self.depth {
            return None;
        }
        // SAFETY: tag < depth and the mapping holds `depth` descriptors (the
        // length is rounded up to a page), page-aligned so each is aligned. The
        // kernel may write it concurrently, hence a volatile read of plain-old
        // data where every bit pattern is valid.
        Some(unsafe { self.base.as_ptr().add(usize::from(tag)).read_volatile() })
    }
}

impl Drop for QueueDescs {
    fn drop(&mut self) {
        // SAFETY: base/bytes are exactly what mmap returned; no reference into
        // the mapping outlives `self` (get() returns copies).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}
