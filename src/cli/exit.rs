//! How a failed command ends: one error class per failure, each with its own
//! exit status and machine code (the control protocol's codes plus the
//! client's own `not_running` and `usage`). Under `--json` the error is also
//! printed to stdout as `{"error":{"code":"…","message":"…"}}`; the human line
//! always goes to stderr.
//!
//! Contract: [`classify`] looks at the whole cause chain of an error and never
//! fails; every control protocol code has a class (the match is exhaustive).
//! Errors of `serve`'s start-up (state file, config, sockets, TLS, block
//! devices) get the class the control path gives the same failure, so a typo
//! in the config (`invalid`, 7) is told from a missing module (`unavailable`,
//! 8) or a locked state file (`busy`, 5). The error line is the chain of
//! causes, each once ([`loopd::text::join_causes`]).

use loopd::backing::format::RawError;
use loopd::backing::identity::IdentityError;
use loopd::backing::lock::LockError;
use loopd::control::client::ClientError;
use loopd::control::proto::{ErrorBody, ErrorCode};
use loopd::daemon::CtlError;
use loopd::daemon::config::ConfigError;
use loopd::daemon::state::StateError;
use loopd::kernel_loop::KernelLoopError;
use loopd::metrics::MetricsError;
use loopd::server::ServerError;
use loopd::server::activation::ActivationError;
use loopd::server::listen::ListenError;
use loopd::server::pidfile::PidFileError;
use loopd::tls::TlsError;
use thiserror::Error;

/// A failure the command found itself, with its machine code (e.g. `serve`'s
/// checks of its options: `usage`).
#[derive(Debug, Error)]
#[error("{msg}")]
pub struct Classed {
    pub code: &'static str,
    pub msg: String,
}

impl Classed {
    pub fn new(code: &'static str, msg: impl Into<String>) -> Classed {
        Classed {
            code,
            msg: msg.into(),
        }
    }
}

/// A control request the daemon answered with an error.
#[derive(Debug, Error)]
#[error("{} ({})", .0.message, code_str(.0.code))]
pub struct DaemonError(pub ErrorBody);

/// A bad command line found after parsing (e.g. `attach --name` with several
/// images).
#[derive(Debug, Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// `attach` of several images: some were not attached (each already reported
/// on its own line); the exit status is that of the first failure's `code`.
#[derive(Debug, Error)]
#[error("{failed} of {total} image(s) not attached")]
pub struct BatchFailed {
    pub failed: usize,
    pub total: usize,
    pub code: ErrorCode,
}

/// Exit statuses, one per class of failure (shown in `loopd --help`).
pub const OK: u8 = 0;
pub const OTHER: u8 = 1;
pub const USAGE: u8 = 2;
pub const NOT_RUNNING: u8 = 3;
pub const NOT_FOUND: u8 = 4;
pub const BUSY: u8 = 5;
pub const NAME_TAKEN: u8 = 6;
pub const INVALID: u8 = 7;
pub const UNAVAILABLE: u8 = 8;

/// The exit statuses and what they mean (for `--help` and the man page's
/// EXIT STATUS).
pub const STATUSES: &[(u8, &str)] = &[
    (OK, "success"),
    (
        OTHER,
        "I/O, internal or other error (io, direct_refused, internal)",
    ),
    (USAGE, "usage: bad command line (usage)"),
    (
        NOT_RUNNING,
        "the daemon is not running or is shutting down (not_running, shutting_down)",
    ),
    (
        NOT_FOUND,
        "no such device, or no such RBD pool, image or snapshot (not_found)",
    ),
    (
        BUSY,
        "clients are connected; the change needs --force; or the image is in use; or the \
         state file, socket, pid file or TCP address is another server's (busy)",
    ),
    (NAME_TAKEN, "a device with that name exists (name_taken)"),
    (
        INVALID,
        "a value is out of range, the request is malformed or the config file has an error \
         (invalid, bad_request, unsupported_version)",
    ),
    (
        UNAVAILABLE,
        "the kernel lacks what is needed: a module, a permission, a limit; or the Ceph \
         library or cluster cannot be reached or refuses the client (unavailable)",
    ),
];

