//! One ublk queue, served on the reactor that owns it.
//!
//! Contract:
//! - A queue is created on its reactor ([`Queue::new`] + [`Queue::start`]) and
//!   never moves: the kernel takes a queue's commands only from the task that
//!   fetched first, and every command goes through that reactor's ring.
//! - Each tag owns a buffer of `max_io` bytes (outside the memory budget: the
//!   kernel bounds their number and size). The kernel copies a write's data into
//!   it before the fetch completes, and a read's data out of it when the commit
//!   is submitted; in between the tag's task works in it directly (lent to the
//!   [`Task`]), so data is never copied by loopd unless the request must be
//!   bounced (a block size below the file's direct-I/O alignment).
//! - Zero copy (`UBLK_F_AUTO_BUF_REG`, chosen per device when it is made):
//!   no tag has a buffer. The queue holds a range of its reactor ring's
//!   fixed-buffer table, one slot per tag (taken when it is built, given
//!   back when it is finished); every FETCH / COMMIT_AND_FETCH names the
//!   tag's slot, the kernel registers the request's pages there before the
//!   command completes and takes them out at the commit, and the task reads
//!   or writes the file straight from that slot ([`Task::plan_fixed`]). A
//!   request that cannot go straight (the registration failed, or the
//!   device no longer has direct, aligned I/O) fails with EIO: there is no
//!   buffer to copy through, and the bytes are never guessed.
//! - Memory an SQE refers to (tag buffers, task buffers) lives in the queue's
//!   boxed slot table, which is not dropped while any command or file operation
//!   is in flight ([`Queue::ops_in_flight`]).
//! - Requests go through the engine's shared step ([`exec`]) exactly as NBD
//!   requests do: export freeze, range lock, inline page-cache paths, the same
//!   backend operations submitted through the same call
//!   ([`Io::submit_file`]), their completions decoded by the ring, the same
//!   errors.
//! - Stopping: the daemon issues STOP_DEV; the kernel then aborts the queue's
//!   fetches and, once owned requests are committed, their piggy-backed fetches.
//!   The queue is finished when no command and no file operation is in flight.

use crate::block::{Errno, Op, ReqFlags};
use crate::device::Device;
use crate::device::export::Export;
use crate::engine::buffer::AlignedBuf;
use crate::engine::exec::{self, Request};
use crate::engine::task::{Next, Task};
use crate::frontend::ublk::chardev::{QueueDescs, UblkChar};
use crate::frontend::ublk::io_cmd::{self, TagBuf};
use crate::frontend::ublk::iod::{self, Geometry, UblkOp};
use crate::frontend::ublk::sys::UBLK_IO_F_NEED_REG_BUF;
use crate::frontend::ublk::tags::{CqeAction, TagTable};
use crate::ring::{Io, TAG_FILE, TAG_UBLK, ud};
use std::sync::Arc;
use std::sync::mpsc::Sender;

struct TagSlot {
    req: Request,
    /// The tag's buffer while no task has it.
    buf: Option<AlignedBuf>,
    /// Its address, as given to the kernel (stable: the buffer never moves).
    addr: u64,
    op: Option<UblkOp>,
    /// Parked on its range (in the reactor's lock waiters).
    waiting_lock: bool,
}

/// One ublk queue. See the module documentation.
pub struct Queue {
    export: Arc<Export>,
    dev: Arc<Device>,
    epoch: u64,
    char: Arc<UblkChar>,
    descs: QueueDescs,
    q_id: u16,
    tags: TagTable,
    slots: Box<[TagSlot]>,
    max_io: u32,
    file_ops: u32,
    /// Zero copy: the first of this queue's slots in the ring's fixed-buffer
    /// table (tag `t` uses `first + t`). `None`: copy mode.
    fixed: Option<u16>,
    /// The slots are still this queue's (given back once it is finished).
    fixed_held: bool,
    /// Tags waiting for the export to thaw, oldest first.
    frozen: Vec<u16>,
    /// Dropped with the queue: tells the daemon its commands are all done.
    _done: Sender<()>,
}

// SAFETY: the tag buffers' addresses handed to the kernel point into this
// queue's own slots; the queue moves between threads only once, from the
// thread that built it to its reactor, before any command is submitted.
unsafe impl Send for Queue {}

