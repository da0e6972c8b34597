//! Logging: `tracing` lines, level from `LOOPD_LOG` (default `info`), to one
//! sink that `loopd serve` may switch while it runs: stderr (the default), a
//! log file (`--log-file`), or syslog (`--fork` without `--log-file`).
//!
//! Contract: every line written is one line. Field values (the message
//! included) are escaped by [`EscapedFields`] and each line is passed through
//! [`loopd::text::sanitize_line`] on its way out (except the colours loopd
//! adds itself on a terminal), so no message, whatever its source (an image
//! path, a device name, an error from the kernel), can end a line early,
//! forge another one, or reach a terminal as a control sequence.
//!
//! Under systemd, stderr is the journal's stream and `JOURNAL_STREAM` names it
//! (`DEV:INODE`). When it matches stderr, lines carry no timestamp (the journal
//! adds its own) and start with a `<N>` syslog priority (sd-daemon(3)), so the
//! journal files each line at its level. Otherwise the usual format (in a
//! log file too, without colours); to syslog, the message alone behind the
//! RFC 3164 header (see [`super::syslog`]).
//!
//! Locking: the sink is one mutex, held while a line is written (as stderr's
//! own lock was); a syslog datagram is sent without waiting (a full socket
//! drops the line and counts it).

use super::syslog::Syslog;
use loopd::text::sanitize_line;
use std::fs::File;
use std::io::{IsTerminal, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::{DefaultFields, Format, Full, Writer};
use tracing_subscriber::fmt::time::SystemTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// Where log lines go.
enum Target {
    /// stderr; `journal`: it is the journal's stream.
    Stderr {
        journal: bool,
        ansi: bool,
    },
    /// `--log-file`: appended to, re-opened by [`reopen`].
    File {
        file: File,
        path: PathBuf,
    },
    Syslog(Syslog),
}

static SINK: Mutex<Target> = Mutex::new(Target::Stderr {
    journal: false,
    ansi: false,
});

fn with_sink<R>(f: impl FnOnce(&mut Target) -> R) -> R {
    f(&mut SINK.lock().unwrap_or_else(PoisonError::into_inner))
}

/// Install the subscriber for this process (lines to stderr).
pub fn init() {
    let journal = stderr_is_journal();
    let ansi = !journal && std::io::stderr().is_terminal();
    with_sink(|t| *t = Target::Stderr { journal, ansi });
    let (filter, bad) = log_filter(std::env::var_os("LOOPD_LOG").as_deref());
    // The filter is the only one with a level, so the global maximum is its
    // own: a `debug!` below it costs one comparison.
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(Sink)
        .with_ansi(ansi)
        .fmt_fields(EscapedFields)
        .event_format(LoopdFormat::new(None));
    tracing_subscriber::registry()
        .with(lines)
        .with(filter)
        .init();
    if let Some(bad) = bad {
        tracing::warn!(
            "LOOPD_LOG={bad:?} is not a log filter (a level such as debug, or target=level pairs joined by commas); logging at info"
        );
    }
}

/// The log filter `LOOPD_LOG` asks for: a level (`debug`) or `target=level`
/// directives joined by commas (`loopd=debug,rustls=warn`), `info` when unset
/// or empty; with the text back when it is not a filter (then `info`). A
/// plain target filter, not `tracing`'s regular-expression one: the CLI
/// starts as a smaller process (no regular-expression tables to relocate).
fn log_filter(value: Option<&std::ffi::OsStr>) -> (Targets, Option<String>) {
    let info = || Targets::new().with_default(tracing::Level::INFO);
    let Some(v) = value.filter(|v| !v.is_empty()) else {
        return (info(), None);
    };
    match v.to_str().map(str::parse::<Targets>) {
        Some(Ok(t)) => (t, None),
        _ => (info(), Some(v.to_string_lossy().into_owned())),
    }
}

/// Why a log file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("--log-file {}: cannot open it", .0.display())]
    Open(PathBuf, #[source] std::io::Error),
    #[error("--log-file {}: not a regular file", .0.display())]
    NotAFile(PathBuf),
    #[error("--log-file {}: a symbolic link (give the file's own path)", .0.display())]
    Symlink(PathBuf),
}

/// Open `path` for appending: created mode 0600, never through a symbolic
/// link, a regular file only (a FIFO is not waited on).
fn open_log(path: &Path) -> Result<File, LogError> {
    let f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => LogError::Symlink(path.to_path_buf()),
            _ => LogError::Open(path.to_path_buf(), e),
        })?;
    let m = f
        .metadata()
        .map_err(|e| LogError::Open(path.to_path_buf(), e))?;
    if !m.file_type().is_file() {
        return Err(LogError::NotAFile(path.to_path_buf()));
    }
    Ok(f)
}

/// A log file opened for appending (see [`open_log`]), not yet in use.
pub struct LogFile {
    file: File,
    path: PathBuf,
}

impl LogFile {
    /// Open (create) the log file at `path`.
    pub fn open(path: &Path) -> Result<LogFile, LogError> {
        Ok(LogFile {
            file: open_log(path)?,
            path: path.to_path_buf(),
        })
    }
}

