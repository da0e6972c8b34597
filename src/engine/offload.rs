//! Backing-file calls that io_uring has no opcode for, run off the reactors.
//!
//! Contract:
//! - BLOCK_STATUS asks the backing file with `SEEK_DATA`/`SEEK_HOLE` and `fstat`;
//!   on a network or FUSE filesystem each can wait for a server for as long as it
//!   likes, so no reactor thread makes them. A reactor hands the request to this
//!   process-wide pool of worker threads ([`submit`]) with the descriptor buffer
//!   (owned by the job until it comes back) and an `Arc` of the device, and goes
//!   on; the worker answers into the reactor's [`Inbox`] and wakes it.
//! - One device's hung store holds only that device's queries. Jobs wait in
//!   their device's own queue; at most [`PER_DEVICE`] workers work for one
//!   device at a time, and devices with work take turns (round robin). Workers
//!   are started on demand up to [`MAX_WORKERS`]; past that, a device with no
//!   worker busy for it may still start one, up to [`HARD_MAX_WORKERS`]. So a
//!   device whose store answers gets a worker at once unless [`MAX_WORKERS`] /
//!   [`PER_DEVICE`] devices hang with [`PER_DEVICE`] queries each *and*
//!   [`HARD_MAX_WORKERS`] − [`MAX_WORKERS`] more hang with one each (52
//!   devices' stores at once). Idle workers exit after [`IDLE_EXIT`].
//! - A job whose connection is gone ([`StatusJob::gone`]) is answered without
//!   asking the file when a worker takes it.
//! - The queue's lock is held only to push or pop a job, never during a call.

use crate::block::{Errno, Extent};
use crate::device::range_lock::Wake;
use crate::device::{Device, status};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// Workers started for any device.
pub const MAX_WORKERS: usize = 16;
/// Workers at most: past [`MAX_WORKERS`], only for a device with none busy.
pub const HARD_MAX_WORKERS: usize = 64;
/// Workers busy for one device at most; its other jobs wait in its queue.
pub const PER_DEVICE: usize = 4;
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
    /// Set when nobody will read the answer (the connection is dead).
    pub gone: Arc<AtomicBool>,
}

impl StatusJob {
    /// Which device's queue the job waits in: the device's counters, shared
    /// by every configuration it goes through (`set`, `resize`).
    fn device(&self) -> usize {
        Arc::as_ptr(&self.dev.stats) as usize
    }
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
    q: Mutex<Queue<StatusJob>>,
    cv: Condvar,
}

/// One device's waiting jobs and busy workers.
struct DevQueue<J> {
    jobs: VecDeque<J>,
    busy: usize,
    /// In [`Queue::ready`].
    ready: bool,
}

/// The pool's state: every device's queue (keyed by [`StatusJob::device`]),
/// whose turn it is, and the workers.
struct Queue<J> {
    devs: HashMap<usize, DevQueue<J>>,
    /// Devices with a job waiting and fewer than [`PER_DEVICE`] busy, in turn.
    ready: VecDeque<usize>,
    /// Workers waiting for a job, and how many of them were notified already.
    idle: usize,
    notified: usize,
    threads: usize,
}

impl<J> Default for Queue<J> {
    fn default() -> Self {
        Queue {
            devs: HashMap::new(),
            ready: VecDeque::new(),
            idle: 0,
            notified: 0,
            threads: 0,
        }
    }
}

impl<J> Queue<J> {
    /// Queue `job` for device `key`. Returns whether it may start now (its
    /// device has room for a worker) and whether it is the first job of a
    /// device with no worker busy.
    fn push(&mut self, key: usize, job: J) -> (bool, bool) {
        let d = self.devs.entry(key).or_insert_with(|| DevQueue {
            jobs: VecDeque::new(),
            busy: 0,
            ready: false,
        });
        d.jobs.push_back(job);
        let runnable = d.busy < PER_DEVICE;
        let fresh = d.busy == 0 && d.jobs.len() == 1;
        self.mark_ready(key);
        (runnable, fresh)
    }

    /// Take back the last job queued for `key` (none will run it).
    fn unpush(&mut self, key: usize) -> Option<J> {
        let d = self.devs.get_mut(&key)?;
        let job = d.jobs.pop_back();
        if d.busy == 0 && d.jobs.is_empty() {
            self.devs.remove(&key);
        }
        job
    }

    /// Put `key` in line if it has a job waiting and room for a worker.
    fn mark_ready(&mut self, key: usize) {
        if let Some(d) = self.devs.get_mut(&key)
            && !d.ready
            && !d.jobs.is_empty()
            && d.busy < PER_DEVICE
        {
            d.ready = true;
            self.ready.push_back(key);
        }
    }

    /// The next job to run: from a device with no worker busy first (its
    /// store may well answer, while one with workers busy may hang), else from
    /// the device whose turn it is.
    fn take(&mut self) -> Option<(usize, J)> {
        loop {
            let devs = &self.devs;
            let pos = self
                .ready
                .iter()
                .position(|k| devs.get(k).is_none_or(|d| d.busy == 0))
                .unwrap_or(0);
            let key = self.ready.remove(pos)?;
            let Some(d) = self.devs.get_mut(&key) else {
                continue;
            };
            d.ready = false;
            if d.busy >= PER_DEVICE {
                continue;
            }
            let Some(job) = d.jobs.pop_front() else {
                continue;
            };
            d.busy += 1;
            self.mark_ready(key);
            return Some((key, job));
        }
    }

