//! Reading requests: headers into the connection's buffer, write payloads
//! straight into their task's buffer, rejected payloads thrown away. A request is
//! taken only when a slot, the connection's byte allowance, its device's share
//! of the memory budget and the budget itself allow, and while its export is
//! not frozen. A client that hangs up (EOF or a broken socket before
//! NBD_CMD_DISC) stops its requests ([`Conn::hang_up`]), seen by the posted
//! receive, or, while reading is paused, by a poll of the socket
//! ([`Conn::on_poll`]).

use super::conn::{Conn, RBUF, RecvState, SlotState};
use super::tls::Received;
use crate::block::Op;
use crate::engine::task::{self, Task};
use crate::engine::{budget, buffer};
use crate::frontend::nbd::proto::*;
use crate::frontend::nbd::wire::{self, Command};
use crate::ring::{Io, TAG_POLL, TAG_RECV, ud};
use io_uring::{opcode, types};
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// Effect bytes of one piece of a request longer than a task can be (a power
/// of two, so pieces of an aligned request stay aligned).
pub(super) const PIECE: u32 = 1 << 31;

/// Bytes of reply descriptors a BLOCK_STATUS holds (64-bit descriptors, the
/// larger kind), counted against the budget's shares like a read's data.
const STATUS_BYTES: usize = 16 * crate::device::status::MAX_DESCRIPTORS;

/// The range a BLOCK_STATUS request asks the backing file about: a 64-bit
/// length is cut to whole blocks below 4 GiB (the reply may cover less than
/// asked; the client asks again from where it ends).
fn status_len(dev: &crate::device::Device, len: u64) -> u32 {
    let bs = dev.block_size.max(1);
    u32::try_from(len).unwrap_or(u32::MAX / bs * bs)
}

impl Conn {
    /// Post a receive of up to `len` bytes into `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` lies in this connection's receive buffer or in the task
    /// buffer of one of its slots, which stays put until the receive completes.
    unsafe fn post_recv(&mut self, io: &mut Io, ci: u32, ptr: *mut u8, len: usize) {
        self.recv_inflight = true;
        let (ptr, len) = match self.tls.as_mut() {
            None => (ptr, len),
            Some(tls) => {
                // Already decrypted (or over): the receive completes through
                // the ring as a NOP whose count is `ready`, so `on_recv` runs
                // as for any receive.
                // SAFETY: by this function's contract, the target stays valid
                // until this receive completes.
                let now = match unsafe { tls.set_target(ptr, len) } {
                    Ok(Received::NeedMore) => None,
                    Ok(Received::Plain(n)) => Some(n),
                    Ok(Received::Closed) => Some(0),
                    Err(e) => {
                        tracing::info!("closing a TLS connection to {:?}: {e}", self.dev.name);
                        self.dead = true;
                        Some(0)
                    }
                };
                match now {
                    None => tls.rx_space(),
                    Some(n) => {
                        tls.ready = Some(n);
                        let e = opcode::Nop::new().build().user_data(ud(TAG_RECV, ci, 0));
                        // SAFETY: a NOP refers to no memory.
                        unsafe { io.push(e) };
                        return;
                    }
                }
            }
        };
        // SAFETY: by this function's contract (or, with TLS, the free tail of
        // the record layer's ciphertext buffer, which lives in the connection).
        unsafe { self.push_recv(io, ci, ptr, len) };
    }

    /// Submit the receive SQE of `len` bytes into `ptr`.
    ///
    /// # Safety
    /// As [`Conn::post_recv`]: the memory stays put until the receive completes.
    unsafe fn push_recv(&self, io: &mut Io, ci: u32, ptr: *mut u8, len: usize) {
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        let e = opcode::Recv::new(types::Fd(self.sock.as_raw_fd()), ptr, len)
            .build()
            .user_data(ud(TAG_RECV, ci, 0));
        // SAFETY: by this function's contract.
        unsafe { io.push(e) };
    }

