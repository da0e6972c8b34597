//! Netlink and generic-netlink messages as bytes: a builder for requests and a
//! parser for replies. Pure functions over byte slices; nothing here does I/O.
//!
//! Layout (linux/netlink.h, linux/genetlink.h), all integers in host byte
//! order: a 16-byte `nlmsghdr` (len, type, flags, seq, pid), for generic
//! netlink a 4-byte `genlmsghdr` (cmd, version, reserved), then attributes,
//! each a 4-byte `nlattr` (len, type) and its payload padded to 4 bytes.
//! `NLMSG_ERROR` carries the negative errno (0 is an ACK), the request's
//! header (only the header: the socket sets `NETLINK_CAP_ACK`) and, with
//! `NLM_F_ACK_TLVS`, extended-ack attributes such as the kernel's message.
//!
//! The parser trusts nothing: every length is checked against what is left
//! before it is used, and nothing is allocated from a length in the input
//! except the vectors of what was actually found.

use thiserror::Error;

pub const NLMSG_HDR_LEN: usize = 16;
pub const GENL_HDR_LEN: usize = 4;
const NLA_HDR_LEN: usize = 4;

pub const NLMSG_NOOP: u16 = 1;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLMSG_OVERRUN: u16 = 4;

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
/// In an `NLMSG_ERROR`: the request was cut to its header.
pub const NLM_F_CAPPED: u16 = 0x100;
/// In an `NLMSG_ERROR`: extended-ack attributes follow the request.
pub const NLM_F_ACK_TLVS: u16 = 0x200;

pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_F_NET_BYTEORDER: u16 = 0x4000;
const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

/// `NLMSGERR_ATTR_MSG`: the kernel's error message, a NUL-terminated string.
pub const NLMSGERR_ATTR_MSG: u16 = 1;

/// The generic-netlink controller (linux/genetlink.h).
pub const GENL_ID_CTRL: u16 = 0x10;
pub const CTRL_CMD_GETFAMILY: u8 = 3;
pub const CTRL_ATTR_FAMILY_ID: u16 = 1;
pub const CTRL_ATTR_FAMILY_NAME: u16 = 2;
pub const CTRL_ATTR_MCAST_GROUPS: u16 = 7;
pub const CTRL_ATTR_MCAST_GRP_NAME: u16 = 1;
pub const CTRL_ATTR_MCAST_GRP_ID: u16 = 2;

/// Longest message the builder makes (far above what loopd sends).
pub const MAX_REQUEST: usize = 64 * 1024;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum MsgError {
    #[error("netlink message header cut short: {left} bytes left, a header needs 16")]
    ShortHeader { left: usize },
    #[error("netlink message length {len} is outside 16..={left} (the bytes left)")]
    BadMessageLength { len: u32, left: usize },
    #[error("generic netlink message of {len} bytes has no room for its 4-byte header")]
    ShortGenl { len: usize },
    #[error("NLMSG_ERROR of {len} bytes has no room for its errno")]
    ShortError { len: usize },
    #[error("NLMSG_ERROR carries a positive error {0}")]
    PositiveError(i32),
    #[error("attribute header cut short: {left} bytes left")]
    ShortAttr { left: usize },
    #[error("attribute {ty} length {len} is outside 4..={left} (the bytes left)")]
    BadAttrLength { ty: u16, len: u16, left: usize },
    #[error("attribute {ty} has {got} bytes, its type needs {want}")]
    AttrSize { ty: u16, got: usize, want: usize },
    #[error("attribute {ty} is not a NUL-terminated UTF-8 string")]
    BadString { ty: u16 },
    #[error("reply has no attribute {ty}")]
    Missing { ty: u16 },
    #[error("request would be longer than {MAX_REQUEST} bytes")]
    TooLong,
}

fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

