//! The in-flight table of one NBD connection (pure: no I/O).
//!
//! A connection has up to [`SLOTS`] request slots, made [`CHUNK`] at a time
//! as requests need them (an idle connection has none) and never moved while
//! they exist, so the reply headers inside them have stable addresses while a
//! `sendmsg` refers to them; once every slot is free again the connection may
//! drop them all ([`Slots::shrink`]). A slot goes
//!
//! ```text
//!   Free ──take──▶ (Receiving: a write's payload arrives) ──▶ WaitLock ⇄ Io ──▶ Queued ──sent──▶ Free
//! ```
//!
//! and back to `Free` from any state when it is released (its reply sent, or
//! dropped on a dead socket). The table keeps the free list and the bytes of
//! the memory budget its requests hold (the sum of the slots' `held`), and
//! says whether one more request may be taken ([`Slots::can_take`]).
//!
//! Soundness: a slot's reply is only ever handed out as slices
//! ([`Slot::parts`]): its header is a [`ReplyHeader`], whose length cannot
//! exceed its array, and its data is a prefix of a buffer the slot owns. No
//! length a caller sets can make a send read past what the slot holds.
//!
//! Contract: owned by its connection, used on its reactor thread only.

use crate::engine::buffer::AlignedBuf;
use crate::engine::exec::Request;
use crate::engine::splice::{MAX_PIPES, Pipe, PipePool, part_len};
use crate::frontend::nbd::wire::MAX_REPLY_HEADER;

/// Requests a connection may have between header and reply.
pub const SLOTS: u16 = 128;
/// Slots made at once (a power of two dividing [`SLOTS`]).
pub(crate) const CHUNK: u16 = 16;

/// Effect bytes of one piece of a request longer than a task can be (a power
/// of two, so pieces of an aligned request stay aligned).
pub(crate) const PIECE: u32 = 1 << 31;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotState {
    Free,
    /// A write's payload is arriving into the task's buffer.
    Receiving,
    /// Planned, waiting for its range.
    WaitLock,
    /// A file operation (or a block-status query) is in flight.
    Io,
    /// The reply is queued or being sent.
    Queued,
}

/// A reply header: at most [`MAX_REPLY_HEADER`] bytes, and never a length
/// past its array.
pub(crate) struct ReplyHeader {
    bytes: [u8; MAX_REPLY_HEADER],
    len: usize,
}

impl ReplyHeader {
    fn new() -> ReplyHeader {
        ReplyHeader {
            bytes: [0; MAX_REPLY_HEADER],
            len: 0,
        }
    }

