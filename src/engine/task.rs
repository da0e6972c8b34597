//! The I/O of one request against its device's backend, as a small state
//! machine over owned operations.
//!
//! A [`Task`] is planned from a validated request ([`Task::plan`]): it decides the
//! path (direct, bounced, buffered), the range to lock and in which mode, and owns
//! the data buffer. Then the caller alternates [`Task::start`] / [`Task::complete`]
//! with whatever runs the [`FileOp`]s it yields — the reactor's ring
//! (`Io::submit_file` in the ring module, which hands each to the device's
//! [`crate::backing::Backend`]), or [`super::sync::drive`] (the synchronous
//! engine used as a test oracle) — until it yields [`Next::Done`]. At most one
//! operation of a task is in flight at a time.
//!
//! Ownership: the buffers stay inside the task, in private fields; a yielded
//! [`FileOp`] refers to them, valid until the op's completion is handed to
//! `complete`. A `FileOp` is opaque outside this crate: only a task makes one,
//! and only the engines here run one (the ring, whose submission is `unsafe`,
//! and [`super::sync::drive`], which runs a task's ops while it holds the
//! task). The caller must keep the task alive (and not touch its buffers)
//! until then. Which backend runs the ops is not the task's business: it
//! names buffers and backend offsets, never a descriptor.

use super::buffer::{AlignedBuf, Pool};
use crate::backing::{Backend, IoOp};
use crate::block::{Errno, Op, ReqFlags};
use crate::device::Device;
use crate::device::range_lock::Mode;
use crate::device::stats::Path;

/// One operation on the device's backend, made by a [`Task`] (opaque outside
/// the crate: it refers to the task's buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileOp(pub(crate) IoOp);

/// What an inline `RWF_NOWAIT` write achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nowait {
    /// All of it is in the page cache.
    Done,
    /// Not all: the rest (or an error) is for the ring.
    Again,
    /// The filesystem does not take `RWF_NOWAIT` writes; nothing was written.
    Unsupported,
}

/// What a task wants next.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    Submit(FileOp),
    /// Finished: the number of reply data bytes (reads), or the error to send.
    Done(Result<u32, Errno>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    /// Reading the span into `buf`; `done` bytes so far.
    ReadSpan,
    /// Zero-copy read past the end of the file: zeros into the registered
    /// buffer from `done` on (see [`fixed`]).
    ZeroTail,
    /// Read-modify-write: reading the first block of the span into `edge`.
    RmwHead,
    /// Read-modify-write: reading the last block of the span into `edge`.
    RmwTail,
    /// Writing the span from `buf`; `done` bytes so far.
    WriteSpan,
    /// `statx` in flight: the file's size, before a write-zeroes past the
    /// end loopd knows of is clipped.
    Size,
    /// `fallocate` in flight.
    Allocate,
    /// Writing zeros (fallback when the filesystem cannot `fallocate`).
    ZeroFill,
    /// `fdatasync` after a FUA trim / write-zeroes / zero fill.
    SyncAfter,
    /// `fdatasync` for FLUSH.
    Flush,
    WillNeed,
    Finished,
}

/// Largest chunk the zero-fill fallback writes at once.
const ZERO_CHUNK: usize = 1 << 20;
/// Largest buffered write copied inline; larger ones go to the ring, whose workers
/// copy them in parallel with the reactor.
pub const INLINE_WRITE_MAX: usize = 64 << 10;

