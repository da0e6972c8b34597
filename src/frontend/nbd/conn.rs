//! One NBD connection's transmission phase, owned by one reactor: the
//! driver of the connection's pure parts.
//!
//! The connection owns its socket and buffers and feeds its parts:
//! [`super::framing`] (bytes in → request headers, payloads, discards),
//! [`super::slots`] (the in-flight table: slots, states, the budget they
//! hold), [`super::replies`] (the reply queue: what to send next, how much
//! was sent) and [`super::transport`] (plaintext or the userspace TLS record
//! layer, behind one interface). This file holds the connection's state and
//! life (construction, hang-up, stop, moving, the audit lines);
//! [`super::recv`] reads requests, [`super::send`] sends replies, and
//! [`super::run`] is the one place where requests meet the engine (planning,
//! file operations on the ring, their completions, replies queued) — with
//! [`super::splice`] (large buffered reads answered from pipes) and
//! [`super::status`] (BLOCK_STATUS off the reactor) beside it;
//! [`super::stall`] cuts off a client that holds budget others wait for.
//!
//! At most one receive and one send (a `sendmsg` of queued replies, or the
//! splice of one spliced read's reply out of its pipe) are in flight per
//! connection, which keeps the byte streams in order; file operations of
//! different slots run concurrently and complete in any order. Everything
//! runs on the reactor thread; `ci` is the connection's session index (for
//! `user_data`) and `io` the reactor's ring and pools. Memory an SQE refers to
//! belongs to the connection or one of its slots, which is not freed or
//! reused until the CQE arrives.
//!
//! A client that hangs up without NBD_CMD_DISC gets no more work done
//! ([`Conn::hang_up`]): a posted receive sees the end of the stream, and while
//! none is posted (reads paused: no free slot, the connection's byte
//! allowance, a budget refusal, a frozen export) a poll of the socket for a
//! hang-up is (`TAG_POLL`; posted once, kept until it fires or the connection
//! stops reading, then cancelled, so it never outlives the connection). One
//! that holds memory budget others wait for without taking its replies in
//! time is cut off ([`super::stall`]). Each slot records what it holds of its
//! device's budget share and gives it back when released (a spliced read,
//! when its buffer goes: its data is in pipes), and when its reply was queued
//! (in the reactor's stall ticks).
//!
//! Nothing of a connection is public but its construction and what the
//! reactor's session asks of it: its fields are the frontend's, so no code
//! outside can make a send read memory the connection does not hold.
//!
//! ```compile_fail
//! // A slot's reply header is the slot's own: it cannot be reached, let
//! // alone given a length past its array.
//! fn forge(c: &mut loopd::frontend::nbd::conn::Conn) {
//!     c.slots[0].hdr_len = 4096;
//! }
//! ```
//!
//! ```compile_fail
//! // Nor can a slot be named outside the crate.
//! fn forge(s: &mut loopd::frontend::nbd::slots::Slot) {}
//! ```
//!
//! ```no_run
//! // What is public: the type, as the reactor's session holds it.
//! fn held(_: &loopd::frontend::nbd::conn::Conn) {}
//! ```

