//! The closed set of sessions a reactor drives, dispatched statically.
//!
//! A session owns its socket or queue, its request slots and everything its
//! in-flight operations refer to; the reactor routes each completion to the
//! session named in its `user_data` and services the sessions a batch touched.
//! The reactor knows sessions only through this interface: it is handed them
//! built ([`Session::nbd`], [`Session::ublk`]), adopts them, asks them to move
//! or stop through methods, and never reads what is inside.
//! An NBD connection may move to another reactor; a ublk queue never moves.

use crate::engine::admit::Ticket;
use crate::engine::offload::StatusDone;
use crate::frontend::nbd::conn::Conn;
use crate::frontend::ublk::queue::Queue;
use crate::ring::{Io, TAG_FILE, TAG_POLL, TAG_RECV, TAG_SEND};
use std::sync::Arc;
use std::time::Instant;

pub use crate::frontend::nbd::conn::BYTES_BUDGET as CONN_BYTES_BUDGET;

pub enum Session {
    Nbd(Box<Conn>),
    Ublk(Box<Queue>),
}

impl Session {
    /// An NBD connection (built where it was negotiated), as a session to
    /// hand to a reactor.
    pub fn nbd(c: Conn) -> Session {
        Session::Nbd(Box::new(c))
    }

    /// A ublk queue built on its reactor.
    pub fn ublk(q: Queue) -> Session {
        Session::Ublk(Box::new(q))
    }

    /// Adopted by a reactor as session `si` (`stopping`: the reactor is
    /// stopping, so the session takes no new requests).
    pub fn adopted(&mut self, io: &mut Io, si: u32, stopping: bool) {
        match self {
            Session::Nbd(c) => c.arrive(io, stopping),
            // A queue fetches its tags once it has its index.
            Session::Ublk(q) => q.start(io, si),
        }
    }

    /// Route a completion (`tag`, `slot`, `res`) of session `si`.
    pub fn on_cqe(&mut self, io: &mut Io, si: u32, tag: u64, slot: u16, res: i32) {
        match self {
            Session::Nbd(c) => match tag {
                TAG_RECV => c.on_recv(io, si, res),
                TAG_SEND => c.on_send(io, si, res),
                TAG_FILE => c.on_file(io, si, slot, res),
                TAG_POLL => c.on_poll(io, si, res),
                // TAG_CANCEL: the cancelled operation completes on its own.
                _ => {}
            },
            Session::Ublk(q) => q.on_cqe(io, si, tag, slot, res),
        }
    }

    /// An allocation query answered by the offload workers.
    pub fn on_status(&mut self, io: &mut Io, si: u32, d: StatusDone) {
        match self {
            Session::Nbd(c) => c.on_status(io, si, d),
            Session::Ublk(_) => {}
        }
    }

    /// Retry request `slot` parked on its range (if it still is).
    pub fn retry(&mut self, io: &mut Io, si: u32, slot: u16) {
        match self {
            Session::Nbd(c) => c.retry(io, si, slot),
            Session::Ublk(q) => q.retry(io, si, slot),
        }
    }

    /// After a batch: take new requests, send replies. True when the session is
    /// finished and may be dropped.
    pub fn service(&mut self, io: &mut Io, si: u32) -> bool {
        match self {
            Session::Nbd(c) => c.service(io, si),
            Session::Ublk(q) => q.service(io, si),
        }
    }

    /// The reactor is stopping: take no new requests; those in flight finish.
    pub fn stop_taking(&mut self, io: &mut Io, si: u32) {
        match self {
            Session::Nbd(c) => c.stop_taking(io, si),
            // A queue takes requests until the daemon stops its device.
            Session::Ublk(_) => {}
        }
    }

    /// Cut the session off now (drain timeout, reactor exit): its socket is shut
    /// down; operations in flight still complete before it is dropped.
    pub fn kill(&mut self, io: &mut Io, si: u32) {
        match self {
            Session::Nbd(c) => c.cut_off(io, si),
            // Its commands end when the device is stopped (or the process exits).
            Session::Ublk(_) => {}
        }
    }

    /// Its place among the server's connections went to another peer's
    /// newcomer: cut off, saying why.
    pub fn give_up_place(&mut self, io: &mut Io, si: u32) {
        match self {
            Session::Nbd(c) => c.give_up_place(io, si),
            Session::Ublk(_) => {}
        }
    }

    /// Whether any operation of the session is still in the ring.
    pub fn ops_in_flight(&self) -> bool {
        match self {
            Session::Nbd(c) => c.ops_in_flight(),
            Session::Ublk(q) => q.ops_in_flight(),
        }
    }

    /// The ticket of its place among the server's connections (an NBD
    /// connection's).
    pub fn ticket(&self) -> Option<&Arc<Ticket>> {
        match self {
            Session::Nbd(c) => Some(c.ticket()),
            Session::Ublk(_) => None,
        }
    }

    /// One look of the stall timer (see [`crate::frontend::nbd::stall`]):
    /// true when the session was cut off (the caller services it).
    pub fn stall_tick(&mut self, io: &mut Io, si: u32) -> bool {
        match self {
            Session::Nbd(c) => c.stall_tick(io, si),
            Session::Ublk(_) => false,
        }
    }

    /// One look for idle connections (see [`crate::frontend::nbd::conn`]):
    /// whether the session still holds a receive buffer lent by the reactor.
    pub fn idle_tick(&mut self, io: &mut Io, si: u32) -> bool {
        match self {
            Session::Nbd(c) => c.idle_tick(io, si),
            Session::Ublk(_) => false,
        }
    }

    /// Where its client runs, at a look on CPU `here` (`busy`: follow
    /// clients): the CPU the session should move to, if any.
    pub fn look(&mut self, busy: bool, here: usize, now: Instant) -> Option<usize> {
        match self {
            Session::Nbd(c) => c.look(busy, here, now),
            Session::Ublk(_) => None,
        }
    }

    /// Start moving to peer reactor `to`: it reads no more requests here.
    pub fn move_to(&mut self, to: usize) {
        if let Session::Nbd(c) = self {
            c.move_to(to);
        }
    }

    /// Stay after all (the move cannot happen).
    pub fn stay(&mut self) {
        if let Session::Nbd(c) = self {
            c.stay();
        }
    }

    /// A moving session with nothing in flight: the peer reactor to hand it
    /// to now.
    pub fn move_target(&self) -> Option<usize> {
        match self {
            Session::Nbd(c) => c.move_target(),
            Session::Ublk(_) => None,
        }
    }
}
