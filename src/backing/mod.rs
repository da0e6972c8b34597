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
//! - [`Backend::Rbd`] ([`rbd`]): an image on a Ceph cluster (`rbd:POOL/IMAGE`),
//!   through librbd (loaded at run time); its operations complete on
//!   librbd's threads into the reactor's [`Completions`].
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
//! A new backend is one file here (a type implementing [`Storage`], from
//! `storage.rs`, whose defaults cover every capability it lacks), its variant
//! in [`Backend`] and its line in the `each!` dispatch below, and the line in
//! `Device::open` (the device module) that selects it.

pub mod align;
pub mod cache;
pub mod create;
pub mod file;
pub mod format;
pub mod identity;
pub mod lock;
#[cfg(feature = "test-backend")]
pub mod mem;
pub mod rbd;

pub mod storage;

pub use storage::{Caps, Completions, IoOp, Storage};

use io_uring::squeue;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

/// Whether opening an image for writing failed because it is write-protected
/// (a read-only mount, mode 0444, an immutable file): such an image is opened
/// read-only instead, with a notice, as losetup does.
pub fn write_protected(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EROFS | libc::EACCES | libc::EPERM)
    )
}

/// A device's storage. See the module documentation.
#[derive(Debug)]
pub enum Backend {
    File(file::FileBackend),
    #[cfg(feature = "test-backend")]
    Mem(mem::MemBackend),
    Rbd(Arc<rbd::RbdImage>),
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
            Backend::Rbd($x) => $f,
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

    /// The RBD image, for what only RBD images have (its spec, its
    /// handle kept across a reconfiguration); `None` for any other backend.
    pub fn as_rbd(&self) -> Option<&Arc<rbd::RbdImage>> {
        match self {
            Backend::Rbd(r) => Some(r),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The local file, for what only files have (image identity and locks,
    /// page-cache statistics); `None` for any other backend.
    pub fn as_file(&self) -> Option<&file::FileBackend> {
        each!(self, b => (b as &dyn std::any::Any).downcast_ref())
    }
}
