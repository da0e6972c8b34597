//! NBD wire formats: pure parsing and encoding, no I/O.
//!
//! Every function here takes bytes (or plain values) and returns values (or bytes);
//! nothing allocates in proportion to an untrusted length before that length is
//! checked against a cap. The handshake and the reactor drive sockets and call in
//! here; the fuzz targets and property tests call in here directly.

use super::proto::*;
use crate::block::{Extent, Op, ReqFlags};
use thiserror::Error;

/// What went wrong decoding bytes from a client.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum WireError {
    #[error("need {need} bytes, have {have}")]
    Short { need: usize, have: usize },
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("length {len} exceeds limit {limit}")]
    TooLong { len: u64, limit: u64 },
    #[error("malformed option payload: {0}")]
    Malformed(&'static str),
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Length of something loopd itself built (names, replies), capped far below `u32`.
fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn need(b: &[u8], n: usize) -> Result<(), WireError> {
    if b.len() < n {
        Err(WireError::Short {
            need: n,
            have: b.len(),
        })
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Handshake

/// An option header sent by the client: `IHAVEOPT`, option, length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

/// Decode the 16-byte option header.
pub fn parse_option_header(b: &[u8]) -> Result<OptionHeader, WireError> {
    need(b, 16)?;
    let magic = be64(b, 0);
    if magic != IHAVEOPT {
        return Err(WireError::BadMagic(magic));
    }
    Ok(OptionHeader {
        option: be32(b, 8),
        len: be32(b, 12),
    })
}

/// The payload of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

/// Read a length-prefixed (u32) string at `at`, returning it and the next offset.
fn parse_string(b: &[u8], at: usize) -> Result<(String, usize), WireError> {
    need(b, at.checked_add(4).ok_or(WireError::Malformed("offset"))?)?;
    let len = be32(b, at) as usize;
    if len > MAX_NAME_LEN {
        return Err(WireError::TooLong {
            len: len as u64,
            limit: MAX_NAME_LEN as u64,
        });
    }
    let start = at + 4;
    let end = start + len;
    need(b, end)?;
    let s = std::str::from_utf8(&b[start..end])
        .map_err(|_| WireError::Malformed("string is not UTF-8"))?;
    if s.contains('\0') {
        return Err(WireError::Malformed("string contains NUL"));
    }
    Ok((s.to_owned(), end))
}

/// Decode the payload of `NBD_OPT_INFO`/`NBD_OPT_GO`.
pub fn parse_info_request(b: &[u8]) -> Result<InfoRequest, WireError> {
    let (name, at) = parse_string(b, 0)?;
    need(b, at + 2)?;
    let n = be16(b, at) as usize;
    let start = at + 2;
    if b.len() != start + 2 * n {
        return Err(WireError::Malformed(
            "info request count does not match length",
        ));
    }
    let requests = (0..n).map(|i| be16(b, start + 2 * i)).collect();
    Ok(InfoRequest { name, requests })
}

/// The payload of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub name: String,
    pub queries: Vec<String>,
}

/// Decode a meta-context option payload.
pub fn parse_meta_context_request(b: &[u8]) -> Result<MetaContextRequest, WireError> {
    let (name, mut at) = parse_string(b, 0)?;
    need(b, at + 4)?;
    let n = be32(b, at) as usize;
    at += 4;
    // Each query needs at least its 4-byte length: cap before allocating.
    if n > (b.len() - at) / 4 {
        return Err(WireError::Malformed("more queries than bytes"));
    }
    let mut queries = Vec::with_capacity(n);
    for _ in 0..n {
        let (q, next) = parse_string(b, at)?;
        queries.push(q);
        at = next;
    }
    if at != b.len() {
        return Err(WireError::Malformed("trailing bytes after queries"));
    }
    Ok(MetaContextRequest { name, queries })
}

/// Whether a meta-context query selects `base:allocation`.
/// For `LIST`, an empty query list or the bare namespace `base:` selects it too.
pub fn query_selects_base_allocation(query: &str, listing: bool) -> bool {
    query == BASE_ALLOCATION || (listing && query == "base:")
}

/// Encode an option reply header followed by its payload.
pub fn option_reply(out: &mut Vec<u8>, option: u32, reply: u32, payload: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&len_u32(payload.len()).to_be_bytes());
    out.extend_from_slice(payload);
}

/// Encode the payload of an `NBD_REP_INFO` of type `NBD_INFO_EXPORT`.
pub fn info_export(size: u64, flags: u16) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    b[2..10].copy_from_slice(&size.to_be_bytes());
    b[10..12].copy_from_slice(&flags.to_be_bytes());
    b
}

