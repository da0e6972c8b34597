//! `loopd serve`: the server's options and its start-up (state, IMAGE, config,
//! restore), then the server loop until SIGTERM/SIGINT. A start-up failure is
//! classed as the control path classes the same failure ([`super::exit`]):
//! checks of its own use [`Classed`].

use super::args::DeviceArgs;
use super::exit::{Classed, DaemonError};
use super::log;
use super::syslog::Syslog;
use anyhow::{Context, Result, bail};
use loopd::daemon::{self, Daemon};
use loopd::frontend::nbd::handshake::TlsMode;
use loopd::server::activation::{self, Activated};
use loopd::server::daemonize::{self, ReadyPipe};
use loopd::server::notify::Notifier;
use loopd::server::pidfile::{self, PidFile};
use loopd::server::{self, Hooks, ServeOptions};
use std::cell::RefCell;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The image file (or block device, or RBD image `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]`)
    /// to serve; optional: without it the server starts with the devices of
    /// --config and the state file only.
    image: Option<PathBuf>,
    #[command(flatten)]
    dev: DeviceArgs,
    /// NBD Unix socket to listen on [default: /run/loopd/loopd.sock for root,
    /// else $XDG_RUNTIME_DIR/loopd/loopd.sock; none when systemd passes NBD
    /// sockets (LISTEN_FDS, FileDescriptorName=nbd)]. Only a stale socket there
    /// is replaced; any other file is refused and left as it is (so are
    /// --control's and --metrics'). `-k` as in qemu-nbd.
    #[arg(long, short = 'k', value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Mode of the NBD Unix socket, in octal. Connecting needs write permission:
    /// 600 lets only this user in; 660 with --socket-group lets a group in.
    #[arg(long, value_name = "MODE", default_value = "600", value_parser = parse_mode)]
    socket_mode: u32,
    /// Group of the NBD Unix socket (name or number), e.g. `disk`, with
    /// --socket-mode 660.
    #[arg(long, value_name = "GROUP")]
    socket_group: Option<String>,
    /// Also (or only) listen on TCP: HOST:PORT, HOST (NBD's port 10809), :PORT
    /// (every IPv4 address), [IPV6]:PORT. Repeatable. Without --tls require any
    /// host that reaches the address can use the devices, so loopd warns unless
    /// it is a loopback address. For an address of every interface (0.0.0.0,
    /// [::]) the printed URIs name loopback, and a line says where it binds.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_listen)]
    listen: Vec<String>,
    /// Listen on TCP PORT of every IPv4 address, as qemu-nbd's -p (which
    /// binds 0.0.0.0): the same as --listen 0.0.0.0:PORT, warning included
    /// (--listen 127.0.0.1:PORT keeps it to this host). Unlike qemu-nbd, -k
    /// does not turn it off: loopd listens on both.
    #[arg(long, short = 'p', value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    port: Option<u16>,
    /// Accepted for qemu-nbd's -t (keep serving after the last client
    /// disconnects): loopd always does, until SIGTERM.
    #[arg(long, short = 't')]
    persistent: bool,
    /// Accepted for qemu-nbd's --aio: loopd always does its file I/O through
    /// io_uring, one ring per reactor, whatever MODE says (`threads` and
    /// `native` are told so at start).
    #[arg(long, value_enum, value_name = "MODE")]
    aio: Option<Aio>,
    /// TLS for NBD clients (STARTTLS), as nbdkit's --tls: `off`; `on` offers it
    /// and lets clients choose; `require` refuses every option but STARTTLS
    /// until TLS is up [default: off, or on with --tls-certs]. Applies to the
    /// Unix socket and TCP alike; printed URIs become nbds://.
    #[arg(long, value_enum, value_name = "MODE")]
    tls: Option<TlsArg>,
    /// Directory of the server's certificates, in the layout of nbdkit and QEMU:
    /// ca-cert.pem (the CA clients' certificates must chain to, with
    /// --tls-verify-peer), server-cert.pem, server-key.pem, and optionally
    /// ca-crl.pem (revoked client certificates, with --tls-verify-peer). Re-read
    /// on SIGHUP and `loopd reload-tls`.
    #[arg(long, value_name = "DIR")]
    tls_certs: Option<PathBuf>,
    /// Require a client certificate that chains to ca-cert.pem; its identities
    /// are what a device's --tls-allow matches.
    #[arg(long)]
    tls_verify_peer: bool,
    /// Keep TLS records in userspace even where the kernel could take the keys
    /// (kTLS). By default a session's keys go to the kernel after the handshake
    /// where it has kTLS (module `tls`), so replies are sent and spliced as
    /// without TLS.
    #[arg(long)]
    no_ktls: bool,
    /// NBD connections at most, handshakes included. At it a newcomer takes
    /// the place of the handshake that shows least sign of life (silent
    /// longest, from the peer holding most); else, if another peer (IPv4
    /// address, IPv6 /64, Unix-socket user) holds two places more than the
    /// newcomer's, that peer's newest connection is closed for it; else the
    /// newcomer, whose peer holds as many as anyone, is closed at once. One
    /// peer may use every place while nobody else wants one. Lowered to what
    /// the open-file limit allows.
    #[arg(long, value_name = "N", default_value_t = server::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// NBD connections at most from one peer (IPv4 address, IPv6 /64,
    /// Unix-socket user), handshakes included; past it that peer's newcomer
    /// is refused, unless one of its own handshakes (the one with least sign
    /// of life) can make room.
    /// Default: no limit of its own (up to --max-connections, shared out
    /// between peers when it is reached).
    #[arg(long, value_name = "N")]
    max_connections_per_peer: Option<usize>,
    /// Seconds a client has for its whole handshake (from connecting until it
    /// selects an export). One silent a quarter of it (at most 2 s) after
    /// connecting is the first to go when room is needed.
    #[arg(long, value_name = "SECS", default_value_t = server::DEFAULT_HANDSHAKE_TIMEOUT.as_secs_f64())]
    handshake_timeout: f64,
    /// Refuse NBD_OPT_LIST: clients cannot list the export names.
    #[arg(long)]
    no_list: bool,
    /// Seconds a control client may stay silent before it is closed (tests).
    #[arg(long, hide = true, value_name = "SECS", default_value_t = 60.0)]
    control_idle_timeout: f64,
    /// TOML file of devices to attach at start ([[device]] tables with image,
    /// name, offset, size_limit, block_size, cache, read_only, autoclear, shared,
    /// format); re-read on SIGHUP and `loopd reload`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Control socket (mode 0600) [default: the one systemd passes named
    /// `control`, else beside the NBD socket, with extension .ctl].
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Serve Prometheus metrics (GET /metrics) on HOST:PORT, or on a Unix
    /// socket at PATH (any value with a `/`, e.g. ./metrics.sock); see
    /// docs/metrics.md. Its URL is printed at start with the endpoints; loopd
    /// warns unless HOST is a loopback address (metrics have no authentication).
    #[arg(long, value_name = "ADDR|PATH")]
    metrics: Option<String>,
    /// Mode of the metrics Unix socket, in octal.
    #[arg(long, value_name = "MODE", default_value = "600", value_parser = parse_mode)]
    metrics_mode: u32,
    /// State file: devices attached over the control socket, restored at start
    /// (beside it, STATE.rbd-owners: the RBD lock owners of the other devices);
    /// one daemon per state file [default: /var/lib/loopd/STEM.state for root,
    /// else $XDG_STATE_HOME/loopd/STEM.state (~/.local/state/loopd/), STEM being
    /// the control socket's file stem].
    #[arg(long, value_name = "FILE")]
    state: Option<PathBuf>,
    /// Write the daemon's pid to FILE once it serves; removed at exit (unless
    /// FILE was replaced meanwhile). Only a stale pid file (one pid and a
    /// newline, of a process that is gone) is replaced; one a running loopd
    /// holds, one of a running process, and any other file are refused.
    #[arg(long, value_name = "FILE")]
    pid_file: Option<PathBuf>,
    /// Run in the background (for scripts without systemd): return once the
    /// daemon serves (sockets bound, devices attached and restored), or print
    /// its start-up error and exit non-zero. Best with --pid-file. Its log
    /// lines then go to --log-file, else to syslog (--syslog-socket), else (no
    /// syslog socket) to the state file's path with extension .log; which one
    /// is said before it forks.
    #[arg(long)]
    fork: bool,
    /// Append log lines to FILE instead of stderr, from the start (created
    /// mode 0600; never through a symbolic link). Re-opened on SIGHUP, so
    /// logrotate may move it and send SIGHUP (or `systemctl reload`).
    #[arg(long, value_name = "FILE")]
    log_file: Option<PathBuf>,
    /// The syslog socket a --fork'ed daemon logs to, RFC 3164 datagrams with
    /// facility daemon.
    #[arg(long, value_name = "PATH", default_value = super::syslog::DEFAULT_SOCKET)]
    syslog_socket: PathBuf,
    /// Reactor threads, each with its own io_uring [default: one per core].
    #[arg(long, value_name = "N", default_value = "0", hide_default_value = true)]
    reactors: usize,
    /// Keep each connection on the reactor it started on. By default, while the
    /// machine's CPUs are busy, a connection moves to the reactor running on the
    /// CPU its client keeps running on (found by SO_INCOMING_CPU for TCP, and for
    /// Unix sockets from the connecting process if it is single-threaded): that
    /// saves a cross-CPU hand-over of every request and reply.
    #[arg(long)]
    no_follow: bool,
    /// Test switch: connections follow their clients even on an idle machine.
    #[arg(long, hide = true)]
    follow_idle: bool,
    /// Longest a reactor busy-polls for the next request before sleeping, in
    /// microseconds. The window adapts: it opens only while requests keep arriving
    /// soon after the reactor goes idle (a client at low queue depth) and closes
    /// when they don't, so an idle server never spins. It trades some CPU for
    /// latency where waking a sleeping CPU is slow (virtual machines). 0 = never poll.
    #[arg(long, value_name = "US", default_value_t = loopd::reactor::poll::DEFAULT_MAX_US)]
    poll_us: u64,
    /// Memory for request and reply buffers across the whole daemon, e.g. 512M
    /// [default: 256M; at least 128M]. When it is spent, connections stop reading
    /// new requests until replies are sent (backpressure).
    #[arg(long, value_name = "SIZE", value_parser = parse_budget)]
    memory_budget: Option<u64>,
    /// Seconds within which a client holding part of the memory budget must take
    /// each reply once it is queued (and send each write's payload once its
    /// header is read) while other requests wait for budget; then it is
    /// disconnected, with an audit line. Reading slowly is not enough: a client
    /// must take what it has outstanding within this (3.2 MiB/s for one 32 MiB
    /// read at a time with 10). The kernel's own NBD client (--blockdev nbd)
    /// gets at least 120. 0 = never.
    #[arg(long, value_name = "SECS", default_value_t = loopd::engine::budget::DEFAULT_REPLY_TIMEOUT.as_secs_f64())]
    reply_timeout: f64,
    /// Seconds the kernel has to answer each control request of a block
    /// device (ublk control commands, kernel-NBD netlink calls). A kernel that
    /// takes longer fails that attach (or detach) with an error naming the
    /// request and the time waited; the daemon and the other devices go on.
    #[arg(long, value_name = "SECS", default_value_t = loopd::blockdev::kernel_timeout::DEFAULT.as_secs_f64())]
    kernel_timeout: f64,
    /// On stop (SIGTERM, Ctrl-C), leave the block devices (ublk, kernel NBD)
    /// to the next daemon started on the same state file instead of removing
    /// them: a mounted filesystem on /dev/ublkbN or /dev/nbdN survives a
    /// restart or an upgrade of loopd. Its I/O waits meanwhile (a ublk device
    /// is quiesced first where the kernel can, 6.15+: nothing is left in
    /// flight; elsewhere loopd holds its new requests until they stop coming,
    /// at most 5 s). Without it a stop removes them, as `detach` would
    #[arg(long)]
    keep_blockdevs: bool,
    /// Benchmark switch: one lock for the whole device instead of byte ranges.
    #[arg(long, hide = true)]
    whole_device_lock: bool,
    /// Benchmark switch: buffered reads never try the page cache inline.
    #[arg(long, hide = true)]
    no_inline_reads: bool,
    /// Benchmark switch: buffered writes always go through the ring.
    #[arg(long, hide = true)]
    no_inline_writes: bool,
    /// Benchmark switch: large buffered reads are copied, never spliced.
    #[arg(long, hide = true)]
    no_splice: bool,
}

