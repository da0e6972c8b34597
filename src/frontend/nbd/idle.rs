//! What an idle connection holds: its memory is lent while it is busy and
//! given back once it is idle, so that a connection that sends nothing costs
//! little (a small receive buffer of its framing, no slots).
//!
//! A connection borrows its reactor's large receive buffer
//! ([`crate::engine::buffer::Lender`]) before posting a receive when its
//! framing wants room ([`super::framing::Framing::wants_room`]: requests in
//! flight, a receive that filled the small buffer, a large payload to throw
//! away), and makes slots as its requests need them ([`super::slots`]). Both
//! go back at the reactor's look for idle connections ([`Conn::idle_tick`],
//! every second while it has buffers lent): a connection that received
//! nothing since the last look, with nothing buffered, in flight or queued,
//! drops its slots at once, and its lent buffer once no receive refers to it
//! — if one is posted (plaintext only; the userspace TLS record layer keeps
//! its receive), it is cancelled, and the buffer goes back when the cancel
//! completes ([`Conn::on_recv`]: bytes that beat the cancel are taken as
//! usual, and the buffer stays). A client that sends again after that pays
//! one receive into the small buffer before it borrows again.
//!
//! Contract: as [`super::conn`]'s: on the connection's reactor thread. A
//! buffer is changed only while no receive is posted into it.

use super::conn::Conn;
use super::framing::RecvState;
use crate::ring::Io;

impl Conn {
    /// Whether the connection is idle: nothing buffered or arriving,
    /// no request in flight, nothing to send, and it is reading.
    fn quiet(&self) -> bool {
        !self.read_closed
            && !self.dead
            && self.moving.is_none()
            && self.framing.state() == RecvState::Header
            && self.framing.avail() == 0
            && self.slots.idle()
            && self.sendq.is_empty()
            && !self.send_inflight
            && self.file_ops == 0
    }

    /// Before a receive into the framing: borrow the large buffer if the
    /// framing wants room (no receive is posted).
    pub(super) fn borrow_room(&mut self, io: &mut Io) {
        if self.framing.wants_room(!self.slots.idle()) {
            self.framing.lend(io.lender.lend());
        }
    }

    /// Give the lent buffer back and drop the slots, if the connection is
    /// idle and no receive is posted.
    pub(super) fn go_small(&mut self, io: &mut Io) {
        if self.recv_inflight || !self.quiet() {
            return;
        }
        self.slots.shrink();
        if let Some(b) = self.framing.give_back() {
            io.lender.give_back(b);
        }
    }

    /// The reactor's look for idle connections (once a second while it has
    /// buffers lent): give back what an idle connection holds, or start to
    /// (cancel its receive). Whether it still holds a lent buffer.
    pub(crate) fn idle_tick(&mut self, io: &mut Io, ci: u32) -> bool {
        let recent = std::mem::take(&mut self.recent);
        if !recent && self.quiet() {
            self.slots.shrink();
            if !self.recv_inflight {
                self.go_small(io);
            } else if self.framing.is_lent() && self.transport.can_splice() && !self.cancel_sent {
                // Plaintext: the receive's buffer is the framing's. Its
                // cancel completes in `on_recv`, which gives the buffer back.
                self.shrinking = true;
                self.cancel_recv(io, ci);
            }
        }
        self.framing.is_lent()
    }

    /// A receive completed with `res` while it was being cancelled to give
    /// its buffer back: true if that is done (the cancel took it; the
    /// connection then posts its next receive into the small buffer).
    pub(super) fn shrunk(&mut self, io: &mut Io, res: i32) -> bool {
        if !std::mem::take(&mut self.shrinking) {
            return false;
        }
        if self.moving.is_none() && !self.read_closed {
            self.cancel_sent = false;
            if res == -libc::ECANCELED {
                self.go_small(io);
                return true;
            }
        }
        false
    }
}