    /// Write the header with `encode`, which fills the array and says how
    /// many bytes it wrote (capped at the array's size).
    pub(crate) fn write(&mut self, encode: impl FnOnce(&mut [u8; MAX_REPLY_HEADER]) -> usize) {
        self.len = encode(&mut self.bytes).min(MAX_REPLY_HEADER);
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    fn clear(&mut self) {
        self.len = 0;
    }
}

/// One request between its header and its reply.
pub(crate) struct Slot {
    state: SlotState,
    cookie: u64,
    /// The request's offset (an extended reply header repeats it).
    offset: u64,
    /// Effect bytes after the piece in flight, for a request longer than a
    /// task can be (an extended header's 64-bit `TRIM`, `WRITE_ZEROES` or
    /// `CACHE`, run one piece after the other), and whether the request asked
    /// for FUA (which the last piece carries).
    rest: u64,
    rest_fua: bool,
    /// Bytes of its device's share of the memory budget this request holds
    /// ([`crate::device::export::Export::hold`]), given back when released.
    held: usize,
    /// The reactor's stall tick ([`crate::ring::Io::ticks`]) when its reply
    /// was queued, or, while its write's payload arrives, when its header was
    /// read.
    since: u32,
    /// The request as the engine tracks it (task, range, in-flight count).
    req: Request,
    hdr: ReplyHeader,
    /// Bytes of reply data after the header (read data or status
    /// descriptors; for a spliced read, what its pipes hold).
    data_len: usize,
    /// Block-status descriptors, when this is a block-status reply.
    extra: Option<AlignedBuf>,
    /// A spliced read: the pipes holding its reply, in order (the header and
    /// the first `part` data bytes in the first, the rest in the second).
    pipes: [Option<Pipe>; MAX_PIPES],
    part: usize,
    /// Data bytes spliced into the pipes so far.
    piped: usize,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: SlotState::Free,
            cookie: 0,
            offset: 0,
            rest: 0,
            rest_fua: false,
            held: 0,
            since: 0,
            req: Request::default(),
            hdr: ReplyHeader::new(),
            data_len: 0,
            extra: None,
            pipes: [None, None],
            part: 0,
            piped: 0,
        }
    }

    pub(crate) fn set_state(&mut self, s: SlotState) {
        self.state = s;
    }

    /// A request taken into this slot: its cookie, offset, whether it asked
    /// for FUA, and the budget bytes it holds.
    pub(crate) fn begin(&mut self, cookie: u64, offset: u64, fua: bool, held: usize) {
        self.cookie = cookie;
        self.offset = offset;
        self.rest = 0;
        self.rest_fua = fua;
        self.held = held;
    }

    pub(crate) fn cookie(&self) -> u64 {
        self.cookie
    }

    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    pub(crate) fn rest(&self) -> u64 {
        self.rest
    }

    pub(crate) fn set_rest(&mut self, rest: u64) {
        self.rest = rest;
    }

    pub(crate) fn rest_fua(&self) -> bool {
        self.rest_fua
    }

    /// The next piece of a long request: its length (at most [`PIECE`]),
    /// taken off `rest`.
    pub(crate) fn next_piece_len(&mut self) -> u32 {
        let len = u32::try_from(self.rest).map_or(PIECE, |r| r.min(PIECE));
        self.rest -= u64::from(len);
        len
    }

    pub(crate) fn since(&self) -> u32 {
        self.since
    }

    pub(crate) fn stamp(&mut self, tick: u32) {
        self.since = tick;
    }

    pub(crate) fn req(&self) -> &Request {
        &self.req
    }

    pub(crate) fn req_mut(&mut self) -> &mut Request {
        &mut self.req
    }

    /// The reply: write its header with `encode` and say how many data bytes
    /// follow it (read data from the task's buffer, or descriptors in
    /// `extra`).
    pub(crate) fn set_reply(
        &mut self,
        encode: impl FnOnce(&mut [u8; MAX_REPLY_HEADER]) -> usize,
        data_len: usize,
        extra: Option<AlignedBuf>,
    ) {
        self.hdr.write(encode);
        self.data_len = data_len;
        if extra.is_some() {
            self.extra = extra;
        }
    }

    pub(crate) fn header(&self) -> &[u8] {
        self.hdr.as_slice()
    }

    pub(crate) fn take_extra(&mut self) -> Option<AlignedBuf> {
        self.extra.take()
    }

    /// The reply's bytes, header then data, as the slot holds them (a
    /// spliced reply's data is in its pipes, not here).
    pub(crate) fn parts(&self) -> [&[u8]; 2] {
        let data: &[u8] = match (&self.extra, &self.req.task) {
            (Some(e), _) => e.as_slice(),
            (None, Some(t)) if !self.spliced() => t.read_data(),
            _ => &[],
        };
        [self.hdr.as_slice(), &data[..self.data_len.min(data.len())]]
    }

    /// Bytes of the whole reply.
    pub(crate) fn reply_len(&self) -> usize {
        if self.spliced() {
            self.hdr.as_slice().len() + self.data_len
        } else {
            self.parts().iter().map(|p| p.len()).sum()
        }
    }

    /// Whether the reply is spliced out of pipes rather than sent from memory.
    pub(crate) fn spliced(&self) -> bool {
        self.pipes[0].is_some()
    }

    /// Take `parts` pipes from `pool` for a spliced read, `part` bytes each.
    /// False (none kept) if the pool runs out.
    pub(crate) fn take_pipes(&mut self, pool: &mut PipePool, parts: usize, part: usize) -> bool {
        if parts > MAX_PIPES {
            return false;
        }
        self.part = part;
        for i in 0..parts {
            match pool.take() {
                Some(p) => self.pipes[i] = Some(p),
                None => {
                    self.drop_pipes(pool, false);
                    return false;
                }
            }
        }
        true
    }

    /// The first pipe, where the reply header of a spliced read goes.
    pub(crate) fn first_pipe(&self) -> Option<&Pipe> {
        self.pipes[0].as_ref()
    }

    /// Where the next bytes of a spliced read of `len` bytes go: the pipe,
    /// the data bytes piped so far, and how many more this pipe takes.
    pub(crate) fn next_to_pipe(&self, len: usize) -> Option<(&Pipe, usize, usize)> {
        if self.part == 0 {
            return None;
        }
        let i = self.piped / self.part;
        let pipe = self.pipes.get(i)?.as_ref()?;
        let left = (i * self.part + part_len(len, self.part, i)).saturating_sub(self.piped);
        Some((pipe, self.piped, left))
    }

    /// `n` more data bytes were spliced into the pipes: how many they hold.
    pub(crate) fn piped(&mut self, n: usize) -> usize {
        self.piped += n;
        self.piped
    }

    /// The pipe holding reply byte `at` of a spliced reply, and how many reply
    /// bytes it holds from there on.
    pub(crate) fn pipe_at(&self, at: usize) -> Option<(&Pipe, usize)> {
        let mut end = self.hdr.as_slice().len();
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
    pub(crate) fn drop_pipes(&mut self, pool: &mut PipePool, sent: bool) {
        for p in self.pipes.iter_mut().filter_map(Option::take) {
            if sent { pool.put(p) } else { pool.discard(p) }
        }
        self.piped = 0;
    }
}

