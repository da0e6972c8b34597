//! The local-file backend: a regular file or block device, `O_DIRECT` where
//! the filesystem allows it, with a buffered descriptor beside it for what
//! needs no alignment (zero fill, metadata, splice, inline page-cache paths).
//!
//! Operations run on the reactor's ring ([`FileBackend::sqe`]); a file that is
//! not on a local disk (FUSE, NFS, ...) has them sent straight to the ring's
//! workers (`IOSQE_ASYNC`): issued inline, from the reactor's `io_uring_enter`,
//! a FUSE read can block there (its readahead waits for a slot in the FUSE
//! server's queue) and stall every connection. [`FileBackend::run`] is the
//! same operation as plain system calls (the test oracle, inline writes).
//!
//! A `FileBackend` is built complete by the device's open and never changes;
//! it holds the image lock and the pinned image file for as long as it lives.

use super::align::DioAlign;
use super::identity::Pinned;
use super::lock::ImageLock;
use super::storage::{Caps, IoOp, Storage};
use io_uring::{opcode, squeue, types};
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

/// A local image file. See the module documentation.
#[derive(Debug)]
pub struct FileBackend {
    /// The data fd: `O_DIRECT` when `direct`.
    file: File,
    /// A buffered fd on the same file (the same file as `file` when buffered).
    plain: File,
    direct: bool,
    /// Alignment a request needs to go straight to `file` (1 if buffered).
    dio_align: u32,
    align: DioAlign,
    /// On a local disk filesystem (or a block device): see the module doc.
    local: bool,
    /// This device's hold on the image lock; released when dropped.
    image_lock: ImageLock,
    /// The image file every descriptor above was opened through.
    pinned: Arc<Pinned>,
}

/// The parts of a [`FileBackend`], as the device's open found them.
pub struct FileParts {
    pub file: File,
    pub plain: File,
    pub direct: bool,
    pub align: DioAlign,
    pub local: bool,
    pub image_lock: ImageLock,
    pub pinned: Arc<Pinned>,
}

fn errno_of(e: rustix::io::Errno) -> i32 {
    -e.raw_os_error()
}

