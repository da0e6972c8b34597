//! The server: listeners, the accept loop, signals, and the hand-off of negotiated
//! connections to reactors.
//!
//! Start-up is two steps: [`bind`] reads the certificates and binds every socket
//! (or takes those systemd passed, see [`activation`]) and starts no thread, so
//! a caller may still fork; [`run`] starts the threads, tells its [`Hooks`] when
//! it is ready, serves, and on the way out removes the socket files `bind` made
//! (never activated ones, and only while their paths still name them: see
//! [`owned`]).
//!
//! Threads: the caller's thread runs the accept loop, which also runs every
//! pending handshake (see [`accept`]); reactors run the transmission phase; the
//! control socket has its own threads. Stopping (SIGINT/SIGTERM): stop accepting,
//! let each reactor finish and answer what it has in flight, flush every device,
//! remove the socket files.

mod accept;
pub mod activation;
pub mod daemonize;
pub mod fd_table;
pub mod listen;
pub mod notify;
pub mod owned;
mod pending;
pub mod pidfile;
mod quiet;

use crate::daemon::control_socket::{self as control, ControlError};
use crate::daemon::{ClosedState, Daemon, Endpoints, reserved_fds};
use crate::engine::admit::Admission;
use crate::frontend::nbd::handshake::{Policy, TlsMode};
use crate::metrics::{self, MetricsError};
use crate::reactor::{self, ReactorError, ReactorHandle};
use crate::tls::{TlsContext, TlsError, TlsFiles};
use activation::{Activated, NbdSocket};
use listen::Listener;
pub use listen::{ListenError, default_socket_dir};
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Default for `--max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default for `--handshake-timeout`.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Listen backlog of the NBD and metrics sockets loopd binds: as deep as the
/// kernel allows (`listen(2)` caps it at `net.core.somaxconn`).
const BACKLOG: i32 = i32::MAX;
/// Default mode of the NBD Unix socket (owner only; see `--socket-mode`).
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;
/// Mode of the control socket: owner only, always (`docs/control.md` says how
/// to let others in).
const CONTROL_SOCKET_MODE: u32 = 0o600;

#[derive(Debug, Error)]
pub enum ServerError {
    #[error(transparent)]
    Listen(#[from] ListenError),
    #[error("cannot set up signal handling")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Reactor(#[from] ReactorError),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("waiting for connections failed")]
    Poll(#[source] std::io::Error),
    /// The block device of `serve IMAGE --blockdev` (its class is the
    /// control path's: a missing module is `unavailable`).
    #[error(transparent)]
    Blockdev(Box<crate::daemon::CtlError>),
    #[error("TLS")]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    #[error("--tls {0} needs --tls-certs DIR (with ca-cert.pem, server-cert.pem, server-key.pem)")]
    TlsNoCerts(&'static str),
}

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// NBD Unix socket; `None` with no `listen` means the default path.
    pub socket: Option<PathBuf>,
    /// Mode of the NBD Unix socket.
    pub socket_mode: u32,
    /// Group of the NBD Unix socket (name or number).
    pub socket_group: Option<String>,
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
    pub poll: Duration,
    /// Control socket; `None` = no control socket.
    pub control: Option<PathBuf>,
    /// NBD connections at most (handshakes included).
    pub max_connections: usize,
    /// NBD connections at most from one peer (0: no limit of its own; at
    /// `max_connections` places are shared out, see `engine::admit`).
    pub max_connections_per_peer: usize,
    /// Deadline for a client's whole handshake.
    pub handshake_timeout: Duration,
    /// Refuse `NBD_OPT_LIST`.
    pub no_list: bool,
    /// Whether clients may (`On`) or must (`Require`) use TLS.
    pub tls: TlsMode,
    /// Certificates for TLS (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`).
    pub tls_certs: Option<PathBuf>,
    /// Require client certificates that chain to `ca-cert.pem`.
    pub tls_verify_peer: bool,
    /// Hand TLS sessions to the kernel (kTLS) where it can take them.
    pub ktls: bool,
    /// How long a control client may stay idle.
    pub control_idle: Duration,
    /// Bytes of request and reply buffers across the daemon (0 = the default,
    /// `engine::budget::DEFAULT_LIMIT`).
    pub memory_budget: usize,
    /// How long a connection holding budget others wait for may make no
    /// progress (zero: never cut off; see `engine::budget`).
    pub reply_timeout: Duration,
    /// Prometheus endpoint: TCP `HOST:PORT`, or a Unix socket path (with a `/`).
    pub metrics: Option<String>,
    /// Mode of the metrics Unix socket.
    pub metrics_mode: u32,
    /// A stop leaves the block devices to the next daemon on the same state
    /// file instead of removing them (`--keep-blockdevs`).
    pub keep_blockdevs: bool,
}