/// The connection's slots, its free list, and the budget its requests hold.
pub(crate) struct Slots {
    /// [`CHUNK`] slots each; slot `si` is `chunks[si / CHUNK][si % CHUNK]`.
    /// A chunk's slots stay put while it exists (the boxes move, not them).
    chunks: Vec<Box<[Slot]>>,
    free: Vec<u16>,
    /// Bytes of the memory budget the slots hold (the sum of their `held`).
    held: usize,
}

impl Slots {
    /// No slots yet: they are made as requests come.
    pub(crate) fn new() -> Slots {
        Slots {
            chunks: Vec::new(),
            free: Vec::new(),
            held: 0,
        }
    }

    /// Slots made so far (indices `0..len()`).
    pub(crate) fn len(&self) -> u16 {
        u16::try_from(self.chunks.len()).unwrap_or(u16::MAX) * CHUNK
    }

    pub(crate) fn get(&self, si: u16) -> &Slot {
        &self.chunks[usize::from(si / CHUNK)][usize::from(si % CHUNK)]
    }

    pub(crate) fn get_mut(&mut self, si: u16) -> &mut Slot {
        &mut self.chunks[usize::from(si / CHUNK)][usize::from(si % CHUNK)]
    }

    /// The state of slot `si`; `Free` for one not made (an index from
    /// elsewhere, such as a stale retry, may name one).
    pub(crate) fn state_of(&self, si: u16) -> SlotState {
        if si < self.len() {
            self.get(si).state
        } else {
            SlotState::Free
        }
    }

    /// Whether one more request may be taken: a slot is free (or may be
    /// made) and the requests hold no more than `allowance` bytes of budget.
    pub(crate) fn can_take(&self, allowance: usize) -> bool {
        (!self.free.is_empty() || self.len() < SLOTS) && self.held <= allowance
    }

    /// A free slot for a request holding `held` bytes of budget (its state
    /// is still `Free`; the caller sets what it does). The lowest free index,
    /// so more slots are made only when more requests are in flight.
    pub(crate) fn take(&mut self, held: usize) -> Option<u16> {
        if self.free.is_empty() {
            self.grow()?;
        }
        let si = self.free.pop()?;
        self.held += held;
        Some(si)
    }

    /// Make [`CHUNK`] more slots, if fewer than [`SLOTS`] exist.
    fn grow(&mut self) -> Option<()> {
        let base = self.len();
        if base >= SLOTS {
            return None;
        }
        self.chunks.push((0..CHUNK).map(|_| Slot::new()).collect());
        self.free.extend((base..base + CHUNK).rev());
        Some(())
    }

    /// Drop every slot, if all are free (an idle connection): true if some
    /// were dropped. No slot may be referred to by an operation in flight,
    /// which a free slot is not.
    pub(crate) fn shrink(&mut self) -> bool {
        if self.chunks.is_empty() || !self.idle() {
            return false;
        }
        self.chunks = Vec::new();
        self.free = Vec::new();
        true
    }

    /// A slot taken and given back at once (NBD_CMD_DISC): nothing of it
    /// was used.
    pub(crate) fn untake(&mut self, si: u16) {
        self.free.push(si);
    }

    /// Give back what slot `si` holds of the budget: the bytes it held.
    pub(crate) fn unhold(&mut self, si: u16) -> usize {
        let held = std::mem::take(&mut self.get_mut(si).held);
        self.held = self.held.saturating_sub(held);
        held
    }

    /// Slot `si` holds `n` more bytes of budget (a spliced read that fell
    /// back to copying took its buffer back).
    pub(crate) fn hold_more(&mut self, si: u16, n: usize) {
        self.get_mut(si).held += n;
        self.held += n;
    }

    /// Bytes of the budget the slots hold.
    pub(crate) fn bytes_held(&self) -> usize {
        self.held
    }

    /// Mark slot `si` free again (its budget, buffers and range already
    /// given back by the caller).
    pub(crate) fn free(&mut self, si: u16) {
        if self.state_of(si) == SlotState::Free {
            return;
        }
        let slot = self.get_mut(si);
        slot.state = SlotState::Free;
        slot.rest = 0;
        slot.data_len = 0;
        slot.hdr.clear();
        self.free.push(si);
    }

    /// Whether every slot is free.
    pub(crate) fn idle(&self) -> bool {
        self.free.len() == usize::from(self.len())
    }

