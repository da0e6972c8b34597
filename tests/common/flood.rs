//! Attackers for the denial-of-service tests: a thread holding many sockets to
//! a server that never send a byte (or send a little, slowly, or send a lot
//! and never read the replies), reconnecting every one the server closes, for
//! a bounded time; a TCP connection from a chosen loopback address (a second
//! peer on one machine); and a raise of this process's open-file limit so it
//! can hold them.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where the attacker connects.
#[derive(Clone, Debug)]
pub enum Target {
    Unix(PathBuf),
    Tcp(SocketAddr),
    /// TCP from another loopback address (another peer than 127.0.0.1).
    TcpFrom(std::net::Ipv4Addr, SocketAddr),
}

impl Target {
    fn connect(&self) -> Option<OwnedFd> {
        match self {
            Target::Unix(p) => UnixStream::connect(p).ok().map(|s| {
                let _ = s.set_nonblocking(true);
                OwnedFd::from(s)
            }),
            Target::TcpFrom(from, to) => {
                connect_from(*from, *to, Duration::from_secs(1))
                    .ok()
                    .map(|s| {
                        let _ = s.set_nonblocking(true);
                        OwnedFd::from(s)
                    })
            }
            Target::Tcp(a) => TcpStream::connect_timeout(a, Duration::from_secs(1))
                .ok()
                .map(|s| {
                    let _ = s.set_nonblocking(true);
                    OwnedFd::from(s)
                }),
        }
    }
}

/// How an attacking socket behaves once connected.
#[derive(Clone, Debug)]
pub enum Behaviour {
    /// Sends nothing, ever.
    Silent,
    /// Sends these bytes one at a time, one every `every`, then nothing.
    Trickle { bytes: Vec<u8>, every: Duration },
    /// Sends these bytes at once (as fast as the socket takes them) and never
    /// reads a byte of what the server sends back.
    Unread(Vec<u8>),
}

/// What an attack did, once it ended.
#[derive(Debug, Default, Clone, Copy)]
pub struct FloodStats {
    /// Connections opened, the first `n` included.
    pub connects: u64,
    /// Connections the server closed (each was replaced).
    pub closed_by_server: u64,
    /// Connection attempts that failed (retried on the next round).
    pub failed_connects: u64,
}

/// A running attack; [`Flood::finish`] (or dropping it) stops it and closes
/// its sockets.
pub struct Flood {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<FloodStats>>,
}

struct Sock {
    fd: OwnedFd,
    sent: usize,
    next: Instant,
}

impl Flood {
    /// Keep `n` sockets connected to `target` until `for_at_most` has passed
    /// or the flood is finished. Each socket behaves as `how`; every one the
    /// server closes is opened again at once.
    pub fn start(target: Target, n: usize, how: Behaviour, for_at_most: Duration) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let handle = std::thread::spawn(move || run(&target, n, &how, for_at_most, &s));
        Flood {
            stop,
            handle: Some(handle),
        }
    }

    /// Stop the attack and say what it did.
    pub fn finish(mut self) -> FloodStats {
        self.stop.store(true, Ordering::SeqCst);
        self.handle
            .take()
            .map(|h| h.join().expect("the flood thread panicked"))
            .unwrap_or_default()
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn run(
    target: &Target,
    n: usize,
    how: &Behaviour,
    for_at_most: Duration,
    stop: &AtomicBool,
) -> FloodStats {
    use rustix::event::{PollFd, PollFlags, poll};
    let end = Instant::now() + for_at_most;
    let mut st = FloodStats::default();
    let mut socks: Vec<Sock> = Vec::with_capacity(n);
    let mut scratch = [0u8; 4096];
    while Instant::now() < end && !stop.load(Ordering::SeqCst) {
        // Top up to n.
        let mut tries = 0;
        while socks.len() < n && tries < n {
            tries += 1;
            match target.connect() {
                Some(fd) => {
                    st.connects += 1;
                    socks.push(Sock {
                        fd,
                        sent: 0,
                        next: Instant::now(),
                    });
                }
                None => {
                    st.failed_connects += 1;
                    break;
                }
            }
        }
        // Send what is due.
        let now = Instant::now();
        if let Behaviour::Unread(bytes) = how {
            for s in socks.iter_mut() {
                while s.sent < bytes.len() {
                    match rustix::net::send(
                        &s.fd,
                        &bytes[s.sent..],
                        rustix::net::SendFlags::NOSIGNAL,
                    ) {
                        Ok(n) => s.sent += n,
                        Err(_) => break,
                    }
                }
            }
        }
        if let Behaviour::Trickle { bytes, every } = how {
            for s in socks.iter_mut() {
                if s.sent < bytes.len() && s.next <= now {
                    if rustix::net::send(
                        &s.fd,
                        &bytes[s.sent..s.sent + 1],
                        rustix::net::SendFlags::NOSIGNAL,
                    )
                    .is_ok()
                    {
                        s.sent += 1;
                    }
                    s.next = now + *every;
                }
            }
        }
        // Wait for the server to close some (or send them something; an
        // attacker that never reads only looks for the hang-up).
        let unread = matches!(how, Behaviour::Unread(_));
        let watch = if unread {
            PollFlags::RDHUP
        } else {
            PollFlags::IN
        };
        let closed: Vec<usize> = {
            let mut fds: Vec<PollFd<'_>> =
                socks.iter().map(|s| PollFd::new(&s.fd, watch)).collect();
            let ts = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 20_000_000,
            };
            if poll(&mut fds, Some(&ts)).is_err() {
                continue;
            }
            fds.iter()
                .enumerate()
                .filter(|(_, f)| !f.revents().is_empty())
                .map(|(i, _)| i)
                .collect()
        };
        let mut gone = Vec::new();
        for i in closed {
            if unread {
                gone.push(i);
                continue;
            }
            loop {
                match rustix::io::read(socks[i].fd.as_fd(), &mut scratch) {
                    Ok(0) => {
                        gone.push(i);
                        break;
                    }
                    Ok(_) => continue,
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(_) => {
                        gone.push(i);
                        break;
                    }
                }
            }
        }
        for &i in gone.iter().rev() {
            st.closed_by_server += 1;
            socks.swap_remove(i);
        }
    }
    st
}

/// A TCP connection to `to` from the loopback address `from` (the whole of
/// 127/8 is loopback: a second peer on one machine), with `timeout` for
/// reads and writes.
pub fn connect_from(
    from: std::net::Ipv4Addr,
    to: SocketAddr,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None)?;
    bind(&fd, &SocketAddr::from((from, 0)))?;
    connect(&fd, &to)?;
    let s = TcpStream::from(fd);
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Raise this test process's open-file soft limit to its hard limit; returns
/// the limit, and panics if it is below `need`.
pub fn raise_nofile(need: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read or write the struct given.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    assert!(
        lim.rlim_max >= need,
        "this test needs an open-file hard limit of at least {need} (have {}); raise it \
         (ulimit -Hn, LimitNOFILE=)",
        lim.rlim_max
    );
    lim.rlim_max
}
