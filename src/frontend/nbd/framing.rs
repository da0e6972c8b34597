//! The request framing of one NBD connection (pure: no I/O): bytes in,
//! requests out.
//!
//! What the client sends is a stream of requests, each a header
//! ([`wire::request_len`] bytes) and, for a write, its payload. Headers are
//! received into the connection's buffer, several at a time when the client
//! pipelines them; a write's payload goes into its task's buffer — what of it
//! was received with the headers is copied there, the rest is received there
//! directly — and the payload of a rejected write is received and thrown
//! away. The framing never hands out bytes past the request it is at: a
//! payload takes only its own bytes out of the buffer, a discard only the
//! rejected payload's, and what follows stays buffered for the next request.
//!
//! The driver asks [`Framing::step`] what comes next: a whole header is
//! buffered (parse it, take it with [`Framing::consume_header`]), or receive
//! into [`Framing::recv_space`], or a payload is arriving into a slot. It
//! reports receives with [`Framing::received`].
//!
//! Two buffers, so that an idle connection costs little: a small one of
//! [`SMALL`] bytes, the framing's own, enough for a few headers, and a large
//! one of [`RECV_BUF`] bytes lent by the reactor ([`Framing::lend`]) while
//! the connection is busy, given back once it is idle again
//! ([`Framing::give_back`]). [`Framing::wants_room`] says when to borrow: the
//! connection has requests in flight (the client is active and pipelining is
//! likely), a receive filled the small buffer (more is waiting), or a
//! rejected payload larger than it is to be thrown away.
//!
//! Contract: owned by its connection. Neither buffer moves while the framing
//! holds it (the small one is boxed, the lent one is a heap buffer), so a
//! receive posted into [`Framing::recv_space`] stays valid until it
//! completes, as long as the driver changes buffers ([`Framing::lend`],
//! [`Framing::give_back`]) only while no receive is posted.

use crate::engine::buffer::{AlignedBuf, RECV_BUF};
use crate::frontend::nbd::wire::{self, WireError};

/// Size of the header receive buffer while the connection is busy.
pub const RBUF: usize = RECV_BUF;
/// Size of the receive buffer an idle connection keeps: a few headers.
pub const SMALL: usize = 512;

/// What the next received bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecvState {
    /// Request headers, into the buffer.
    Header,
    /// The payload of the write in `slot`; `got` bytes so far.
    Payload { slot: u16, got: usize },
    /// The payload of a rejected write, to be thrown away.
    Discard { remaining: u64 },
}

/// What the framing needs next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// A whole request header is buffered ([`Framing::header`]).
    Header,
    /// Receive into [`Framing::recv_space`] (header bytes, or bytes of a
    /// rejected payload).
    Receive,
    /// A write's payload arrives into its slot's buffer.
    Payload,
    /// A rejected payload is all thrown away: ask again.
    Again,
}

/// What a receive of `n` bytes completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Got {
    /// Bytes into the buffer (headers, or a rejected payload).
    Buffered,
    /// `got` bytes of the payload of the write in `slot` have arrived.
    Payload { slot: u16, got: usize },
}

pub(crate) struct Framing {
    /// The small buffer, always held.
    small: Box<[u8; SMALL]>,
    /// The large buffer, while lent.
    lent: Option<AlignedBuf>,
    /// Unparsed bytes: `buf[start..end]`.
    start: usize,
    end: usize,
    state: RecvState,
    extended: bool,
    /// The last receive filled the small buffer.
    filled: bool,
}

impl Framing {
    /// `extended`: extended headers were negotiated (32-byte headers).
    pub(crate) fn new(extended: bool) -> Framing {
        Framing {
            small: Box::new([0; SMALL]),
            lent: None,
            start: 0,
            end: 0,
            state: RecvState::Header,
            extended,
            filled: false,
        }
    }

    /// The buffer in use.
    fn buf(&self) -> &[u8] {
        match &self.lent {
            Some(b) => &b.as_slice()[..RBUF],
            None => &self.small[..],
        }
    }