fn ne_u16(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn ne_u32(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Builds one generic-netlink request. Attribute and nest lengths are
/// checked once, in [`MsgBuilder::finish`].
#[derive(Debug)]
pub struct MsgBuilder {
    buf: Vec<u8>,
    open: Vec<usize>,
    too_long: bool,
}

impl MsgBuilder {
    /// A request of `msg_type` (the family id) carrying generic-netlink `cmd`.
    pub fn genl(msg_type: u16, flags: u16, seq: u32, cmd: u8, version: u8) -> MsgBuilder {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set by finish
        buf.extend_from_slice(&msg_type.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
        buf.extend_from_slice(&[cmd, version, 0, 0]);
        MsgBuilder {
            buf,
            open: Vec::new(),
            too_long: false,
        }
    }

    fn put(&mut self, ty: u16, payload: &[u8]) {
        let len = NLA_HDR_LEN + payload.len();
        let Ok(len16) = u16::try_from(len) else {
            self.too_long = true;
            return;
        };
        self.buf.extend_from_slice(&len16.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.buf.resize(align4(self.buf.len()), 0);
        if self.buf.len() > MAX_REQUEST {
            self.too_long = true;
        }
    }

    pub fn u8(&mut self, ty: u16, v: u8) -> &mut Self {
        self.put(ty, &[v]);
        self
    }

    pub fn u16(&mut self, ty: u16, v: u16) -> &mut Self {
        self.put(ty, &v.to_ne_bytes());
        self
    }

    pub fn u32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.put(ty, &v.to_ne_bytes());
        self
    }

    pub fn u64(&mut self, ty: u16, v: u64) -> &mut Self {
        self.put(ty, &v.to_ne_bytes());
        self
    }

    /// A NUL-terminated string (`NLA_STRING`/`NLA_NUL_STRING` both accept it).
    pub fn str(&mut self, ty: u16, s: &str) -> &mut Self {
        let mut b = Vec::with_capacity(s.len() + 1);
        b.extend_from_slice(s.as_bytes());
        b.push(0);
        self.put(ty, &b);
        self
    }

    /// Opens a nested attribute; attributes until the matching
    /// [`MsgBuilder::end_nested`] go inside it.
    pub fn begin_nested(&mut self, ty: u16) -> &mut Self {
        self.open.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub fn end_nested(&mut self) -> &mut Self {
        if let Some(at) = self.open.pop() {
            match u16::try_from(self.buf.len() - at) {
                Ok(len) => self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes()),
                Err(_) => self.too_long = true,
            }
        }
        self
    }

    /// The finished message. Nests still open are closed.
    pub fn finish(mut self) -> Result<Vec<u8>, MsgError> {
        while !self.open.is_empty() {
            self.end_nested();
        }
        if self.too_long || self.buf.len() > MAX_REQUEST {
            return Err(MsgError::TooLong);
        }
        let len = u32::try_from(self.buf.len()).map_err(|_| MsgError::TooLong)?;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        Ok(self.buf)
    }
}

/// One attribute: its type without the flag bits, and its payload (padding
/// not included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    pub ty: u16,
    pub nested: bool,
    pub payload: &'a [u8],
}

impl<'a> Attr<'a> {
    fn exact<const N: usize>(&self) -> Result<[u8; N], MsgError> {
        self.payload.try_into().map_err(|_| MsgError::AttrSize {
            ty: self.ty,
            got: self.payload.len(),
            want: N,
        })
    }

    pub fn u8(&self) -> Result<u8, MsgError> {
        Ok(self.exact::<1>()?[0])
    }

    pub fn u16(&self) -> Result<u16, MsgError> {
        Ok(u16::from_ne_bytes(self.exact()?))
    }

    pub fn u32(&self) -> Result<u32, MsgError> {
        Ok(u32::from_ne_bytes(self.exact()?))
    }

    pub fn u64(&self) -> Result<u64, MsgError> {
        Ok(u64::from_ne_bytes(self.exact()?))
    }

    /// A string up to its first NUL (which must be there).
    pub fn str(&self) -> Result<&'a str, MsgError> {
        let bad = MsgError::BadString { ty: self.ty };
        let end = self.payload.iter().position(|&b| b == 0).ok_or(bad)?;
        std::str::from_utf8(&self.payload[..end]).map_err(|_| MsgError::BadString { ty: self.ty })
    }
}

/// Every attribute in `buf`, in order; the first malformed one is an error.
pub fn parse_attrs(buf: &[u8]) -> Result<Vec<Attr<'_>>, MsgError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let left = buf.len() - at;
        if left < NLA_HDR_LEN {
            return Err(MsgError::ShortAttr { left });
        }
        let len = ne_u16(buf, at);
        let raw_ty = ne_u16(buf, at + 2);
        let ty = raw_ty & NLA_TYPE_MASK;
        if usize::from(len) < NLA_HDR_LEN || usize::from(len) > left {
            return Err(MsgError::BadAttrLength { ty, len, left });
        }
        out.push(Attr {
            ty,
            nested: raw_ty & NLA_F_NESTED != 0,
            payload: &buf[at + NLA_HDR_LEN..at + usize::from(len)],
        });
        at = at.saturating_add(align4(usize::from(len))).min(buf.len());
    }
    Ok(out)
}

