//! The metrics server: one thread, `poll(2)` over the listener and at most
//! [`MAX_SCRAPERS`] connections. One request per connection (`Connection:
//! close`).
//!
//! Nobody can keep a scrape out (issue 22): a scraper sends its request head
//! at once, so a connection has [`HEAD_DEADLINE`] for it and [`DEADLINE`] for
//! the whole exchange. The listener is always served: when the table is full a
//! newcomer takes the place of the connection that shows least sign of life
//! (`engine::admit::victim_checked`: silent since it connected first — or
//! blocked on a reply it does not take —, then quiet the longest, from the
//! peer — IPv4 address, IPv6 /64, Unix uid — holding the most places; one
//! choice costs one pass and one `poll`), so slow or silent connections,
//! however many, churn among
//! themselves while a real scrape, which talks at once, is answered. Each turn
//! serves the connections that are ready before it accepts at most
//! [`ACCEPT_BATCH`] newcomers.

use super::collect::{self, Process};
use super::request::{self, Parsed};
use crate::daemon::Daemon;
use crate::engine::admit::{PeerKey, Standing, victim_checked};
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connections held at once; a newcomer past it takes the place of the one
/// with least sign of life.
pub const MAX_SCRAPERS: usize = 512;
/// How long one connection may take, from accept to the last byte sent.
pub const DEADLINE: Duration = Duration::from_secs(10);
/// How long a connection may take to send its whole request head.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(2);
/// Newcomers accepted per turn of the loop.
const ACCEPT_BATCH: usize = 64;
/// How long a connection may stay silent before it is the first to go.
const STALL: Duration = Duration::from_millis(500);

/// A bound metrics listener.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

enum Stream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Stream {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(b),
            Stream::Unix(s) => s.read(b),
        }
    }
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(b),
            Stream::Unix(s) => s.write(b),
        }
    }
}

impl Listener {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l) => l.as_fd(),
        }
    }
    /// A new connection and the peer limits count it under.
    fn accept(&self) -> std::io::Result<(Stream, PeerKey)> {
        let (s, peer) = match self {
            Listener::Tcp(l) => {
                let (s, a) = l.accept()?;
                (Stream::Tcp(s), PeerKey::of_ip(a.ip()))
            }
            Listener::Unix(l) => {
                let s = l.accept()?.0;
                let peer = rustix::net::sockopt::socket_peercred(&s)
                    .map_or(PeerKey::Unknown, |c| PeerKey::Uid(c.uid.as_raw()));
                (Stream::Unix(s), peer)
            }
        };
        match &s {
            Stream::Tcp(t) => t.set_nonblocking(true)?,
            Stream::Unix(u) => u.set_nonblocking(true)?,
        }
        Ok((s, peer))
    }
}

struct Conn {
    sock: Stream,
    peer: PeerKey,
    opened: Instant,
    /// When bytes last moved, either way (`None`: none yet).
    heard: Option<Instant>,
    /// Since when its reply has waited for it to take more, with no
    /// progress (`None`: not blocked on its reply).
    stuck: Option<Instant>,
    deadline: Instant,
    inbuf: Vec<u8>,
    /// The reply, once the request is read; `sent` bytes of it are out.
    reply: Option<Vec<u8>>,
    sent: usize,
}

/// Start the server thread.
pub fn spawn(
    l: Listener,
    daemon: Arc<Daemon>,
    process: Process,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    match &l {
        Listener::Tcp(t) => t.set_nonblocking(true)?,
        Listener::Unix(u) => u.set_nonblocking(true)?,
    }
    std::thread::Builder::new()
        .name("loopd-metrics".into())
        .spawn(move || serve(&l, &daemon, &process))
}

impl Conn {
    /// When it must be done with, or at least have sent its request head.
    fn due(&self) -> Instant {
        if self.reply.is_some() {
            self.deadline
        } else {
            self.deadline.min(self.opened + HEAD_DEADLINE)
        }
    }
}

fn serve(l: &Listener, daemon: &Daemon, process: &Process) {
    let mut conns: Vec<Conn> = Vec::new();
    let mut accept_warned: Option<Instant> = None;
    loop {
        let now = Instant::now();
        conns.retain(|c| c.due() > now);
        let timeout = conns
            .iter()
            .map(|c| c.due().saturating_duration_since(now))
            .min()
            .map(|d| d.max(Duration::from_millis(1)));
        let (listener_ready, ready) = {
            let mut fds = Vec::with_capacity(conns.len() + 1);
            fds.push(PollFd::from_borrowed_fd(l.fd(), PollFlags::IN));
            for c in &conns {
                let ev = if c.reply.is_some() {
                    PollFlags::OUT
                } else {
                    PollFlags::IN
                };
                fds.push(PollFd::from_borrowed_fd(c.sock.fd(), ev));
            }
            let ts = timeout.map(|d| Timespec {
                tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                tv_nsec: i64::from(d.subsec_nanos()),
            });
            match poll(&mut fds, ts.as_ref()) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!("metrics server stops: poll failed: {e}");
                    return;
                }
            }
            let ready: Vec<usize> = fds[1..]
                .iter()
                .enumerate()
                .filter(|(_, f)| !f.revents().is_empty())
                .map(|(i, _)| i)
                .collect();
            (!fds[0].revents().is_empty(), ready)
        };
        // Highest index first, so swap_remove never moves one still to visit.
        for &i in ready.iter().rev() {
            if !service(&mut conns[i], daemon, process) {
                conns.swap_remove(i);
            }
        }
        if listener_ready {
            accept_some(l, &mut conns, &mut accept_warned);
        }
    }
}