/// The text after `loopd --help`: exit statuses, `--json` errors, LOOPD_LOG.
pub fn help_text() -> String {
    let mut s = String::from("Exit status:\n");
    for (n, what) in STATUSES {
        s.push_str(&format!("  {n}  {what}\n"));
    }
    s.push_str(
        "\nWith --json, a failure also prints {\"error\":{\"code\":\"…\",\"message\":\"…\"}} on stdout.\n\
         LOOPD_LOG sets the log filter (e.g. LOOPD_LOG=debug; default info).",
    );
    s
}

/// The protocol's name for a code (as it appears on the wire).
pub fn code_str(c: ErrorCode) -> &'static str {
    match c {
        ErrorCode::BadRequest => "bad_request",
        ErrorCode::UnsupportedVersion => "unsupported_version",
        ErrorCode::NotFound => "not_found",
        ErrorCode::NameTaken => "name_taken",
        ErrorCode::Busy => "busy",
        ErrorCode::Invalid => "invalid",
        ErrorCode::Io => "io",
        ErrorCode::DirectRefused => "direct_refused",
        ErrorCode::ShuttingDown => "shutting_down",
        ErrorCode::Unavailable => "unavailable",
        ErrorCode::Internal => "internal",
    }
}

/// The exit status for a machine code.
pub fn status_for(code: &str) -> u8 {
    match code {
        "usage" => USAGE,
        "not_running" | "shutting_down" => NOT_RUNNING,
        "not_found" => NOT_FOUND,
        "busy" => BUSY,
        "name_taken" => NAME_TAKEN,
        "invalid" | "bad_request" | "unsupported_version" => INVALID,
        "unavailable" => UNAVAILABLE,
        _ => OTHER,
    }
}

/// The class of a socket call's failure: an address in use is `busy`, a
/// permission the kernel refuses `unavailable`, an address this host does not
/// have `invalid`; anything else `io`.
fn io_class(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => "busy",
        std::io::ErrorKind::PermissionDenied => "unavailable",
        std::io::ErrorKind::AddrNotAvailable => "invalid",
        _ => "io",
    }
}

/// The class of a failure of `serve`'s start-up (or of a library error the
/// CLI meets), as the control path classes the same failure; `None` for an
/// error that is no such failure.
fn server_class(cause: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    if let Some(c) = cause.downcast_ref::<Classed>() {
        return Some(c.code);
    }
    if let Some(c) = cause.downcast_ref::<CtlError>() {
        return Some(code_str(c.code()));
    }
    if let Some(s) = cause.downcast_ref::<ServerError>() {
        return match s {
            ServerError::Blockdev(c) => Some(code_str(c.code())),
            ServerError::TlsNoCerts(_) => Some("usage"),
            ServerError::Listen(l) => server_class(l),
            ServerError::Metrics(m) => server_class(m),
            // As `reload-tls` classes them.
            ServerError::Tls(_) => Some("io"),
            ServerError::Reactor(_)
            | ServerError::Control(_)
            | ServerError::Signals(_)
            | ServerError::Poll(_) => Some("io"),
        };
    }
    if let Some(l) = cause.downcast_ref::<ListenError>() {
        return Some(match l {
            ListenError::SocketInUse(..) | ListenError::Appeared(_) => "busy",
            ListenError::NotASocket { .. }
            | ListenError::UnsafeDir { .. }
            | ListenError::UnknownGroup(_) => "invalid",
            ListenError::BadListen(_) => "usage",
            ListenError::BindTcp(_, e) | ListenError::BindUnix(_, e) => io_class(e),
            ListenError::SocketDir(..) | ListenError::Inspect(..) | ListenError::SocketMode(..) => {
                "io"
            }
        });
    }
    if let Some(m) = cause.downcast_ref::<MetricsError>() {
        return Some(match m {
            MetricsError::BindTcp(_, e) => io_class(e),
            MetricsError::Spawn(_) => "io",
        });
    }
    if cause.downcast_ref::<TlsError>().is_some() {
        return Some("io");
    }
    if let Some(s) = cause.downcast_ref::<StateError>() {
        return Some(match s {
            StateError::Locked { .. } => "busy",
            StateError::NotState(..) => "invalid",
            StateError::Write(..)
            | StateError::Read(..)
            | StateError::Lock(..)
            | StateError::SaveDamaged(..) => "io",
        });
    }
    if let Some(c) = cause.downcast_ref::<ConfigError>() {
        // As `loopd reload` classes them.
        return Some(match c {
            ConfigError::Parse(..) => "invalid",
            ConfigError::Read(..) => "io",
        });
    }
    if let Some(p) = cause.downcast_ref::<PidFileError>() {
        return Some(match p {
            PidFileError::Held { .. } | PidFileError::Alive { .. } | PidFileError::Changed(_) => {
                "busy"
            }
            PidFileError::NotPidFile { .. } => "invalid",
            PidFileError::Inspect(..) | PidFileError::Write(..) => "io",
        });
    }
    if cause.downcast_ref::<ActivationError>().is_some() {
        return Some("invalid");
    }
    None
}