/// Encode the payload of an `NBD_REP_INFO` of type `NBD_INFO_BLOCK_SIZE`.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> [u8; 14] {
    let mut b = [0u8; 14];
    b[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b[2..6].copy_from_slice(&min.to_be_bytes());
    b[6..10].copy_from_slice(&preferred.to_be_bytes());
    b[10..14].copy_from_slice(&max.to_be_bytes());
    b
}

/// Encode the payload of an `NBD_REP_INFO` carrying a string (`NAME`, `DESCRIPTION`).
pub fn info_string(kind: u16, s: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(2 + s.len());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(s.as_bytes());
    b
}

/// Encode an `NBD_REP_SERVER` payload for `NBD_OPT_LIST`.
pub fn rep_server(name: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + name.len());
    b.extend_from_slice(&len_u32(name.len()).to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b
}

/// Encode an `NBD_REP_META_CONTEXT` payload.
pub fn rep_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + name.len());
    b.extend_from_slice(&id.to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b
}

// ---------------------------------------------------------------------------
// Transmission

/// A request header as it came off the wire, not yet validated. `len` is 64
/// bits wide for extended headers; a compact header's fits in 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u64,
}

/// Size of a request header: 32 bytes with extended headers, else 28.
pub fn request_len(extended: bool) -> usize {
    if extended {
        EXTENDED_REQUEST_LEN
    } else {
        REQUEST_LEN
    }
}

/// Decode the 28-byte compact request header. Only the magic is checked here;
/// everything else is [`validate`]'s job, so that a bad field gets an error
/// reply rather than a closed connection.
pub fn parse_request(b: &[u8]) -> Result<Request, WireError> {
    need(b, REQUEST_LEN)?;
    let magic = be32(b, 0);
    if magic != REQUEST_MAGIC {
        return Err(WireError::BadMagic(u64::from(magic)));
    }
    Ok(Request {
        flags: be16(b, 4),
        kind: be16(b, 6),
        cookie: be64(b, 8),
        offset: be64(b, 16),
        len: u64::from(be32(b, 24)),
    })
}

/// Decode the 32-byte extended request header. Besides the magic, one thing is
/// a framing error here: a payload (a `WRITE`'s, or a request flagged
/// `NBD_CMD_FLAG_PAYLOAD_LEN`) longer than a compact header could announce (the
/// spec lets the server hang up on any payload past its maximum; shorter ones
/// are refused and skipped, as in compact mode).
pub fn parse_request_ext(b: &[u8]) -> Result<Request, WireError> {
    need(b, EXTENDED_REQUEST_LEN)?;
    let magic = be32(b, 0);
    if magic != EXTENDED_REQUEST_MAGIC {
        return Err(WireError::BadMagic(u64::from(magic)));
    }
    let r = Request {
        flags: be16(b, 4),
        kind: be16(b, 6),
        cookie: be64(b, 8),
        offset: be64(b, 16),
        len: be64(b, 24),
    };
    let limit = u64::from(u32::MAX);
    let payload = r.kind == CMD_WRITE || r.flags & CMD_FLAG_PAYLOAD_LEN != 0;
    if payload && r.len > limit {
        return Err(WireError::TooLong { len: r.len, limit });
    }
    Ok(r)
}

/// Decode a request header of the negotiated kind: with extended headers a
/// compact one is a framing error, and the other way round.
pub fn parse_header(b: &[u8], extended: bool) -> Result<Request, WireError> {
    if extended {
        parse_request_ext(b)
    } else {
        parse_request(b)
    }
}

