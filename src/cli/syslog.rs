//! Log lines to syslog: RFC 3164 datagrams on a Unix socket (`/dev/log`, or
//! `--syslog-socket`), as glibc's syslog(3) sends them:
//! `<PRI>Mmm dd hh:mm:ss loopd[PID]: MESSAGE`, facility `daemon`. journald,
//! rsyslog and syslog-ng all read this form.
//!
//! Contract: [`Syslog::send`] never waits. The socket is non-blocking: a line
//! the socket does not take at once (the syslog daemon is behind) is dropped
//! and counted, and the next line that goes through is preceded by a warning
//! saying how many were lost. A socket whose reader went away (syslog
//! restarted) is connected again once per line. The message is escaped by
//! the caller (one line, no control characters) and cut at [`MAX_MESSAGE`]
//! bytes.

use std::io::ErrorKind;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use tracing::Level;

/// Where syslog listens unless `--syslog-socket` says otherwise.
pub const DEFAULT_SOCKET: &str = "/dev/log";
/// syslog's facility `daemon`.
const FACILITY_DAEMON: u8 = 3;
/// The longest message sent; longer ones end with `…`.
pub const MAX_MESSAGE: usize = 8000;

/// A connected syslog socket.
pub struct Syslog {
    sock: UnixDatagram,
    path: PathBuf,
    dropped: u64,
}

fn open(path: &Path) -> std::io::Result<UnixDatagram> {
    let sock = UnixDatagram::unbound()?;
    sock.connect(path)?;
    sock.set_nonblocking(true)?;
    Ok(sock)
}

impl Syslog {
    /// Connect to the syslog socket at `path`.
    pub fn connect(path: &Path) -> std::io::Result<Syslog> {
        Ok(Syslog {
            sock: open(path)?,
            path: path.to_path_buf(),
            dropped: 0,
        })
    }

    /// Send one line at `level` (see the module doc: never waits).
    pub fn send(&mut self, level: Level, msg: &str) {
        if self.dropped > 0 {
            let note = format!(
                "{} log line(s) dropped: the syslog socket {} did not take them",
                self.dropped,
                self.path.display()
            );
            if !self.try_send(Level::WARN, &note) {
                self.dropped += 1;
                return;
            }
            self.dropped = 0;
        }
        if !self.try_send(level, msg) {
            self.dropped += 1;
        }
    }

    fn try_send(&mut self, level: Level, msg: &str) -> bool {
        let d = datagram(level, &timestamp(), std::process::id(), msg);
        match self.sock.send(&d) {
            Ok(_) => true,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused | ErrorKind::NotConnected | ErrorKind::NotFound
                ) =>
            {
                // The syslog daemon was restarted: its socket is a new one.
                match open(&self.path) {
                    Ok(s) => {
                        self.sock = s;
                        self.sock.send(&d).is_ok()
                    }
                    Err(_) => false,
                }
            }
            Err(_) => false,
        }
    }
}

/// syslog's severity for a level: err 3, warning 4, info 6, debug 7.
pub fn severity(l: Level) -> u8 {
    match l {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// One datagram: `<PRI>STAMP loopd[PID]: MSG`, MSG cut at [`MAX_MESSAGE`]
/// bytes (on a character boundary).
pub fn datagram(level: Level, stamp: &str, pid: u32, msg: &str) -> Vec<u8> {
    let pri = FACILITY_DAEMON * 8 + severity(level);
    let mut body = msg;
    let mut cut = false;
    if body.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !body.is_char_boundary(end) {
            end -= 1;
        }
        body = &body[..end];
        cut = true;
    }
    format!(
        "<{pri}>{stamp} loopd[{pid}]: {body}{}",
        if cut { "…" } else { "" }
    )
    .into_bytes()
}

/// The local time as RFC 3164 writes it: `Nov  6 09:03:07`.
fn timestamp() -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let t = libc::time_t::try_from(now).unwrap_or(0);
    // SAFETY: `tm` is a plain C struct for localtime_r to fill; `t` and `tm`
    // live across the call, and localtime_r (unlike localtime) keeps no
    // pointer to either and touches no shared buffer.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    let ok = unsafe { !libc::localtime_r(&t, &mut tm).is_null() };
    if !ok {
        return "Jan  1 00:00:00".into();
    }
    let month = usize::try_from(tm.tm_mon)
        .ok()
        .and_then(|m| MONTHS.get(m))
        .unwrap_or(&"Jan");
    format!(
        "{month} {:>2} {:02}:{:02}:{:02}",
        tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_are_rfc3164_with_the_daemon_facility() {
        let d = datagram(Level::INFO, "Nov  6 09:03:07", 42, "audit: attach \"a\"");
        assert_eq!(
            String::from_utf8(d).unwrap(),
            "<30>Nov  6 09:03:07 loopd[42]: audit: attach \"a\""
        );
        let d = datagram(Level::ERROR, "Nov  6 09:03:07", 42, "x");
        assert!(d.starts_with(b"<27>"));
        let d = datagram(Level::WARN, "Nov  6 09:03:07", 42, "x");
        assert!(d.starts_with(b"<28>"));
        let d = datagram(Level::DEBUG, "Nov  6 09:03:07", 42, "x");
        assert!(d.starts_with(b"<31>"));
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let msg = "é".repeat(MAX_MESSAGE);
        let d = String::from_utf8(datagram(Level::INFO, "Jan  1 00:00:00", 1, &msg)).unwrap();
        assert!(d.ends_with('…'));
        assert!(d.len() <= MAX_MESSAGE + 64, "{}", d.len());
    }

    #[test]
    fn timestamps_have_the_rfc3164_shape() {
        let t = timestamp();
        assert_eq!(t.len(), 15, "{t}");
        assert_eq!(&t[3..4], " ");
        assert_eq!(&t[9..10], ":");
    }

    #[test]
    fn lines_reach_the_socket_and_drops_are_reported() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("log");
        let rx = UnixDatagram::bind(&p).unwrap();
        let mut s = Syslog::connect(&p).unwrap();
        s.send(Level::INFO, "hello");
        let mut buf = [0u8; 9000];
        let n = rx.recv(&mut buf).unwrap();
        let got = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(
            got.starts_with("<30>") && got.ends_with("]: hello"),
            "{got}"
        );
        // Fill the socket until lines are dropped, then drain it.
        rx.set_nonblocking(true).unwrap();
        for _ in 0..100_000 {
            s.send(Level::INFO, "filler");
            if s.dropped > 0 {
                break;
            }
        }
        assert!(s.dropped > 0, "the socket never filled");
        while rx.recv(&mut buf).is_ok() {}
        s.send(Level::INFO, "after");
        let n = rx.recv(&mut buf).unwrap();
        let got = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(
            got.starts_with("<28>") && got.contains("log line(s) dropped"),
            "{got}"
        );
        let n = rx.recv(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).ends_with("]: after"));
    }
}
