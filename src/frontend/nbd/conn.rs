//! One NBD connection's transmission phase, owned by one reactor.
//!
//! A connection has a fixed table of request slots (never reallocated, so reply
//! headers inside it have stable addresses while a `sendmsg` refers to them), a
//! receive buffer for request headers, and a queue of slots whose replies wait to
//! be sent. At most one receive and one send (a `sendmsg` of queued replies, or the
//! splice of one spliced read's reply out of its pipe) are in flight per
//! connection, which keeps the byte streams in order; file operations of different
//! slots run concurrently and complete in any order.
//!
//! The work is split by phase: [`super::recv`] reads and parses requests,
//! [`super::run`] takes them through the engine's shared execution step
//! ([`crate::engine::exec`]), [`super::splice`] answers large buffered reads
//! from pipes, [`super::status`] answers BLOCK_STATUS off the reactor, and
//! [`super::reply`] sends replies. Everything runs on the reactor thread; `ci` is
//! the connection's session index (for `user_data`) and `io` the reactor's ring
//! and pools. Memory an SQE refers to belongs to the connection or one of its
//! slots, which is not freed or reused until the CQE arrives.
//!
//! A client that hangs up without NBD_CMD_DISC gets no more work done
//! ([`Conn::hang_up`]): a posted receive sees the end of the stream, and while
//! none is posted (reads paused: no free slot, the connection's byte
//! allowance, a budget refusal, a frozen export) a poll of the socket for a
//! hang-up is (`TAG_POLL`; posted once, kept until it fires or the connection
//! stops reading, then cancelled, so it never outlives the connection). One
//! that holds memory budget others wait for without taking its replies in
//! time is cut off ([`super::stall`]). Each slot records what it holds of its
//! device's budget share (`Slot::held`) and gives it back when released (a
//! spliced read, when its buffer goes: its data is in pipes), and when its
//! reply was queued (`Slot::since`, in the reactor's stall ticks).

use super::affinity::{Follow, Peer};
use super::lines;
use super::tls::TlsIo;
use crate::device::Device;
use crate::device::export::{ClientRef, Export};
use crate::engine::admit::{PeerKey, Permit};
use crate::engine::buffer::AlignedBuf;
use crate::engine::exec::Request;
use crate::engine::splice::{MAX_PIPES, Pipe, PipePool, part_len};
use crate::frontend::nbd::wire::{ExportView, MAX_REPLY_HEADER, Replies};
use crate::ring::{Io, TAG_CANCEL, TAG_FILE, TAG_POLL, TAG_RECV, ud};
use io_uring::opcode;
use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Requests a connection may have between header and reply.
pub const SLOTS: u16 = 128;
/// Bytes of request buffers a connection may hold before it stops reading (at
/// most; a quarter of the daemon's memory budget when that is less).
pub const BYTES_BUDGET: usize = 128 << 20;
/// Size of the header receive buffer.
pub const RBUF: usize = 64 << 10;
/// iovecs in one `sendmsg`.
pub const MAX_IOV: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Free,
    /// A write's payload is arriving into the task's buffer.
    Receiving,
    /// Planned, waiting for its range.
    WaitLock,
    /// A file operation is in flight.
    Io,
    /// The reply is queued or being sent.
    Queued,
}