    fn buf_mut(&mut self) -> &mut [u8] {
        match &mut self.lent {
            Some(b) => &mut b.as_mut_slice()[..RBUF],
            None => &mut self.small[..],
        }
    }

    /// Bytes of the buffer in use.
    fn cap(&self) -> usize {
        if self.lent.is_some() { RBUF } else { SMALL }
    }

    /// Whether the large buffer is lent to this framing.
    pub(crate) fn is_lent(&self) -> bool {
        self.lent.is_some()
    }

    /// Whether the next receive ([`Step::Receive`]) should go into a lent
    /// buffer (see the module documentation); `busy`: the connection has
    /// requests in flight.
    pub(crate) fn wants_room(&self, busy: bool) -> bool {
        if self.lent.is_some() {
            return false;
        }
        let big_discard =
            matches!(self.state, RecvState::Discard { remaining } if remaining > SMALL as u64);
        busy || self.filled || big_discard
    }

    /// Take the lent buffer `buf` (at least [`RBUF`] bytes) in place of the
    /// small one, with what is buffered. No receive may be posted.
    pub(crate) fn lend(&mut self, mut buf: AlignedBuf) {
        if self.lent.is_some() || buf.capacity() < RBUF {
            return;
        }
        let (s, e) = (self.start, self.end);
        buf.as_mut_slice()[..e - s].copy_from_slice(&self.small[s..e]);
        self.start = 0;
        self.end = e - s;
        self.filled = false;
        self.lent = Some(buf);
    }

    /// Give the lent buffer back, if nothing is buffered in it: back to the
    /// small one. No receive may be posted.
    pub(crate) fn give_back(&mut self) -> Option<AlignedBuf> {
        if self.avail() > 0 || self.state != RecvState::Header {
            return None;
        }
        let b = self.lent.take()?;
        self.start = 0;
        self.end = 0;
        Some(b)
    }

    pub(crate) fn state(&self) -> RecvState {
        self.state
    }

    /// Bytes buffered but not yet taken.
    pub(crate) fn avail(&self) -> usize {
        self.end - self.start
    }

    fn header_len(&self) -> usize {
        wire::request_len(self.extended)
    }

    /// Move unparsed bytes to the front of the buffer.
    fn compact(&mut self) {
        if self.start > 0 {
            let (s, e) = (self.start, self.end);
            self.buf_mut().copy_within(s..e, 0);
            self.end = e - s;
            self.start = 0;
        }
    }

    /// What comes next. Throws away what is buffered of a rejected payload.
    pub(crate) fn step(&mut self) -> Step {
        match self.state {
            RecvState::Discard { remaining } => {
                let avail = self.avail();
                let take = usize::try_from(remaining).map_or(avail, |r| r.min(avail));
                self.start += take;
                let left = remaining - take as u64;
                if left == 0 {
                    self.state = RecvState::Header;
                    return Step::Again;
                }
                // Nothing else is buffered: the rest of the payload is received
                // at the front of the buffer and thrown away.
                self.state = RecvState::Discard { remaining: left };
                self.start = 0;
                self.end = 0;
                Step::Receive
            }
            RecvState::Payload { .. } => Step::Payload,
            RecvState::Header if self.avail() >= self.header_len() => Step::Header,
            RecvState::Header => {
                self.compact();
                Step::Receive
            }
        }
    }

    /// Where the receive [`Step::Receive`] asked for goes: the free tail of
    /// the buffer, or, for a rejected payload, as much of the buffer as the
    /// payload has left.
    pub(crate) fn recv_space(&mut self) -> &mut [u8] {
        let (at, cap) = (self.end, self.cap());
        let n = match self.state {
            RecvState::Discard { remaining } => usize::try_from(remaining).unwrap_or(cap).min(cap),
            _ => cap - at,
        };
        &mut self.buf_mut()[at..at + n]
    }

    /// The buffered request header ([`Step::Header`]).
    pub(crate) fn header(&self) -> &[u8] {
        let n = self.header_len().min(self.avail());
        &self.buf()[self.start..self.start + n]
    }

