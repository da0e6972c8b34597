//! Storage, below the device: the backend seam ([`Backend`]) and its
//! implementations, plus what a backing *file* needs besides I/O — creating
//! one (atomically, see `create`), which file a path names and opening it
//! again only if it is the same one (`identity`), what an image file is
//! (format probe), how direct I/O must be aligned on it, who else may use it
//! (QEMU-compatible image locking), and how much of it the page cache holds
//! (`cache`).
//!
//! # The backend seam
//!
//! A [`Backend`] is where a device's bytes live. It is an enum, not a trait
//! object, so that the engine's calls into the local file stay statically
//! dispatched (one `match` the compiler folds on the hot path):
//!
//! - [`Backend::File`] ([`file`]): a local file or block device, `O_DIRECT`
//!   where it can; its operations are io_uring entries run on the reactor's
//!   own ring ([`Backend::sqe`]).
//! - `Backend::Mem` ([`mem`], cargo feature `test-backend` only): bytes in
//!   memory, served by a thread of its own; it proves the second kind of
//!   backend, the one a library with its own threads (librbd) needs.
//!
//! Contract:
//! - The engine plans a request into [`IoOp`]s (read, write, flush, allocate
//!   = discard / write-zeroes, prefetch, size), each over memory the request
//!   owns; the range lock, the request's state machine and the counters stay
//!   above, in the engine and the device. A backend never sees a frontend.
//! - An operation is *submitted* from the reactor thread that drives the
//!   request, and its result (bytes, or `-errno`, io_uring style) comes back
//!   to that same thread, which alone goes on with the request:
//!   - a ring-native backend turns it into an io_uring entry
//!     ([`Backend::sqe`]: `Some`) that the reactor pushes on its ring; the
//!     completion queue entry is the result;
//!   - a threaded backend takes it ([`Backend::post`], when `sqe` says
//!     `None`), runs it on its own threads, and hands the result to the
//!     reactor's [`Completions`]: a list plus an eventfd whose read the
//!     reactor keeps posted on its ring. The ring turns the list back into
//!     completions of the same shape as its own (the ring module), so the
//!     request path stays one state machine on one thread.
//! - [`Backend::run`] runs an operation synchronously on the calling thread
//!   (the test oracle, and a small inline write).
//! - Memory: every pointer in an [`IoOp`] names memory of the request that
//!   made it, valid and untouched by anyone else until its result has been
//!   delivered; [`Backend::run`] and [`Backend::post`] are `unsafe` for that
//!   reason. A backend never reads or writes past the lengths an op names, and
//!   never keeps a pointer past delivering the result.
//! - Capabilities ([`Caps`]) say what the engine may do besides submitting
//!   ops: direct I/O (alignment), inline page-cache reads and writes on the
//!   reactor, splice to a socket, an allocation map (`SEEK_DATA`/`SEEK_HOLE`).
//!   A backend without one gets the general path: every op submitted, reads
//!   copied, every range described as data.
//!
//! A new backend is one file here (a type implementing [`Storage`], whose
//! defaults cover every capability it lacks), its variant in [`Backend`] and
//! its line in the `each!` dispatch below, and the line in `Device::open`
//! (the device module) that selects it.

pub mod align;
pub mod cache;
pub mod create;
pub mod file;
pub mod format;
pub mod identity;
pub mod lock;
#[cfg(feature = "test-backend")]
pub mod mem;

use io_uring::squeue;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// Whether opening an image for writing failed because it is write-protected
/// (a read-only mount, mode 0444, an immutable file): such an image is opened
/// read-only instead, with a notice, as losetup does.
pub fn write_protected(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EROFS | libc::EACCES | libc::EPERM)
    )
}

/// One operation on a backend, over memory of the request that made it (see
/// the module contract). Offsets are the backend's own (file offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoOp {
    /// Read `len` bytes at `off` into `buf`; fewer at the end of the data.
    Read { buf: *mut u8, len: u32, off: u64 },
    /// Write `len` bytes from `buf` at `off` (`dsync`: durable when done).
    /// `plain`: through the buffered descriptor of a direct-I/O file (an
    /// unaligned zero fill).
    Write {
        buf: *const u8,
        len: u32,
        off: u64,
        dsync: bool,
        plain: bool,
    },
    /// Make every write done so far durable.
    Flush,
    /// `fallocate(mode)`: punch a hole (discard) or zero a range.
    Allocate { mode: i32, off: u64, len: u64 },
    /// Prefetch a range into the cache (a hint; its result is ignored).
    WillNeed { off: u64, len: u64 },
    /// The data's current size into `buf` (`stx_size`, `STATX_SIZE` in
    /// `stx_mask`).
    Size { buf: *mut libc::statx },
}

