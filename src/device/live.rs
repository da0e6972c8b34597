//! A live device: its window, sizes and backend, opened complete by
//! [`Device::open`] (see the `device` module for the contract), and the
//! backend selection.

use super::params::{CacheMode, DeviceError, DeviceParams, Opening};
use super::range_lock::RangeLock;
use super::stats::Stats;
use crate::backing::Backend;
use crate::backing::align;
use crate::backing::create;
use crate::backing::file::{FileBackend, FileParts};
use crate::backing::format;
use crate::backing::identity::{FileIdentity, Pinned};
use crate::backing::lock::{ImageLock, Mode};
use crate::text::quoted_path;
use rustix::fs::Statx;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A live device. See the module documentation.
///
/// Its fields are the crate's (the engine and the frontends read them on the
/// data path); outside the crate a device is read through its accessors and
/// made only by [`Device::open`]:
///
/// ```compile_fail,E0616
/// fn widen(dev: &mut loopd::device::Device) {
///     dev.dio_align = 1; // private field
/// }
/// ```
pub struct Device {
    pub(crate) name: String,
    pub(crate) path: PathBuf,
    /// Start of the window in the backing file.
    pub(crate) offset: u64,
    /// Size of the export (the window).
    pub(crate) size: u64,
    pub(crate) block_size: u32,
    /// NBD clients are told the block size is the minimum they may use, so
    /// strict clients (libnbd) refuse smaller or unaligned requests themselves.
    /// Off (the default), the minimum advertised is 1 byte and the block size is
    /// only preferred: unaligned requests are served (bounced, read-modify-write
    /// in direct mode) either way.
    pub(crate) strict_block_size: bool,
    /// Whether the backend bypasses any cache (`O_DIRECT`): requests must be
    /// aligned to `dio_align`, else they are bounced.
    pub(crate) direct: bool,
    /// Alignment a request needs to go straight to the backend (1 if buffered).
    pub(crate) dio_align: u32,
    pub(crate) read_only: bool,
    /// Read-only because the image could not be opened for writing (a
    /// read-only mount, mode 0444), not because it was asked.
    pub(crate) write_protected: bool,
    /// Length of the backing data as last seen; writes that pass it take an
    /// exclusive range because they change its size.
    pub(crate) file_size: AtomicU64,
    pub(crate) lock: RangeLock,
    /// Counters; shared by every configuration a device goes through.
    pub(crate) stats: Arc<Stats>,
    /// Why the cache mode is what it is (for the start-up line).
    pub(crate) cache_note: String,
    /// This open created the image (`create`), so undoing it removes the file.
    pub(crate) created: bool,
    /// Buffered reads try the backend's cache inline first (seed 004).
    pub(crate) inline_reads: bool,
    /// Small whole-page buffered writes are copied into the cache inline.
    pub(crate) inline_writes: bool,
    /// The backing file lives on a local disk filesystem (or is a block device):
    /// an inline write the filesystem refuses to do with `RWF_NOWAIT` may still be
    /// copied inline, blocking — it waits for the journal or writeback of a local
    /// disk, never for a server (FUSE, NFS, ...), whose files' writes always go
    /// through the ring.
    pub(crate) local_fs: bool,
    /// The filesystem takes `RWF_NOWAIT` buffered writes (cleared at the first
    /// `EOPNOTSUPP`).
    pub(crate) nowait_writes: AtomicBool,
    /// Large buffered reads are spliced from the page cache to the socket.
    pub(crate) splice_reads: bool,
    /// Where the bytes are (see [`crate::backing`]).
    pub(crate) backend: Backend,
}

/// What a device's open found out, besides its backend.
struct Shape {
    size: u64,
    block_size: u32,
    read_only: bool,
    write_protected: bool,
    file_size: u64,
    cache_note: String,
    local_fs: bool,
}