    /// A TLS receive completed: what it means for the connection's target.
    /// `Some(res)` goes on as a plaintext receive's result; `None` means the
    /// receive goes on (more ciphertext was asked for).
    fn tls_received(&mut self, io: &mut Io, ci: u32, res: i32) -> Option<i32> {
        let tls = self.tls.as_mut()?;
        if let Some(n) = tls.ready.take() {
            return Some(i32::try_from(n).unwrap_or(-libc::EPROTO));
        }
        if res <= 0 {
            return Some(res);
        }
        match tls.received(res as usize) {
            Ok(Received::Plain(n)) => Some(i32::try_from(n).unwrap_or(-libc::EPROTO)),
            Ok(Received::Closed) => Some(0),
            Ok(Received::NeedMore) => {
                if self.read_closed || self.moving.is_some() {
                    return Some(-libc::ECANCELED);
                }
                let (ptr, len) = tls.rx_space();
                if len == 0 {
                    return Some(-libc::EPROTO);
                }
                self.recv_inflight = true;
                // SAFETY: the free tail of the record layer's ciphertext buffer,
                // which lives in the connection until the receive completes.
                unsafe { self.push_recv(io, ci, ptr, len) };
                None
            }
            Err(e) => {
                tracing::info!("closing a TLS connection to {:?}: {e}", self.dev.name);
                self.dead = true;
                Some(-libc::EPROTO)
            }
        }
    }

    /// Parse what is buffered and keep a receive posted, as far as budget
    /// allows; while none is posted, watch the socket for a hang-up.
    pub fn pump(&mut self, io: &mut Io, ci: u32) {
        self.take_requests(io, ci);
        if !(self.recv_inflight
            || self.poll_inflight
            || self.poll_failed
            || self.read_closed
            || self.dead
            || self.moving.is_some())
        {
            self.poll_inflight = true;
            let ev = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
            let e = opcode::PollAdd::new(types::Fd(self.sock.as_raw_fd()), ev as u32)
                .build()
                .user_data(ud(TAG_POLL, ci, 0));
            // SAFETY: a poll refers to no memory; the socket stays open until
            // the connection is dropped, which waits for the poll's completion.
            unsafe { io.push(e) };
        }
    }

