//! STARTTLS policy, identity-aware exports and extended headers, driven
//! sans-I/O: the tests feed the state machine and read what it leaves in `out`.

use super::*;

/// Hides `"second"` from clients whose certificate did not prove `"alice"`.
struct Gated(Arc<TestExports>);

impl Gated {
    fn allowed(name: &str, ids: &[String]) -> bool {
        name != "second" || ids.iter().any(|i| i == "alice")
    }
}

impl Exports for Gated {
    type Client = ();
    type Export = Arc<Device>;
    fn find(&self, name: &str, ids: &[String]) -> Option<Arc<Device>> {
        Gated::allowed(name, ids)
            .then(|| self.0.find(name, ids))
            .flatten()
    }
    fn join(&self, name: &str, ids: &[String]) -> Option<(Arc<Device>, ())> {
        self.find(name, ids).map(|d| (d, ()))
    }
    fn names(&self, ids: &[String]) -> Vec<String> {
        let all = self.0.names(ids);
        all.into_iter().filter(|n| Gated::allowed(n, ids)).collect()
    }
}

fn opt(option: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// A handshake past the client flags, its greeting taken out of `out`.
fn started(tls: TlsMode) -> Handshake {
    let mut h = Handshake::new(Policy { list: true, tls });
    h.out.clear();
    let flags = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES).to_be_bytes();
    let ex = exports();
    assert!(matches!(h.feed(&flags, &*ex), Ok(Step::More)));
    h
}

/// Feed `input` as the machine asks for it; the first step that is not
/// `More` (or `More` once the input is used up).
fn drive<E: Exports>(
    h: &mut Handshake,
    ex: &E,
    input: &[u8],
) -> Result<Step<E::Client, E::Export>, HandshakeError> {
    let mut at = 0;
    while at < input.len() {
        let n = h.want().min(input.len() - at);
        match h.feed(&input[at..at + n], ex)? {
            Step::More => at += n,
            step => {
                assert_eq!(at + n, input.len(), "bytes left after a final step");
                return Ok(step);
            }
        }
    }
    Ok(Step::More)
}

/// The option replies in `out` (option, reply type, payload), which is emptied.
fn replies(h: &mut Handshake) -> Vec<(u32, u32, Vec<u8>)> {
    let out = std::mem::take(&mut h.out);
    let mut v = Vec::new();
    let mut at = 0;
    while at < out.len() {
        assert_eq!(be64(&out, at), OPT_REPLY_MAGIC, "reply magic at {at}");
        let len = be32(&out, at + 16) as usize;
        v.push((
            be32(&out, at + 8),
            be32(&out, at + 12),
            out[at + 20..at + 20 + len].to_vec(),
        ));
        at += 20 + len;
    }
    v
}

fn kinds(h: &mut Handshake) -> Vec<(u32, u32)> {
    replies(h).into_iter().map(|(o, k, _)| (o, k)).collect()
}

/// GO on `name`; the outcome, with the replies checked to end in an ACK.
fn go<E: Exports>(h: &mut Handshake, ex: &E, name: &str) -> Negotiated<E::Client, E::Export> {
    let step = drive(h, ex, &opt(OPT_GO, &info_request(name, &[])));
    let Ok(Step::Done(Some(n))) = step else {
        panic!("GO did not enter transmission: {:?}", kinds(h));
    };
    assert_eq!(kinds(h).last(), Some(&(OPT_GO, REP_ACK)));
    n
}

#[test]
fn starttls_with_tls_off_is_refused_by_policy() {
    let ex = exports();
    let mut h = started(TlsMode::Off);
    assert!(matches!(
        drive(&mut h, &*ex, &opt(OPT_STARTTLS, &[])),
        Ok(Step::More)
    ));
    assert_eq!(kinds(&mut h), [(OPT_STARTTLS, REP_ERR_POLICY)]);
    let n = go(&mut h, &*ex, "");
    assert!(!n.tls && n.identities.is_empty());
}