pub struct Slot {
    pub state: SlotState,
    pub cookie: u64,
    /// The request's offset (an extended reply header repeats it).
    pub offset: u64,
    /// Effect bytes after the piece in flight, for a request longer than a
    /// task can be (an extended header's 64-bit `TRIM`, `WRITE_ZEROES` or
    /// `CACHE`, run one piece after the other), and whether the request asked
    /// for FUA (which the last piece carries).
    pub rest: u64,
    pub rest_fua: bool,
    /// Bytes of its device's share of the memory budget this request holds
    /// ([`Export::hold`]), given back when the slot is released.
    pub held: usize,
    /// The reactor's stall tick ([`Io::ticks`]) when its reply was queued,
    /// or, while its write's payload arrives, when its header was read.
    pub since: u32,
    /// The request as the engine tracks it (task, range, in-flight count).
    pub req: Request,
    pub hdr: [u8; MAX_REPLY_HEADER],
    pub hdr_len: usize,
    /// Bytes of reply data after the header (read data or status descriptors).
    pub data_len: usize,
    /// Block-status descriptors, when this is a block-status reply.
    pub extra: Option<AlignedBuf>,
    /// A spliced read: the pipes holding its reply, in order (the header and the
    /// first `part` data bytes in the first, the rest in the second).
    pub pipes: [Option<Pipe>; MAX_PIPES],
    pub part: usize,
    /// Data bytes spliced into the pipes so far.
    pub piped: usize,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: SlotState::Free,
            cookie: 0,
            offset: 0,
            rest: 0,
            rest_fua: false,
            held: 0,
            since: 0,
            req: Request::default(),
            hdr: [0; MAX_REPLY_HEADER],
            hdr_len: 0,
            data_len: 0,
            extra: None,
            pipes: [None, None],
            part: 0,
            piped: 0,
        }
    }

    /// Pointer to the reply data (valid while the slot is `Queued`).
    pub fn data_ptr(&self) -> *const u8 {
        if let Some(e) = &self.extra {
            return e.as_ptr();
        }
        match &self.req.task {
            Some(t) if self.data_len > 0 => t.read_data().as_ptr(),
            _ => std::ptr::null(),
        }
    }

    pub fn reply_len(&self) -> usize {
        self.hdr_len + self.data_len
    }

    /// Whether the reply is spliced out of pipes rather than sent from memory.
    pub fn spliced(&self) -> bool {
        self.pipes[0].is_some()
    }

    /// The pipe holding reply byte `at` of a spliced reply, and how many reply
    /// bytes it holds from there on.
    pub(super) fn pipe_at(&self, at: usize) -> Option<(&Pipe, usize)> {
        let mut end = self.hdr_len;
        for (i, p) in self.pipes.iter().enumerate() {
            end += part_len(self.data_len, self.part, i);
            if at < end {
                return p.as_ref().map(|p| (p, end - at));
            }
        }
        None
    }

    /// Give the pipes back to `pool`: for reuse if the whole reply was `sent`
    /// (they are empty), else closed with whatever they hold.
    pub(super) fn drop_pipes(&mut self, pool: &mut PipePool, sent: bool) {
        for p in self.pipes.iter_mut().filter_map(Option::take) {
            if sent { pool.put(p) } else { pool.discard(p) }
        }
        self.piped = 0;
    }
}

/// What the next received bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvState {
    /// Request headers, into `rbuf`.
    Header,
    /// The payload of the write in `slot`; `got` bytes so far.
    Payload { slot: u16, got: usize },
    /// The payload of a rejected write, to be thrown away.
    Discard { remaining: u64 },
}

pub struct Conn {
    pub sock: OwnedFd,
    pub export: Arc<Export>,
    /// Counts this connection as a client of `export` until it is dropped.
    _client: ClientRef,
    /// Its place among the server's connections.
    _permit: Permit,
    /// The configuration this connection uses, as of `epoch`.
    pub dev: Arc<Device>,
    pub epoch: u64,
    pub view: ExportView,
    /// How replies are framed (simple, structured, extended headers).
    pub replies: Replies,
    pub rbuf: AlignedBuf,
    pub rstart: usize,
    pub rend: usize,
    pub recv: RecvState,
    pub recv_inflight: bool,
    /// A poll for a hang-up is posted (while reads are paused), and whether
    /// a cancel of it has been submitted.
    pub poll_inflight: bool,
    pub poll_cancel_sent: bool,
    /// The poll failed (not cancelled): none is posted again, rather than
    /// one a turn.
    pub poll_failed: bool,
    /// No more requests will be read (EOF, DISC, error or shutdown).
    pub read_closed: bool,
    /// The socket is broken: replies are dropped, not sent.
    pub dead: bool,
    pub slots: Box<[Slot]>,
    pub free_slots: Vec<u16>,
    /// Bytes of the memory budget its requests hold (the sum of their slots'
    /// `held`): it stops reading past the reactor's `per_conn_bytes`.
    pub bytes_held: usize,
    pub sendq: VecDeque<u16>,
    pub send_inflight: bool,
    /// Bytes of the front reply already sent by earlier partial sends.
    pub front_sent: usize,
    /// Slots covered by the send in flight (a prefix of `sendq`).
    pub sending: usize,
    pub iov: Box<[libc::iovec; MAX_IOV]>,
    pub msg: Box<libc::msghdr>,
    pub file_ops: u32,
    /// A cancel for the receive has been submitted.
    pub cancel_sent: bool,
    /// Where the client runs, and whether to follow it to another reactor.
    pub peer: Peer,
    pub follow: Follow,
    /// A request was read since the reactor last looked where the client runs.
    pub active: bool,
    /// Moving to this reactor (an index into the reactor's peers): no more
    /// requests are read; the move happens once nothing is in flight.
    pub moving: Option<usize>,
    /// The TLS record layer, when the session is encrypted in userspace (with
    /// kTLS, or without TLS, the socket carries plaintext and this is `None`).
    pub tls: Option<Box<TlsIo>>,
    /// For the audit lines at connect and disconnect.
    pub audit: ConnAudit,
    /// Set once nobody will read a reply (the connection is dead): the offload
    /// workers skip this connection's block-status queries not yet started.
    pub gone: Arc<AtomicBool>,
    /// The kernel's own NBD client (a socket pair of this process, for
    /// `--blockdev nbd`).
    pub kernel: bool,
}

