//! One client in its handshake, and the byte transport under it: the socket
//! itself, or, after `STARTTLS`, a TLS session over it.
//!
//! Contract: a [`Pending`] belongs to the accept loop; its socket is
//! non-blocking and [`step`] moves it on as far as the socket allows without
//! waiting. TLS records are read only while the handshake wants bytes, and the
//! plaintext rustls decrypts past what the handshake takes stays in the session
//! (handed to the reactor with it). Nothing here blocks.
//!
//! A pending handshake knows who its client is ([`Who`]: the peer named in log
//! lines, and the key limits count it under), when it connected, when its
//! last bytes arrived, and since when a reply has waited for it to take it
//! (what the accept loop weighs when it must close one: a client blocked on
//! our reply is silent, whatever it sends meanwhile), and roughly how much
//! memory it holds. [`step`] writes the audit line of every
//! refusal, naming the peer, through the accept loop's rate-limited [`Lines`].

use super::quiet::Lines;
use crate::daemon::Daemon;
use crate::device::Device;
use crate::device::export::ClientRef;
use crate::engine::admit::{PeerKey, Permit, Standing};
use crate::frontend::nbd::handshake::{Handshake, HandshakeError, Negotiated, Notice, Step};
use crate::frontend::nbd::proto::option_name;
use crate::tls::TlsContext;
use crate::tls::record::RecordBoundary;
use rustls::ServerConnection;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

/// What a TLS session holds while it is set up, roughly: rustls's buffers for
/// a record each way and the handshake's state. Counted against the memory
/// limit on handshakes (an estimate: rustls does not report it).
const TLS_SESSION: usize = 40 << 10;

/// Who a client is.
#[derive(Debug, Clone)]
pub(super) struct Who {
    /// For log lines: `ADDR:PORT`, or `unix uid=U pid=P` (as the audit lines
    /// of connected clients name them).
    pub name: String,
    /// What limits count it under.
    pub key: PeerKey,
}

impl Who {
    /// A TCP client.
    pub fn tcp(addr: std::net::SocketAddr) -> Who {
        Who {
            name: addr.to_string(),
            key: PeerKey::of_ip(addr.ip()),
        }
    }

    /// A Unix-socket client, as `SO_PEERCRED` names it.
    pub fn unix(sock: &OwnedFd) -> Who {
        match rustix::net::sockopt::socket_peercred(sock) {
            Ok(c) => Who {
                name: format!(
                    "unix uid={} pid={}",
                    c.uid.as_raw(),
                    c.pid.as_raw_nonzero().get()
                ),
                key: PeerKey::Uid(c.uid.as_raw()),
            },
            Err(_) => Who {
                name: "unix peer (credentials unknown)".into(),
                key: PeerKey::Unknown,
            },
        }
    }
}

/// One client in its handshake.
pub(super) struct Pending {
    pub sock: OwnedFd,
    pub who: Who,
    /// When it connected.
    pub opened: Instant,
    /// When its last bytes arrived (`None`: it has sent nothing).
    pub heard: Option<Instant>,
    /// When it last took bytes we sent (the greeting included).
    pub progress: Option<Instant>,
    /// Since when a reply has waited for it to take more, with no progress
    /// (`None`: nothing waits to be sent). It counts as silent meanwhile.
    pub stuck: Option<Instant>,
    /// Memory it held when last serviced ([`Pending::held`]), as the accept
    /// loop's total counts it.
    pub counted: usize,
    pub hs: Handshake,
    /// Bytes of `hs.out` already sent (plaintext only; with TLS, `hs.out`
    /// goes into the session whole).
    pub sent: usize,
    /// The outcome, once reached; handed over when the last reply is sent.
    pub done: Option<Negotiated<ClientRef, Arc<Device>>>,
    pub deadline: Instant,
    pub permit: Permit,
    /// The client asked for TLS: it starts once `hs.out` (the ACK) is sent.
    pub start_tls: bool,
    /// The TLS session, from `STARTTLS` on.
    pub tls: Option<Box<ServerConnection>>,
    /// The TLS handshake is over and the handshake knows who the client is.
    pub tls_up: bool,
    /// Where the TLS records end in what was read: the socket is never read
    /// past the record in progress, so rustls holds no partial record when
    /// the session may go to the kernel.
    pub boundary: RecordBoundary,
}

