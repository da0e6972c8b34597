//! Extended headers: the 32-byte request header, validation with 64-bit
//! lengths and `NBD_CMD_FLAG_PAYLOAD_LEN`, and the 32-byte reply headers.

use super::replies::ALL_ERRNOS;
use super::*;

fn arb_ext_request() -> impl Strategy<Value = Request> {
    let flags = prop_oneof![4 => 0u16..64, 1 => any::<u16>()];
    let kind = prop_oneof![6 => 0u16..=7, 1 => any::<u16>()];
    let offset = prop_oneof![3 => 0u64..=(1 << 34), 1 => any::<u64>()];
    let len = prop_oneof![
        1 => Just(0u64),
        3 => 1u64..=(1 << 22),
        1 => (u64::from(MAX_PAYLOAD) - 2)..=(u64::from(MAX_PAYLOAD) + 2),
        2 => (1u64 << 32)..=(1u64 << 34),
        1 => any::<u64>(),
    ];
    (flags, kind, any::<u64>(), offset, len).prop_map(|(flags, kind, cookie, offset, len)| {
        Request {
            flags,
            kind,
            cookie,
            offset,
            len,
        }
    })
}

fn ext_view() -> impl Strategy<Value = ExportView> {
    let size = prop_oneof![2 => 0u64..=(1 << 34), 1 => any::<u64>()];
    (size, any::<bool>(), any::<bool>()).prop_map(|(size, read_only, meta_context)| ExportView {
        size,
        read_only,
        structured: true,
        extended: true,
        meta_context,
    })
}

fn view(size: u64) -> ExportView {
    ExportView {
        size,
        read_only: false,
        structured: true,
        extended: true,
        meta_context: true,
    }
}

fn req(kind: u16, flags: u16, offset: u64, len: u64) -> Request {
    Request {
        flags,
        kind,
        cookie: 0x1122_3344_5566_7788,
        offset,
        len,
    }
}

/// A write's length is a payload's, flagged or not.
fn has_payload(r: &Request) -> bool {
    r.kind == CMD_WRITE || r.flags & CMD_FLAG_PAYLOAD_LEN != 0
}

fn payload_bounded(r: &Request) -> bool {
    !has_payload(r) || r.len <= u64::from(u32::MAX)
}