/// A byte count as an io_uring-style result (ops never exceed `u32` lengths,
/// well under `i32::MAX` for every request loopd issues).
fn res_of(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

fn len_i64(len: u64) -> libc::off_t {
    libc::off_t::try_from(len).unwrap_or(libc::off_t::MAX)
}

/// `/dev/zero`, opened once for the process (the source of
/// [`IoOp::ZeroFixed`]); `None` if it cannot be opened.
fn dev_zero() -> Option<i32> {
    static ZERO: std::sync::OnceLock<Option<File>> = std::sync::OnceLock::new();
    ZERO.get_or_init(|| File::open("/dev/zero").ok())
        .as_ref()
        .map(AsRawFd::as_raw_fd)
}

impl FileBackend {
    pub fn new(p: FileParts) -> FileBackend {
        let dio_align = if p.direct { p.align.offset.max(1) } else { 1 };
        FileBackend {
            file: p.file,
            plain: p.plain,
            direct: p.direct,
            dio_align,
            align: p.align,
            local: p.local,
            image_lock: p.image_lock,
            pinned: p.pinned,
        }
    }

    /// The direct-I/O alignment statx reported.
    pub fn align(&self) -> DioAlign {
        self.align
    }

    /// Whether the file lives on a local disk filesystem or is a block device.
    pub fn local(&self) -> bool {
        self.local
    }

    /// The data descriptor (`O_DIRECT` when direct).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The buffered descriptor.
    pub fn plain(&self) -> &File {
        &self.plain
    }

    pub fn image_lock(&self) -> &ImageLock {
        &self.image_lock
    }

    pub fn pinned(&self) -> &Arc<Pinned> {
        &self.pinned
    }

    fn fd_of(&self, plain: bool) -> i32 {
        if plain {
            self.plain.as_raw_fd()
        } else {
            self.file.as_raw_fd()
        }
    }
}

impl Storage for FileBackend {
    #[inline]
    fn caps(&self) -> Caps {
        Caps {
            direct: self.direct,
            // Through the buffered descriptor, whatever the data fd is (a
            // task takes these paths only when its data is buffered).
            inline_cached: true,
            splice: true,
            allocation_map: true,
        }
    }

    #[inline]
    fn dio_align(&self) -> u32 {
        self.dio_align
    }

    /// The io_uring entry for `op` (the caller tags it with its `user_data`).
    #[inline]
    fn sqe(&self, op: IoOp) -> Option<squeue::Entry> {
        let fd = types::Fd(self.file.as_raw_fd());
        let e = match op {
            IoOp::Read { buf, len, off } => opcode::Read::new(fd, buf, len).offset(off).build(),
            IoOp::Write {
                buf,
                len,
                off,
                dsync,
                plain,
            } => {
                let flags = if dsync { libc::RWF_DSYNC } else { 0 };
                opcode::Write::new(types::Fd(self.fd_of(plain)), buf, len)
                    .offset(off)
                    .rw_flags(flags)
                    .build()
            }
            IoOp::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            IoOp::Allocate { mode, off, len } => opcode::Fallocate::new(fd, len)
                .offset(off)
                .mode(mode)
                .build(),
            IoOp::Size { buf } => {
                opcode::Statx::new(types::Fd(self.fd_of(true)), c"".as_ptr(), buf.cast())
                    .flags(libc::AT_EMPTY_PATH | libc::AT_STATX_FORCE_SYNC)
                    .mask(libc::STATX_SIZE)
                    .build()
            }
            IoOp::WillNeed { off, len } => {
                opcode::Fadvise::new(fd, len_i64(len), libc::POSIX_FADV_WILLNEED)
                    .offset(off)
                    .build()
            }
            // The address of a fixed operation is an offset into the
            // registered buffer: a kernel-registered (bvec) buffer starts at 0.
            IoOp::ReadFixed {
                index,
                at,
                len,
                off,
            } => opcode::ReadFixed::new(fd, at as *mut u8, len, index)
                .offset(off)
                .build(),
            IoOp::WriteFixed {
                index,
                at,
                len,
                off,
                dsync,
            } => {
                let flags = if dsync { libc::RWF_DSYNC } else { 0 };
                opcode::WriteFixed::new(fd, at as *const u8, len, index)
                    .offset(off)
                    .rw_flags(flags)
                    .build()
            }
            IoOp::ZeroFixed { index, at, len } => {
                // No /dev/zero: the op fails (`run` answers EOPNOTSUPP).
                let zero = dev_zero()?;
                opcode::ReadFixed::new(types::Fd(zero), at as *mut u8, len, index).build()
            }
        };
        Some(if self.local {
            e
        } else {
            e.flags(squeue::Flags::ASYNC)
        })
    }

    /// The entry splicing `len` bytes at `off` from the buffered descriptor
    /// into `pipe`.
    fn splice_sqe(&self, off: u64, pipe: BorrowedFd<'_>, len: u32) -> Option<squeue::Entry> {
        let off = i64::try_from(off).unwrap_or(i64::MAX);
        let e = opcode::Splice::new(
            types::Fd(self.plain.as_raw_fd()),
            off,
            types::Fd(pipe.as_raw_fd()),
            -1,
            len,
        )
        .build();
        Some(if self.local {
            e
        } else {
            e.flags(squeue::Flags::ASYNC)
        })
    }

    /// Run `op` with plain system calls; what io_uring would return.
    ///
    /// # Safety
    /// As [`Storage::run`].
    unsafe fn run(&self, op: IoOp) -> i32 {
        match op {
            IoOp::Read { buf, len, off } => {
                // SAFETY: by the caller's contract, `len` bytes at `buf` are ours
                // to write until we return.
                let slice = unsafe { std::slice::from_raw_parts_mut(buf, len as usize) };
                match rustix::io::pread(&self.file, slice, off) {
                    Ok(n) => res_of(n),
                    Err(e) => errno_of(e),
                }
            }
            IoOp::Write {
                buf,
                len,
                off,
                dsync,
                plain,
            } => {
                // SAFETY: as for Read; the buffer is only read.
                let slice = unsafe { std::slice::from_raw_parts(buf, len as usize) };
                let flags = if dsync {
                    rustix::io::ReadWriteFlags::DSYNC
                } else {
                    rustix::io::ReadWriteFlags::empty()
                };
                let f = if plain { &self.plain } else { &self.file };
                match rustix::io::pwritev2(f, &[std::io::IoSlice::new(slice)], off, flags) {
                    Ok(n) => res_of(n),
                    Err(e) => errno_of(e),
                }
            }
            IoOp::Flush => rustix::fs::fdatasync(&self.file).map_or_else(errno_of, |()| 0),
            IoOp::Allocate { mode, off, len } => {
                let mode = rustix::fs::FallocateFlags::from_bits_retain(mode as u32);
                rustix::fs::fallocate(&self.file, mode, off, len).map_or_else(errno_of, |()| 0)
            }
            IoOp::Size { buf } => {
                // SAFETY: `plain` is open; `buf` points at a `libc::statx` the
                // caller owns until we return (its contract).
                let r = unsafe {
                    libc::statx(
                        self.plain.as_raw_fd(),
                        c"".as_ptr(),
                        libc::AT_EMPTY_PATH | libc::AT_STATX_FORCE_SYNC,
                        libc::STATX_SIZE,
                        buf,
                    )
                };
                if r == 0 {
                    0
                } else {
                    -std::io::Error::last_os_error()
                        .raw_os_error()
                        .unwrap_or(libc::EIO)
                }
            }
            IoOp::WillNeed { off, len } => {
                let len = std::num::NonZeroU64::new(len);
                rustix::fs::fadvise(&self.file, off, len, rustix::fs::Advice::WillNeed)
                    .map_or_else(errno_of, |()| 0)
            }
            // Registered buffers exist only in a ring.
            IoOp::ReadFixed { .. } | IoOp::WriteFixed { .. } | IoOp::ZeroFixed { .. } => {
                -libc::EOPNOTSUPP
            }
        }
    }

    /// `preadv2(RWF_NOWAIT)` on the buffered descriptor.
    #[inline]
    fn read_cached(&self, buf: &mut [u8], off: u64) -> Option<usize> {
        let flags = rustix::io::ReadWriteFlags::NOWAIT;
        rustix::io::preadv2(
            &self.plain,
            &mut [std::io::IoSliceMut::new(buf)],
            off,
            flags,
        )
        .ok()
    }

    /// `pwritev2(RWF_NOWAIT)` on the data descriptor.
    #[inline]
    fn write_nowait(&self, data: &[u8], off: u64) -> Result<usize, rustix::io::Errno> {
        let flags = rustix::io::ReadWriteFlags::NOWAIT;
        rustix::io::pwritev2(&self.file, &[std::io::IoSlice::new(data)], off, flags)
    }

    fn current_len(&self) -> u64 {
        use std::os::unix::fs::FileTypeExt;
        match self.plain.metadata() {
            // A block device's length is where its end is (its inode says 0).
            Ok(m) if m.file_type().is_block_device() => {
                rustix::fs::seek(&self.plain, rustix::fs::SeekFrom::End(0)).unwrap_or(0)
            }
            Ok(m) => m.len(),
            Err(_) => 0,
        }
    }

    fn seek_data(&self, off: u64) -> Result<u64, rustix::io::Errno> {
        rustix::fs::seek(&self.plain, rustix::fs::SeekFrom::Data(off))
    }

    fn seek_hole(&self, off: u64) -> Result<u64, rustix::io::Errno> {
        rustix::fs::seek(&self.plain, rustix::fs::SeekFrom::Hole(off))
    }

    fn sync_data(&self) -> std::io::Result<()> {
        Ok(rustix::fs::fdatasync(&self.file)?)
    }
}