impl Default for ServeOptions {
    fn default() -> ServeOptions {
        ServeOptions {
            socket: None,
            socket_mode: DEFAULT_SOCKET_MODE,
            socket_group: None,
            listen: Vec::new(),
            reactors: 0,
            no_follow: false,
            follow_idle: false,
            poll: Duration::ZERO,
            control: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: 0,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            no_list: false,
            tls: TlsMode::Off,
            tls_certs: None,
            tls_verify_peer: false,
            ktls: true,
            control_idle: control::IDLE_TIMEOUT,
            memory_budget: 0,
            reply_timeout: crate::engine::budget::DEFAULT_REPLY_TIMEOUT,
            metrics: None,
            metrics_mode: DEFAULT_SOCKET_MODE,
            keep_blockdevs: false,
        }
    }
}

/// The NBD socket path `opts` asks for (the default when nothing is given).
pub fn nbd_socket_path(opts: &ServeOptions) -> Option<PathBuf> {
    match (&opts.socket, opts.listen.is_empty()) {
        (Some(p), _) => Some(p.clone()),
        (None, true) => Some(default_socket_dir().join("loopd.sock")),
        (None, false) => None,
    }
}

/// `--max-connections` as the open-file limit allows it (at least one).
fn connection_limit(asked: usize, reactors: usize) -> usize {
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let room = nofile
        .saturating_sub(reserved_fds(reactors))
        .max(nofile / 2);
    let fit = usize::try_from(room).unwrap_or(usize::MAX).max(1);
    if fit < asked {
        tracing::warn!(
            "--max-connections {asked} lowered to {fit}: the open-file limit is {nofile} and \
             {} descriptors are kept for the control plane, images and reactors",
            nofile - room
        );
        return fit;
    }
    asked
}

/// Everything [`bind`] made ready: the NBD listeners, the control socket, the
/// TLS certificates. Dropping it removes the socket files it bound (never
/// activated ones).
pub struct Bound {
    listeners: Vec<Listener>,
    control: Option<(UnixListener, Option<PathBuf>)>,
    endpoints: Endpoints,
    tls: Option<Arc<TlsContext>>,
    metrics: Option<metrics::http::Listener>,
    /// The lines printed after the URIs, before `control:` (TCP bind
    /// addresses a client cannot use as they are, the metrics URL).
    notes: Vec<String>,
    files: SocketFiles,
}

/// Socket files this server bound, removed when dropped (on every exit path)
/// if their paths still name them ([`owned::Owned::remove`]).
#[derive(Default)]
struct SocketFiles(Vec<owned::Owned>);

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for o in &self.0 {
            o.remove();
        }
    }
}

