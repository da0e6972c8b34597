//! The fixed-newstyle handshake as a state machine with no I/O of its own.
//!
//! A [`Handshake`] says how many bytes it wants next ([`Handshake::want`]), takes
//! them ([`Handshake::feed`]) and leaves what to send in [`Handshake::out`]. It never
//! asks for a byte past the end of the handshake, so nothing of the transmission
//! phase is consumed here, and it holds at most one option's data (capped at
//! `MAX_OPTION_LEN`; longer options are counted off and refused). The server drives
//! it on one event loop over non-blocking sockets (a pending handshake costs its
//! buffers, no thread); [`negotiate`] drives it over a blocking `Read + Write`
//! (tests, fuzzing). Parsing is in [`super::wire`].
//!
//! A client counts as a client of an export from the moment `GO` or
//! `EXPORT_NAME` selects it: [`Exports::join`] hands back the registration
//! (`Exports::Client`), which travels with the connection.
//!
//! What the server must record about a client (an option refused because TLS
//! is required, an export list given or refused, an export asked for that the
//! client may not see) is left in [`Handshake::notices`] for the driver, which
//! knows who the client is; names in notices and errors are already cut and
//! escaped for a log line ([`crate::text::untrusted`]).
//!
//! TLS: no cryptography happens here. With [`Policy::tls`] on, `STARTTLS` is
//! acknowledged and [`Handshake::feed`] returns [`Step::StartTls`]; the driver
//! sends [`Handshake::out`], runs the TLS handshake on the socket, and calls
//! [`Handshake::tls_started`] with what the client's certificate proved
//! (its identities), before it feeds any more bytes (which are then the
//! decrypted ones). Everything negotiated before `STARTTLS` is forgotten then,
//! as the spec demands. [`TlsMode::Require`] refuses every option but
//! `STARTTLS` and `ABORT` until TLS is up. Every export lookup is given the
//! client's identities, so the [`Exports`] can hide an export from a client
//! not allowed to see it.

use super::proto::*;
use super::wire::{self, WireError};
use std::io::{Read, Write};
use std::sync::Arc;
use thiserror::Error;

/// Where the handshake finds exports by name. `ids` are the identities the
/// client's TLS certificate proved (empty without TLS or without a client
/// certificate); an export the client may not use is answered as if it did
/// not exist.
pub trait Exports {
    /// What selecting an export hands back: the connection's registration as a
    /// client, held for as long as the connection lives.
    type Client;
    /// An export as the handshake is given it (the daemon's: its device);
    /// the handshake sees only its [`ExportFacts`].
    type Export: ExportFacts;
    /// The export named `name` (`""` is the default export), for `INFO` and
    /// meta-context queries.
    fn find(&self, name: &str, ids: &[String]) -> Option<Self::Export>;
    /// Select `name` for the transmission phase: from now on the connection
    /// counts as its client. `None` if there is no such export or it takes no
    /// new clients (a detach has begun).
    fn join(&self, name: &str, ids: &[String]) -> Option<(Self::Export, Self::Client)>;
    /// Every export's name the client may see, for `NBD_OPT_LIST`.
    fn names(&self, ids: &[String]) -> Vec<String>;
}