#[test]
fn starttls_is_acked_then_forgets_what_was_negotiated_before() {
    let ex = exports();
    let mut h = started(TlsMode::On);
    let mut before = opt(OPT_STRUCTURED_REPLY, &[]);
    before.extend(opt(OPT_EXTENDED_HEADERS, &[]));
    before.extend(opt(
        OPT_SET_META_CONTEXT,
        &meta_request("", &[BASE_ALLOCATION]),
    ));
    assert!(matches!(drive(&mut h, &*ex, &before), Ok(Step::More)));
    let got = kinds(&mut h);
    assert_eq!(
        got[..2],
        [
            (OPT_STRUCTURED_REPLY, REP_ACK),
            (OPT_EXTENDED_HEADERS, REP_ACK)
        ]
    );
    assert_eq!(got.last(), Some(&(OPT_SET_META_CONTEXT, REP_ACK)));

    let step = drive(&mut h, &*ex, &opt(OPT_STARTTLS, &[]));
    assert!(matches!(step, Ok(Step::StartTls)));
    assert_eq!(kinds(&mut h), [(OPT_STARTTLS, REP_ACK)]);
    // Nothing may be fed until the driver says TLS is up.
    assert!(matches!(
        h.feed(&IHAVEOPT.to_be_bytes(), &*ex),
        Err(HandshakeError::TlsNotStarted)
    ));
    h.tls_started(vec!["alice".into()]);

    let n = go(&mut h, &*ex, "");
    assert!(n.tls);
    assert_eq!(n.identities, ["alice"]);
    assert!(
        !n.structured && !n.extended && !n.meta_context,
        "state survived STARTTLS"
    );
}

#[test]
fn starttls_twice_or_with_data_is_invalid() {
    let ex = exports();
    let mut h = started(TlsMode::On);
    assert!(matches!(
        drive(&mut h, &*ex, &opt(OPT_STARTTLS, b"x")),
        Ok(Step::More)
    ));
    assert_eq!(kinds(&mut h), [(OPT_STARTTLS, REP_ERR_INVALID)]);
    assert!(matches!(
        drive(&mut h, &*ex, &opt(OPT_STARTTLS, &[])),
        Ok(Step::StartTls)
    ));
    h.tls_started(Vec::new());
    h.out.clear();
    assert!(matches!(
        drive(&mut h, &*ex, &opt(OPT_STARTTLS, &[])),
        Ok(Step::More)
    ));
    assert_eq!(kinds(&mut h), [(OPT_STARTTLS, REP_ERR_INVALID)]);
    let n = go(&mut h, &*ex, "");
    assert!(n.tls && n.identities.is_empty());
}

#[test]
fn tls_on_lets_a_client_go_without_tls() {
    let ex = exports();
    let mut h = started(TlsMode::On);
    let n = go(&mut h, &*ex, "second");
    assert!(!n.tls);
}

#[test]
fn tls_required_refuses_every_option_but_starttls_and_abort() {
    let ex = exports();
    let mut h = started(TlsMode::Require);
    let refused = [
        (OPT_LIST, vec![]),
        (OPT_INFO, info_request("", &[])),
        (OPT_GO, info_request("", &[])),
        (OPT_STRUCTURED_REPLY, vec![]),
        (OPT_EXTENDED_HEADERS, vec![]),
        (OPT_LIST_META_CONTEXT, meta_request("", &[])),
        (OPT_SET_META_CONTEXT, meta_request("", &[BASE_ALLOCATION])),
        (99, vec![]),
    ];
    for (o, data) in &refused {
        assert!(matches!(
            drive(&mut h, &*ex, &opt(*o, data)),
            Ok(Step::More)
        ));
        assert_eq!(kinds(&mut h), [(*o, REP_ERR_TLS_REQD)], "option {o}");
    }
    // Once TLS is up, the same client gets its export.
    assert!(matches!(
        drive(&mut h, &*ex, &opt(OPT_STARTTLS, &[])),
        Ok(Step::StartTls)
    ));
    h.tls_started(Vec::new());
    h.out.clear();
    let n = go(&mut h, &*ex, "");
    assert!(n.tls);
}

