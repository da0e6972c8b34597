//! A reactor's io_uring and what every frontend's session needs from its
//! reactor to run requests: the ring itself, the buffer and pipe pools, the
//! queues of requests parked on a range or on a frozen export, the waker the
//! range lock and the offload workers use, and the memory-budget registration.
//!
//! Contract:
//! - One [`Io`] per reactor thread, used only by that thread (the ring is
//!   `IORING_SETUP_SINGLE_ISSUER` where the kernel has it).
//! - The ring's submission entries are 128 bytes (`IORING_SETUP_SQE128`), so a
//!   frontend can issue `URING_CMD`s (ublk) on the same ring as its file and
//!   socket operations; plain 64-byte entries are widened by [`Io::push`].
//! - `user_data` is `tag << 56 | session << 16 | slot` ([`ud`]): the tag says what
//!   completed, `session` is the session's index on the reactor, `slot` its
//!   request slot (or ublk tag). Whoever pushes an entry guarantees that the
//!   memory it refers to outlives the operation (see [`Io::push`]).
//! - Every request's backend operation goes through [`Io::submit_file`] (and a
//!   spliced read's through [`Io::push_file`]), from either frontend: a
//!   ring-native backend's becomes an entry on this ring; a threaded backend's
//!   is posted to it with this reactor's [`Completions`], whose eventfd read
//!   ([`TAG_POSTED`]) this ring keeps posted while any is out.
//! - Completions are decoded in one place, [`Io::reap`], into [`Completion`]s:
//!   the ring's own entries, and the threaded backends' results as
//!   [`TAG_FILE`] completions of the same shape, so a session cannot tell
//!   which backend ran its operation. [`Io::file_ops`] counts backend
//!   operations in flight on this reactor (submitted here, decremented there).
//! - Each ring has one sparse registered-buffer table ([`fixed`]), made with
//!   the ring on its thread; zero-copy ublk queues take slot ranges of it
//!   for the kernel to register their requests' pages in.
//! - Outside the crate an `Io` cannot be made (its fields and constructor are
//!   the crate's): a forged completion handed to a session would make it free
//!   memory the kernel may still write.

pub mod fixed;

use crate::backing::{Backend, Completions};
use crate::device::range_lock::Wake;
use crate::engine::budget;
use crate::engine::buffer::{Lender, Pool};
use crate::engine::offload::Inbox;
use crate::engine::ops;
use crate::engine::splice::PipePool;
use crate::engine::task::FileOp;
use io_uring::{IoUring, cqueue, opcode, squeue, types};
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// The reactor's own eventfd read (wake-ups).
pub const TAG_WAKE: u64 = 1;
/// A socket receive.
pub const TAG_RECV: u64 = 2;
/// A socket send (or a splice to the socket).
pub const TAG_SEND: u64 = 3;
/// A file operation of a request.
pub const TAG_FILE: u64 = 4;
/// A cancel request (its own completion is ignored).
pub const TAG_CANCEL: u64 = 5;
/// The reactor's drain timer.
pub const TAG_TIMER: u64 = 6;
/// A ublk queue's FETCH / COMMIT_AND_FETCH command (`slot` is the tag).
pub const TAG_UBLK: u64 = 7;
/// A poll of a connection's socket for a hang-up while no receive is posted.
pub const TAG_POLL: u64 = 8;
/// The eventfd read of threaded backends' results ([`Completions`]); never
/// leaves [`Io::reap`].
pub const TAG_POSTED: u64 = 9;

/// One completion, decoded: what completed (`tag`), for which session and
/// slot, with what result (bytes or `-errno`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub(crate) tag: u64,
    pub(crate) session: u32,
    pub(crate) slot: u16,
    pub(crate) res: i32,
}

const RING_ENTRIES: u32 = 1024;

/// The ring type every reactor uses: 128-byte submission entries.
pub type Ring = IoUring<squeue::Entry128, cqueue::Entry>;