#[derive(Debug, Error)]
pub enum HandshakeError {
    #[error("socket error during handshake")]
    Io(#[from] std::io::Error),
    #[error("client sent unknown flags {0:#x}")]
    ClientFlags(u32),
    #[error("bad option from client: {0}")]
    Wire(#[from] WireError),
    /// The name as a log line may show it ([`crate::text::untrusted`]).
    #[error("client asked for unknown export {0} with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    #[error("client sent more than {0} options")]
    TooManyOptions(usize),
    #[error("client closed the connection in the middle of a message")]
    Truncated,
    #[error("client sent NBD_OPT_EXPORT_NAME without TLS, which this server requires")]
    TlsRequired,
    #[error("client sent NBD_OPT_EXPORT_NAME after negotiating extended headers")]
    ExportNameExtended,
    #[error("client sent more handshake bytes before the TLS handshake was done")]
    TlsNotStarted,
    #[error("this handshake driver cannot start TLS")]
    NoTls,
}

/// All the handshake needs of an export: what it tells the client about it.
pub trait ExportFacts {
    /// The name it is exported as (`NBD_INFO_NAME`).
    fn name(&self) -> &str;
    /// Its size in bytes.
    fn size(&self) -> u64;
    fn read_only(&self) -> bool;
    /// Its logical block size.
    fn block_size(&self) -> u32;
    /// Whether its block size is the least a client may use.
    fn strict_block_size(&self) -> bool;
}

impl<T: ExportFacts + ?Sized> ExportFacts for Arc<T> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn read_only(&self) -> bool {
        (**self).read_only()
    }
    fn block_size(&self) -> u32 {
        (**self).block_size()
    }
    fn strict_block_size(&self) -> bool {
        (**self).strict_block_size()
    }
}

/// The outcome of a successful handshake (`X`: the export selected, as
/// [`Exports::Export`]).
pub struct Negotiated<C, X> {
    pub dev: X,
    /// The connection's registration as a client of the export.
    pub client: C,
    /// Structured replies (also true with extended headers).
    pub structured: bool,
    /// Extended headers: 32-byte request and reply headers, 64-bit lengths.
    pub extended: bool,
    pub meta_context: bool,
    /// The connection runs over TLS (`STARTTLS` and [`Handshake::tls_started`]).
    pub tls: bool,
    /// What the client's certificate proved (empty without one).
    pub identities: Vec<String>,
}

/// Something a client did during its handshake that the server records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// An option refused with `NBD_REP_ERR_TLS_REQD` (the first one of the
    /// connection only).
    TlsRequired { option: u32 },
    /// `NBD_OPT_LIST` answered with this many names.
    Listed(usize),
    /// `NBD_OPT_LIST` refused (`--no-list`).
    ListRefused,
    /// `GO` or `INFO` asked for an export that does not exist or that the
    /// client may not see; the name cut and escaped for a log line.
    UnknownExport { option: u32, name: String },
}

/// Whether the server offers TLS (`NBD_OPT_STARTTLS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// No TLS: `STARTTLS` is refused with `NBD_REP_ERR_POLICY`.
    #[default]
    Off,
    /// TLS at the client's choice.
    On,
    /// TLS before anything else: every other option but `ABORT` is refused
    /// with `NBD_REP_ERR_TLS_REQD` until TLS is up.
    Require,
}

/// What the server allows during the handshake.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Answer `NBD_OPT_LIST` (else `NBD_REP_ERR_POLICY`).
    pub list: bool,
    pub tls: TlsMode,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            list: true,
            tls: TlsMode::Off,
        }
    }
}

const MAX_OPTIONS: usize = 4096;
/// Bytes of an over-long option's data taken per [`Handshake::feed`].
const DISCARD_CHUNK: usize = 64 << 10;

/// Transmission flags for a device (`structured`: structured replies or
/// extended headers were negotiated).
pub fn transmission_flags(dev: &impl ExportFacts, structured: bool) -> u16 {
    let mut f = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_CACHE
        | TFLAG_CAN_MULTI_CONN;
    if dev.read_only() {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
    }
    if structured {
        f |= TFLAG_SEND_DF;
    }
    f
}

/// Block sizes advertised for a device: (minimum, preferred, maximum).
///
/// The minimum is 1: loopd serves requests at any offset and length (direct
/// mode bounces them through aligned buffers, read-modify-write for writes), so
/// byte-granular clients (nbdfuse, a 512-byte-sector loop device on it) work at
/// any block size. The block size (at least a page) is the preferred size,
/// which keeps well-behaved clients aligned and fast. A device configured
/// `strict_block_size` advertises its block size as the minimum instead, and
/// strict clients (libnbd) then refuse unaligned requests themselves.
pub fn block_sizes(dev: &impl ExportFacts) -> (u32, u32, u32) {
    let min = if dev.strict_block_size() {
        dev.block_size()
    } else {
        1
    };
    (min, dev.block_size().max(4096), MAX_PAYLOAD)
}