/// Read the certificates and bind every socket: the activated ones `act`, else
/// `--socket` (or the default path) and `--listen`, and the control socket.
/// Starts no thread; on error, removes the socket files it bound. What it
/// keeps for printing works from any directory and any host: socket paths
/// absolute, a listener on every address (`0.0.0.0`, `[::]`) as a loopback
/// URI plus a line naming the bind address, and the metrics URL.
pub fn bind(opts: &ServeOptions, act: Activated) -> Result<Bound, ServerError> {
    raise_open_file_limit();
    // Certificates are read before anything is bound: a bad one stops here.
    let tls = tls_context(opts)?;
    let group = opts
        .socket_group
        .as_deref()
        .map(listen::group_id)
        .transpose()?;
    let mut files = SocketFiles::default();
    let mut listeners = Vec::new();
    let mut tcp = Vec::new();
    let mut unix = None;
    let mut notes = Vec::new();
    let activated_nbd = act.nbd.len();
    if !act.nbd.is_empty() {
        for s in act.nbd {
            match s {
                NbdSocket::Unix(l, p) => {
                    unix = unix.or(p.map(|p| absolute(&p)));
                    listeners.push(Listener::Unix(l));
                }
                NbdSocket::Tcp(l) => {
                    if let Ok(a) = l.local_addr() {
                        if let Some(w) = listen::exposure_warning(a, opts.tls == TlsMode::Require) {
                            tracing::warn!("{w}");
                        }
                        tcp.push(listen::uri_host(&listen::client_addr(a)));
                        notes.extend(listen::bind_note(a));
                    }
                    listeners.push(Listener::Tcp(l));
                }
            }
        }
    } else {
        let socket = nbd_socket_path(opts);
        // The default runtime directory is checked before anything is put in it.
        let default_dir = default_socket_dir();
        let in_default =
            |p: Option<&PathBuf>| p.and_then(|p| p.parent()) == Some(default_dir.as_path());
        if in_default(socket.as_ref()) || in_default(opts.control.as_ref()) {
            listen::ensure_runtime_dir(&default_dir)?;
        }
        if let Some(p) = &socket {
            let (l, o) = listen::bind_unix(p, opts.socket_mode, group, listen::Hint::Socket)?;
            files.0.push(o);
            listeners.push(Listener::Unix(l));
            unix = Some(absolute(p));
        }
        for addr in &opts.listen {
            let l = listen::bind_tcp(addr, opts.tls == TlsMode::Require)?;
            if let Ok(a) = l.local_addr() {
                tcp.push(listen::uri_host(&listen::client_addr(a)));
                notes.extend(listen::bind_note(a));
            }
            listeners.push(Listener::Tcp(l));
        }
    }
    let control = match (act.control, &opts.control) {
        (Some(c), _) => Some(c),
        (None, Some(p)) => {
            if let Some(dir) = p.parent() {
                if dir == default_socket_dir() {
                    listen::ensure_runtime_dir(dir)?;
                }
            }
            let (l, o) = listen::bind_unix(p, CONTROL_SOCKET_MODE, None, listen::Hint::Control)?;
            files.0.push(o);
            Some((l, Some(absolute(p))))
        }
        (None, None) => None,
    };
    let metrics = match &opts.metrics {
        Some(a) if a.contains('/') => {
            let p = PathBuf::from(a);
            let (l, o) = listen::bind_unix(&p, opts.metrics_mode, None, listen::Hint::Metrics)?;
            files.0.push(o);
            notes.push(format!(
                "metrics: http://localhost/metrics --unix-socket {}",
                absolute(&p).display()
            ));
            Some(metrics::http::Listener::Unix(l))
        }
        Some(a) => {
            let l = TcpListener::bind(a).map_err(|e| MetricsError::BindTcp(a.clone(), e))?;
            if let Ok(bound) = l.local_addr() {
                if let Some(w) = listen::metrics_exposure_warning(bound) {
                    tracing::warn!("{w}");
                }
                let host = listen::uri_host(&listen::client_addr(bound));
                let every = if bound.ip().is_unspecified() {
                    format!(
                        " (listening on {}, every address)",
                        listen::uri_host(&bound)
                    )
                } else {
                    String::new()
                };
                notes.push(format!("metrics: http://{host}/metrics{every}"));
            }
            Some(metrics::http::Listener::Tcp(l))
        }
        None => None,
    };
    // A deep backlog for the metrics endpoint too (see BACKLOG).
    match &metrics {
        Some(metrics::http::Listener::Tcp(t)) => {
            let _ = rustix::net::listen(t, BACKLOG);
        }
        Some(metrics::http::Listener::Unix(u)) => {
            let _ = rustix::net::listen(u, BACKLOG);
        }
        None => {}
    }
    for l in &listeners {
        let _ = match l {
            Listener::Unix(u) => u.set_nonblocking(true),
            Listener::Tcp(t) => t.set_nonblocking(true),
        };
    }
    if activated_nbd == 0 {
        // The standard library listens with a backlog of 128: a burst of
        // reconnects (a flood the accept loop is closing) would fill it and
        // make the kernel drop a real client's SYN, which it then resends
        // only after a second. Listen again with the kernel's maximum
        // (`net.core.somaxconn`). Activated sockets keep the unit's Backlog=.
        for l in &listeners {
            let _ = rustix::net::listen(l.as_fd(), BACKLOG);
        }
    }
    Ok(Bound {
        listeners,
        control,
        endpoints: Endpoints {
            unix,
            tcp,
            tls: opts.tls != TlsMode::Off,
        },
        tls,
        metrics,
        notes,
        files,
    })
}

