use super::*;
use crate::device::{CacheMode, DeviceParams};
use proptest::prelude::*;
use std::io::Cursor;
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::Duration;

/// Size of the test exports' backing files.
const SIZE: u64 = 1 << 20;

struct TestExports {
    devs: Vec<Arc<Device>>,
    /// Keeps the backing files alive for the test's duration.
    _dir: tempfile::TempDir,
}

impl Exports for TestExports {
    type Client = ();
    fn find(&self, name: &str, _ids: &[String]) -> Option<Arc<Device>> {
        self.devs.iter().find(|d| d.name == name).cloned()
    }
    fn join(&self, name: &str, ids: &[String]) -> Option<(Arc<Device>, ())> {
        self.find(name, ids).map(|d| (d, ()))
    }
    fn names(&self, _ids: &[String]) -> Vec<String> {
        self.devs.iter().map(|d| d.name.clone()).collect()
    }
}

/// Two buffered exports: the default (`""`) and `"second"` (read-only).
fn exports() -> Arc<TestExports> {
    let dir = tempfile::tempdir().unwrap();
    let mut devs = Vec::new();
    for (i, (name, read_only)) in [("", false), ("second", true)].into_iter().enumerate() {
        let path = dir.path().join(format!("disk{i}.img"));
        std::fs::File::create(&path).unwrap().set_len(SIZE).unwrap();
        let p = DeviceParams {
            path,
            name: name.to_string(),
            cache: CacheMode::Buffered,
            read_only,
            block_size: Some(512),
            ..DeviceParams::default()
        };
        devs.push(Arc::new(Device::open(&p).unwrap()));
    }
    Arc::new(TestExports { devs, _dir: dir })
}

type Outcome = Result<Option<Negotiated<()>>, HandshakeError>;

/// The client end of a handshake running on a server thread.
struct Client {
    s: UnixStream,
    server: Option<JoinHandle<(Outcome, UnixStream)>>,
}

impl Client {
    fn start(exports: &Arc<TestExports>) -> Client {
        let (c, s) = UnixStream::pair().unwrap();
        for x in [&c, &s] {
            x.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            x.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        }
        let ex = Arc::clone(exports);
        let server = std::thread::spawn(move || {
            let mut s = s;
            let r = negotiate(&mut s, &*ex);
            (r, s)
        });
        let mut c = Client {
            s: c,
            server: Some(server),
        };
        let mut hello = [0u8; 18];
        c.s.read_exact(&mut hello).unwrap();
        assert_eq!(&hello[0..8], &NBDMAGIC.to_be_bytes());
        assert_eq!(&hello[8..16], &IHAVEOPT.to_be_bytes());
        assert_eq!(
            u16::from_be_bytes([hello[16], hello[17]]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        c
    }

    /// Start and send the usual client flags.
    fn fixed(exports: &Arc<TestExports>) -> Client {
        let mut c = Client::start(exports);
        c.send(&(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES).to_be_bytes());
        c
    }

    fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).unwrap();
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        self.option_header(option, u32::try_from(data.len()).unwrap());
        self.send(data);
    }

    fn option_header(&mut self, option: u32, len: u32) {
        let mut h = Vec::with_capacity(16);
        h.extend_from_slice(&IHAVEOPT.to_be_bytes());
        h.extend_from_slice(&option.to_be_bytes());
        h.extend_from_slice(&len.to_be_bytes());
        self.send(&h);
    }

    /// Read one option reply: (option, reply type, payload).
    fn reply(&mut self) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(&h[0..8], &OPT_REPLY_MAGIC.to_be_bytes(), "reply magic");
        let option = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut payload = vec![0u8; len as usize];
        self.s.read_exact(&mut payload).unwrap();
        (option, kind, payload)
    }

    /// Expect a reply of `kind` to `option`, returning its payload.
    fn expect(&mut self, option: u32, kind: u32) -> Vec<u8> {
        let (o, k, p) = self.reply();
        assert_eq!(
            (o, k),
            (option, kind),
            "payload {:?}",
            String::from_utf8_lossy(&p)
        );
        p
    }

    /// Close the client's sending side and collect the server's outcome.
    fn finish(mut self) -> (Outcome, UnixStream) {
        let _ = self.s.shutdown(std::net::Shutdown::Write);
        self.server
            .take()
            .unwrap()
            .join()
            .expect("negotiate panicked")
    }
}

fn info_request(name: &str, requests: &[u16]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&u32::try_from(name.len()).unwrap().to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(&u16::try_from(requests.len()).unwrap().to_be_bytes());
    for r in requests {
        b.extend_from_slice(&r.to_be_bytes());
    }
    b
}