    /// Parse the buffered request header.
    pub(crate) fn parse(&self) -> Result<wire::Request, WireError> {
        wire::parse_header(self.header(), self.extended)
    }

    /// The buffered header is taken.
    pub(crate) fn consume_header(&mut self) {
        self.start += self.header_len().min(self.avail());
    }

    /// Copy what is buffered of a write's payload into `dst` (its task's
    /// buffer), no more than `dst` holds: the bytes copied.
    pub(crate) fn take_payload(&mut self, dst: &mut [u8]) -> usize {
        let have = self.avail().min(dst.len());
        let (s, e) = (self.start, self.start + have);
        dst[..have].copy_from_slice(&self.buf()[s..e]);
        self.start = e;
        have
    }

    /// The rest of the payload of the write in `slot` (of which `got` bytes
    /// are in already) is received into its buffer.
    pub(crate) fn expect_payload(&mut self, slot: u16, got: usize) {
        self.state = RecvState::Payload { slot, got };
    }

    /// The `payload` bytes after the header just taken belong to a rejected
    /// request: thrown away.
    pub(crate) fn discard(&mut self, payload: u64) {
        if payload > 0 {
            self.state = RecvState::Discard { remaining: payload };
        }
    }

    /// Back to headers (a payload done, or given up): the slot whose payload
    /// was arriving, if one was.
    pub(crate) fn end_payload(&mut self) -> Option<u16> {
        match std::mem::replace(&mut self.state, RecvState::Header) {
            RecvState::Payload { slot, .. } => Some(slot),
            s => {
                self.state = s;
                None
            }
        }
    }