/// `--aio`, qemu-nbd's names; loopd's I/O is io_uring's whatever is asked.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Aio {
    /// io_uring: what loopd does.
    #[value(name = "io_uring")]
    IoUring,
    /// qemu's thread pool: loopd uses io_uring instead (and says so).
    Threads,
    /// qemu's Linux AIO: loopd uses io_uring instead (and says so).
    Native,
}

impl Aio {
    fn name(self) -> &'static str {
        match self {
            Aio::IoUring => "io_uring",
            Aio::Threads => "threads",
            Aio::Native => "native",
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum TlsArg {
    /// No TLS; STARTTLS is refused.
    Off,
    /// Offer TLS; clients may use it or not.
    On,
    /// Clients must upgrade to TLS before anything else.
    Require,
}

impl From<TlsArg> for TlsMode {
    fn from(t: TlsArg) -> TlsMode {
        match t {
            TlsArg::Off => TlsMode::Off,
            TlsArg::On => TlsMode::On,
            TlsArg::Require => TlsMode::Require,
        }
    }
}

/// Before this version the default state file lived beside the control socket
/// (in /run, gone at reboot). Say so if one is still there and the new default
/// does not exist yet: its devices are not restored from there any more.
fn warn_old_default_state(control: &std::path::Path, state: &std::path::Path) {
    let old = control.with_extension("state");
    if old != state && old.is_file() && !state.exists() {
        tracing::warn!(
            "{} is a state file at the old default location; the state now lives in {}, so \
             its devices are not restored. To keep them, stop loopd and move it there \
             (or pass --state {})",
            old.display(),
            state.display(),
            old.display()
        );
    }
}

/// `--listen`: normalized to `HOST:PORT`.
fn parse_listen(s: &str) -> Result<String, String> {
    server::listen::normalize_listen(s).map_err(|e| e.to_string())
}

/// An octal file mode (`600`, `0660`).
fn parse_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s, 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!("{s:?} is not an octal mode between 0 and 777")),
    }
}

