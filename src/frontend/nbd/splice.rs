//! Large buffered reads answered from pipes: the reply header goes into the
//! first pipe, the data is spliced from the file behind it and from the pipes to
//! the socket, never passing through loopd's memory. Any failure falls back to
//! an ordinary copied read.

use super::conn::Conn;
use crate::device::stats::Path;
use crate::engine::splice::MAX_PIPES;
use crate::frontend::nbd::wire;
use crate::ring::Io;
use std::os::fd::AsFd;

impl Conn {
    /// Answer the read in `si` from pipes: write its reply header into the first,
    /// then splice the data from the file behind it. False (nothing started) when
    /// the read needs more pipes than a reply may use, no pipe can be had, or the
    /// header write fails; the caller copies instead.
    pub(super) fn start_splice(&mut self, io: &mut Io, ci: u32, si: u16) -> bool {
        let replies = self.replies;
        let slot = self.slots.get_mut(si);
        let Some(task) = slot.req().task.as_ref() else {
            return false;
        };
        let (offset, len) = (task.offset(), task.len());
        let Some(part) = io.pipes.part_bytes() else {
            return false;
        };
        let parts = (len as usize).div_ceil(part);
        if parts > MAX_PIPES || !io.pipes.can_take(parts) {
            return false;
        }
        if !slot.take_pipes(&mut io.pipes, parts, part) {
            return false;
        }
        // The success header; should the read fail, the pipes are dropped and an
        // error reply sent the ordinary way instead. The reply's shape (for
        // `pipe_at`): a fallback to copying sets it anew.
        let cookie = slot.cookie();
        slot.set_reply(
            |hdr| wire::reply_header(hdr, true, replies, cookie, offset, Ok(len)),
            len as usize,
            None,
        );
        let n = slot.header().len();
        let written = match slot.first_pipe() {
            Some(p) => rustix::io::write(&p.w, slot.header()),
            None => Ok(0),
        };
        if !matches!(written, Ok(w) if w == n) {
            slot.drop_pipes(&mut io.pipes, false);
            return false;
        }
        // The data never passes through memory of ours: lend the buffer out,
        // and with it the request's hold on its device's share (what waits
        // for that share is woken).
        if let Some(t) = slot.req_mut().task.as_mut() {
            t.recycle(&mut io.pool);
        }
        self.unhold(si);
        self.splice_in(io, ci, si);
        true
    }

    /// Splice the next part of slot `si`'s read from the file into its pipe.
    fn splice_in(&mut self, io: &mut Io, ci: u32, si: u16) {
        let slot = self.slots.get(si);
        let Some(task) = slot.req().task.as_ref() else {
            return;
        };
        let Some((pipe, piped, left)) = slot.next_to_pipe(task.len() as usize) else {
            return;
        };
        let off = self.dev.file_offset(task.offset()) + piped as u64;
        let left = u32::try_from(left).unwrap_or(0);
        // Only a backend with the splice capability gets here (the device's
        // `splice_reads`); should it have none, copy instead.
        let Some(e) = self.dev.backend.splice_sqe(off, pipe.w.as_fd(), left) else {
            self.on_splice_in(io, ci, si, -libc::EOPNOTSUPP);
            return;
        };
        // SAFETY: a splice refers to no memory; the pipe stays in the slot and the
        // file open with the device until the completion arrives.
        unsafe { self.submit_splice(io, ci, si, e) };
    }

    /// A splice into slot `si`'s pipes completed with `res`.
    pub(super) fn on_splice_in(&mut self, io: &mut Io, ci: u32, si: u16, res: i32) {
        let slot = self.slots.get_mut(si);
        let len = slot.req().task.as_ref().map_or(0, |t| t.len());
        if res > 0 {
            if slot.piped(res.unsigned_abs() as usize) < len as usize {
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
        let Some(task) = slot.req_mut().task.as_mut() else {
            return;
        };
        task.rebuffer(&mut io.pool);
        // The buffer is back: so is its hold on the device's share (counted
        // whatever the share, like the buffer itself: the request is taken).
        let cap = task.buffer_capacity();
        self.slots.hold_more(si, cap);
        self.export.hold_taken(cap);
        let Some(task) = self.slots.get_mut(si).req_mut().task.as_mut() else {
            return;
        };
        self.dev.stats.path(Path::Buffered);
        let next = task.start();
        self.advance(io, ci, si, next);
    }
}