    /// The slots in state `s`, in index order.
    pub(crate) fn in_state(&self, s: SlotState) -> impl Iterator<Item = u16> + '_ {
        (0..self.len()).filter(move |&si| self.get(si).state == s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_is_taken_once_and_comes_back() {
        let mut t = Slots::new();
        assert!(t.idle());
        let mut seen = std::collections::HashSet::new();
        for _ in 0..SLOTS {
            let si = t.take(0).expect("a free slot");
            assert!(seen.insert(si), "slot {si} handed out twice");
            t.get_mut(si).set_state(SlotState::Io);
        }
        assert!(t.take(0).is_none());
        assert!(!t.can_take(usize::MAX));
        for si in 0..SLOTS {
            t.free(si);
        }
        assert!(t.idle());
        // Freeing a free slot does not put it on the list twice.
        t.free(3);
        assert!(t.idle());
        assert_eq!(t.in_state(SlotState::Io).count(), 0);
    }

    #[test]
    fn slots_are_made_as_requests_come_and_dropped_when_idle() {
        let mut t = Slots::new();
        assert_eq!(t.len(), 0, "an idle connection has none");
        assert!(t.idle());
        assert!(t.can_take(0));
        assert!(!t.shrink(), "nothing to drop");
        // One request at a time reuses the first slot.
        for _ in 0..3 {
            let si = t.take(0).expect("slot");
            assert_eq!(si, 0);
            t.get_mut(si).set_state(SlotState::Io);
            t.free(si);
        }
        assert_eq!(t.len(), CHUNK);
        // CHUNK + 1 in flight: a second chunk; the first one's slots stay put.
        let first: *const Slot = t.get(0);
        let taken: Vec<u16> = (0..=CHUNK).map(|_| t.take(0).expect("slot")).collect();
        for &si in &taken {
            t.get_mut(si).set_state(SlotState::Queued);
        }
        assert_eq!(t.len(), 2 * CHUNK);
        assert!(
            std::ptr::eq(first, t.get(0)),
            "slots never move while they exist"
        );
        assert!(!t.shrink(), "slots in use are never dropped");
        assert_eq!(t.state_of(SLOTS + 5), SlotState::Free, "not made: free");
        assert_eq!(t.state_of(3 * CHUNK), SlotState::Free);
        for si in taken {
            t.free(si);
        }
        assert!(t.idle());
        assert!(t.shrink());
        assert_eq!(t.len(), 0);
        assert!(t.idle());
        assert_eq!(t.take(0), Some(0), "made again on demand");
    }

    #[test]
    fn held_budget_is_summed_and_limits_taking() {
        let mut t = Slots::new();
        let a = t.take(4096).expect("slot");
        t.get_mut(a).begin(1, 0, false, 4096);
        let b = t.take(8192).expect("slot");
        t.get_mut(b).begin(2, 0, false, 8192);
        assert_eq!(t.bytes_held(), 12288);
        assert!(t.can_take(12288));
        assert!(!t.can_take(12287));
        assert_eq!(t.unhold(a), 4096);
        assert_eq!(t.unhold(a), 0, "given back once");
        t.hold_more(b, 100);
        assert_eq!(t.bytes_held(), 8292);
        assert_eq!(t.unhold(b), 8292);
        assert_eq!(t.bytes_held(), 0);
    }

    #[test]
    fn a_reply_header_length_never_passes_its_array() {
        let mut s = Slot::new();
        s.set_reply(|_| 4096, 0, None);
        assert_eq!(s.header().len(), MAX_REPLY_HEADER);
        // No data buffer: whatever the length says, no data bytes are sent.
        s.set_reply(
            |h| {
                h[..16].fill(7);
                16
            },
            1 << 20,
            None,
        );
        let [h, d] = s.parts();
        assert_eq!(h, &[7; 16]);
        assert!(d.is_empty());
        assert_eq!(s.reply_len(), 16);
    }

    #[test]
    fn status_descriptors_are_sent_up_to_their_buffer() {
        let mut s = Slot::new();
        let buf = AlignedBuf::unbudgeted(4096);
        s.set_reply(|_| 20, 64, Some(buf));
        assert_eq!(s.parts()[1].len(), 64);
        assert_eq!(s.reply_len(), 84);
        s.set_reply(|_| 20, 1 << 30, None);
        assert_eq!(s.parts()[1].len(), 4096, "capped at the buffer");
    }

    #[test]
    fn a_long_request_runs_in_pieces() {
        let mut s = Slot::new();
        s.set_rest(u64::from(PIECE) * 2 + 5);
        assert_eq!(s.next_piece_len(), PIECE);
        assert_eq!(s.next_piece_len(), PIECE);
        assert_eq!(s.next_piece_len(), 5);
        assert_eq!(s.rest(), 0);
    }
}
