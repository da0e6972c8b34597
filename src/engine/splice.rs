//! Zero-copy replies for large buffered reads: the page cache's own pages go
//! file → pipe → socket by reference (io_uring `SPLICE`, which the kernel runs on its
//! worker threads), so the reactor copies none of the data.
//!
//! Contract:
//! - A [`Pipe`] belongs to one request slot from the moment the reply header is
//!   written into it until its last byte has been spliced into the socket; then it
//!   goes back to the reactor's [`PipePool`], empty ([`PipePool::put`]). A slot
//!   dropped earlier (error, dead socket) hands it to [`PipePool::discard`], which
//!   closes it with whatever it holds. Never close a pipe an operation in flight
//!   refers to: io_uring resolves a splice's source descriptor when the kernel's
//!   worker runs it, not when it is submitted.
//! - Both ends are non-blocking, and a reply is only spliced into pipes with room
//!   for all of it ([`PipePool::part_bytes`]), so nothing waits for pipe space: the
//!   header write on the reactor never blocks.
//! - A reactor has at most [`MAX_IN_USE`] pipes out and [`MAX_IDLE`] idle: pipes cost
//!   two descriptors each and, for unprivileged users, count against
//!   `fs.pipe-user-pages-soft`. Past the budget reads are copied.
//! - The pages are the page cache's, not copies. A write to the same range that
//!   lands after the read finished but before the client has taken the reply off
//!   the socket shows in that reply. The client has not received the reply then, so
//!   such a write is concurrent with the read, which NBD leaves unordered; a read
//!   that starts after a write was acknowledged always sees it, as before.
//! - The pool is per reactor and used by its thread only. Nothing here blocks.

use rustix::pipe::{PipeFlags, fcntl_getpipe_size, fcntl_setpipe_size, pipe_with};
use std::os::fd::OwnedFd;

/// Reads at least this long are spliced (shorter ones cost less copied inline
/// than a round trip through the kernel's workers).
pub const SPLICE_MIN: usize = 64 << 10;
/// Pipes one reply may use: a read is spliced if its data fits this many parts.
pub const MAX_PIPES: usize = 2;
/// Pipe capacity asked for. Without `CAP_SYS_RESOURCE` the system caps it at
/// `fs.pipe-max-size` (1 MiB by default); the smaller pipes then carry a
/// megabyte read in two parts.
const PIPE_BYTES: [usize; 2] = [2 << 20, 1 << 20];
/// Pipes a reactor may have out at once (16 spliced 1 MiB reads in flight).
pub const MAX_IN_USE: usize = 32;
/// Idle pipes kept for reuse per reactor.
pub const MAX_IDLE: usize = 8;
/// Smallest useful pipe, in page buffers (a header, one page, one to spare).
const MIN_SLOTS: usize = 3;

/// One pipe: reply bytes are written or spliced into `w` and spliced out of `r`.
pub struct Pipe {
    pub r: OwnedFd,
    pub w: OwnedFd,
}

/// The reactor's pipes, and what the system let them hold.
#[derive(Default)]
pub struct PipePool {
    idle: Vec<Pipe>,
    /// Pipes handed out and not yet returned or discarded.
    in_use: usize,
    /// Page buffers per pipe (0 until the first pipe has been made).
    slots: usize,
    /// Pipes cannot be made or sized (the first attempt failed): never try again.
    unavailable: bool,
}

impl PipePool {
    /// Data bytes one pipe carries: the pages a part touches (one more than it
    /// covers when it starts mid-page) plus the reply header must fit its page
    /// buffers. `None` when no pipe can be made.
    pub fn part_bytes(&mut self) -> Option<usize> {
        if self.slots == 0 && !self.unavailable {
            let p = self.make()?;
            self.idle.push(p);
        }
        let part = self.slots.checked_sub(2)? * rustix::param::page_size();
        (part > 0).then_some(part)
    }

    /// Whether `n` more pipes may be taken now.
    pub fn can_take(&self, n: usize) -> bool {
        self.in_use + n <= MAX_IN_USE
    }

