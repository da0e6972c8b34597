//! Running a parsed request through the engine's shared execution step
//! ([`crate::engine::exec`]): its range, its inline paths, its file operations
//! on the reactor's ring, and its result turned into a queued reply.
//!
//! This is the one place where the connection meets the engine: tasks are
//! planned here ([`Conn::plan`]), every file operation of the connection is
//! submitted here (a task's through [`Conn::submit_file_op`], which leaves
//! to the ring how the device's backend runs it; the splice path's entry
//! through [`Conn::submit_splice`]), and every file completion arrives in
//! [`Conn::on_file`], which decodes it with the task
//! ([`crate::engine::task::Task::complete`]) or hands it to the splice path.

use super::conn::Conn;
use super::slots::SlotState;
use crate::block::Op;
use crate::block::ReqFlags;
use crate::device::stats::Path;
use crate::engine::splice::SPLICE_MIN;
use crate::engine::task::{FileOp, Next, Task};
use crate::engine::{clip, exec};
use crate::frontend::nbd::wire::{self, NbdErrno};
use crate::ring::{Io, TAG_FILE, ud};
use io_uring::squeue;
use std::sync::atomic::Ordering;

impl Conn {
    /// Plan the task of a request: `op` of `len` bytes at `offset`.
    pub(super) fn plan(&self, io: &mut Io, op: Op, flags: ReqFlags, offset: u64, len: u32) -> Task {
        Task::plan(&self.dev, op, flags, offset, len, &mut io.pool)
    }

    /// Start a planned request: take its range, then run its first operation.
    pub(super) fn dispatch(&mut self, io: &mut Io, ci: u32, si: u16) {
        if let Some(next) = self.begin(io, ci, si) {
            self.advance(io, ci, si, next);
        }
    }

    /// Take the range of slot `si`'s task and start it: its first step, or
    /// `None` when it waits for its range or went to the splice path.
    fn begin(&mut self, io: &mut Io, ci: u32, si: u16) -> Option<Next> {
        let dev = &self.dev;
        let slot = self.slots.get_mut(si);
        if !slot.req_mut().admit(dev, &io.waker) {
            slot.set_state(SlotState::WaitLock);
            io.lock_waiters.push((ci, si));
            return None;
        }
        let task = slot.req_mut().task.as_mut()?;
        // A userspace TLS session sends from memory only.
        let splice = task.op() == Op::Read
            && task.path() == Path::Buffered
            && dev.splice_reads
            && self.transport.can_splice()
            && task.len() as usize >= SPLICE_MIN;
        if splice && self.start_splice(io, ci, si) {
            return None;
        }
        let task = self.slots.get_mut(si).req_mut().task.as_mut()?;
        Some(exec::start(&self.dev, task, &mut io.pool))
    }

    /// Submit `op`, a backend operation of slot `si`'s task, counted in
    /// flight (per connection here, per ring in [`Io`]) until its completion
    /// reaches [`Conn::on_file`]; the ring decides how the device's backend
    /// runs it ([`Io::submit_file`]).
    ///
    /// # Safety
    /// `op` was yielded by the slot's task, which the slot keeps (its buffers
    /// untouched) until the completion arrives.
    pub(super) unsafe fn submit_file_op(&mut self, io: &mut Io, ci: u32, si: u16, op: FileOp) {
        self.slots.get_mut(si).set_state(SlotState::Io);
        self.file_ops += 1;
        // SAFETY: by this function's contract.
        unsafe { io.submit_file(&self.dev.backend, op, ud(TAG_FILE, ci, si)) };
    }

    /// Submit `e`, the splice path's entry for slot `si` (built by the
    /// device's backend, see [`crate::backing::Backend::splice_sqe`]), counted
    /// in flight like [`Conn::submit_file_op`]'s until its completion reaches
    /// [`Conn::on_file`].
    ///
    /// # Safety
    /// `e` refers to no memory, only to the slot's pipe and the backend's
    /// descriptor, which the slot and the device keep until the completion
    /// arrives.
    pub(super) unsafe fn submit_splice(&mut self, io: &mut Io, ci: u32, si: u16, e: squeue::Entry) {
        self.slots.get_mut(si).set_state(SlotState::Io);
        self.file_ops += 1;
        // SAFETY: by this function's contract.
        unsafe { io.push_file(e, ud(TAG_FILE, ci, si)) };
    }