/// Encode `user_data`.
pub fn ud(tag: u64, session: u32, slot: u16) -> u64 {
    tag << 56 | u64::from(session) << 16 | u64::from(slot)
}

/// Decode `user_data` into (tag, session, slot).
pub fn ud_parts(u: u64) -> (u64, u32, u16) {
    (
        u >> 56,
        ((u >> 16) & 0xffff_ffff) as u32,
        (u & 0xffff) as u16,
    )
}

/// An `io_uring_enter` error that only means "try again" (a signal, or the
/// completion queue full until it is reaped).
pub fn retryable(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY))
}

/// A ring with the cheapest completion delivery this kernel offers: single
/// issuer + deferred task work (6.1), else cooperative task running (5.19),
/// else plain. Call it on the thread that will use the ring.
pub fn new_ring() -> Result<Ring, std::io::Error> {
    let tuned = Ring::builder()
        .setup_cqsize(RING_ENTRIES * 4)
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(RING_ENTRIES);
    if let Ok(r) = tuned {
        return Ok(r);
    }
    let coop = Ring::builder()
        .setup_cqsize(RING_ENTRIES * 4)
        .setup_coop_taskrun()
        .setup_taskrun_flag()
        .build(RING_ENTRIES);
    if let Ok(r) = coop {
        return Ok(r);
    }
    Ring::builder()
        .setup_cqsize(RING_ENTRIES * 4)
        .build(RING_ENTRIES)
}

/// What a session needs from its reactor. See the module documentation.
///
/// Outside the crate nothing can be done with one's parts (they are the
/// crate's), so no completion can be forged into it:
///
/// ```compile_fail,E0616
/// fn forge(io: &mut loopd::ring::Io) {
///     io.cqes.clear(); // private field
/// }
/// ```
pub struct Io {
    pub(crate) ring: Ring,
    pub(crate) pool: Pool,
    /// Receive buffers lent to busy NBD connections.
    pub(crate) lender: Lender,
    /// Pipes for spliced read replies.
    pub(crate) pipes: PipePool,
    /// Requests parked on a range: (session, slot).
    pub(crate) lock_waiters: Vec<(u32, u16)>,
    /// Sessions that stopped taking requests (export frozen, budget short);
    /// retried at every wake-up, and every second while budget is watched.
    pub(crate) parked: Vec<u32>,
    pub(crate) waker: Arc<dyn Wake>,
    /// Completions reaped but not yet handled.
    pub(crate) cqes: Vec<Completion>,
    /// Backend operations in flight on this reactor (all sessions).
    pub(crate) file_ops: u32,
    /// Answers of allocation queries run on the offload workers.
    pub(crate) inbox: Arc<Inbox>,
    /// Bytes of requests one connection may hold.
    pub(crate) per_conn_bytes: usize,
    /// The ring's registered-buffer table (zero-copy ublk queues take their
    /// slots here).
    pub(crate) fixed: fixed::FixedTable,
    /// Bytes of request buffers the clients of one device may hold together.
    pub(crate) device_share: usize,
    /// Some request waits for budget: look for connections that hold some
    /// and are late with a reply (the reactor's stall timer runs while this
    /// is set).
    pub(crate) watch_stalls: bool,
    /// Seconds the stall timer has ticked (only while `watch_stalls`): a
    /// queued reply records it, and its age is counted in these ticks.
    pub(crate) ticks: u32,
    /// Marked starved in the budget (until the next wake-up).
    pub(crate) starved: bool,
    /// This reactor's registration with the budget.
    pub(crate) budget_id: usize,
    /// Where threaded backends deliver this reactor's results (made at the
    /// first posted operation).
    posted: Option<Arc<Completions>>,
    /// Posted operations whose result has not been drained yet.
    posted_out: u32,
    /// The eventfd read of `posted` is in the ring.
    posted_armed: bool,
    /// What that read writes into.
    posted_buf: Box<u64>,
}

