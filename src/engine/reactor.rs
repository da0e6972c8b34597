//! The reactor: one thread, one io_uring, many connections.
//!
//! Contract:
//! - A connection is handed over ([`ReactorHandle::add`]) and stays on this
//!   reactor until it closes, or until it moves to the reactor running on the CPU
//!   its client runs on (see [`super::affinity`]): it stops reading requests,
//!   cancels its posted receive, and once nothing of it is in flight (no request,
//!   receive, send or file operation) the whole `Conn`, unparsed bytes included,
//!   goes to the other reactor's channel. While it lives here its socket I/O and
//!   its requests' file I/O all go through this reactor's ring, and no other
//!   thread touches it.
//! - `user_data` = `tag << 56 | conn << 16 | slot`: the tag says what completed
//!   (wake-up, receive, send, file op, cancel), `conn` indexes `conns`, `slot` the
//!   connection's slot table. A connection's index is reused only after every
//!   operation it submitted has completed, so a completion always finds its owner.
//! - Buffers referred to by an SQE belong to the slot (or connection) that
//!   submitted it, which is not freed or reused until the CQE arrives. On exit the
//!   reactor waits for every in-flight operation before dropping anything.
//! - The only lock taken is the device's range lock, and only to decide; a request
//!   that must wait is parked and retried when a release wakes this reactor.
//! - Large buffered reads are spliced (see [`super::splice`]): their file → pipe
//!   and pipe → socket operations run on the kernel's io_uring workers, which may
//!   block there, never this thread.
//! - What the thread may block on: the ring (waiting for completions), and in
//!   buffered mode the two inline page-cache paths — `RWF_NOWAIT` reads, which do
//!   not block, and small whole-page writes, which copy into the page cache and can
//!   wait for the filesystem's journal, dirty-page throttling or a page fault, and
//!   then stall every connection on this reactor (direct-mode ones included).
//! - Before sleeping it may busy-poll (see [`super::poll`]) for up to `--poll-us`,
//!   never while file I/O is in flight and never after a large batch.

use super::admit::Permit;
use super::affinity::{self, CpuLoad, Peer};
use super::buffer::Pool;
use super::conn::Conn;
use super::poll::AdaptivePoll;
use super::splice::PipePool;
use crate::device::export::ClientRef;
use crate::device::range_lock::Wake;
use io_uring::{IoUring, opcode, squeue, types};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;

const TAG_WAKE: u64 = 1;
pub(super) const TAG_RECV: u64 = 2;
pub(super) const TAG_SEND: u64 = 3;
pub(super) const TAG_FILE: u64 = 4;
pub(super) const TAG_CANCEL: u64 = 5;
const TAG_TIMER: u64 = 6;

