//! Logging setup: `tracing` to stderr, level from `LOOPD_LOG` (default `info`).
//!
//! Under systemd, stderr is the journal's stream and `JOURNAL_STREAM` names it
//! (`DEV:INODE`). When it matches stderr, lines carry no timestamp (the journal
//! adds its own) and start with a `<N>` syslog priority (sd-daemon(3)), so the
//! journal files each line at its level. Otherwise the usual format.

use std::io::IsTerminal;
use std::os::unix::fs::MetadataExt;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// Install the subscriber for this process.
pub fn init() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("LOOPD_LOG").unwrap_or_else(|_| "info".into());
    let b = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    if stderr_is_journal() {
        b.with_ansi(false).event_format(Journal).init();
    } else {
        b.with_target(false)
            .with_ansi(std::io::stderr().is_terminal())
            .init();
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

/// `<N>message key=value…`: no timestamp, no level word, no colours.
struct Journal;

impl<S, N> FormatEvent<S, N> for Journal
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
        w.write_str(priority(*event.metadata().level()))?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_follow_sd_daemon() {
        assert_eq!(priority(Level::ERROR), "<3>");
        assert_eq!(priority(Level::WARN), "<4>");
        assert_eq!(priority(Level::INFO), "<6>");
        assert_eq!(priority(Level::DEBUG), "<7>");
        assert_eq!(priority(Level::TRACE), "<7>");
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

    #[test]
    fn journal_lines_are_prefixed_without_timestamps() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
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
        let buf = Buf::default();
        let w = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_max_level(Level::DEBUG)
            .with_ansi(false)
            .event_format(Journal)
            .finish();
        tracing::subscriber::with_default(sub, || {
            tracing::error!("disk gone");
            tracing::warn!(device = "a", "slow");
            tracing::info!("attached");
            tracing::debug!("detail");
        });
        let out = String::from_utf8(buf.0.lock().map(|v| v.clone()).unwrap_or_default())
            .unwrap_or_default();
        assert_eq!(
            out,
            "<3>disk gone\n<4>slow device=\"a\"\n<6>attached\n<7>detail\n"
        );
    }
}