#[test]
fn tls_required_acks_abort() {
    let ex = exports();
    let mut h = started(TlsMode::Require);
    assert!(matches!(
        drive(&mut h, &*ex, &opt(OPT_ABORT, &[])),
        Ok(Step::Done(None))
    ));
    assert_eq!(kinds(&mut h), [(OPT_ABORT, REP_ACK)]);
}

#[test]
fn tls_required_closes_on_export_name_without_tls() {
    let ex = exports();
    let mut h = started(TlsMode::Require);
    let r = drive(&mut h, &*ex, &opt(OPT_EXPORT_NAME, b""));
    assert!(matches!(r, Err(HandshakeError::TlsRequired)));
    assert!(h.out.is_empty(), "nothing may be sent: {:?}", h.out);
}

#[test]
fn exports_are_hidden_from_clients_without_the_identity() {
    let ex = Gated(exports());
    // bob: "second" is refused as if it did not exist, and not listed.
    let mut h = started(TlsMode::On);
    assert!(matches!(
        drive(&mut h, &ex, &opt(OPT_STARTTLS, &[])),
        Ok(Step::StartTls)
    ));
    h.tls_started(vec!["bob".into()]);
    h.out.clear();
    let mut input = opt(OPT_LIST, &[]);
    input.extend(opt(OPT_INFO, &info_request("second", &[])));
    input.extend(opt(OPT_GO, &info_request("second", &[])));
    input.extend(opt(OPT_STRUCTURED_REPLY, &[]));
    input.extend(opt(OPT_LIST_META_CONTEXT, &meta_request("second", &[])));
    assert!(matches!(drive(&mut h, &ex, &input), Ok(Step::More)));
    let got = replies(&mut h);
    let listed: Vec<_> = got
        .iter()
        .filter(|(o, k, _)| (*o, *k) == (OPT_LIST, REP_SERVER))
        .map(|(_, _, p)| p[4..].to_vec())
        .collect();
    assert_eq!(listed, [b"".to_vec()]);
    let k: Vec<_> = got.iter().map(|(o, k, _)| (*o, *k)).skip(2).collect();
    assert_eq!(
        k,
        [
            (OPT_INFO, REP_ERR_UNKNOWN),
            (OPT_GO, REP_ERR_UNKNOWN),
            (OPT_STRUCTURED_REPLY, REP_ACK),
            (OPT_LIST_META_CONTEXT, REP_ERR_UNKNOWN),
        ]
    );
    // Without TLS there is no identity either.
    let mut h = started(TlsMode::On);
    assert!(matches!(
        drive(&mut h, &ex, &opt(OPT_EXPORT_NAME, b"second")),
        Err(HandshakeError::UnknownExport(_))
    ));
    // alice gets it.
    let mut h = started(TlsMode::On);
    assert!(matches!(
        drive(&mut h, &ex, &opt(OPT_STARTTLS, &[])),
        Ok(Step::StartTls)
    ));
    h.tls_started(vec!["carol".into(), "alice".into()]);
    h.out.clear();
    let n = go(&mut h, &ex, "second");
    assert_eq!(n.dev.name, "second");
    assert_eq!(n.identities, ["carol", "alice"]);
}

#[test]
fn extended_headers_are_acked_and_imply_structured_replies() {
    let ex = exports();
    let mut h = started(TlsMode::Off);
    let mut input = opt(OPT_EXTENDED_HEADERS, &[]);
    // Meta contexts need structured replies: extended headers are enough.
    input.extend(opt(
        OPT_SET_META_CONTEXT,
        &meta_request("", &[BASE_ALLOCATION]),
    ));
    input.extend(opt(OPT_INFO, &info_request("", &[])));
    assert!(matches!(drive(&mut h, &*ex, &input), Ok(Step::More)));
    let got = replies(&mut h);
    assert_eq!((got[0].0, got[0].1), (OPT_EXTENDED_HEADERS, REP_ACK));
    assert_eq!(
        (got[1].0, got[1].1),
        (OPT_SET_META_CONTEXT, REP_META_CONTEXT)
    );
    let info = &got[3];
    assert_eq!((info.0, info.1), (OPT_INFO, REP_INFO));
    assert_ne!(
        be16(&info.2, 10) & TFLAG_SEND_DF,
        0,
        "DF needs structured replies"
    );
    let n = go(&mut h, &*ex, "");
    assert!(n.extended && n.structured && n.meta_context);
}