impl Queue {
    /// A queue `q_id` of `depth` tags for the device `export` serves; maps its
    /// descriptors from `char`. Copy mode (`fixed` `None`): each tag gets a
    /// `max_io`-byte buffer. Zero copy: tag `t` uses slot `fixed + t` of the
    /// reactor ring's fixed-buffer table, which the caller took for this queue
    /// (given back to `Io::fixed` once the queue is finished).
    pub fn new(
        export: Arc<Export>,
        char: Arc<UblkChar>,
        q_id: u16,
        depth: u16,
        max_io: u32,
        fixed: Option<u16>,
        done: Sender<()>,
    ) -> Result<Queue, crate::frontend::ublk::chardev::CharError> {
        let descs = QueueDescs::map(&char, q_id, depth)?;
        let (dev, epoch) = export.current();
        let slots = (0..depth)
            .map(|_| {
                let (buf, addr) = if fixed.is_some() {
                    (None, 0)
                } else {
                    let mut b = AlignedBuf::unbudgeted(max_io as usize);
                    let addr = b.as_mut_ptr() as u64;
                    (Some(b), addr)
                };
                TagSlot {
                    req: Request::default(),
                    buf,
                    addr,
                    op: None,
                    waiting_lock: false,
                }
            })
            .collect();
        Ok(Queue {
            export,
            dev,
            epoch,
            char,
            descs,
            q_id,
            tags: TagTable::new(depth),
            slots,
            max_io,
            file_ops: 0,
            fixed,
            fixed_held: fixed.is_some(),
            frozen: Vec::new(),
            _done: done,
        })
    }

    /// Where `tag`'s request data lives, as its commands name it.
    fn tag_buf(&self, tag: u16) -> TagBuf {
        match self.fixed {
            Some(first) => TagBuf::AutoReg(first.saturating_add(tag)),
            None => TagBuf::Copy(self.slots[usize::from(tag)].addr),
        }
    }

    fn geometry(&self) -> Geometry {
        Geometry {
            dev_bytes: self.dev.size,
            logical_block: self.dev.block_size,
            max_io_bytes: self.max_io,
        }
    }

    /// Take the export's current configuration if it changed (a `set`, a
    /// resize) since this queue last looked.
    fn follow_config(&mut self) {
        if self.export.epoch() != self.epoch {
            let (dev, epoch) = self.export.current();
            self.dev = dev;
            self.epoch = epoch;
        }
    }

    /// Fetch every tag (the device can start once the kernel has them all).
    pub fn start(&mut self, io: &mut Io, si: u32) {
        for tag in 0..self.tags.depth() {
            if self.tags.fetch(tag).is_err() {
                continue;
            }
            #[cfg(feature = "vm-tests")]
            if crate::frontend::ublk::test_hook::skip_fetch(&self.export.name, self.q_id, tag) {
                let _ = self.tags.complete(tag, -libc::ENODEV);
                continue;
            }
            let e = io_cmd::fetch(self.char.raw_fd(), self.q_id, tag, self.tag_buf(tag))
                .user_data(ud(TAG_UBLK, si, tag));
            // SAFETY: the tag's buffer lives in this queue's slot table, which
            // outlives the command (see the module contract); a zero-copy
            // fetch names no memory of ours.
            unsafe { io.push(e) };
        }
    }

    /// Route a completion of this queue.
    pub fn on_cqe(&mut self, io: &mut Io, si: u32, tag_kind: u64, tag: u16, res: i32) {
        match tag_kind {
            TAG_UBLK => self.on_cmd(io, si, tag, res),
            TAG_FILE => self.on_file(io, si, tag, res),
            _ => {}
        }
    }

    fn on_cmd(&mut self, io: &mut Io, si: u32, tag: u16, res: i32) {
        match self.tags.complete(tag, res) {
            Ok(CqeAction::Serve) => self.serve(io, si, tag),
            Ok(CqeAction::Retired) => {}
            Ok(CqeAction::Failed(e)) => {
                tracing::warn!(
                    "ublk queue {} of {:?}: command for tag {tag} failed: {e}",
                    self.q_id,
                    self.dev.name
                );
            }
            Err(e) => tracing::warn!("ublk queue {} of {:?}: {e}", self.q_id, self.dev.name),
        }
    }

    /// A request arrived in `tag`: decode it and start it.
    fn serve(&mut self, io: &mut Io, si: u32, tag: u16) {
        let Some(desc) = self.descs.get(tag) else {
            return;
        };
        // Decode against the device as it is now: after a resize the kernel
        // sends requests past the old end as soon as it is told the new size
        // (UPDATE_SIZE), which is after the new configuration is published.
        self.follow_config();
        let op = match iod::decode(&desc, self.geometry()) {
            Ok(op) => op,
            Err(e) => {
                tracing::debug!("ublk queue {} tag {tag}: {e}", self.q_id);
                self.commit(io, si, tag, e.commit_result());
                return;
            }
        };
        if self.fixed.is_some() && desc.flags() & UBLK_IO_F_NEED_REG_BUF != 0 {
            // The kernel could not register the request's pages in the tag's
            // slot: no buffer to work in. Fail this one request.
            tracing::warn!(
                "ublk queue {} of {:?} tag {tag}: the kernel could not register the \
                 request's buffer (zero copy); failed with EIO",
                self.q_id,
                self.dev.name
            );
            self.commit(io, si, tag, -libc::EIO);
            return;
        }
        self.slots[usize::from(tag)].op = Some(op);
        if !self.begin(io, si, tag) {
            // A new request parked: counted, for a daemon that holds the
            // export frozen until requests stop coming (Export::freeze_for_exit).
            self.export.note_held();
        }
    }

