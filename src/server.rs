//! The server: listeners, the accept loop, signals, and the hand-off of negotiated
//! connections to reactors.
//!
//! Threads: the caller's thread runs the accept loop (`poll` on the listeners and
//! a signal pipe); each accepted connection gets a short-lived handshake thread
//! (bounded by a socket timeout); reactors run the transmission phase. Stopping
//! (SIGINT/SIGTERM): stop accepting, let each reactor finish and answer what it
//! has in flight, flush every device, remove the socket file.

use crate::control::server::{self as control, ControlError};
use crate::daemon::{Daemon, Endpoints};
use crate::engine::affinity::Peer;
use crate::engine::reactor::{self, NewConn, ReactorError, ReactorHandle};
use crate::nbd::handshake;
use rustix::event::{PollFd, PollFlags, poll};
use rustix::net::AddressFamily;
use std::io::Read;
use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// How long a client may take over the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("cannot create directory {0} for the socket")]
    SocketDir(PathBuf, #[source] std::io::Error),
    #[error("{0} is in use by another server (remove it or choose another --socket)")]
    SocketInUse(PathBuf),
    #[error("cannot listen on {0}")]
    BindUnix(PathBuf, #[source] std::io::Error),
    #[error("cannot listen on {0}")]
    BindTcp(String, #[source] std::io::Error),
    #[error("cannot set up signal handling")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Reactor(#[from] ReactorError),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("waiting for connections failed")]
    Poll(#[source] std::io::Error),
}

/// Where and how to serve.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// NBD Unix socket; `None` with no `listen` means the default path.
    pub socket: Option<PathBuf>,
    /// TCP addresses (`HOST:PORT`).
    pub listen: Vec<String>,
    /// Reactor threads (0 = one per core).
    pub reactors: usize,
    /// Keep each connection on the reactor it started on (never move it to the
    /// reactor running where its client runs).
    pub no_follow: bool,
    /// Move connections after their clients even on an idle machine (tests).
    pub follow_idle: bool,
    /// Longest adaptive busy-poll before a reactor sleeps (zero: never poll).
    pub poll: std::time::Duration,
    /// Control socket; `None` = no control socket.
    pub control: Option<PathBuf>,
    /// Bytes of request and reply buffers across the daemon (0 = the default,
    /// `engine::budget::DEFAULT_LIMIT`).
    pub memory_budget: usize,
}

/// The default socket directory: `/run/loopd` for root, else
/// `$XDG_RUNTIME_DIR/loopd`, else `/tmp/loopd-UID`.
pub fn default_socket_dir() -> PathBuf {
    let uid = rustix::process::geteuid();
    if uid.is_root() {
        return PathBuf::from("/run/loopd");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => Path::new(&d).join("loopd"),
        _ => PathBuf::from(format!("/tmp/loopd-{}", uid.as_raw())),
    }
}

fn bind_unix(path: &Path) -> Result<UnixListener, ServerError> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() && !dir.exists() {
            std::fs::create_dir_all(dir)
                .map_err(|e| ServerError::SocketDir(dir.to_path_buf(), e))?;
        }
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(ServerError::SocketInUse(path.to_path_buf()));
        }
        // A stale socket from a server that died: nobody answers on it.
        let _ = std::fs::remove_file(path);
    }
    UnixListener::bind(path).map_err(|e| ServerError::BindUnix(path.to_path_buf(), e))
}

fn uri_host(addr: &std::net::SocketAddr) -> String {
    match addr {
        std::net::SocketAddr::V4(a) => format!("{}:{}", a.ip(), a.port()),
        std::net::SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    }
}

/// A bound endpoint and the URI a client uses for it.
enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// The NBD socket path `opts` asks for (the default when nothing is given).
pub fn nbd_socket_path(opts: &ServeOptions) -> Option<PathBuf> {
    match (&opts.socket, opts.listen.is_empty()) {
        (Some(p), _) => Some(p.clone()),
        (None, true) => Some(default_socket_dir().join("loopd.sock")),
        (None, false) => None,
    }
}