/// The first attribute of type `ty`, if any.
pub fn find<'a>(attrs: &[Attr<'a>], ty: u16) -> Option<Attr<'a>> {
    attrs.iter().copied().find(|a| a.ty == ty)
}

/// One message of a reply datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message<'a> {
    /// `NLMSG_ERROR` with error 0: the request succeeded.
    Ack { seq: u32 },
    /// `NLMSG_ERROR`: the request failed with `errno` (positive), and the
    /// kernel's extended-ack message if it sent one.
    Error {
        seq: u32,
        errno: i32,
        message: Option<String>,
    },
    /// End of a multi-part reply.
    Done { seq: u32 },
    /// A generic-netlink message: its type (the family id), command and the
    /// bytes of its attributes.
    Genl {
        seq: u32,
        msg_type: u16,
        cmd: u8,
        attrs: &'a [u8],
    },
    /// `NLMSG_NOOP`, `NLMSG_OVERRUN` or a type this parser does not know.
    Other { seq: u32, msg_type: u16 },
}

impl Message<'_> {
    pub fn seq(&self) -> u32 {
        match self {
            Message::Ack { seq }
            | Message::Error { seq, .. }
            | Message::Done { seq }
            | Message::Genl { seq, .. }
            | Message::Other { seq, .. } => *seq,
        }
    }
}

/// Every message in one datagram read from a netlink socket.
pub fn parse_datagram(buf: &[u8]) -> Result<Vec<Message<'_>>, MsgError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let left = buf.len() - at;
        if left < NLMSG_HDR_LEN {
            return Err(MsgError::ShortHeader { left });
        }
        let len32 = ne_u32(buf, at);
        let len = usize::try_from(len32).unwrap_or(usize::MAX);
        if len < NLMSG_HDR_LEN || len > left {
            return Err(MsgError::BadMessageLength { len: len32, left });
        }
        let msg_type = ne_u16(buf, at + 4);
        let flags = ne_u16(buf, at + 6);
        let seq = ne_u32(buf, at + 8);
        let body = &buf[at + NLMSG_HDR_LEN..at + len];
        out.push(parse_one(msg_type, flags, seq, body)?);
        at = at.saturating_add(align4(len)).min(buf.len());
    }
    Ok(out)
}

fn parse_one(msg_type: u16, flags: u16, seq: u32, body: &[u8]) -> Result<Message<'_>, MsgError> {
    Ok(match msg_type {
        NLMSG_ERROR => parse_error(flags, seq, body)?,
        NLMSG_DONE => Message::Done { seq },
        NLMSG_NOOP | NLMSG_OVERRUN => Message::Other { seq, msg_type },
        t if t < GENL_ID_CTRL => Message::Other { seq, msg_type },
        _ => {
            if body.len() < GENL_HDR_LEN {
                return Err(MsgError::ShortGenl { len: body.len() });
            }
            Message::Genl {
                seq,
                msg_type,
                cmd: body[0],
                attrs: &body[GENL_HDR_LEN..],
            }
        }
    })
}

fn parse_error(flags: u16, seq: u32, body: &[u8]) -> Result<Message<'_>, MsgError> {
    if body.len() < 4 {
        return Err(MsgError::ShortError { len: body.len() });
    }
    let error = i32::from_ne_bytes([body[0], body[1], body[2], body[3]]);
    if error == 0 {
        return Ok(Message::Ack { seq });
    }
    let errno = error
        .checked_neg()
        .filter(|e| *e > 0)
        .ok_or(MsgError::PositiveError(error))?;
    // The kernel's message, if there is one: after the echoed request (its
    // header alone when capped). A malformed tail loses the message, never
    // the errno.
    let message = if flags & NLM_F_ACK_TLVS != 0 {
        ext_ack_message(&body[4..], flags & NLM_F_CAPPED != 0)
    } else {
        None
    };
    Ok(Message::Error {
        seq,
        errno,
        message,
    })
}

