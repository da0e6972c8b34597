//! The backend contract (see the `backing` module for the seam as a whole):
//! the operations a backend runs ([`IoOp`]), what else it can do ([`Caps`]),
//! the trait every backend implements ([`Storage`]), and where a threaded
//! backend delivers its results ([`Completions`]).

use io_uring::squeue;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

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
    /// Read `len` bytes at `off` into the reactor ring's registered buffer
    /// `index`, from byte `at` of it (`IORING_OP_READ_FIXED`): a ublk
    /// request's own pages, registered by the kernel (zero copy). Only a
    /// ring-native backend with direct I/O runs it; anywhere else (and in
    /// [`Storage::run`]) it fails with `-EOPNOTSUPP`.
    ReadFixed {
        index: u16,
        at: u64,
        len: u32,
        off: u64,
    },
    /// Write `len` bytes at `off` from registered buffer `index`, byte `at`
    /// on (`IORING_OP_WRITE_FIXED`; `dsync`: durable when done). As
    /// [`IoOp::ReadFixed`].
    WriteFixed {
        index: u16,
        at: u64,
        len: u32,
        off: u64,
        dsync: bool,
    },
    /// Fill `len` bytes of registered buffer `index` from byte `at` with
    /// zeros (a fixed read of `/dev/zero`): the part of a zero-copy read past
    /// the end of the file, which loopd cannot write in memory (the pages
    /// are the kernel's). As [`IoOp::ReadFixed`].
    ZeroFixed { index: u16, at: u64, len: u32 },
}

impl IoOp {
    /// Whether the op names a registered buffer of the ring rather than
    /// memory (only a ring can run it).
    pub fn is_fixed(&self) -> bool {
        matches!(
            self,
            IoOp::ReadFixed { .. } | IoOp::WriteFixed { .. } | IoOp::ZeroFixed { .. }
        )
    }
}

/// What a backend can do besides running [`IoOp`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Data goes to storage without a cache of ours: requests must be
    /// aligned to [`Storage::dio_align`] or are bounced.
    pub direct: bool,
    /// Reads and small writes may be tried inline, non-blocking, on the
    /// reactor thread (a page cache).
    pub inline_cached: bool,
    /// Read data can be spliced to a pipe ([`Storage::splice_sqe`]).
    pub splice: bool,
    /// The backend knows where its holes are ([`Storage::seek_data`]).
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
}
