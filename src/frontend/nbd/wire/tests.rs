use super::*;
use proptest::prelude::*;

#[test]
fn request_round_trips() {
    let r = Request {
        flags: 1,
        kind: CMD_WRITE,
        cookie: 7,
        offset: 4096,
        len: 512,
    };
    assert_eq!(parse_request(&encode_request(&r)), Ok(r));
}

// ---------------------------------------------------------------------------
// Helpers: encoders for the client side of the handshake, written here from the
// spec so that the parsers are checked against an independent encoding.

fn enc_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&u32::try_from(s.len()).unwrap().to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn enc_info_request(name: &str, requests: &[u16]) -> Vec<u8> {
    let mut b = Vec::new();
    enc_string(&mut b, name);
    b.extend_from_slice(&u16::try_from(requests.len()).unwrap().to_be_bytes());
    for r in requests {
        b.extend_from_slice(&r.to_be_bytes());
    }
    b
}

fn enc_meta_request(name: &str, queries: &[String]) -> Vec<u8> {
    let mut b = Vec::new();
    enc_string(&mut b, name);
    b.extend_from_slice(&u32::try_from(queries.len()).unwrap().to_be_bytes());
    for q in queries {
        enc_string(&mut b, q);
    }
    b
}

fn be32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

fn be64_at(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// Names and queries as clients send them: UTF-8 without NUL, mostly short.
fn arb_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z0-9:/._ -]{0,24}",
        1 => "\\PC{0,16}".prop_filter("no NUL", |s| !s.contains('\0')),
        1 => Just(BASE_ALLOCATION.to_string()),
        1 => Just("x".repeat(MAX_NAME_LEN)),
    ]
}

/// A valid encoding, then one of several corruptions applied to it.
#[derive(Debug, Clone)]
enum Corruption {
    Truncate(usize),
    Append(Vec<u8>),
    SetByte(usize, u8),
    /// Overwrite four bytes at this position with 0xffffffff (a huge length or count).
    HugeU32(usize),
}

fn arb_corruption() -> impl Strategy<Value = Corruption> {
    prop_oneof![
        any::<usize>().prop_map(Corruption::Truncate),
        proptest::collection::vec(any::<u8>(), 1..8).prop_map(Corruption::Append),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Corruption::SetByte(i, b)),
        any::<usize>().prop_map(Corruption::HugeU32),
    ]
}

fn corrupt(mut b: Vec<u8>, c: &Corruption) -> Vec<u8> {
    match c {
        Corruption::Truncate(n) => {
            let n = n % (b.len() + 1);
            b.truncate(n);
        }
        Corruption::Append(x) => b.extend_from_slice(x),
        Corruption::SetByte(i, v) => {
            if !b.is_empty() {
                let i = i % b.len();
                b[i] = *v;
            }
        }
        Corruption::HugeU32(i) => {
            if b.len() >= 4 {
                let i = i % (b.len() - 3);
                b[i..i + 4].copy_from_slice(&[0xff; 4]);
            }
        }
    }
    b
}

// ---------------------------------------------------------------------------
// Requests

fn arb_request() -> impl Strategy<Value = Request> {
    (
        any::<u16>(),
        any::<u16>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
    )
        .prop_map(|(flags, kind, cookie, offset, len)| Request {
            flags,
            kind,
            cookie,
            offset,
            len: u64::from(len),
        })
}

/// Requests concentrated where `validate`'s decisions are: known commands, small
/// flag values, offsets and lengths near the export's end and near overflow.
fn arb_interesting_request() -> impl Strategy<Value = Request> {
    let kind = prop_oneof![6 => 0u16..=7, 1 => 8u16..=16, 1 => any::<u16>()];
    let flags = prop_oneof![6 => 0u16..32, 1 => any::<u16>()];
    let offset = prop_oneof![
        4 => 0u64..=(1 << 21),
        1 => (0u64..=(1 << 20)).prop_map(|d| u64::MAX - d),
        1 => any::<u64>(),
    ];
    let len = prop_oneof![
        1 => Just(0u32),
        4 => 1u32..=(1 << 20),
        1 => (MAX_PAYLOAD - 2)..=(MAX_PAYLOAD + 2),
        1 => any::<u32>(),
    ];
    (flags, kind, any::<u64>(), offset, len).prop_map(|(flags, kind, cookie, offset, len)| {
        Request {
            flags,
            kind,
            cookie,
            offset,
            len: u64::from(len),
        }
    })
}