/// What the handshake is waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The client's 4-byte flags.
    Flags,
    /// A 16-byte option header.
    Header,
    /// `len` bytes of data of `option`.
    Data { option: u32, len: u32 },
    /// The rest of an over-long option's data, thrown away.
    Discard { option: u32, left: u64 },
}

/// What a handshake over exports `E` negotiates.
pub type NegotiatedWith<E> = Negotiated<<E as Exports>::Client, <E as Exports>::Export>;

/// Progress after [`Handshake::feed`].
pub enum Step<C, X> {
    /// Wants more bytes ([`Handshake::want`]).
    More,
    /// `STARTTLS` was acknowledged: send what [`Handshake::out`] holds, run the
    /// TLS handshake, then call [`Handshake::tls_started`] before feeding more.
    StartTls,
    /// The handshake is over: `Some` enters the transmission phase, `None` means
    /// the client aborted. Send what [`Handshake::out`] holds first.
    Done(Option<Negotiated<C, X>>),
}

/// Where TLS stands on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tls {
    None,
    /// `STARTTLS` acknowledged; the driver runs the TLS handshake.
    Starting,
    Started,
}

/// What the options negotiated so far selected: forgotten when TLS starts.
#[derive(Debug, Clone, Copy, Default)]
struct Haggled {
    structured: bool,
    extended: bool,
    meta_context: bool,
}

/// One client's handshake. See the module documentation.
pub struct Handshake {
    phase: Phase,
    /// Bytes of the current message received so far.
    buf: Vec<u8>,
    /// Bytes to send, in order; the driver drains it.
    pub out: Vec<u8>,
    policy: Policy,
    no_zeroes: bool,
    haggled: Haggled,
    tls: Tls,
    identities: Vec<String>,
    options: usize,
    /// What the server should record; the driver drains it after each
    /// [`Handshake::feed`] (at most one per option).
    pub notices: Vec<Notice>,
    /// A TLS refusal was noticed already.
    tls_noticed: bool,
}

impl Handshake {
    /// A new handshake; `out` already holds the server's greeting.
    pub fn new(policy: Policy) -> Handshake {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(&NBDMAGIC.to_be_bytes());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        Handshake {
            phase: Phase::Flags,
            buf: Vec::with_capacity(16),
            out,
            policy,
            no_zeroes: false,
            haggled: Haggled::default(),
            tls: Tls::None,
            identities: Vec::new(),
            options: 0,
            notices: Vec::new(),
            tls_noticed: false,
        }
    }

    /// Bytes of buffers this handshake holds (for the server's memory limit
    /// on handshakes).
    pub fn held(&self) -> usize {
        self.buf.capacity() + self.out.capacity()
    }

    /// The TLS handshake the driver ran after [`Step::StartTls`] succeeded;
    /// `identities` is what the client's certificate proved (empty without
    /// one). Forgets every option negotiated before `STARTTLS`.
    pub fn tls_started(&mut self, identities: Vec<String>) {
        self.tls = Tls::Started;
        self.identities = identities;
        self.haggled = Haggled::default();
    }

    /// How many bytes to read next (at least one): never more than the current
    /// message still lacks.
    pub fn want(&self) -> usize {
        let total = match self.phase {
            Phase::Flags => 4,
            Phase::Header => 16,
            Phase::Data { len, .. } => len as usize,
            Phase::Discard { left, .. } => {
                return usize::try_from(left).map_or(DISCARD_CHUNK, |l| l.min(DISCARD_CHUNK));
            }
        };
        total - self.buf.len()
    }

    /// Whether the client may close the connection here without error (between
    /// options).
    pub fn at_boundary(&self) -> bool {
        self.phase == Phase::Header && self.buf.is_empty()
    }

