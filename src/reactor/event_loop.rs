//! The reactor's event loop: reap completions, route them to sessions, service
//! the sessions they touched, retry requests parked on a range, follow clients
//! to other reactors, drain on stop; and [`spawn`], which starts one. See the
//! module documentation of [`super`] for the contract.

#[cfg(test)]
use super::handle::STUCK_AFTER_MS;
use super::handle::{
    EventWaker, Msg, NO_FIXED_SLOTS, ReactorError, ReactorHandle, UblkQueueSetup, now_ms,
};
use super::poll::AdaptivePoll;
use super::session::{CONN_BYTES_BUDGET, Session};
use crate::device::range_lock::Wake;
use crate::engine::budget;
use crate::frontend::nbd::affinity::{self, CpuLoad};
use crate::frontend::ublk::queue::Queue;
use crate::ring::{Completion, Io, Ring, TAG_CANCEL, TAG_TIMER, TAG_WAKE, new_ring, retryable, ud};
use io_uring::{opcode, types};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

/// How long a stopping reactor waits for clients to take their replies.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Kernel worker threads a reactor's ring may run file operations on at once.
const IOWQ_BOUNDED: u32 = 512;

/// A session's index as it appears in user_data.
fn conn_id(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

pub(super) struct Reactor {
    io: Io,
    rx: Receiver<Msg>,
    waker: Arc<EventWaker>,
    handle: Arc<ReactorHandle>,
    wake_buf: Box<u64>,
    sessions: Vec<Option<Session>>,
    free: Vec<u32>,
    retry_locks: bool,
    /// Sessions to service after this batch of completions.
    dirty: Vec<u32>,
    stopping: Option<Instant>,
    /// Stopping with the ublk devices left to the next daemon
    /// ([`Reactor::let_go_of_ublk_queues`]).
    leave_ublk: bool,
    timer: Box<types::Timespec>,
    timer_armed: bool,
    poll: AdaptivePoll,
    /// Every reactor of the server (empty until told, or when connections stay).
    peers: Vec<Arc<ReactorHandle>>,
    /// When to look next where clients run.
    next_look: Instant,
    busy: CpuLoad,
    /// Follow clients whether or not the machine is busy (tests).
    follow_idle: bool,
}

impl Reactor {
    pub(super) fn new(
        ring: Ring,
        rx: Receiver<Msg>,
        waker: Arc<EventWaker>,
        handle: Arc<ReactorHandle>,
        poll_max: Duration,
    ) -> Reactor {
        let waker_dyn: Arc<dyn Wake> = waker.clone();
        Reactor {
            io: Io::new(ring, waker_dyn, CONN_BYTES_BUDGET),
            rx,
            waker,
            handle,
            wake_buf: Box::new(0),
            sessions: Vec::new(),
            free: Vec::new(),
            retry_locks: false,
            dirty: Vec::new(),
            stopping: None,
            leave_ublk: false,
            timer: Box::new(types::Timespec::new().sec(1)),
            timer_armed: false,
            poll: AdaptivePoll::new(poll_max),
            peers: Vec::new(),
            next_look: Instant::now(),
            busy: CpuLoad::default(),
            follow_idle: false,
        }
    }

    fn arm_wake(&mut self) {
        let buf: *mut u64 = &mut *self.wake_buf;
        let fd = types::Fd(self.waker.fd.as_raw_fd());
        let e = opcode::Read::new(fd, buf.cast(), 8)
            .build()
            .user_data(ud(TAG_WAKE, 0, 0));
        // SAFETY: `wake_buf` is the reactor's own box, alive until the reactor is
        // dropped, which first waits for operations in flight.
        unsafe { self.io.push(e) };
    }

    pub(super) fn run(&mut self) -> Result<(), ReactorError> {
        /// Completions in one batch from which deferred work may have been left over.
        const LARGE_BATCH: usize = 16;
        self.arm_wake();
        let mut last_batch = 0;
        loop {
            // Completions reaped while submitting are already queued: don't sleep.
            let mut want = usize::from(self.io.cqes.is_empty());
            // Poll only for clients: with file I/O in flight the next event is most
            // likely the disk's interrupt, and a spinning vCPU can slow the very
            // device emulation it waits for.
            let for_clients = self.io.file_ops == 0;
            // After a large batch the kernel may hold deferred work it did not run
            // (it caps the work per enter) without flagging it: enter at once.
            let may_poll = for_clients && last_batch < LARGE_BATCH;
            if want == 1 && may_poll && self.poll.window > Duration::ZERO && self.poll_briefly() {
                want = 0;
            }
            let blocked = (want == 1 && for_clients).then(Instant::now);
            if want == 1 {
                self.handle.turn_since.store(0, Ordering::Relaxed);
            }
            let entered = self.io.ring.submit_and_wait(want);
            self.handle.turn_since.store(now_ms(), Ordering::Relaxed);
            match entered {
                Ok(_) => {}
                Err(e) if retryable(&e) => {}
                Err(e) => return Err(ReactorError::Enter(e)),
            }
            if let Some(t) = blocked {
                self.poll.blocked(t.elapsed());
            }
            self.io.reap();
            let mut batch = std::mem::take(&mut self.io.cqes);
            last_batch = batch.len();
            for &c in &batch {
                self.on_cqe(c);
            }
            batch.clear();
            // Completions reaped while handling this batch stay queued for the next.
            batch.append(&mut self.io.cqes);
            self.io.cqes = batch;
            if self.retry_locks {
                self.retry_locks = false;
                self.retry_waiters();
            }
            self.service_dirty();
            if self.stopping.is_none() && !self.peers.is_empty() {
                let now = Instant::now();
                if now >= self.next_look {
                    self.next_look = now + affinity::LOOK_EVERY;
                    self.look(now);
                }
            }
            if let Some(since) = self.stopping {
                if self.leave_ublk {
                    self.let_go_of_ublk_queues();
                }
                if self.sessions.iter().all(Option::is_none) && !self.adopt_stragglers() {
                    return Ok(());
                }
                if since.elapsed() > DRAIN_TIMEOUT {
                    self.force_close_all();
                }
                self.arm_timer();
            }
            if self.io.watch_stalls || self.io.lender.out > 0 {
                self.arm_timer();
            }
        }
    }

    /// Arm the one-second timer (draining, watching stalls, receive buffers
    /// lent), if it is not.
    fn arm_timer(&mut self) {
        if !self.timer_armed {
            self.timer_armed = true;
            let t: *const types::Timespec = &*self.timer;
            let e = opcode::Timeout::new(t)
                .build()
                .user_data(ud(TAG_TIMER, 0, 0));
            // SAFETY: `timer` is the reactor's own box (see `arm_wake`).
            unsafe { self.io.push(e) };
        }
    }

    /// The timer while requests wait for budget somewhere: one more tick,
    /// cut off connections that hold budget and are late with a reply (see
    /// [`crate::frontend::nbd::stall`]), and retry the connections parked
    /// here (a backstop: each is also woken by the release it waits for).
    fn look_for_stalls(&mut self) {
        self.dirty.append(&mut self.io.parked);
        if !budget::global().anyone_waiting() {
            self.io.watch_stalls = false;
            return;
        }
        self.io.ticks = self.io.ticks.wrapping_add(1);
        for (ci, s) in self.sessions.iter_mut().enumerate() {
            if let Some(s) = s.as_mut() {
                let ci = conn_id(ci);
                if s.stall_tick(&mut self.io, ci) {
                    self.dirty.push(ci);
                }
            }
        }
    }

    /// The timer while receive buffers are lent: connections idle since the
    /// last look give back what they hold (see `frontend::nbd::idle`), and
    /// the buffers still lent are counted again (one that moved here with a
    /// connection is this reactor's now).
    fn look_for_idle(&mut self) {
        let mut lent = 0;
        for (ci, s) in self.sessions.iter_mut().enumerate() {
            if let Some(s) = s.as_mut() {
                lent += usize::from(s.idle_tick(&mut self.io, conn_id(ci)));
            }
        }
        self.io.lender.out = lent;
    }

    /// Spin for up to the poll window, watching for completions or deferred task
    /// work (which `IORING_SETUP_TASKRUN_FLAG` flags in the shared ring, so no
    /// system call is needed to look). Yields the CPU each round, so a runnable
    /// client on the same CPU is not starved. Whether something turned up.
    fn poll_briefly(&mut self) -> bool {
        /// A `sched_yield` that took this long ran another task.
        const YIELDED: Duration = Duration::from_micros(10);
        // What this batch queued (replies above all) goes out before the wait.
        if !self.io.ring.submission().is_empty()
            && let Err(e) = self.io.ring.submit()
            && !retryable(&e)
        {
            return true; // let the blocking enter report it
        }
        let deadline = Instant::now() + self.poll.window;
        loop {
            if self.io.ring.submission().taskrun() || !self.io.ring.completion().is_empty() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::yield_now();
            if now.elapsed() > YIELDED {
                // Another task had this CPU: polling would take time from it.
                self.poll.contended();
                return false;
            }
        }
    }

    fn on_cqe(&mut self, c: Completion) {
        let Completion {
            tag,
            session: ci,
            slot: si,
            res,
        } = c;
        if tag == TAG_WAKE {
            self.arm_wake();
            self.retry_locks = true;
            self.dirty.append(&mut self.io.parked);
            let b = budget::global();
            if std::mem::take(&mut self.io.starved) {
                b.fed();
            }
            if b.anyone_starved() {
                // Budget is short somewhere: give back what sits idle here,
                // and watch for connections holding it without progress.
                self.io.pool.trim();
                self.io.watch_stalls = true;
            } else if b.anyone_waiting() {
                // A device's share is short: only watch (the pools keep
                // caching for the other devices).
                self.io.watch_stalls = true;
            }
            self.take_offloaded();
            if self.handle.kicked.swap(false, Ordering::SeqCst) {
                self.dirty.extend((0..self.sessions.len()).map(conn_id));
            }
            while let Ok(m) = self.rx.try_recv() {
                self.on_msg(m);
            }
            return;
        }
        if tag == TAG_TIMER {
            self.timer_armed = false;
            if self.io.watch_stalls {
                self.look_for_stalls();
            }
            if self.io.lender.out > 0 {
                self.look_for_idle();
            }
            return;
        }
        if tag == TAG_CANCEL {
            return; // the cancelled operation completes on its own
        }
        if let Some(s) = self.sessions.get_mut(ci as usize).and_then(Option::as_mut) {
            s.on_cqe(&mut self.io, ci, tag, si, res);
            self.dirty.push(ci);
        }
    }

    /// Hand answered block-status requests to their connections.
    fn take_offloaded(&mut self) {
        for d in self.io.inbox.take() {
            let ci = d.conn;
            if let Some(s) = self.sessions.get_mut(ci as usize).and_then(Option::as_mut) {
                s.on_status(&mut self.io, ci, d);
                self.dirty.push(ci);
            }
        }
    }

    fn on_msg(&mut self, m: Msg) {
        match m {
            Msg::Adopt(s) => {
                self.adopt(s);
            }
            Msg::GiveUp(t) => {
                let here = self.sessions.iter().position(|s| {
                    s.as_ref()
                        .and_then(Session::ticket)
                        .is_some_and(|x| Arc::ptr_eq(x, &t))
                });
                if let Some(ci) = here {
                    self.close_given_up(conn_id(ci));
                }
            }
            Msg::Peers(all, always) => {
                self.peers = all;
                self.follow_idle = always;
            }
            Msg::Ublk(q) => self.start_ublk_queue(q),
            Msg::Shutdown { leave_ublk } => {
                self.leave_ublk |= leave_ublk;
                self.begin_stop();
            }
        }
    }

    /// Build a ublk queue here and fetch its tags; the daemon starts the device
    /// once every queue said it is ready.
    fn start_ublk_queue(&mut self, q: UblkQueueSetup) {
        io_flusher_once();
        // Zero copy: the queue's slots in this ring's fixed-buffer table,
        // taken before any of its fetches is submitted.
        let fixed = if q.zero_copy {
            match self.io.fixed.take(q.depth) {
                Some(first) => Some(first),
                None => {
                    let why = if self.io.fixed.registered() {
                        format!(
                            "{NO_FIXED_SLOTS} ({} slots for zero copy, {} free)",
                            q.depth,
                            self.io.fixed.free_slots()
                        )
                    } else {
                        format!("{NO_FIXED_SLOTS} (the ring has none)")
                    };
                    let _ = q.ready.send(Err(why));
                    return;
                }
            }
        } else {
            None
        };
        let depth = q.depth;
        let queue = match Queue::new(q.export, q.char, q.q_id, q.depth, q.max_io, fixed, q.done) {
            Ok(queue) => queue,
            Err(e) => {
                if let Some(first) = fixed {
                    self.io.fixed.give_back(first, depth);
                }
                let _ = q.ready.send(Err(e.to_string()));
                return;
            }
        };
        // Adopted, it fetches its tags.
        self.adopt(Session::ublk(queue));
        // START_DEV waits for every fetch: they must reach the kernel now, not at
        // the next turn.
        let sent = self.io.ring.submit().map(|_| ()).map_err(|e| e.to_string());
        let _ = q.ready.send(sent);
    }

    /// Stopping with no connection left: take any that moved here meanwhile
    /// (they drain like the rest). Whether there were any.
    fn adopt_stragglers(&mut self) -> bool {
        let mut any = false;
        while let Ok(m) = self.rx.try_recv() {
            any |= matches!(m, Msg::Adopt(_));
            self.on_msg(m);
        }
        any
    }

    /// Look where each connection's client runs; while the machine is busy, start
    /// moving those whose client keeps running on another reactor's CPU.
    fn look(&mut self, now: Instant) {
        // Published for the other reactors' looks; a reactor under load stays put,
        // so a value up to one look old is good enough.
        let here = rustix::thread::sched_getcpu();
        self.handle.cpu.store(here, Ordering::Relaxed);
        let busy = self.busy.sample().is_some_and(|b| b >= affinity::BUSY) || self.follow_idle;
        for (ci, s) in self.sessions.iter_mut().enumerate() {
            let Some(s) = s.as_mut() else {
                continue;
            };
            let Some(to) = s.look(busy, here, now) else {
                continue;
            };
            if let Some(i) = self
                .peers
                .iter()
                .position(|p| p.cpu.load(Ordering::Relaxed) == to)
            {
                s.move_to(i);
                self.dirty.push(conn_id(ci));
            }
        }
    }

    /// Hand a moving session with nothing in flight to reactor `to`.
    fn move_out(&mut self, ci: u32, to: usize) {
        // Find the destination before the session leaves its place, so no path
        // can drop it on the floor.
        let Some(peer) = self.peers.get(to) else {
            if let Some(s) = self.sessions[ci as usize].as_mut() {
                s.stay();
            }
            self.dirty.push(ci);
            return;
        };
        let Some(s) = self.sessions[ci as usize].take() else {
            return;
        };
        match peer.take_moved(s) {
            Ok(()) => {
                self.free.push(ci);
                self.handle.load.fetch_sub(1, Ordering::Relaxed);
            }
            Err(mut s) => {
                s.stay();
                let given_up = s.ticket().is_some_and(|t| t.given_up());
                self.sessions[ci as usize] = Some(s);
                if given_up {
                    // Its place went to a newcomer while it was away.
                    self.close_given_up(ci);
                }
                self.dirty.push(ci);
            }
        }
    }

    /// Take session `s`: a new one, or one moving here.
    fn adopt(&mut self, s: Session) -> u32 {
        let given_up = s.ticket().is_some_and(|t| t.given_up());
        let ci = match self.free.pop() {
            Some(i) => {
                self.sessions[i as usize] = Some(s);
                i
            }
            None => {
                self.sessions.push(Some(s));
                conn_id(self.sessions.len() - 1)
            }
        };
        if let Some(s) = self.sessions[ci as usize].as_mut() {
            s.adopted(&mut self.io, ci, self.stopping.is_some());
        }
        if given_up {
            // Its place went to a newcomer while it was on its way here.
            self.close_given_up(ci);
        }
        self.dirty.push(ci);
        ci
    }

    /// Close connection `ci`, whose place went to another peer's newcomer
    /// (see `engine::admit`): its socket is shut down, its requests get no
    /// further step, and the disconnect line says why.
    fn close_given_up(&mut self, ci: u32) {
        if let Some(s) = self.sessions.get_mut(ci as usize).and_then(Option::as_mut) {
            s.give_up_place(&mut self.io, ci);
            self.dirty.push(ci);
        }
    }

    fn begin_stop(&mut self) {
        if self.stopping.is_some() {
            return;
        }
        self.stopping = Some(Instant::now());
        self.handle.open.store(false, Ordering::SeqCst);
        for (ci, s) in self.sessions.iter_mut().enumerate() {
            if let Some(s) = s.as_mut() {
                let ci = conn_id(ci);
                s.stop_taking(&mut self.io, ci);
                self.dirty.push(ci);
            }
        }
    }

    /// Stopping with the ublk devices left to the next daemon: once every
    /// other session is gone, forget the ublk queues. Their fetches stay with
    /// the kernel (ended when this ring closes) and the buffers those name
    /// are never freed; what was in flight goes to the next daemon again.
    fn let_go_of_ublk_queues(&mut self) {
        let others = self
            .sessions
            .iter()
            .flatten()
            .any(|s| !matches!(s, Session::Ublk(_)));
        if others {
            return;
        }
        for slot in &mut self.sessions {
            if let Some(s) = slot.take() {
                std::mem::forget(s);
            }
        }
    }

    fn force_close_all(&mut self) {
        for (ci, s) in self.sessions.iter_mut().enumerate() {
            if let Some(s) = s.as_mut() {
                // Shutting the socket down makes a stuck send fail at once.
                s.kill(&mut self.io, conn_id(ci));
                self.dirty.push(conn_id(ci));
            }
        }
    }

    fn retry_waiters(&mut self) {
        let mut waiters = std::mem::take(&mut self.io.lock_waiters);
        // A slot parks again each time it loses; keep one entry per slot, oldest
        // first (the lock itself orders exclusive waiters fairly).
        let mut seen = std::collections::HashSet::with_capacity(waiters.len());
        waiters.retain(|w| seen.insert(*w));
        for (ci, si) in waiters {
            if let Some(s) = self.sessions.get_mut(ci as usize).and_then(Option::as_mut) {
                s.retry(&mut self.io, ci, si);
                self.dirty.push(ci);
            }
        }
    }

    fn service_dirty(&mut self) {
        self.dirty.sort_unstable();
        self.dirty.dedup();
        while let Some(ci) = self.dirty.pop() {
            let Some(s) = self.sessions.get_mut(ci as usize).and_then(Option::as_mut) else {
                continue;
            };
            if s.service(&mut self.io, ci) {
                // Dropping the session drops its client registration.
                self.sessions[ci as usize] = None;
                self.free.push(ci);
                self.handle.load.fetch_sub(1, Ordering::Relaxed);
            } else if let Some(to) = s.move_target() {
                self.move_out(ci, to);
            }
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        // Never free a buffer the kernel may still write: wait for everything in
        // flight. If the ring is broken, leak the connections instead.
        let busy = |s: &[Option<Session>]| s.iter().flatten().any(Session::ops_in_flight);
        for (ci, s) in self.sessions.iter_mut().enumerate() {
            if let Some(s) = s.as_mut() {
                s.kill(&mut self.io, conn_id(ci));
            }
        }
        let mut rounds = 0;
        while busy(&self.sessions) && rounds < 10_000 {
            rounds += 1;
            if self.io.ring.submit_and_wait(1).is_err() {
                break;
            }
            self.io.reap();
            let batch = std::mem::take(&mut self.io.cqes);
            for Completion {
                tag,
                session: ci,
                slot: si,
                res,
            } in batch
            {
                if tag == TAG_WAKE {
                    self.arm_wake();
                    self.take_offloaded();
                    continue;
                }
                if let Some(s) = self.sessions.get_mut(ci as usize).and_then(Option::as_mut) {
                    s.on_cqe(&mut self.io, ci, tag, si, res);
                }
            }
        }
        if busy(&self.sessions) {
            for s in self.sessions.drain(..).flatten() {
                std::mem::forget(s);
            }
        }
    }
}

/// Mark this reactor thread as an I/O flusher (`PR_SET_IO_FLUSHER`): it serves
/// a block device of this host, so memory reclaim must not make it write back
/// pages of that same device (a deadlock). Checked with `PR_GET_IO_FLUSHER`;
/// without `CAP_SYS_RESOURCE` it cannot be set, which is logged once.
fn io_flusher_once() {
    // linux/prctl.h (5.6+); not in the libc crate.
    const PR_SET_IO_FLUSHER: libc::c_int = 57;
    const PR_GET_IO_FLUSHER: libc::c_int = 58;
    use std::cell::Cell;
    thread_local!(static DONE: Cell<bool> = const { Cell::new(false) });
    if DONE.with(|d| d.replace(true)) {
        return;
    }
    // SAFETY: prctl with integer arguments only.
    let set = unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) };
    // SAFETY: as above.
    let got = unsafe { libc::prctl(PR_GET_IO_FLUSHER, 0, 0, 0, 0) };
    if set != 0 || got != 1 {
        let err = std::io::Error::last_os_error();
        tracing::warn!(
            "cannot mark the reactor serving ublk as an I/O flusher (PR_SET_IO_FLUSHER: {err}; \
             needs CAP_SYS_RESOURCE): under memory pressure the kernel may wait on this \
             thread to write back pages of the device it serves"
        );
    } else {
        tracing::debug!("reactor marked PR_SET_IO_FLUSHER");
    }
}

