//! How a failed command ends: one error class per failure, each with its own
//! exit status and machine code (the control protocol's codes plus the
//! client's own `not_running` and `usage`). Under `--json` the error is also
//! printed to stdout as `{"error":{"code":"…","message":"…"}}`; the human line
//! always goes to stderr.
//!
//! Contract: [`classify`] looks at the whole cause chain of an error and never
//! fails; every control protocol code has a class (the match is exhaustive).

use loopd::backing::format::RawError;
use loopd::backing::identity::IdentityError;
use loopd::backing::lock::LockError;
use loopd::control::client::ClientError;
use loopd::control::proto::{ErrorBody, ErrorCode};
use loopd::kernel_loop::KernelLoopError;
use thiserror::Error;

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
        "clients are connected; the change needs --force; or the image is in use (busy)",
    ),
    (NAME_TAKEN, "a device with that name exists (name_taken)"),
    (
        INVALID,
        "a value is out of range or the request is malformed (invalid, bad_request, unsupported_version)",
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

/// The machine code of a failure, from the first cause that has one.
pub fn classify(e: &anyhow::Error) -> &'static str {
    for cause in e.chain() {
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

/// The `--json` error object.
pub fn json_error(code: &str, message: &str) -> String {
    serde_json::json!({ "error": { "code": code, "message": message } }).to_string()
}

/// The line a failure prints after `loopd: error: ` (ending with its code),
/// and its exit status.
pub fn line(e: &anyhow::Error) -> (String, u8) {
    let code = classify(e);
    let message = format!("{e:#}");
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
    let message = format!("{e:#}");
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
}