    /// Take `input` (at most [`Handshake::want`] bytes; any more is an error of
    /// the caller and is ignored) and act on every complete message.
    pub fn feed<E: Exports + ?Sized>(
        &mut self,
        input: &[u8],
        exports: &E,
    ) -> Result<Step<E::Client, E::Export>, HandshakeError> {
        if self.tls == Tls::Starting {
            return Err(HandshakeError::TlsNotStarted);
        }
        let input = &input[..input.len().min(self.want())];
        if let Phase::Discard { option, left } = self.phase {
            let left = left - input.len() as u64;
            if left > 0 {
                self.phase = Phase::Discard { option, left };
                return Ok(Step::More);
            }
            self.phase = Phase::Header;
            self.reply(option, REP_ERR_TOO_BIG, b"option too long");
            return Ok(Step::More);
        }
        self.buf.extend_from_slice(input);
        if self.want() > 0 {
            return Ok(Step::More);
        }
        let msg = std::mem::take(&mut self.buf);
        let step = self.message(&msg, exports);
        // Reuse the allocation for the next message.
        self.buf = msg;
        self.buf.clear();
        step
    }

    fn message<E: Exports + ?Sized>(
        &mut self,
        msg: &[u8],
        exports: &E,
    ) -> Result<Step<E::Client, E::Export>, HandshakeError> {
        match self.phase {
            Phase::Flags => {
                let mut cf = [0u8; 4];
                cf.copy_from_slice(msg);
                let client_flags = u32::from_be_bytes(cf);
                if client_flags & !(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES) != 0 {
                    return Err(HandshakeError::ClientFlags(client_flags));
                }
                self.no_zeroes = client_flags & CLIENT_FLAG_NO_ZEROES != 0;
                self.phase = Phase::Header;
                Ok(Step::More)
            }
            Phase::Header => {
                if self.options == MAX_OPTIONS {
                    return Err(HandshakeError::TooManyOptions(MAX_OPTIONS));
                }
                self.options += 1;
                let opt = wire::parse_option_header(msg)?;
                if opt.len > MAX_OPTION_LEN {
                    self.phase = Phase::Discard {
                        option: opt.option,
                        left: u64::from(opt.len),
                    };
                    return Ok(Step::More);
                }
                self.phase = Phase::Data {
                    option: opt.option,
                    len: opt.len,
                };
                if opt.len == 0 {
                    return self.message(&[], exports);
                }
                Ok(Step::More)
            }
            Phase::Data { option, .. } => {
                self.phase = Phase::Header;
                self.option(option, msg, exports)
            }
            // Handled in `feed`; never a complete message.
            Phase::Discard { .. } => Ok(Step::More),
        }
    }

    fn reply(&mut self, option: u32, kind: u32, payload: &[u8]) {
        wire::option_reply(&mut self.out, option, kind, payload);
    }

