//! The metrics server: one thread, `poll(2)` over the listener and at most
//! [`MAX_SCRAPERS`] connections, each with a [`DEADLINE`] for its whole
//! exchange, so a stalled scraper holds neither the thread nor a slot for long.
//! One request per connection (`Connection: close`).

use super::collect::{self, Process};
use super::request::{self, Parsed};
use crate::daemon::Daemon;
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connections served at once; more wait in the listen backlog.
pub const MAX_SCRAPERS: usize = 64;
/// How long one connection may take, from accept to the last byte sent.
pub const DEADLINE: Duration = Duration::from_secs(10);

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
    fn accept(&self) -> std::io::Result<Stream> {
        let s = match self {
            Listener::Tcp(l) => Stream::Tcp(l.accept()?.0),
            Listener::Unix(l) => Stream::Unix(l.accept()?.0),
        };
        match &s {
            Stream::Tcp(t) => t.set_nonblocking(true)?,
            Stream::Unix(u) => u.set_nonblocking(true)?,
        }
        Ok(s)
    }
}

struct Conn {
    sock: Stream,
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

fn serve(l: &Listener, daemon: &Daemon, process: &Process) {
    let mut conns: Vec<Conn> = Vec::new();
    loop {
        let now = Instant::now();
        conns.retain(|c| c.deadline > now);
        let timeout = conns
            .iter()
            .map(|c| c.deadline.saturating_duration_since(now))
            .min()
            .map(|d| d.max(Duration::from_millis(1)));
        let (listener_ready, ready) = {
            let mut fds = Vec::with_capacity(conns.len() + 1);
            // A full table stops accepting; the backlog holds the rest.
            let accepting = conns.len() < MAX_SCRAPERS;
            fds.push(PollFd::from_borrowed_fd(
                l.fd(),
                if accepting {
                    PollFlags::IN
                } else {
                    PollFlags::empty()
                },
            ));
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
            (accepting && !fds[0].revents().is_empty(), ready)
        };
        // Highest index first, so swap_remove never moves one still to visit.
        for &i in ready.iter().rev() {
            if !service(&mut conns[i], daemon, process) {
                conns.swap_remove(i);
            }
        }
        if listener_ready {
            while conns.len() < MAX_SCRAPERS {
                match l.accept() {
                    Ok(sock) => conns.push(Conn {
                        sock,
                        deadline: Instant::now() + DEADLINE,
                        inbuf: Vec::new(),
                        reply: None,
                        sent: 0,
                    }),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        // EMFILE and the like: try again on the next round.
                        tracing::warn!("metrics: accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                        break;
                    }
                }
            }
        }
    }
}

/// Make progress on one connection; false when it is done with.
fn service(c: &mut Conn, daemon: &Daemon, process: &Process) -> bool {
    if let Some(reply) = &c.reply {
        loop {
            match c.sock.write(&reply[c.sent..]) {
                Ok(0) => return false,
                Ok(n) => {
                    c.sent += n;
                    if c.sent == reply.len() {
                        return false;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
    }
    let mut buf = [0u8; 2048];
    loop {
        match c.sock.read(&mut buf) {
            Ok(0) => return false,
            Ok(n) => c.inbuf.extend_from_slice(&buf[..n]),
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