/// Accept up to [`ACCEPT_BATCH`] newcomers; at [`MAX_SCRAPERS`], or out of
/// descriptors, each takes the place of the connection with least sign of
/// life.
fn accept_some(l: &Listener, conns: &mut Vec<Conn>, warned: &mut Option<Instant>) {
    let mut batch = 0;
    while batch < ACCEPT_BATCH {
        if conns.len() >= MAX_SCRAPERS {
            make_room(conns);
        }
        match l.accept() {
            Ok((sock, peer)) => {
                batch += 1;
                let now = Instant::now();
                conns.push(Conn {
                    sock,
                    peer,
                    opened: now,
                    heard: None,
                    stuck: None,
                    deadline: now + DEADLINE,
                    inbuf: Vec::new(),
                    reply: None,
                    sent: 0,
                });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors: a connection's makes room, else wait.
                if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) && make_room(conns)
                {
                    continue;
                }
                if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    tracing::warn!("metrics: accept failed: {e}");
                    *warned = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(100));
                return;
            }
        }
    }
}

/// Close the connection with least sign of life; false if there is none.
/// One pass and one `poll` (over those waiting for their request), whatever
/// the number of connections.
fn make_room(conns: &mut Vec<Conn>) -> bool {
    let now = Instant::now();
    let mut held: HashMap<PeerKey, usize> = HashMap::new();
    for c in conns.iter() {
        *held.entry(c.peer).or_default() += 1;
    }
    let mut standings: Vec<Standing> = conns
        .iter()
        .map(|c| Standing {
            peer: c.peer,
            held: held.get(&c.peer).copied().unwrap_or(0),
            opened: c.opened,
            heard: c.heard,
            stuck: c.stuck,
        })
        .collect();
    let found = victim_checked(
        &mut standings,
        now,
        STALL,
        |_| true,
        |ask| {
            let mut fds: Vec<PollFd<'_>> = ask
                .iter()
                .map(|&i| PollFd::from_borrowed_fd(conns[i].sock.fd(), PollFlags::IN))
                .collect();
            let zero = Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            if !matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0) {
                return Vec::new();
            }
            fds.iter()
                .zip(ask)
                .filter(|(f, _)| !f.revents().is_empty())
                .map(|(_, &i)| i)
                .collect()
        },
    );
    match found {
        Some(i) => {
            conns.swap_remove(i);
            true
        }
        None => false,
    }
}

/// Make progress on one connection; false when it is done with.
fn service(c: &mut Conn, daemon: &Daemon, process: &Process) -> bool {
    if let Some(reply) = &c.reply {
        loop {
            match c.sock.write(&reply[c.sent..]) {
                Ok(0) => return false,
                Ok(n) => {
                    let now = Instant::now();
                    c.heard = Some(now);
                    c.stuck = Some(now);
                    c.sent += n;
                    if c.sent == reply.len() {
                        return false;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    // Silent from its last progress on, whatever it sends.
                    c.stuck.get_or_insert_with(Instant::now);
                    return true;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
    }
    let mut buf = [0u8; 2048];
    loop {
        match c.sock.read(&mut buf) {
            Ok(0) => return false,
            Ok(n) => {
                c.heard = Some(Instant::now());
                c.inbuf.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
        if c.inbuf.len() >= request::MAX_HEAD {
            break;
        }
    }
    let reply = match request::parse(&c.inbuf) {
        Parsed::Partial => return true,
        Parsed::Bad(why) => response(400, "Bad Request", "text/plain", format!("{why}\n"), false),
        Parsed::Done(h) => {
            let head_only = h.method == "HEAD";
            if h.method != "GET" && !head_only {
                response(
                    405,
                    "Method Not Allowed",
                    "text/plain",
                    "only GET\n".into(),
                    false,
                )
            } else if h.path != "/metrics" {
                response(
                    404,
                    "Not Found",
                    "text/plain",
                    "try /metrics\n".into(),
                    head_only,
                )
            } else {
                response(
                    200,
                    "OK",
                    "text/plain; version=0.0.4; charset=utf-8",
                    collect::render(daemon, process),
                    head_only,
                )
            }
        }
    };
    c.reply = Some(reply);
    service(c, daemon, process)
}

fn response(code: u16, reason: &str, ctype: &str, body: String, head_only: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\
         Connection: close\r\n",
        body.len()
    );
    if code == 405 {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    out
}