/// Whether `f` is on a filesystem whose I/O waits only for local disks (or is a
/// block device), never for a server or a user-space process.
fn on_local_disk(f: &File) -> bool {
    const LOCAL: [i64; 6] = [
        0xEF53,      // ext2/3/4
        0x5846_5342, // xfs
        0x9123_683E, // btrfs
        0x0102_1994, // tmpfs
        0xF2F5_2010, // f2fs
        0x6264_6576, // bdev
    ];
    match rustix::fs::fstatfs(f) {
        #[allow(clippy::unnecessary_cast)]
        Ok(st) => LOCAL.contains(&(st.f_type as i64)),
        Err(_) => false,
    }
}

fn valid_block_size(bs: u32) -> bool {
    bs.is_power_of_two() && (512..=4096).contains(&bs)
}

/// Open the image for the device: read-write unless read-only was asked; an
/// image the filesystem will not let us write (EROFS, EACCES, EPERM: a
/// read-only mount, mode 0444) is opened read-only instead, with a notice, as
/// losetup does. Returns the file, its `statx` (size, type, direct-I/O
/// alignment) and whether the device is read-only.
fn open_plain(p: &DeviceParams, pinned: &Pinned) -> Result<(File, Statx, bool), DeviceError> {
    let err = |source| DeviceError::Open {
        path: p.path.clone(),
        source,
    };
    match pinned.open_statx(p.read_only, false) {
        Ok((f, st)) => Ok((f, st, p.read_only)),
        Err(e) if !p.read_only && crate::backing::write_protected(&e) => {
            let why = e.to_string();
            let (f, st) = pinned.open_statx(true, false).map_err(|_| err(e))?;
            tracing::info!(
                "{} is write-protected ({why}): serving it read-only",
                quoted_path(&p.path)
            );
            Ok((f, st, true))
        }
        Err(e) => Err(err(e)),
    }
}

/// Create an image of `size` bytes at `path`, sparse or (`preallocate`) with
/// every block allocated, if nothing is there (see
/// [`crate::backing::create`]). `Ok(false)`: someone else created it.
fn create_image(path: &Path, size: u64, preallocate: bool) -> Result<bool, DeviceError> {
    create::create_image(path, size, preallocate).map_err(|source| DeviceError::Create {
        path: path.to_path_buf(),
        source,
    })
}

/// The export's size: `p`'s window over data of `file_size` bytes.
fn window(p: &DeviceParams, file_size: u64, block_size: u32) -> Result<u64, DeviceError> {
    if p.offset % u64::from(block_size) != 0 {
        return Err(DeviceError::UnalignedOffset {
            offset: p.offset,
            block_size,
        });
    }
    let size = match p.size_limit {
        Some(limit) => {
            if limit == 0 || limit % u64::from(block_size) != 0 {
                return Err(DeviceError::BadSizeLimit(limit, block_size));
            }
            limit
        }
        None => {
            if p.offset > file_size {
                return Err(DeviceError::OffsetPastEnd {
                    path: p.path.clone(),
                    offset: p.offset,
                    size: file_size,
                });
            }
            // Round a ragged tail up to a whole block: the bytes past the end of
            // the file read as zeros (and a write there extends the file).
            (file_size - p.offset).div_ceil(u64::from(block_size)) * u64::from(block_size)
        }
    };
    if size == 0 {
        return Err(DeviceError::Empty);
    }
    // Files cannot reach past i64::MAX (off_t): refuse windows that would, so
    // no offset arithmetic on the data path can overflow.
    if p.offset
        .checked_add(size)
        .is_none_or(|end| end > i64::MAX as u64 - (1 << 20))
    {
        return Err(DeviceError::TooLarge {
            offset: p.offset,
            size,
        });
    }
    Ok(size)
}

fn dup(f: &File, path: &Path) -> Result<File, DeviceError> {
    f.try_clone().map_err(|source| DeviceError::Open {
        path: path.to_path_buf(),
        source,
    })
}

impl Device {
    /// Validate `p`, open and probe the file, and return a complete device.
    pub fn open(p: &DeviceParams) -> Result<Device, DeviceError> {
        Self::open_with_stats(p, Arc::default())
    }