impl Io {
    /// Wrap `ring`; `waker` wakes the owning reactor.
    pub(crate) fn new(ring: Ring, waker: Arc<dyn Wake>, per_conn_bytes: usize) -> Io {
        let b = budget::global();
        let budget_id = b.register(Arc::downgrade(&waker));
        let fixed = fixed::FixedTable::register(ring.submitter());
        Io {
            fixed,
            ring,
            pool: Pool::default(),
            lender: Lender::default(),
            pipes: PipePool::default(),
            lock_waiters: Vec::new(),
            parked: Vec::new(),
            waker: Arc::clone(&waker),
            cqes: Vec::new(),
            file_ops: 0,
            inbox: Arc::new(Inbox::new(waker)),
            per_conn_bytes: b.per_connection().min(per_conn_bytes),
            device_share: b.device_share(),
            watch_stalls: false,
            ticks: 0,
            starved: false,
            budget_id,
            posted: None,
            posted_out: 0,
            posted_armed: false,
            posted_buf: Box::new(0),
        }
    }

    /// Submit a request's backend operation `op`, tagged `user_data` (a
    /// [`TAG_FILE`] value): on this ring for a ring-native backend, else
    /// posted to the backend's threads (see the module documentation). Its
    /// completion comes back through [`Io::reap`] either way.
    ///
    /// # Safety
    /// `op` was yielded by a task that stays alive, its buffers untouched,
    /// until the completion has been reaped and handed back to it.
    #[inline]
    pub(crate) unsafe fn submit_file(&mut self, backend: &Backend, op: FileOp, user_data: u64) {
        if let Some(e) = ops::sqe(backend, op) {
            self.file_ops += 1;
            // SAFETY: by this function's contract.
            unsafe { self.push(e.user_data(user_data)) };
            return;
        }
        // SAFETY: by this function's contract.
        unsafe { self.post_file(backend, op, user_data) };
    }

    /// The threaded-backend half of [`Io::submit_file`].
    ///
    /// # Safety
    /// As [`Io::submit_file`].
    #[cold]
    unsafe fn post_file(&mut self, backend: &Backend, op: FileOp, user_data: u64) {
        if self.posted.is_none() {
            match Completions::new() {
                Ok(d) => self.posted = Some(Arc::new(d)),
                Err(e) => {
                    tracing::error!("cannot make an eventfd for backend completions: {e}");
                    let (tag, session, slot) = ud_parts(user_data);
                    let res = -e.raw_os_error().unwrap_or(libc::EIO);
                    self.cqes.push(Completion {
                        tag,
                        session,
                        slot,
                        res,
                    });
                    return;
                }
            }
        }
        let Some(done) = self.posted.clone() else {
            return;
        };
        self.file_ops += 1;
        self.posted_out += 1;
        // SAFETY: our caller keeps the task alive and its buffers untouched
        // until the result is reaped, which is after the backend has
        // delivered it into `done` (the `post` contract).
        unsafe { ops::post(backend, op, user_data, &done) };
        self.arm_posted();
    }

    /// Submit a file operation of a request that the frontend built itself
    /// (a splice from the backend's descriptor), counted like
    /// [`Io::submit_file`]'s.
    ///
    /// # Safety
    /// As [`Io::push`].
    pub(crate) unsafe fn push_file(&mut self, e: squeue::Entry, user_data: u64) {
        self.file_ops += 1;
        // SAFETY: by this function's contract.
        unsafe { self.push(e.user_data(user_data)) };
    }