/// `p` made absolute against the current directory, for the paths loopd
/// prints (URIs, `control:`): they must work from any directory. (Lexical,
/// as `std::path::absolute`; `p` as it is if the current directory is gone.)
fn absolute(p: &std::path::Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Called once when the server is ready.
pub type ReadyHook = Box<dyn FnOnce(&Daemon)>;
/// Called on every SIGHUP, on the signal thread, with who sent it.
pub type SighupHook = Box<dyn Fn(&Daemon, SignalSender) + Send>;

/// Who sent a signal, as the kernel reports it (`siginfo`'s `si_pid` and
/// `si_uid`); `None` when the signal did not come from a process (`kill`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SignalSender {
    pub pid: Option<i32>,
    pub uid: Option<u32>,
}

impl std::fmt::Display for SignalSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.pid, self.uid) {
            (Some(p), Some(u)) => write!(f, "signal SIGHUP from pid={p} uid={u}"),
            _ => f.write_str("signal SIGHUP (sender unknown)"),
        }
    }
}

/// What the embedding program hears from [`run`].
#[derive(Default)]
pub struct Hooks {
    /// Called once every socket listens and the devices asked for at start
    /// are up, just before the first connection is accepted.
    pub on_ready: Option<ReadyHook>,
    /// Called on SIGHUP instead of [`Daemon::reload`], on the signal thread
    /// (it calls it, and tells the service manager).
    pub on_sighup: Option<SighupHook>,
    /// Called once SIGTERM/SIGINT arrived, before the devices are stopped.
    pub on_stopping: Option<Box<dyn FnOnce()>>,
}

/// Serve the daemon's exports until SIGINT or SIGTERM.
/// Prints one line per endpoint with its URI on stdout once ready.
pub fn serve(daemon: Arc<Daemon>, opts: &ServeOptions) -> Result<(), ServerError> {
    let bound = bind(opts, Activated::default())?;
    run(daemon, bound, opts, Hooks::default())
}