/// qemu-nbd's spellings that have no option of their own here: `-p PORT`
/// is one more `--listen`, `--aio` other than io_uring is told what loopd
/// does instead.
fn qemu_nbd_spellings(a: &mut ServeArgs) {
    // -t: nothing to do; loopd keeps serving after the last client anyway.
    let _ = a.persistent;
    if let Some(p) = a.port {
        a.listen.push(format!("0.0.0.0:{p}"));
    }
    if let Some(aio) = a.aio.filter(|&m| m != Aio::IoUring) {
        tracing::warn!(
            "--aio {}: loopd does its file I/O through io_uring (as --aio io_uring), \
             whatever --aio says",
            aio.name()
        );
    }
}

pub fn serve(mut a: ServeArgs) -> Result<()> {
    qemu_nbd_spellings(&mut a);
    // Sockets passed by the service manager, and where to report readiness:
    // taken before anything else (and before any thread starts).
    let act = activation::take()?;
    let notifier = Arc::new(Notifier::from_env()?);
    // A SIGHUP during start-up (`systemctl reload` racing the start) must not
    // kill the daemon: its default action is replaced at once. The server
    // reloads on SIGHUP once it runs; the files are read at start anyway.
    signal_hook::flag::register(
        signal_hook::consts::SIGHUP,
        Arc::new(std::sync::atomic::AtomicBool::new(false)),
    )
    .context("cannot set up signal handling")?;
    if let Some(p) = &a.pid_file {
        pidfile::check(p)?;
    }
    if a.fork {
        absolute_paths(&mut a)?;
    } else if let Some(f) = a.log_file.as_mut() {
        // SIGHUP opens it again by this path.
        *f = std::path::absolute(&*f)
            .with_context(|| format!("cannot make {} absolute", f.display()))?;
    }
    let late = setup_logs(&a, &act)?;
    let ready_pipe = Rc::new(RefCell::new(None::<ReadyPipe>));
    if a.fork {
        *ready_pipe.borrow_mut() = Some(daemonize::fork()?);
    }
    // Before any thread starts (see the module): no stalls as devices come.
    loopd::server::fd_table::reserve();
    let r = start(a, act, Arc::clone(&notifier), Rc::clone(&ready_pipe), late);
    if let Err(e) = &r {
        let msg = super::exit::message(e);
        // `systemctl status` shows it beside the exit code.
        notifier.send(&format!("STATUS=failed: {}", msg.replace('\n', " ")));
        if let Some(p) = ready_pipe.borrow_mut().as_mut() {
            let (line, status) = super::exit::line(e);
            p.fail(status, &line);
        }
    }
    r
}

