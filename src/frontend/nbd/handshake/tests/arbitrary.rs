//! Arbitrary clients, over an in-memory stream: the handshake survives any
//! bytes and option sequences, and fed byte by byte it decides as it does on
//! the whole buffer.

use super::*;

/// Reads from a fixed script of client bytes; collects what the server writes.
struct Mem {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for Mem {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Mem {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Run the handshake on `input` and check that what the server wrote is the hello
/// followed by well-formed option replies (and, if an export was chosen with
/// `EXPORT_NAME`, its 10- or 134-byte reply).
fn run_and_check(ex: &TestExports, input: Vec<u8>) -> Result<(), TestCaseError> {
    let mut m = Mem {
        input: Cursor::new(input),
        output: Vec::new(),
    };
    let r = negotiate(&mut m, ex);
    let out = &m.output;
    prop_assert!(out.len() >= 18);
    prop_assert_eq!(be64(out, 0), NBDMAGIC);
    let mut at = 18;
    while out.len() - at >= 20 && be64(out, at) == OPT_REPLY_MAGIC {
        let len = be32(out, at + 16) as usize;
        prop_assert!(out.len() - at - 20 >= len, "truncated option reply");
        at += 20 + len;
    }
    let rest = out.len() - at;
    if rest != 0 {
        prop_assert!(
            matches!(r, Ok(Some(_))) && (rest == 10 || rest == 134),
            "{} stray bytes",
            rest
        );
    }
    if let Ok(Some(n)) = r {
        prop_assert!(ex.devs.iter().any(|d| Arc::ptr_eq(d, &n.dev)));
        prop_assert!(n.structured || !n.meta_context);
    }
    Ok(())
}

fn arb_option_payload() -> impl Strategy<Value = Vec<u8>> {
    let name = prop::sample::select(vec!["", "second", "nope"]);
    prop_oneof![
        Just(Vec::new()),
        proptest::collection::vec(any::<u8>(), 0..40),
        (name.clone(), proptest::collection::vec(0u16..5, 0..4))
            .prop_map(|(n, r)| info_request(n, &r)),
        (
            name,
            proptest::collection::vec(
                prop::sample::select(vec!["base:", BASE_ALLOCATION, "x:y"]),
                0..3
            )
        )
            .prop_map(|(n, q)| meta_request(n, &q)),
    ]
}

/// A plausible client: flags, then options (some with lying lengths), possibly cut short.
fn arb_client_script() -> impl Strategy<Value = Vec<u8>> {
    let flags = prop_oneof![4 => 0u32..4, 1 => any::<u32>()];
    let opt = prop_oneof![6 => 1u32..=10, 1 => any::<u32>()];
    let len_lie = prop_oneof![8 => Just(None), 1 => any::<u32>().prop_map(Some), 1 => (0u32..64).prop_map(Some)];
    let options = proptest::collection::vec((opt, arb_option_payload(), len_lie), 0..8);
    (flags, options, any::<prop::sample::Index>(), any::<bool>()).prop_map(
        |(flags, options, cut, do_cut)| {
            let mut b = flags.to_be_bytes().to_vec();
            for (opt, data, lie) in options {
                b.extend_from_slice(&IHAVEOPT.to_be_bytes());
                b.extend_from_slice(&opt.to_be_bytes());
                b.extend_from_slice(
                    &lie.unwrap_or(u32::try_from(data.len()).unwrap())
                        .to_be_bytes(),
                );
                b.extend_from_slice(&data);
            }
            if do_cut {
                let n = cut.index(b.len() + 1);
                b.truncate(n);
            }
            b
        },
    )
}

#[test]
fn negotiate_survives_arbitrary_client_bytes() {
    let ex = exports();
    let mut runner = proptest::test_runner::TestRunner::default();
    let strategy = (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..256));
    runner
        .run(&strategy, |(flags, bytes)| {
            // Mostly valid flags, so that the bytes after them are read at all.
            let mut input = (flags & 3).to_be_bytes().to_vec();
            input.extend_from_slice(&bytes);
            run_and_check(&ex, input)
        })
        .unwrap();
}

#[test]
fn negotiate_survives_arbitrary_option_sequences() {
    let ex = exports();
    let mut runner = proptest::test_runner::TestRunner::default();
    runner
        .run(&arb_client_script(), |input| run_and_check(&ex, input))
        .unwrap();
}

/// Feed `input` to a [`Handshake`] one byte at a time (as a client that
/// trickles would): the output, the bytes consumed and the outcome must be
/// those of the whole-buffer driver, and the machine never asks for a byte
/// past the end of the handshake.
fn bytewise_matches_whole(ex: &TestExports, input: Vec<u8>) -> Result<(), TestCaseError> {
    let mut m = Mem {
        input: Cursor::new(input.clone()),
        output: Vec::new(),
    };
    let whole = negotiate(&mut m, ex);
    let consumed_whole = usize::try_from(m.input.position()).unwrap();
    let mut h = Handshake::new(Policy::default());
    let mut out = std::mem::take(&mut h.out);
    let mut at = 0;
    let outcome = loop {
        if at == input.len() {
            break if h.at_boundary() {
                Ok(None)
            } else {
                Err(HandshakeError::Truncated)
            };
        }
        prop_assert!(h.want() >= 1);
        let step = h.feed(&input[at..at + 1], ex);
        at += 1;
        out.append(&mut h.out);
        match step {
            Ok(Step::More) => {}
            Ok(Step::StartTls) => break Err(HandshakeError::NoTls),
            Ok(Step::Done(d)) => break Ok(d),
            Err(e) => break Err(e),
        }
    };
    prop_assert_eq!(at, consumed_whole, "bytes consumed");
    match (&whole, &outcome) {
        (Ok(Some(a)), Ok(Some(b))) => {
            prop_assert!(Arc::ptr_eq(&a.dev, &b.dev));
            prop_assert_eq!(a.structured, b.structured);
            prop_assert_eq!(a.meta_context, b.meta_context);
        }
        (Ok(None), Ok(None)) | (Err(_), Err(_)) => {}
        _ => prop_assert!(false, "outcomes differ"),
    }
    // The blocking driver stops writing at an error; compare what both produced.
    if whole.is_ok() {
        prop_assert_eq!(&m.output, &out);
    } else {
        prop_assert!(out.starts_with(&m.output) || m.output.starts_with(&out));
    }
    Ok(())
}

#[test]
fn handshake_fed_byte_by_byte_matches_the_whole_buffer() {
    let ex = exports();
    let mut runner = proptest::test_runner::TestRunner::default();
    runner
        .run(&arb_client_script(), |input| {
            bytewise_matches_whole(&ex, input)
        })
        .unwrap();
}