/// What the connect and disconnect lines say about a connection.
pub struct ConnAudit {
    /// The peer: `ADDR:PORT`, or `unix uid=U pid=P`.
    pub who: String,
    /// The peer as the rate limit of these lines counts it ([`super::lines`]).
    pub key: PeerKey,
    pub opened: std::time::Instant,
    /// Requests read.
    pub served: u64,
    /// Why it ended (set where reading stops).
    pub reason: &'static str,
}

/// Who is at the other end of `sock`, for log lines and for their rate limit.
fn describe_peer(sock: &OwnedFd) -> (String, PeerKey) {
    let ip = rustix::net::getpeername(sock)
        .ok()
        .flatten()
        .and_then(|a| std::net::SocketAddr::try_from(a).ok());
    if let Some(ip) = ip {
        return (ip.to_string(), PeerKey::of_ip(ip.ip()));
    }
    match rustix::net::sockopt::socket_peercred(sock) {
        Ok(c) => (
            format!(
                "unix uid={} pid={}",
                c.uid.as_raw(),
                c.pid.as_raw_nonzero().get()
            ),
            PeerKey::Uid(c.uid.as_raw()),
        ),
        Err(_) => ("unknown peer".into(), PeerKey::Unknown),
    }
}

/// Whether the other end of `sock` is this process: a socket pair the daemon
/// made for the kernel's NBD client.
fn own_socket_pair(sock: &OwnedFd) -> bool {
    rustix::net::sockopt::socket_peercred(sock).is_ok_and(|c| c.pid == rustix::process::getpid())
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(skipped) = lines::admit(self.audit.key) {
            tracing::info!(
                "audit: NBD client {} disconnected from {} after {:.1} s, {} requests: {}{}",
                self.audit.who,
                crate::text::quoted(&self.export.name),
                self.audit.opened.elapsed().as_secs_f64(),
                self.audit.served,
                self.audit.reason,
                lines::left_out(skipped)
            );
        }
    }
}

// SAFETY: the raw pointers in `iov`/`msg` point into this connection's own slots
// and task buffers and are only dereferenced (by the kernel) while a send is in
// flight; the connection moves between threads only before it is handed to its
// first reactor and when it moves to another (`ready_to_move`: nothing in flight).
unsafe impl Send for Conn {}