/// The kernel's extended-ack message in what follows the errno: the echoed
/// request (its header alone when `capped`), then attributes.
fn ext_ack_message(orig: &[u8], capped: bool) -> Option<String> {
    if orig.len() < NLMSG_HDR_LEN {
        return None;
    }
    let echoed = if capped {
        NLMSG_HDR_LEN
    } else {
        usize::try_from(ne_u32(orig, 0)).ok()?
    };
    let attrs = parse_attrs(orig.get(align4(echoed)..)?).ok()?;
    let m = find(&attrs, NLMSGERR_ATTR_MSG)?;
    m.str().ok().map(str::to_string)
}

/// The messages that answer one request: collects its data messages until its
/// ACK or error arrives. Messages for other sequence numbers are ignored.
#[derive(Debug, Default)]
pub struct Transaction {
    pub seq: u32,
    /// Attribute bytes of each generic-netlink reply of this family, in order.
    pub replies: Vec<(u8, Vec<u8>)>,
    /// `Some` once the request is answered: `Ok` for an ACK, else the errno
    /// and the kernel's message.
    pub outcome: Option<Result<(), (i32, Option<String>)>>,
    family: u16,
}

impl Transaction {
    pub fn new(family: u16, seq: u32) -> Transaction {
        Transaction {
            seq,
            family,
            ..Transaction::default()
        }
    }

