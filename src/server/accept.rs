//! The accept loop: one thread accepts NBD clients and runs every pending
//! handshake, then hands negotiated connections to reactors.
//!
//! Contract:
//! - Sockets are non-blocking here; one `poll` covers the listeners, the signal
//!   pipe, a kick pipe (a detach wants pending connections of its export gone)
//!   and every pending handshake. A handshake costs its socket and buffers (at
//!   most one option's data, 64 KiB), never a thread, and never blocks the loop:
//!   replies are sent as the client takes them, and no request is read while a
//!   reply waits.
//! - Each handshake has one deadline for the whole exchange
//!   (`--handshake-timeout`), not per read: a client that trickles bytes is
//!   dropped when it runs out.
//! - Limits: at most [`MAX_PENDING`] handshakes at once, and `--max-connections`
//!   connections in all (handshakes included, counted by a [`Permit`] that stays
//!   with the connection). Past either, a new client is accepted and closed at
//!   once (it sees the connection closed, not a hang) and the first refusal of a
//!   burst is logged. When the process is out of descriptors, one kept in reserve
//!   is given up to accept and close the client, so the listener never spins and
//!   the control plane keeps the descriptors it needs.
//! - What may block: nothing but `poll`. Choosing the export takes the daemon's
//!   table lock for a lookup only.

use super::Listener;
use super::pending::{Fate, Pending, step};
use crate::daemon::Daemon;
use crate::engine::admit::Admission;
use crate::frontend::nbd::affinity::Peer;
use crate::frontend::nbd::handshake::{Handshake, Policy};
use crate::frontend::nbd::tls::TlsIo;
use crate::reactor::{NewConn, ReactorHandle};
use crate::tls::TlsContext;
use crate::tls::ktls::KtlsError;
use rustix::event::{PollFd, PollFlags, poll};
use rustix::net::AddressFamily;
use rustls::ServerConnection;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Handshakes in progress at most.
pub const MAX_PENDING: usize = 256;
/// Receive scratch per read (an option's data arrives in pieces of at most this).
const SCRATCH: usize = 64 << 10;

/// How the loop treats clients.
pub struct AcceptConfig {
    pub handshake_timeout: Duration,
    pub policy: Policy,
    pub admission: Arc<Admission>,
    /// Certificates for `STARTTLS` (present when TLS is on or required).
    pub tls: Option<Arc<TlsContext>>,
    /// Hand TLS sessions to the kernel (kTLS) where it can take them.
    pub ktls: bool,
}

/// Logs the first event of a burst and counts the rest, so a flood of refused
/// or timed-out clients cannot flood the log.
struct Quiet {
    what: &'static str,
    since: Option<Instant>,
    count: u64,
}

impl Quiet {
    const WINDOW: Duration = Duration::from_secs(10);

    fn new(what: &'static str) -> Quiet {
        Quiet {
            what,
            since: None,
            count: 0,
        }
    }

    fn hit(&mut self, detail: impl FnOnce() -> String) {
        self.count += 1;
        if self.since.is_none() {
            tracing::warn!("{} ({}); further ones are counted", self.what, detail());
            self.since = Some(Instant::now());
            self.count = 0;
        }
    }

    /// Report the count of a burst once its window has passed.
    fn tick(&mut self, now: Instant) {
        if let Some(t) = self.since {
            if now.duration_since(t) >= Self::WINDOW {
                if self.count > 0 {
                    tracing::warn!(
                        "{}: {} more in the last {:?}",
                        self.what,
                        self.count,
                        Self::WINDOW
                    );
                }
                self.since = None;
                self.count = 0;
            }
        }
    }
}

