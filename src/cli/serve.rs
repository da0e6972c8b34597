//! `loopd serve`: the server's options and its start-up (state, IMAGE, config,
//! restore), then the server loop until SIGTERM/SIGINT.

use super::DeviceArgs;
use anyhow::{Context, Result, bail};
use loopd::daemon::{self, Daemon};
use loopd::frontend::nbd::handshake::TlsMode;
use loopd::server::{self, ServeOptions};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The image file (or block device) to serve; optional: without it the server
    /// starts with the devices of --config and the state file only.
    image: Option<PathBuf>,
    #[command(flatten)]
    dev: DeviceArgs,
    /// NBD Unix socket to listen on [default: /run/loopd/loopd.sock for root,
    /// else $XDG_RUNTIME_DIR/loopd/loopd.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Mode of the NBD Unix socket, in octal. Connecting needs write permission:
    /// 600 lets only this user in; 660 with --socket-group lets a group in.
    #[arg(long, value_name = "MODE", default_value = "600", value_parser = parse_mode)]
    socket_mode: u32,
    /// Group of the NBD Unix socket (name or number), e.g. `disk`, with
    /// --socket-mode 660.
    #[arg(long, value_name = "GROUP")]
    socket_group: Option<String>,
    /// Also (or only) listen on TCP, e.g. 127.0.0.1:10809 (NBD's port). Repeatable.
    /// Without --tls require any host that reaches the address can use the
    /// devices, so loopd warns unless it is a loopback address.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Vec<String>,
    /// TLS for NBD clients (STARTTLS), as nbdkit's --tls: `off`; `on` offers it
    /// and lets clients choose; `require` refuses every option but STARTTLS
    /// until TLS is up [default: off, or on with --tls-certs]. Applies to the
    /// Unix socket and TCP alike; printed URIs become nbds://.
    #[arg(long, value_enum, value_name = "MODE")]
    tls: Option<TlsArg>,
    /// Directory of the server's certificates, in the layout of nbdkit and QEMU:
    /// ca-cert.pem (the CA clients' certificates must chain to, with
    /// --tls-verify-peer), server-cert.pem, server-key.pem. Re-read on SIGHUP
    /// and `loopd reload-tls`.
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
    /// NBD connections at most, handshakes included; past it new clients are
    /// closed at once. Lowered to what the open-file limit allows.
    #[arg(long, value_name = "N", default_value_t = server::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Seconds a client has for its whole handshake (from connecting until it
    /// selects an export).
    #[arg(long, value_name = "SECS", default_value_t = server::DEFAULT_HANDSHAKE_TIMEOUT.as_secs_f64())]
    handshake_timeout: f64,
    /// Refuse NBD_OPT_LIST: clients cannot list the export names.
    #[arg(long)]
    no_list: bool,
    /// Seconds a control client may stay silent before it is closed (tests).
    #[arg(long, hide = true, value_name = "SECS", default_value_t = 60.0)]
    control_idle_timeout: f64,
    /// TOML file of devices to attach at start ([[device]] tables with image,
    /// name, offset, size_limit, block_size, cache, read_only, autoclear, shared, format).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Control socket (mode 0600) [default: beside the NBD socket, with extension .ctl].
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// State file: devices attached over the control socket, restored at start;
    /// one daemon per state file [default: /var/lib/loopd/STEM.state for root,
    /// else $XDG_STATE_HOME/loopd/STEM.state (~/.local/state/loopd/), STEM being
    /// the control socket's file stem].
    #[arg(long, value_name = "FILE")]
    state: Option<PathBuf>,
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
    /// [default: 256M; at least 64M]. When it is spent, connections stop reading
    /// new requests until replies are sent (backpressure).
    #[arg(long, value_name = "SIZE", value_parser = parse_budget)]
    memory_budget: Option<u64>,
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

/// An octal file mode (`600`, `0660`).
fn parse_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s, 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!("{s:?} is not an octal mode between 0 and 777")),
    }
}

pub fn serve(a: ServeArgs) -> Result<()> {
    if !(a.handshake_timeout > 0.0 && a.handshake_timeout <= 3600.0) {
        bail!("--handshake-timeout must be more than 0 and at most 3600 seconds");
    }
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
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
    };
    let nbd = server::nbd_socket_path(&opts0);
    let control = a.control.clone().unwrap_or_else(|| match &nbd {
        Some(p) => p.with_extension("ctl"),
        None => server::default_socket_dir().join("loopd.ctl"),
    });
    let state = a
        .state
        .clone()
        .unwrap_or_else(|| daemon::default_state_path(&control));
    if a.state.is_none() {
        warn_old_default_state(&control, &state);
    }
    let d = Daemon::new(Some(state));
    // Before anything is attached or bound: refuse a state file that is another
    // daemon's, or not a state file at all.
    d.open_state()?;
    if let Some(image) = a.image {
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
            .map_err(|e| anyhow::anyhow!(e.body().message))?;
        let e = d.export(&info.name).context("device vanished")?;
        let (dev, _) = e.current();
        tracing::info!(
            "serving {} as {:?}: {} bytes, block size {}, {}{}",
            dev.path.display(),
            dev.name,
            dev.size,
            dev.block_size,
            dev.cache_note,
            if dev.read_only { ", read-only" } else { "" }
        );
    }
    if let Some(cfg) = &a.config {
        let specs = super::read_config(cfg)?;
        let t = std::time::Instant::now();
        let n = specs.len();
        for spec in specs {
            let name = daemon::name_of(&spec);
            d.attach(spec, false)
                .map_err(|e| anyhow::anyhow!(e.body().message))
                .with_context(|| format!("{}: device {name:?}", cfg.display()))?;
        }
        tracing::info!(
            "attached {n} device(s) from {} in {:?}",
            cfg.display(),
            t.elapsed()
        );
    }
    d.restore();
    d.run_retrier();
    let opts = ServeOptions {
        control: Some(control),
        ..opts0
    };
    server::serve(d, &opts)?;
    Ok(())
}

/// `--memory-budget`: a size of at least the engine's minimum.
fn parse_budget(s: &str) -> Result<u64, String> {
    let min = loopd::engine::budget::MIN_LIMIT as u64;
    let b = loopd::size::parse_size(s).map_err(|e| e.to_string())?;
    if b < min {
        return Err(format!(
            "{b} bytes is too small: the largest request needs at least {}M",
            min >> 20
        ));
    }
    Ok(b)
}