fn meta_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&u32::try_from(name.len()).unwrap().to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(&u32::try_from(queries.len()).unwrap().to_be_bytes());
    for q in queries {
        b.extend_from_slice(&u32::try_from(q.len()).unwrap().to_be_bytes());
        b.extend_from_slice(q.as_bytes());
    }
    b
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}
fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// Read the GO/INFO replies up to the ACK; returns the export size and flags.
fn expect_info_export(c: &mut Client, option: u32) -> (u64, u16) {
    let p = c.expect(option, REP_INFO);
    assert_eq!(p.len(), 12);
    assert_eq!(be16(&p, 0), INFO_EXPORT);
    (be64(&p, 2), be16(&p, 10))
}

fn expect_ended_cleanly(c: Client) {
    let (r, _) = c.finish();
    assert!(
        matches!(r, Ok(None)),
        "expected a clean end, got {:?}",
        r.err()
    );
}

#[test]
fn go_with_block_size_request_replies_export_info_block_size_and_ack() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(OPT_GO, &info_request("", &[INFO_BLOCK_SIZE]));
    let (size, flags) = expect_info_export(&mut c, OPT_GO);
    assert_eq!(size, SIZE);
    assert_ne!(flags & TFLAG_HAS_FLAGS, 0);
    assert_eq!(flags & TFLAG_READ_ONLY, 0);
    assert_ne!(flags & TFLAG_SEND_TRIM, 0);
    assert_eq!(flags & TFLAG_SEND_DF, 0, "DF needs structured replies");
    let p = c.expect(OPT_GO, REP_INFO);
    assert_eq!(p.len(), 14);
    assert_eq!(be16(&p, 0), INFO_BLOCK_SIZE);
    assert_eq!(
        (be32(&p, 2), be32(&p, 6), be32(&p, 10)),
        (1, 4096, MAX_PAYLOAD),
        "minimum 1: unaligned requests are served; the block size is preferred"
    );
    assert!(c.expect(OPT_GO, REP_ACK).is_empty());
    let (r, _) = c.finish();
    let n = r.unwrap().expect("GO negotiates");
    assert!(Arc::ptr_eq(&n.dev, &ex.devs[0]));
    assert!(!n.structured);
    assert!(!n.meta_context);
}

#[test]
fn go_leaves_the_transmission_bytes_after_it_unread() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    let mut b = Vec::new();
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    let data = info_request("", &[]);
    b.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
    b.extend_from_slice(&data);
    let tail = b"first request header follows";
    b.extend_from_slice(tail);
    c.send(&b);
    expect_info_export(&mut c, OPT_GO);
    c.expect(OPT_GO, REP_ACK);
    let (r, mut s) = c.finish();
    assert!(r.unwrap().is_some());
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert_eq!(rest, tail);
}

#[test]
fn info_with_name_and_description_requests_then_go_to_second_export() {
    // The description is not answered: it would reveal where the image lives.
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(
        OPT_INFO,
        &info_request("second", &[INFO_NAME, INFO_DESCRIPTION, 0x7777]),
    );
    let (_, flags) = expect_info_export(&mut c, OPT_INFO);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(flags & TFLAG_SEND_TRIM, 0);
    let p = c.expect(OPT_INFO, REP_INFO);
    assert_eq!(be16(&p, 0), INFO_NAME);
    assert_eq!(&p[2..], b"second");
    // No INFO_DESCRIPTION reply; the unknown info type 0x7777 is ignored.
    c.expect(OPT_INFO, REP_ACK);
    // INFO does not end the handshake.
    c.option(OPT_GO, &info_request("second", &[]));
    expect_info_export(&mut c, OPT_GO);
    c.expect(OPT_GO, REP_ACK);
    let (r, _) = c.finish();
    assert!(Arc::ptr_eq(&r.unwrap().unwrap().dev, &ex.devs[1]));
}

#[test]
fn unknown_export_gets_err_unknown_and_handshake_continues() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(OPT_GO, &info_request("nope", &[]));
    c.expect(OPT_GO, REP_ERR_UNKNOWN);
    c.option(OPT_INFO, &info_request("nope", &[]));
    c.expect(OPT_INFO, REP_ERR_UNKNOWN);
    c.option(OPT_GO, &info_request("", &[]));
    expect_info_export(&mut c, OPT_GO);
    c.expect(OPT_GO, REP_ACK);
    assert!(c.finish().0.unwrap().is_some());
}

#[test]
fn malformed_go_payload_gets_err_invalid_and_handshake_continues() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    let mut bad = info_request("", &[INFO_BLOCK_SIZE]);
    bad.pop();
    c.option(OPT_GO, &bad);
    c.expect(OPT_GO, REP_ERR_INVALID);
    c.option(OPT_ABORT, &[]);
    c.expect(OPT_ABORT, REP_ACK);
    expect_ended_cleanly(c);
}