/// The file I/O of one request. See the module documentation.
///
/// Its fields are private: the operations it yields point into its buffers
/// for the lengths it planned, so nothing else may change them. A buffer of
/// the wrong size cannot be put in from outside:
///
/// ```compile_fail,E0616
/// use loopd::engine::{buffer::{AlignedBuf, Pool}, sync, task::Task};
/// # fn f(dev: &loopd::device::Device, task: &mut Task, pool: &mut Pool) {
/// task.buf = Some(AlignedBuf::new(4096)); // private field
/// let _ = sync::drive(dev, task, pool);
/// # }
/// ```
///
/// (The same without that line compiles:)
///
/// ```no_run
/// use loopd::engine::{buffer::Pool, sync, task::Task};
/// # fn f(dev: &loopd::device::Device, task: &mut Task, pool: &mut Pool) {
/// let _ = sync::drive(dev, task, pool);
/// # }
/// ```
pub struct Task {
    op: Op,
    flags: ReqFlags,
    /// Export offset and length from the request.
    offset: u64,
    len: u32,
    /// File offset of `buf[0]`, and bytes of the span `buf` covers.
    span_start: u64,
    span_len: usize,
    /// Where the request's own bytes begin inside `buf`.
    data_at: usize,
    buf: Option<AlignedBuf>,
    edge: Option<AlignedBuf>,
    /// Range to lock (file offsets) and how.
    lock_start: u64,
    lock_end: u64,
    lock_mode: Mode,
    path: Path,
    phase: Phase,
    done: usize,
    align: u64,
    /// `align` as a buffer length.
    align_len: usize,
    /// File offset just past this write, if it may grow the file.
    grows_to: Option<u64>,
    /// Bytes a trim, write-zeroes or cache acts on: `len`, less what lies past
    /// the end of the file ([`Task::clip_to_file`]).
    effect: u32,
    /// The file's size as the task asked it ([`Task::start_sized`]).
    size_seen: Option<u64>,
    /// `buf` was lent by the caller ([`Task::plan_lent`]): it goes back with
    /// [`Task::take_lent`], never into the pool.
    lent: bool,
    /// The data lives in the ring's registered buffer of this index, not in
    /// `buf` (a zero-copy ublk request, [`Task::plan_fixed`]).
    fixed: Option<u16>,
}

impl Task {
    /// Plan a validated request (the caller has checked bounds against the export
    /// size, so `offset + len` fits). Takes buffers from `pool`.
    pub fn plan(
        dev: &Device,
        op: Op,
        flags: ReqFlags,
        offset: u64,
        len: u32,
        pool: &mut Pool,
    ) -> Task {
        Task::plan_lent(dev, op, flags, offset, len, pool, &mut None)
    }

    /// Plan a request whose data buffer the caller lends (a ublk tag's buffer,
    /// which the kernel fills with a write's data and drains a read's from). The
    /// task uses it when the request's bytes are the whole span (no bounce) and
    /// it is large enough, taking it out of `lent`; else it takes a buffer from
    /// `pool` and leaves `lent` alone, and the caller copies the data in or out
    /// ([`Task::payload_mut`], [`Task::read_data`]). A lent buffer comes back
    /// with [`Task::take_lent`].
    pub fn plan_lent(
        dev: &Device,
        op: Op,
        flags: ReqFlags,
        offset: u64,
        len: u32,
        pool: &mut Pool,
        lent: &mut Option<AlignedBuf>,
    ) -> Task {
        let mut t = Task::plan_span(dev, op, flags, offset, len);
        if matches!(op, Op::Read | Op::Write) {
            let whole = t.data_at == 0 && t.span_len == len as usize;
            let fits = lent.as_ref().is_some_and(|b| b.capacity() >= t.span_len);
            t.buf = if whole && fits {
                t.lent = true;
                lent.take()
            } else {
                Some(pool.get(t.span_len))
            };
        }
        t
    }

    /// Plan a read or write whose data is the ring's registered buffer
    /// `index` (a ublk request's pages, see [`fixed`]); `None` if it cannot
    /// go straight between that buffer and the file (not a read or write,
    /// buffered, bounced, or a backend the ring does not run), and must not
    /// be started with it.
    pub fn plan_fixed(
        dev: &Device,
        op: Op,
        flags: ReqFlags,
        offset: u64,
        len: u32,
        index: u16,
    ) -> Option<Task> {
        if !matches!(op, Op::Read | Op::Write) || !fixed_capable(dev) {
            return None;
        }
        let mut t = Task::plan_span(dev, op, flags, offset, len);
        if t.path != Path::Direct || t.data_at != 0 || t.span_len != len as usize {
            return None;
        }
        t.fixed = Some(index);
        Some(t)
    }