impl Conn {
    /// A negotiated connection; `replies` is the framing the handshake agreed
    /// on ([`Replies::of`]).
    // The negotiated facts, one argument each: the reactor's NewConn (a
    // layer above) cannot be taken here.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        sock: OwnedFd,
        client: ClientRef,
        permit: Permit,
        replies: Replies,
        meta_context: bool,
        peer: Peer,
        tls: Option<Box<TlsIo>>,
        encrypted: bool,
    ) -> Conn {
        let export = Arc::clone(client.export());
        let (dev, epoch) = export.current();
        let view = ExportView {
            size: dev.size,
            read_only: dev.read_only,
            structured: replies != Replies::Simple,
            extended: replies == Replies::Extended,
            meta_context,
        };
        tracing::debug!("new connection to {:?}: {replies:?} replies", dev.name);
        let kernel = own_socket_pair(&sock);
        let (who, key) = describe_peer(&sock);
        let audit = ConnAudit {
            who,
            key,
            opened: std::time::Instant::now(),
            served: 0,
            reason: "closed",
        };
        if let Some(skipped) = lines::admit(audit.key) {
            tracing::info!(
                "audit: NBD client {} connected to {}, tls {}{}",
                audit.who,
                crate::text::quoted(&export.name),
                if encrypted { "yes" } else { "no" },
                lines::left_out(skipped)
            );
        }
        // SAFETY: msghdr and iovec are plain C structs for which all-zero is valid.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        let iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_IOV];
        Conn {
            sock,
            export,
            _client: client,
            _permit: permit,
            dev,
            epoch,
            view,
            replies,
            // Outside the budget: bounded by --max-connections, not by what
            // clients send, and counting it would let idle connections eat
            // the reserve other devices' requests need.
            rbuf: AlignedBuf::unbudgeted(RBUF),
            rstart: 0,
            rend: 0,
            recv: RecvState::Header,
            recv_inflight: false,
            poll_inflight: false,
            poll_cancel_sent: false,
            poll_failed: false,
            read_closed: false,
            dead: false,
            slots: (0..SLOTS).map(|_| Slot::new()).collect(),
            free_slots: (0..SLOTS).rev().collect(),
            bytes_held: 0,
            sendq: VecDeque::with_capacity(usize::from(SLOTS)),
            send_inflight: false,
            front_sent: 0,
            sending: 0,
            iov: Box::new(iov),
            msg: Box::new(msg),
            file_ops: 0,
            cancel_sent: false,
            peer,
            follow: Follow::default(),
            active: false,
            moving: None,
            tls,
            audit,
            gone: Arc::new(AtomicBool::new(false)),
            kernel,
        }
    }

    /// Bytes buffered but not yet parsed.
    pub fn avail(&self) -> usize {
        self.rend - self.rstart
    }

    /// Move unparsed bytes to the front of `rbuf`.
    pub fn compact(&mut self) {
        if self.rstart > 0 {
            let (s, e) = (self.rstart, self.rend);
            self.rbuf.as_mut_slice().copy_within(s..e, 0);
            self.rend = e - s;
            self.rstart = 0;
        }
    }

    /// Whether every slot is back in the free list.
    pub fn idle(&self) -> bool {
        self.free_slots.len() == usize::from(SLOTS)
    }

    /// Whether a moving connection has nothing in flight (no request, receive,
    /// send or file operation) and may go to its new reactor.
    pub fn ready_to_move(&self) -> bool {
        self.moving.is_some()
            && !self.read_closed
            && !self.dead
            && self.recv == RecvState::Header
            && !self.ops_in_flight()
            && self.sendq.is_empty()
            && self.idle()
    }

    /// Whether the connection has nothing in flight and can be dropped.
    pub fn finished(&self) -> bool {
        self.read_closed && !self.ops_in_flight() && self.idle()
    }

    /// Whether a receive, poll, send or file operation of this connection is
    /// in the ring.
    pub fn ops_in_flight(&self) -> bool {
        self.recv_inflight || self.poll_inflight || self.send_inflight || self.file_ops > 0
    }
}

impl Conn {
    /// Pick up the export's new configuration (no request of ours is in flight
    /// on the old one: the swap waited for them).
    pub(super) fn reload(&mut self) {
        let (dev, epoch) = self.export.current();
        self.view.size = dev.size;
        self.view.read_only = dev.read_only;
        self.dev = dev;
        self.epoch = epoch;
    }

    /// Stop reading requests; cancel the receive in flight.
    pub fn close_reading(&mut self, io: &mut Io, ci: u32) {
        if !self.read_closed {
            self.audit.reason = "closed by the server";
        }
        self.read_closed = true;
        self.cancel_recv(io, ci);
        self.cancel_poll(io, ci);
    }

    /// Ask the kernel to cancel every file operation of this connection in
    /// flight (each still completes, with `ECANCELED` or its result).
    pub(super) fn cancel_file_ops(&mut self, io: &mut Io, ci: u32) {
        if self.file_ops == 0 {
            return;
        }
        for si in 0..SLOTS {
            if self.slots[si as usize].state == SlotState::Io {
                let e = opcode::AsyncCancel::new(ud(TAG_FILE, ci, si))
                    .build()
                    .user_data(ud(TAG_CANCEL, ci, 0));
                // SAFETY: a cancel refers to no memory, only to a user_data value.
                unsafe { io.push(e) };
            }
        }
    }

    /// Cancel the receive in flight, if any (once).
    pub(super) fn cancel_recv(&mut self, io: &mut Io, ci: u32) {
        if self.recv_inflight && !self.cancel_sent {
            self.cancel_sent = true;
            let e = opcode::AsyncCancel::new(ud(TAG_RECV, ci, 0))
                .build()
                .user_data(ud(TAG_CANCEL, ci, 0));
            // SAFETY: a cancel refers to no memory, only to a user_data value.
            unsafe { io.push(e) };
        }
    }

    /// Cancel the hang-up poll in flight, if any (once).
    pub(super) fn cancel_poll(&mut self, io: &mut Io, ci: u32) {
        if self.poll_inflight && !self.poll_cancel_sent {
            self.poll_cancel_sent = true;
            let e = opcode::AsyncCancel::new(ud(TAG_POLL, ci, 0))
                .build()
                .user_data(ud(TAG_CANCEL, ci, 0));
            // SAFETY: a cancel refers to no memory, only to a user_data value.
            unsafe { io.push(e) };
        }
    }