/// Serve the daemon's exports until SIGINT or SIGTERM.
/// Prints one line per endpoint with its URI on stdout once ready.
pub fn serve(daemon: Arc<Daemon>, opts: &ServeOptions) -> Result<(), ServerError> {
    raise_open_file_limit();
    let mut listeners = Vec::new();
    let socket = nbd_socket_path(opts);
    if let Some(p) = &socket {
        listeners.push(Listener::Unix(bind_unix(p)?));
    }
    let mut tcp = Vec::new();
    for addr in &opts.listen {
        let l = TcpListener::bind(addr).map_err(|e| ServerError::BindTcp(addr.clone(), e))?;
        if let Ok(a) = l.local_addr() {
            tcp.push(uri_host(&a));
        }
        listeners.push(Listener::Tcp(l));
    }
    daemon.set_endpoints(Endpoints {
        unix: socket.clone(),
        tcp,
    });
    let control = match &opts.control {
        Some(p) => {
            let l = control::bind(p)?;
            control::spawn(l, Arc::clone(&daemon))?;
            Some(p.clone())
        }
        None => None,
    };

    let (sig_rx, sig_tx) = UnixStream::pair().map_err(ServerError::Signals)?;
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let tx = sig_tx.try_clone().map_err(ServerError::Signals)?;
        signal_hook::low_level::pipe::register(sig, tx).map_err(ServerError::Signals)?;
    }
    sig_rx.set_nonblocking(true).map_err(ServerError::Signals)?;

    let n = if opts.reactors == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        opts.reactors
    };
    let reactors: Vec<Arc<ReactorHandle>> = (0..n)
        .map(|i| reactor::spawn(i, opts.poll, opts.memory_budget))
        .collect::<Result<_, _>>()?;
    // Connections follow their clients between reactors (engine::affinity).
    if n > 1 && !opts.no_follow {
        for r in &reactors {
            r.set_peers(reactors.clone(), opts.follow_idle);
        }
    }
    daemon.set_reactors(reactors.clone());
    let reactors = Arc::new(reactors);
    daemon.run_janitor();

    let name = daemon
        .export("")
        .map(|e| e.name.clone())
        .unwrap_or_default();
    for uri in daemon.endpoints().uris(&name) {
        println!("{uri}");
    }
    if let Some(c) = &control {
        println!("control: {}", c.display());
    }
    for l in &listeners {
        let _ = match l {
            Listener::Unix(u) => u.set_nonblocking(true),
            Listener::Tcp(t) => t.set_nonblocking(true),
        };
    }

    let result = accept_loop(&listeners, &sig_rx, &daemon, &reactors);

    tracing::info!("stopping: finishing in-flight requests");
    daemon.set_stopping();
    daemon.write_state();
    for r in reactors.iter() {
        r.shutdown();
    }
    for e in daemon.all() {
        let (dev, _) = e.current();
        if !dev.read_only {
            if let Err(err) = rustix::fs::fdatasync(&dev.file) {
                tracing::error!("flushing {} failed: {err}", dev.path.display());
            }
        }
        tracing::info!("device {:?}: {}", e.name, e.stats.summary());
    }
    if let Some(p) = &socket {
        let _ = std::fs::remove_file(p);
    }
    if let Some(p) = &control {
        let _ = std::fs::remove_file(p);
    }
    result
}

