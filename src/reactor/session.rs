//! The closed set of sessions a reactor drives, dispatched statically.
//!
//! A session owns its socket or queue, its request slots and everything its
//! in-flight operations refer to; the reactor routes each completion to the
//! session named in its `user_data` and services the sessions a batch touched.
//! An NBD connection may move to another reactor; a ublk queue never moves.

use crate::engine::offload::StatusDone;
use crate::frontend::nbd::conn::Conn;
use crate::frontend::ublk::queue::Queue;
use crate::ring::{Io, TAG_FILE, TAG_POLL, TAG_RECV, TAG_SEND};

pub enum Session {
    Nbd(Box<Conn>),
    Ublk(Box<Queue>),
}

impl Session {
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
            Session::Nbd(c) => {
                if c.waiting(slot) {
                    c.dispatch(io, si, slot);
                }
            }
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
            Session::Nbd(c) => {
                c.moving = None;
                c.close_reading(io, si);
            }
            // A queue takes requests until the daemon stops its device.
            Session::Ublk(_) => {}
        }
    }

    /// Cut the session off now (drain timeout, reactor exit): its socket is shut
    /// down; operations in flight still complete before it is dropped.
    pub fn kill(&mut self, io: &mut Io, si: u32) {
        match self {
            Session::Nbd(c) => {
                let _ = rustix::net::shutdown(&c.sock, rustix::net::Shutdown::Both);
                c.kill(io, si);
            }
            // Its commands end when the device is stopped (or the process exits).
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

    /// The NBD connection, for what only connections do (moving between
    /// reactors).
    pub fn as_conn(&mut self) -> Option<&mut Conn> {
        match self {
            Session::Nbd(c) => Some(c),
            Session::Ublk(_) => None,
        }
    }
}