    /// A pipe from the pool, or a new one (`None` past the budget).
    pub fn take(&mut self) -> Option<Pipe> {
        if !self.can_take(1) {
            return None;
        }
        let p = match self.idle.pop() {
            Some(p) => p,
            None => self.make()?,
        };
        self.in_use += 1;
        Some(p)
    }

    /// Return a pipe whose contents have all been spliced out.
    pub fn put(&mut self, p: Pipe) {
        self.in_use = self.in_use.saturating_sub(1);
        if self.idle.len() < MAX_IDLE {
            self.idle.push(p);
        }
    }

    /// Close a pipe that may still hold data.
    pub fn discard(&mut self, p: Pipe) {
        self.in_use = self.in_use.saturating_sub(1);
        drop(p);
    }

    fn make(&mut self) -> Option<Pipe> {
        if self.unavailable {
            return None;
        }
        let (r, w) = match pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK) {
            Ok(p) => p,
            Err(e) => {
                if self.slots == 0 {
                    self.unavailable = true;
                    tracing::debug!("no pipes for spliced reads ({e}); reads are copied");
                }
                return None;
            }
        };
        let bytes = PIPE_BYTES
            .iter()
            .find_map(|&b| fcntl_setpipe_size(&w, b).ok())
            .or_else(|| fcntl_getpipe_size(&w).ok())
            .unwrap_or(0);
        let slots = bytes / rustix::param::page_size();
        if self.slots == 0 {
            if slots < MIN_SLOTS {
                self.unavailable = true;
                tracing::debug!("pipes hold {bytes} bytes: too small to splice; reads are copied");
                return None;
            }
            self.slots = slots;
        } else if slots < self.slots {
            // Later pipes must hold what the first did (an unprivileged user's
            // pipe quota may run out); this one is of no use.
            return None;
        }
        Some(Pipe { r, w })
    }
}

/// The data bytes of part `i` of a `len`-byte reply split into `part`-byte parts.
pub fn part_len(len: usize, part: usize, i: usize) -> usize {
    len.saturating_sub(i * part).min(part)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_reply_in_order() {
        let part = 1016 << 10;
        assert_eq!(part_len(1 << 20, part, 0), part);
        assert_eq!(part_len(1 << 20, part, 1), (1 << 20) - part);
        assert_eq!(part_len(1 << 20, part, 2), 0);
        assert_eq!(part_len(64 << 10, part, 0), 64 << 10);
        assert_eq!(part_len(64 << 10, part, 1), 0);
    }

    #[test]
    fn a_part_and_its_header_fit_a_pipe_at_any_offset() {
        let mut pool = PipePool::default();
        let part = pool.part_bytes().expect("pipes can be made");
        let slots = pool.slots;
        assert!(
            part >= 56 << 10,
            "even a default 64 KiB pipe carries 56 KiB"
        );
        let page = rustix::param::page_size() as u64;
        for off in [0u64, 1, page - 1, page, 123_456_789] {
            let pages = (off + part as u64).div_ceil(page) - off / page;
            // The header takes one buffer; the part's pages the rest.
            assert!(pages < slots as u64, "offset {off}: {pages} pages");
        }
    }

    #[test]
    fn pool_reuses_pipes_within_its_budget() {
        let mut pool = PipePool::default();
        let _ = pool.part_bytes();
        assert_eq!(pool.idle.len(), 1, "sizing made the first pipe");
        let mut out: Vec<Pipe> = (0..MAX_IN_USE).map_while(|_| pool.take()).collect();
        assert_eq!(out.len(), MAX_IN_USE);
        assert!(pool.idle.is_empty());
        assert!(pool.take().is_none(), "no pipe past the budget");
        pool.discard(out.pop().expect("a pipe"));
        assert!(pool.idle.is_empty(), "a discarded pipe is closed, not kept");
        assert!(pool.take().is_some(), "room again after a discard");
        for p in out {
            pool.put(p);
        }
        assert_eq!(pool.idle.len(), MAX_IDLE, "idle pipes are capped");
    }
}