    /// Takes in one datagram. Returns whether the request is answered.
    pub fn feed(&mut self, datagram: &[u8]) -> Result<bool, MsgError> {
        for m in parse_datagram(datagram)? {
            if m.seq() != self.seq || self.outcome.is_some() {
                continue;
            }
            match m {
                Message::Ack { .. } | Message::Done { .. } => self.outcome = Some(Ok(())),
                Message::Error { errno, message, .. } => self.outcome = Some(Err((errno, message))),
                Message::Genl {
                    msg_type,
                    cmd,
                    attrs,
                    ..
                } if msg_type == self.family => {
                    if self.replies.len() < 64 {
                        self.replies.push((cmd, attrs.to_vec()));
                    }
                }
                Message::Genl { .. } | Message::Other { .. } => {}
            }
        }
        Ok(self.outcome.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An `NLMSG_ERROR` as the kernel sends it with `NETLINK_CAP_ACK` and
    /// `NETLINK_EXT_ACK`: errno, the request's header, then a message.
    fn error_msg(seq: u32, error: i32, text: Option<&str>, capped: bool) -> Vec<u8> {
        let mut body = error.to_ne_bytes().to_vec();
        // The echoed request: a header claiming 24 bytes, and (uncapped) its body.
        let mut orig = MsgBuilder::genl(0x20, NLM_F_REQUEST, seq, 1, 1);
        orig.u32(1, 7);
        let orig = orig.finish().unwrap();
        if capped {
            body.extend_from_slice(&orig[..NLMSG_HDR_LEN]);
        } else {
            body.extend_from_slice(&orig);
        }
        let mut flags = if capped { NLM_F_CAPPED } else { 0 };
        if let Some(t) = text {
            flags |= NLM_F_ACK_TLVS;
            let mut s = t.as_bytes().to_vec();
            s.push(0);
            let len = u16::try_from(4 + s.len()).unwrap();
            body.extend_from_slice(&len.to_ne_bytes());
            body.extend_from_slice(&NLMSGERR_ATTR_MSG.to_ne_bytes());
            body.extend_from_slice(&s);
            body.resize(align4(body.len()), 0);
        }
        let mut m = u32::try_from(NLMSG_HDR_LEN + body.len())
            .unwrap()
            .to_ne_bytes()
            .to_vec();
        m.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&body);
        m
    }

    #[derive(Debug, Clone)]
    enum Val {
        U8(u8),
        U16(u16),
        U32(u32),
        U64(u64),
        Str(String),
    }

    fn val() -> impl Strategy<Value = (u16, Val)> {
        (
            1u16..0x3fff,
            prop_oneof![
                any::<u8>().prop_map(Val::U8),
                any::<u16>().prop_map(Val::U16),
                any::<u32>().prop_map(Val::U32),
                any::<u64>().prop_map(Val::U64),
                "[a-z0-9/._-]{0,40}".prop_map(Val::Str),
            ],
        )
    }

    fn put(b: &mut MsgBuilder, ty: u16, v: &Val) {
        match v {
            Val::U8(x) => b.u8(ty, *x),
            Val::U16(x) => b.u16(ty, *x),
            Val::U32(x) => b.u32(ty, *x),
            Val::U64(x) => b.u64(ty, *x),
            Val::Str(s) => b.str(ty, s),
        };
    }

    fn check(a: &Attr<'_>, ty: u16, v: &Val) {
        assert_eq!(a.ty, ty);
        match v {
            Val::U8(x) => assert_eq!(a.u8().unwrap(), *x),
            Val::U16(x) => assert_eq!(a.u16().unwrap(), *x),
            Val::U32(x) => assert_eq!(a.u32().unwrap(), *x),
            Val::U64(x) => assert_eq!(a.u64().unwrap(), *x),
            Val::Str(s) => assert_eq!(a.str().unwrap(), s),
        }
    }

    proptest! {
        /// What the builder writes, the parser reads back: header fields,
        /// flat attributes and one nest of attributes.
        #[test]
        fn built_message_parses_back(
            family in 0x10u16..0xffff, seq: u32, cmd: u8,
            flat in proptest::collection::vec(val(), 0..8),
            nest_ty in 1u16..100,
            inner in proptest::collection::vec(val(), 0..8),
        ) {
            let mut b = MsgBuilder::genl(family, NLM_F_REQUEST, seq, cmd, 1);
            for (t, v) in &flat { put(&mut b, *t, v); }
            b.begin_nested(nest_ty);
            for (t, v) in &inner { put(&mut b, *t, v); }
            b.end_nested();
            let bytes = b.finish().unwrap();
            prop_assert_eq!(bytes.len() % 4, 0);
            let msgs = parse_datagram(&bytes).unwrap();
            prop_assert_eq!(msgs.len(), 1);
            let Message::Genl { seq: s, msg_type, cmd: c, attrs } = &msgs[0] else {
                panic!("not a genl message: {:?}", msgs[0]);
            };
            prop_assert_eq!((*s, *msg_type, *c), (seq, family, cmd));
            let attrs = parse_attrs(attrs).unwrap();
            prop_assert_eq!(attrs.len(), flat.len() + 1);
            for (a, (t, v)) in attrs.iter().zip(&flat) { check(a, *t, v); }
            let nest = attrs[flat.len()];
            prop_assert!(nest.nested);
            prop_assert_eq!(nest.ty, nest_ty);
            let got = parse_attrs(nest.payload).unwrap();
            prop_assert_eq!(got.len(), inner.len());
            for (a, (t, v)) in got.iter().zip(&inner) { check(a, *t, v); }
        }

        /// Arbitrary bytes never panic the parser, and every attribute slice
        /// it returns lies inside the input.
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(msgs) = parse_datagram(&data) {
                for m in msgs {
                    if let Message::Genl { attrs, .. } = m {
                        prop_assert!(attrs.len() <= data.len());
                        let _ = parse_attrs(attrs);
                    }
                }
            }
            let _ = parse_attrs(&data);
            let mut t = Transaction::new(0x20, 1);
            let _ = t.feed(&data);
        }

        /// Every strict prefix of a well-formed datagram of two messages is
        /// either the first message alone or an error, never a panic.
        #[test]
        fn truncated_datagram_is_an_error_or_a_whole_message(cut in 0usize..200) {
            let mut b = MsgBuilder::genl(0x20, 0, 9, 5, 1);
            b.u32(1, 3).str(10, "backend");
            let mut d = b.finish().unwrap();
            let first = d.len();
            d.extend_from_slice(&error_msg(9, 0, None, true));
            let cut = cut.min(d.len() - 1);
            match parse_datagram(&d[..cut]) {
                Ok(msgs) => prop_assert!(cut == 0 && msgs.is_empty() || cut == first && msgs.len() == 1),
                Err(_) => prop_assert!(cut != 0 && cut != first),
            }
        }

        /// The errno and the kernel's message come back from any error,
        /// capped or with the whole request echoed.
        #[test]
        fn error_carries_errno_and_message(errno in 1i32..4096, text in "[ -~]{0,60}", capped: bool, with_text: bool) {
            let d = error_msg(4, -errno, with_text.then_some(text.as_str()), capped);
            let msgs = parse_datagram(&d).unwrap();
            let want = Message::Error { seq: 4, errno, message: with_text.then(|| text.clone()) };
            prop_assert_eq!(&msgs[..], &[want][..]);
        }
    }