/// Encode a compact request header (tests, fuzz seeds and benchmarks' raw
/// clients); `r.len` must fit in 32 bits (it is cut to its low 32 bits).
pub fn encode_request(r: &Request) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.kind.to_be_bytes());
    b[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    let low = (r.len & u64::from(u32::MAX)).to_be_bytes();
    b[24..28].copy_from_slice(&low[4..]);
    b
}

/// Encode an extended request header.
pub fn encode_request_ext(r: &Request) -> [u8; EXTENDED_REQUEST_LEN] {
    let mut b = [0u8; EXTENDED_REQUEST_LEN];
    b[0..4].copy_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.kind.to_be_bytes());
    b[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..32].copy_from_slice(&r.len.to_be_bytes());
    b
}

/// The errors loopd puts on the wire are the block layer's; the spec's values
/// are Linux errno numbers, so an error's code is its errno.
pub use crate::block::Errno as NbdErrno;

/// The number sent in a reply for `e`.
pub fn error_code(e: NbdErrno) -> u32 {
    e.raw().unsigned_abs()
}

/// A validated command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
}

impl Command {
    /// The block operation this command asks for (`None`: DISC and
    /// BLOCK_STATUS, which the frontend answers itself).
    pub fn op(self) -> Option<Op> {
        match self {
            Command::Read => Some(Op::Read),
            Command::Write => Some(Op::Write),
            Command::Flush => Some(Op::Flush),
            Command::Trim => Some(Op::Trim),
            Command::Cache => Some(Op::Cache),
            Command::WriteZeroes => Some(Op::WriteZeroes),
            Command::Disc | Command::BlockStatus => None,
        }
    }
}

/// A request's command flags as the block layer's.
pub fn req_flags(flags: u16) -> ReqFlags {
    ReqFlags {
        fua: flags & CMD_FLAG_FUA != 0,
        no_hole: flags & CMD_FLAG_NO_HOLE != 0,
        fast_zero: flags & CMD_FLAG_FAST_ZERO != 0,
    }
}

/// What the validator needs to know about the export and the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportView {
    pub size: u64,
    pub read_only: bool,
    /// Structured replies were negotiated (also true with extended headers).
    pub structured: bool,
    /// Extended headers were negotiated: 32-byte headers, 64-bit lengths.
    pub extended: bool,
    /// A metadata context was selected with `SET_META_CONTEXT`.
    pub meta_context: bool,
}

/// A request the validator rejected, and how many payload bytes follow it on the
/// wire (which the reader must consume before the next header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejected {
    pub errno: NbdErrno,
    pub payload: u64,
}

/// Payload bytes that follow `req` on the wire: a `WRITE`'s length (its length
/// is always its payload's: with extended headers, qemu and libnbd send writes
/// without `NBD_CMD_FLAG_PAYLOAD_LEN`, which is optional there); with extended
/// headers, also the length of any request flagged `NBD_CMD_FLAG_PAYLOAD_LEN`.
pub fn payload_len(req: &Request, exp: &ExportView) -> u64 {
    let flagged = exp.extended && req.flags & CMD_FLAG_PAYLOAD_LEN != 0;
    if req.kind == CMD_WRITE || flagged {
        req.len
    } else {
        0
    }
}