    /// As [`Device::open`], counting into existing `stats` (a reconfiguration).
    /// An image this call creates is removed again if the open then fails.
    pub fn open_with_stats(p: &DeviceParams, stats: Arc<Stats>) -> Result<Device, DeviceError> {
        if let Some(bs) = p.block_size {
            if !valid_block_size(bs) {
                return Err(DeviceError::BadBlockSize(bs));
            }
        }
        // The backend selection: an RBD image (`rbd:` or a live RBD
        // device's handle), else the local file, unless a test build asks
        // for memory (see `crate::backing::mem`).
        if let Some(r) = super::rbd::wanted(p) {
            return Self::open_rbd(p, stats, r);
        }
        #[cfg(feature = "test-backend")]
        if let Some(mem) = Self::memory_of(p) {
            return Self::open_memory(p, stats, mem);
        }
        let created = match (p.create, &p.opening) {
            (Some(size), Opening::First) if !p.path.exists() => {
                create_image(&p.path, size, p.preallocate)?
            }
            _ => false,
        };
        match Self::open_existing(p, stats, created) {
            Ok(mut d) => {
                d.created = created;
                Ok(d)
            }
            Err(e) => {
                if created {
                    let _ = std::fs::remove_file(&p.path);
                }
                Err(e)
            }
        }
    }

    fn open_existing(
        p: &DeviceParams,
        stats: Arc<Stats>,
        created: bool,
    ) -> Result<Device, DeviceError> {
        let pinned = match &p.opening {
            Opening::First => Arc::new(Pinned::first(&p.path)?),
            Opening::Recorded(Some(id)) => Arc::new(Pinned::again(&p.path, id)?),
            Opening::Recorded(None) => Arc::new(Pinned::unrecorded(&p.path)?),
            Opening::Same(x) => Arc::clone(x),
            Opening::Rbd(_) => {
                return Err(DeviceError::Open {
                    path: p.path.clone(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "an RBD device's reconfiguration names no file",
                    ),
                });
            }
            #[cfg(feature = "test-backend")]
            Opening::Memory(_) => {
                return Err(DeviceError::Open {
                    path: p.path.clone(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "a memory device's reconfiguration names no memory",
                    ),
                });
            }
        };
        let (plain, st, read_only) = open_plain(p, &pinned)?;
        let write_protected = read_only && !p.read_only;
        let ft = rustix::fs::FileType::from_raw_mode(st.stx_mode.into());
        let file_size = match ft {
            rustix::fs::FileType::RegularFile => st.stx_size,
            rustix::fs::FileType::BlockDevice => {
                rustix::fs::seek(&plain, rustix::fs::SeekFrom::End(0)).map_err(|e| {
                    DeviceError::Stat {
                        path: p.path.clone(),
                        source: e.into(),
                    }
                })?
            }
            _ => {
                return Err(DeviceError::NotAFile {
                    path: p.path.clone(),
                });
            }
        };
        let mode = Mode {
            read_only,
            shared: p.shared,
        };
        let image_lock = ImageLock::acquire_on(&p.path, &plain, pinned.key(), &p.name, mode)?;
        // Whether to look for a container format (after the direct
        // descriptor is open: the probe reads through it if there is one).
        let probe_format = p.format.is_none() && !created && !image_lock.is_reconfiguration();
        let align = align::of_statx(&st);
        let local_fs = on_local_disk(&plain);
        let default_bs = align.offset.clamp(512, 4096);
        let block_size = p.block_size.unwrap_or(if valid_block_size(default_bs) {
            default_bs
        } else {
            512
        });

        let (file, direct, cache_note) = match p.cache {
            CacheMode::Buffered => (
                dup(&plain, &p.path)?,
                false,
                "buffered (page cache), as asked".to_string(),
            ),
            CacheMode::Direct => {
                if !align.supported {
                    return Err(DeviceError::DirectRefused {
                        path: p.path.clone(),
                        source: None,
                    });
                }
                let f = pinned
                    .open(read_only, true)
                    .map_err(|e| DeviceError::DirectRefused {
                        path: p.path.clone(),
                        source: Some(e),
                    })?;
                (
                    f,
                    true,
                    format!("direct I/O, alignment {} ({})", align.offset, align.source),
                )
            }
            CacheMode::Auto => match (align.supported, pinned.open(read_only, true)) {
                (true, Ok(f)) => (
                    f,
                    true,
                    format!(
                        "direct I/O (auto), alignment {} ({})",
                        align.offset, align.source
                    ),
                ),
                (_, Err(e)) => (
                    dup(&plain, &p.path)?,
                    false,
                    format!("buffered (auto): the filesystem refused O_DIRECT: {e}"),
                ),
                (false, Ok(_)) => (
                    dup(&plain, &p.path)?,
                    false,
                    "buffered (auto): statx says direct I/O is unsupported here".into(),
                ),
            },
        };

        if probe_format {
            if direct {
                format::check_raw_direct(&p.path, &file, align.offset, &plain)?;
            } else {
                format::check_raw(&p.path, &plain)?;
            }
        }
        let size = window(p, file_size, block_size)?;
        let backend = Backend::File(FileBackend::new(FileParts {
            file,
            plain,
            direct,
            align,
            local: local_fs,
            image_lock,
            pinned,
        }));
        Ok(Device::assemble(
            p,
            stats,
            Shape {
                size,
                block_size,
                read_only,
                write_protected,
                file_size,
                cache_note,
                local_fs,
            },
            backend,
        ))
    }

