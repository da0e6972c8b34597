//! Sending replies: queued replies go out in order, many per `sendmsg`, with
//! partial sends resumed where they stopped; a spliced reply goes out of its
//! pipes on its own.

use super::conn::{Conn, MAX_IOV};
use crate::ring::{Io, TAG_SEND, ud};
use io_uring::{opcode, types};
use std::os::fd::AsRawFd;

impl Conn {
    /// Start sending queued replies, if no send is in flight.
    pub fn send(&mut self, io: &mut Io, ci: u32) {
        if self.tls.is_some() {
            self.send_tls(io, ci);
            return;
        }
        if self.send_inflight || self.sendq.is_empty() || self.dead {
            return;
        }
        if let Some(&si) = self.sendq.front()
            && self.slots[si as usize].spliced()
        {
            // Sent on its own, out of its pipes.
            let Some((pipe, left)) = self.slots[si as usize].pipe_at(self.front_sent) else {
                return;
            };
            let left = u32::try_from(left).unwrap_or(0);
            let sock = types::Fd(self.sock.as_raw_fd());
            let e = opcode::Splice::new(types::Fd(pipe.r.as_raw_fd()), -1, sock, -1, left)
                .build()
                .user_data(ud(TAG_SEND, ci, 0));
            self.send_inflight = true;
            // SAFETY: a splice refers to no memory; the pipe stays in the
            // slot until the send completes.
            unsafe { io.push(e) };
            return;
        }
        let n_iov = self.fill_iov();
        if n_iov == 0 {
            return; // nothing sendable (cannot happen: a queued reply has a header)
        }
        self.msg.msg_iov = self.iov.as_mut_ptr();
        self.msg.msg_iovlen = n_iov;
        self.send_inflight = true;
        let msg: *const libc::msghdr = &*self.msg;
        let e = opcode::SendMsg::new(types::Fd(self.sock.as_raw_fd()), msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(ud(TAG_SEND, ci, 0));
        // SAFETY: `msg` and `iov` live in the connection's boxes and point at
        // reply headers in its slot table and at data in its slots' buffers; none
        // of them moves or is freed while `send_inflight` (see `on_send`).
        unsafe { io.push(e) };
    }

    /// [`Conn::send`] through the userspace record layer: the queued replies'
    /// plaintext (as much as one batch takes) is encrypted and sent from the
    /// record layer's buffer.
    fn send_tls(&mut self, io: &mut Io, ci: u32) {
        if self.send_inflight || self.dead {
            return;
        }
        if self.sendq.is_empty() && !self.tls.as_ref().is_some_and(|t| t.wants_write()) {
            return;
        }
        let n_iov = self.fill_iov();
        let Some(tls) = self.tls.as_mut() else {
            return;
        };
        let parts = self.iov[..n_iov].iter().map(|v| {
            // SAFETY: `fill_iov` points each iovec at a queued slot's header or
            // data (its task's buffer or status descriptors), alive while the
            // slot is queued, which it is until this send completes.
            unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) }
        });
        if let Err(e) = tls.encrypt(parts) {
            tracing::info!("closing a TLS connection to {:?}: {e}", self.dev.name);
            self.kill(io, ci);
            return;
        }
        self.post_tls_send(io, ci);
    }

    /// Point `self.iov` at the queued replies' bytes still to send, in order
    /// (each reply's header and data, less the `front_sent` bytes earlier
    /// partial sends took), stopping before a spliced reply (sent on its own)
    /// and at [`MAX_IOV`]; returns how many iovecs are set.
    fn fill_iov(&mut self) -> usize {
        let mut n_iov = 0;
        let mut skip = self.front_sent;
        for &si in self.sendq.iter() {
            let s = &self.slots[si as usize];
            if n_iov + 2 > MAX_IOV || s.spliced() {
                break;
            }
            for (ptr, len) in [(s.hdr.as_ptr(), s.hdr_len), (s.data_ptr(), s.data_len)] {
                if skip >= len {
                    skip -= len;
                    continue;
                }
                // SAFETY: skip < len, so the pointer stays inside the part.
                let p = unsafe { ptr.add(skip) };
                self.iov[n_iov] = libc::iovec {
                    iov_base: p as *mut libc::c_void,
                    iov_len: len - skip,
                };
                skip = 0;
                n_iov += 1;
            }
        }
        n_iov
    }

    fn post_tls_send(&mut self, io: &mut Io, ci: u32) {
        let Some(tls) = self.tls.as_ref() else {
            return;
        };
        let (ptr, len) = tls.tx_pending();
        if len == 0 {
            return;
        }
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        self.send_inflight = true;
        let e = opcode::Send::new(types::Fd(self.sock.as_raw_fd()), ptr, len)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(ud(TAG_SEND, ci, 0));
        // SAFETY: the record layer's ciphertext buffer lives in the connection
        // and is neither touched nor freed while `send_inflight`.
        unsafe { io.push(e) };
    }

    pub fn on_send(&mut self, io: &mut Io, ci: u32, res: i32) {
        self.send_inflight = false;
        let res = match self.tls.as_mut() {
            Some(tls) if res > 0 => match tls.sent(res as usize) {
                None => {
                    self.post_tls_send(io, ci);
                    return;
                }
                Some(0) => return, // rustls's own message (an alert) went out
                Some(plain) => i32::try_from(plain).unwrap_or(i32::MAX),
            },
            _ => res,
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
        let mut n = res as usize + self.front_sent;
        self.front_sent = 0;
        while let Some(&si) = self.sendq.front() {
            let len = self.slots[si as usize].reply_len();
            if n < len {
                self.front_sent = n;
                break;
            }
            n -= len;
            self.sendq.pop_front();
            self.slots[si as usize].drop_pipes(&mut io.pipes, true);
            self.release_slot(io, si);
        }
    }
}