/// Check a request against the export: command, flags, bounds, size.
/// On success returns the command; the payload length of a write is `req.len`
/// (at most [`MAX_PAYLOAD`]). With extended headers, `TRIM`, `WRITE_ZEROES`,
/// `CACHE` and `BLOCK_STATUS` may have an effect length past 32 bits.
pub fn validate(req: &Request, exp: &ExportView) -> Result<Command, Rejected> {
    let payload = payload_len(req, exp);
    let reject = |errno| Err(Rejected { errno, payload });
    let cmd = match req.kind {
        CMD_READ => Command::Read,
        CMD_WRITE => Command::Write,
        CMD_DISC => Command::Disc,
        CMD_FLUSH => Command::Flush,
        CMD_TRIM => Command::Trim,
        CMD_CACHE => Command::Cache,
        CMD_WRITE_ZEROES => Command::WriteZeroes,
        CMD_BLOCK_STATUS => Command::BlockStatus,
        _ => return reject(NbdErrno::Inval),
    };
    let allowed = match cmd {
        Command::Read => CMD_FLAG_FUA | if exp.structured { CMD_FLAG_DF } else { 0 },
        Command::Write if exp.extended => CMD_FLAG_FUA | CMD_FLAG_PAYLOAD_LEN,
        Command::Write | Command::Trim => CMD_FLAG_FUA,
        Command::WriteZeroes => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        Command::BlockStatus => CMD_FLAG_REQ_ONE,
        Command::Disc | Command::Flush | Command::Cache => CMD_FLAG_FUA,
    };
    if req.flags & !allowed != 0 {
        return reject(NbdErrno::Inval);
    }
    let writes = matches!(cmd, Command::Write | Command::Trim | Command::WriteZeroes);
    if writes && exp.read_only {
        return reject(NbdErrno::Perm);
    }
    if matches!(cmd, Command::Disc | Command::Flush) {
        return Ok(cmd);
    }
    if cmd == Command::BlockStatus && !exp.meta_context {
        return reject(NbdErrno::Inval);
    }
    if req.len == 0 {
        return reject(NbdErrno::Inval);
    }
    let end = req.offset.checked_add(req.len);
    let in_range = end.is_some_and(|e| e <= exp.size);
    if !in_range {
        let errno = match cmd {
            Command::Write | Command::WriteZeroes => NbdErrno::NoSpc,
            _ => NbdErrno::Inval,
        };
        return reject(errno);
    }
    if matches!(cmd, Command::Read | Command::Write) && req.len > u64::from(MAX_PAYLOAD) {
        return reject(NbdErrno::Overflow);
    }
    Ok(cmd)
}

/// Encode a simple reply.
pub fn simple_reply(out: &mut [u8; SIMPLE_REPLY_LEN], error: u32, cookie: u64) {
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
}

/// Encode a structured reply chunk header.
pub fn chunk_header(out: &mut [u8], flags: u16, kind: u16, cookie: u64, len: u32) {
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&kind.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&len.to_be_bytes());
}

/// How replies are framed on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replies {
    /// Simple replies only (nothing negotiated).
    Simple,
    /// `NBD_OPT_STRUCTURED_REPLY`: structured chunks for reads and errors.
    Structured,
    /// `NBD_OPT_EXTENDED_HEADERS`: a 32-byte extended header on every reply.
    Extended,
}

impl Replies {
    /// The framing negotiated (extended headers take precedence).
    pub fn of(structured: bool, extended: bool) -> Replies {
        match (structured, extended) {
            (_, true) => Replies::Extended,
            (true, false) => Replies::Structured,
            (false, false) => Replies::Simple,
        }
    }
}

/// Largest reply header loopd builds: an extended offset-data or block-status
/// header (32 + 8); an extended error chunk with no message is 38 bytes, a
/// structured offset-data chunk header 28.
pub const MAX_REPLY_HEADER: usize = 40;

/// Encode an extended reply header (`offset` is the request's).
pub fn extended_header(out: &mut [u8], flags: u16, kind: u16, cookie: u64, offset: u64, len: u64) {
    out[0..4].copy_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&kind.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..24].copy_from_slice(&offset.to_be_bytes());
    out[24..32].copy_from_slice(&len.to_be_bytes());
}