/// What became of a pending handshake after it was serviced.
pub(super) enum Fate {
    Waiting,
    Negotiated,
    Dropped,
}

impl Pending {
    pub fn new(
        sock: OwnedFd,
        who: Who,
        hs: Handshake,
        deadline: Instant,
        permit: Permit,
    ) -> Pending {
        let opened = Instant::now();
        Pending {
            sock,
            who,
            opened,
            heard: None,
            progress: None,
            stuck: None,
            counted: 0,
            hs,
            sent: 0,
            done: None,
            deadline,
            permit,
            start_tls: false,
            tls: None,
            tls_up: false,
            boundary: RecordBoundary::new(),
        }
    }

    /// What the choice of whom to close knows of it; `held`: places its
    /// peer holds.
    pub fn standing(&self, held: usize) -> Standing {
        Standing {
            peer: self.who.key,
            held,
            opened: self.opened,
            // Once it has spoken, taking our replies is a sign of life too.
            heard: self.heard.map(|h| self.progress.map_or(h, |p| p.max(h))),
            stuck: self.stuck,
        }
    }

    /// A send moved `n` bytes and more waits (`n` zero: nothing moved): the
    /// reply is stuck from the last progress on.
    fn sent_some(&mut self, n: usize) {
        if n > 0 {
            let now = Instant::now();
            self.progress = Some(now);
            self.stuck = Some(now);
        } else if self.stuck.is_none() {
            self.stuck = Some(Instant::now());
        }
    }

    /// Memory it holds: the handshake's buffers and its TLS session (an
    /// estimate), not counting the socket's own kernel buffers.
    pub fn held(&self) -> usize {
        self.hs.held() + if self.tls.is_some() { TLS_SESSION } else { 0 }
    }

    /// Whether the socket must become writable before this moves on.
    pub fn wants_out(&self) -> bool {
        match &self.tls {
            Some(t) => t.wants_write(),
            None => self.sent < self.hs.out.len(),
        }
    }
}

/// How a read or write on the transport went.
enum Io {
    Done(usize),
    WouldBlock,
    Eof,
    Failed(String),
    /// The TLS handshake failed (no or a bad client certificate, …).
    TlsFailed(rustls::Error),
}

/// A `Write` view of the non-blocking socket, for rustls.
struct SockW<'a>(&'a OwnedFd);

impl Write for SockW<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        rustix::net::send(self.0.as_fd(), buf, rustix::net::SendFlags::NOSIGNAL)
            .map_err(std::io::Error::from)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A `Read` view of the non-blocking socket for rustls that never reads past
/// the TLS record in progress.
struct SockR<'a> {
    sock: &'a OwnedFd,
    boundary: &'a mut RecordBoundary,
}

impl Read for SockR<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.boundary.max_read());
        let n = rustix::io::read(self.sock.as_fd(), &mut buf[..n]).map_err(std::io::Error::from)?;
        self.boundary.consumed(&buf[..n]);
        Ok(n)
    }
}