    fn take_requests(&mut self, io: &mut Io, ci: u32) {
        if self.export.forced() && !self.dead {
            // A forced detach: cut the connection off now. Shutting the socket
            // down fails a send stuck on a client that does not read; file I/O in
            // flight is cancelled where the kernel can, and its buffers are
            // released when it completes.
            let _ = rustix::net::shutdown(&self.sock, rustix::net::Shutdown::Both);
            self.cancel_file_ops(io, ci);
            self.kill(io, ci);
        } else if self.export.closing() && !self.read_closed {
            // Detached: stop reading (cancelling a receive an idle client left
            // posted); the connection closes once its requests are answered.
            self.close_reading(io, ci);
        }
        loop {
            if self.read_closed || self.recv_inflight || self.dead {
                return;
            }
            match self.recv {
                RecvState::Discard { remaining } => {
                    let avail = self.avail();
                    let take = usize::try_from(remaining).map_or(avail, |r| r.min(avail));
                    self.rstart += take;
                    let left = remaining - take as u64;
                    if left == 0 {
                        self.recv = RecvState::Header;
                        continue;
                    }
                    self.recv = RecvState::Discard { remaining: left };
                    self.rstart = 0;
                    self.rend = 0;
                    let ptr = self.rbuf.as_mut_ptr();
                    let n = usize::try_from(left).unwrap_or(RBUF).min(RBUF);
                    // SAFETY: n <= RBUF bytes of the connection's receive buffer.
                    unsafe { self.post_recv(io, ci, ptr, n) };
                    return;
                }
                RecvState::Payload { .. } => return,
                RecvState::Header if self.moving.is_some() => {
                    // Read no further here: what arrives is the new reactor's.
                    self.cancel_recv(io, ci);
                    return;
                }
                RecvState::Header => {}
            }
            let hlen = wire::request_len(self.view.extended);
            if self.avail() < hlen {
                self.compact();
                let at = self.rend;
                // SAFETY: at <= RBUF, the buffer's capacity.
                let ptr = unsafe { self.rbuf.as_mut_ptr().add(at) };
                // SAFETY: the free tail of the connection's receive buffer.
                unsafe { self.post_recv(io, ci, ptr, RBUF - at) };
                return;
            }
            if self.free_slots.is_empty() || self.bytes_held > io.per_conn_bytes {
                return; // resumed when a reply has been sent
            }
            if !self.export.enter(&io.waker) {
                io.parked.push(ci);
                return; // frozen: resumed when the export thaws
            }
            if self.export.epoch() != self.epoch {
                self.reload();
            }
            let hdr = &self.rbuf.as_slice()[self.rstart..self.rstart + hlen];
            let req = match wire::parse_header(hdr, self.view.extended) {
                Ok(r) => r,
                Err(e) => {
                    self.audit.reason = "framing error";
                    self.export.leave();
                    tracing::warn!(
                        "closing a connection to {:?}: framing error: {e}",
                        self.dev.name
                    );
                    self.kill(io, ci);
                    return;
                }
            };
            // The request's data buffer must fit in its device's share and in
            // the daemon's memory budget before the request is taken; if it
            // does not, read no further until budget is released (the header
            // stays buffered).
            let valid = wire::validate(&req, &self.view);
            // What one task does: all of a request but a 64-bit TRIM,
            // WRITE_ZEROES or CACHE, which runs as pieces (`Slot::rest`); a
            // read's or write's length is at most MAX_PAYLOAD once valid.
            let piece = u32::try_from(req.len).unwrap_or(PIECE);
            let need = match valid {
                Ok(Command::BlockStatus) => STATUS_BYTES,
                Ok(c) => match c.op() {
                    Some(op @ (Op::Read | Op::Write)) => {
                        task::buffer_len(&self.dev, op, req.offset, piece)
                    }
                    _ => 0,
                },
                Err(_) => 0,
            };
            let held = if need > 0 {
                buffer::capacity_for(need)
            } else {
                0
            };
            if held > 0 && !self.take_budget(io, need, held) {
                self.export.leave();
                io.parked.push(ci);
                return;
            }
            self.rstart += hlen;
            self.active = true;
            self.audit.served += 1;
            let Some(si) = self.free_slots.pop() else {
                self.export.unhold(held);
                self.export.leave();
                return;
            };
            self.bytes_held += held;
            let slot = &mut self.slots[si as usize];
            slot.held = held;
            slot.cookie = req.cookie;
            slot.offset = req.offset;
            slot.rest = 0;
            slot.rest_fua = req.flags & CMD_FLAG_FUA != 0;
            slot.req.arrived(None);
            let cmd = match valid {
                Err(rej) => {
                    self.slots[si as usize].state = SlotState::Io;
                    if rej.payload > 0 {
                        self.recv = RecvState::Discard {
                            remaining: rej.payload,
                        };
                    }
                    self.finish(io, ci, si, req.kind == CMD_READ, Err(rej.errno));
                    continue;
                }
                Ok(cmd) => cmd,
            };
            let Some(op) = cmd.op() else {
                if cmd == Command::BlockStatus {
                    self.dev.stats.status_query();
                    let one = req.flags & CMD_FLAG_REQ_ONE != 0;
                    let len = status_len(&self.dev, req.len);
                    self.block_status(io, ci, si, req.offset, len, one);
                    continue;
                }
                // DISC: answered by closing once everything before it is.
                let slot = &mut self.slots[si as usize];
                slot.req.entered = false;
                slot.req.started = None;
                self.export.leave();
                self.free_slots.push(si);
                self.audit.reason = "client disconnected (NBD_CMD_DISC)";
                self.read_closed = true;
                return;
            };
            if matches!(op, Op::Trim | Op::WriteZeroes | Op::Cache) {
                self.slots[si as usize].rest = req.len - u64::from(piece).min(req.len);
            }
            let mut flags = wire::req_flags(req.flags);
            // FUA goes with the last piece: its sync covers the ones before.
            flags.fua &= self.slots[si as usize].rest == 0;
            let mut task = Task::plan(&self.dev, op, flags, req.offset, piece, &mut io.pool);
            let len = piece as usize;
            if op == Op::Write {
                let have = self.avail().min(len);
                let (s, e) = (self.rstart, self.rstart + have);
                task.payload_mut()[..have].copy_from_slice(&self.rbuf.as_slice()[s..e]);
                self.rstart = e;
                if have < len {
                    let ptr = task.payload_mut()[have..].as_mut_ptr();
                    let slot = &mut self.slots[si as usize];
                    // Its payload must arrive within the progress deadline
                    // of its header while others wait for budget.
                    slot.since = io.ticks;
                    slot.req.task = Some(task);
                    slot.state = SlotState::Receiving;
                    self.recv = RecvState::Payload {
                        slot: si,
                        got: have,
                    };
                    // SAFETY: the rest of the slot's task buffer, which stays in
                    // the slot until the receive completes.
                    unsafe { self.post_recv(io, ci, ptr, len - have) };
                    return;
                }
            }
            self.slots[si as usize].req.task = Some(task);
            self.dispatch(io, ci, si);
        }
    }

