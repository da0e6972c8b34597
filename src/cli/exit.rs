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
use loopd::reactor::ReactorError;
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

/// `attach` of several images, `detach` of several devices: some failed
/// (each already reported on its own line); the exit status is that of the
/// first failure's `code`. `what` ends the line: `image(s) not attached`.
#[derive(Debug, Error)]
#[error("{failed} of {total} {what}")]
pub struct BatchFailed {
    pub failed: usize,
    pub total: usize,
    pub what: &'static str,
    pub code: ErrorCode,
}

/// One failed item of a batch on stderr: `loopd: error: LABEL: MESSAGE (code)`.
/// `label` (an image path, a device name) comes escaped by the caller; the
/// daemon's message is sanitized here.
pub fn print_item_error(label: &str, e: &ErrorBody) {
    eprintln!(
        "loopd: error: {label}: {} ({})",
        loopd::text::sanitize_line(&e.message),
        code_str(e.code)
    );
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
            // io_uring disabled (`kernel.io_uring_disabled`) or refused.
            ServerError::Reactor(ReactorError::Ring(_)) => Some("unavailable"),
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
    if std::env::args_os().any(|a| a == "--json" || a == "-J") {
        let message = usage_message(&e.render().to_string());
        let mut v = serde_json::json!({ "error": { "code": "usage", "message": message } });
        if let Some(arg) = usage_argument(&e) {
            v["error"]["argument"] = arg.into();
        }
        println!("{v}");
    }
    let _ = e.print();
    std::process::ExitCode::from(USAGE)
}

/// Clap's error text as one line: everything before `Usage:`, so the
/// arguments it lists on lines of their own (a missing `<NAME>`) stay in it.
pub fn usage_message(text: &str) -> String {
    let mut out = String::new();
    for l in text.lines().take_while(|l| !l.starts_with("Usage:")) {
        let l = l.trim();
        let l = l.strip_prefix("error: ").unwrap_or(l);
        if l.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push_str(if out.ends_with(':') { " " } else { "; " });
        }
        out.push_str(l);
    }
    out
}

/// The argument a usage error is about (`<NAME>`, `--size-limit
/// <BYTES|none>`), as clap names it; several missing ones joined with a
/// space.
fn usage_argument(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    match e.get(ContextKind::InvalidArg)? {
        ContextValue::String(s) => Some(s.clone()),
        ContextValue::Strings(v) => Some(v.join(" ")),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