    /// Keep the eventfd read of threaded backends' results in the ring while
    /// any is out. Pushes on the submission queue directly (called from
    /// [`Io::reap`], which [`Io::push`] calls).
    fn arm_posted(&mut self) {
        if self.posted_armed || self.posted_out == 0 {
            return;
        }
        let Some(done) = self.posted.as_ref() else {
            return;
        };
        let buf: *mut u64 = &mut *self.posted_buf;
        let fd = types::Fd(done.event_fd().as_raw_fd());
        let e: squeue::Entry128 = opcode::Read::new(fd, buf.cast(), 8)
            .build()
            .user_data(ud(TAG_POSTED, 0, 0))
            .into();
        for _ in 0..2 {
            // SAFETY: `posted_buf` is this `Io`'s own box, kept (leaked if need
            // be, see `Drop`) until the read completes; the eventfd stays open
            // with `posted`, which this `Io` holds for as long as its ring.
            if unsafe { self.ring.submission().push(&e) }.is_ok() {
                self.posted_armed = true;
                return;
            }
            // Full: hand the queue to the kernel and try once more; if that
            // fails too, the next reap tries again.
            let _ = self.ring.submit();
        }
    }

    /// Queue an SQE, flushing the submission queue to the kernel if it is full.
    ///
    /// # Safety
    /// Every buffer, iovec, msghdr or fd `e` refers to stays valid (and is not
    /// otherwise accessed where the kernel writes) until the operation's
    /// completion has been reaped (the sessions' contracts say how each keeps
    /// to it).
    pub unsafe fn push(&mut self, e: impl Into<squeue::Entry128>) {
        let e = e.into();
        loop {
            // SAFETY: by this function's contract, whatever `e` refers to stays
            // valid until the operation completes.
            if unsafe { self.ring.submission().push(&e) }.is_ok() {
                return;
            }
            if let Err(err) = self.ring.submit() {
                if !retryable(&err) {
                    tracing::error!("io_uring submit failed: {err}");
                }
                self.reap();
            }
        }
    }

    /// A session was refused budget: be woken by the next release anywhere
    /// (the caller tries once more after this, so a release in between counts).
    pub fn starve(&mut self) {
        self.watch_stalls = true;
        if !self.starved {
            self.starved = true;
            budget::global().starve(self.budget_id);
        }
    }

    /// A session's request was refused by its device's share: it waits for
    /// that device's releases ([`crate::device::export::Export::wait_share`]),
    /// not for the daemon's budget, so nothing is trimmed and no reactor is
    /// starved; but late replies are watched for.
    pub fn share_refused(&mut self) {
        self.watch_stalls = true;
        budget::global().share_refused(self.budget_id);
    }

    /// Move the ring's completions into [`Io::cqes`], decoded; a threaded
    /// backend's results join them as [`TAG_FILE`] completions.
    pub fn reap(&mut self) {
        let mut posted = false;
        for c in self.ring.completion() {
            let (tag, session, slot) = ud_parts(c.user_data());
            if tag == TAG_POSTED {
                self.posted_armed = false;
                posted = true;
                continue;
            }
            if tag == TAG_FILE {
                self.file_ops = self.file_ops.saturating_sub(1);
            }
            self.cqes.push(Completion {
                tag,
                session,
                slot,
                res: c.result(),
            });
        }
        if posted {
            self.take_posted();
        }
        if self.posted_out > 0 && !self.posted_armed {
            self.arm_posted();
        }
    }

    /// Drain the threaded backends' results.
    #[cold]
    fn take_posted(&mut self) {
        let Some(done) = self.posted.as_ref() else {
            return;
        };
        let (cqes, file_ops, out) = (&mut self.cqes, &mut self.file_ops, &mut self.posted_out);
        done.drain(|u, res| {
            let (tag, session, slot) = ud_parts(u);
            *file_ops = file_ops.saturating_sub(1);
            *out = out.saturating_sub(1);
            cqes.push(Completion {
                tag,
                session,
                slot,
                res,
            });
        });
    }
}

impl Drop for Io {
    fn drop(&mut self) {
        // The eventfd read may still be in the kernel's hands while the ring
        // is torn down: never free the memory it writes.
        if self.posted_armed {
            std::mem::forget(std::mem::replace(&mut self.posted_buf, Box::new(0)));
        }
    }
}