#[test]
fn unknown_option_gets_err_unsup_and_handshake_continues() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(99, b"whatever");
    c.expect(99, REP_ERR_UNSUP);
    // TLS is off by default: refused by policy, and the handshake goes on.
    c.option(OPT_STARTTLS, &[]);
    c.expect(OPT_STARTTLS, REP_ERR_POLICY);
    c.option(OPT_GO, &info_request("", &[]));
    expect_info_export(&mut c, OPT_GO);
    c.expect(OPT_GO, REP_ACK);
    assert!(c.finish().0.unwrap().is_some());
}

#[test]
fn list_replies_one_server_per_export_then_ack() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (o, k, p) = c.reply();
        assert_eq!(o, OPT_LIST);
        if k == REP_ACK {
            break;
        }
        assert_eq!(k, REP_SERVER);
        let n = be32(&p, 0) as usize;
        assert_eq!(p.len(), 4 + n);
        names.push(String::from_utf8(p[4..].to_vec()).unwrap());
    }
    assert_eq!(names, ["", "second"]);
    c.option(OPT_LIST, b"x");
    c.expect(OPT_LIST, REP_ERR_INVALID);
    expect_ended_cleanly(c);
}

#[test]
fn abort_is_acked_and_ends_the_handshake_cleanly() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(OPT_ABORT, &[]);
    c.expect(OPT_ABORT, REP_ACK);
    expect_ended_cleanly(c);
}

#[test]
fn close_between_options_ends_the_handshake_cleanly() {
    let ex = exports();
    let c = Client::fixed(&ex);
    expect_ended_cleanly(c);
}

#[test]
fn set_meta_context_before_structured_reply_is_invalid() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(OPT_SET_META_CONTEXT, &meta_request("", &[BASE_ALLOCATION]));
    c.expect(OPT_SET_META_CONTEXT, REP_ERR_INVALID);
    c.option(OPT_LIST_META_CONTEXT, &meta_request("", &[]));
    c.expect(OPT_LIST_META_CONTEXT, REP_ERR_INVALID);
    c.option(OPT_GO, &info_request("", &[]));
    expect_info_export(&mut c, OPT_GO);
    c.expect(OPT_GO, REP_ACK);
    let n = c.finish().0.unwrap().unwrap();
    assert!(!n.structured && !n.meta_context);
}

#[test]
fn set_meta_context_after_structured_reply_selects_base_allocation_as_id_1() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(OPT_STRUCTURED_REPLY, &[]);
    c.expect(OPT_STRUCTURED_REPLY, REP_ACK);
    c.option(
        OPT_SET_META_CONTEXT,
        &meta_request("", &["qemu:dirty-bitmap:x", BASE_ALLOCATION]),
    );
    let p = c.expect(OPT_SET_META_CONTEXT, REP_META_CONTEXT);
    assert_eq!(be32(&p, 0), 1);
    assert_eq!(&p[4..], BASE_ALLOCATION.as_bytes());
    c.expect(OPT_SET_META_CONTEXT, REP_ACK);
    c.option(OPT_GO, &info_request("", &[]));
    let (_, flags) = expect_info_export(&mut c, OPT_GO);
    assert_ne!(flags & TFLAG_SEND_DF, 0);
    c.expect(OPT_GO, REP_ACK);
    let n = c.finish().0.unwrap().unwrap();
    assert!(n.structured && n.meta_context);
}

#[test]
fn list_meta_context_with_no_queries_lists_base_allocation_without_selecting_it() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(OPT_STRUCTURED_REPLY, &[]);
    c.expect(OPT_STRUCTURED_REPLY, REP_ACK);
    c.option(OPT_LIST_META_CONTEXT, &meta_request("", &[]));
    let p = c.expect(OPT_LIST_META_CONTEXT, REP_META_CONTEXT);
    assert_eq!(&p[4..], BASE_ALLOCATION.as_bytes());
    c.expect(OPT_LIST_META_CONTEXT, REP_ACK);
    // A SET that selects nothing: no context reply, just the ACK.
    c.option(OPT_SET_META_CONTEXT, &meta_request("", &["base:"]));
    c.expect(OPT_SET_META_CONTEXT, REP_ACK);
    c.option(
        OPT_SET_META_CONTEXT,
        &meta_request("nope", &[BASE_ALLOCATION]),
    );
    c.expect(OPT_SET_META_CONTEXT, REP_ERR_UNKNOWN);
    c.option(OPT_GO, &info_request("", &[]));
    expect_info_export(&mut c, OPT_GO);
    c.expect(OPT_GO, REP_ACK);
    let n = c.finish().0.unwrap().unwrap();
    assert!(n.structured && !n.meta_context);
}

