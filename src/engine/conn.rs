//! Per-connection state of the transmission phase, owned by one reactor.
//!
//! A connection has a fixed table of request slots (never reallocated, so reply
//! headers inside it have stable addresses while a `sendmsg` refers to them), a
//! receive buffer for request headers, and a queue of slots whose replies wait to
//! be sent. At most one receive and one send (a `sendmsg` of queued replies, or the
//! splice of one spliced read's reply out of its pipe) are in flight per
//! connection, which keeps the byte streams in order; file operations of different
//! slots run concurrently and complete in any order.

use super::admit::Permit;
use super::affinity::{Follow, Peer};
use super::buffer::AlignedBuf;
use super::ops;
use super::reactor::{Io, TAG_CANCEL, TAG_FILE, TAG_RECV, TAG_SEND, ud};
use super::splice::{MAX_PIPES, Pipe, PipePool, SPLICE_MIN, part_len};
use super::sync;
use super::task::{Next, Task};
use crate::device::export::{ClientRef, Export};
use crate::device::range_lock::{Place, Ticket};
use crate::device::stats::Path;
use crate::device::{Device, status};
use crate::nbd::proto::*;
use crate::nbd::wire::{self, Command, ExportView, MAX_REPLY_HEADER, NbdErrno};
use io_uring::{opcode, squeue, types};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Requests a connection may have between header and reply.
pub const SLOTS: u16 = 128;
/// Bytes of request buffers a connection may hold before it stops reading.
pub const BYTES_BUDGET: usize = 128 << 20;
/// Size of the header receive buffer.
pub const RBUF: usize = 64 << 10;
/// iovecs in one `sendmsg`.
pub const MAX_IOV: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Free,
    /// A write's payload is arriving into the task's buffer.
    Receiving,
    /// Planned, waiting for its range.
    WaitLock,
    /// A file operation is in flight.
    Io,
    /// The reply is queued or being sent.
    Queued,
}

pub struct Slot {
    pub state: SlotState,
    pub cookie: u64,
    pub task: Option<Task>,
    pub ticket: Option<Ticket>,
    pub place: Place,
    pub hdr: [u8; MAX_REPLY_HEADER],
    pub hdr_len: usize,
    /// Bytes of reply data after the header (read data or status descriptors).
    pub data_len: usize,
    /// Block-status descriptors, when this is a block-status reply.
    pub extra: Option<AlignedBuf>,
    /// Counted in the export's in-flight requests (see `Export::enter`).
    pub entered: bool,
    /// When the request's header was parsed (for the latency histogram).
    pub started: Option<std::time::Instant>,
    /// A spliced read: the pipes holding its reply, in order (the header and the
    /// first `part` data bytes in the first, the rest in the second).
    pub pipes: [Option<Pipe>; MAX_PIPES],
    pub part: usize,
    /// Data bytes spliced into the pipes so far.
    pub piped: usize,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: SlotState::Free,
            cookie: 0,
            task: None,
            ticket: None,
            place: Place::default(),
            hdr: [0; MAX_REPLY_HEADER],
            hdr_len: 0,
            data_len: 0,
            extra: None,
            entered: false,
            started: None,
            pipes: [None, None],
            part: 0,
            piped: 0,
        }
    }

    /// Pointer to the reply data (valid while the slot is `Queued`).
    pub fn data_ptr(&self) -> *const u8 {
        if let Some(e) = &self.extra {
            return e.as_ptr();
        }
        match &self.task {
            Some(t) if self.data_len > 0 => t.read_data().as_ptr(),
            _ => std::ptr::null(),
        }
    }

    pub fn reply_len(&self) -> usize {
        self.hdr_len + self.data_len
    }

    /// Whether the reply is spliced out of pipes rather than sent from memory.
    pub fn spliced(&self) -> bool {
        self.pipes[0].is_some()
    }

    /// The pipe holding reply byte `at` of a spliced reply, and how many reply
    /// bytes it holds from there on.
    fn pipe_at(&self, at: usize) -> Option<(&Pipe, usize)> {
        let mut end = self.hdr_len;
        for (i, p) in self.pipes.iter().enumerate() {
            end += part_len(self.data_len, self.part, i);
            if at < end {
                return p.as_ref().map(|p| (p, end - at));
            }
        }
        None
    }

    /// Give the pipes back to `pool`: for reuse if the whole reply was `sent`
    /// (they are empty), else closed with whatever they hold.
    fn drop_pipes(&mut self, pool: &mut PipePool, sent: bool) {
        for p in self.pipes.iter_mut().filter_map(Option::take) {
            if sent { pool.put(p) } else { pool.discard(p) }
        }
        self.piped = 0;
    }
}