    /// Take slot `si`'s request on from `next`: submit its operation, or, when
    /// a step is done, start its next piece or queue its reply. A loop, not a
    /// recursion: pieces that finish at once (a cache in direct mode) follow
    /// one another here without growing the stack.
    pub(super) fn advance(&mut self, io: &mut Io, ci: u32, si: u16, mut next: Next) {
        loop {
            match next {
                Next::Submit(op) => {
                    // SAFETY: the op was yielded by this slot's task, which
                    // stays in the slot (buffers untouched) until its
                    // completion reaches `on_file`.
                    unsafe { self.submit_file_op(io, ci, si, op) };
                    return;
                }
                Next::Done(r) => {
                    let task = self.slots.get(si).req().task.as_ref();
                    let is_read = task.is_some_and(|t| t.op() == Op::Read);
                    exec::conclude(&self.dev, task, &r);
                    if r.is_ok() && self.slots.get(si).rest() > 0 {
                        match self.next_piece(io, ci, si) {
                            Some(n) => {
                                next = n;
                                continue;
                            }
                            None => return,
                        }
                    }
                    self.finish(io, ci, si, is_read, r);
                    return;
                }
            }
        }
    }

    /// Plan and begin the next piece of a request longer than a task can be
    /// (see [`super::slots::Slot::rest`]): the piece before gives up its range,
    /// the next one takes its own. Past the end of the backing file there is
    /// nothing left to do ([`crate::engine::clip`]): the pieces stop there,
    /// and a FUA request gets the sync its last piece would have made. A
    /// write-zeroes stops only after a piece that reached the end as the file
    /// itself told it (`Task::start_sized`), never on the size loopd last
    /// saw, which another writer of a `--shared` image may have passed.
    fn next_piece(&mut self, io: &mut Io, ci: u32, si: u16) -> Option<Next> {
        let slot = self.slots.get_mut(si);
        if let Some(t) = slot.req_mut().ticket.take() {
            self.dev.lock.unlock(t);
        }
        let mut done = slot.req_mut().task.take()?;
        done.recycle(&mut io.pool);
        let off = done.offset() + u64::from(done.len());
        let more = if done.op() == Op::WriteZeroes {
            !done.clipped()
        } else {
            let size = self.dev.file_size.load(Ordering::Relaxed);
            clip::more_in_file(self.dev.offset, off, size)
        };
        let task = if more {
            let len = slot.next_piece_len();
            let mut flags = done.flags();
            flags.fua = slot.rest_fua() && slot.rest() == 0;
            Task::plan(&self.dev, done.op(), flags, off, len, &mut io.pool)
        } else if slot.rest_fua() {
            slot.set_rest(0);
            Task::plan(&self.dev, Op::Flush, done.flags(), off, 0, &mut io.pool)
        } else {
            slot.set_rest(0);
            slot.req_mut().task = Some(done);
            return Some(Next::Done(Ok(0)));
        };
        slot.req_mut().task = Some(task);
        self.begin(io, ci, si)
    }

    pub(crate) fn on_file(&mut self, io: &mut Io, ci: u32, si: u16, res: i32) {
        self.file_ops = self.file_ops.saturating_sub(1);
        if self.dead {
            // Nobody to answer: stop here (the range is released with the slot).
            self.release_slot(io, si);
            return;
        }
        if self.slots.get(si).spliced() {
            self.on_splice_in(io, ci, si, res);
            return;
        }
        let Some(task) = self.slots.get_mut(si).req_mut().task.as_mut() else {
            return;
        };
        let next = task.complete(res, &mut io.pool);
        self.advance(io, ci, si, next);
    }

    /// The request in `si` is done with the file (see [`exec::Request::settle`]).
    pub(super) fn settle(&mut self, si: u16) {
        self.slots
            .get_mut(si)
            .req_mut()
            .settle(&self.dev, &self.export);
    }

    /// Queue the reply of slot `si` (or drop it on a dead socket).
    pub(super) fn finish(
        &mut self,
        io: &mut Io,
        _ci: u32,
        si: u16,
        is_read: bool,
        r: Result<u32, NbdErrno>,
    ) {
        self.settle(si);
        if let Err(e) = r {
            self.dev.stats.error(e);
        }
        let slot = self.slots.get_mut(si);
        let r = if is_read { r } else { r.map(|_| 0) };
        let (cookie, offset, replies) = (slot.cookie(), slot.offset(), self.replies);
        slot.set_reply(
            |hdr| wire::reply_header(hdr, is_read, replies, cookie, offset, r),
            r.map_or(0, |n| n as usize),
            None,
        );
        self.queue(io, si);
    }

    pub(super) fn queue(&mut self, io: &mut Io, si: u16) {
        if self.dead {
            self.release_slot(io, si);
            return;
        }
        let slot = self.slots.get_mut(si);
        slot.set_state(SlotState::Queued);
        // Its client must take it within the progress deadline while others
        // wait for budget (see `super::stall`).
        slot.stamp(io.ticks);
        self.sendq.push(si);
    }
}
