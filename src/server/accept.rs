//! The accept loop: one thread accepts NBD clients and runs every pending
//! handshake, then hands negotiated connections to reactors.
//!
//! Contract:
//! - Sockets are non-blocking here; one `poll` covers the listeners, the signal
//!   pipe, a kick pipe (a detach wants pending connections of its export gone)
//!   and every pending handshake. A handshake costs its socket and buffers (at
//!   most one option's data, 64 KiB, and a TLS session), never a thread, and
//!   never blocks the loop: replies are sent as the client takes them, and no
//!   request is read while a reply waits. Each turn services the handshakes
//!   that are ready before it accepts at most [`ACCEPT_BATCH`] clients per
//!   listener, so a flood of connections cannot starve handshakes under way.
//! - Each handshake has one deadline for the whole exchange
//!   (`--handshake-timeout`), not per read: a client that trickles bytes is
//!   dropped when it runs out.
//! - Limits, and who pays for them. There is no fixed count of handshakes: a
//!   newcomer is never turned away while a handshake can make room. The real
//!   limits are `--max-connections` (connections in all, handshakes included,
//!   counted by a [`Permit`](crate::engine::admit::Permit) that stays with the
//!   connection), `--max-connections-per-peer` if set, the process's
//!   descriptors, and [`HANDSHAKE_MEMORY`] for the buffers of all handshakes.
//!   When one is reached, the handshake that shows least sign of life is
//!   closed (`engine::admit::victim_checked`): one silent since it connected,
//!   or blocked on a reply it does not take, for longer than the stall time (a
//!   quarter of `--handshake-timeout`, at most 2 s; a real client answers the
//!   greeting at once) first, then one that spoke and went quiet, then one
//!   silent but younger, and a client that is talking last; among equals,
//!   from the peer (IPv4 address, IPv6 /64, Unix uid) holding the most
//!   places, so one peer's flood takes places from itself. At
//!   `--max-connections` a peer holding two places more than the newcomer's
//!   gives one up even if it is a connection past its handshake, and a
//!   newcomer whose peer holds as many as anyone is refused (see [`room`]).
//!   A refused newcomer is accepted and closed at once (it sees the connection
//!   closed, not a hang), and the line says which limit. When the process is
//!   out of descriptors with no handshake to close, one descriptor kept in
//!   reserve is given up to accept and close the client, so the listener never
//!   spins and the control plane keeps the descriptors it needs.
//! - Log lines clients can cause (refusals, evictions, timeouts, listings) go
//!   through [`Lines`]: each names the peer, and at most a few of each kind
//!   from each peer (and a few peers' worth) are written per window, the rest
//!   counted (see [`super::quiet`]).
//! - What may block: nothing but `poll`. Choosing the export takes the daemon's
//!   table lock for a lookup only; admitting takes the admission's lock for a
//!   few map operations.

mod room;