/// Serve on what [`bind`] bound until SIGINT or SIGTERM, then remove the
/// socket files it made.
pub fn run(
    daemon: Arc<Daemon>,
    bound: Bound,
    opts: &ServeOptions,
    hooks: Hooks,
) -> Result<(), ServerError> {
    let Bound {
        listeners,
        control,
        endpoints,
        tls,
        metrics,
        notes,
        files,
    } = bound;
    daemon.set_endpoints(endpoints);
    if let Some(t) = &tls {
        daemon.set_tls(Arc::clone(t));
    }
    for e in daemon.all() {
        daemon.warn_if_unreachable(&e.name);
    }
    let control = match control {
        Some((l, p)) => {
            control::spawn(l, Arc::clone(&daemon), opts.control_idle)?;
            p
        }
        None => None,
    };

    let (sig_rx, sig_tx) = UnixStream::pair().map_err(ServerError::Signals)?;
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let tx = sig_tx.try_clone().map_err(ServerError::Signals)?;
        signal_hook::low_level::pipe::register(sig, tx).map_err(ServerError::Signals)?;
    }
    sig_rx.set_nonblocking(true).map_err(ServerError::Signals)?;
    reload_on_sighup(&daemon, hooks.on_sighup)?;
    let (kick_rx, kick_tx) = UnixStream::pair().map_err(ServerError::Signals)?;
    kick_rx
        .set_nonblocking(true)
        .map_err(ServerError::Signals)?;
    kick_tx
        .set_nonblocking(true)
        .map_err(ServerError::Signals)?;
    daemon.set_handshake_kick(Box::new(move || {
        let _ = (&kick_tx).write(&[1]);
    }));

    let n = if opts.reactors == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        opts.reactors
    };
    crate::engine::budget::global().set_reply_timeout(opts.reply_timeout);
    let reactors: Vec<Arc<ReactorHandle>> = (0..n)
        .map(|i| reactor::spawn(i, opts.poll, opts.memory_budget))
        .collect::<Result<_, _>>()?;
    // Connections follow their clients between reactors (frontend::nbd::affinity).
    if n > 1 && !opts.no_follow {
        for r in &reactors {
            r.set_peers(reactors.clone(), opts.follow_idle);
        }
    }
    daemon.set_reactors(reactors.clone());
    if let Some(l) = metrics {
        let p = metrics::collect::Process {
            start_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            reactors: n,
        };
        metrics::http::spawn(l, Arc::clone(&daemon), p).map_err(MetricsError::Spawn)?;
    }
    // Block devices need the reactors: those asked for at start are made now.
    let mut failed = None;
    let default = daemon.export("").map(|e| e.name.clone());
    for (name, r) in daemon.start_pending_blockdevs() {
        match r {
            Ok(path) => println!("{}", path.display()),
            Err(e) if default.as_deref() == Some(name.as_str()) => {
                failed = Some(e);
            }
            Err(e) => tracing::error!("{}", e.body().message),
        }
    }
    if let Some(e) = failed {
        // A start that failed removes what it made.
        let closed = stop(&daemon, &reactors, false);
        let_go(&daemon, closed);
        drop(files);
        return Err(ServerError::Blockdev(Box::new(e)));
    }
    daemon.run_janitor();
    daemon.run_follower();
    let max = connection_limit(opts.max_connections, n);
    let admission = match opts.max_connections_per_peer {
        0 => Admission::new(max),
        per_peer => Admission::with_per_peer(max, per_peer),
    };

    let name = daemon
        .export("")
        .map(|e| e.name.clone())
        .unwrap_or_default();
    for uri in daemon.endpoints().uris(&name) {
        println!("{uri}");
    }
    for n in &notes {
        println!("{n}");
    }
    if let Some(c) = &control {
        println!("control: {}", c.display());
    }
    if let Some(f) = hooks.on_ready {
        f(&daemon);
    }

    let cfg = accept::AcceptConfig {
        handshake_timeout: opts.handshake_timeout,
        policy: Policy {
            list: !opts.no_list,
            tls: opts.tls,
        },
        admission,
        tls,
        ktls: opts.ktls,
    };
    let result = accept::AcceptLoop::new(&listeners, &sig_rx, &kick_rx, &daemon, &reactors, cfg)
        .run()
        .map_err(|e| ServerError::Poll(e.into()));

    if let Some(f) = hooks.on_stopping {
        f();
    }
    tracing::info!("stopping: finishing in-flight requests");
    let closed = stop(&daemon, &reactors, opts.keep_blockdevs);
    let_go(&daemon, closed);
    drop(files);
    result
}