    /// Handle one option.
    fn option<E: Exports + ?Sized>(
        &mut self,
        option: u32,
        data: &[u8],
        exports: &E,
    ) -> Result<Step<E::Client, E::Export>, HandshakeError> {
        let tls_missing = self.policy.tls == TlsMode::Require && self.tls != Tls::Started;
        if tls_missing && !matches!(option, OPT_STARTTLS | OPT_ABORT) {
            // This option has no error reply: all that is left is to close.
            if option == OPT_EXPORT_NAME {
                return Err(HandshakeError::TlsRequired);
            }
            if !self.tls_noticed {
                self.tls_noticed = true;
                self.notices.push(Notice::TlsRequired { option });
            }
            self.reply(option, REP_ERR_TLS_REQD, b"this server requires TLS");
            return Ok(Step::More);
        }
        match option {
            OPT_EXPORT_NAME => {
                if self.haggled.extended {
                    return Err(HandshakeError::ExportNameExtended);
                }
                let name = std::str::from_utf8(data)
                    .map_err(|_| WireError::Malformed("export name is not UTF-8"))?;
                // This option has no error reply: an unknown export closes.
                let Some((dev, client)) = exports.join(name, &self.identities) else {
                    return Err(HandshakeError::UnknownExport(crate::text::untrusted(name)));
                };
                let flags = transmission_flags(&dev, self.haggled.structured);
                self.out.extend_from_slice(&dev.size().to_be_bytes());
                self.out.extend_from_slice(&flags.to_be_bytes());
                if !self.no_zeroes {
                    self.out.extend_from_slice(&[0u8; 124]);
                }
                Ok(Step::Done(Some(self.done(dev, client))))
            }
            OPT_ABORT => {
                self.reply(option, REP_ACK, &[]);
                Ok(Step::Done(None))
            }
            OPT_LIST => {
                if !data.is_empty() {
                    self.reply(option, REP_ERR_INVALID, b"LIST takes no data");
                } else if !self.policy.list {
                    self.notices.push(Notice::ListRefused);
                    self.reply(option, REP_ERR_POLICY, b"listing exports is turned off");
                } else {
                    let names = exports.names(&self.identities);
                    self.notices.push(Notice::Listed(names.len()));
                    for name in names {
                        self.reply(option, REP_SERVER, &wire::rep_server(&name));
                    }
                    self.reply(option, REP_ACK, &[]);
                }
                Ok(Step::More)
            }
            OPT_INFO | OPT_GO => self.info_or_go(option, data, exports),
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.reply(option, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data");
                } else if self.haggled.extended {
                    self.reply(
                        option,
                        REP_ERR_EXT_HEADER_REQD,
                        b"extended headers are already negotiated",
                    );
                } else {
                    self.haggled.structured = true;
                    self.reply(option, REP_ACK, &[]);
                }
                Ok(Step::More)
            }
            OPT_EXTENDED_HEADERS => {
                if !data.is_empty() {
                    self.reply(option, REP_ERR_INVALID, b"EXTENDED_HEADERS takes no data");
                } else if self.haggled.extended {
                    self.reply(
                        option,
                        REP_ERR_INVALID,
                        b"extended headers are already negotiated",
                    );
                } else {
                    // Extended headers take the place of structured replies.
                    self.haggled.extended = true;
                    self.haggled.structured = true;
                    self.reply(option, REP_ACK, &[]);
                }
                Ok(Step::More)
            }
            OPT_STARTTLS => {
                if self.policy.tls == TlsMode::Off {
                    self.reply(option, REP_ERR_POLICY, b"TLS is not enabled on this server");
                } else if self.tls != Tls::None {
                    self.reply(option, REP_ERR_INVALID, b"TLS is already started");
                } else if !data.is_empty() {
                    self.reply(option, REP_ERR_INVALID, b"STARTTLS takes no data");
                } else {
                    self.reply(option, REP_ACK, &[]);
                    self.tls = Tls::Starting;
                    return Ok(Step::StartTls);
                }
                Ok(Step::More)
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta(option, data, exports);
                Ok(Step::More)
            }
            _ => {
                self.reply(option, REP_ERR_UNSUP, b"option not supported by loopd");
                Ok(Step::More)
            }
        }
    }

    fn done<C, X>(&mut self, dev: X, client: C) -> Negotiated<C, X> {
        Negotiated {
            dev,
            client,
            structured: self.haggled.structured,
            extended: self.haggled.extended,
            meta_context: self.haggled.meta_context,
            tls: self.tls == Tls::Started,
            identities: std::mem::take(&mut self.identities),
        }
    }

    fn info_or_go<E: Exports + ?Sized>(
        &mut self,
        option: u32,
        data: &[u8],
        exports: &E,
    ) -> Result<Step<E::Client, E::Export>, HandshakeError> {
        let req = match wire::parse_info_request(data) {
            Ok(r) => r,
            Err(e) => {
                self.reply(option, REP_ERR_INVALID, e.to_string().as_bytes());
                return Ok(Step::More);
            }
        };
        // GO joins before it answers: by the time the client reads the reply
        // it is counted, so a detach cannot miss it.
        let (dev, client) = if option == OPT_GO {
            match exports.join(&req.name, &self.identities) {
                Some((d, c)) => (d, Some(c)),
                None => return self.unknown(option, &req.name),
            }
        } else {
            match exports.find(&req.name, &self.identities) {
                Some(d) => (d, None),
                None => return self.unknown(option, &req.name),
            }
        };
        let flags = transmission_flags(&dev, self.haggled.structured);
        self.reply(option, REP_INFO, &wire::info_export(dev.size(), flags));
        for &kind in &req.requests {
            match kind {
                INFO_NAME => {
                    self.reply(option, REP_INFO, &wire::info_string(INFO_NAME, dev.name()))
                }
                INFO_BLOCK_SIZE => {
                    let (min, pref, max) = block_sizes(&dev);
                    self.reply(option, REP_INFO, &wire::info_block_size(min, pref, max))
                }
                // No description: it would tell any client where the image lives.
                // Unknown requests are ignored, as the spec allows.
                _ => {}
            }
        }
        self.reply(option, REP_ACK, &[]);
        match client {
            Some(c) => Ok(Step::Done(Some(self.done(dev, c)))),
            None => Ok(Step::More),
        }
    }

    fn unknown<C, X>(&mut self, option: u32, name: &str) -> Result<Step<C, X>, HandshakeError> {
        self.notices.push(Notice::UnknownExport {
            option,
            name: crate::text::untrusted(name),
        });
        let msg = format!("no export named {name:?}");
        self.reply(option, REP_ERR_UNKNOWN, msg.as_bytes());
        Ok(Step::More)
    }

    fn meta<E: Exports + ?Sized>(&mut self, option: u32, data: &[u8], exports: &E) {
        let listing = option == OPT_LIST_META_CONTEXT;
        if !self.haggled.structured {
            self.reply(
                option,
                REP_ERR_INVALID,
                b"negotiate structured replies first",
            );
            return;
        }
        let req = match wire::parse_meta_context_request(data) {
            Ok(r) => r,
            Err(e) => {
                self.reply(option, REP_ERR_INVALID, e.to_string().as_bytes());
                return;
            }
        };
        if exports.find(&req.name, &self.identities).is_none() {
            let msg = format!("no export named {:?}", req.name);
            self.reply(option, REP_ERR_UNKNOWN, msg.as_bytes());
            return;
        }
        let selected = if listing && req.queries.is_empty() {
            true
        } else {
            req.queries
                .iter()
                .any(|q| wire::query_selects_base_allocation(q, listing))
        };
        if selected {
            self.reply(
                option,
                REP_META_CONTEXT,
                &wire::rep_meta_context(BASE_ALLOCATION_ID, BASE_ALLOCATION),
            );
        }
        if !listing {
            self.haggled.meta_context = selected;
        }
        self.reply(option, REP_ACK, &[]);
    }
}

