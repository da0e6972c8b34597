//! Backing-file calls that io_uring has no opcode for, run off the reactors.
//!
//! Contract:
//! - BLOCK_STATUS asks the backing file with `SEEK_DATA`/`SEEK_HOLE` and `fstat`;
//!   on a network or FUSE filesystem each can wait for a server for as long as it
//!   likes, so no reactor thread makes them. A reactor hands the request to this
//!   process-wide pool of worker threads ([`submit`]) with the descriptor buffer
//!   (owned by the job until it comes back) and an `Arc` of the device, and goes
//!   on; the worker answers into the reactor's [`Inbox`] and wakes it.
//! - Workers are started on demand, up to [`MAX_WORKERS`], and exit after
//!   [`IDLE_EXIT`] without work. A hung backing file holds the workers its
//!   requests are on (and its clients wait); other devices' requests take the
//!   remaining workers, so only [`MAX_WORKERS`] simultaneously hung requests can
//!   delay them.
//! - The queue's lock is held only to push or pop a job, never during a call.

use crate::block::{Errno, Extent};
use crate::device::range_lock::Wake;
use crate::device::{Device, status};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// Most worker threads at once.
pub const MAX_WORKERS: usize = 16;
/// An idle worker exits after this long.
pub const IDLE_EXIT: Duration = Duration::from_secs(10);

/// An allocation query (NBD's BLOCK_STATUS) to answer off the reactor.
pub struct StatusJob {
    pub dev: Arc<Device>,
    pub off: u64,
    pub len: u32,
    pub one: bool,
    /// Room for the extents (its length is how many may be described), handed
    /// back in [`StatusDone`].
    pub out: Vec<Extent>,
    /// The session and slot on the submitting reactor.
    pub conn: u32,
    pub slot: u16,
    pub inbox: Arc<Inbox>,
}

/// An answered block-status request.
pub struct StatusDone {
    pub conn: u32,
    pub slot: u16,
    /// Extents written into `out`, or the error to reply with.
    pub res: Result<usize, Errno>,
    pub out: Vec<Extent>,
}

/// Where a reactor's answered jobs wait until it wakes.
pub struct Inbox {
    done: Mutex<Vec<StatusDone>>,
    /// Answers waiting in `done`: the reactor looks at this every turn and takes
    /// the lock only when it is not zero (no lock on the data path otherwise).
    waiting: AtomicUsize,
    waker: Arc<dyn Wake>,
}

impl Inbox {
    pub fn new(waker: Arc<dyn Wake>) -> Inbox {
        Inbox {
            done: Mutex::new(Vec::new()),
            waiting: AtomicUsize::new(0),
            waker,
        }
    }

    /// Take every answered job.
    pub fn take(&self) -> Vec<StatusDone> {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        self.waiting.store(0, Ordering::Release);
        match self.done.lock() {
            Ok(mut d) => std::mem::take(&mut *d),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        }
    }

    fn deliver(&self, d: StatusDone) {
        match self.done.lock() {
            Ok(mut q) => q.push(d),
            Err(p) => p.into_inner().push(d),
        }
        // After the push: a reader that sees the count finds the answer (one
        // that took the list just before finds it on the next wake-up).
        self.waiting.fetch_add(1, Ordering::AcqRel);
        self.waker.wake();
    }
}

struct Workers {
    q: Mutex<Queue>,
    cv: Condvar,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<StatusJob>,
    idle: usize,
    threads: usize,
}

fn workers() -> &'static Workers {
    static W: OnceLock<Workers> = OnceLock::new();
    W.get_or_init(|| Workers {
        q: Mutex::new(Queue::default()),
        cv: Condvar::new(),
    })
}

/// Queue `job`; its answer reaches `job.inbox`. If no worker can be started at
/// all, the job is answered at once with an I/O error (never dropped).
pub fn submit(job: StatusJob) {
    let w = workers();
    let mut q = match w.q.lock() {
        Ok(q) => q,
        Err(p) => p.into_inner(),
    };
    q.jobs.push_back(job);
    if q.idle > q.jobs.len().saturating_sub(1) {
        w.cv.notify_one();
        return;
    }
    if q.threads < MAX_WORKERS {
        q.threads += 1;
        let spawned = std::thread::Builder::new()
            .name("loopd-offload".into())
            .spawn(work);
        if spawned.is_ok() {
            return;
        }
        q.threads -= 1;
        if q.threads == 0 {
            // Nobody will ever take it: answer it here, as an error.
            if let Some(job) = q.jobs.pop_back() {
                drop(q);
                job.inbox.deliver(StatusDone {
                    conn: job.conn,
                    slot: job.slot,
                    res: Err(Errno::Io),
                    out: job.out,
                });
            }
        }
    }
    // Every worker is busy: the job waits for the first to finish.
}

fn work() {
    let w = workers();
    loop {
        let job = {
            let mut q = match w.q.lock() {
                Ok(q) => q,
                Err(p) => p.into_inner(),
            };
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                q.idle += 1;
                let (g, t) = match w.cv.wait_timeout(q, IDLE_EXIT) {
                    Ok(r) => r,
                    Err(p) => p.into_inner(),
                };
                q = g;
                q.idle -= 1;
                if t.timed_out() && q.jobs.is_empty() {
                    q.threads -= 1;
                    return;
                }
            }
        };
        let mut out = job.out;
        let res = status::describe(&job.dev, job.off, job.len, job.one, &mut out);
        job.inbox.deliver(StatusDone {
            conn: job.conn,
            slot: job.slot,
            res,
            out,
        });
    }
}