/// The loop's state.
pub struct AcceptLoop<'a> {
    listeners: &'a [Listener],
    sig_rx: &'a UnixStream,
    kick_rx: &'a UnixStream,
    daemon: &'a Arc<Daemon>,
    reactors: &'a [Arc<ReactorHandle>],
    cfg: AcceptConfig,
    pending: Vec<Pending>,
    scratch: Vec<u8>,
    /// A descriptor given up to accept (and close) a client when out of them.
    reserve: Option<OwnedFd>,
    refused: Quiet,
    timed_out: Quiet,
    no_fds: Quiet,
    /// Said once that TLS runs in userspace (no kTLS).
    ktls_noted: bool,
}

impl<'a> AcceptLoop<'a> {
    pub fn new(
        listeners: &'a [Listener],
        sig_rx: &'a UnixStream,
        kick_rx: &'a UnixStream,
        daemon: &'a Arc<Daemon>,
        reactors: &'a [Arc<ReactorHandle>],
        cfg: AcceptConfig,
    ) -> AcceptLoop<'a> {
        AcceptLoop {
            listeners,
            sig_rx,
            kick_rx,
            daemon,
            reactors,
            cfg,
            pending: Vec::new(),
            scratch: vec![0u8; SCRATCH],
            reserve: open_reserve(),
            refused: Quiet::new("refusing new NBD clients: the connection limit is reached"),
            timed_out: Quiet::new("dropping clients that did not finish the handshake in time"),
            ktls_noted: false,
            no_fds: Quiet::new(
                "refusing new NBD clients: out of file descriptors (raise the open-file limit, \
                 e.g. LimitNOFILE=, or lower --max-connections)",
            ),
        }
    }

    /// Run until SIGINT/SIGTERM.
    pub fn run(&mut self) -> Result<(), rustix::io::Errno> {
        loop {
            let now = Instant::now();
            self.expire(now);
            self.refused.tick(now);
            self.timed_out.tick(now);
            self.no_fds.tick(now);
            let timeout = self
                .pending
                .iter()
                .map(|p| p.deadline.saturating_duration_since(now))
                .min()
                .map(|d| d.max(Duration::from_millis(1)));
            let (ready, sig, kick, ready_pending) = {
                let mut fds: Vec<PollFd<'_>> =
                    Vec::with_capacity(self.listeners.len() + 2 + self.pending.len());
                for l in self.listeners {
                    fds.push(PollFd::from_borrowed_fd(l.as_fd(), PollFlags::IN));
                }
                fds.push(PollFd::new(self.sig_rx, PollFlags::IN));
                fds.push(PollFd::new(self.kick_rx, PollFlags::IN));
                for p in &self.pending {
                    let ev = if p.wants_out() {
                        PollFlags::OUT
                    } else {
                        PollFlags::IN
                    };
                    fds.push(PollFd::new(&p.sock, ev));
                }
                let ts = timeout.map(|d| rustix::event::Timespec {
                    tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                    tv_nsec: i64::from(d.subsec_nanos()),
                });
                match poll(&mut fds, ts.as_ref()) {
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(e),
                }
                let n = self.listeners.len();
                let ready: Vec<bool> = fds[..n].iter().map(|f| !f.revents().is_empty()).collect();
                let sig = !fds[n].revents().is_empty();
                let kick = !fds[n + 1].revents().is_empty();
                let ready_pending: Vec<usize> = fds[n + 2..]
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| !f.revents().is_empty())
                    .map(|(i, _)| i)
                    .collect();
                (ready, sig, kick, ready_pending)
            };
            if sig {
                let mut b = [0u8; 16];
                let _ = (&mut &*self.sig_rx).read(&mut b);
                return Ok(());
            }
            // Highest index first, so swap_remove never moves one still to visit.
            for &i in ready_pending.iter().rev() {
                self.service(i);
            }
            if kick {
                let mut b = [0u8; 64];
                while matches!((&mut &*self.kick_rx).read(&mut b), Ok(n) if n > 0) {}
                self.drop_closed();
            }
            for (i, _) in ready.iter().enumerate().filter(|(_, r)| **r) {
                self.accept_all(i);
            }
        }
    }

    /// Drop handshakes past their deadline.
    fn expire(&mut self, now: Instant) {
        let before = self.pending.len();
        self.pending.retain(|p| p.deadline > now);
        for _ in self.pending.len()..before {
            let t = self.cfg.handshake_timeout;
            self.timed_out.hit(|| format!("deadline {t:?}"));
        }
    }

    /// Drop pending connections whose export closed under them (a detach).
    fn drop_closed(&mut self) {
        self.pending
            .retain(|p| p.done.as_ref().is_none_or(|n| !n.client.export().closing()));
    }

    fn accept_all(&mut self, li: usize) {
        loop {
            let r = match &self.listeners[li] {
                Listener::Unix(u) => u.accept().map(|(s, _)| OwnedFd::from(s)),
                Listener::Tcp(t) => t.accept().map(|(s, _)| {
                    let _ = s.set_nodelay(true);
                    OwnedFd::from(s)
                }),
            };
            let sock = match r {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    self.refuse_without_fds(li);
                    return;
                }
                Err(e) => {
                    // ECONNABORTED and the like: that client is gone; go on later.
                    tracing::debug!("accept failed: {e}");
                    return;
                }
            };
            self.admit(sock);
        }
    }

    /// Out of descriptors: use the reserve one to take the client off the
    /// queue and close it, so it is refused rather than left hanging.
    fn refuse_without_fds(&mut self, li: usize) {
        self.no_fds
            .hit(|| format!("{} open", self.cfg.admission.open()));
        drop(self.reserve.take());
        let _ = match &self.listeners[li] {
            Listener::Unix(u) => u.accept().map(|_| ()),
            Listener::Tcp(t) => t.accept().map(|_| ()),
        };
        self.reserve = open_reserve();
    }

    fn admit(&mut self, sock: OwnedFd) {
        let permit = if self.pending.len() < MAX_PENDING {
            self.cfg.admission.try_admit()
        } else {
            None
        };
        let Some(permit) = permit else {
            let (open, max) = (self.cfg.admission.open(), self.cfg.admission.max());
            let pending = self.pending.len();
            self.refused
                .hit(|| format!("{open} of {max} connections, {pending} in handshake"));
            return; // dropping the socket closes it
        };
        if rustix::io::ioctl_fionbio(&sock, true).is_err() {
            return;
        }
        self.pending.push(Pending::new(
            sock,
            Handshake::new(self.cfg.policy),
            Instant::now() + self.cfg.handshake_timeout,
            permit,
        ));
        // Send the greeting now.
        let i = self.pending.len() - 1;
        self.service(i);
    }

    /// Move handshake `i` on as far as its socket allows; hand it to a reactor
    /// once negotiated, drop it on error or EOF.
    fn service(&mut self, i: usize) {
        let fate = step(
            &mut self.pending[i],
            &mut self.scratch,
            self.daemon,
            self.cfg.tls.as_deref(),
        );
        match fate {
            Fate::Waiting => {}
            Fate::Dropped => {
                self.pending.swap_remove(i);
            }
            Fate::Negotiated => {
                let p = self.pending.swap_remove(i);
                self.hand_over(p);
            }
        }
    }

    fn hand_over(&mut self, p: Pending) {
        let Some(neg) = p.done else {
            return;
        };
        // The reactor's ring waits for the socket itself: it must be blocking
        // (io_uring returns EAGAIN for a non-blocking one instead of waiting).
        if rustix::io::ioctl_fionbio(&p.sock, false).is_err() {
            return;
        }
        let Some(r) = pick_reactor(self.reactors) else {
            return;
        };
        let domain = rustix::net::sockopt::socket_domain(&p.sock).ok();
        widen_send_buffer(&p.sock, domain);
        let peer = Peer::of(&p.sock, domain);
        let encrypted = p.tls.is_some();
        let tls = match p.tls {
            None => None,
            Some(session) => match self.record_layer(&p.sock, session, p.boundary.at_boundary()) {
                Ok(t) => t,
                Err(()) => return,
            },
        };
        r.add(NewConn {
            sock: p.sock,
            client: neg.client,
            permit: p.permit,
            structured: neg.structured,
            extended: neg.extended,
            meta_context: neg.meta_context,
            peer,
            tls,
            encrypted,
        });
    }

    /// Where a negotiated TLS session's records are handled from now on: by
    /// the kernel (`None`: the socket then carries plaintext for the reactor)
    /// where it takes the keys, else by the userspace record layer.
    /// `Err` if the session was lost on the way (the client is dropped).
    fn record_layer(
        &mut self,
        sock: &OwnedFd,
        session: Box<ServerConnection>,
        at_boundary: bool,
    ) -> Result<Option<Box<TlsIo>>, ()> {
        if !self.cfg.ktls {
            return Ok(Some(Box::new(TlsIo::new(*session))));
        }
        if !at_boundary {
            // Part of a record the client sent behind its last option is in
            // rustls's buffer, where the kernel would not find it.
            return Ok(Some(Box::new(TlsIo::new(*session))));
        }
        let Err((e, session)) = crate::tls::ktls::enable(sock.as_fd(), *session) else {
            return Ok(None);
        };
        match session {
            Some(session) => {
                if matches!(e, KtlsError::Unavailable(_)) {
                    if !self.ktls_noted {
                        self.ktls_noted = true;
                        tracing::info!(
                            "TLS records are handled in userspace ({e}); replies are not spliced"
                        );
                    }
                } else {
                    tracing::debug!("TLS session kept in userspace: {e}");
                }
                Ok(Some(Box::new(TlsIo::new(session))))
            }
            None => {
                // The keys were handed over and the kernel refused them: the
                // session cannot go on.
                tracing::warn!("dropping a TLS client: the kernel refused its TLS keys: {e}");
                Err(())
            }
        }
    }
}