    #[test]
    fn ack_is_error_zero() {
        let d = error_msg(3, 0, None, true);
        assert_eq!(parse_datagram(&d).unwrap(), vec![Message::Ack { seq: 3 }]);
    }

    #[test]
    fn positive_error_is_rejected() {
        let d = error_msg(3, 5, None, true);
        assert_eq!(parse_datagram(&d), Err(MsgError::PositiveError(5)));
    }

    #[test]
    fn message_with_length_past_end_is_rejected() {
        let mut d = error_msg(3, 0, None, true);
        let len = u32::try_from(d.len() + 4).unwrap();
        d[0..4].copy_from_slice(&len.to_ne_bytes());
        assert!(matches!(
            parse_datagram(&d),
            Err(MsgError::BadMessageLength { .. })
        ));
    }

    #[test]
    fn message_length_shorter_than_a_header_is_rejected() {
        let mut d = error_msg(3, 0, None, true);
        d[0..4].copy_from_slice(&8u32.to_ne_bytes());
        assert!(matches!(
            parse_datagram(&d),
            Err(MsgError::BadMessageLength { len: 8, .. })
        ));
    }

    #[test]
    fn attr_with_length_past_end_is_rejected() {
        let mut a = Vec::new();
        a.extend_from_slice(&12u16.to_ne_bytes());
        a.extend_from_slice(&1u16.to_ne_bytes());
        a.extend_from_slice(&[0; 4]);
        assert!(matches!(
            parse_attrs(&a),
            Err(MsgError::BadAttrLength {
                ty: 1,
                len: 12,
                left: 8
            })
        ));
    }

    #[test]
    fn attr_shorter_than_its_header_is_rejected() {
        let a = [2u8, 0, 1, 0];
        assert!(matches!(
            parse_attrs(&a),
            Err(MsgError::BadAttrLength { len: 2, .. })
        ));
    }

    #[test]
    fn integer_attr_of_the_wrong_size_is_rejected() {
        let mut b = MsgBuilder::genl(0x20, 0, 1, 1, 1);
        b.u16(1, 7);
        let d = b.finish().unwrap();
        let Message::Genl { attrs, .. } = &parse_datagram(&d).unwrap()[0] else {
            panic!("not genl")
        };
        let a = parse_attrs(attrs).unwrap()[0];
        assert_eq!(
            a.u32(),
            Err(MsgError::AttrSize {
                ty: 1,
                got: 2,
                want: 4
            })
        );
    }

    #[test]
    fn string_without_nul_is_rejected() {
        let a = [7u8, 0, 3, 0, b'a', b'b', b'c', 0];
        let attrs = parse_attrs(&a).unwrap();
        assert_eq!(attrs[0].str(), Err(MsgError::BadString { ty: 3 }));
    }

    #[test]
    fn oversized_request_is_refused() {
        let mut b = MsgBuilder::genl(0x20, 0, 1, 1, 1);
        let long = "x".repeat(70_000);
        b.str(1, &long);
        assert_eq!(b.finish(), Err(MsgError::TooLong));
    }

    #[test]
    fn transaction_keeps_its_own_replies_and_ends_on_its_ack() {
        let mut t = Transaction::new(0x20, 7);
        let mut other = MsgBuilder::genl(0x20, 0, 6, 5, 1);
        other.u32(1, 1);
        let mut mine = MsgBuilder::genl(0x20, 0, 7, 5, 1);
        mine.u32(1, 2);
        let mut d = other.finish().unwrap();
        d.extend(mine.finish().unwrap());
        assert!(!t.feed(&d).unwrap());
        assert!(!t.feed(&error_msg(6, 0, None, true)).unwrap());
        assert!(t.feed(&error_msg(7, -16, Some("busy"), true)).unwrap());
        assert_eq!(t.replies.len(), 1);
        assert_eq!(t.outcome, Some(Err((16, Some("busy".into())))));
    }
}