    /// A device of `p` over `backend`, whose open found `shape`.
    fn assemble(p: &DeviceParams, stats: Arc<Stats>, shape: Shape, backend: Backend) -> Device {
        let caps = backend.caps();
        Device {
            name: p.name.clone(),
            path: p.path.clone(),
            offset: p.offset,
            size: shape.size,
            block_size: shape.block_size,
            strict_block_size: p.strict_block_size,
            direct: caps.direct,
            dio_align: backend.dio_align(),
            read_only: shape.read_only,
            write_protected: shape.write_protected,
            file_size: AtomicU64::new(shape.file_size),
            lock: if p.whole_device_lock {
                RangeLock::whole_device()
            } else {
                RangeLock::default()
            },
            stats,
            cache_note: shape.cache_note,
            created: false,
            inline_reads: !p.no_inline_reads && caps.inline_cached,
            inline_writes: !p.no_inline_writes && caps.inline_cached,
            local_fs: shape.local_fs,
            nowait_writes: AtomicBool::new(true),
            splice_reads: !p.no_splice && caps.splice,
            backend,
        }
    }

    /// A device on an RBD image (see the `rbd` module of the device).
    fn open_rbd(
        p: &DeviceParams,
        stats: Arc<Stats>,
        w: super::rbd::Wanted,
    ) -> Result<Device, DeviceError> {
        let o = super::rbd::open(p, w)?;
        let block_size = p.block_size.unwrap_or(512);
        let size = window(p, o.image_size, block_size)?;
        if !super::rbd::window_fits(p.offset, size, o.image_size, block_size) {
            return Err(DeviceError::NotForRbd {
                spec: o.img.spec().to_string(),
                what: "the window reaches past the end of the image, which does not grow \
                       (`rbd resize` it first)",
            });
        }
        let shape = Shape {
            size,
            block_size,
            read_only: o.read_only,
            write_protected: o.write_protected,
            file_size: o.image_size,
            cache_note: o.cache_note,
            local_fs: false,
        };
        Ok(Device::assemble(p, stats, shape, Backend::Rbd(o.img)))
    }

    /// The memory a device of `p` is served from, if a test build asks for
    /// it (a reconfiguration keeps the memory it has).
    #[cfg(feature = "test-backend")]
    fn memory_of(p: &DeviceParams) -> Option<Result<crate::backing::mem::MemBackend, String>> {
        match &p.opening {
            Opening::Memory(m) => Some(Ok(m.clone())),
            _ => crate::backing::mem::select(&p.path, p.create),
        }
    }

