//! Reading requests: the connection's receive path, feeding its framing
//! ([`super::framing`]) from the transport ([`super::transport`]). Headers
//! arrive into the framing's buffer, write payloads straight into their
//! task's buffer, rejected payloads are thrown away. A request is taken only
//! when a slot, the connection's byte allowance, its device's share of the
//! memory budget and the budget itself allow, and while its export is not
//! frozen; it then goes to the engine ([`super::run`]). A client that hangs
//! up (EOF or a broken socket before NBD_CMD_DISC) stops its requests
//! ([`Conn::hang_up`]), seen by the posted receive, or, while reading is
//! paused, by a poll of the socket ([`Conn::on_poll`]).

use super::conn::Conn;
use super::framing::{Got, Step};
use super::slots::{PIECE, SlotState};
use super::transport::RecvDone;
use crate::block::Op;
use crate::engine::task;
use crate::engine::{budget, buffer};
use crate::frontend::nbd::proto::*;
use crate::frontend::nbd::wire::{self, Command};
use crate::ring::{Io, TAG_POLL, ud};
use io_uring::{opcode, types};
use std::sync::Arc;

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
        let fd = self.fd();
        // SAFETY: by this function's contract.
        if let Err(e) = unsafe { self.transport.post_recv(io, ci, fd, ptr, len) } {
            tracing::info!("closing a TLS connection to {:?}: {e}", self.dev.name);
            self.dead = true;
        }
    }

    /// Post the receive the framing asked for, into its buffer (the large
    /// one borrowed first if it wants room, see [`super::idle`]).
    fn post_framing_recv(&mut self, io: &mut Io, ci: u32) {
        self.borrow_room(io);
        let space = self.framing.recv_space();
        let (ptr, len) = (space.as_mut_ptr(), space.len());
        // SAFETY: the framing's buffer in use, which stays put and is not
        // changed while the receive is posted (`super::framing`'s contract).
        unsafe { self.post_recv(io, ci, ptr, len) };
    }

    /// Parse what is buffered and keep a receive posted, as far as budget
    /// allows; while none is posted, watch the socket for a hang-up.
    pub(super) fn pump(&mut self, io: &mut Io, ci: u32) {
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
            let e = opcode::PollAdd::new(types::Fd(self.fd()), ev as u32)
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
            if self.moving.is_some() && self.framing.state() == super::framing::RecvState::Header {
                // Read no further here: what arrives is the new reactor's.
                self.cancel_recv(io, ci);
                return;
            }
            match self.framing.step() {
                Step::Again => continue,
                Step::Payload => return,
                Step::Receive => {
                    self.post_framing_recv(io, ci);
                    return;
                }
                Step::Header => {}
            }
            if !self.slots.can_take(io.per_conn_bytes) {
                return; // resumed when a reply has been sent
            }
            if !self.export.enter(&io.waker) {
                io.parked.push(ci);
                return; // frozen: resumed when the export thaws
            }
            if self.export.epoch() != self.epoch {
                self.reload();
            }
            let req = match self.framing.parse() {
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
            self.framing.consume_header();
            self.active = true;
            self.audit.served += 1;
            let Some(si) = self.slots.take(held) else {
                self.export.unhold(held);
                self.export.leave();
                return;
            };
            let slot = self.slots.get_mut(si);
            slot.begin(req.cookie, req.offset, req.flags & CMD_FLAG_FUA != 0, held);
            slot.req_mut().arrived(None);
            let cmd = match valid {
                Err(rej) => {
                    slot.set_state(SlotState::Io);
                    self.framing.discard(rej.payload);
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
                let r = slot.req_mut();
                r.entered = false;
                r.started = None;
                self.export.leave();
                self.slots.untake(si);
                self.audit.reason = "client disconnected (NBD_CMD_DISC)";
                self.read_closed = true;
                return;
            };
            if matches!(op, Op::Trim | Op::WriteZeroes | Op::Cache) {
                slot.set_rest(req.len - u64::from(piece).min(req.len));
            }
            let mut flags = wire::req_flags(req.flags);
            // FUA goes with the last piece: its sync covers the ones before.
            flags.fua &= slot.rest() == 0;
            let mut task = self.plan(io, op, flags, req.offset, piece);
            let len = piece as usize;
            if op == Op::Write {
                let have = self.framing.take_payload(task.payload_mut());
                if have < len {
                    let ptr = task.payload_mut()[have..].as_mut_ptr();
                    let slot = self.slots.get_mut(si);
                    // Its payload must arrive within the progress deadline
                    // of its header while others wait for budget.
                    slot.stamp(io.ticks);
                    slot.req_mut().task = Some(task);
                    slot.set_state(SlotState::Receiving);
                    self.framing.expect_payload(si, have);
                    // SAFETY: the rest of the slot's task buffer, which stays in
                    // the slot until the receive completes.
                    unsafe { self.post_recv(io, ci, ptr, len - have) };
                    return;
                }
            }
            self.slots.get_mut(si).req_mut().task = Some(task);
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

    /// A receive completed with `res`.
    pub(crate) fn on_recv(&mut self, io: &mut Io, ci: u32, res: i32) {
        self.recv_inflight = false;
        let stop = self.read_closed || self.moving.is_some();
        let fd = self.fd();
        let res = match self.transport.on_recv(io, ci, fd, res, stop) {
            RecvDone::Result(r) => r,
            RecvDone::Again => {
                self.recv_inflight = true;
                return;
            }
            RecvDone::Failed(e) => {
                tracing::info!("closing a TLS connection to {:?}: {e}", self.dev.name);
                self.dead = true;
                -libc::EPROTO
            }
        };
        if res > 0 {
            self.recent = true;
        }
        if self.shrunk(io, res) {
            return; // idle: its buffer went back (`super::idle`)
        }
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
            if let Some(slot) = self.framing.end_payload() {
                // A write cut off mid-payload was never acknowledged: drop it.
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
        let Got::Payload { slot, got } = self.framing.received(res.unsigned_abs() as usize) else {
            return;
        };
        let read_closed = self.read_closed;
        let Some(t) = self.slots.get_mut(slot).req_mut().task.as_mut() else {
            return;
        };
        let total = t.len() as usize;
        if got < total {
            if read_closed {
                // Stopping: this write will never be complete.
                self.framing.end_payload();
                self.release_slot(io, slot);
                return;
            }
            let ptr = t.payload_mut()[got..].as_mut_ptr();
            // SAFETY: the rest of the slot's task buffer, which stays in the
            // slot until the receive completes.
            unsafe { self.post_recv(io, ci, ptr, total - got) };
            return;
        }
        self.framing.end_payload();
        self.dispatch(io, ci, slot);
    }
}