    /// Enter the export and plan the task (again after a thaw); `false`: the
    /// export is frozen and the tag parked.
    fn begin(&mut self, io: &mut Io, si: u32, tag: u16) -> bool {
        if !self.export.enter(&io.waker) {
            self.frozen.push(tag);
            io.parked.push(si);
            return false;
        }
        self.follow_config();
        let Some(op) = self.slots[usize::from(tag)].op else {
            self.export.leave();
            return true;
        };
        let (bop, flags, offset, len) = block_request(op);
        if bop.writes() && self.dev.read_only {
            self.export.leave();
            self.commit(io, si, tag, -libc::EPERM);
            return true;
        }
        // The descriptor was checked against the size the queue knew; a shrink
        // since then makes the request fail like any past the end.
        if offset
            .checked_add(u64::from(len))
            .is_none_or(|e| e > self.dev.size)
        {
            self.export.leave();
            self.commit(io, si, tag, -libc::EINVAL);
            return true;
        }
        let fixed = match self.fixed {
            Some(first) if bop.has_data() => {
                let index = first.saturating_add(tag);
                match Task::plan_fixed(&self.dev, bop, flags, offset, len, index) {
                    Some(t) => Some(t),
                    None => {
                        // Zero copy was chosen for direct, aligned I/O; the
                        // device no longer has it. Nothing to copy through.
                        tracing::error!(
                            "ublk queue {} of {:?}: a {bop:?} at {offset} cannot go straight \
                             to the file (zero copy needs direct, aligned I/O); failed with EIO",
                            self.q_id,
                            self.dev.name
                        );
                        self.export.leave();
                        self.commit(io, si, tag, -libc::EIO);
                        return true;
                    }
                }
            }
            _ => None,
        };
        let slot = &mut self.slots[usize::from(tag)];
        let mut task = match fixed {
            Some(t) => t,
            None => Task::plan_lent(
                &self.dev,
                bop,
                flags,
                offset,
                len,
                &mut io.pool,
                &mut slot.buf,
            ),
        };
        if bop == Op::Write && !task.is_lent() {
            // Bounced: the kernel put the data in the tag's buffer.
            if let Some(b) = slot.buf.as_ref() {
                task.payload_mut()
                    .copy_from_slice(&b.as_slice()[..len as usize]);
            }
        }
        slot.req.arrived(Some(task));
        self.dispatch(io, si, tag);
        true
    }

    /// Take the range and run the first operation.
    fn dispatch(&mut self, io: &mut Io, si: u32, tag: u16) {
        let slot = &mut self.slots[usize::from(tag)];
        slot.waiting_lock = !slot.req.admit(&self.dev, &io.waker);
        if slot.waiting_lock {
            io.lock_waiters.push((si, tag));
            return;
        }
        let Some(task) = slot.req.task.as_mut() else {
            return;
        };
        let next = exec::start(&self.dev, task, &mut io.pool);
        self.advance(io, si, tag, next);
    }

    /// Retry `tag` parked on its range.
    pub fn retry(&mut self, io: &mut Io, si: u32, tag: u16) {
        if self
            .slots
            .get(usize::from(tag))
            .is_some_and(|s| s.waiting_lock)
        {
            self.dispatch(io, si, tag);
        }
    }

    fn advance(&mut self, io: &mut Io, si: u32, tag: u16, next: Next) {
        match next {
            Next::Submit(op) => {
                self.file_ops += 1;
                // SAFETY: the op was yielded by this tag's task, which stays in the
                // slot (its buffers untouched) until the completion reaches
                // `on_file`.
                unsafe { io.submit_file(&self.dev.backend, op, ud(TAG_FILE, si, tag)) };
            }
            Next::Done(r) => {
                let slot = &self.slots[usize::from(tag)];
                exec::conclude(&self.dev, slot.req.task.as_ref(), &r);
                self.finish(io, si, tag, r);
            }
        }
    }