    /// Reserve the data buffer of a request (`need` bytes, `cap` as the pool
    /// hands it out): `cap` of its device's share, then the buffer from the
    /// daemon's budget — within the share, or, for a device that held
    /// nothing, from the reserve in its turn (see [`crate::engine::budget`]).
    /// False: refused, nothing held; the connection waits for its device's
    /// releases (share refused) or, marked starved, for a release anywhere.
    fn take_budget(&mut self, io: &mut Io, need: usize, cap: usize) -> bool {
        let share = io.device_share;
        let first = match self.export.hold(cap, share) {
            Some(first) => first,
            None => {
                // Register, then try again: an `unhold` in between wakes us.
                self.export.wait_share(&io.waker);
                io.share_refused();
                match self.export.hold(cap, share) {
                    Some(first) => first,
                    None => return false,
                }
            }
        };
        let b = budget::global();
        // The device's key in the reserve's line.
        let key = Arc::as_ptr(&self.export) as usize;
        let reserve = first && !self.export.shunned();
        if io.pool.reserve(need, share)
            || reserve && b.line_empty() && io.pool.reserve(need, usize::MAX)
        {
            if first {
                b.turn_taken(key); // one load unless someone is in line
            }
            return true;
        }
        // Marked starved before the last tries: a release after this wakes us.
        io.starve();
        if io.pool.reserve(need, share) {
            if first {
                b.turn_taken(key);
            }
            return true;
        }
        if reserve && b.reserve_turn(key) && io.pool.reserve(need, usize::MAX) {
            b.turn_taken(key);
            return true;
        }
        if first && !reserve {
            b.turn_taken(key); // shunned: out of line too, not to hold up others
        }
        self.export.unhold(cap);
        false
    }

    pub fn on_recv(&mut self, io: &mut Io, ci: u32, res: i32) {
        self.recv_inflight = false;
        let res = if self.tls.is_some() {
            match self.tls_received(io, ci, res) {
                Some(r) => r,
                None => return,
            }
        } else {
            res
        };
        if self.moving.is_some() && !self.read_closed {
            // Our cancel, or a receive that beat it: either way none is pending.
            self.cancel_sent = false;
            if res == -libc::ECANCELED {
                return;
            }
        }
        if res <= 0 {
            if !self.read_closed {
                self.audit.reason = if res == 0 {
                    "connection closed by the client"
                } else {
                    "receive failed"
                };
            }
            if res < 0 && res != -libc::ECANCELED && res != -libc::ECONNRESET {
                tracing::debug!(
                    "receive failed on a connection to {:?}: errno {}",
                    self.dev.name,
                    -res
                );
            }
            self.read_closed = true;
            if let RecvState::Payload { slot, .. } = self.recv {
                // A write cut off mid-payload was never acknowledged: drop it.
                self.recv = RecvState::Header;
                self.release_slot(io, slot);
            }
            if res != -libc::ECANCELED {
                // Not our cancel: the client closed its socket without
                // NBD_CMD_DISC (a hard disconnect), or it broke. Nobody will
                // read a reply: its requests stop here.
                self.hang_up(io, ci);
            }
            return;
        }
        let n = res as usize;
        match self.recv {
            RecvState::Header | RecvState::Discard { .. } => self.rend += n,
            RecvState::Payload { slot, got } => {
                let got = got + n;
                let Some(t) = self.slots[slot as usize].req.task.as_mut() else {
                    return;
                };
                let total = t.len() as usize;
                if got < total {
                    if self.read_closed {
                        // Stopping: this write will never be complete.
                        self.recv = RecvState::Header;
                        self.release_slot(io, slot);
                        return;
                    }
                    let ptr = t.payload_mut()[got..].as_mut_ptr();
                    self.recv = RecvState::Payload { slot, got };
                    // SAFETY: the rest of the slot's task buffer, which stays in
                    // the slot until the receive completes.
                    unsafe { self.post_recv(io, ci, ptr, total - got) };
                    return;
                }
                self.recv = RecvState::Header;
                self.dispatch(io, ci, slot);
            }
        }
    }
}
