//! TLS record boundaries in the byte stream a socket delivers, so that a
//! reader that may later hand the session to the kernel ([`super::ktls`])
//! never reads past the end of the record in progress.
//!
//! Why: rustls keeps the bytes of a partly received record in a private
//! buffer. If the session moves to kTLS then, those bytes are lost and the
//! kernel starts decrypting in the middle of a record (`EBADMSG`). A reader
//! that asks the socket for at most [`RecordBoundary::max_read`] bytes, and
//! reports what it got with [`RecordBoundary::consumed`], is at a record
//! boundary whenever rustls has processed all it was given.
//!
//! A pure state machine over untrusted bytes (the 5-byte record header:
//! type, version, 16-bit big-endian length): it never panics and keeps no
//! buffer; property-tested here and fuzzed by `fuzz/fuzz_targets/tls_records.rs`.

/// Where the stream is: inside a record header, or inside a record's body.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordBoundary {
    header: [u8; 5],
    /// Header bytes seen of the record in progress (0..5).
    have: usize,
    /// Body bytes still to come of the record in progress.
    body_left: usize,
}

impl RecordBoundary {
    /// At the start of a record.
    pub fn new() -> RecordBoundary {
        RecordBoundary::default()
    }

    /// How many bytes may be read next without crossing the end of the
    /// record in progress (1 ..= 16 KiB + 2 KiB + 5, never 0).
    pub fn max_read(&self) -> usize {
        if self.have == 5 {
            self.body_left
        } else {
            5 - self.have
        }
    }

    /// Accounts for bytes read from the socket, in order. Any number of bytes
    /// is accepted (also more than [`max_read`](Self::max_read): whole
    /// records are skipped over).
    pub fn consumed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.have < 5 {
                let n = (5 - self.have).min(data.len());
                self.header[self.have..self.have + n].copy_from_slice(&data[..n]);
                self.have += n;
                data = &data[n..];
                if self.have == 5 {
                    self.body_left =
                        usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                    if self.body_left == 0 {
                        self.have = 0;
                    }
                }
            } else {
                let n = self.body_left.min(data.len());
                self.body_left -= n;
                data = &data[n..];
                if self.body_left == 0 {
                    self.have = 0;
                }
            }
        }
    }

    /// Whether every record read so far is complete.
    pub fn at_boundary(&self) -> bool {
        self.have == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(len: usize, fill: u8) -> Vec<u8> {
        let mut r = vec![23, 3, 3];
        r.extend_from_slice(&u16::try_from(len).unwrap().to_be_bytes());
        r.extend(std::iter::repeat_n(fill, len));
        r
    }

    #[test]
    fn header_then_body_then_next() {
        let mut b = RecordBoundary::new();
        assert!(b.at_boundary());
        assert_eq!(b.max_read(), 5);
        b.consumed(&[23, 3]);
        assert_eq!(b.max_read(), 3);
        assert!(!b.at_boundary());
        b.consumed(&[3, 0, 4]);
        assert_eq!(b.max_read(), 4);
        b.consumed(&[1, 2, 3]);
        assert_eq!(b.max_read(), 1);
        b.consumed(&[4]);
        assert!(b.at_boundary());
        assert_eq!(b.max_read(), 5);
        // An empty record is over with its header.
        b.consumed(&[23, 3, 3, 0, 0]);
        assert!(b.at_boundary());
    }

    proptest! {
        /// Reading at most max_read() each time stops exactly at every
        /// record end, whatever the socket delivers.
        #[test]
        fn bounded_reads_stop_at_every_record_end(
            lens in proptest::collection::vec(0usize..3000, 1..8),
            cuts in proptest::collection::vec(1usize..4000, 1..64),
        ) {
            let mut stream = Vec::new();
            let mut ends = Vec::new();
            for (i, &l) in lens.iter().enumerate() {
                stream.extend(record(l, u8::try_from(i).unwrap_or(0)));
                ends.push(stream.len());
            }
            let mut b = RecordBoundary::new();
            let mut at = 0;
            let mut cut = cuts.iter().cycle();
            while at < stream.len() {
                let want = b.max_read().min(*cut.next().unwrap_or(&1));
                prop_assert!(want > 0);
                let n = want.min(stream.len() - at);
                b.consumed(&stream[at..at + n]);
                at += n;
                prop_assert_eq!(b.at_boundary(), ends.contains(&at), "at {}", at);
            }
        }

        /// Any bytes in any chunks: never panics, and the state depends only
        /// on the bytes, not on how they were cut.
        #[test]
        fn chunking_does_not_matter(
            data in proptest::collection::vec(any::<u8>(), 0..2000),
            cut in 1usize..100,
        ) {
            let mut whole = RecordBoundary::new();
            whole.consumed(&data);
            let mut parts = RecordBoundary::new();
            for c in data.chunks(cut) {
                parts.consumed(c);
            }
            prop_assert_eq!(whole.at_boundary(), parts.at_boundary());
            prop_assert_eq!(whole.max_read(), parts.max_read());
            prop_assert!(whole.max_read() >= 1);
        }
    }
}