/// Start a reactor thread. `memory_budget` (bytes; 0 = the default) sets the
/// daemon-wide [`budget`] shared by every reactor.
pub fn spawn(
    id: usize,
    poll_max: Duration,
    memory_budget: usize,
) -> Result<Arc<ReactorHandle>, ReactorError> {
    if memory_budget > 0 {
        budget::global().set_limit(memory_budget);
    }
    // Blocking: io_uring polls it; a non-blocking eventfd could complete the
    // wake-up read with EAGAIN instead of waiting.
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
        .map_err(|e| ReactorError::EventFd(e.into()))?;
    let waker = Arc::new(EventWaker { fd: efd });
    let (tx, rx) = channel();
    let handle = Arc::new(ReactorHandle::new(tx, Arc::clone(&waker)));
    let h2 = Arc::clone(&handle);
    // The ring is created on the reactor thread: it is that thread's alone
    // (IORING_SETUP_SINGLE_ISSUER), and its completions' task work runs only when
    // the thread asks for events (DEFER_TASKRUN), so completions are reaped in
    // batches instead of interrupting the thread one by one.
    let (ready_tx, ready_rx) = channel::<Result<(), std::io::Error>>();
    let thread = std::thread::Builder::new()
        .name(format!("loopd-reactor-{id}"))
        .spawn(move || {
            let ring = match new_ring() {
                Ok(r) => {
                    let _ = ready_tx.send(Ok(()));
                    r
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            // Operations on a hung backing file hold a kernel worker each (reads
            // are not serialised per file as writes are); with the default cap (4
            // per CPU) a few of them would hold every worker, and other devices'
            // syncs and large writes would queue behind them. Workers start only
            // when needed, so a higher cap costs nothing until then.
            let mut max = [IOWQ_BOUNDED, 0];
            if let Err(e) = ring.submitter().register_iowq_max_workers(&mut max) {
                tracing::debug!("reactor {id}: io_uring worker cap unchanged: {e}");
            }
            let mut r = Reactor::new(ring, rx, waker, h2, poll_max);
            if let Err(e) = r.run() {
                tracing::error!("reactor {id} stopped: {e:#}");
            }
        })
        .map_err(ReactorError::Spawn)?;
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(ReactorError::Ring(e)),
        Err(_) => {
            return Err(ReactorError::Ring(std::io::Error::other(
                "reactor thread died",
            )));
        }
    }
    if let Ok(mut t) = handle.thread.lock() {
        *t = Some(thread);
    }
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_reactor_makes_progress_and_one_held_in_a_turn_does_not() {
        let r = spawn(0, Duration::ZERO, 0).expect("reactor");
        std::thread::sleep(Duration::from_millis(50));
        assert!(r.making_progress(), "idle, waiting on its ring");
        // As if its thread had begun a turn two seconds ago and not come back.
        r.turn_since
            .store(now_ms() - 2 * STUCK_AFTER_MS, Ordering::Relaxed);
        assert!(!r.making_progress());
        r.turn_since.store(now_ms(), Ordering::Relaxed);
        assert!(r.making_progress(), "a turn that just began");
        r.shutdown();
    }
}