    fn on_file(&mut self, io: &mut Io, si: u32, tag: u16, res: i32) {
        self.file_ops = self.file_ops.saturating_sub(1);
        let Some(task) = self.slots[usize::from(tag)].req.task.as_mut() else {
            return;
        };
        let next = task.complete(res, &mut io.pool);
        self.advance(io, si, tag, next);
    }

    /// The request in `tag` is done: settle it, take the buffer back, commit.
    fn finish(&mut self, io: &mut Io, si: u32, tag: u16, r: Result<u32, Errno>) {
        let slot = &mut self.slots[usize::from(tag)];
        let op = slot.op.take();
        if let Err(e) = r {
            self.dev.stats.error(e);
        }
        if let Some(mut task) = slot.req.release(&self.dev, &self.export, &mut io.pool) {
            if let Some(b) = task.take_lent() {
                slot.buf = Some(b);
            } else if let (Ok(_), Some(UblkOp::Read { len, .. }), Some(b)) =
                (r, op, slot.buf.as_mut())
            {
                // Bounced: copy the read's bytes where the kernel takes them.
                let data = task.read_data();
                let n = (len as usize).min(data.len());
                b.as_mut_slice()[..n].copy_from_slice(&data[..n]);
            }
        }
        let res = match (r, op) {
            (Err(e), _) => -e.raw(),
            (Ok(_), Some(UblkOp::Read { len, .. } | UblkOp::Write { len, .. })) => {
                i32::try_from(len).unwrap_or(i32::MAX)
            }
            (Ok(_), _) => 0,
        };
        self.commit(io, si, tag, res);
    }

    /// Complete `tag`'s request with `res` and fetch its next one.
    fn commit(&mut self, io: &mut Io, si: u32, tag: u16, res: i32) {
        if self.tags.commit(tag).is_err() {
            return;
        }
        let max_io = self.max_io as usize;
        let copy_mode = self.fixed.is_none();
        let slot = &mut self.slots[usize::from(tag)];
        if copy_mode && slot.buf.is_none() {
            // Cannot happen (the task gives the buffer back before the commit);
            // never hand the kernel an address this queue does not own: give the
            // tag a new buffer (the kernel takes the address from every command).
            tracing::error!("ublk queue {} tag {tag}: buffer lost; replaced", self.q_id);
            let mut b = AlignedBuf::unbudgeted(max_io);
            slot.addr = b.as_mut_ptr() as u64;
            slot.buf = Some(b);
        }
        let e =
            io_cmd::commit_and_fetch(self.char.raw_fd(), self.q_id, tag, res, self.tag_buf(tag))
                .user_data(ud(TAG_UBLK, si, tag));
        // SAFETY: `addr` is the tag's buffer, held in this queue's slot table,
        // which outlives the command (see the module contract); a zero-copy
        // command names no memory of ours.
        unsafe { io.push(e) };
    }

    /// After a batch: restart requests that waited for a thaw. Whether the
    /// queue is finished (stopped, nothing in flight).
    pub fn service(&mut self, io: &mut Io, si: u32) -> bool {
        if !self.frozen.is_empty() {
            for tag in std::mem::take(&mut self.frozen) {
                let _ = self.begin(io, si, tag);
            }
        }
        // Once the device is stopped the kernel aborts every command: nothing
        // in flight any more means the queue is done.
        let finished = self.tags.all_fetched() && self.tags.is_drained() && self.file_ops == 0;
        if finished
            && std::mem::take(&mut self.fixed_held)
            && let Some(first) = self.fixed
        {
            // Every request was committed, so the kernel took its pages out
            // of these slots: the next queue here may use them.
            io.fixed.give_back(first, self.tags.depth());
        }
        finished
    }

    /// Whether any command or file operation of the queue is in flight.
    pub fn ops_in_flight(&self) -> bool {
        self.tags.in_kernel() > 0 || self.file_ops > 0
    }
}

/// A decoded ublk request as the block layer's (op, flags, offset, length).
fn block_request(op: UblkOp) -> (Op, ReqFlags, u64, u32) {
    let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    match op {
        UblkOp::Read { offset, len } => (Op::Read, ReqFlags::default(), offset, len),
        UblkOp::Write { offset, len, fua } => (
            Op::Write,
            ReqFlags {
                fua,
                ..ReqFlags::default()
            },
            offset,
            len,
        ),
        UblkOp::Flush => (Op::Flush, ReqFlags::default(), 0, 0),
        UblkOp::Discard { offset, len } => (Op::Trim, ReqFlags::default(), offset, clamp(len)),
        UblkOp::WriteZeroes {
            offset,
            len,
            may_unmap,
        } => (
            Op::WriteZeroes,
            ReqFlags {
                no_hole: !may_unmap,
                ..ReqFlags::default()
            },
            offset,
            clamp(len),
        ),
    }
}
