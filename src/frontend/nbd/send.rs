//! Sending replies: the connection's send path, feeding its reply queue
//! ([`super::replies`]) to the transport ([`super::transport`]). Queued
//! replies go out in order, many per send, with partial sends resumed where
//! they stopped; a spliced reply goes out of its pipes on its own.

use super::conn::Conn;
use super::transport::{MAX_IOV, SendDone};
use crate::ring::{Io, TAG_SEND, ud};
use io_uring::{opcode, types};
use std::os::fd::AsRawFd;

impl Conn {
    /// Start sending queued replies, if no send is in flight.
    pub(super) fn send(&mut self, io: &mut Io, ci: u32) {
        if self.send_inflight || self.dead {
            return;
        }
        if self.sendq.is_empty() && !self.transport.wants_write() {
            return;
        }
        if let Some(si) = self.sendq.front()
            && self.slots.get(si).spliced()
        {
            // Sent on its own, out of its pipes.
            let Some((pipe, left)) = self.slots.get(si).pipe_at(self.sendq.front_sent()) else {
                return;
            };
            let left = u32::try_from(left).unwrap_or(0);
            let sock = types::Fd(self.fd());
            let e = opcode::Splice::new(types::Fd(pipe.r.as_raw_fd()), -1, sock, -1, left)
                .build()
                .user_data(ud(TAG_SEND, ci, 0));
            self.send_inflight = true;
            // SAFETY: a splice refers to no memory; the pipe stays in the
            // slot until the send completes.
            unsafe { io.push(e) };
            return;
        }
        let fd = self.fd();
        let (slots, sendq) = (&self.slots, &self.sendq);
        // SAFETY: every piece is a queued slot's reply header or data (its
        // task's buffer or status descriptors); a queued slot keeps them,
        // unchanged, until its reply is sent, which is not before this send
        // completes (`on_send`); the slot table never moves.
        let sent = unsafe {
            self.transport.send(io, ci, fd, |emit| {
                sendq.gather(
                    MAX_IOV,
                    |si| {
                        let s = slots.get(si);
                        (!s.spliced()).then(|| s.parts())
                    },
                    emit,
                );
            })
        };
        match sent {
            Ok(posted) => self.send_inflight = posted,
            Err(e) => {
                tracing::info!("closing a TLS connection to {:?}: {e}", self.dev.name);
                self.kill(io, ci);
            }
        }
    }

    /// A send completed with `res`.
    pub(crate) fn on_send(&mut self, io: &mut Io, ci: u32, res: i32) {
        self.send_inflight = false;
        let fd = self.fd();
        let res = match self.transport.on_send(io, ci, fd, res) {
            SendDone::Result(r) => r,
            SendDone::Again => {
                self.send_inflight = true;
                return;
            }
            SendDone::Own => return,
        };
        if res == 0 {
            // Nothing sent although something was asked: a splice whose page went
            // bad (a page-cache page that could not be confirmed) says so with 0,
            // and would say it again forever. Give up on the connection.
            tracing::warn!(
                "closing a connection to {:?}: a reply could not be sent",
                self.dev.name
            );
            self.kill(io, ci);
            return;
        }
        if res < 0 {
            if res != -libc::EPIPE && res != -libc::ECONNRESET {
                tracing::debug!(
                    "send failed on a connection to {:?}: errno {}",
                    self.dev.name,
                    -res
                );
            }
            self.kill(io, ci);
            return;
        }
        let slots = &self.slots;
        let done = self
            .sendq
            .sent(res.unsigned_abs() as usize, |si| slots.get(si).reply_len());
        for _ in 0..done {
            let Some(si) = self.sendq.pop() else {
                break;
            };
            self.slots.get_mut(si).drop_pipes(&mut io.pipes, true);
            self.release_slot(io, si);
        }
    }
}