/// What a backend can do besides running [`IoOp`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Data goes to storage without a cache of ours: requests must be
    /// aligned to [`Backend::dio_align`] or are bounced.
    pub direct: bool,
    /// Reads and small writes may be tried inline, non-blocking, on the
    /// reactor thread (a page cache).
    pub inline_cached: bool,
    /// Read data can be spliced to a pipe ([`Backend::splice_sqe`]).
    pub splice: bool,
    /// The backend knows where its holes are ([`Backend::seek_data`]).
    pub allocation_map: bool,
}

/// Where a threaded backend delivers results for one reactor: a list the
/// reactor drains, and an eventfd it keeps a read posted on. Created by the
/// reactor's ring (`Io` in the ring module) the first time it posts an operation.
#[derive(Debug)]
pub struct Completions {
    event: OwnedFd,
    done: Mutex<Vec<(u64, i32)>>,
}

impl Completions {
    pub fn new() -> std::io::Result<Completions> {
        let event = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?;
        Ok(Completions {
            event,
            done: Mutex::new(Vec::new()),
        })
    }

    /// The eventfd the reactor reads (8 bytes: a count of signals).
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }

    /// Deliver `res` for the operation tagged `user_data`, and wake the reactor.
    /// After this the backend holds no pointer of that operation.
    pub fn complete(&self, user_data: u64, res: i32) {
        match self.done.lock() {
            Ok(mut d) => d.push((user_data, res)),
            Err(p) => p.into_inner().push((user_data, res)),
        }
        // After the push: the read this write completes finds the result. A
        // failed write (the counter full: never, at one per op) loses nothing:
        // the next drain takes the list anyway.
        let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
    }

    /// Hand every delivered result to `f` (on the reactor), oldest first.
    pub fn drain(&self, mut f: impl FnMut(u64, i32)) {
        let taken = match self.done.lock() {
            Ok(mut d) => std::mem::take(&mut *d),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        };
        for (u, r) in taken {
            f(u, r);
        }
    }
}

/// What every backend implements: the operations of [`IoOp`], and the
/// capabilities of [`Caps`] with their defaults (a backend without a cache,
/// splice or an allocation map keeps them). See the module documentation.
pub trait Storage {
    /// What the backend can do besides running operations.
    fn caps(&self) -> Caps;

    /// Alignment a request needs to go straight to storage (1: none).
    fn dio_align(&self) -> u32 {
        1
    }

    /// The io_uring entry that runs `op` on the reactor's ring, for a
    /// ring-native backend; `None`: [`Storage::post`] it instead. Building is
    /// safe; pushing the entry is not (the ring's `push` contract).
    fn sqe(&self, op: IoOp) -> Option<squeue::Entry> {
        let _ = op;
        None
    }

    /// Hand `op` to the backend's own threads; its result goes to `done`
    /// tagged `user_data`. By default it runs at once, on the caller's thread.
    ///
    /// # Safety
    /// As [`Storage::run`], until the result is in `done`.
    unsafe fn post(&self, op: IoOp, user_data: u64, done: &Arc<Completions>) {
        // SAFETY: by this function's contract.
        let res = unsafe { self.run(op) };
        done.complete(user_data, res);
    }

    /// Run `op` on the calling thread; bytes or `-errno`.
    ///
    /// # Safety
    /// Every pointer in `op` names memory valid for the lengths `op` gives,
    /// which nobody else touches until this returns.
    unsafe fn run(&self, op: IoOp) -> i32;

    /// A non-blocking read from the cache into `buf` (capability
    /// `inline_cached`): bytes found, or `None` (none, or it would block).
    fn read_cached(&self, buf: &mut [u8], off: u64) -> Option<usize> {
        let _ = (buf, off);
        None
    }

    /// A non-blocking write of `data` into the cache (capability
    /// `inline_cached`): bytes written, or the error (`EAGAIN`; `EOPNOTSUPP`:
    /// the storage takes no non-blocking writes).
    fn write_nowait(&self, data: &[u8], off: u64) -> Result<usize, rustix::io::Errno> {
        let _ = (data, off);
        Err(rustix::io::Errno::OPNOTSUPP)
    }