/// With --fork the daemon runs in `/`: every path it is given becomes
/// absolute (the log file's too, which SIGHUP opens again).
fn absolute_paths(a: &mut ServeArgs) -> Result<()> {
    let rbd = a
        .image
        .as_deref()
        .and_then(|p| p.to_str())
        .is_some_and(loopd::backing::rbd::spec::is_rbd);
    // An rbd: image is no path.
    let mut none = None;
    for p in [
        if rbd { &mut none } else { &mut a.image },
        &mut a.dev.ceph_conf,
        &mut a.socket,
        &mut a.tls_certs,
        &mut a.config,
        &mut a.control,
        &mut a.state,
        &mut a.pid_file,
        &mut a.log_file,
    ]
    .into_iter()
    .flatten()
    {
        *p = std::path::absolute(&*p)
            .with_context(|| format!("cannot make {} absolute", p.display()))?;
    }
    if let Some(m) = a.metrics.as_mut().filter(|m| m.contains('/')) {
        let abs = std::path::absolute(&*m).with_context(|| format!("cannot make {m} absolute"))?;
        *m = abs.to_string_lossy().into_owned();
    }
    Ok(())
}

/// Where a forked daemon's log lines go once it serves (and stderr is gone).
enum LateSink {
    Syslog(Syslog),
    File(log::LogFile),
}