    /// A receive of `n` bytes completed.
    pub(crate) fn received(&mut self, n: usize) -> Got {
        match self.state {
            RecvState::Header | RecvState::Discard { .. } => {
                let cap = self.cap();
                self.end = (self.end + n).min(cap);
                self.filled = self.lent.is_none() && self.end == cap;
                Got::Buffered
            }
            RecvState::Payload { slot, got } => {
                let got = got + n;
                self.state = RecvState::Payload { slot, got };
                Got::Payload { slot, got }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::nbd::proto::{CMD_READ, CMD_WRITE, REQUEST_LEN};

    fn header(kind: u16, cookie: u64, len: u32) -> [u8; REQUEST_LEN] {
        wire::encode_request(&wire::Request {
            flags: 0,
            kind,
            cookie,
            offset: 0,
            len: u64::from(len),
        })
    }

    /// Deliver `bytes` the way the kernel would: into the receive space, at
    /// most as much as it holds. The bytes delivered.
    fn deliver(f: &mut Framing, bytes: &[u8]) -> usize {
        let space = f.recv_space();
        let n = bytes.len().min(space.len());
        space[..n].copy_from_slice(&bytes[..n]);
        assert_eq!(f.received(n), Got::Buffered);
        n
    }

    /// A framing holding a lent buffer, as a busy connection's.
    fn busy(extended: bool) -> Framing {
        let mut f = Framing::new(extended);
        f.lend(AlignedBuf::unbudgeted(RBUF));
        assert!(f.is_lent());
        f
    }

    #[test]
    fn pipelined_headers_are_taken_one_at_a_time() {
        let mut f = busy(false);
        assert_eq!(f.step(), Step::Receive);
        let stream = [header(CMD_READ, 1, 512), header(CMD_READ, 2, 512)].concat();
        deliver(&mut f, &stream);
        for cookie in [1, 2] {
            assert_eq!(f.step(), Step::Header);
            assert_eq!(f.parse().expect("header").cookie, cookie);
            f.consume_header();
        }
        assert_eq!(f.step(), Step::Receive);
        assert_eq!(f.recv_space().len(), RBUF, "the buffer is empty again");
    }

    #[test]
    fn a_header_cut_across_receives_is_put_together() {
        let mut f = busy(false);
        let h = header(CMD_READ, 9, 4096);
        let stream = [header(CMD_READ, 8, 4096).as_slice(), &h[..10]].concat();
        f.step();
        deliver(&mut f, &stream);
        assert_eq!(f.step(), Step::Header);
        f.consume_header();
        assert_eq!(f.step(), Step::Receive, "only part of the next header");
        assert_eq!(f.recv_space().len(), RBUF - 10, "moved to the front");
        deliver(&mut f, &h[10..]);
        assert_eq!(f.step(), Step::Header);
        assert_eq!(f.parse().expect("header").cookie, 9);
    }

    #[test]
    fn a_payload_takes_only_its_own_bytes() {
        let mut f = busy(false);
        let payload = vec![0xab; 100];
        let next = header(CMD_READ, 2, 512);
        let stream = [header(CMD_WRITE, 1, 100).as_slice(), &payload[..60]].concat();
        f.step();
        deliver(&mut f, &stream);
        assert_eq!(f.step(), Step::Header);
        f.consume_header();
        let mut dst = vec![0u8; 100];
        assert_eq!(f.take_payload(&mut dst), 60);
        f.expect_payload(5, 60);
        assert_eq!(f.step(), Step::Payload);
        // The rest arrives into the slot's buffer, not the framing's.
        dst[60..].copy_from_slice(&payload[60..]);
        assert_eq!(f.received(40), Got::Payload { slot: 5, got: 100 });
        assert_eq!(dst, payload);
        assert_eq!(f.end_payload(), Some(5));
        // A payload wholly buffered with the next header leaves that header.
        let stream = [header(CMD_WRITE, 3, 8).as_slice(), &[1; 8], &next].concat();
        f.step();
        deliver(&mut f, &stream);
        assert_eq!(f.step(), Step::Header);
        f.consume_header();
        let mut dst = [0u8; 8];
        assert_eq!(f.take_payload(&mut dst), 8);
        assert_eq!(dst, [1; 8]);
        assert_eq!(f.step(), Step::Header);
        assert_eq!(f.parse().expect("header").cookie, 2);
    }

    #[test]
    fn a_rejected_payload_is_thrown_away_up_to_the_next_header() {
        let mut f = busy(false);
        let next = header(CMD_READ, 7, 512);
        // 70,000 payload bytes: more than the buffer, so some are received
        // and thrown away after the first batch.
        let total = 70_000usize;
        let mut stream = header(CMD_WRITE, 6, 70_000).to_vec();
        stream.extend(std::iter::repeat_n(0x55, total));
        stream.extend_from_slice(&next);
        f.step();
        let mut at = deliver(&mut f, &stream);
        assert_eq!(f.step(), Step::Header);
        f.consume_header();
        f.discard(total as u64);
        let mut rounds = 0;
        loop {
            match f.step() {
                Step::Again => continue,
                Step::Header => break,
                Step::Receive => {
                    let left = match f.state() {
                        RecvState::Discard { remaining } => {
                            usize::try_from(remaining).expect("small")
                        }
                        _ => RBUF,
                    };
                    assert!(
                        f.recv_space().len() <= left.max(1),
                        "never past the payload"
                    );
                    at += deliver(&mut f, &stream[at..]);
                }
                Step::Payload => panic!("no payload is expected"),
            }
            rounds += 1;
            assert!(rounds < 10);
        }
        assert_eq!(f.parse().expect("header").cookie, 7);
    }

    #[test]
    fn extended_headers_are_longer() {
        let mut f = busy(true);
        f.step();
        deliver(&mut f, &header(CMD_READ, 1, 512));
        assert_eq!(f.step(), Step::Receive, "28 bytes are not a 32-byte header");
    }

    #[test]
    fn an_idle_framing_holds_only_its_small_buffer() {
        let mut f = Framing::new(false);
        assert!(!f.is_lent());
        assert_eq!(f.step(), Step::Receive);
        assert_eq!(f.recv_space().len(), SMALL);
        assert!(!f.wants_room(false), "idle: no lent buffer");
        assert!(f.wants_room(true), "requests in flight: borrow");
        deliver(&mut f, &header(CMD_READ, 4, 4096));
        assert!(!f.wants_room(false), "one header does not fill it");
        assert_eq!(f.step(), Step::Header);
        assert_eq!(f.parse().expect("header").cookie, 4);
        f.consume_header();
        assert_eq!(f.step(), Step::Receive);
        assert_eq!(f.give_back().map(|b| b.capacity()), None, "nothing lent");
    }

    #[test]
    fn a_full_small_buffer_borrows_and_keeps_its_bytes() {
        let mut f = Framing::new(false);
        // More pipelined headers than the small buffer holds, the last one
        // cut across it.
        let n = SMALL / REQUEST_LEN + 3;
        let stream: Vec<u8> = (0..n as u64)
            .flat_map(|c| header(CMD_READ, c, 512))
            .collect();
        f.step();
        let mut at = deliver(&mut f, &stream);
        assert_eq!(at, SMALL);
        assert!(f.wants_room(false), "a full receive: more is waiting");
        let whole = SMALL / REQUEST_LEN;
        for c in 0..whole as u64 {
            assert_eq!(f.step(), Step::Header);
            assert_eq!(f.parse().expect("header").cookie, c);
            f.consume_header();
        }
        assert_eq!(f.step(), Step::Receive, "part of a header is left");
        f.lend(AlignedBuf::unbudgeted(RBUF));
        assert!(!f.wants_room(true), "lent already");
        assert_eq!(f.recv_space().len(), RBUF - SMALL % REQUEST_LEN);
        at += deliver(&mut f, &stream[at..]);
        assert_eq!(at, stream.len());
        for c in whole as u64..n as u64 {
            assert_eq!(f.step(), Step::Header);
            assert_eq!(f.parse().expect("header").cookie, c);
            f.consume_header();
        }
        assert_eq!(f.step(), Step::Receive);
        let b = f.give_back().expect("idle again: the buffer goes back");
        assert_eq!(b.capacity(), RBUF);
        assert!(!f.is_lent());
        assert_eq!(f.recv_space().len(), SMALL);
    }

    #[test]
    fn a_buffer_with_bytes_in_it_is_not_given_back() {
        let mut f = busy(false);
        f.step();
        deliver(&mut f, &header(CMD_READ, 1, 512)[..10]);
        assert!(f.give_back().is_none(), "part of a header is buffered");
        assert!(f.is_lent());
        let mut f = busy(false);
        f.step();
        deliver(&mut f, &header(CMD_WRITE, 1, 100));
        f.step();
        f.consume_header();
        f.expect_payload(0, 0);
        assert!(f.give_back().is_none(), "a payload is arriving");
    }

    #[test]
    fn a_large_rejected_payload_borrows() {
        let mut f = Framing::new(false);
        f.step();
        deliver(&mut f, &header(CMD_WRITE, 1, 100_000));
        f.step();
        f.consume_header();
        f.discard(100_000);
        assert_eq!(f.step(), Step::Receive);
        assert!(f.wants_room(false), "100,000 bytes to throw away");
        let mut f = Framing::new(false);
        f.step();
        deliver(&mut f, &header(CMD_WRITE, 1, 100));
        f.step();
        f.consume_header();
        f.discard(100);
        assert_eq!(f.step(), Step::Receive);
        assert!(!f.wants_room(false), "100 bytes fit the small buffer");
        assert_eq!(f.recv_space().len(), 100);
    }

    /// One request of a generated stream: a read, or a write with a payload
    /// that the driver takes or rejects (throws away).
    #[derive(Debug, Clone)]
    enum Req {
        Read,
        Write { len: usize, reject: bool },
    }

    fn req() -> impl proptest::strategy::Strategy<Value = Req> {
        use proptest::prelude::*;
        prop_oneof![
            Just(Req::Read),
            (0usize..3000, any::<bool>()).prop_map(|(len, reject)| Req::Write { len, reject }),
        ]
    }

    proptest::proptest! {
        /// Whatever the receive sizes and wherever the large buffer is lent
        /// and given back, every header comes out once and in order, and every
        /// payload taken is its own bytes.
        #[test]
        fn buffers_lent_and_given_back_anywhere_lose_no_byte(
            reqs in proptest::collection::vec(req(), 1..40),
            chunks in proptest::collection::vec(1usize..5000, 1..20),
            moves in proptest::collection::vec(0u8..4, 1..20),
        ) {
            let mut stream = Vec::new();
            let mut want = Vec::new();
            for (c, r) in reqs.iter().enumerate() {
                let c = c as u64;
                match *r {
                    Req::Read => stream.extend(header(CMD_READ, c, 512)),
                    Req::Write { len, reject } => {
                        let wire_len = u32::try_from(len).expect("small");
                        stream.extend(header(CMD_WRITE, c, wire_len));
                        let body: Vec<u8> = (0..len).map(|i| u8::try_from(i % 251).unwrap_or(0) ^ c.to_le_bytes()[0]).collect();
                        if !reject {
                            want.push((c, body.clone()));
                        }
                        stream.extend(body);
                    }
                }
            }
            let mut f = Framing::new(false);
            let mut spare = Some(AlignedBuf::unbudgeted(RBUF));
            let (mut at, mut turn) = (0usize, 0usize);
            let mut cookies = Vec::new();
            let mut got = Vec::new();
            let mut arriving: Option<(u64, Vec<u8>)> = None;
            for _ in 0..100_000 {
                let chunk = chunks[turn % chunks.len()];
                match f.step() {
                    Step::Again => {}
                    Step::Header => {
                        let r = f.parse().expect("a header of the stream");
                        f.consume_header();
                        cookies.push(r.cookie);
                        if r.kind == CMD_WRITE {
                            let len = usize::try_from(r.len).expect("small");
                            let i = usize::try_from(r.cookie).expect("small");
                            if matches!(reqs[i], Req::Write { reject: true, .. }) {
                                f.discard(r.len);
                                continue;
                            }
                            let mut dst = vec![0u8; len];
                            let have = f.take_payload(&mut dst);
                            if have < len {
                                f.expect_payload(0, have);
                                arriving = Some((r.cookie, dst));
                            } else {
                                got.push((r.cookie, dst));
                            }
                        }
                    }
                    Step::Payload => {
                        let (c, mut dst) = arriving.take().expect("a payload arriving");
                        let RecvState::Payload { got: have, .. } = f.state() else {
                            unreachable!()
                        };
                        let n = chunk.min(dst.len() - have).min(stream.len() - at);
                        dst[have..have + n].copy_from_slice(&stream[at..at + n]);
                        at += n;
                        turn += 1;
                        let Got::Payload { got: now, .. } = f.received(n) else {
                            unreachable!()
                        };
                        if now == dst.len() {
                            f.end_payload();
                            got.push((c, dst));
                        } else {
                            arriving = Some((c, dst));
                        }
                    }
                    Step::Receive => {
                        if at == stream.len() {
                            break;
                        }
                        // The driver's choices, before a receive is posted.
                        match moves[turn % moves.len()] {
                            0 | 1 if f.wants_room(moves[turn % moves.len()] == 1) => {
                                if let Some(b) = spare.take() {
                                    f.lend(b);
                                }
                            }
                            2 => {
                                if let Some(b) = f.give_back() {
                                    spare = Some(b);
                                }
                            }
                            _ => {}
                        }
                        at += deliver(&mut f, &stream[at..(at + chunk).min(stream.len())]);
                        turn += 1;
                    }
                }
            }
            proptest::prop_assert_eq!(at, stream.len(), "every byte received");
            proptest::prop_assert_eq!(f.avail(), 0);
            proptest::prop_assert_eq!(cookies, (0..reqs.len() as u64).collect::<Vec<_>>());
            proptest::prop_assert_eq!(got, want);
        }
    }
}