fn accept_loop(
    listeners: &[Listener],
    sig_rx: &UnixStream,
    daemon: &Arc<Daemon>,
    reactors: &Arc<Vec<Arc<ReactorHandle>>>,
) -> Result<(), ServerError> {
    loop {
        let mut fds: Vec<PollFd<'_>> = listeners
            .iter()
            .map(|l| match l {
                Listener::Unix(u) => PollFd::new(u, PollFlags::IN),
                Listener::Tcp(t) => PollFd::new(t, PollFlags::IN),
            })
            .collect();
        fds.push(PollFd::new(sig_rx, PollFlags::IN));
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(ServerError::Poll(e.into())),
        }
        let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        if ready[listeners.len()] {
            let mut b = [0u8; 16];
            let mut r = sig_rx;
            let _ = r.read(&mut b);
            return Ok(());
        }
        for (l, _) in listeners.iter().zip(&ready).filter(|(_, r)| **r) {
            loop {
                let sock: OwnedFd = match l {
                    Listener::Unix(u) => match u.accept() {
                        Ok((s, _)) => s.into(),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => {
                            tracing::warn!("accept failed: {e}");
                            std::thread::sleep(ACCEPT_ERROR_PAUSE);
                            break;
                        }
                    },
                    Listener::Tcp(t) => match t.accept() {
                        Ok((s, _)) => {
                            let _ = s.set_nodelay(true);
                            s.into()
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => {
                            tracing::warn!("accept failed: {e}");
                            std::thread::sleep(ACCEPT_ERROR_PAUSE);
                            break;
                        }
                    },
                };
                start_handshake(sock, Arc::clone(daemon), Arc::clone(reactors));
            }
        }
    }
}

/// Every connection, backing file and spliced read holds descriptors; the common
/// soft limit of 1024 is low for a server. Raise it to the hard limit (failure
/// leaves it as it was).
fn raise_open_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        lim.current = lim.maximum;
        let _ = setrlimit(Resource::Nofile, lim);
    }
}

/// After an accept error other than "no connection waiting" (out of descriptors,
/// say), the listener stays readable: pause instead of spinning on it.
const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

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

/// Negotiate on a thread of its own, then hand the socket to the least-loaded
/// reactor.
fn start_handshake(sock: OwnedFd, daemon: Arc<Daemon>, reactors: Arc<Vec<Arc<ReactorHandle>>>) {
    let spawned = std::thread::Builder::new()
        .name("loopd-handshake".into())
        .spawn(move || {
            // Accepted sockets may inherit O_NONBLOCK from the listener: the handshake
            // is blocking, with a timeout.
            let mut stream = SockStream(sock);
            let _ = rustix::io::ioctl_fionbio(&stream.0, false);
            stream.set_timeouts(Some(HANDSHAKE_TIMEOUT));
            match handshake::negotiate(&mut stream, daemon.as_ref()) {
                Ok(Some(neg)) => {
                    stream.set_timeouts(None);
                    // The least loaded reactor that is making progress (a
                    // reactor held up inside a turn only if all are).
                    let Some(r) = reactors.iter().min_by_key(|r| {
                        let load = r.load.load(std::sync::atomic::Ordering::Relaxed);
                        (!r.making_progress(), load)
                    }) else {
                        return;
                    };
                    // Detached while we negotiated: drop the connection.
                    let Some(export) = daemon.export(&neg.dev.name) else {
                        return;
                    };
                    let domain = rustix::net::sockopt::socket_domain(&stream.0).ok();
                    widen_send_buffer(&stream.0, domain);
                    let peer = Peer::of(&stream.0, domain);
                    r.add(NewConn {
                        sock: stream.0,
                        export,
                        structured: neg.structured,
                        meta_context: neg.meta_context,
                        peer,
                    });
                }
                Ok(None) => {}
                Err(e) => tracing::info!("handshake failed: {e}"),
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start a handshake thread: {e}");
    }
}

/// A connected stream socket (Unix or TCP) as blocking `Read + Write`.
struct SockStream(OwnedFd);

impl SockStream {
    fn set_timeouts(&self, t: Option<Duration>) {
        use rustix::net::sockopt::{Timeout, set_socket_timeout};
        let _ = set_socket_timeout(&self.0, Timeout::Recv, t);
        let _ = set_socket_timeout(&self.0, Timeout::Send, t);
    }
}

impl std::io::Read for SockStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        Ok(rustix::io::read(&self.0, buf)?)
    }
}

impl std::io::Write for SockStream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(rustix::net::send(
            &self.0,
            buf,
            rustix::net::SendFlags::NOSIGNAL,
        )?)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