#[test]
fn structured_reply_after_extended_headers_is_refused_but_before_is_fine() {
    let ex = exports();
    let mut h = started(TlsMode::Off);
    let mut input = opt(OPT_STRUCTURED_REPLY, &[]);
    input.extend(opt(OPT_EXTENDED_HEADERS, &[]));
    input.extend(opt(OPT_STRUCTURED_REPLY, &[]));
    input.extend(opt(OPT_EXTENDED_HEADERS, &[]));
    input.extend(opt(OPT_EXTENDED_HEADERS, b"data"));
    assert!(matches!(drive(&mut h, &*ex, &input), Ok(Step::More)));
    assert_eq!(
        kinds(&mut h),
        [
            (OPT_STRUCTURED_REPLY, REP_ACK),
            (OPT_EXTENDED_HEADERS, REP_ACK),
            (OPT_STRUCTURED_REPLY, REP_ERR_EXT_HEADER_REQD),
            (OPT_EXTENDED_HEADERS, REP_ERR_INVALID),
            (OPT_EXTENDED_HEADERS, REP_ERR_INVALID),
        ]
    );
    let n = go(&mut h, &*ex, "");
    assert!(n.extended && n.structured);
}

#[test]
fn export_name_after_extended_headers_closes() {
    let ex = exports();
    let mut h = started(TlsMode::Off);
    let mut input = opt(OPT_EXTENDED_HEADERS, &[]);
    input.extend(opt(OPT_EXPORT_NAME, b""));
    let r = drive(&mut h, &*ex, &input);
    assert!(matches!(r, Err(HandshakeError::ExportNameExtended)));
}

#[test]
fn without_extended_headers_go_negotiates_compact_headers() {
    let ex = exports();
    let mut h = started(TlsMode::Off);
    assert!(matches!(
        drive(&mut h, &*ex, &opt(OPT_STRUCTURED_REPLY, &[])),
        Ok(Step::More)
    ));
    h.out.clear();
    let n = go(&mut h, &*ex, "");
    assert!(n.structured && !n.extended);
}

/// Issue 22, point 7: LIST (given or refused), an export the client may not
/// see and an option refused for want of TLS are left as notices for the
/// server to record: one per option, and one TLS refusal per connection.
#[test]
fn refusals_and_listings_leave_notices() {
    let ex = Gated(exports());
    let go = |name: &[u8]| {
        let mut d = u32::try_from(name.len()).unwrap().to_be_bytes().to_vec();
        d.extend_from_slice(name);
        d.extend_from_slice(&0u16.to_be_bytes());
        opt(OPT_GO, &d)
    };
    let mut h = started(TlsMode::Off);
    let mut input = opt(OPT_LIST, &[]);
    input.extend(go(b"second"));
    assert!(matches!(drive(&mut h, &ex, &input), Ok(Step::More)));
    assert_eq!(
        h.notices,
        vec![
            Notice::Listed(1),
            Notice::UnknownExport {
                option: OPT_GO,
                name: "\"second\"".into()
            }
        ]
    );

    let mut h = started(TlsMode::Require);
    let mut input = opt(OPT_LIST, &[]);
    input.extend(opt(OPT_STRUCTURED_REPLY, &[]));
    assert!(matches!(drive(&mut h, &ex, &input), Ok(Step::More)));
    assert_eq!(h.notices, vec![Notice::TlsRequired { option: OPT_LIST }]);

    let mut h = Handshake::new(Policy {
        list: false,
        tls: TlsMode::Off,
    });
    let mut input = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    input.extend(opt(OPT_LIST, &[]));
    assert!(matches!(drive(&mut h, &ex, &input), Ok(Step::More)));
    assert_eq!(h.notices, vec![Notice::ListRefused]);
}