/// `--log-file`: lines go there from now on. `--fork` without it: say where
/// they will go once the daemon serves (syslog, or where there is none, the
/// state file's path with extension `.log`) and open that now, so that a
/// failure is reported before the fork.
fn setup_logs(a: &ServeArgs, act: &Activated) -> Result<Option<LateSink>> {
    if let Some(f) = &a.log_file {
        log::use_file(log::LogFile::open(f)?);
        return Ok(None);
    }
    if !a.fork {
        return Ok(None);
    }
    match Syslog::connect(&a.syslog_socket) {
        Ok(s) => {
            tracing::info!(
                "--fork: once it serves, the daemon logs to syslog ({})",
                a.syslog_socket.display()
            );
            Ok(Some(LateSink::Syslog(s)))
        }
        Err(e) => {
            let (_, _, state) = paths(a, act);
            let file = state.with_extension("log");
            if let Some(dir) = file.parent().filter(|d| !d.exists()) {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
            }
            let f = log::LogFile::open(&file)?;
            tracing::warn!(
                "--fork: no syslog at {} ({e}); once it serves, the daemon logs to {} \
                 (--log-file FILE chooses another file)",
                a.syslog_socket.display(),
                file.display()
            );
            Ok(Some(LateSink::File(f)))
        }
    }
}

/// The NBD socket (if any), the control socket and the state file `a` asks
/// for, given the sockets systemd passed.
fn paths(a: &ServeArgs, act: &Activated) -> (Option<PathBuf>, PathBuf, PathBuf) {
    let nbd = if act.nbd.is_empty() {
        match (&a.socket, a.listen.is_empty()) {
            (Some(p), _) => Some(p.clone()),
            (None, true) => Some(server::default_socket_dir().join("loopd.sock")),
            (None, false) => None,
        }
    } else {
        act.first_unix_path().cloned()
    };
    let activated_control = act.control.as_ref().map(|(_, p)| p.clone());
    let control = match (&a.control, activated_control) {
        (Some(c), _) => Some(c.clone()),
        (None, Some(p)) => p,
        (None, None) => None,
    };
    let control = control.unwrap_or_else(|| match &nbd {
        Some(p) => p.with_extension("ctl"),
        None => server::default_socket_dir().join("loopd.ctl"),
    });
    let state = a
        .state
        .clone()
        .unwrap_or_else(|| daemon::default_state_path(&control));
    (nbd, control, state)
}