    /// The io_uring entry splicing `len` bytes at `off` into `pipe`
    /// (capability `splice`; `None` without it). The caller tags it.
    fn splice_sqe(&self, off: u64, pipe: BorrowedFd<'_>, len: u32) -> Option<squeue::Entry> {
        let _ = (off, pipe, len);
        None
    }

    /// The data's size now (0 if it cannot be asked).
    fn current_len(&self) -> u64;

    /// The first offset at or after `off` holding data (`ENXIO`: none).
    /// Without an allocation map, everything up to the end is data.
    fn seek_data(&self, off: u64) -> Result<u64, rustix::io::Errno> {
        if off < self.current_len() {
            Ok(off)
        } else {
            Err(rustix::io::Errno::NXIO)
        }
    }

    /// The first hole at or after `off` (the end counts as one).
    fn seek_hole(&self, off: u64) -> Result<u64, rustix::io::Errno> {
        Ok(self.current_len().max(off))
    }

    /// Make every write so far durable, on the calling thread (stopping,
    /// detaching: never on a reactor).
    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }

    /// The local file, for what only files have (image identity and locks,
    /// page-cache statistics).
    fn as_file(&self) -> Option<&file::FileBackend> {
        None
    }
}

/// A device's storage. See the module documentation.
#[derive(Debug)]
pub enum Backend {
    File(file::FileBackend),
    #[cfg(feature = "test-backend")]
    Mem(mem::MemBackend),
}

/// `f` applied to whichever backend `b` holds: the one `match` every method
/// of [`Backend`] is, so each call is dispatched statically. A new backend
/// adds its variant here and in [`Backend`].
macro_rules! each {
    ($b:expr, $x:ident => $f:expr) => {
        match $b {
            Backend::File($x) => $f,
            #[cfg(feature = "test-backend")]
            Backend::Mem($x) => $f,
        }
    };
}

impl Backend {
    /// What the backend can do.
    #[inline]
    pub fn caps(&self) -> Caps {
        each!(self, b => b.caps())
    }

    /// Alignment a request needs to go straight to storage (1: none).
    #[inline]
    pub fn dio_align(&self) -> u32 {
        each!(self, b => b.dio_align())
    }

    /// See [`Storage::sqe`].
    #[inline]
    pub fn sqe(&self, op: IoOp) -> Option<squeue::Entry> {
        each!(self, b => b.sqe(op))
    }

    /// See [`Storage::post`].
    ///
    /// # Safety
    /// As [`Storage::post`].
    pub unsafe fn post(&self, op: IoOp, user_data: u64, done: &Arc<Completions>) {
        // SAFETY: by this function's contract.
        each!(self, b => unsafe { b.post(op, user_data, done) })
    }

    /// See [`Storage::run`].
    ///
    /// # Safety
    /// As [`Storage::run`].
    pub unsafe fn run(&self, op: IoOp) -> i32 {
        // SAFETY: by this function's contract.
        each!(self, b => unsafe { b.run(op) })
    }

    /// See [`Storage::read_cached`].
    #[inline]
    pub fn read_cached(&self, buf: &mut [u8], off: u64) -> Option<usize> {
        each!(self, b => b.read_cached(buf, off))
    }

    /// See [`Storage::write_nowait`].
    #[inline]
    pub fn write_nowait(&self, data: &[u8], off: u64) -> Result<usize, rustix::io::Errno> {
        each!(self, b => b.write_nowait(data, off))
    }

    /// See [`Storage::splice_sqe`].
    pub fn splice_sqe(&self, off: u64, pipe: BorrowedFd<'_>, len: u32) -> Option<squeue::Entry> {
        each!(self, b => b.splice_sqe(off, pipe, len))
    }

    /// See [`Storage::seek_data`].
    pub fn seek_data(&self, off: u64) -> Result<u64, rustix::io::Errno> {
        each!(self, b => b.seek_data(off))
    }

    /// See [`Storage::seek_hole`].
    pub fn seek_hole(&self, off: u64) -> Result<u64, rustix::io::Errno> {
        each!(self, b => b.seek_hole(off))
    }

    /// See [`Storage::current_len`].
    pub fn current_len(&self) -> u64 {
        each!(self, b => b.current_len())
    }

    /// See [`Storage::sync_data`].
    pub fn sync_data(&self) -> std::io::Result<()> {
        each!(self, b => b.sync_data())
    }

    /// See [`Storage::as_file`].
    pub fn as_file(&self) -> Option<&file::FileBackend> {
        each!(self, b => b.as_file())
    }
}