/// Send what waits: `hs.out` (into the TLS session, if any) and the session's
/// records. `Done(_)` once all of it is out.
fn flush(p: &mut Pending) -> Io {
    match p.tls.as_mut() {
        None => {
            while p.sent < p.hs.out.len() {
                match rustix::net::send(
                    &p.sock,
                    &p.hs.out[p.sent..],
                    rustix::net::SendFlags::NOSIGNAL,
                ) {
                    Ok(n) => {
                        p.sent += n;
                        p.sent_some(n);
                    }
                    Err(rustix::io::Errno::AGAIN) => {
                        p.sent_some(0);
                        return Io::WouldBlock;
                    }
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Io::Failed(e.to_string()),
                }
            }
            p.hs.out.clear();
            p.sent = 0;
            p.stuck = None;
            Io::Done(0)
        }
        Some(t) => {
            if !p.hs.out.is_empty() {
                if let Err(e) = t.writer().write_all(&p.hs.out) {
                    return Io::Failed(e.to_string());
                }
                p.hs.out.clear();
            }
            let mut moved = 0;
            while t.wants_write() {
                match t.write_tls(&mut SockW(&p.sock)) {
                    Ok(n) => moved += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        p.sent_some(moved);
                        return Io::WouldBlock;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Io::Failed(e.to_string()),
                }
            }
            if moved > 0 {
                p.progress = Some(Instant::now());
            }
            p.stuck = None;
            Io::Done(0)
        }
    }
}

