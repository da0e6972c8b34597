//! The reply queue of one NBD connection (pure: no I/O): which replies wait
//! to be sent, in order, and how much of the front one earlier partial sends
//! took.
//!
//! Replies go out in the order they were queued, many per send: the driver
//! asks for the bytes still to send ([`ReplyQueue::gather`]: each queued
//! reply's header and data, less what went out already, up to a number of
//! pieces, stopping before a reply that is spliced out of pipes), sends some
//! of them, and reports how many bytes went ([`ReplyQueue::sent`]), which
//! says how many replies at the front are complete. The property test below
//! checks that every byte of every reply is sent once and in order under any
//! sequence of partial sends.
//!
//! Contract: owned by its connection; a reply's bytes are the slot's and stay
//! put while it is queued (the slot table never moves).

use std::collections::VecDeque;

pub(crate) struct ReplyQueue {
    q: VecDeque<u16>,
    /// Bytes of the front reply already sent by earlier partial sends.
    front_sent: usize,
}

impl ReplyQueue {
    pub(crate) fn with_capacity(n: usize) -> ReplyQueue {
        ReplyQueue {
            q: VecDeque::with_capacity(n),
            front_sent: 0,
        }
    }

    /// Queue the reply of slot `si` behind the others.
    pub(crate) fn push(&mut self, si: u16) {
        self.q.push_back(si);
    }

    pub(crate) fn front(&self) -> Option<u16> {
        self.q.front().copied()
    }