/// Start-up after the fork: lock the state, bind every socket, attach IMAGE and
/// --config, restore the state, then serve. A failure removes the images it
/// created (and `bind` the sockets it bound).
fn start(
    a: ServeArgs,
    act: Activated,
    notifier: Arc<Notifier>,
    ready_pipe: Rc<RefCell<Option<ReadyPipe>>>,
    late: Option<LateSink>,
) -> Result<()> {
    if !(a.handshake_timeout > 0.0 && a.handshake_timeout <= 3600.0) {
        bail!(Classed::new(
            "usage",
            "--handshake-timeout must be more than 0 and at most 3600 seconds"
        ));
    }
    if a.max_connections == 0 {
        bail!(Classed::new(
            "usage",
            "--max-connections must be at least 1"
        ));
    }
    if a.max_connections_per_peer == Some(0) {
        bail!(Classed::new(
            "usage",
            "--max-connections-per-peer must be at least 1"
        ));
    }
    if !(0.1..=86_400.0).contains(&a.kernel_timeout) {
        bail!("--kernel-timeout must be from 0.1 to 86400 seconds");
    }
    let kernel_timeout = std::time::Duration::from_secs_f64(a.kernel_timeout);
    loopd::blockdev::kernel_timeout::set(kernel_timeout);
    if !(0.0..=86_400.0).contains(&a.reply_timeout) {
        bail!(Classed::new(
            "usage",
            "--reply-timeout must be from 0 to 86400 seconds"
        ));
    }
    let opts0 = ServeOptions {
        socket: a.socket.clone(),
        socket_mode: a.socket_mode,
        socket_group: a.socket_group.clone(),
        listen: a.listen.clone(),
        reactors: a.reactors,
        no_follow: a.no_follow,
        follow_idle: a.follow_idle,
        poll: std::time::Duration::from_micros(a.poll_us),
        control: None,
        max_connections: a.max_connections,
        max_connections_per_peer: a.max_connections_per_peer.unwrap_or(0),
        handshake_timeout: std::time::Duration::from_secs_f64(a.handshake_timeout),
        no_list: a.no_list,
        tls: match a.tls {
            Some(t) => t.into(),
            None if a.tls_certs.is_some() => TlsMode::On,
            None => TlsMode::Off,
        },
        tls_certs: a.tls_certs.clone(),
        tls_verify_peer: a.tls_verify_peer,
        ktls: !a.no_ktls,
        control_idle: std::time::Duration::from_secs_f64(
            a.control_idle_timeout.clamp(0.1, 86_400.0),
        ),
        memory_budget: a
            .memory_budget
            .map_or(0, |b| usize::try_from(b).unwrap_or(usize::MAX)),
        reply_timeout: std::time::Duration::from_secs_f64(a.reply_timeout),
        metrics: a.metrics.clone(),
        metrics_mode: a.metrics_mode,
        keep_blockdevs: a.keep_blockdevs,
    };
    if !act.nbd.is_empty() && (a.socket.is_some() || !a.listen.is_empty()) {
        bail!(Classed::new(
            "usage",
            "NBD sockets were passed by socket activation (LISTEN_FDS); drop --socket and \
             --listen, or name the activated sockets `control` only"
        ));
    }
    if act.control.is_some() && a.control.is_some() {
        bail!(Classed::new(
            "usage",
            "the control socket was passed by socket activation (LISTEN_FDS); drop --control"
        ));
    }
    let (nbd, control, state) = paths(&a, &act);
    if a.state.is_none() {
        warn_old_default_state(&control, &state);
    }
    let d = Daemon::new(Some(state));
    // Before anything is attached or bound: refuse a state file that is another
    // daemon's, or not a state file at all.
    if let Err(e) = d.open_state() {
        // Two servers on every default path meet first at the state file.
        if let (daemon::state::StateError::Locked { pid, .. }, None, None) =
            (&e, &a.state, &a.control)
        {
            if let Some(sock) = nbd
                .as_ref()
                .filter(|_| a.socket.is_none() && act.nbd.is_empty())
            {
                bail!(Classed::new(
                    "busy",
                    format!(
                        "{} is in use by another server (pid {pid}); pass --socket PATH (and \
                         --control/--state) to run a second one",
                        sock.display()
                    )
                ));
            }
        }
        return Err(e.into());
    }
    let opts = ServeOptions {
        control: Some(control),
        ..opts0
    };
    let bound = server::bind(&opts, act)?;
    if let Err(e) = attach_at_start(&d, &a) {
        remove_created(&d);
        return Err(e);
    }
    d.restore();
    d.run_retrier();
    let pid_file = match a.pid_file.as_deref().map(PidFile::write).transpose() {
        Ok(p) => p,
        Err(e) => {
            remove_created(&d);
            return Err(e.into());
        }
    };
    let n = Arc::clone(&notifier);
    let ready = Rc::new(std::cell::Cell::new(false));
    let was_ready = Rc::clone(&ready);
    let late = RefCell::new(late);
    let on_ready = Box::new(move |d: &Daemon| {
        was_ready.set(true);
        n.ready(&format!("serving {} devices", d.all().len()));
        // Before stderr goes to /dev/null: the lines go on elsewhere.
        match late.borrow_mut().take() {
            Some(LateSink::Syslog(s)) => log::use_syslog(s),
            Some(LateSink::File(f)) => log::use_file(f),
            None => {}
        }
        if let Some(p) = ready_pipe.borrow_mut().as_mut() {
            p.ready();
        }
    });
    let n = Arc::clone(&notifier);
    let on_sighup = Box::new(move |d: &Daemon, from: server::SignalSender| {
        n.reloading();
        // logrotate moved the log file away: go on in a new one.
        log::reopen();
        // Logged by reload (a config file that does not parse too), and audited.
        let _ = d.reload_audited(&from.to_string());
        n.ready(&format!("serving {} devices", d.all().len()));
    });
    let n = Arc::clone(&notifier);
    let hooks = Hooks {
        on_ready: Some(on_ready),
        on_sighup: Some(on_sighup),
        on_stopping: Some(Box::new(move || n.stopping())),
    };
    let r = server::run(Arc::clone(&d), bound, &opts, hooks);
    if r.is_err() && !ready.get() {
        remove_created(&d);
    }
    drop(pid_file);
    Ok(r?)
}