/// From now on, log lines are appended to `f`.
pub fn use_file(f: LogFile) {
    with_sink(|t| {
        *t = Target::File {
            file: f.file,
            path: f.path,
        }
    });
}

/// From now on, log lines go to syslog through `s`.
pub fn use_syslog(s: Syslog) {
    with_sink(|t| *t = Target::Syslog(s));
}

/// SIGHUP: open the log file again by its path (after logrotate moved it).
/// On failure the old file stays in use and the error is logged.
pub fn reopen() {
    let path = with_sink(|t| match t {
        Target::File { path, .. } => Some(path.clone()),
        _ => None,
    });
    let Some(path) = path else { return };
    match open_log(&path) {
        Ok(f) => with_sink(|t| {
            if let Target::File { file, .. } = t {
                *file = f;
            }
        }),
        Err(e) => tracing::error!("{e}; still writing to the file it was"),
    }
}

/// The writer the subscriber asks for each line.
struct Sink;

/// Writes the lines of one event (the subscriber hands over a whole line).
struct LineWriter {
    level: Level,
}

impl<'a> MakeWriter<'a> for Sink {
    type Writer = LineWriter;
    fn make_writer(&'a self) -> LineWriter {
        LineWriter { level: Level::INFO }
    }
    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> LineWriter {
        LineWriter {
            level: *meta.level(),
        }
    }
}

impl Write for LineWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        with_sink(|t| {
            for line in text.split_terminator('\n') {
                match t {
                    // loopd's own colours stay; every field was escaped.
                    // One write per line (stderr is unbuffered: `writeln!`
                    // would write the line and its newline apart).
                    Target::Stderr { ansi: true, .. } => {
                        let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
                    }
                    Target::Stderr { .. } => {
                        let l = format!("{}\n", sanitize_line(line));
                        let _ = std::io::stderr().write_all(l.as_bytes());
                    }
                    Target::File { file, .. } => {
                        let l = format!("{}\n", sanitize_line(line));
                        let _ = file.write_all(l.as_bytes());
                    }
                    Target::Syslog(s) => s.send(self.level, &sanitize_line(line)),
                }
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Field values as `tracing`'s default, with every control, line break and
/// invisible character escaped ([`loopd::text::sanitize_line`]).
pub struct EscapedFields;

impl<'writer> FormatFields<'writer> for EscapedFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut w: Writer<'writer>,
        fields: R,
    ) -> std::fmt::Result {
        let mut raw = String::new();
        DefaultFields::new().format_fields(Writer::new(&mut raw), fields)?;
        w.write_str(&sanitize_line(&raw))
    }
}

/// The line format for the sink in use (see the module doc).
struct LoopdFormat {
    full: Format<Full, SystemTime>,
    /// A fixed shape instead of the sink's (tests).
    forced: Option<Shape>,
}

impl LoopdFormat {
    fn new(forced: Option<Shape>) -> LoopdFormat {
        LoopdFormat {
            full: tracing_subscriber::fmt::format().with_target(false),
            forced,
        }
    }
}

/// What the sink needs of a line.
#[derive(Clone, Copy)]
enum Shape {
    Full,
    FullPlain,
    Journal,
    Bare,
}

impl<S, N> FormatEvent<S, N> for LoopdFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let shape = self.forced.unwrap_or_else(|| {
            with_sink(|t| match t {
                Target::Stderr { journal: true, .. } => Shape::Journal,
                Target::Stderr { .. } => Shape::Full,
                Target::File { .. } => Shape::FullPlain,
                Target::Syslog(_) => Shape::Bare,
            })
        });
        match shape {
            Shape::Full => self.full.format_event(ctx, w, event),
            Shape::FullPlain => {
                // No colours in a file, whatever stderr was.
                let mut s = String::new();
                self.full.format_event(ctx, Writer::new(&mut s), event)?;
                w.write_str(&s)
            }
            Shape::Journal => {
                w.write_str(priority(*event.metadata().level()))?;
                ctx.field_format().format_fields(w.by_ref(), event)?;
                writeln!(w)
            }
            Shape::Bare => {
                ctx.field_format().format_fields(w.by_ref(), event)?;
                writeln!(w)
            }
        }
    }
}

/// Whether `JOURNAL_STREAM` names the file stderr is.
fn stderr_is_journal() -> bool {
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(m) = std::fs::metadata("/proc/self/fd/2").or_else(|_| std::fs::metadata("/dev/stderr"))
    else {
        return false;
    };
    matches_stream(&v.to_string_lossy(), m.dev(), m.ino())
}

/// Whether `JOURNAL_STREAM`'s `DEV:INODE` (decimal) is `dev`/`ino`.
pub fn matches_stream(var: &str, dev: u64, ino: u64) -> bool {
    let Some((d, i)) = var.trim().split_once(':') else {
        return false;
    };
    d.parse::<u64>() == Ok(dev) && i.parse::<u64>() == Ok(ino)
}