/// The reactor for a new connection: the least loaded one that is making
/// progress (one held up inside a turn, by a hung backing file say, only if
/// all are).
fn pick_reactor(reactors: &[Arc<ReactorHandle>]) -> Option<&Arc<ReactorHandle>> {
    reactors.iter().min_by_key(|r| {
        let load = r.load.load(std::sync::atomic::Ordering::Relaxed);
        (!r.making_progress(), load)
    })
}

/// A spare descriptor (see [`AcceptLoop::refuse_without_fds`]).
fn open_reserve() -> Option<OwnedFd> {
    std::fs::File::open("/dev/null").ok().map(OwnedFd::from)
}

/// Unix socket send buffer asked for (the kernel books twice this). The default
/// (`net.core.wmem_default`, 208 KiB) holds a fifth of a 1 MiB reply, so the
/// sender stalls and is woken several times per reply while the client reads; a
/// buffer that holds a few replies lets it run on. For spliced replies the queued
/// data are page-cache pages, not copies.
const SEND_BUFFER: usize = 2 << 20;

/// Raise a Unix socket's send buffer (`domain`: the socket's address family): as
/// far as `net.core.wmem_max` allows, then past it where the daemon may
/// (`CAP_NET_ADMIN`). A refusal leaves the default. TCP sockets are left alone:
/// setting a size turns off the kernel's autotuning, which grows their buffers
/// further where the path needs it.
fn widen_send_buffer(sock: &OwnedFd, domain: Option<AddressFamily>) {
    use rustix::net::sockopt::{
        set_socket_send_buffer_size, set_socket_send_buffer_size_force, socket_send_buffer_size,
    };
    if domain != Some(AddressFamily::UNIX) {
        return;
    }
    let _ = set_socket_send_buffer_size(sock, SEND_BUFFER);
    if socket_send_buffer_size(sock).is_ok_and(|n| n < 2 * SEND_BUFFER) {
        let _ = set_socket_send_buffer_size_force(sock, SEND_BUFFER);
    }
}