    /// A memory device (feature `test-backend`): see [`crate::backing::mem`].
    #[cfg(feature = "test-backend")]
    fn open_memory(
        p: &DeviceParams,
        stats: Arc<Stats>,
        mem: Result<crate::backing::mem::MemBackend, String>,
    ) -> Result<Device, DeviceError> {
        let mem = mem.map_err(|why| DeviceError::Open {
            path: p.path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, why),
        })?;
        let block_size = p.block_size.unwrap_or(512);
        let size = window(p, mem.len(), block_size)?;
        let shape = Shape {
            size,
            block_size,
            read_only: p.read_only,
            write_protected: false,
            file_size: mem.len(),
            cache_note: "memory (test backend)".to_string(),
            local_fs: true,
        };
        Ok(Device::assemble(p, stats, shape, Backend::Mem(mem)))
    }

    /// How a reconfiguration finds this device's storage again: the same
    /// file (never by path), or the same memory.
    pub fn reopening(&self) -> Opening {
        match &self.backend {
            Backend::File(f) => Opening::Same(Arc::clone(f.pinned())),
            #[cfg(feature = "test-backend")]
            Backend::Mem(m) => Opening::Memory(m.clone()),
            Backend::Rbd(r) => Opening::Rbd(Arc::clone(r)),
        }
    }

    /// Whether the image path still names the file the device serves (a
    /// memory device has no path: yes).
    pub fn path_still_names_it(&self) -> bool {
        self.backend
            .as_file()
            .is_none_or(|f| f.pinned().path_still_names_it())
    }

    /// The identity of the image file, for the state file (none in memory).
    pub fn identity(&self) -> Option<&FileIdentity> {
        self.backend.as_file().map(|f| f.pinned().identity())
    }

    /// The owner an RBD device took its image's exclusive lock as, for the
    /// state file (see `crate::backing::rbd::lock`).
    pub fn rbd_lock_owner(&self) -> Option<String> {
        self.backend.as_rbd()?.lock_owner().map(str::to_owned)
    }

    /// Make every acknowledged write durable (on a control thread).
    pub fn sync_data(&self) -> std::io::Result<()> {
        self.backend.sync_data()
    }

    /// The device is detached: its image lock lets an attach in its way
    /// wait for it to go (see [`ImageLock::retire`]).
    pub fn retire(&self) {
        if let Backend::File(f) = &self.backend {
            f.image_lock().retire();
        }
    }

    /// Where the device's bytes are.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Start of the window in the backing data.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Size of the export (the window).
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn strict_block_size(&self) -> bool {
        self.strict_block_size
    }

    /// Whether requests go around the cache (`O_DIRECT`).
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Alignment a request needs to go straight to the backend (1 if buffered).
    pub fn dio_align(&self) -> u32 {
        self.dio_align
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn write_protected(&self) -> bool {
        self.write_protected
    }

    /// The backing data's length as last seen.
    pub fn file_size(&self) -> u64 {
        self.file_size.load(Ordering::Relaxed)
    }

    /// The backing data's length now, asked of the backend (for what is
    /// shown to people: the file may have grown since the device opened
    /// it); what was last seen if the backend cannot tell. Changes nothing:
    /// the data path and the RBD follower keep their last-seen size.
    pub fn file_size_now(&self) -> u64 {
        match self.backend.current_len() {
            0 => self.file_size(),
            n => n,
        }
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Why the cache mode is what it is (for the start-up line).
    pub fn cache_note(&self) -> &str {
        &self.cache_note
    }

    /// This open created the image.
    pub fn created(&self) -> bool {
        self.created
    }

    /// Offset in the backing file of export offset `off` (checked by the caller
    /// against `size`, so this cannot overflow for a window that fits in u64).
    pub fn file_offset(&self, off: u64) -> u64 {
        self.offset.saturating_add(off)
    }

    /// Note that the file now extends at least to `end`.
    pub fn grew_to(&self, end: u64) {
        self.file_size.fetch_max(end, Ordering::Relaxed);
    }

    /// Whether a write ending at file offset `end` would change the file's size.
    pub fn extends_file(&self, end: u64) -> bool {
        end > self.file_size.load(Ordering::Relaxed)
    }
}