/// What the next received bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvState {
    /// Request headers, into `rbuf`.
    Header,
    /// The payload of the write in `slot`; `got` bytes so far.
    Payload { slot: u16, got: usize },
    /// The payload of a rejected write, to be thrown away.
    Discard { remaining: u64 },
}

pub struct Conn {
    pub sock: OwnedFd,
    pub export: Arc<Export>,
    /// Counts this connection as a client of `export` until it is dropped.
    _client: ClientRef,
    /// Its place among the server's connections.
    _permit: Permit,
    /// The configuration this connection uses, as of `epoch`.
    pub dev: Arc<Device>,
    pub epoch: u64,
    pub view: ExportView,
    pub structured: bool,
    pub rbuf: AlignedBuf,
    pub rstart: usize,
    pub rend: usize,
    pub recv: RecvState,
    pub recv_inflight: bool,
    /// No more requests will be read (EOF, DISC, error or shutdown).
    pub read_closed: bool,
    /// The socket is broken: replies are dropped, not sent.
    pub dead: bool,
    pub slots: Box<[Slot]>,
    pub free_slots: Vec<u16>,
    pub bytes_held: usize,
    pub sendq: VecDeque<u16>,
    pub send_inflight: bool,
    /// Bytes of the front reply already sent by earlier partial sends.
    pub front_sent: usize,
    /// Slots covered by the send in flight (a prefix of `sendq`).
    pub sending: usize,
    pub iov: Box<[libc::iovec; MAX_IOV]>,
    pub msg: Box<libc::msghdr>,
    pub file_ops: u32,
    /// A cancel for the receive has been submitted.
    pub cancel_sent: bool,
    /// Where the client runs, and whether to follow it to another reactor.
    pub peer: Peer,
    pub follow: Follow,
    /// A request was read since the reactor last looked where the client runs.
    pub active: bool,
    /// Moving to this reactor (an index into the reactor's peers): no more
    /// requests are read; the move happens once nothing is in flight.
    pub moving: Option<usize>,
}

// SAFETY: the raw pointers in `iov`/`msg` point into this connection's own slots
// and task buffers and are only dereferenced (by the kernel) while a send is in
// flight; the connection moves between threads only before it is handed to its
// first reactor and when it moves to another (`ready_to_move`: nothing in flight).
unsafe impl Send for Conn {}

impl Conn {
    pub fn new(
        sock: OwnedFd,
        client: ClientRef,
        permit: Permit,
        structured: bool,
        meta_context: bool,
        peer: Peer,
    ) -> Conn {
        let export = Arc::clone(client.export());
        let (dev, epoch) = export.current();
        let view = ExportView {
            size: dev.size,
            read_only: dev.read_only,
            structured,
            meta_context,
        };
        // SAFETY: msghdr and iovec are plain C structs for which all-zero is valid.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        let iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_IOV];
        Conn {
            sock,
            export,
            _client: client,
            _permit: permit,
            dev,
            epoch,
            view,
            structured,
            rbuf: AlignedBuf::new(RBUF),
            rstart: 0,
            rend: 0,
            recv: RecvState::Header,
            recv_inflight: false,
            read_closed: false,
            dead: false,
            slots: (0..SLOTS).map(|_| Slot::new()).collect(),
            free_slots: (0..SLOTS).rev().collect(),
            bytes_held: 0,
            sendq: VecDeque::with_capacity(usize::from(SLOTS)),
            send_inflight: false,
            front_sent: 0,
            sending: 0,
            iov: Box::new(iov),
            msg: Box::new(msg),
            file_ops: 0,
            cancel_sent: false,
            peer,
            follow: Follow::default(),
            active: false,
            moving: None,
        }
    }