const RING_ENTRIES: u32 = 1024;
/// How long a stopping reactor waits for clients to take their replies.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Bumped by the control plane when connections must look at their export again
/// (a detach started); reactors compare it on every wake-up.
pub static CONTROL_GEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A connection's index as it appears in user_data.
fn conn_id(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

pub(super) fn ud(tag: u64, conn: u32, slot: u16) -> u64 {
    tag << 56 | u64::from(conn) << 16 | u64::from(slot)
}

fn ud_parts(u: u64) -> (u64, u32, u16) {
    (
        u >> 56,
        ((u >> 16) & 0xffff_ffff) as u32,
        (u & 0xffff) as u16,
    )
}

#[derive(Debug, Error)]
pub enum ReactorError {
    #[error(
        "cannot create io_uring (is io_uring disabled? see /proc/sys/kernel/io_uring_disabled)"
    )]
    Ring(#[source] std::io::Error),
    #[error("cannot create eventfd")]
    EventFd(#[source] std::io::Error),
    #[error("cannot start reactor thread")]
    Spawn(#[source] std::io::Error),
    #[error("io_uring_enter failed")]
    Enter(#[source] std::io::Error),
}

/// A negotiated connection, ready for the transmission phase.
pub struct NewConn {
    pub sock: OwnedFd,
    /// Its registration as a client of the export its handshake selected.
    pub client: ClientRef,
    /// Its place among the server's connections.
    pub permit: Permit,
    pub structured: bool,
    pub meta_context: bool,
    /// How to find where the client runs.
    pub peer: Peer,
}

enum Msg {
    Conn(NewConn),
    /// A connection moving here from another reactor, nothing of it in flight.
    Moved(Box<Conn>),
    /// Every reactor of the server (for moving connections), sent once at start,
    /// and whether to follow clients on an idle machine too.
    Peers(Vec<Arc<ReactorHandle>>, bool),
    Shutdown,
}

/// Wakes a reactor through its eventfd.
pub struct EventWaker {
    fd: OwnedFd,
}

impl Wake for EventWaker {
    fn wake(&self) {
        // Only a counter at its maximum could fail (or block) here, and then a
        // wake-up is pending anyway, so the result does not matter.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }
}

/// How other threads reach a reactor.
pub struct ReactorHandle {
    tx: Mutex<Sender<Msg>>,
    waker: Arc<EventWaker>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Connections living on this reactor (for picking the least loaded).
    pub load: std::sync::atomic::AtomicUsize,
    /// The CPU the reactor thread ran on at its last look (`usize::MAX`: none yet).
    cpu: AtomicUsize,
    /// Takes connections moving in: false once the reactor is stopping.
    open: AtomicBool,
}

impl ReactorHandle {
    /// Hand a negotiated connection to this reactor.
    pub fn add(&self, c: NewConn) {
        self.load.fetch_add(1, Ordering::Relaxed);
        let _ = self.post(Msg::Conn(c));
    }

    /// Queue `m` for the reactor and wake it; the message comes back if the
    /// reactor is gone (or its channel's lock poisoned).
    fn post(&self, m: Msg) -> Result<(), Msg> {
        let sent = match self.tx.lock() {
            Ok(tx) => tx.send(m).map_err(|e| e.0),
            Err(_) => Err(m),
        };
        self.waker.wake();
        sent
    }

    /// Tell the reactor about every reactor of the server, itself included: its
    /// connections may move to the others (`always`: even on an idle machine).
    pub fn set_peers(&self, all: Vec<Arc<ReactorHandle>>, always: bool) {
        let _ = self.post(Msg::Peers(all, always));
    }

    /// Hand over a connection moving from another reactor; it comes back if this
    /// reactor is stopping (or gone).
    fn take_moved(&self, c: Box<Conn>) -> Result<(), Box<Conn>> {
        if !self.open.load(Ordering::SeqCst) {
            return Err(c);
        }
        self.load.fetch_add(1, Ordering::Relaxed);
        self.post(Msg::Moved(c)).or_else(|m| {
            self.load.fetch_sub(1, Ordering::Relaxed);
            match m {
                Msg::Moved(c) => Err(c),
                _ => Ok(()),
            }
        })
    }

    /// Wake the reactor (it re-checks parked requests and, if the control
    /// generation moved, every connection's export).
    pub fn wake(&self) {
        self.waker.wake();
    }

    /// Ask the reactor to stop: no new requests are read, in-flight requests
    /// finish and are answered, then the thread exits. Returns after it has.
    pub fn shutdown(&self) {
        let _ = self.post(Msg::Shutdown);
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// Start a reactor thread.
pub fn spawn(id: usize, poll_max: Duration) -> Result<Arc<ReactorHandle>, ReactorError> {
    // Blocking: io_uring polls it; a non-blocking eventfd could complete the
    // wake-up read with EAGAIN instead of waiting.
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
        .map_err(|e| ReactorError::EventFd(e.into()))?;
    let waker = Arc::new(EventWaker { fd: efd });
    let (tx, rx) = channel();
    let handle = Arc::new(ReactorHandle {
        tx: Mutex::new(tx),
        waker: Arc::clone(&waker),
        thread: Mutex::new(None),
        load: Default::default(),
        cpu: AtomicUsize::new(usize::MAX),
        open: AtomicBool::new(true),
    });
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

/// An `io_uring_enter` error that only means "try again" (a signal, or the
/// completion queue full until it is reaped).
fn retryable(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY))
}

/// A ring with the cheapest completion delivery this kernel offers: single
/// issuer + deferred task work (6.1), else cooperative task running (5.19), else
/// plain.
fn new_ring() -> Result<IoUring, std::io::Error> {
    let tuned = IoUring::builder()
        .setup_cqsize(RING_ENTRIES * 4)
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(RING_ENTRIES);
    if let Ok(r) = tuned {
        return Ok(r);
    }
    let coop = IoUring::builder()
        .setup_cqsize(RING_ENTRIES * 4)
        .setup_coop_taskrun()
        .setup_taskrun_flag()
        .build(RING_ENTRIES);
    if let Ok(r) = coop {
        return Ok(r);
    }
    IoUring::builder()
        .setup_cqsize(RING_ENTRIES * 4)
        .build(RING_ENTRIES)
}

/// What connection code needs from its reactor: the ring, the buffer pool, the
/// queue of requests parked on a range, and the waker given to the range lock.
pub(super) struct Io {
    ring: IoUring,
    pub pool: Pool,
    /// Pipes for spliced read replies.
    pub pipes: PipePool,
    pub lock_waiters: Vec<(u32, u16)>,
    /// Connections that stopped reading because their export is frozen.
    pub parked: Vec<u32>,
    pub waker: Arc<dyn Wake>,
    cqes: Vec<(u64, i32)>,
    /// File operations in flight on this ring (all connections).
    pub file_ops: u32,
}

impl Io {
    /// Queue an SQE, flushing the submission queue to the kernel if it is full.
    pub fn push(&mut self, e: squeue::Entry) {
        loop {
            // SAFETY: every entry pushed refers to memory owned by a slot, a
            // connection or the reactor, each of which outlives the operation
            // (see the module contract).
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

    fn reap(&mut self) {
        for c in self.ring.completion() {
            self.cqes.push((c.user_data(), c.result()));
        }
    }
}

struct Reactor {
    io: Io,
    rx: Receiver<Msg>,
    waker: Arc<EventWaker>,
    handle: Arc<ReactorHandle>,
    wake_buf: Box<u64>,
    conns: Vec<Option<Box<Conn>>>,
    free_conns: Vec<u32>,
    retry_locks: bool,
    /// Connections to service after this batch of completions.
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
    fn new(
        ring: IoUring,
        rx: Receiver<Msg>,
        waker: Arc<EventWaker>,
        handle: Arc<ReactorHandle>,
        poll_max: Duration,
    ) -> Reactor {
        let waker_dyn: Arc<dyn Wake> = waker.clone();
        Reactor {
            io: Io {
                ring,
                pool: Pool::default(),
                pipes: PipePool::default(),
                lock_waiters: Vec::new(),
                parked: Vec::new(),
                waker: waker_dyn,
                cqes: Vec::new(),
                file_ops: 0,
            },
            control_gen: CONTROL_GEN.load(Ordering::SeqCst),
            rx,
            waker,
            handle,
            wake_buf: Box::new(0),
            conns: Vec::new(),
            free_conns: Vec::new(),
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
        self.io.push(
            opcode::Read::new(fd, buf.cast(), 8)
                .build()
                .user_data(ud(TAG_WAKE, 0, 0)),
        );
    }

    fn run(&mut self) -> Result<(), ReactorError> {
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
            match self.io.ring.submit_and_wait(want) {
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
            for &(u, res) in &batch {
                self.on_cqe(u, res);
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
                if self.conns.iter().all(Option::is_none) && !self.adopt_stragglers() {
                    return Ok(());
                }
                if since.elapsed() > DRAIN_TIMEOUT {
                    self.force_close_all();
                }
                if !self.timer_armed {
                    self.timer_armed = true;
                    let t: *const types::Timespec = &*self.timer;
                    self.io.push(
                        opcode::Timeout::new(t)
                            .build()
                            .user_data(ud(TAG_TIMER, 0, 0)),
                    );
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

    fn on_cqe(&mut self, u: u64, res: i32) {
        let (tag, ci, si) = ud_parts(u);
        if tag == TAG_WAKE {
            self.arm_wake();
            self.retry_locks = true;
            self.dirty.append(&mut self.io.parked);
            let gen_now = CONTROL_GEN.load(Ordering::SeqCst);
            if gen_now != self.control_gen {
                self.control_gen = gen_now;
                self.dirty.extend((0..self.conns.len()).map(conn_id));
            }
            while let Ok(m) = self.rx.try_recv() {
                self.on_msg(m);
            }
            return;
        }
        if tag == TAG_TIMER {
            self.timer_armed = false;
            return;
        }
        let io = &mut self.io;
        let conn = self
            .conns
            .get_mut(ci as usize)
            .and_then(|c| c.as_deref_mut());
        match (tag, conn) {
            (TAG_RECV, Some(c)) => c.on_recv(io, ci, res),
            (TAG_SEND, Some(c)) => c.on_send(io, ci, res),
            (TAG_FILE, Some(c)) => c.on_file(io, ci, si, res),
            // TAG_CANCEL: the cancelled receive completes on its own.
            _ => return,
        }
        self.dirty.push(ci);
    }

    fn on_msg(&mut self, m: Msg) {
        match m {
            Msg::Conn(nc) => {
                let c = Box::new(Conn::new(
                    nc.sock,
                    nc.client,
                    nc.permit,
                    nc.structured,
                    nc.meta_context,
                    nc.peer,
                ));
                self.adopt(c);
            }
            Msg::Moved(mut c) => {
                c.moving = None;
                self.adopt(c);
            }
            Msg::Peers(all, always) => {
                self.peers = all;
                self.follow_idle = always;
            }
            Msg::Shutdown => self.begin_stop(),
        }
    }

    /// Stopping with no connection left: take any that moved here meanwhile
    /// (they drain like the rest). Whether there were any.
    fn adopt_stragglers(&mut self) -> bool {
        let mut any = false;
        while let Ok(m) = self.rx.try_recv() {
            any |= matches!(m, Msg::Conn(_) | Msg::Moved(_));
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
        for (ci, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c.as_deref_mut() else {
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
        let slot = &mut self.conns[ci as usize];
        let Some(to) = slot.as_ref().and_then(|c| c.moving) else {
            return;
        };
        // Find the destination before the connection leaves its slot, so no path
        // can drop it on the floor.
        let Some(peer) = self.peers.get(to) else {
            if let Some(c) = slot.as_deref_mut() {
                c.moving = None;
            }
            self.dirty.push(ci);
            return;
        };
        let Some(c) = slot.take() else {
            return;
        };
        let dev = Arc::clone(&c.dev);
        match peer.take_moved(c) {
            Ok(()) => {
                dev.stats.moves.fetch_add(1, Ordering::Relaxed);
                self.free_conns.push(ci);
                self.handle.load.fetch_sub(1, Ordering::Relaxed);
            }
            Err(mut c) => {
                c.moving = None;
                self.conns[ci as usize] = Some(c);
                self.dirty.push(ci);
            }
        }
    }

    fn adopt(&mut self, mut c: Box<Conn>) {
        if self.stopping.is_some() {
            c.read_closed = true;
        }
        let ci = match self.free_conns.pop() {
            Some(i) => {
                self.conns[i as usize] = Some(c);
                i
            }
            None => {
                self.conns.push(Some(c));
                conn_id(self.conns.len() - 1)
            }
        };
        self.dirty.push(ci);
    }

    fn begin_stop(&mut self) {
        if self.stopping.is_some() {
            return;
        }
        self.stopping = Some(Instant::now());
        self.handle.open.store(false, Ordering::SeqCst);
        for (ci, c) in self.conns.iter_mut().enumerate() {
            if let Some(c) = c.as_deref_mut() {
                let ci = conn_id(ci);
                c.moving = None;
                c.close_reading(&mut self.io, ci);
                self.dirty.push(ci);
            }
        }
    }

    fn force_close_all(&mut self) {
        for (ci, c) in self.conns.iter_mut().enumerate() {
            if let Some(c) = c.as_deref_mut() {
                // Shutting the socket down makes a stuck send fail at once.
                let _ = rustix::net::shutdown(&c.sock, rustix::net::Shutdown::Both);
                c.kill(&mut self.io, conn_id(ci));
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
            if let Some(c) = self
                .conns
                .get_mut(ci as usize)
                .and_then(|c| c.as_deref_mut())
            {
                if c.waiting(si) {
                    c.dispatch(&mut self.io, ci, si);
                    self.dirty.push(ci);
                }
            }
        }
    }

    fn service_dirty(&mut self) {
        self.dirty.sort_unstable();
        self.dirty.dedup();
        while let Some(ci) = self.dirty.pop() {
            let Some(c) = self
                .conns
                .get_mut(ci as usize)
                .and_then(|c| c.as_deref_mut())
            else {
                continue;
            };
            if c.service(&mut self.io, ci) {
                // Dropping the connection drops its client registration.
                self.conns[ci as usize] = None;
                self.free_conns.push(ci);
                self.handle.load.fetch_sub(1, Ordering::Relaxed);
            } else if c.ready_to_move() {
                self.move_out(ci);
            }
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        // Never free a buffer the kernel may still write: wait for everything in
        // flight. If the ring is broken, leak the connections instead.
        let busy = |conns: &[Option<Box<Conn>>]| conns.iter().flatten().any(|c| c.ops_in_flight());
        for (ci, c) in self.conns.iter_mut().enumerate() {
            if let Some(c) = c.as_deref_mut() {
                let _ = rustix::net::shutdown(&c.sock, rustix::net::Shutdown::Both);
                c.kill(&mut self.io, conn_id(ci));
            }
        }
        let mut rounds = 0;
        while busy(&self.conns) && rounds < 10_000 {
            rounds += 1;
            if self.io.ring.submit_and_wait(1).is_err() {
                break;
            }
            self.io.reap();
            let batch = std::mem::take(&mut self.io.cqes);
            for (u, res) in batch {
                let (tag, ci, si) = ud_parts(u);
                let io = &mut self.io;
                if let Some(c) = self
                    .conns
                    .get_mut(ci as usize)
                    .and_then(|c| c.as_deref_mut())
                {
                    match tag {
                        TAG_RECV => c.on_recv(io, ci, res),
                        TAG_SEND => c.on_send(io, ci, res),
                        TAG_FILE => c.on_file(io, ci, si, res),
                        _ => {}
                    }
                }
            }
        }
        if busy(&self.conns) {
            for c in self.conns.drain(..).flatten() {
                std::mem::forget(c);
            }
        }
    }
}