    /// Everything of a plan but the data buffer.
    fn plan_span(dev: &Device, op: Op, flags: ReqFlags, offset: u64, len: u32) -> Task {
        let foff = dev.file_offset(offset);
        let fend = foff.saturating_add(u64::from(len));
        let align = u64::from(dev.dio_align.max(1));
        let mut t = Task {
            op,
            flags,
            offset,
            len,
            span_start: foff,
            span_len: len as usize,
            data_at: 0,
            buf: None,
            edge: None,
            lock_start: foff,
            lock_end: fend,
            lock_mode: Mode::Shared,
            path: if dev.direct {
                Path::Direct
            } else {
                Path::Buffered
            },
            phase: Phase::Start,
            done: 0,
            align,
            align_len: to_len(align),
            grows_to: None,
            effect: len,
            size_seen: None,
            lent: false,
            fixed: None,
        };
        match op {
            Op::Read | Op::Write => {
                if dev.direct && (foff % align != 0 || fend % align != 0) {
                    let a0 = align_down(foff, align);
                    let a1 = align_up(fend, align);
                    t.span_start = a0;
                    t.span_len = to_len(a1 - a0);
                    t.data_at = to_len(foff - a0);
                    t.lock_start = a0;
                    t.lock_end = a1;
                    t.path = Path::Bounced;
                    if op == Op::Write {
                        t.lock_mode = Mode::Exclusive;
                    }
                }
                // The benchmark's baseline (seed 001): one device-wide lock that
                // every write holds exclusively, as an inode lock would.
                if op == Op::Write && dev.lock.is_whole_device() {
                    t.lock_mode = Mode::Exclusive;
                }
                if op == Op::Write && dev.extends_file(t.lock_end) {
                    t.lock_mode = Mode::Exclusive;
                    // The whole span is written, so the file reaches its end.
                    t.grows_to = Some(t.lock_end);
                }
            }
            Op::Trim | Op::WriteZeroes => t.lock_mode = Mode::Exclusive,
            Op::Flush | Op::Cache => {}
        }
        t
    }

    /// Clip a trim, write-zeroes or cache to the part of its range before
    /// `file_size` (see [`super::clip`]); past the end there is nothing to do,
    /// and [`Task::start`] then only syncs (FUA) or answers at once.
    pub fn clip_to_file(&mut self, file_size: u64) {
        if matches!(self.op, Op::Trim | Op::WriteZeroes | Op::Cache) {
            let n = super::clip::in_file(self.lock_start, u64::from(self.len), file_size);
            // n <= len, a u32.
            self.effect = u32::try_from(n).unwrap_or(self.len);
        }
    }

    /// Whether a trim, write-zeroes or cache reaches past `file_size`.
    pub fn passes(&self, file_size: u64) -> bool {
        self.lock_start.saturating_add(u64::from(self.len)) > file_size
    }

    /// Whether a trim, write-zeroes or cache was clipped: part of its range
    /// lies past the end of the file (as last seen).
    pub fn clipped(&self) -> bool {
        matches!(self.op, Op::Trim | Op::WriteZeroes | Op::Cache) && self.effect < self.len
    }

    /// The file's size the task found by asking the file, if it did.
    pub fn size_seen(&self) -> Option<u64> {
        self.size_seen
    }

    /// First operation of a write-zeroes that reaches past the end of the
    /// file as loopd knows it: first ask the file its size (another writer
    /// of a `--shared` image may have grown it), through a `statx` the
    /// engine runs like any operation (off the reactor, also on a network
    /// filesystem); then clip and start. If the file cannot say, the clip
    /// already made stands.
    pub fn start_sized(&mut self, pool: &mut Pool) -> Next {
        if self.op != Op::WriteZeroes {
            return self.start();
        }
        let mut b = pool.get(std::mem::size_of::<libc::statx>());
        b.as_mut_slice().fill(0);
        let buf = b.as_mut_ptr().cast::<libc::statx>();
        self.edge = Some(b);
        self.phase = Phase::Size;
        Next::Submit(FileOp(IoOp::Size { buf }))
    }