    /// Bytes buffered but not yet parsed.
    pub fn avail(&self) -> usize {
        self.rend - self.rstart
    }

    /// Move unparsed bytes to the front of `rbuf`.
    pub fn compact(&mut self) {
        if self.rstart > 0 {
            let (s, e) = (self.rstart, self.rend);
            self.rbuf.as_mut_slice().copy_within(s..e, 0);
            self.rend = e - s;
            self.rstart = 0;
        }
    }

    /// Whether every slot is back in the free list.
    pub fn idle(&self) -> bool {
        self.free_slots.len() == usize::from(SLOTS)
    }

    /// Whether a moving connection has nothing in flight (no request, receive,
    /// send or file operation) and may go to its new reactor.
    pub fn ready_to_move(&self) -> bool {
        self.moving.is_some()
            && !self.read_closed
            && !self.dead
            && self.recv == RecvState::Header
            && !self.ops_in_flight()
            && self.sendq.is_empty()
            && self.idle()
    }

    /// Whether the connection has nothing in flight and can be dropped.
    pub fn finished(&self) -> bool {
        self.read_closed && !self.ops_in_flight() && self.idle()
    }

    /// Whether a receive, send or file operation of this connection is in the ring.
    pub fn ops_in_flight(&self) -> bool {
        self.recv_inflight || self.send_inflight || self.file_ops > 0
    }
}

// ------------------------------------------------------------------ transmission
//
// Everything below runs on the reactor thread. `ci` is this connection's index in
// the reactor (for user_data); `io` is the reactor's ring, pool and queues.

impl Conn {
    fn post_recv(&mut self, io: &mut Io, ci: u32, ptr: *mut u8, len: usize) {
        self.recv_inflight = true;
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        let e = opcode::Recv::new(types::Fd(self.sock.as_raw_fd()), ptr, len)
            .build()
            .user_data(ud(TAG_RECV, ci, 0));
        io.push(e);
    }

    /// Pick up the export's new configuration (no request of ours is in flight
    /// on the old one: the swap waited for them).
    fn reload(&mut self) {
        let (dev, epoch) = self.export.current();
        self.view.size = dev.size;
        self.view.read_only = dev.read_only;
        self.dev = dev;
        self.epoch = epoch;
    }

    /// Stop reading requests; cancel the receive in flight.
    pub(super) fn close_reading(&mut self, io: &mut Io, ci: u32) {
        self.read_closed = true;
        self.cancel_recv(io, ci);
    }

    /// Ask the kernel to cancel every file operation of this connection in
    /// flight (each still completes, with `ECANCELED` or its result).
    fn cancel_file_ops(&mut self, io: &mut Io, ci: u32) {
        if self.file_ops == 0 {
            return;
        }
        for si in 0..SLOTS {
            if self.slots[si as usize].state == SlotState::Io {
                let e = opcode::AsyncCancel::new(ud(TAG_FILE, ci, si))
                    .build()
                    .user_data(ud(TAG_CANCEL, ci, 0));
                io.push(e);
            }
        }
    }

    /// Cancel the receive in flight, if any (once).
    fn cancel_recv(&mut self, io: &mut Io, ci: u32) {
        if self.recv_inflight && !self.cancel_sent {
            self.cancel_sent = true;
            let e = opcode::AsyncCancel::new(ud(TAG_RECV, ci, 0))
                .build()
                .user_data(ud(TAG_CANCEL, ci, 0));
            io.push(e);
        }
    }