/// Encode the header of a reply into `out`, returning its length. `data_len` is
/// the number of payload bytes that follow (read data); `offset` is the
/// request's offset.
pub fn reply_header(
    out: &mut [u8; MAX_REPLY_HEADER],
    cmd_is_read: bool,
    replies: Replies,
    cookie: u64,
    offset: u64,
    result: Result<u32, NbdErrno>,
) -> usize {
    match (replies, result) {
        (Replies::Extended, Err(e)) => {
            // Error chunk: errno (4) + message length (2), no message.
            let x = EXTENDED_REPLY_LEN;
            extended_header(out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, offset, 6);
            out[x..x + 4].copy_from_slice(&error_code(e).to_be_bytes());
            out[x + 4..x + 6].copy_from_slice(&0u16.to_be_bytes());
            x + 6
        }
        (Replies::Extended, Ok(data_len)) if cmd_is_read => {
            let len = u64::from(data_len) + 8;
            let x = EXTENDED_REPLY_LEN;
            extended_header(
                out,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                cookie,
                offset,
                len,
            );
            out[x..x + 8].copy_from_slice(&offset.to_be_bytes());
            x + 8
        }
        (Replies::Extended, Ok(_)) => {
            extended_header(out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, offset, 0);
            EXTENDED_REPLY_LEN
        }
        (Replies::Structured, Err(e)) => {
            // Error chunk: errno (4) + message length (2), no message.
            chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6);
            out[20..24].copy_from_slice(&error_code(e).to_be_bytes());
            out[24..26].copy_from_slice(&0u16.to_be_bytes());
            26
        }
        (Replies::Structured, Ok(data_len)) if cmd_is_read => {
            chunk_header(
                out,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                cookie,
                data_len.saturating_add(8),
            );
            out[20..28].copy_from_slice(&offset.to_be_bytes());
            28
        }
        (Replies::Simple | Replies::Structured, _) => {
            let err = result.err().map_or(0, error_code);
            let mut h = [0u8; SIMPLE_REPLY_LEN];
            simple_reply(&mut h, err, cookie);
            out[..SIMPLE_REPLY_LEN].copy_from_slice(&h);
            SIMPLE_REPLY_LEN
        }
    }
}

/// Encode the header of a block-status chunk carrying `n` descriptors.
pub fn block_status_header(
    out: &mut [u8; MAX_REPLY_HEADER],
    cookie: u64,
    context: u32,
    n: u32,
) -> usize {
    chunk_header(
        out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        cookie,
        n.saturating_mul(8).saturating_add(4),
    );
    out[20..24].copy_from_slice(&context.to_be_bytes());
    24
}

/// Encode the extended header of an `NBD_REPLY_TYPE_BLOCK_STATUS_EXT` chunk
/// carrying `n` 16-byte descriptors (`offset` is the request's).
pub fn block_status_ext_header(
    out: &mut [u8; MAX_REPLY_HEADER],
    cookie: u64,
    offset: u64,
    context: u32,
    n: u32,
) -> usize {
    let len = u64::from(n) * 16 + 8;
    let x = EXTENDED_REPLY_LEN;
    extended_header(
        out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS_EXT,
        cookie,
        offset,
        len,
    );
    out[x..x + 4].copy_from_slice(&context.to_be_bytes());
    out[x + 4..x + 8].copy_from_slice(&n.to_be_bytes());
    x + 8
}

/// Encode one block-status descriptor.
pub fn block_descriptor(out: &mut [u8], len: u32, flags: u32) {
    out[0..4].copy_from_slice(&len.to_be_bytes());
    out[4..8].copy_from_slice(&flags.to_be_bytes());
}

/// Encode `extents` as `base:allocation` descriptors into `out` (8 bytes each;
/// as many as fit). Returns the number encoded.
pub fn encode_extents(out: &mut [u8], extents: &[Extent]) -> usize {
    let mut n = 0;
    for (e, d) in extents.iter().zip(out.chunks_exact_mut(8)) {
        let flags = if e.hole { STATE_HOLE } else { 0 } | if e.zero { STATE_ZERO } else { 0 };
        block_descriptor(d, e.len, flags);
        n += 1;
    }
    n
}

/// Encode `extents` as 16-byte `base:allocation` descriptors of
/// `NBD_REPLY_TYPE_BLOCK_STATUS_EXT` into `out` (64-bit length, zero padding,
/// flags; as many as fit). Returns the number encoded.
pub fn encode_extents_ext(out: &mut [u8], extents: &[Extent]) -> usize {
    let mut n = 0;
    for (e, d) in extents.iter().zip(out.chunks_exact_mut(16)) {
        let flags = if e.hole { STATE_HOLE } else { 0 } | if e.zero { STATE_ZERO } else { 0 };
        d[0..8].copy_from_slice(&u64::from(e.len).to_be_bytes());
        d[8..12].copy_from_slice(&0u32.to_be_bytes());
        d[12..16].copy_from_slice(&flags.to_be_bytes());
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests;