#[test]
fn option_longer_than_64k_gets_err_too_big_and_handshake_continues() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    let len = MAX_OPTION_LEN + 1;
    c.option_header(OPT_GO, len);
    c.send(&vec![0x5a; len as usize]);
    c.expect(OPT_GO, REP_ERR_TOO_BIG);
    c.option(OPT_GO, &info_request("", &[]));
    expect_info_export(&mut c, OPT_GO);
    c.expect(OPT_GO, REP_ACK);
    assert!(c.finish().0.unwrap().is_some());
}

#[test]
fn bad_client_flags_are_an_error() {
    let ex = exports();
    let mut c = Client::start(&ex);
    c.send(&(CLIENT_FLAG_FIXED_NEWSTYLE | 1 << 7).to_be_bytes());
    let (r, _) = c.finish();
    assert!(
        matches!(r, Err(HandshakeError::ClientFlags(0x81))),
        "{:?}",
        r.err()
    );
}

#[test]
fn client_closing_mid_option_is_an_error() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option_header(OPT_GO, 100);
    c.send(&[0u8; 10]);
    let (r, _) = c.finish();
    assert!(
        matches!(r, Err(HandshakeError::Truncated)),
        "expected a truncation error, got {:?}",
        r.err()
    );
}

#[test]
fn client_closing_mid_too_big_option_is_an_error() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option_header(99, u32::MAX);
    c.send(&[0u8; 5000]);
    let (r, _) = c.finish();
    assert!(matches!(r, Err(HandshakeError::Truncated)), "{:?}", r.err());
}

#[test]
fn bad_option_magic_is_an_error() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.send(&[0u8; 16]);
    let (r, _) = c.finish();
    assert!(
        matches!(r, Err(HandshakeError::Wire(WireError::BadMagic(0)))),
        "{:?}",
        r.err()
    );
}

#[test]
fn export_name_sends_size_and_flags_with_or_without_zeroes() {
    for (client_flags, reply_len) in [
        (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES, 10),
        (CLIENT_FLAG_FIXED_NEWSTYLE, 134),
    ] {
        let ex = exports();
        let mut c = Client::start(&ex);
        c.send(&client_flags.to_be_bytes());
        c.option(OPT_EXPORT_NAME, b"second");
        let (r, _) = {
            let mut b = vec![0u8; reply_len];
            c.s.read_exact(&mut b).unwrap();
            assert_eq!(be64(&b, 0), SIZE);
            assert_ne!(be16(&b, 8) & TFLAG_READ_ONLY, 0);
            assert!(b[10..].iter().all(|&x| x == 0));
            c.finish()
        };
        assert!(Arc::ptr_eq(&r.unwrap().unwrap().dev, &ex.devs[1]));
    }
}

#[test]
fn export_name_for_unknown_export_is_an_error() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    c.option(OPT_EXPORT_NAME, b"nope");
    let (r, _) = c.finish();
    assert!(
        matches!(r, Err(HandshakeError::UnknownExport(ref n)) if n == "\"nope\""),
        "{:?}",
        r.err()
    );
}

/// Issue 22, point 8: a failed `NBD_OPT_EXPORT_NAME` with a long name that
/// forges a line says a bounded, escaped amount (not 328 KB per connection).
#[test]
fn an_unknown_export_error_shows_a_cut_escaped_name() {
    let ex = exports();
    let mut c = Client::fixed(&ex);
    let mut name = b"x\naudit: detach \"prod\" by uid=0: ok\n".to_vec();
    name.resize(60_000, b'a');
    c.option(OPT_EXPORT_NAME, &name);
    let (r, _) = c.finish();
    let Err(e @ HandshakeError::UnknownExport(_)) = r else {
        panic!("{:?}", r.err());
    };
    let line = e.to_string();
    assert!(line.len() < 300, "{} bytes: {line}", line.len());
    assert!(!line.contains('\n'), "{line}");
    assert!(line.contains("(60000 bytes)"), "{line}");
}

#[test]
fn list_is_refused_by_policy() {
    let ex = exports();
    let mut h = Handshake::new(Policy {
        list: false,
        ..Policy::default()
    });
    let mut input = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    input.extend_from_slice(&IHAVEOPT.to_be_bytes());
    input.extend_from_slice(&OPT_LIST.to_be_bytes());
    input.extend_from_slice(&0u32.to_be_bytes());
    h.out.clear();
    let mut at = 0;
    while at < input.len() {
        let n = h.want().min(input.len() - at);
        assert!(matches!(h.feed(&input[at..at + n], &*ex), Ok(Step::More)));
        at += n;
    }
    // One reply: the policy error, no names.
    assert_eq!(be32(&h.out, 12), REP_ERR_POLICY);
    assert_eq!(h.out.len(), 20 + be32(&h.out, 16) as usize);
}

mod arbitrary;
mod tls_ext;