use super::listen::Listener;
use super::pending::{Fate, Pending, Who, step};
use super::quiet::Lines;
use crate::daemon::Daemon;
use crate::engine::admit::{Admission, PeerKey};
use crate::frontend::nbd::affinity::Peer;
use crate::frontend::nbd::conn::{Conn, NewConn};
use crate::frontend::nbd::handshake::{Handshake, Policy};
use crate::frontend::nbd::tls::TlsIo;
use crate::reactor::{ReactorHandle, Session};
use crate::tls::TlsContext;
use crate::tls::ktls::KtlsError;
use room::{Limit, Room, Which};
use rustix::event::{PollFd, PollFlags, poll};
use rustix::net::AddressFamily;
use rustls::ServerConnection;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Receive scratch per read (an option's data arrives in pieces of at most this).
const SCRATCH: usize = 64 << 10;
/// Clients accepted per listener per turn of the loop.
pub const ACCEPT_BATCH: usize = 64;
/// Memory all handshakes together may hold in buffers and TLS sessions; past
/// it, the handshake with least sign of life is closed.
pub const HANDSHAKE_MEMORY: usize = 64 << 20;
/// The longest a client may stay silent after the greeting before it is the
/// first to go when room is needed.
const MAX_STALL: Duration = Duration::from_secs(2);

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

/// The loop's state.
pub struct AcceptLoop<'a> {
    listeners: &'a [Listener],
    sig_rx: &'a UnixStream,
    kick_rx: &'a UnixStream,
    daemon: &'a Arc<Daemon>,
    reactors: &'a [Arc<ReactorHandle>],
    cfg: AcceptConfig,
    pending: Vec<Pending>,
    /// Memory the pending handshakes hold (the sum of their `counted`).
    held: usize,
    scratch: Vec<u8>,
    /// A descriptor given up to accept (and close) a client when out of them.
    reserve: Option<OwnedFd>,
    lines: Lines,
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
            held: 0,
            scratch: vec![0u8; SCRATCH],
            reserve: open_reserve(),
            lines: Lines::new(),
            ktls_noted: false,
        }
    }

    /// How long a client may be silent before it is the first to go.
    fn stall(&self) -> Duration {
        (self.cfg.handshake_timeout / 4).min(MAX_STALL)
    }

    /// The handshakes and what choosing who makes room needs (see [`room`]).
    fn room(&mut self) -> Room<'_> {
        Room {
            stall: self.stall(),
            admission: &self.cfg.admission,
            reactors: self.reactors,
            pending: &mut self.pending,
            held: &mut self.held,
            lines: &mut self.lines,
        }
    }

    /// Run until SIGINT/SIGTERM.
    pub fn run(&mut self) -> Result<(), rustix::io::Errno> {
        loop {
            let now = Instant::now();
            self.expire(now);
            self.lines.tick(now);
            // Wake for the next handshake deadline, and to write the count
            // of a burst of log lines when its window ends.
            let timeout = self
                .pending
                .iter()
                .map(|p| p.deadline)
                .chain(self.lines.due())
                .min()
                .map(|t| {
                    t.saturating_duration_since(now)
                        .max(Duration::from_millis(1))
                });
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
            self.fit_memory();
            if kick {
                let mut b = [0u8; 64];
                while matches!((&mut &*self.kick_rx).read(&mut b), Ok(n) if n > 0) {}
                self.drop_closed();
            }
            for (i, _) in ready.iter().enumerate().filter(|(_, r)| **r) {
                self.accept_some(i);
            }
        }
    }

    /// Remove handshake `i` (closing its socket), keeping the memory count.
    fn remove(&mut self, i: usize) -> Pending {
        let p = self.pending.swap_remove(i);
        self.held -= p.counted;
        p
    }

    /// Drop handshakes past their deadline.
    fn expire(&mut self, now: Instant) {
        let t = self.cfg.handshake_timeout;
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].deadline > now {
                i += 1;
                continue;
            }
            let p = self.remove(i);
            self.lines.timed_out.hit(now, p.who.key, || {
                format!(
                    "dropping NBD client {}: its handshake did not finish within {t:?} \
                     (--handshake-timeout)",
                    p.who.name
                )
            });
        }
    }

    /// Drop pending connections whose export closed under them (a detach).
    fn drop_closed(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let closing = self.pending[i]
                .done
                .as_ref()
                .is_some_and(|n| n.client.export().closing());
            if closing {
                self.remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Accept up to [`ACCEPT_BATCH`] clients waiting on listener `li`.
    fn accept_some(&mut self, li: usize) {
        for _ in 0..ACCEPT_BATCH {
            let r = match &self.listeners[li] {
                Listener::Unix(u) => u.accept().map(|(s, _)| {
                    let s = OwnedFd::from(s);
                    let who = Who::unix(&s);
                    (s, who)
                }),
                Listener::Tcp(t) => t.accept().map(|(s, addr)| {
                    let _ = s.set_nodelay(true);
                    (OwnedFd::from(s), Who::tcp(addr))
                }),
            };
            let (sock, who) = match r {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    // A handshake's descriptor makes room; else refuse.
                    if self.room().evict(Limit::Descriptors, Which::Any) {
                        continue;
                    }
                    self.refuse_without_fds(li);
                    return;
                }
                Err(e) => {
                    // ECONNABORTED and the like: that client is gone; go on later.
                    tracing::debug!("accept failed: {e}");
                    return;
                }
            };
            self.admit(sock, who);
        }
    }

    /// Out of descriptors with no handshake to close: use the reserve one to
    /// take the client off the queue and close it, so it is refused rather
    /// than left hanging.
    fn refuse_without_fds(&mut self, li: usize) {
        let open = self.cfg.admission.open();
        self.lines.no_fds.hit(Instant::now(), PeerKey::Unknown, || {
            format!(
                "refusing new NBD clients: out of file descriptors with {open} connections \
                 open, none in its handshake (raise the open-file limit, e.g. LimitNOFILE=, \
                 or lower --max-connections)"
            )
        });
        drop(self.reserve.take());
        let _ = match &self.listeners[li] {
            Listener::Unix(u) => u.accept().map(|_| ()),
            Listener::Tcp(t) => t.accept().map(|_| ()),
        };
        self.reserve = open_reserve();
    }

    fn admit(&mut self, sock: OwnedFd, who: Who) {
        // Dropping the socket of a refused client closes it.
        let Some(permit) = self.room().place_for(&who) else {
            return;
        };
        if rustix::io::ioctl_fionbio(&sock, true).is_err() {
            return;
        }
        self.pending.push(Pending::new(
            sock,
            who,
            Handshake::new(self.cfg.policy),
            Instant::now() + self.cfg.handshake_timeout,
            permit,
        ));
        // Send the greeting now.
        let i = self.pending.len() - 1;
        self.service(i);
        self.fit_memory();
    }

    /// Close handshakes until their memory is within [`HANDSHAKE_MEMORY`].
    fn fit_memory(&mut self) {
        while self.held > HANDSHAKE_MEMORY
            && self
                .room()
                .evict(Limit::Memory(HANDSHAKE_MEMORY), Which::Any)
        {}
    }

    /// Move handshake `i` on as far as its socket allows; hand it to a reactor
    /// once negotiated, drop it on error or EOF. Counts the memory it holds
    /// (see [`AcceptLoop::fit_memory`]).
    fn service(&mut self, i: usize) {
        let fate = step(
            &mut self.pending[i],
            &mut self.scratch,
            self.daemon,
            self.cfg.tls.as_deref(),
            &mut self.lines,
        );
        match fate {
            Fate::Waiting => {
                let p = &mut self.pending[i];
                let now = p.held();
                self.held = self.held - p.counted + now;
                p.counted = now;
            }
            Fate::Dropped => {
                self.remove(i);
            }
            Fate::Negotiated => {
                let p = self.remove(i);
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
        // From now on its place may go to another peer's newcomer.
        self.cfg.admission.established(&p.permit);
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
        r.adopt(Session::nbd(Conn::new(NewConn {
            sock: p.sock,
            client: neg.client,
            permit: p.permit,
            structured: neg.structured,
            extended: neg.extended,
            meta_context: neg.meta_context,
            peer,
            tls,
            encrypted,
        })));
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