/// The machine code of a failure, from the first cause that has one.
pub fn classify(e: &anyhow::Error) -> &'static str {
    for cause in e.chain() {
        if let Some(c) = server_class(cause) {
            return c;
        }
        if let Some(d) = cause.downcast_ref::<DaemonError>() {
            return code_str(d.0.code);
        }
        if let Some(b) = cause.downcast_ref::<BatchFailed>() {
            return code_str(b.code);
        }
        if cause.downcast_ref::<UsageError>().is_some() {
            return "usage";
        }
        if let Some(c) = cause.downcast_ref::<ClientError>() {
            return match c {
                ClientError::Connect(..) => "not_running",
                ClientError::Protocol(_) => "bad_request",
                ClientError::Io(..) | ClientError::NoReply => "io",
            };
        }
        if let Some(k) = cause.downcast_ref::<KernelLoopError>() {
            return match k {
                KernelLoopError::BadBlockSize(_)
                | KernelLoopError::NotLoop(_)
                | KernelLoopError::NotAFileRbd(_) => "invalid",
                KernelLoopError::Control(_) => "unavailable",
                KernelLoopError::DirectRefused { .. } => "direct_refused",
                // As the daemon's attach classes them.
                KernelLoopError::ImageLock(LockError::InUse { .. }) => "busy",
                KernelLoopError::Raw(RawError::NotRaw { .. })
                | KernelLoopError::Identity(IdentityError::NotAFile { .. }) => "invalid",
                _ => "io",
            };
        }
        if cause.downcast_ref::<loopd::size::SizeError>().is_some() {
            return "usage";
        }
    }
    if e.chain()
        .any(|c| c.downcast_ref::<std::io::Error>().is_some())
    {
        "io"
    } else {
        "internal"
    }
}

/// An error and its causes on one line, each cause once (the one rule for
/// error chains, [`loopd::text::join_causes`]).
pub fn message(e: &anyhow::Error) -> String {
    loopd::text::join_causes(e.chain().map(|c| c.to_string()))
}

/// The `--json` error object.
pub fn json_error(code: &str, message: &str) -> String {
    serde_json::json!({ "error": { "code": code, "message": message } }).to_string()
}

/// The line a failure prints after `loopd: error: ` (ending with its code),
/// and its exit status.
pub fn line(e: &anyhow::Error) -> (String, u8) {
    let code = classify(e);
    let message = message(e);
    // A daemon error's message already ends with its code.
    let daemon = e.chain().any(|c| c.downcast_ref::<DaemonError>().is_some());
    let text = if daemon {
        message
    } else {
        format!("{message} ({code})")
    };
    (text, status_for(code))
}

/// Report a failure (stderr, and stdout under `--json`) and give its exit status.
pub fn report(e: &anyhow::Error, json: bool) -> u8 {
    let code = classify(e);
    let message = message(e);
    // A daemon error's message already ends with its code. On the terminal it
    // is one line with nothing raw in it (it may quote a client's path).
    let daemon = e.chain().find_map(|c| c.downcast_ref::<DaemonError>());
    eprintln!("loopd: error: {}", loopd::text::sanitize_line(&line(e).0));
    // A batch printed its outcomes (under --json, as its JSON).
    let batch = e.chain().any(|c| c.downcast_ref::<BatchFailed>().is_some());
    if json && !batch {
        let body = daemon.map(|d| d.0.message.clone()).unwrap_or(message);
        println!("{}", json_error(code, &body));
    }
    status_for(code)
}

/// Restore SIGPIPE's default action (Rust starts with it ignored, which turns
/// a closed pipe into a panic in `println!`).
pub fn default_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_DFL is async-signal-safe
    // and done before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Ignore SIGPIPE again (the server: a client hanging up is an EPIPE to handle).