proptest! {
    #[test]
    fn extended_request_round_trips(r in arb_ext_request()) {
        let b = encode_request_ext(&r);
        prop_assert_eq!(b.len(), EXTENDED_REQUEST_LEN);
        prop_assert_eq!(be32_at(&b, 0), 0x21e4_1c71);
        if payload_bounded(&r) {
            prop_assert_eq!(parse_request_ext(&b), Ok(r));
            prop_assert_eq!(parse_header(&b, true), Ok(r));
        } else {
            prop_assert_eq!(
                parse_request_ext(&b),
                Err(WireError::TooLong { len: r.len, limit: u64::from(u32::MAX) })
            );
        }
        // An extended header where compact ones are expected is a framing error.
        prop_assert!(parse_header(&b, false).is_err());
    }

    #[test]
    fn compact_header_is_a_framing_error_in_extended_mode(r in arb_request()) {
        let b = encode_request(&r);
        let mut padded = b.to_vec();
        padded.extend_from_slice(&[0u8; 4]);
        prop_assert_eq!(
            parse_header(&padded, true),
            Err(WireError::BadMagic(u64::from(REQUEST_MAGIC)))
        );
    }

    /// Arbitrary bytes: an error or a request, never a panic; accepted only
    /// when 32 bytes long with the extended magic, and then exactly the bytes.
    #[test]
    fn parse_request_ext_accepts_iff_long_enough_with_magic(
        mut b in proptest::collection::vec(any::<u8>(), 0..48),
        force_magic in any::<bool>(),
    ) {
        if force_magic && b.len() >= 4 {
            b[0..4].copy_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        }
        let r = parse_request_ext(&b);
        match r {
            Ok(req) => {
                prop_assert!(b.len() >= EXTENDED_REQUEST_LEN);
                prop_assert_eq!(&encode_request_ext(&req)[..], &b[..EXTENDED_REQUEST_LEN]);
                prop_assert!(payload_bounded(&req));
            }
            Err(WireError::Short { need, have }) => {
                prop_assert_eq!(need, EXTENDED_REQUEST_LEN);
                prop_assert_eq!(have, b.len());
            }
            Err(WireError::BadMagic(m)) => {
                prop_assert_ne!(m, u64::from(EXTENDED_REQUEST_MAGIC));
                prop_assert_eq!(m, u64::from(be32_at(&b, 0)));
            }
            Err(WireError::TooLong { len, .. }) => {
                prop_assert_eq!(len, be64_at(&b, 24));
                prop_assert!(len > u64::from(u32::MAX));
            }
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
    }

    /// With extended headers: the payload a rejection reports is the length of
    /// a write or of a request flagged PAYLOAD_LEN (and nothing else); an
    /// accepted request is in range, only a write has a payload, and reads and
    /// writes stay within the payload cap while other commands may go past 32
    /// bits.
    #[test]
    fn extended_validate_accepts_only_safe_requests(
        r in arb_ext_request(),
        exp in ext_view(),
    ) {
        prop_assert_eq!(payload_len(&r, &exp), if has_payload(&r) { r.len } else { 0 });
        match validate(&r, &exp) {
            Err(rej) => prop_assert_eq!(rej.payload, payload_len(&r, &exp)),
            Ok(cmd) => {
                prop_assert_eq!(has_payload(&r), cmd == Command::Write);
                prop_assert!(!(is_write_like(cmd) && exp.read_only));
                if !matches!(cmd, Command::Disc | Command::Flush) {
                    prop_assert!(r.len > 0);
                    prop_assert!(r.offset.checked_add(r.len).is_some_and(|e| e <= exp.size));
                }
                if matches!(cmd, Command::Read | Command::Write) {
                    prop_assert!(r.len <= u64::from(MAX_PAYLOAD));
                }
            }
        }
    }

    #[test]
    fn extended_replies_are_32_byte_headers_with_the_request_offset(
        cmd_is_read in any::<bool>(),
        cookie in any::<u64>(),
        offset in any::<u64>(),
        result in prop_oneof![
            (0u32..=MAX_PAYLOAD).prop_map(Ok),
            prop::sample::select(ALL_ERRNOS.to_vec()).prop_map(Err),
        ],
    ) {
        let mut out = [0xaau8; MAX_REPLY_HEADER];
        let n = reply_header(&mut out, cmd_is_read, Replies::Extended, cookie, offset, result);
        prop_assert_eq!(be32_at(&out, 0), 0x6e8a_278c);
        prop_assert_eq!(u16::from_be_bytes([out[4], out[5]]), REPLY_FLAG_DONE);
        prop_assert_eq!(be64_at(&out, 8), cookie);
        prop_assert_eq!(be64_at(&out, 16), offset);
        let kind = u16::from_be_bytes([out[6], out[7]]);
        let len = be64_at(&out, 24);
        match result {
            Err(e) => {
                prop_assert_eq!((kind, n, len), (REPLY_TYPE_ERROR, 38, 6));
                prop_assert_eq!(be32_at(&out, 32), error_code(e));
                prop_assert_eq!(u16::from_be_bytes([out[36], out[37]]), 0);
            }
            Ok(data) if cmd_is_read => {
                prop_assert_eq!((kind, n), (REPLY_TYPE_OFFSET_DATA, 40));
                prop_assert_eq!(len, u64::from(data) + 8);
                prop_assert_eq!(be64_at(&out, 32), offset);
            }
            Ok(_) => prop_assert_eq!((kind, n, len), (REPLY_TYPE_NONE, 32, 0)),
        }
    }

    #[test]
    fn block_status_ext_is_counted_16_byte_descriptors(
        cookie in any::<u64>(),
        offset in any::<u64>(),
        extents in proptest::collection::vec((1u32.., any::<bool>()), 1..20),
    ) {
        let ext: Vec<Extent> = extents
            .iter()
            .map(|&(len, hole)| Extent { len, hole, zero: hole })
            .collect();
        let mut body = vec![0xaau8; 16 * ext.len()];
        let n = encode_extents_ext(&mut body, &ext);
        prop_assert_eq!(n, ext.len());
        let mut out = [0u8; MAX_REPLY_HEADER];
        let count = u32::try_from(n).unwrap();
        let h = block_status_ext_header(&mut out, cookie, offset, 1, count);
        prop_assert_eq!(h, 40);
        prop_assert_eq!(be32_at(&out, 0), EXTENDED_REPLY_MAGIC);
        prop_assert_eq!(u16::from_be_bytes([out[6], out[7]]), REPLY_TYPE_BLOCK_STATUS_EXT);
        prop_assert_eq!(be64_at(&out, 16), offset);
        // The length counts what follows the 32-byte header: id, count, descriptors.
        prop_assert_eq!(be64_at(&out, 24), 8 + 16 * u64::from(count));
        prop_assert_eq!(be32_at(&out, 32), 1);
        prop_assert_eq!(be32_at(&out, 36), count);
        for (e, d) in ext.iter().zip(body.chunks_exact(16)) {
            prop_assert_eq!(be64_at(d, 0), u64::from(e.len));
            prop_assert_eq!(be32_at(d, 8), 0);
            let want = if e.hole { STATE_HOLE | STATE_ZERO } else { 0 };
            prop_assert_eq!(be32_at(d, 12), want);
        }
    }
}

#[test]
fn sixty_four_bit_effect_lengths_are_accepted_for_trim_zeroes_cache_and_status() {
    let exp = view(8 << 30);
    for (kind, cmd) in [
        (CMD_TRIM, Command::Trim),
        (CMD_WRITE_ZEROES, Command::WriteZeroes),
        (CMD_CACHE, Command::Cache),
        (CMD_BLOCK_STATUS, Command::BlockStatus),
    ] {
        assert_eq!(validate(&req(kind, 0, 4096, 5 << 30), &exp), Ok(cmd));
        // Past the end is still past the end.
        let err = validate(&req(kind, 0, 4 << 30, 5 << 30), &exp).unwrap_err();
        assert_ne!(err.errno, NbdErrno::Overflow);
        assert_eq!(err.payload, 0);
    }
}

#[test]
fn extended_reads_and_writes_stay_within_the_payload_cap() {
    let exp = view(8 << 30);
    let big = u64::from(MAX_PAYLOAD) + 1;
    let r = validate(&req(CMD_READ, 0, 0, 5 << 30), &exp);
    assert_eq!(
        r,
        Err(Rejected {
            errno: NbdErrno::Overflow,
            payload: 0
        })
    );
    let r = validate(&req(CMD_WRITE, CMD_FLAG_PAYLOAD_LEN, 0, big), &exp);
    // Refused, and its payload skipped.
    assert_eq!(
        r,
        Err(Rejected {
            errno: NbdErrno::Overflow,
            payload: big
        })
    );
    let ok = validate(&req(CMD_WRITE, CMD_FLAG_PAYLOAD_LEN, 0, 4096), &exp);
    assert_eq!(ok, Ok(Command::Write));
}

#[test]
fn payload_flag_is_optional_on_writes_and_refused_elsewhere() {
    let exp = view(1 << 30);
    for flags in [0, CMD_FLAG_PAYLOAD_LEN, CMD_FLAG_PAYLOAD_LEN | CMD_FLAG_FUA] {
        let r = req(CMD_WRITE, flags, 0, 4096);
        assert_eq!(validate(&r, &exp), Ok(Command::Write));
        assert_eq!(payload_len(&r, &exp), 4096);
    }
    for kind in [
        CMD_READ,
        CMD_TRIM,
        CMD_WRITE_ZEROES,
        CMD_BLOCK_STATUS,
        CMD_FLUSH,
    ] {
        let r = validate(&req(kind, CMD_FLAG_PAYLOAD_LEN, 0, 100), &exp);
        assert_eq!(
            r,
            Err(Rejected {
                errno: NbdErrno::Inval,
                payload: 100
            }),
            "kind {kind}"
        );
    }
    // In compact mode the flag is unknown: refused, and a write's length is its payload.
    let compact = ExportView {
        extended: false,
        ..exp
    };
    let r = validate(&req(CMD_WRITE, CMD_FLAG_PAYLOAD_LEN, 0, 100), &compact);
    assert_eq!(
        r,
        Err(Rejected {
            errno: NbdErrno::Inval,
            payload: 100
        })
    );
}

#[test]
fn a_payload_past_32_bits_is_a_framing_error() {
    for (kind, flags) in [
        (CMD_WRITE, 0),
        (CMD_WRITE, CMD_FLAG_PAYLOAD_LEN),
        (CMD_READ, CMD_FLAG_PAYLOAD_LEN),
    ] {
        let r = req(kind, flags, 0, 1 << 32);
        let e = parse_request_ext(&encode_request_ext(&r));
        assert!(matches!(e, Err(WireError::TooLong { .. })), "{r:?}");
    }
    // Without a payload the same length is an effect length, for `validate`.
    let r = req(CMD_TRIM, 0, 0, 1 << 32);
    assert_eq!(parse_request_ext(&encode_request_ext(&r)), Ok(r));
}