/// Remove the images that attaches at start created (`create`), after a
/// failed start.
fn remove_created(d: &Daemon) {
    for e in d.all() {
        let (dev, _) = e.current();
        if dev.created() {
            let _ = std::fs::remove_file(dev.path());
        }
    }
}

/// Attach IMAGE and the devices of --config.
fn attach_at_start(d: &Daemon, a: &ServeArgs) -> Result<()> {
    if let Some(image) = a.image.clone() {
        let mut spec = a.dev.spec(image);
        spec.autoclear = false;
        let info = d
            .attach_default(
                spec,
                daemon::Tuning {
                    whole_device_lock: a.whole_device_lock,
                    no_inline_reads: a.no_inline_reads,
                    no_inline_writes: a.no_inline_writes,
                    no_splice: a.no_splice,
                },
            )
            .map_err(|e| DaemonError(e.body()))?;
        let e = d.export(&info.name).context("device vanished")?;
        let (dev, _) = e.current();
        tracing::info!(
            "serving {} as {:?}: {} bytes, block size {}, {}{}",
            dev.path().display(),
            dev.name(),
            dev.size(),
            dev.block_size(),
            dev.cache_note(),
            if dev.read_only() { ", read-only" } else { "" }
        );
    }
    if let Some(cfg) = &a.config {
        let specs = super::args::read_config(cfg)?;
        d.set_config(cfg, specs.clone());
        let t = std::time::Instant::now();
        let n = specs.len();
        let mut failed = 0;
        // A device that cannot be attached does not stop the start (as a
        // reload and the state file do not): it is kept as missing, with the
        // reason, and retried.
        for spec in specs {
            let name = daemon::name_of(&spec);
            if let Err(e) = d.attach_config(spec) {
                failed += 1;
                tracing::error!(
                    "{}: device {}: not attached: {}; the other devices are served, and it \
                     is listed as missing and retried every {}s and by each reload",
                    loopd::text::quoted_path(cfg),
                    loopd::text::quoted(&name),
                    e.body().message,
                    daemon::RETRY_INTERVAL.as_secs()
                );
            }
        }
        tracing::info!(
            "attached {} of {n} device(s) from {} in {:?}",
            n - failed,
            cfg.display(),
            t.elapsed()
        );
    }
    Ok(())
}

/// `--memory-budget`: a size of at least the engine's minimum.
fn parse_budget(s: &str) -> Result<u64, String> {
    let min = loopd::engine::budget::MIN_LIMIT as u64;
    let b = loopd::size::parse_size(s).map_err(|e| e.to_string())?;
    if b < min {
        return Err(format!(
            "{b} bytes is too small: the largest request's buffer must fit in a device's \
             share and again in the reserve kept for other devices, so at least {}M",
            min >> 20
        ));
    }
    Ok(b)
}
