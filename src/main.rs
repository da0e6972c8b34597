//! The `loopd` command line. Subcommands only; the work is in the library.

mod cli;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use cli::{Cache, DeviceArgs};
use loopd::control::client;
use loopd::control::proto::{Request, SetSpec};
use loopd::daemon::{self, Daemon};
use loopd::frontend::nbd::handshake::TlsMode;
use loopd::server::{self, ServeOptions};
use std::io::IsTerminal;
use std::path::PathBuf;

/// A userspace loop device: serves disk-image files as block devices over NBD,
/// with direct, asynchronous I/O (io_uring). `loopd serve` runs the server; the
/// other commands talk to a running server over its control socket.
#[derive(Parser)]
#[command(name = "loopd", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the server in the foreground until Ctrl-C/SIGTERM: serve IMAGE (if
    /// given), the devices of --config and of the state file, and any attached later.
    Serve(Box<ServeArgs>),
    /// Attach an image as a new device of a running server; prints its name and URIs.
    Attach(AttachArgs),
    /// Remove a device. Refuses while clients are connected unless --force.
    Detach(DetachArgs),
    /// List devices, like `losetup --list`.
    List(ListArgs),
    /// Show a device's configuration and live counters.
    Status(StatusArgs),
    /// Change a device's configuration while it serves.
    Set(SetArgs),
    /// Re-read the backing file's size (like `losetup --set-capacity`).
    Resize(ResizeArgs),
    /// Re-read the server's TLS certificates (as SIGHUP does): new connections
    /// use the new ones; on error the old ones stay in use.
    ReloadTls(ReloadTlsArgs),
    /// Kernel loop devices (/dev/loopN), set up in one LOOP_CONFIGURE call.
    #[command(subcommand)]
    Kernel(cli::kernel::KernelCmd),
}

#[derive(clap::Args)]
struct ServeArgs {
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
    #[arg(long, value_name = "N", default_value = "0")]
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

/// Where client commands find the server.
#[derive(clap::Args)]
struct ControlArg {
    /// The server's control socket [default: $LOOPD_CONTROL, else the default
    /// socket directory's loopd.ctl].
    #[arg(long, value_name = "PATH", env = "LOOPD_CONTROL")]
    control: Option<PathBuf>,
}

impl ControlArg {
    fn path(&self) -> PathBuf {
        self.control
            .clone()
            .unwrap_or_else(|| server::default_socket_dir().join("loopd.ctl"))
    }
}

#[derive(clap::Args)]
struct AttachArgs {
    /// The image file (or block device).
    image: PathBuf,
    #[command(flatten)]
    dev: DeviceArgs,
    /// Remove the device when its last client disconnects.
    #[arg(long)]
    autoclear: bool,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct DetachArgs {
    /// Device name.
    name: String,
    /// Detach even with clients connected: their sockets are shut down and their
    /// file I/O in flight cancelled; the command returns once they are gone (or
    /// says how many still wait for a backing file that does not answer, after 5 s).
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct ListArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct StatusArgs {
    /// Device name.
    name: String,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct SetArgs {
    /// Device name.
    name: String,
    /// New size of the window, in bytes (K/M/G/T).
    #[arg(long, value_name = "BYTES", value_parser = loopd::size::parse_size)]
    size_limit: Option<u64>,
    /// New start of the window in the file (clients cannot follow: needs --force
    /// while clients are connected).
    #[arg(long, value_name = "BYTES", value_parser = loopd::size::parse_size)]
    offset: Option<u64>,
    /// New logical block size (clients cannot follow: needs --force while
    /// clients are connected).
    #[arg(long, value_name = "BYTES")]
    block_size: Option<u32>,
    /// New cache mode.
    #[arg(long, value_enum)]
    cache: Option<Cache>,
    /// Make the device read-only (true) or writable (false).
    #[arg(long, value_name = "BOOL")]
    read_only: Option<bool>,
    /// Apply changes connected clients cannot follow.
    #[arg(long)]
    force: bool,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct ResizeArgs {
    /// Device name.
    name: String,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct ReloadTlsArgs {
    #[command(flatten)]
    ctl: ControlArg,
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

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole cause chain; no backtrace noise.
            eprintln!("loopd: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOOPD_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Serve(a) => serve(*a),
        Cmd::Attach(a) => {
            let mut spec = a.dev.spec(a.image);
            spec.autoclear = a.autoclear;
            let v = call(&a.ctl, &Request::Attach(spec))?;
            cli::print_device(&v, a.json)
        }
        Cmd::Detach(a) => {
            call(
                &a.ctl,
                &Request::Detach {
                    name: a.name.clone(),
                    force: a.force,
                },
            )?;
            println!("detached {}", a.name);
            Ok(())
        }
        Cmd::List(a) => cli::print_list(&call(&a.ctl, &Request::List)?, a.json),
        Cmd::Status(a) => {
            cli::print_status(&call(&a.ctl, &Request::Status { name: a.name })?, a.json)
        }
        Cmd::Set(a) => {
            let s = SetSpec {
                name: a.name,
                size_limit: a.size_limit,
                offset: a.offset,
                block_size: a.block_size,
                cache: a.cache.map(Into::into),
                read_only: a.read_only,
                force: a.force,
            };
            cli::print_set(&call(&a.ctl, &Request::Set(s))?, a.json)
        }
        Cmd::Resize(a) => cli::print_set(&call(&a.ctl, &Request::Resize { name: a.name })?, a.json),
        Cmd::ReloadTls(a) => {
            call(&a.ctl, &Request::ReloadTls)?;
            println!("TLS certificates reloaded");
            Ok(())
        }
        Cmd::Kernel(k) => cli::kernel::run(k),
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

/// Send a control request; a daemon error becomes this command's error.
fn call(ctl: &ControlArg, req: &Request) -> Result<serde_json::Value> {
    match client::call(&ctl.path(), req)? {
        Ok(v) => Ok(v),
        Err(e) => {
            let code = serde_json::to_value(e.code).unwrap_or_default();
            bail!("{} ({})", e.message, code.as_str().unwrap_or("error"))
        }
    }
}

fn serve(a: ServeArgs) -> Result<()> {
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
        let specs = cli::read_config(cfg)?;
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