    /// Wake one more idle worker if a job is waiting that none was woken for.
    fn wake_one(&mut self, cv: &Condvar) -> bool {
        if self.idle > self.notified {
            self.notified += 1;
            cv.notify_one();
            return true;
        }
        false
    }

    /// A worker finished a job of `key`.
    fn done(&mut self, key: usize) {
        if let Some(d) = self.devs.get_mut(&key) {
            d.busy = d.busy.saturating_sub(1);
            if d.busy == 0 && d.jobs.is_empty() {
                self.devs.remove(&key);
                return;
            }
        }
        self.mark_ready(key);
    }
}

fn workers() -> &'static Workers {
    static W: OnceLock<Workers> = OnceLock::new();
    W.get_or_init(|| Workers {
        q: Mutex::new(Queue::default()),
        cv: Condvar::new(),
    })
}

fn lock(w: &Workers) -> MutexGuard<'_, Queue<StatusJob>> {
    match w.q.lock() {
        Ok(q) => q,
        Err(p) => p.into_inner(),
    }
}

/// Queue `job` in its device's queue; its answer reaches `job.inbox`. If no
/// worker can be started at all, the job is answered at once with an I/O
/// error (never dropped).
pub fn submit(job: StatusJob) {
    let w = workers();
    let mut q = lock(w);
    let key = job.device();
    let (runnable, fresh) = q.push(key, job);
    if !runnable || q.wake_one(&w.cv) {
        return; // waits for one of its device's workers, or is taken now
    }
    if q.threads < MAX_WORKERS || (fresh && q.threads < HARD_MAX_WORKERS) {
        q.threads += 1;
        let spawned = std::thread::Builder::new()
            .name("loopd-offload".into())
            .spawn(work);
        if spawned.is_ok() {
            return;
        }
        q.threads -= 1;
    }
    if q.threads == 0 {
        // Nobody will ever take it: answer it here, as an error.
        let job = q.unpush(key);
        drop(q);
        if let Some(job) = job {
            job.inbox.deliver(StatusDone {
                conn: job.conn,
                slot: job.slot,
                res: Err(Errno::Io),
                out: job.out,
            });
        }
    }
    // Otherwise every worker is busy: the job waits for the first to finish.
}

fn work() {
    let w = workers();
    let mut q = lock(w);
    loop {
        let Some((key, job)) = q.take() else {
            q.idle += 1;
            let (g, t) = match w.cv.wait_timeout(q, IDLE_EXIT) {
                Ok(r) => r,
                Err(p) => p.into_inner(),
            };
            q = g;
            q.idle -= 1;
            q.notified = q.notified.saturating_sub(1);
            if t.timed_out() && q.ready.is_empty() {
                q.threads -= 1;
                return;
            }
            continue;
        };
        if !q.ready.is_empty() {
            // More waiting: pass the wake-up on.
            q.wake_one(&w.cv);
        }
        drop(q);
        let mut out = job.out;
        let res = if job.gone.load(Ordering::Relaxed) {
            Err(Errno::Io)
        } else {
            status::describe(&job.dev, job.off, job.len, job.one, &mut out)
        };
        job.inbox.deliver(StatusDone {
            conn: job.conn,
            slot: job.slot,
            res,
            out,
        });
        q = lock(w);
        q.done(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Take every job that may start now, as idle workers would.
    fn take_all(q: &mut Queue<u32>) -> Vec<(usize, u32)> {
        std::iter::from_fn(|| q.take()).collect()
    }

    #[test]
    fn a_hung_device_holds_at_most_its_share_of_workers() {
        let mut q = Queue::default();
        for j in 0..32 {
            q.push(1, j);
        }
        let started = take_all(&mut q);
        assert_eq!(started.len(), PER_DEVICE, "{started:?}");
        // Another device's query is next in line at once, ahead of the rest.
        let (runnable, fresh) = q.push(2, 100);
        assert!(runnable && fresh);
        assert_eq!(q.take(), Some((2, 100)));
        assert_eq!(q.take(), None, "the hung device's other jobs wait");
        // One of device 1's queries comes back: the next one starts.
        q.done(1);
        assert_eq!(q.take(), Some((1, 4)), "PER_DEVICE is 4");
    }

    #[test]
    fn a_device_with_no_worker_goes_first() {
        let mut q = Queue::default();
        for j in 0..3 {
            q.push(1, j);
        }
        assert_eq!(q.take(), Some((1, 0)));
        q.push(2, 10);
        // Device 1 still has room and jobs, but device 2 has nobody.
        assert_eq!(q.take(), Some((2, 10)));
        assert_eq!(q.take(), Some((1, 1)));
    }

    #[test]
    fn devices_take_turns_and_queues_go_when_empty() {
        let mut q = Queue::default();
        for j in 0..2 {
            q.push(1, j);
            q.push(2, 10 + j);
        }
        let order: Vec<_> = take_all(&mut q).into_iter().map(|(_, j)| j).collect();
        assert_eq!(order, [0, 10, 1, 11]);
        for k in [1, 1, 2, 2] {
            q.done(k);
        }
        assert!(q.devs.is_empty() && q.take().is_none());
        // A job taken back leaves nothing behind either.
        q.push(3, 30);
        assert_eq!(q.unpush(3), Some(30));
        assert!(q.devs.is_empty() && q.take().is_none());
    }
}