/// SIGHUP re-reads the TLS certificates and the config file
/// ([`Daemon::reload_audited`], which logs an audit line naming the sender),
/// or calls `hook`, which does (and never stops the daemon).
fn reload_on_sighup(daemon: &Arc<Daemon>, hook: Option<SighupHook>) -> Result<(), ServerError> {
    use signal_hook::iterator::{SignalsInfo, exfiltrator::WithOrigin};
    let mut signals = SignalsInfo::<WithOrigin>::new([signal_hook::consts::SIGHUP])
        .map_err(ServerError::Signals)?;
    let daemon = Arc::clone(daemon);
    std::thread::Builder::new()
        .name("loopd-sighup".into())
        .spawn(move || {
            for origin in signals.forever() {
                let from = SignalSender {
                    pid: origin.process.map(|p| p.pid),
                    uid: origin.process.map(|p| p.uid),
                };
                match &hook {
                    Some(h) => h(&daemon, from),
                    // Logged by reload (a config that does not parse too).
                    None => {
                        let _ = daemon.reload_audited(&from.to_string());
                    }
                }
            }
        })
        .map_err(ServerError::Signals)?;
    Ok(())
}

/// The TLS certificates, when TLS is on or required.
fn tls_context(opts: &ServeOptions) -> Result<Option<Arc<TlsContext>>, ServerError> {
    let mode = match opts.tls {
        TlsMode::Off => return Ok(None),
        TlsMode::On => "on",
        TlsMode::Require => "require",
    };
    let Some(dir) = &opts.tls_certs else {
        return Err(ServerError::TlsNoCerts(mode));
    };
    let ctx = TlsContext::new(TlsFiles {
        dir: dir.clone(),
        verify_peer: opts.tls_verify_peer,
    })?;
    Ok(Some(Arc::new(ctx)))
}

/// Stop serving: no new requests, block devices removed (their queues keep
/// commands in the reactors' rings until the kernel is told to stop them) or,
/// with `keep_blockdevs`, left to the next daemon (quiesced where the kernel
/// can; their queues are let go of, not stopped), the state file closed to
/// changes (still locked: see [`let_go`]), then every reactor drained and
/// stopped.
fn stop(daemon: &Daemon, reactors: &[Arc<ReactorHandle>], keep_blockdevs: bool) -> ClosedState {
    daemon.set_stopping();
    if keep_blockdevs {
        daemon.leave_blockdevs();
    } else {
        daemon.remove_blockdevs();
    }
    let closed = daemon.close_state();
    for r in reactors {
        if keep_blockdevs {
            r.shutdown_leaving_ublk();
        } else {
            r.shutdown();
        }
    }
    closed
}

/// After [`stop`]: every device flushed and its RBD lock released, and only
/// then the state file's lock (dropping `closed`) — a daemon started on the
/// same state file meanwhile is refused, never handed a record whose RBD lock
/// owner is still alive here (it would break that lock as its dead self's).
fn let_go(daemon: &Daemon, closed: ClosedState) {
    for e in daemon.all() {
        let (dev, _) = e.current();
        // A device this run never wrote to has nothing of ours to flush (with
        // thousands of idle devices, one fdatasync each made a stop last
        // seconds).
        let s = &e.stats;
        let wrote = [&s.writes, &s.trims, &s.write_zeroes]
            .iter()
            .any(|c| c.load(std::sync::atomic::Ordering::Relaxed) > 0);
        if !dev.read_only && wrote {
            if let Err(err) = dev.sync_data() {
                tracing::error!(
                    "flushing {} failed: {err}",
                    crate::text::quoted_path(&dev.path)
                );
            }
        }
        // An RBD image's exclusive lock goes now (the process exits
        // without closing the image).
        if let Some(r) = dev.backend().as_rbd() {
            r.release_lock();
        }
        tracing::info!("device {:?}: {}", e.name, e.stats.summary());
    }
    drop(closed);
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
