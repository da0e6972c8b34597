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

use crate::device::range_lock::Wake;
use crate::engine::budget;
use crate::engine::buffer::Pool;
use crate::engine::offload::Inbox;
use crate::engine::splice::PipePool;
use io_uring::{IoUring, cqueue, squeue};
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
pub struct Io {
    pub ring: Ring,
    pub pool: Pool,
    /// Pipes for spliced read replies.
    pub pipes: PipePool,
    /// Requests parked on a range: (session, slot).
    pub lock_waiters: Vec<(u32, u16)>,
    /// Sessions that stopped taking requests (export frozen, budget short);
    /// retried at every wake-up, and every second while budget is watched.
    pub parked: Vec<u32>,
    pub waker: Arc<dyn Wake>,
    /// Completions reaped but not yet handled: (user_data, result).
    pub cqes: Vec<(u64, i32)>,
    /// File operations in flight on this ring (all sessions).
    pub file_ops: u32,
    /// Answers of allocation queries run on the offload workers.
    pub inbox: Arc<Inbox>,
    /// Bytes of requests one connection may hold.
    pub per_conn_bytes: usize,
    /// Bytes of request buffers the clients of one device may hold together.
    pub device_share: usize,
    /// Some request waits for budget: look for connections that hold some
    /// and are late with a reply (the reactor's stall timer runs while this
    /// is set).
    pub watch_stalls: bool,
    /// Seconds the stall timer has ticked (only while `watch_stalls`): a
    /// queued reply records it, and its age is counted in these ticks.
    pub ticks: u32,
    /// Marked starved in the budget (until the next wake-up).
    pub starved: bool,
    /// This reactor's registration with the budget.
    pub budget_id: usize,
}

impl Io {
    /// Wrap `ring`; `waker` wakes the owning reactor.
    pub fn new(ring: Ring, waker: Arc<dyn Wake>, per_conn_bytes: usize) -> Io {
        let b = budget::global();
        let budget_id = b.register(Arc::downgrade(&waker));
        Io {
            ring,
            pool: Pool::default(),
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

    /// Move the ring's completions into [`Io::cqes`].
    pub fn reap(&mut self) {
        for c in self.ring.completion() {
            self.cqes.push((c.user_data(), c.result()));
        }
    }
}