    /// Take the front reply off the queue (complete, or dropped).
    pub(crate) fn pop(&mut self) -> Option<u16> {
        self.q.pop_front()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// Bytes of the front reply already sent.
    pub(crate) fn front_sent(&self) -> usize {
        self.front_sent
    }

    /// The bytes still to send, in order: `emit` gets each queued reply's
    /// header and data (as `parts` gives them), less the bytes already sent
    /// of the front one, skipping empty pieces. Stops before a reply whose
    /// `parts` is `None` (spliced: sent on its own) and before a reply whose
    /// two pieces would pass `max` pieces. Returns the pieces emitted.
    pub(crate) fn gather<'a>(
        &self,
        max: usize,
        parts: impl Fn(u16) -> Option<[&'a [u8]; 2]>,
        mut emit: impl FnMut(&'a [u8]),
    ) -> usize {
        let mut n = 0;
        let mut skip = self.front_sent;
        for &si in &self.q {
            if n + 2 > max {
                break;
            }
            let Some(ps) = parts(si) else {
                break;
            };
            for p in ps {
                if skip >= p.len() {
                    skip -= p.len();
                    continue;
                }
                emit(&p[skip..]);
                skip = 0;
                n += 1;
            }
        }
        n
    }

    /// `n` more bytes of the queued replies went out (`len` says how long
    /// each reply is): returns how many replies at the front are now
    /// complete, for the caller to [`ReplyQueue::pop`] and free. What is left
    /// of a reply sent in part is remembered.
    pub(crate) fn sent(&mut self, n: usize, len: impl Fn(u16) -> usize) -> usize {
        let mut n = n + self.front_sent;
        self.front_sent = 0;
        let mut done = 0;
        for &si in &self.q {
            let l = len(si);
            if n < l {
                self.front_sent = n;
                break;
            }
            n -= l;
            done += 1;
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A reply: header bytes, data bytes, and whether it is spliced (sent on
    /// its own, out of pipes, from where the queue says it stopped).
    #[derive(Debug, Clone)]
    struct Reply {
        hdr: Vec<u8>,
        data: Vec<u8>,
        spliced: bool,
    }

    fn reply(i: usize, hdr: usize, data: usize, spliced: bool) -> Reply {
        // Bytes that name their reply and position, so a misplaced byte shows.
        let byte = |k: usize| u8::try_from((i * 131 + k * 7) % 251).expect("below 251");
        Reply {
            hdr: (0..hdr).map(byte).collect(),
            data: (hdr..hdr + data).map(byte).collect(),
            spliced,
        }
    }

    impl Reply {
        fn bytes(&self) -> Vec<u8> {
            [self.hdr.as_slice(), &self.data].concat()
        }
    }

    /// Run the queue the way the connection does: replies queued while sends
    /// go on (`arrive[k]` replies join before send `k`), each send taking
    /// at most `sizes[k]` bytes of what `gather` offers (or, for a spliced
    /// front reply, of what is left of it). Returns the bytes sent and the
    /// replies completed, in order.
    fn run(
        replies: &[Reply],
        arrive: &[usize],
        sizes: &[usize],
        max: usize,
    ) -> (Vec<u8>, Vec<u16>) {
        let mut q = ReplyQueue::with_capacity(replies.len());
        let mut queued = 0;
        let mut out = Vec::new();
        let mut done = Vec::new();
        let mut k = 0;
        let len =
            |si: u16| replies[usize::from(si)].hdr.len() + replies[usize::from(si)].data.len();
        // Bounded: every round sends at least one byte or queues a reply.
        for _ in 0..100_000 {
            let joining = arrive.get(k).copied().unwrap_or(replies.len());
            for _ in 0..joining {
                if queued < replies.len() {
                    q.push(u16::try_from(queued).unwrap());
                    queued += 1;
                }
            }
            let Some(front) = q.front() else {
                if queued == replies.len() {
                    break;
                }
                k += 1;
                continue;
            };
            let size = sizes.get(k).copied().unwrap_or(usize::MAX).max(1);
            k += 1;
            let r = &replies[usize::from(front)];
            let mut offered = Vec::new();
            if r.spliced {
                offered.extend_from_slice(&r.bytes()[q.front_sent()..]);
            } else {
                let n = q.gather(
                    max,
                    |si| {
                        let r = &replies[usize::from(si)];
                        (!r.spliced).then_some([r.hdr.as_slice(), r.data.as_slice()])
                    },
                    |p| offered.extend_from_slice(p),
                );
                assert!(n <= max);
                assert!(n > 0, "a queued reply always offers bytes");
            }
            let take = size.min(offered.len());
            out.extend_from_slice(&offered[..take]);
            for _ in 0..q.sent(take, len) {
                done.push(q.pop().unwrap());
            }
        }
        (out, done)
    }

    fn arb_reply(i: usize) -> impl Strategy<Value = Reply> {
        (
            1usize..=40,
            prop_oneof![Just(0usize), 1usize..300, 4000usize..5000],
            any::<bool>(),
        )
            .prop_map(move |(h, d, s)| reply(i, h, d, s && d > 0))
    }

    fn arb_replies() -> impl Strategy<Value = Vec<Reply>> {
        (1usize..40).prop_flat_map(|n| (0..n).map(arb_reply).collect::<Vec<_>>())
    }

    proptest! {
        #[test]
        fn every_byte_of_every_reply_is_sent_once_and_in_order(
            replies in arb_replies(),
            arrive in proptest::collection::vec(0usize..4, 0..60),
            sizes in proptest::collection::vec(prop_oneof![1usize..8, 1usize..100, 1usize..10_000], 0..400),
            max in prop_oneof![Just(64usize), 2usize..8],
        ) {
            let (out, done) = run(&replies, &arrive, &sizes, max);
            let want: Vec<u8> = replies.iter().flat_map(Reply::bytes).collect();
            prop_assert_eq!(out.len(), want.len());
            prop_assert!(out == want, "bytes out of order or repeated");
            let order: Vec<u16> = (0..replies.len()).map(|i| u16::try_from(i).unwrap()).collect();
            prop_assert_eq!(done, order);
        }
    }

    #[test]
    fn a_partial_send_resumes_inside_the_front_reply() {
        let a = reply(0, 16, 10, false);
        let b = reply(1, 16, 0, false);
        let mut q = ReplyQueue::with_capacity(2);
        q.push(0);
        q.push(1);
        let parts = |si: u16| {
            let r = if si == 0 { &a } else { &b };
            Some([r.hdr.as_slice(), r.data.as_slice()])
        };
        let len = |si: u16| if si == 0 { 26 } else { 16 };
        assert_eq!(q.sent(20, len), 0);
        assert_eq!(q.front_sent(), 20);
        let mut got = Vec::new();
        assert_eq!(q.gather(64, parts, |p| got.push(p.to_vec())), 2);
        assert_eq!(got, vec![a.data[4..].to_vec(), b.hdr.clone()]);
        assert_eq!(q.sent(6, len), 1);
        assert_eq!(q.pop(), Some(0));
        assert_eq!(q.front_sent(), 0);
    }

    #[test]
    fn gathering_stops_before_a_spliced_reply_and_at_the_piece_limit() {
        let r = reply(0, 16, 8, false);
        let mut q = ReplyQueue::with_capacity(4);
        for si in 0..4 {
            q.push(si);
        }
        let parts = |si: u16| (si != 2).then_some([r.hdr.as_slice(), r.data.as_slice()]);
        assert_eq!(
            q.gather(64, parts, |_| {}),
            4,
            "two replies before the spliced one"
        );
        assert_eq!(
            q.gather(3, parts, |_| {}),
            2,
            "a reply's two pieces go together"
        );
    }
}