use super::affinity::{Follow, Peer};
use super::framing::{Framing, RecvState};
use super::lines;
use super::replies::ReplyQueue;
use super::slots::{SlotState, Slots};
use super::tls::TlsIo;
use super::transport::Transport;
use crate::device::Device;
use crate::device::export::{ClientRef, Export};
use crate::engine::admit::{PeerKey, Permit, Ticket};
use crate::frontend::nbd::wire::{ExportView, Replies};
use crate::ring::{Io, TAG_CANCEL, TAG_FILE, TAG_POLL, TAG_RECV, ud};
use io_uring::opcode;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Bytes of request buffers a connection may hold before it stops reading (at
/// most; a quarter of the daemon's memory budget when that is less).
pub const BYTES_BUDGET: usize = 128 << 20;

/// A negotiated connection, ready for the transmission phase.
pub struct NewConn {
    pub(crate) sock: OwnedFd,
    /// Its registration as a client of the export its handshake selected.
    pub(crate) client: ClientRef,
    /// Its place among the server's connections.
    pub(crate) permit: Permit,
    pub(crate) structured: bool,
    /// Extended headers were negotiated (32-byte headers, 64-bit lengths).
    pub(crate) extended: bool,
    pub(crate) meta_context: bool,
    /// How to find where the client runs.
    pub(crate) peer: Peer,
    /// The userspace TLS record layer of an encrypted session the kernel does
    /// not carry (see [`super::tls`]).
    pub(crate) tls: Option<Box<TlsIo>>,
    /// TLS was negotiated (kernel or userspace records).
    pub(crate) encrypted: bool,
}

/// One NBD connection. See the module documentation.
pub struct Conn {
    pub(super) sock: OwnedFd,
    pub(super) export: Arc<Export>,
    /// Counts this connection as a client of `export` until it is dropped.
    _client: ClientRef,
    /// Its place among the server's connections.
    permit: Permit,
    /// The configuration this connection uses, as of `epoch`.
    pub(super) dev: Arc<Device>,
    pub(super) epoch: u64,
    pub(super) view: ExportView,
    /// How replies are framed (simple, structured, extended headers).
    pub(super) replies: Replies,
    /// Request bytes in: headers, payloads, discards.
    pub(super) framing: Framing,
    pub(super) recv_inflight: bool,
    /// A poll for a hang-up is posted (while reads are paused), and whether
    /// a cancel of it has been submitted.
    pub(super) poll_inflight: bool,
    poll_cancel_sent: bool,
    /// The poll failed (not cancelled): none is posted again, rather than
    /// one a turn.
    pub(super) poll_failed: bool,
    /// No more requests will be read (EOF, DISC, error or shutdown).
    pub(super) read_closed: bool,
    /// The socket is broken: replies are dropped, not sent.
    pub(super) dead: bool,
    /// The in-flight table.
    pub(super) slots: Slots,
    /// Replies waiting to be sent, in order.
    pub(super) sendq: ReplyQueue,
    pub(super) send_inflight: bool,
    /// Plaintext, or the userspace TLS record layer.
    pub(super) transport: Transport,
    /// File operations (and block-status queries) in flight.
    pub(super) file_ops: u32,
    /// A cancel for the receive has been submitted.
    pub(super) cancel_sent: bool,
    /// Where the client runs, and whether to follow it to another reactor.
    peer: Peer,
    follow: Follow,
    /// A request was read since the reactor last looked where the client runs.
    pub(super) active: bool,
    /// Bytes were received since the reactor's last look for idle
    /// connections ([`Conn::idle_tick`]).
    pub(super) recent: bool,
    /// The receive in flight is being cancelled to give its lent buffer back.
    pub(super) shrinking: bool,
    /// Moving to this reactor (an index into the reactor's peers): no more
    /// requests are read; the move happens once nothing is in flight.
    pub(super) moving: Option<usize>,
    /// For the audit lines at connect and disconnect.
    pub(super) audit: ConnAudit,
    /// Set once nobody will read a reply (the connection is dead): the offload
    /// workers skip this connection's block-status queries not yet started.
    pub(super) gone: Arc<AtomicBool>,
    /// The kernel's own NBD client (a socket pair of this process, for
    /// `--blockdev nbd`).
    pub(super) kernel: bool,
}

/// What the connect and disconnect lines say about a connection.
pub(super) struct ConnAudit {
    /// The peer: `ADDR:PORT`, or `unix uid=U pid=P`.
    pub(super) who: String,
    /// The peer as the rate limit of these lines counts it ([`super::lines`]).
    pub(super) key: PeerKey,
    pub(super) opened: std::time::Instant,
    /// Requests read.
    pub(super) served: u64,
    /// Why it ended (set where reading stops).
    pub(super) reason: &'static str,
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

// SAFETY: the raw pointers a connection hands the kernel (its send's iovecs,
// its receive targets) point into its own slots and buffers and are only
// dereferenced while an operation is in flight; the connection moves between
// threads only before it is handed to its first reactor and when it moves to
// another (`move_target`: nothing in flight).
unsafe impl Send for Conn {}

impl Conn {
    /// A negotiated connection (the framing of its replies as the handshake
    /// agreed, [`Replies::of`]). Built on the thread that negotiated it; it
    /// then goes to its reactor as a session.
    pub fn new(nc: NewConn) -> Conn {
        let replies = Replies::of(nc.structured, nc.extended);
        let export = Arc::clone(nc.client.export());
        let (dev, epoch) = export.current();
        let view = ExportView {
            size: dev.size,
            read_only: dev.read_only,
            structured: replies != Replies::Simple,
            extended: replies == Replies::Extended,
            meta_context: nc.meta_context,
        };
        tracing::debug!("new connection to {:?}: {replies:?} replies", dev.name);
        let kernel = own_socket_pair(&nc.sock);
        let (who, key) = describe_peer(&nc.sock);
        let audit = ConnAudit {
            who,
            key,
            opened: Instant::now(),
            served: 0,
            reason: "closed",
        };
        if let Some(skipped) = lines::admit(audit.key) {
            tracing::info!(
                "audit: NBD client {} connected to {}, tls {}{}",
                audit.who,
                crate::text::quoted(&export.name),
                if nc.encrypted { "yes" } else { "no" },
                lines::left_out(skipped)
            );
        }
        Conn {
            sock: nc.sock,
            export,
            _client: nc.client,
            permit: nc.permit,
            dev,
            epoch,
            view,
            replies,
            framing: Framing::new(replies == Replies::Extended),
            recv_inflight: false,
            poll_inflight: false,
            poll_cancel_sent: false,
            poll_failed: false,
            read_closed: false,
            dead: false,
            slots: Slots::new(),
            sendq: ReplyQueue::with_capacity(0),
            send_inflight: false,
            transport: Transport::new(nc.tls),
            file_ops: 0,
            cancel_sent: false,
            peer: nc.peer,
            follow: Follow::default(),
            active: false,
            recent: false,
            shrinking: false,
            moving: None,
            audit,
            gone: Arc::new(AtomicBool::new(false)),
            kernel,
        }
    }

    pub(super) fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// The ticket of its place among the server's connections.
    pub(crate) fn ticket(&self) -> &Arc<Ticket> {
        self.permit.ticket()
    }

    /// Whether a moving connection has nothing in flight (no request, receive,
    /// send or file operation) and may go to its new reactor: where to (an
    /// index into the reactor's peers).
    pub(crate) fn move_target(&self) -> Option<usize> {
        let ready = !self.read_closed
            && !self.dead
            && self.framing.state() == RecvState::Header
            && !self.ops_in_flight()
            && self.sendq.is_empty()
            && self.slots.idle();
        self.moving.filter(|_| ready)
    }

    /// Whether the connection has nothing in flight and can be dropped.
    fn finished(&self) -> bool {
        self.read_closed && !self.ops_in_flight() && self.slots.idle()
    }

    /// Whether a receive, poll, send or file operation of this connection is
    /// in the ring.
    pub(crate) fn ops_in_flight(&self) -> bool {
        self.recv_inflight || self.poll_inflight || self.send_inflight || self.file_ops > 0
    }

    /// Where the client runs, at one of the reactor's looks (on CPU `here`,
    /// at `now`; `busy`: the machine is busy enough to follow clients): the
    /// CPU to move to, if the connection should follow its client there.
    pub(crate) fn look(&mut self, busy: bool, here: usize, now: Instant) -> Option<usize> {
        if self.moving.is_some() || self.read_closed || self.dead {
            return None;
        }
        // Only clients that sent requests are worth a look (and the probe).
        let client = if busy && std::mem::take(&mut self.active) {
            self.peer.cpu(&self.sock)
        } else {
            None
        };
        self.follow.observe(client, here, now)
    }

    /// Start moving to peer reactor `to` (no more requests are read here).
    pub(crate) fn move_to(&mut self, to: usize) {
        self.moving = Some(to);
    }

    /// Stay here after all (the move could not happen).
    pub(crate) fn stay(&mut self) {
        self.moving = None;
    }

    /// Taken in by a reactor: a connection that moved there is counted in
    /// its device's moves (and a receive buffer it brought along in the
    /// reactor's lent ones); one arriving while the reactor stops reads
    /// nothing more.
    pub(crate) fn arrive(&mut self, io: &mut Io, stopping: bool) {
        if self.framing.is_lent() {
            io.lender.out += 1;
        }
        if self.moving.take().is_some() {
            self.dev.stats.moves.fetch_add(1, Ordering::Relaxed);
        }
        if stopping {
            self.read_closed = true;
        }
    }

    /// The reactor is stopping: take no new requests; those in flight finish.
    pub(crate) fn stop_taking(&mut self, io: &mut Io, ci: u32) {
        self.moving = None;
        self.close_reading(io, ci);
    }

    /// Cut the connection off now (drain timeout, reactor exit): its socket is
    /// shut down; operations in flight still complete before it is dropped.
    pub(crate) fn cut_off(&mut self, io: &mut Io, ci: u32) {
        let _ = rustix::net::shutdown(&self.sock, rustix::net::Shutdown::Both);
        self.kill(io, ci);
    }

    /// Its place went to another peer's newcomer (see `engine::admit`): cut
    /// off, and the disconnect line says why.
    pub(crate) fn give_up_place(&mut self, io: &mut Io, ci: u32) {
        self.cut_off(io, ci);
        self.audit.reason = "closed to make room for another peer (--max-connections)";
    }

    /// Retry request `si` parked on its range (if it still is).
    pub(crate) fn retry(&mut self, io: &mut Io, ci: u32, si: u16) {
        if self.slots.state_of(si) == SlotState::WaitLock {
            self.dispatch(io, ci, si);
        }
    }

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
    pub(super) fn close_reading(&mut self, io: &mut Io, ci: u32) {
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
        for si in self.slots.in_state(SlotState::Io) {
            let e = opcode::AsyncCancel::new(ud(TAG_FILE, ci, si))
                .build()
                .user_data(ud(TAG_CANCEL, ci, 0));
            // SAFETY: a cancel refers to no memory, only to a user_data value.
            unsafe { io.push(e) };
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
        let held = self.slots.unhold(si);
        if held > 0 {
            self.export.unhold(held);
        }
    }

    /// Free a slot: release its range (or its place in line) and its buffers.
    pub(super) fn release_slot(&mut self, io: &mut Io, si: u16) {
        if self.slots.state_of(si) == SlotState::Free {
            return;
        }
        self.unhold(si);
        let slot = self.slots.get_mut(si);
        slot.req_mut()
            .release(&self.dev, &self.export, &mut io.pool);
        if let Some(e) = slot.take_extra() {
            io.pool.put(e);
        }
        slot.drop_pipes(&mut io.pipes, false);
        self.slots.free(si);
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
    pub(crate) fn on_poll(&mut self, io: &mut Io, ci: u32, res: i32) {
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
        if !self.recv_inflight
            && let Some(slot) = self.framing.end_payload()
        {
            self.release_slot(io, slot);
        }
        self.hang_up(io, ci);
    }

    /// The socket is unusable: drop queued replies and parked requests; requests
    /// with a file operation or receive in flight are released when it completes.
    pub(super) fn kill(&mut self, io: &mut Io, ci: u32) {
        self.gone.store(true, Ordering::Relaxed);
        self.dead = true;
        self.close_reading(io, ci);
        self.drop_unsent(io);
    }

    fn drop_unsent(&mut self, io: &mut Io) {
        if !self.send_inflight {
            while let Some(si) = self.sendq.pop() {
                self.release_slot(io, si);
            }
        }
        for si in 0..self.slots.len() {
            if self.slots.state_of(si) == SlotState::WaitLock {
                self.release_slot(io, si);
            }
        }
    }

    /// After a batch: parse, send, and report whether the connection is done.
    pub(crate) fn service(&mut self, io: &mut Io, ci: u32) -> bool {
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