    /// The block operation.
    pub fn op(&self) -> Op {
        self.op
    }

    pub fn flags(&self) -> ReqFlags {
        self.flags
    }

    /// Export offset of the request.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length of the request.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the request has no bytes (a flush).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The range to lock (file offsets, end exclusive) and how.
    pub fn lock_range(&self) -> (u64, u64, Mode) {
        (self.lock_start, self.lock_end, self.lock_mode)
    }

    /// The path its data takes (direct, bounced, buffered).
    pub fn path(&self) -> Path {
        self.path
    }

    /// Bytes of data buffer the task holds (0 without one).
    pub fn buffer_capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, AlignedBuf::capacity)
    }

    /// Whether this task touches the file under the range lock at all.
    pub fn needs_lock(&self) -> bool {
        matches!(self.op, Op::Read | Op::Write | Op::Trim | Op::WriteZeroes)
    }

    /// The bytes a write's payload must be received into.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let (at, len) = (self.data_at, self.len as usize);
        match self.buf.as_mut() {
            Some(b) => &mut b.as_mut_slice()[at..at + len],
            None => &mut [],
        }
    }

    /// The reply data of a finished read: the request's bytes in its buffer
    /// (empty for any other operation, whose buffer, if any, holds no reply
    /// data: a write's payload, a zero fill's zeros). Never past the buffer.
    pub fn read_data(&self) -> &[u8] {
        match self.buf.as_ref() {
            Some(b) if self.op == Op::Read => {
                let all = b.as_slice();
                let at = self.data_at.min(all.len());
                let end = at.saturating_add(self.len as usize).min(all.len());
                &all[at..end]
            }
            _ => &[],
        }
    }

    /// Take a buffer for the span again after [`Task::recycle`] (a spliced read
    /// that falls back to copying).
    pub fn rebuffer(&mut self, pool: &mut Pool) {
        if self.buf.is_none() && self.op.has_data() {
            self.buf = Some(pool.get(self.span_len));
        }
    }

    /// Whether the task works in the caller's lent buffer.
    pub fn is_lent(&self) -> bool {
        self.lent
    }

    /// The lent buffer back, if the task has it (see [`Task::plan_lent`]).
    pub fn take_lent(&mut self) -> Option<AlignedBuf> {
        if !self.lent {
            return None;
        }
        self.lent = false;
        self.buf.take()
    }

    /// Give the buffers back to the pool (a lent buffer stays with the task
    /// until [`Task::take_lent`]).
    pub fn recycle(&mut self, pool: &mut Pool) {
        if !self.lent
            && let Some(b) = self.buf.take()
        {
            pool.put(b);
        }
        if let Some(b) = self.edge.take() {
            pool.put(b);
        }
    }

    /// Whether this write may be copied into the page cache on the reactor thread:
    /// buffered, not FUA, small, and whole pages (so the kernel never has to read a
    /// page from disk before writing part of it). It may still block on the
    /// filesystem's journal, dirty-page throttling or a page fault, stalling the
    /// reactor's other connections meanwhile (see the reactor's contract).
    pub fn inline_write_ok(&self) -> bool {
        let page = page_size();
        self.op == Op::Write
            && self.path == Path::Buffered
            && !self.dsync()
            && self.span_len <= INLINE_WRITE_MAX
            && self.span_start % page == 0
            && (self.span_len as u64) % page == 0
    }

    /// Try the rest of this write on the calling thread with `RWF_NOWAIT`, which
    /// never blocks: it copies into the page cache only what needs no wait.
    /// Whatever it wrote counts as progress for the operations [`Task::start`]
    /// yields after it.
    pub fn write_nowait(&mut self, backend: &Backend) -> Nowait {
        let Some(buf) = self.buf.as_ref() else {
            return Nowait::Again;
        };
        let data = &buf.as_slice()[self.done..self.span_len];
        let off = self.span_start + self.done as u64;
        match backend.write_nowait(data, off) {
            Ok(n) => {
                self.done += n;
                if self.done >= self.span_len {
                    self.phase = Phase::Finished;
                    Nowait::Done
                } else {
                    Nowait::Again
                }
            }
            Err(e) if e == rustix::io::Errno::OPNOTSUPP => Nowait::Unsupported,
            Err(_) => Nowait::Again,
        }
    }

    /// A read already satisfied (inline from the page cache) up to `n` bytes.
    pub fn set_progress(&mut self, n: usize) {
        self.done = n.min(self.span_len);
    }

    fn dsync(&self) -> bool {
        self.flags.fua
    }

    fn read_span(&mut self) -> Next {
        if self.done >= self.span_len {
            self.phase = Phase::Finished;
            return Next::Done(Ok(self.len));
        }
        self.phase = Phase::ReadSpan;
        if let Some(index) = self.fixed {
            let op = fixed::read(index, self.span_start, self.span_len, self.done);
            return Next::Submit(FileOp(op));
        }
        let Some(buf) = self.buf.as_mut() else {
            return Next::Done(Err(Errno::Io));
        };
        // SAFETY: done < span_len <= buf capacity, so the pointer stays in bounds.
        let ptr = unsafe { buf.as_mut_ptr().add(self.done) };
        Next::Submit(FileOp(IoOp::Read {
            buf: ptr,
            len: clamp_u32(self.span_len - self.done),
            off: self.span_start + self.done as u64,
        }))
    }

    fn write_span(&mut self) -> Next {
        if self.done >= self.span_len {
            self.phase = Phase::Finished;
            return Next::Done(Ok(0));
        }
        self.phase = Phase::WriteSpan;
        if let Some(index) = self.fixed {
            let op = fixed::write(
                index,
                self.span_start,
                self.span_len,
                self.done,
                self.dsync(),
            );
            return Next::Submit(FileOp(op));
        }
        let Some(buf) = self.buf.as_ref() else {
            return Next::Done(Err(Errno::Io));
        };
        // SAFETY: done < span_len <= buf capacity, so the pointer stays in bounds.
        let ptr = unsafe { buf.as_ptr().add(self.done) };
        Next::Submit(FileOp(IoOp::Write {
            buf: ptr,
            len: clamp_u32(self.span_len - self.done),
            off: self.span_start + self.done as u64,
            dsync: self.dsync(),
            plain: false,
        }))
    }

    fn tail_block(&self) -> u64 {
        self.span_start + self.span_len as u64 - self.align
    }

    fn head_partial(&self) -> bool {
        self.data_at != 0
    }

    fn tail_partial(&self) -> bool {
        self.data_at + self.len as usize != self.span_len
    }

    fn read_edge(&mut self, phase: Phase, block: u64) -> Next {
        self.phase = phase;
        self.done = 0;
        let align = self.align_len;
        let Some(edge) = self.edge.as_mut() else {
            return Next::Done(Err(Errno::Io));
        };
        Next::Submit(FileOp(IoOp::Read {
            buf: edge.as_mut_ptr(),
            len: clamp_u32(align),
            off: block,
        }))
    }

    /// Copy the parts of `edge` (holding the block at file offset `block`) that lie
    /// outside the client's bytes into `buf`.
    fn merge_edge(&mut self, block: u64) {
        let (Some(buf), Some(edge)) = (self.buf.as_mut(), self.edge.as_ref()) else {
            return;
        };
        let rel = to_len(block - self.span_start);
        let align = self.align_len;
        let data = self.data_at..self.data_at + self.len as usize;
        let b = buf.as_mut_slice();
        let e = edge.as_slice();
        for i in 0..align {
            if !data.contains(&(rel + i)) {
                b[rel + i] = e[i];
            }
        }
    }

    /// First operation (or immediate result).
    pub fn start(&mut self) -> Next {
        match self.op {
            Op::Read => self.read_span(),
            Op::Write if self.path == Path::Bounced => {
                self.edge = Some(AlignedBuf::new(self.align_len));
                if self.head_partial() {
                    self.read_edge(Phase::RmwHead, self.span_start)
                } else {
                    self.read_edge(Phase::RmwTail, self.tail_block())
                }
            }
            Op::Write => self.write_span(),
            Op::Flush => {
                self.phase = Phase::Flush;
                Next::Submit(FileOp(IoOp::Flush))
            }
            Op::Trim | Op::WriteZeroes if self.effect == 0 => self.sync_after_or_done(),
            Op::Trim | Op::WriteZeroes => {
                let punch = self.op == Op::Trim || !self.flags.no_hole;
                let mode = if punch {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                };
                self.phase = Phase::Allocate;
                Next::Submit(FileOp(IoOp::Allocate {
                    mode,
                    off: self.lock_start,
                    len: u64::from(self.effect),
                }))
            }
            Op::Cache if self.path == Path::Buffered && self.effect > 0 => {
                self.phase = Phase::WillNeed;
                Next::Submit(FileOp(IoOp::WillNeed {
                    off: self.lock_start,
                    len: u64::from(self.effect),
                }))
            }
            // Direct mode keeps the image out of the page cache on purpose, so a
            // prefetch into it would only cost memory: CACHE succeeds as a no-op
            // (as it does past the end of the file).
            Op::Cache => Next::Done(Ok(0)),
        }
    }

    fn sync_after_or_done(&mut self) -> Next {
        if self.dsync() {
            self.phase = Phase::SyncAfter;
            Next::Submit(FileOp(IoOp::Flush))
        } else {
            self.phase = Phase::Finished;
            Next::Done(Ok(0))
        }
    }

    fn zero_fill(&mut self, pool: &mut Pool) -> Next {
        let total = self.effect as usize;
        if self.done >= total {
            return self.sync_after_or_done();
        }
        self.phase = Phase::ZeroFill;
        let n = (total - self.done).min(ZERO_CHUNK);
        if self.buf.is_none() {
            let mut b = pool.get(n.min(total));
            b.as_mut_slice().fill(0);
            self.buf = Some(b);
        }
        let Some(buf) = self.buf.as_ref() else {
            return Next::Done(Err(Errno::Io));
        };
        // Through the plain (buffered) fd: the range may not be aligned for O_DIRECT,
        // and it is held exclusively, so no direct I/O races with it.
        Next::Submit(FileOp(IoOp::Write {
            buf: buf.as_ptr(),
            len: clamp_u32(n.min(buf.capacity())),
            off: self.lock_start + self.done as u64,
            dsync: false,
            plain: true,
        }))
    }

    /// Feed the result of the last operation (bytes, or a negative errno).
    pub fn complete(&mut self, res: i32, pool: &mut Pool) -> Next {
        match self.phase {
            Phase::ReadSpan => {
                if res < 0 {
                    return self.fail(res);
                }
                let n = res as usize;
                self.done += n;
                // A short read means end of file (O_DIRECT stops at EOF on an
                // unaligned boundary, or returns 0 past it): the rest reads as zeros.
                if self.done < self.span_len && (n == 0 || n as u64 % self.align != 0) {
                    if let Some(index) = self.fixed {
                        self.phase = Phase::ZeroTail;
                        return Next::Submit(FileOp(fixed::zero(index, self.span_len, self.done)));
                    }
                    if let Some(b) = self.buf.as_mut() {
                        b.as_mut_slice()[self.done..self.span_len].fill(0);
                    }
                    self.done = self.span_len;
                }
                self.read_span()
            }
            Phase::ZeroTail => {
                // /dev/zero never ends: nothing read is an error too.
                if res <= 0 {
                    return self.fail(if res == 0 { -libc::EIO } else { res });
                }
                self.done = (self.done + res as usize).min(self.span_len);
                match self.fixed {
                    Some(i) if self.done < self.span_len => {
                        Next::Submit(FileOp(fixed::zero(i, self.span_len, self.done)))
                    }
                    _ => self.read_span(),
                }
            }
            Phase::RmwHead | Phase::RmwTail => {
                if res < 0 {
                    return self.fail(res);
                }
                let n = (res as usize).min(self.align_len);
                if let Some(e) = self.edge.as_mut() {
                    e.as_mut_slice()[n..self.align_len].fill(0);
                }
                let block = if self.phase == Phase::RmwHead {
                    self.span_start
                } else {
                    self.tail_block()
                };
                self.merge_edge(block);
                if self.phase == Phase::RmwHead
                    && self.tail_partial()
                    && self.tail_block() != self.span_start
                {
                    return self.read_edge(Phase::RmwTail, self.tail_block());
                }
                self.done = 0;
                self.write_span()
            }
            Phase::WriteSpan => {
                if res < 0 {
                    return self.fail(res);
                }
                if res == 0 {
                    return self.fail(-libc::ENOSPC);
                }
                self.done += res as usize;
                self.write_span()
            }
            Phase::Size => {
                if let Some(b) = self.edge.take() {
                    if res == 0 {
                        // SAFETY: the buffer holds a `libc::statx` the kernel
                        // filled (4096-aligned, larger than the struct); read
                        // it unaligned anyway, it costs nothing here.
                        let st =
                            unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<libc::statx>()) };
                        if st.stx_mask & libc::STATX_SIZE != 0 {
                            self.size_seen = Some(st.stx_size);
                            self.clip_to_file(st.stx_size);
                        }
                    }
                    pool.put(b);
                }
                self.phase = Phase::Start;
                self.start()
            }
            Phase::Allocate => {
                if res >= 0 {
                    return self.sync_after_or_done();
                }
                if self.op == Op::Trim {
                    // Trim is advisory: a filesystem that cannot punch holes still
                    // gave correct (unchanged) data.
                    return if -res == libc::EOPNOTSUPP {
                        self.sync_after_or_done()
                    } else {
                        self.fail(res)
                    };
                }
                if -res == libc::EOPNOTSUPP || -res == libc::EINVAL {
                    if self.flags.fast_zero {
                        self.phase = Phase::Finished;
                        return Next::Done(Err(Errno::NotSup));
                    }
                    self.done = 0;
                    return self.zero_fill(pool);
                }
                self.fail(res)
            }
            Phase::ZeroFill => {
                if res <= 0 {
                    return self.fail(if res == 0 { -libc::ENOSPC } else { res });
                }
                self.done += res as usize;
                self.zero_fill(pool)
            }
            // A failed prefetch hint is not the client's problem.
            Phase::WillNeed => {
                self.phase = Phase::Finished;
                Next::Done(Ok(0))
            }
            Phase::SyncAfter | Phase::Flush => {
                if res < 0 {
                    return self.fail(res);
                }
                self.phase = Phase::Finished;
                Next::Done(Ok(0))
            }
            Phase::Start | Phase::Finished => Next::Done(Err(Errno::Io)),
        }
    }

    fn fail(&mut self, res: i32) -> Next {
        self.phase = Phase::Finished;
        Next::Done(Err(Errno::from_os(-res)))
    }

    /// File offset just past a write that may have grown the file: after it
    /// succeeds, the caller publishes it with [`Device::grew_to`].
    pub fn grows_to(&self) -> Option<u64> {
        self.grows_to
    }
}

mod fixed;
mod span;
pub use fixed::{fixed_capable, zero_copy_fits};
pub use span::buffer_len;
use span::{align_down, align_up, clamp_u32, page_size, to_len};
#[cfg(test)]
mod tests;