fn arb_view() -> impl Strategy<Value = ExportView> {
    let size = prop_oneof![
        4 => 0u64..=(1 << 21),
        1 => (1u64 << 21)..=(1u64 << 40),
        1 => Just(u64::MAX),
        1 => any::<u64>(),
    ];
    (size, any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
        |(size, read_only, structured, meta_context)| ExportView {
            size,
            read_only,
            structured,
            extended: false,
            meta_context,
        },
    )
}

fn command_of(kind: u16) -> Option<Command> {
    Some(match kind {
        CMD_READ => Command::Read,
        CMD_WRITE => Command::Write,
        CMD_DISC => Command::Disc,
        CMD_FLUSH => Command::Flush,
        CMD_TRIM => Command::Trim,
        CMD_CACHE => Command::Cache,
        CMD_WRITE_ZEROES => Command::WriteZeroes,
        CMD_BLOCK_STATUS => Command::BlockStatus,
        _ => return None,
    })
}

fn allowed_flags(cmd: Command, structured: bool) -> u16 {
    match cmd {
        Command::Read if structured => CMD_FLAG_FUA | CMD_FLAG_DF,
        Command::WriteZeroes => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        Command::BlockStatus => CMD_FLAG_REQ_ONE,
        _ => CMD_FLAG_FUA,
    }
}

fn in_range(req: &Request, size: u64) -> bool {
    req.offset.checked_add(req.len).is_some_and(|e| e <= size)
}

fn well_flagged(req: &Request, exp: &ExportView) -> Option<Command> {
    let cmd = command_of(req.kind)?;
    (req.flags & !allowed_flags(cmd, exp.structured) == 0).then_some(cmd)
}

fn is_write_like(cmd: Command) -> bool {
    matches!(cmd, Command::Write | Command::Trim | Command::WriteZeroes)
}

