//! The reactor's event loop: reap completions, route them to sessions, service
//! the sessions they touched, retry requests parked on a range, follow clients
//! to other reactors, drain on stop. See the module documentation of
//! [`super`] for the contract.

use super::handle::{EventWaker, Msg, ReactorError, ReactorHandle, UblkQueueSetup, now_ms};
use super::poll::AdaptivePoll;
use super::session::Session;
use super::{CONTROL_GEN, DRAIN_TIMEOUT, conn_id};
use crate::device::range_lock::Wake;
use crate::engine::admit::Ticket;
use crate::engine::budget;
use crate::frontend::nbd::affinity::{self, CpuLoad};
use crate::frontend::nbd::conn::{BYTES_BUDGET, Conn};
use crate::frontend::nbd::wire::Replies;
use crate::frontend::ublk::queue::Queue;
use crate::ring::{Completion, Io, Ring, TAG_CANCEL, TAG_TIMER, TAG_WAKE, retryable, ud};
use io_uring::{opcode, types};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

pub(super) struct Reactor {
    io: Io,
    rx: Receiver<Msg>,
    waker: Arc<EventWaker>,
    handle: Arc<ReactorHandle>,
    wake_buf: Box<u64>,
    sessions: Vec<Option<Session>>,
    /// The place ticket of each session that is an NBD connection (same index).
    tickets: Vec<Option<Arc<Ticket>>>,
    free: Vec<u32>,
    retry_locks: bool,
    /// Sessions to service after this batch of completions.
    dirty: Vec<u32>,
    stopping: Option<Instant>,
    /// Last [`CONTROL_GEN`] seen: when it moves, every connection is looked at.
    control_gen: u64,
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
            io: Io::new(ring, waker_dyn, BYTES_BUDGET),
            control_gen: CONTROL_GEN.load(Ordering::SeqCst),
            rx,
            waker,
            handle,
            wake_buf: Box::new(0),
            sessions: Vec::new(),
            tickets: Vec::new(),
            free: Vec::new(),
            retry_locks: false,
            dirty: Vec::new(),
            stopping: None,
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
                if self.sessions.iter().all(Option::is_none) && !self.adopt_stragglers() {
                    return Ok(());
                }
                if since.elapsed() > DRAIN_TIMEOUT {
                    self.force_close_all();
                }
                self.arm_timer();
            }
            if self.io.watch_stalls {
                self.arm_timer();
            }
        }
    }

    /// Arm the one-second timer (draining, watching stalls), if it is not.
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
            if let Some(c) = s.as_mut().and_then(Session::as_conn) {
                let ci = conn_id(ci);
                if c.stall_tick(&mut self.io, ci) {
                    self.dirty.push(ci);
                }
            }
        }
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
            let gen_now = CONTROL_GEN.load(Ordering::SeqCst);
            if gen_now != self.control_gen {
                self.control_gen = gen_now;
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
            Msg::Conn(nc) => {
                let ticket = Arc::clone(nc.permit.ticket());
                let c = Box::new(Conn::new(
                    nc.sock,
                    nc.client,
                    nc.permit,
                    Replies::of(nc.structured, nc.extended),
                    nc.meta_context,
                    nc.peer,
                    nc.tls,
                    nc.encrypted,
                ));
                self.adopt(Session::Nbd(c), Some(ticket));
            }
            Msg::Moved(mut c, ticket) => {
                c.moving = None;
                self.adopt(Session::Nbd(c), ticket);
            }
            Msg::GiveUp(t) => {
                let here = self
                    .tickets
                    .iter()
                    .position(|x| x.as_ref().is_some_and(|x| Arc::ptr_eq(x, &t)));
                if let Some(ci) = here {
                    self.close_given_up(conn_id(ci));
                }
            }
            Msg::Peers(all, always) => {
                self.peers = all;
                self.follow_idle = always;
            }
            Msg::Ublk(q) => self.start_ublk_queue(q),
            Msg::Shutdown => self.begin_stop(),
        }
    }

    /// Build a ublk queue here and fetch its tags; the daemon starts the device
    /// once every queue said it is ready.
    fn start_ublk_queue(&mut self, q: UblkQueueSetup) {
        io_flusher_once();
        let queue = match Queue::new(q.export, q.char, q.q_id, q.depth, q.max_io, q.done) {
            Ok(queue) => queue,
            Err(e) => {
                let _ = q.ready.send(Err(e.to_string()));
                return;
            }
        };
        let ci = self.adopt(Session::Ublk(Box::new(queue)), None);
        if let Some(Some(Session::Ublk(queue))) = self.sessions.get_mut(ci as usize) {
            queue.start(&mut self.io, ci);
        }
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
            any |= matches!(m, Msg::Conn(_) | Msg::Moved(..));
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
            let Some(c) = s.as_mut().and_then(Session::as_conn) else {
                continue;
            };
            if c.moving.is_some() || c.read_closed || c.dead {
                continue;
            }
            // Only clients that sent requests are worth a look (and the probe).
            let client = if busy && std::mem::take(&mut c.active) {
                c.peer.cpu(&c.sock)
            } else {
                None
            };
            let Some(to) = c.follow.observe(client, here, now) else {
                continue;
            };
            if let Some(i) = self
                .peers
                .iter()
                .position(|p| p.cpu.load(Ordering::Relaxed) == to)
            {
                c.moving = Some(i);
                self.dirty.push(conn_id(ci));
            }
        }
    }

    /// Hand a moving connection with nothing in flight to its new reactor.
    fn move_out(&mut self, ci: u32) {
        let slot = &mut self.sessions[ci as usize];
        let Some(to) = slot
            .as_mut()
            .and_then(Session::as_conn)
            .and_then(|c| c.moving)
        else {
            return;
        };
        // Find the destination before the connection leaves its slot, so no path
        // can drop it on the floor.
        let Some(peer) = self.peers.get(to) else {
            if let Some(c) = slot.as_mut().and_then(Session::as_conn) {
                c.moving = None;
            }
            self.dirty.push(ci);
            return;
        };
        let Some(Session::Nbd(c)) = slot.take() else {
            return;
        };
        let dev = Arc::clone(&c.dev);
        let ticket = self.tickets.get_mut(ci as usize).and_then(Option::take);
        match peer.take_moved(c, ticket) {
            Ok(()) => {
                dev.stats.moves.fetch_add(1, Ordering::Relaxed);
                self.free.push(ci);
                self.handle.load.fetch_sub(1, Ordering::Relaxed);
            }
            Err((mut c, ticket)) => {
                c.moving = None;
                let given_up = ticket.as_ref().is_some_and(|t| t.given_up());
                self.sessions[ci as usize] = Some(Session::Nbd(c));
                self.tickets[ci as usize] = ticket;
                if given_up {
                    // Its place went to a newcomer while it was away.
                    self.close_given_up(ci);
                }
                self.dirty.push(ci);
            }
        }
    }

    /// Take session `s` (with its place's ticket, for a connection).
    fn adopt(&mut self, mut s: Session, ticket: Option<Arc<Ticket>>) -> u32 {
        if self.stopping.is_some()
            && let Some(c) = s.as_conn()
        {
            c.read_closed = true;
        }
        let given_up = ticket.as_ref().is_some_and(|t| t.given_up());
        let ci = match self.free.pop() {
            Some(i) => {
                self.sessions[i as usize] = Some(s);
                self.tickets[i as usize] = ticket;
                i
            }
            None => {
                self.sessions.push(Some(s));
                self.tickets.push(ticket);
                conn_id(self.sessions.len() - 1)
            }
        };
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
            s.kill(&mut self.io, ci);
            if let Some(c) = s.as_conn() {
                c.audit.reason = "closed to make room for another peer (--max-connections)";
            }
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
                self.tickets[ci as usize] = None;
                self.free.push(ci);
                self.handle.load.fetch_sub(1, Ordering::Relaxed);
            } else if s.as_conn().is_some_and(|c| c.ready_to_move()) {
                self.move_out(ci);
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