/// Run the handshake over a blocking stream with the default policy. `Ok(None)`
/// means the client ended it cleanly (ABORT, or closed the socket between
/// options).
pub fn negotiate<S: Read + Write, E: Exports + ?Sized>(
    s: &mut S,
    exports: &E,
) -> Result<Option<NegotiatedWith<E>>, HandshakeError> {
    negotiate_with(s, exports, Policy::default())
}

/// [`negotiate`] with a policy. A plain stream cannot start TLS: a `STARTTLS`
/// the policy acknowledges ends the handshake with [`HandshakeError::NoTls`].
pub fn negotiate_with<S: Read + Write, E: Exports + ?Sized>(
    s: &mut S,
    exports: &E,
    policy: Policy,
) -> Result<Option<NegotiatedWith<E>>, HandshakeError> {
    let mut h = Handshake::new(policy);
    let mut buf = vec![0u8; DISCARD_CHUNK];
    loop {
        s.write_all(&h.out)?;
        h.out.clear();
        let want = h.want().min(buf.len());
        let n = match s.read(&mut buf[..want]) {
            Ok(0) if h.at_boundary() => return Ok(None),
            Ok(0) => return Err(HandshakeError::Truncated),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        match h.feed(&buf[..n], exports)? {
            Step::More => {}
            // A plain stream has no TLS to start.
            Step::StartTls => return Err(HandshakeError::NoTls),
            Step::Done(done) => {
                let sent = s.write_all(&h.out);
                // After ABORT the client may already be gone: that changes nothing.
                if done.is_some() {
                    sent?;
                }
                return Ok(done);
            }
        }
    }
}

#[cfg(test)]
mod tests;