pub fn ignore_sigpipe() {
    // SAFETY: as in `default_sigpipe`; called before the server starts threads.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// Does the parsed command line ask for `--json`?
pub fn wants_json(m: &clap::ArgMatches) -> bool {
    let mut leaf = m;
    while let Some((_, sub)) = leaf.subcommand() {
        leaf = sub;
    }
    matches!(leaf.try_get_one::<bool>("json"), Ok(Some(true)))
}

/// A command line clap refused (or `--help`/`--version`): print it as clap
/// does, and under `--json` as a `usage` error object too.
pub fn usage(e: clap::Error) -> std::process::ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        let _ = e.print();
        return std::process::ExitCode::from(if e.use_stderr() { USAGE } else { OK });
    }
    if std::env::args_os().any(|a| a == "--json") {
        let text = e.render().to_string();
        let first = text.lines().next().unwrap_or_default();
        let message = first.strip_prefix("error: ").unwrap_or(first);
        println!("{}", json_error("usage", message));
    }
    let _ = e.print();
    std::process::ExitCode::from(USAGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_protocol_code_has_a_distinct_class() {
        assert_eq!(status_for(code_str(ErrorCode::NotFound)), NOT_FOUND);
        assert_eq!(status_for(code_str(ErrorCode::Busy)), BUSY);
        assert_eq!(status_for(code_str(ErrorCode::NameTaken)), NAME_TAKEN);
        assert_eq!(status_for(code_str(ErrorCode::Invalid)), INVALID);
        assert_eq!(status_for(code_str(ErrorCode::BadRequest)), INVALID);
        assert_eq!(status_for(code_str(ErrorCode::Unavailable)), UNAVAILABLE);
        assert_eq!(status_for(code_str(ErrorCode::ShuttingDown)), NOT_RUNNING);
        assert_eq!(status_for(code_str(ErrorCode::Io)), OTHER);
        assert_eq!(status_for("not_running"), NOT_RUNNING);
        assert_eq!(status_for("usage"), USAGE);
        assert_eq!(OK, 0);
    }

    #[test]
    fn codes_match_the_wire_names() {
        for c in [
            ErrorCode::BadRequest,
            ErrorCode::UnsupportedVersion,
            ErrorCode::NotFound,
            ErrorCode::NameTaken,
            ErrorCode::Busy,
            ErrorCode::Invalid,
            ErrorCode::Io,
            ErrorCode::DirectRefused,
            ErrorCode::ShuttingDown,
            ErrorCode::Unavailable,
            ErrorCode::Internal,
        ] {
            assert_eq!(serde_json::to_value(c).unwrap(), code_str(c));
        }
    }

    #[test]
    fn classify_finds_the_daemon_code_in_the_chain() {
        let e = anyhow::Error::new(DaemonError(ErrorBody {
            code: ErrorCode::Busy,
            message: "x".into(),
        }))
        .context("detach");
        assert_eq!(classify(&e), "busy");
        let c = anyhow::Error::new(ClientError::Connect(
            "/nope".into(),
            std::io::Error::from(std::io::ErrorKind::NotFound),
        ));
        assert_eq!(classify(&c), "not_running");
    }

    /// A printed error line repeats nothing: no cause twice in a row
    /// (`X: Y: Y`), no segment of any length twice, no path three times.
    pub fn repeats(line: &str) -> Option<String> {
        let segs: Vec<&str> = line.split(": ").map(str::trim).collect();
        for (i, a) in segs.iter().enumerate() {
            if a.len() >= 8 && segs[i + 1..].contains(a) {
                return Some(format!("{a:?} twice"));
            }
        }
        for w in line.split([' ', '\'', '"', ':', '(', ')', ',', ';']) {
            if w.starts_with('/') && w.len() > 1 && line.matches(w).count() >= 3 {
                return Some(format!("{w} three times"));
            }
        }
        None
    }

    #[test]
    fn the_repeat_check_finds_the_issues_examples() {
        for bad in [
            "TLS: /c/server-cert.pem: missing: /c/server-cert.pem: missing",
            "--metrics 0.0.0.0:9: cannot listen: Address already in use (os error 98): \
             Address already in use (os error 98)",
            "'/i/x.img' (missing: cannot attach '/i/x.img': cannot open '/i/x.img': gone)",
        ] {
            assert!(repeats(bad).is_some(), "{bad}");
        }
        assert_eq!(
            repeats("cannot listen on 127.0.0.1:1: Address already in use"),
            None
        );
    }

    fn io(kind: std::io::ErrorKind) -> std::io::Error {
        std::io::Error::from(kind)
    }

    fn enoent() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::ENOENT)
    }

    /// Every error the CLI prints — of `serve`'s start-up (each variant of
    /// the server's, listeners', metrics', TLS, state, config, pid file and
    /// activation errors, with realistic sources), of the control client,
    /// and the daemon's replies (each `CtlError` the control path sends) —
    /// printed as `loopd: error:` prints it: each cause once, no path three
    /// times, and a class that is not `internal`.
    #[test]
    fn every_printed_error_says_each_cause_once() {
        use loopd::backing::create::CreateError;
        use loopd::daemon::blockdev::BlockdevError;
        use loopd::device::DeviceError;
        use loopd::frontend::ublk::ctrl::CtrlError;
        use loopd::kernel_nbd::KernelNbdError;
        use loopd::server::daemonize::DaemonizeError;
        use loopd::server::notify::NotifyError;
        use std::io::ErrorKind as K;
        use std::path::PathBuf;
        let p = |s: &str| PathBuf::from(s);
        let cert = p("/etc/loopd/tls/server-cert.pem");
        let img = p("/srv/images/vm disk.img");
        let tls = || {
            vec![
                TlsError::Missing {
                    path: cert.clone(),
                    why: "",
                },
                TlsError::Read {
                    path: cert.clone(),
                    source: io(K::PermissionDenied),
                },
                TlsError::Content {
                    path: cert.clone(),
                    what: "no certificate in it".into(),
                },
                TlsError::KeyMismatch {
                    cert: cert.clone(),
                    key: p("/etc/loopd/tls/server-key.pem"),
                },
                TlsError::Config {
                    dir: p("/etc/loopd/tls"),
                    source: rustls::Error::General("bad".into()),
                },
                TlsError::Certificate("truncated".into()),
            ]
        };
        let listen = || {
            vec![
                ListenError::SocketDir(p("/run/loopd"), io(K::PermissionDenied)),
                ListenError::SocketInUse(p("/run/loopd/loopd.sock"), "pass --socket"),
                ListenError::BindUnix(p("/run/loopd/loopd.sock"), io(K::AddrInUse)),
                ListenError::NotASocket {
                    option: "--socket",
                    path: img.clone(),
                    kind: "a regular file",
                },
                ListenError::Inspect(p("/run/x"), io(K::PermissionDenied)),
                ListenError::Appeared(p("/run/x")),
                ListenError::SocketMode(p("/run/x"), io(K::PermissionDenied)),
                ListenError::BindTcp("0.0.0.0:10809".into(), io(K::AddrInUse)),
                ListenError::UnsafeDir {
                    path: p("/run/user/1/loopd"),
                    why: "it is a symbolic link".into(),
                },
                ListenError::BadListen("1.2.3.4:x".into()),
                ListenError::UnknownGroup("diks".into()),
            ]
        };
        let metrics = || {
            vec![
                MetricsError::BindTcp("0.0.0.0:9100".into(), io(K::AddrInUse)),
                MetricsError::Spawn(io(K::OutOfMemory)),
            ]
        };
        let blockdev = |source: BlockdevError| CtlError::Blockdev {
            name: "vm".into(),
            source,
        };
        let device = |source: DeviceError| CtlError::Device {
            msg: format!("cannot attach {}", loopd::text::quoted_path(&img)),
            source,
        };
        let ctl = || {
            vec![
                CtlError::NotFound("vm".into()),
                CtlError::NameTaken("vm".into()),
                CtlError::Busy("clients are connected".into()),
                CtlError::Invalid("offset 100 is not a multiple of the block size 512".into()),
                CtlError::ShuttingDown,
                CtlError::TlsOff,
                CtlError::Tls(TlsError::Missing {
                    path: cert.clone(),
                    why: "",
                }),
                blockdev(BlockdevError::Ctrl(CtrlError::NotAvailable {
                    path: p("/dev/ublk-control"),
                })),
                blockdev(BlockdevError::Ctrl(CtrlError::NoAccess {
                    path: p("/dev/ublk-control"),
                    source: io(K::PermissionDenied),
                })),
                blockdev(BlockdevError::Nbd(KernelNbdError::NoModule)),
                blockdev(BlockdevError::Depth(0)),
                device(DeviceError::Open {
                    path: img.clone(),
                    source: enoent(),
                }),
                device(DeviceError::Stat {
                    path: img.clone(),
                    source: enoent(),
                }),
                device(DeviceError::Create {
                    path: img.clone(),
                    source: CreateError::Size {
                        size: 1 << 30,
                        source: io(K::StorageFull),
                    },
                }),
                device(DeviceError::Lock(LockError::InUse {
                    path: img.clone(),
                    why: "qemu (pid 7) holds it".into(),
                })),
                device(DeviceError::Lock(LockError::Open {
                    path: img.clone(),
                    source: enoent(),
                })),
                device(DeviceError::Empty),
            ]
        };
        let mut errors: Vec<anyhow::Error> = Vec::new();
        for t in tls() {
            errors.push(t.into());
        }
        for t in tls() {
            errors.push(ServerError::Tls(t).into());
        }
        for l in listen() {
            errors.push(ServerError::Listen(l).into());
        }
        for m in metrics() {
            errors.push(ServerError::Metrics(m).into());
        }
        for c in ctl() {
            // At start (`serve IMAGE --blockdev`), and as a control reply.
            errors.push(DaemonError(c.body()).into());
            errors.push(ServerError::Blockdev(Box::new(c)).into());
        }
        errors.push(ServerError::TlsNoCerts("require").into());
        errors.push(ServerError::Signals(io(K::Other)).into());
        errors.push(ServerError::Poll(io(K::Interrupted)).into());
        for s in [
            StateError::Write("/var/lib/loopd/a.state".into(), io(K::StorageFull)),
            StateError::Read("/var/lib/loopd/a.state".into(), io(K::PermissionDenied)),
            StateError::NotState("/var/lib/loopd/a.state".into(), "no header"),
            StateError::Locked {
                path: "/var/lib/loopd/a.state".into(),
                pid: "7".into(),
            },
            StateError::Lock("/var/lib/loopd/a.state".into(), io(K::PermissionDenied)),
            StateError::SaveDamaged(
                "/var/lib/loopd/a.state".into(),
                "/var/lib/loopd/a.state.damaged".into(),
                io(K::StorageFull),
            ),
        ] {
            errors.push(s.into());
        }
        let cfg = p("/etc/loopd/devices.toml");
        errors.push(ConfigError::Read(cfg.clone(), enoent()).into());
        errors.push(
            anyhow::Error::new(ConfigError::Parse(
                cfg.clone(),
                "unknown field `imgae`".into(),
            ))
            .context("reading --config"),
        );
        for e in [
            PidFileError::Held {
                path: p("/run/loopd.pid"),
                pid: " (pid 7)".into(),
            },
            PidFileError::Alive {
                path: p("/run/loopd.pid"),
                pid: 7,
                comm: "sshd".into(),
            },
            PidFileError::NotPidFile {
                path: p("/run/loopd.pid"),
                what: "a directory".into(),
            },
            PidFileError::Inspect(p("/run/loopd.pid"), io(K::PermissionDenied)),
            PidFileError::Changed(p("/run/loopd.pid")),
            PidFileError::Write(p("/run/loopd.pid"), io(K::StorageFull)),
        ] {
            errors.push(e.into());
        }
        errors.push(ActivationError::BadPid("x".into()).into());
        errors.push(DaemonizeError::Fork(io(K::OutOfMemory)).into());
        errors.push(NotifyError::Socket(io(K::PermissionDenied)).into());
        for c in [
            ClientError::Connect(p("/run/loopd/loopd.ctl"), enoent()),
            ClientError::Io(p("/run/loopd/loopd.ctl"), io(K::ConnectionReset)),
            ClientError::NoReply,
            ClientError::Protocol("bad reply".into()),
        ] {
            errors.push(c.into());
        }
        errors.push(Classed::new("usage", "--max-connections must be at least 1").into());
        errors.push(UsageError("--name names one device".into()).into());
        let n = errors.len();
        assert!(n > 70, "only {n} errors");
        for e in &errors {
            let (text, _) = line(e);
            assert_eq!(repeats(&text), None, "{text}");
            // Each cause's own text is in the line once at most.
            for c in e.chain() {
                let own = c.to_string();
                if own.len() >= 8 {
                    assert!(text.matches(own.as_str()).count() <= 1, "{own:?} in {text}");
                }
            }
            assert_ne!(classify(e), "internal", "{text}");
        }
    }
}