proptest! {
    #[test]
    fn request_encode_then_parse_round_trips(r in arb_request()) {
        let b = encode_request(&r);
        prop_assert_eq!(b.len(), REQUEST_LEN);
        prop_assert_eq!(be32_at(&b, 0), REQUEST_MAGIC);
        prop_assert_eq!(parse_request(&b), Ok(r));
    }

    #[test]
    fn parse_request_accepts_iff_long_enough_with_magic(
        mut b in proptest::collection::vec(any::<u8>(), 0..40),
        force_magic in any::<bool>(),
    ) {
        if force_magic && b.len() >= 4 {
            b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        let r = parse_request(&b);
        let accept = b.len() >= REQUEST_LEN && be32_at(&b, 0) == REQUEST_MAGIC;
        prop_assert_eq!(r.is_ok(), accept, "{:?}", r);
        match r {
            Ok(req) => prop_assert_eq!(&encode_request(&req)[..], &b[..REQUEST_LEN]),
            Err(WireError::Short { need, have }) => {
                prop_assert_eq!(need, REQUEST_LEN);
                prop_assert_eq!(have, b.len());
                prop_assert!(b.len() < REQUEST_LEN);
            }
            Err(WireError::BadMagic(m)) => prop_assert_eq!(m, u64::from(be32_at(&b, 0))),
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
    }

    #[test]
    fn option_header_accepts_iff_long_enough_with_magic(
        mut b in proptest::collection::vec(any::<u8>(), 0..24),
        force_magic in any::<bool>(),
    ) {
        if force_magic && b.len() >= 8 {
            b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        }
        let h = parse_option_header(&b);
        let accept = b.len() >= 16 && be64_at(&b, 0) == IHAVEOPT;
        prop_assert_eq!(h.is_ok(), accept, "{:?}", h);
        if let Ok(h) = h {
            prop_assert_eq!(h.option, be32_at(&b, 8));
            prop_assert_eq!(h.len, be32_at(&b, 12));
        }
    }

    /// Whatever `validate` says, it never panics, the payload it reports for a
    /// rejection is what the reader must skip, and an accepted request is safe to
    /// plan (known command, allowed flags, in range, writable, within the payload cap).
    #[test]
    fn validate_never_panics_and_accepts_only_safe_requests(
        req in prop_oneof![arb_interesting_request(), arb_request()],
        exp in arb_view(),
    ) {
        match validate(&req, &exp) {
            Err(rej) => {
                let payload = if req.kind == CMD_WRITE { req.len } else { 0 };
                prop_assert_eq!(rej.payload, payload);
            }
            Ok(cmd) => {
                prop_assert_eq!(Some(cmd), command_of(req.kind));
                prop_assert_eq!(req.flags & !allowed_flags(cmd, exp.structured), 0);
                prop_assert!(!(is_write_like(cmd) && exp.read_only));
                if !matches!(cmd, Command::Disc | Command::Flush) {
                    prop_assert!(req.len > 0);
                    prop_assert!(in_range(&req, exp.size));
                }
                if matches!(cmd, Command::Read | Command::Write) {
                    prop_assert!(req.len <= u64::from(MAX_PAYLOAD));
                }
                if cmd == Command::BlockStatus {
                    prop_assert!(exp.meta_context);
                }
            }
        }
    }

    /// The full decision table, rule by rule, in the order the rules apply.
    #[test]
    fn validate_follows_the_rules(req in arb_interesting_request(), exp in arb_view()) {
        let got = validate(&req, &exp).map_err(|r| r.errno);
        let Some(cmd) = command_of(req.kind) else {
            prop_assert_eq!(got, Err(NbdErrno::Inval), "unknown command");
            return Ok(());
        };
        if well_flagged(&req, &exp).is_none() {
            prop_assert_eq!(got, Err(NbdErrno::Inval), "bad flags");
            return Ok(());
        }
        if is_write_like(cmd) && exp.read_only {
            prop_assert_eq!(got, Err(NbdErrno::Perm), "write to read-only export");
            return Ok(());
        }
        if matches!(cmd, Command::Disc | Command::Flush) {
            prop_assert_eq!(got, Ok(cmd));
            return Ok(());
        }
        if cmd == Command::BlockStatus && !exp.meta_context {
            prop_assert_eq!(got, Err(NbdErrno::Inval), "block status without a context");
            return Ok(());
        }
        if req.len == 0 {
            prop_assert_eq!(got, Err(NbdErrno::Inval), "zero length");
            return Ok(());
        }
        if !in_range(&req, exp.size) {
            let want = if matches!(cmd, Command::Write | Command::WriteZeroes) { NbdErrno::NoSpc } else { NbdErrno::Inval };
            prop_assert_eq!(got, Err(want), "out of range");
            return Ok(());
        }
        if matches!(cmd, Command::Read | Command::Write) && req.len > u64::from(MAX_PAYLOAD) {
            prop_assert_eq!(got, Err(NbdErrno::Overflow), "payload too big");
            return Ok(());
        }
        prop_assert_eq!(got, Ok(cmd));
    }

    #[test]
    fn out_of_range_read_is_rejected_with_inval(
        size in 0u64..(1 << 30),
        past in 1u64..(1 << 20),
        len in 1u32..=MAX_PAYLOAD,
        structured in any::<bool>(),
    ) {
        // Ends `past` bytes after the export (or starts past it).
        let end = size + past;
        let offset = end.saturating_sub(u64::from(len));
        let len = u32::try_from(end - offset).unwrap();
        let req = Request { flags: 0, kind: CMD_READ, cookie: 1, offset, len: u64::from(len) };
        let exp = ExportView { size, read_only: false, structured, extended: false, meta_context: false };
        prop_assert_eq!(validate(&req, &exp), Err(Rejected { errno: NbdErrno::Inval, payload: 0 }));
    }

    #[test]
    fn out_of_range_write_is_rejected_with_nospc_and_payload_to_skip(
        size in 0u64..(1 << 30),
        past in 1u64..(1 << 20),
        len in 1u32..=MAX_PAYLOAD,
        fua in any::<bool>(),
    ) {
        let end = size + past;
        let offset = end.saturating_sub(u64::from(len));
        let len = u32::try_from(end - offset).unwrap();
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        let req = Request { flags, kind: CMD_WRITE, cookie: 1, offset, len: u64::from(len) };
        let exp = ExportView { size, read_only: false, structured: false, extended: false, meta_context: false };
        prop_assert_eq!(validate(&req, &exp), Err(Rejected { errno: NbdErrno::NoSpc, payload: u64::from(len) }));
    }

    #[test]
    fn offset_plus_len_overflow_is_rejected(
        kind in 0u16..=7,
        back in 0u64..(1 << 20),
        len in 1u32..=u32::MAX,
        exp in arb_view(),
    ) {
        let offset = u64::MAX - back;
        prop_assume!(offset.checked_add(u64::from(len)).is_none());
        let cmd = command_of(kind).unwrap();
        prop_assume!(!matches!(cmd, Command::Disc | Command::Flush));
        let req = Request { flags: 0, kind, cookie: 0, offset, len: u64::from(len) };
        prop_assert!(validate(&req, &exp).is_err());
    }

    #[test]
    fn writes_to_read_only_export_are_rejected_with_perm(
        kind in prop::sample::select(vec![CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES]),
        offset in 0u64..(1 << 20),
        len in 1u32..(1 << 20),
    ) {
        let req = Request { flags: 0, kind, cookie: 0, offset, len: u64::from(len) };
        let exp = ExportView { size: 1 << 21, read_only: true, structured: true, extended: false, meta_context: true };
        let payload = if kind == CMD_WRITE { u64::from(len) } else { 0 };
        prop_assert_eq!(validate(&req, &exp), Err(Rejected { errno: NbdErrno::Perm, payload }));
    }

    #[test]
    fn oversized_read_or_write_in_range_is_rejected_with_overflow(
        kind in prop::sample::select(vec![CMD_READ, CMD_WRITE]),
        len in (MAX_PAYLOAD + 1)..=u32::MAX,
        offset in 0u64..(1 << 20),
    ) {
        let req = Request { flags: 0, kind, cookie: 0, offset, len: u64::from(len) };
        let exp = ExportView { size: 1 << 40, read_only: false, structured: false, extended: false, meta_context: false };
        let payload = if kind == CMD_WRITE { u64::from(len) } else { 0 };
        prop_assert_eq!(validate(&req, &exp), Err(Rejected { errno: NbdErrno::Overflow, payload }));
    }

    #[test]
    fn unknown_command_is_rejected_with_inval(
        kind in 8u16..,
        flags in any::<u16>(),
        offset in any::<u64>(),
        len in any::<u32>(),
        exp in arb_view(),
    ) {
        let req = Request { flags, kind, cookie: 0, offset, len: u64::from(len) };
        prop_assert_eq!(validate(&req, &exp), Err(Rejected { errno: NbdErrno::Inval, payload: 0 }));
    }

    // -----------------------------------------------------------------------
    // Option payloads

    #[test]
    fn info_request_round_trips(
        name in arb_name(),
        requests in proptest::collection::vec(any::<u16>(), 0..16),
    ) {
        let b = enc_info_request(&name, &requests);
        prop_assert_eq!(parse_info_request(&b), Ok(InfoRequest { name, requests }));
    }

    #[test]
    fn meta_context_request_round_trips(
        name in arb_name(),
        queries in proptest::collection::vec(arb_name(), 0..6),
    ) {
        let b = enc_meta_request(&name, &queries);
        prop_assert_eq!(parse_meta_context_request(&b), Ok(MetaContextRequest { name, queries }));
    }

    /// Arbitrary bytes: no panic, and anything accepted re-encodes to exactly the
    /// input (the parsers consume every byte and nothing else).
    #[test]
    fn option_payload_parsers_never_panic_on_arbitrary_bytes(
        b in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        if let Ok(r) = parse_info_request(&b) {
            prop_assert_eq!(enc_info_request(&r.name, &r.requests), b.clone());
        }
        if let Ok(r) = parse_meta_context_request(&b) {
            prop_assert!(r.queries.len() <= b.len() / 4);
            prop_assert_eq!(enc_meta_request(&r.name, &r.queries), b.clone());
        }
        let _ = parse_option_header(&b);
    }

    #[test]
    fn corrupted_info_request_never_panics_and_accepts_only_exact_encodings(
        name in arb_name(),
        requests in proptest::collection::vec(any::<u16>(), 0..8),
        c in arb_corruption(),
    ) {
        let b = corrupt(enc_info_request(&name, &requests), &c);
        if let Ok(r) = parse_info_request(&b) {
            prop_assert!(r.name.len() <= MAX_NAME_LEN);
            prop_assert!(r.requests.len() <= b.len() / 2);
            prop_assert_eq!(enc_info_request(&r.name, &r.requests), b);
        }
    }

    #[test]
    fn corrupted_meta_context_request_never_panics_and_accepts_only_exact_encodings(
        name in arb_name(),
        queries in proptest::collection::vec(arb_name(), 0..4),
        c in arb_corruption(),
    ) {
        let b = corrupt(enc_meta_request(&name, &queries), &c);
        if let Ok(r) = parse_meta_context_request(&b) {
            prop_assert!(r.name.len() <= MAX_NAME_LEN);
            prop_assert!(r.queries.len() <= b.len() / 4);
            prop_assert!(r.queries.iter().all(|q| q.len() <= MAX_NAME_LEN));
            prop_assert_eq!(enc_meta_request(&r.name, &r.queries), b);
        }
    }
}

#[test]
fn header_with_bad_magic_is_rejected() {
    let mut b = encode_request(&Request {
        flags: 0,
        kind: CMD_READ,
        cookie: 1,
        offset: 0,
        len: 512,
    });
    b[0] ^= 0x80;
    assert!(matches!(parse_request(&b), Err(WireError::BadMagic(_))));
}

#[test]
fn info_request_with_count_past_end_is_rejected() {
    let mut b = enc_info_request("", &[INFO_BLOCK_SIZE]);
    let at = b.len() - 4;
    b[at..at + 2].copy_from_slice(&0xffffu16.to_be_bytes());
    assert!(matches!(
        parse_info_request(&b),
        Err(WireError::Malformed(_))
    ));
}

#[test]
fn info_request_with_huge_name_length_is_rejected_without_reading_it() {
    let mut b = vec![0xff; 4];
    b.extend_from_slice(&[0, 0]);
    assert!(matches!(
        parse_info_request(&b),
        Err(WireError::TooLong {
            len: 0xffff_ffff,
            ..
        })
    ));
    let b = enc_info_request(&"n".repeat(MAX_NAME_LEN + 1), &[]);
    assert!(matches!(
        parse_info_request(&b),
        Err(WireError::TooLong { .. })
    ));
}

#[test]
fn meta_context_request_with_huge_query_count_is_rejected() {
    let mut b = enc_meta_request("", &[]);
    let at = b.len() - 4;
    b[at..].copy_from_slice(&0xffff_ffffu32.to_be_bytes());
    b.extend_from_slice(&[0, 0, 0, 0]);
    assert!(matches!(
        parse_meta_context_request(&b),
        Err(WireError::Malformed(_))
    ));
}

#[test]
fn meta_context_request_with_trailing_bytes_is_rejected() {
    let mut b = enc_meta_request("", &[BASE_ALLOCATION.to_string()]);
    b.push(0);
    assert!(parse_meta_context_request(&b).is_err());
}

#[test]
fn names_with_nul_or_invalid_utf8_are_rejected() {
    let b = enc_info_request("a\0b", &[]);
    assert_eq!(
        parse_info_request(&b),
        Err(WireError::Malformed("string contains NUL"))
    );
    let mut b = enc_info_request("ab", &[]);
    b[4] = 0xff;
    assert_eq!(
        parse_info_request(&b),
        Err(WireError::Malformed("string is not UTF-8"))
    );
}

#[test]
fn query_selection_of_base_allocation() {
    assert!(query_selects_base_allocation("base:allocation", false));
    assert!(query_selects_base_allocation("base:allocation", true));
    assert!(query_selects_base_allocation("base:", true));
    assert!(!query_selects_base_allocation("base:", false));
    assert!(!query_selects_base_allocation("qemu:dirty-bitmap:x", true));
}

#[test]
fn info_payloads_have_spec_layout() {
    let e = info_export(0x0102_0304_0506_0708, 0xabcd);
    assert_eq!(e, [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0xab, 0xcd]);
    let b = info_block_size(512, 4096, MAX_PAYLOAD);
    assert_eq!(&b[0..2], &INFO_BLOCK_SIZE.to_be_bytes());
    assert_eq!(be32_at(&b, 2), 512);
    assert_eq!(be32_at(&b, 6), 4096);
    assert_eq!(be32_at(&b, 10), MAX_PAYLOAD);
    assert_eq!(
        info_string(INFO_NAME, "disk"),
        [0, 1, b'd', b'i', b's', b'k']
    );
    assert_eq!(rep_meta_context(1, "base:allocation")[..4], [0, 0, 0, 1]);
}

mod ext;
mod replies;