/// The sd-daemon(3) prefix for a level: `<3>` error, `<4>` warning, `<6>`
/// info, `<7>` debug and trace.
pub fn priority(l: Level) -> &'static str {
    match l {
        Level::ERROR => "<3>",
        Level::WARN => "<4>",
        Level::INFO => "<6>",
        _ => "<7>",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_filter_takes_levels_and_target_pairs_and_names_what_it_cannot_read() {
        use std::ffi::OsStr;
        use tracing::level_filters::LevelFilter;
        let (t, bad) = log_filter(None);
        assert_eq!((t.default_level(), bad), (Some(LevelFilter::INFO), None));
        let (t, bad) = log_filter(Some(OsStr::new("")));
        assert_eq!((t.default_level(), bad), (Some(LevelFilter::INFO), None));
        let (t, bad) = log_filter(Some(OsStr::new("debug")));
        assert_eq!((t.default_level(), bad), (Some(LevelFilter::DEBUG), None));
        let (t, bad) = log_filter(Some(OsStr::new("warn,loopd=trace")));
        assert_eq!(bad, None);
        assert!(t.would_enable("loopd::daemon", &Level::TRACE));
        assert!(!t.would_enable("rustls", &Level::INFO));
        let (t, bad) = log_filter(Some(OsStr::new("loopd=loud")));
        assert_eq!(t.default_level(), Some(LevelFilter::INFO));
        assert_eq!(bad.as_deref(), Some("loopd=loud"));
    }

    #[test]
    fn priorities_follow_sd_daemon() {
        assert_eq!(priority(Level::ERROR), "<3>");
        assert_eq!(priority(Level::WARN), "<4>");
        assert_eq!(priority(Level::INFO), "<6>");
        assert_eq!(priority(Level::DEBUG), "<7>");
        assert_eq!(priority(Level::TRACE), "<7>");
    }

    #[test]
    fn syslog_lines_are_the_message_alone_and_files_have_no_colours() {
        for (shape, ansi) in [(Shape::Bare, false), (Shape::FullPlain, true)] {
            let buf = Buf::default();
            let w = buf.clone();
            let sub = tracing_subscriber::fmt()
                .with_writer(move || w.clone())
                .with_ansi(ansi)
                .fmt_fields(EscapedFields)
                .event_format(LoopdFormat::new(Some(shape)))
                .finish();
            tracing::subscriber::with_default(sub, || tracing::warn!("slow\ndisk"));
            let text = buf.text();
            match shape {
                Shape::Bare => assert_eq!(text, "slow\\ndisk\n"),
                _ => assert!(
                    text.contains(" WARN slow\\ndisk") && !text.contains('\u{1b}'),
                    "{text:?}"
                ),
            }
        }
    }

    #[test]
    fn journal_stream_must_match_both_numbers() {
        assert!(matches_stream("8:12345", 8, 12345));
        assert!(matches_stream("8:12345\n", 8, 12345));
        assert!(!matches_stream("8:12346", 8, 12345));
        assert!(!matches_stream("9:12345", 8, 12345));
        assert!(!matches_stream("812345", 8, 12345));
        assert!(!matches_stream("", 8, 12345));
        assert!(!matches_stream("x:y", 8, 12345));
    }

    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::ErrorKind::Other)?
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Buf {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().map(|v| v.clone()).unwrap_or_default())
                .unwrap_or_default()
        }
    }

    #[test]
    fn journal_lines_are_prefixed_without_timestamps() {
        let buf = Buf::default();
        let w = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_max_level(Level::DEBUG)
            .with_ansi(false)
            .fmt_fields(EscapedFields)
            .event_format(LoopdFormat::new(Some(Shape::Journal)))
            .finish();
        tracing::subscriber::with_default(sub, || {
            tracing::error!("disk gone");
            tracing::warn!(device = "a", "slow");
            tracing::info!("attached");
            tracing::debug!("detail");
        });
        assert_eq!(
            buf.text(),
            "<3>disk gone\n<4>slow device=\"a\"\n<6>attached\n<7>detail\n"
        );
    }

    #[test]
    fn every_message_is_one_line_whatever_it_holds() {
        let buf = Buf::default();
        let w = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .fmt_fields(EscapedFields)
            .event_format(LoopdFormat::new(Some(Shape::Journal)))
            .finish();
        let path = "/srv/x\naudit: detach \"prod\" by uid=1000 pid=4242: ok\r\u{1b}[2J\u{202e}";
        tracing::subscriber::with_default(sub, || {
            tracing::info!("cannot open {path}");
            tracing::info!(image = path, "field");
            let e = std::io::Error::other(path);
            tracing::info!(error = &e as &dyn std::error::Error, "source");
        });
        let text = buf.text();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(
            !text.contains(['\r', '\u{1b}', '\u{202e}']),
            "raw control characters: {text:?}"
        );
        assert!(
            text.starts_with(r#"<6>cannot open /srv/x\naudit: detach "prod""#),
            "{text}"
        );
    }
}