    /// Parse what is buffered and keep a receive posted, as far as budget allows.
    pub(super) fn pump(&mut self, io: &mut Io, ci: u32) {
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
                    self.post_recv(io, ci, ptr, n);
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
            if self.avail() < REQUEST_LEN {
                self.compact();
                let at = self.rend;
                // SAFETY: at <= RBUF, the buffer's capacity.
                let ptr = unsafe { self.rbuf.as_mut_ptr().add(at) };
                self.post_recv(io, ci, ptr, RBUF - at);
                return;
            }
            if self.free_slots.is_empty() || self.bytes_held > BYTES_BUDGET {
                return; // resumed when a reply has been sent
            }
            if !self.export.enter(&io.waker) {
                io.parked.push(ci);
                return; // frozen: resumed when the export thaws
            }
            if self.export.epoch() != self.epoch {
                self.reload();
            }
            let hdr = &self.rbuf.as_slice()[self.rstart..self.rstart + REQUEST_LEN];
            let req = match wire::parse_request(hdr) {
                Ok(r) => r,
                Err(e) => {
                    self.export.leave();
                    tracing::warn!(
                        "closing a connection to {:?}: framing error: {e}",
                        self.dev.name
                    );
                    self.kill(io, ci);
                    return;
                }
            };
            self.rstart += REQUEST_LEN;
            self.active = true;
            let Some(si) = self.free_slots.pop() else {
                self.export.leave();
                return;
            };
            self.slots[si as usize].cookie = req.cookie;
            self.slots[si as usize].entered = true;
            self.slots[si as usize].started = Some(std::time::Instant::now());
            match wire::validate(&req, &self.view) {
                Err(rej) => {
                    self.slots[si as usize].state = SlotState::Io;
                    if rej.payload > 0 {
                        self.recv = RecvState::Discard {
                            remaining: u64::from(rej.payload),
                        };
                    }
                    self.finish(io, ci, si, req.kind == CMD_READ, Err(rej.errno));
                }
                Ok(Command::Disc) => {
                    self.slots[si as usize].entered = false;
                    self.export.leave();
                    self.free_slots.push(si);
                    self.read_closed = true;
                    return;
                }
                Ok(cmd) => {
                    let mut task =
                        Task::plan(&self.dev, cmd, req.flags, req.offset, req.len, &mut io.pool);
                    let len = req.len as usize;
                    if matches!(cmd, Command::Read | Command::Write) {
                        self.bytes_held += len;
                    }
                    if cmd == Command::Write {
                        let have = self.avail().min(len);
                        let (s, e) = (self.rstart, self.rstart + have);
                        task.payload_mut()[..have].copy_from_slice(&self.rbuf.as_slice()[s..e]);
                        self.rstart = e;
                        if have < len {
                            let ptr = task.payload_mut()[have..].as_mut_ptr();
                            let slot = &mut self.slots[si as usize];
                            slot.task = Some(task);
                            slot.state = SlotState::Receiving;
                            self.recv = RecvState::Payload {
                                slot: si,
                                got: have,
                            };
                            self.post_recv(io, ci, ptr, len - have);
                            return;
                        }
                    }
                    self.slots[si as usize].task = Some(task);
                    self.dispatch(io, ci, si);
                }
            }
        }
    }

    pub(super) fn on_recv(&mut self, io: &mut Io, ci: u32, res: i32) {
        self.recv_inflight = false;
        if self.moving.is_some() && !self.read_closed {
            // Our cancel, or a receive that beat it: either way none is pending.
            self.cancel_sent = false;
            if res == -libc::ECANCELED {
                return;
            }
        }
        if res <= 0 {
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
            return;
        }
        let n = res as usize;
        match self.recv {
            RecvState::Header | RecvState::Discard { .. } => self.rend += n,
            RecvState::Payload { slot, got } => {
                let got = got + n;
                let Some(t) = self.slots[slot as usize].task.as_mut() else {
                    return;
                };
                let total = t.len as usize;
                if got < total {
                    if self.read_closed {
                        // Stopping: this write will never be complete.
                        self.recv = RecvState::Header;
                        self.release_slot(io, slot);
                        return;
                    }
                    let ptr = t.payload_mut()[got..].as_mut_ptr();
                    self.recv = RecvState::Payload { slot, got };
                    self.post_recv(io, ci, ptr, total - got);
                    return;
                }
                self.recv = RecvState::Header;
                self.dispatch(io, ci, slot);
            }
        }
    }

    /// Start a planned request: take its range, then run its first operation.
    pub(super) fn dispatch(&mut self, io: &mut Io, ci: u32, si: u16) {
        let dev = &self.dev;
        let slot = &mut self.slots[si as usize];
        let Some(task) = slot.task.as_mut() else {
            return;
        };
        if task.cmd == Command::BlockStatus {
            let (off, len, one) = (task.offset, task.len, task.flags & CMD_FLAG_REQ_ONE != 0);
            dev.stats.command(Command::BlockStatus, 0);
            self.block_status(io, ci, si, off, len, one);
            return;
        }
        if task.needs_lock() && slot.ticket.is_none() {
            match dev.lock.try_lock(
                task.lock_start,
                task.lock_end,
                task.lock_mode,
                &mut slot.place,
                &io.waker,
            ) {
                Some(t) => slot.ticket = Some(t),
                None => {
                    slot.state = SlotState::WaitLock;
                    io.lock_waiters.push((ci, si));
                    return;
                }
            }
        }
        dev.stats.command(task.cmd, u64::from(task.len));
        let splice = task.cmd == Command::Read
            && task.path == Path::Buffered
            && dev.splice_reads
            && task.len as usize >= SPLICE_MIN;
        if splice && self.start_splice(io, ci, si) {
            return;
        }
        let dev = &self.dev;
        let Some(task) = self.slots[si as usize].task.as_mut() else {
            return;
        };
        if matches!(task.cmd, Command::Read | Command::Write) {
            if task.cmd == Command::Read && task.path == Path::Buffered && dev.inline_reads {
                // Seed 004: try the page cache inline before going async.
                let len32 = task.len;
                let len = len32 as usize;
                let foff = dev.file_offset(task.offset);
                let buf = &mut task.payload_mut()[..len];
                let flags = rustix::io::ReadWriteFlags::NOWAIT;
                match rustix::io::preadv2(
                    &dev.plain,
                    &mut [std::io::IoSliceMut::new(buf)],
                    foff,
                    flags,
                ) {
                    Ok(n) if n == len => {
                        dev.stats.path(Path::InlineCached);
                        self.finish(io, ci, si, true, Ok(len32));
                        return;
                    }
                    Ok(n) => task.set_progress(n),
                    Err(_) => {}
                }
            }
            if dev.inline_writes && task.inline_write_ok() {
                // The filesystem cannot take this write without blocking (ext4 has
                // no RWF_NOWAIT buffered writes), so the ring would hand it to a
                // worker thread: two wake-ups for a page-cache copy of microseconds.
                dev.stats.path(Path::InlineWritten);
                let r = sync::drive(task, &mut io.pool);
                self.advance(io, ci, si, Next::Done(r));
                return;
            }
            dev.stats.path(task.path);
        }
        let next = task.start();
        self.advance(io, ci, si, next);
    }

    /// Answer the read in `si` from pipes: write its reply header into the first,
    /// then splice the data from the file behind it. False (nothing started) when
    /// the read needs more pipes than a reply may use, no pipe can be had, or the
    /// header write fails; the caller copies instead.
    fn start_splice(&mut self, io: &mut Io, ci: u32, si: u16) -> bool {
        let slot = &mut self.slots[si as usize];
        let Some(task) = slot.task.as_ref() else {
            return false;
        };
        let Some(part) = io.pipes.part_bytes() else {
            return false;
        };
        let parts = (task.len as usize).div_ceil(part);
        if parts > MAX_PIPES || !io.pipes.can_take(parts) {
            return false;
        }
        slot.part = part;
        for i in 0..parts {
            match io.pipes.take() {
                Some(p) => slot.pipes[i] = Some(p),
                None => {
                    slot.drop_pipes(&mut io.pipes, false);
                    return false;
                }
            }
        }
        // The success header; should the read fail, the pipes are dropped and an
        // error reply sent the ordinary way instead.
        let n = wire::reply_header(
            &mut slot.hdr,
            true,
            self.structured,
            slot.cookie,
            task.offset,
            Ok(task.len),
        );
        let written = match &slot.pipes[0] {
            Some(p) => rustix::io::write(&p.w, &slot.hdr[..n]),
            None => Ok(0),
        };
        if !matches!(written, Ok(w) if w == n) {
            slot.drop_pipes(&mut io.pipes, false);
            return false;
        }
        // The reply's shape, for `pipe_at`; a fallback to copying sets it anew.
        slot.hdr_len = n;
        slot.data_len = task.len as usize;
        // The data never passes through memory of ours: lend the buffer out.
        if let Some(t) = slot.task.as_mut() {
            t.recycle(&mut io.pool);
        }
        self.splice_in(io, ci, si);
        true
    }

    /// Splice the next part of slot `si`'s read from the file into its pipe.
    fn splice_in(&mut self, io: &mut Io, ci: u32, si: u16) {
        let slot = &mut self.slots[si as usize];
        let Some(task) = slot.task.as_ref() else {
            return;
        };
        let i = slot.piped / slot.part;
        let Some(pipe) = slot.pipes.get(i).and_then(Option::as_ref) else {
            return;
        };
        let left = (i * slot.part + part_len(task.len as usize, slot.part, i)) - slot.piped;
        let off = self.dev.file_offset(task.offset) + slot.piped as u64;
        let file = types::Fd(self.dev.plain.as_raw_fd());
        let off = i64::try_from(off).unwrap_or(i64::MAX);
        let left = u32::try_from(left).unwrap_or(0);
        let e = opcode::Splice::new(file, off, types::Fd(pipe.w.as_raw_fd()), -1, left).build();
        self.submit_file_op(io, ci, si, e);
    }

    /// Submit `e`, a file operation of slot `si`, counted in flight (per connection
    /// and per ring) until its completion reaches [`Conn::on_file`].
    fn submit_file_op(&mut self, io: &mut Io, ci: u32, si: u16, e: squeue::Entry) {
        self.slots[si as usize].state = SlotState::Io;
        self.file_ops += 1;
        io.file_ops += 1;
        io.push(e.user_data(ud(TAG_FILE, ci, si)));
    }

    /// A splice into slot `si`'s pipes completed with `res`.
    fn on_splice_in(&mut self, io: &mut Io, ci: u32, si: u16, res: i32) {
        let slot = &mut self.slots[si as usize];
        let len = slot.task.as_ref().map_or(0, |t| t.len);
        if res > 0 {
            slot.piped += res as usize;
            if slot.piped < len as usize {
                self.splice_in(io, ci, si);
            } else {
                self.dev.stats.path(Path::Spliced);
                // The header went into the first pipe when the splice began.
                self.settle(si);
                self.queue(io, si);
            }
            return;
        }
        // End of file before the end of the read (the rest reads as zeros), an
        // error, or a file that cannot splice: drop what the pipes hold and copy
        // instead; that path zero-fills, and reports errors the usual way.
        slot.drop_pipes(&mut io.pipes, false);
        let Some(task) = slot.task.as_mut() else {
            return;
        };
        task.rebuffer(&mut io.pool);
        self.dev.stats.path(Path::Buffered);
        let next = task.start();
        self.advance(io, ci, si, next);
    }

    fn advance(&mut self, io: &mut Io, ci: u32, si: u16, next: Next) {
        match next {
            Next::Submit(op) => self.submit_file_op(io, ci, si, ops::sqe(op)),
            Next::Done(r) => {
                let task = self.slots[si as usize].task.as_ref();
                let is_read = task.is_some_and(|t| t.cmd == Command::Read);
                match (&r, task.and_then(Task::grows_to)) {
                    (Ok(_), Some(end)) => self.dev.grew_to(end),
                    (Err(e), _) => log_backing_error(&self.dev, *e, task),
                    _ => {}
                }
                self.finish(io, ci, si, is_read, r);
            }
        }
    }

    pub(super) fn on_file(&mut self, io: &mut Io, ci: u32, si: u16, res: i32) {
        self.file_ops = self.file_ops.saturating_sub(1);
        io.file_ops = io.file_ops.saturating_sub(1);
        if self.dead {
            // Nobody to answer: stop here (the range is released with the slot).
            self.release_slot(io, si);
            return;
        }
        if self.slots[si as usize].spliced() {
            self.on_splice_in(io, ci, si, res);
            return;
        }
        let Some(task) = self.slots[si as usize].task.as_mut() else {
            return;
        };
        let next = task.complete(res, &mut io.pool);
        self.advance(io, ci, si, next);
    }

    /// Whether slot `si` is parked waiting for its range.
    pub fn waiting(&self, si: u16) -> bool {
        self.slots[si as usize].state == SlotState::WaitLock
    }

    /// The request in `si` is done with the file: release its range, leave the
    /// export's in-flight count, record its latency.
    fn settle(&mut self, si: u16) {
        let slot = &mut self.slots[si as usize];
        if let Some(t) = slot.ticket.take() {
            self.dev.lock.unlock(t);
        }
        if std::mem::take(&mut slot.entered) {
            self.export.leave();
        }
        if let Some(t) = slot.started.take() {
            let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.dev.stats.latency.record(ns);
        }
    }

    /// Queue the reply of slot `si` (or drop it on a dead socket).
    fn finish(&mut self, io: &mut Io, _ci: u32, si: u16, is_read: bool, r: Result<u32, NbdErrno>) {
        self.settle(si);
        if let Err(e) = r {
            self.dev.stats.error(e);
        }
        let slot = &mut self.slots[si as usize];
        let offset = slot.task.as_ref().map_or(0, |t| t.offset);
        let r = if is_read { r } else { r.map(|_| 0) };
        slot.data_len = r.map_or(0, |n| n as usize);
        slot.hdr_len = wire::reply_header(
            &mut slot.hdr,
            is_read,
            self.structured,
            slot.cookie,
            offset,
            r,
        );
        self.queue(io, si);
    }

    fn queue(&mut self, io: &mut Io, si: u16) {
        if self.dead {
            self.release_slot(io, si);
            return;
        }
        self.slots[si as usize].state = SlotState::Queued;
        self.sendq.push_back(si);
    }

    fn block_status(&mut self, io: &mut Io, ci: u32, si: u16, off: u64, len: u32, one: bool) {
        let mut extra = io.pool.get(8 * status::MAX_DESCRIPTORS);
        match status::describe(&self.dev, off, len, one, extra.as_mut_slice()) {
            Ok(n) => {
                self.settle(si);
                let slot = &mut self.slots[si as usize];
                let count = u32::try_from(n).unwrap_or(0);
                slot.hdr_len = wire::block_status_header(
                    &mut slot.hdr,
                    slot.cookie,
                    BASE_ALLOCATION_ID,
                    count,
                );
                slot.data_len = 8 * n;
                slot.extra = Some(extra);
                self.queue(io, si);
            }
            Err(e) => {
                io.pool.put(extra);
                self.finish(io, ci, si, false, Err(e));
            }
        }
    }

    /// Start sending queued replies, if no send is in flight.
    pub(super) fn send(&mut self, io: &mut Io, ci: u32) {
        if self.send_inflight || self.sendq.is_empty() || self.dead {
            return;
        }
        let mut n_iov = 0;
        let mut skip = self.front_sent;
        for (k, &si) in self.sendq.iter().enumerate() {
            if n_iov + 2 > MAX_IOV {
                break;
            }
            let s = &self.slots[si as usize];
            if s.spliced() {
                if k > 0 {
                    break; // sent on its own, after the replies before it
                }
                let Some((pipe, left)) = s.pipe_at(skip) else {
                    break;
                };
                let left = u32::try_from(left).unwrap_or(0);
                let sock = types::Fd(self.sock.as_raw_fd());
                let e = opcode::Splice::new(types::Fd(pipe.r.as_raw_fd()), -1, sock, -1, left)
                    .build()
                    .user_data(ud(TAG_SEND, ci, 0));
                self.send_inflight = true;
                io.push(e);
                return;
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
        io.push(e);
    }

    pub(super) fn on_send(&mut self, io: &mut Io, ci: u32, res: i32) {
        self.send_inflight = false;
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

    /// Free a slot: release its range (or its place in line) and its buffers.
    pub(super) fn release_slot(&mut self, io: &mut Io, si: u16) {
        let slot = &mut self.slots[si as usize];
        if slot.state == SlotState::Free {
            return;
        }
        self.settle(si);
        let slot = &mut self.slots[si as usize];
        self.dev.lock.abandon(&mut slot.place);
        if let Some(mut t) = slot.task.take() {
            if matches!(t.cmd, Command::Read | Command::Write) {
                self.bytes_held = self.bytes_held.saturating_sub(t.len as usize);
            }
            t.recycle(&mut io.pool);
        }
        if let Some(e) = slot.extra.take() {
            io.pool.put(e);
        }
        slot.drop_pipes(&mut io.pipes, false);
        slot.state = SlotState::Free;
        slot.data_len = 0;
        slot.hdr_len = 0;
        self.free_slots.push(si);
    }

    /// The socket is unusable: drop queued replies and parked requests; requests
    /// with a file operation or receive in flight are released when it completes.
    pub(super) fn kill(&mut self, io: &mut Io, ci: u32) {
        self.dead = true;
        self.close_reading(io, ci);
        self.drop_unsent(io);
    }

    fn drop_unsent(&mut self, io: &mut Io) {
        if !self.send_inflight {
            while let Some(si) = self.sendq.pop_front() {
                self.release_slot(io, si);
            }
        }
        for si in 0..SLOTS {
            if self.slots[si as usize].state == SlotState::WaitLock {
                self.release_slot(io, si);
            }
        }
    }

    /// After a batch: parse, send, and report whether the connection is done.
    pub(super) fn service(&mut self, io: &mut Io, ci: u32) -> bool {
        self.pump(io, ci);
        self.send(io, ci);
        if self.dead {
            self.drop_unsent(io);
        }
        self.finished()
    }
}

/// Log the first backing-file error of each kind per device, with context
/// (later ones are only counted, so a failing disk cannot flood the log).
fn log_backing_error(dev: &Device, e: NbdErrno, task: Option<&Task>) {
    use crate::device::stats::{ERRNO_NAMES, errno_index};
    let bit = 1u64 << errno_index(e);
    if dev.stats.logged_errors.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
        let what = task.map_or(String::new(), |t| {
            format!(" {:?} at offset {} length {}:", t.cmd, t.offset, t.len)
        });
        tracing::warn!(
            "device {:?} ({}):{what} backing file error {}; further {} errors are counted, not logged",
            dev.name,
            dev.path.display(),
            ERRNO_NAMES[errno_index(e)],
            ERRNO_NAMES[errno_index(e)],
        );
    }
}