/// Read up to `buf.len()` bytes of the handshake's stream (plaintext, or
/// decrypted by the session; with TLS, this also moves its own handshake on).
fn read(p: &mut Pending, buf: &mut [u8]) -> Io {
    let Some(t) = p.tls.as_mut() else {
        return match rustix::io::read(&p.sock, buf) {
            Ok(0) => Io::Eof,
            Ok(n) => {
                p.heard = Some(Instant::now());
                Io::Done(n)
            }
            Err(rustix::io::Errno::AGAIN) => Io::WouldBlock,
            Err(rustix::io::Errno::INTR) => Io::Done(0),
            Err(e) => Io::Failed(e.to_string()),
        };
    };
    loop {
        if !t.is_handshaking() {
            match t.reader().read(buf) {
                Ok(0) => return Io::Eof,
                Ok(n) => return Io::Done(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Io::Failed(e.to_string()),
            }
        }
        let mut r = SockR {
            sock: &p.sock,
            boundary: &mut p.boundary,
        };
        match t.read_tls(&mut r) {
            Ok(0) => return Io::Eof,
            Ok(_) => p.heard = Some(Instant::now()),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Io::WouldBlock,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Io::Failed(e.to_string()),
        }
        let was_handshaking = t.is_handshaking();
        if let Err(e) = t.process_new_packets() {
            // Tell the client why (an alert), if the socket takes it now.
            let _ = t.write_tls(&mut SockW(&p.sock));
            return Io::TlsFailed(e);
        }
        if t.wants_write() || (was_handshaking && !t.is_handshaking()) {
            // The session is up (the handshake learns who the client is before
            // it reads on), or
            // Handshake messages to send before anything more can come.
            return Io::Done(0);
        }
    }
}

/// Service one pending handshake: send what waits, read what the handshake
/// wants, repeat until the socket would block. Refusals and listings are
/// recorded in `lines`, naming the client.
pub(super) fn step(
    p: &mut Pending,
    scratch: &mut [u8],
    daemon: &Daemon,
    tls: Option<&TlsContext>,
    lines: &mut Lines,
) -> Fate {
    loop {
        match flush(p) {
            Io::Done(_) => {}
            Io::WouldBlock => return Fate::Waiting,
            Io::Eof => return Fate::Dropped,
            Io::Failed(e) => {
                tracing::debug!("handshake: send failed: {e}");
                return Fate::Dropped;
            }
            Io::TlsFailed(e) => {
                tracing::debug!("handshake: TLS send failed: {e}");
                return Fate::Dropped;
            }
        }
        if p.done.is_some() {
            return Fate::Negotiated;
        }
        if p.start_tls {
            // The ACK is out: the TLS handshake starts.
            p.start_tls = false;
            let Some(ctx) = tls else {
                return Fate::Dropped;
            };
            match ServerConnection::new(ctx.current()) {
                Ok(c) => p.tls = Some(Box::new(c)),
                Err(e) => {
                    tracing::warn!("cannot start TLS: {e}");
                    return Fate::Dropped;
                }
            }
            continue;
        }
        if let Some(t) = p.tls.as_ref()
            && !p.tls_up
            && !t.is_handshaking()
        {
            p.tls_up = true;
            let ids = crate::tls::identities(t);
            tracing::debug!(
                "TLS session up ({:?}), client identities {ids:?}",
                t.protocol_version()
            );
            p.hs.tls_started(ids);
        }
        let want = p.hs.want().min(scratch.len());
        let n = match read(p, &mut scratch[..want]) {
            Io::Done(0) => continue,
            Io::Done(n) => n,
            Io::WouldBlock => return Fate::Waiting,
            Io::Eof => {
                if !p.hs.at_boundary() {
                    tracing::debug!("handshake: {}", HandshakeError::Truncated);
                }
                return Fate::Dropped;
            }
            Io::Failed(e) => {
                tracing::debug!("handshake: receive failed: {e}");
                return Fate::Dropped;
            }
            Io::TlsFailed(e) => {
                let why = crate::text::clip(e.to_string().as_bytes(), 160);
                lines.tls.hit(Instant::now(), p.who.key, || {
                    format!(
                        "NBD client {} refused: TLS handshake failed: {why}",
                        p.who.name
                    )
                });
                return Fate::Dropped;
            }
        };
        let fed = p.hs.feed(&scratch[..n], daemon);
        record(p, lines);
        match fed {
            Ok(Step::More) => {}
            Ok(Step::StartTls) => p.start_tls = true,
            Ok(Step::Done(Some(neg))) => p.done = Some(neg),
            Ok(Step::Done(None)) => {
                // ABORT: its acknowledgement is sent if the socket takes it now.
                let _ = flush(p);
                return Fate::Dropped;
            }
            Err(e) => {
                refused(p, &e, lines);
                return Fate::Dropped;
            }
        }
    }
}

/// Write the audit lines of what the handshake noticed.
fn record(p: &mut Pending, lines: &mut Lines) {
    let now = Instant::now();
    let who = &p.who;
    for n in p.hs.notices.drain(..) {
        match n {
            Notice::TlsRequired { option } => lines.tls.hit(now, who.key, || {
                format!(
                    "NBD client {} refused: TLS is required and it sent {} in the clear",
                    who.name,
                    option_name(option)
                )
            }),
            Notice::Listed(n) => lines.listed.hit(now, who.key, || {
                format!("NBD client {} listed the exports ({n} shown)", who.name)
            }),
            Notice::ListRefused => lines.listed.hit(now, who.key, || {
                format!(
                    "NBD client {} refused: listing exports is turned off (--no-list)",
                    who.name
                )
            }),
            Notice::UnknownExport { option, name } => lines.unknown.hit(now, who.key, || {
                format!(
                    "NBD client {} refused: no export {name} it may use ({})",
                    who.name,
                    option_name(option)
                )
            }),
        }
    }
}

/// Write the audit line of a handshake that ends in an error.
fn refused(p: &Pending, e: &HandshakeError, lines: &mut Lines) {
    let now = Instant::now();
    let who = &p.who;
    let line = || format!("NBD client {} refused: {e}", who.name);
    match e {
        HandshakeError::UnknownExport(_) => lines.unknown.hit(now, who.key, line),
        HandshakeError::TlsRequired => lines.tls.hit(now, who.key, line),
        HandshakeError::Io(_) | HandshakeError::Truncated => {
            tracing::debug!("handshake with {} failed: {e}", who.name);
        }
        HandshakeError::ClientFlags(_)
        | HandshakeError::Wire(_)
        | HandshakeError::TooManyOptions(_)
        | HandshakeError::ExportNameExtended
        | HandshakeError::TlsNotStarted
        | HandshakeError::NoTls => lines.protocol.hit(now, who.key, line),
    }
}