    /// Give back what slot `si` holds of its device's budget share (and of
    /// the connection's allowance): when it is released, or when a spliced
    /// read's buffer goes back. Wakes a connection of this device refused its
    /// share ([`Export::unhold`]).
    pub(super) fn unhold(&mut self, si: u16) {
        let held = std::mem::take(&mut self.slots[si as usize].held);
        if held > 0 {
            self.export.unhold(held);
            self.bytes_held = self.bytes_held.saturating_sub(held);
        }
    }

    /// Free a slot: release its range (or its place in line) and its buffers.
    pub fn release_slot(&mut self, io: &mut Io, si: u16) {
        if self.slots[si as usize].state == SlotState::Free {
            return;
        }
        self.unhold(si);
        let slot = &mut self.slots[si as usize];
        slot.req.release(&self.dev, &self.export, &mut io.pool);
        if let Some(e) = slot.extra.take() {
            io.pool.put(e);
        }
        slot.drop_pipes(&mut io.pipes, false);
        slot.state = SlotState::Free;
        slot.rest = 0;
        slot.data_len = 0;
        slot.hdr_len = 0;
        self.free_slots.push(si);
    }

    /// The client hung up (its socket closed or broke without NBD_CMD_DISC):
    /// nobody will read a reply, so its requests take no further step. File
    /// I/O in flight is cancelled where the kernel can, the pieces of a long
    /// trim or write-zeroes not started are dropped, block-status queries not
    /// started are skipped, and each slot (buffers, range, place in line, its
    /// count in the export) is released when its last operation completes, so
    /// the connection soon stops counting as a client. (After NBD_CMD_DISC a
    /// client may half-close and still read its replies, as libnbd does: no
    /// receive is posted then, and its requests are answered.)
    pub(super) fn hang_up(&mut self, io: &mut Io, ci: u32) {
        if self.dead {
            return;
        }
        self.cancel_file_ops(io, ci);
        self.kill(io, ci);
    }

    /// The hang-up poll completed with `res` (the events seen, or an error):
    /// the client closed or broke its socket while no receive was posted.
    /// After NBD_CMD_DISC (or once the server stopped reading) only a full
    /// hang-up counts: a client may half-close and still read its replies.
    pub fn on_poll(&mut self, io: &mut Io, ci: u32, res: i32) {
        self.poll_inflight = false;
        self.poll_cancel_sent = false;
        if res < 0 && res != -libc::ECANCELED {
            tracing::debug!(
                "hang-up poll failed on a connection to {:?}: errno {}",
                self.dev.name,
                -res
            );
            self.poll_failed = true;
        }
        if res <= 0 || self.dead {
            return; // our cancel, or nothing seen
        }
        let ev = res.unsigned_abs();
        let broken = ev & (libc::POLLHUP | libc::POLLERR) as u32 != 0;
        let rdhup = ev & libc::POLLRDHUP as u32 != 0;
        if !(broken || rdhup && !self.read_closed) {
            return;
        }
        if !self.read_closed {
            self.audit.reason = "connection closed by the client";
        }
        self.read_closed = true;
        if let RecvState::Payload { slot, .. } = self.recv
            && !self.recv_inflight
        {
            self.recv = RecvState::Header;
            self.release_slot(io, slot);
        }
        self.hang_up(io, ci);
    }

    /// The socket is unusable: drop queued replies and parked requests; requests
    /// with a file operation or receive in flight are released when it completes.
    pub fn kill(&mut self, io: &mut Io, ci: u32) {
        self.gone.store(true, Ordering::Relaxed);
        self.dead = true;
        self.close_reading(io, ci);
        self.drop_unsent(io);
    }

    fn drop_unsent(&mut self, io: &mut Io) {
        if !self.send_inflight {
            while let Some(si) = self.sendq.pop_front() {
                self.release_slot(io, si);
            }
        }
        for si in 0..SLOTS {
            if self.slots[si as usize].state == SlotState::WaitLock {
                self.release_slot(io, si);
            }
        }
    }

    /// After a batch: parse, send, and report whether the connection is done.
    pub fn service(&mut self, io: &mut Io, ci: u32) -> bool {
        self.pump(io, ci);
        self.send(io, ci);
        if self.dead {
            self.drop_unsent(io);
        }
        if self.read_closed || self.dead || self.moving.is_some() {
            // No hang-up to watch for here any more (DISC read, stopping,
            // leaving for another reactor): the poll must not outlive it.
            self.cancel_poll(io, ci);
        }
        self.finished()
    }
}
