//! Service-manager notifications (systemd's `sd_notify` protocol, without
//! libsystemd).
//!
//! Contract: [`Notifier::from_env`] reads `NOTIFY_SOCKET` once and removes it
//! from the environment (children never inherit it). The value is a path or,
//! starting with `@`, an abstract socket name. Each [`Notifier::send`] is one
//! datagram of `KEY=VALUE` lines. Without `NOTIFY_SOCKET` every send does
//! nothing; a failed send is logged at debug and otherwise ignored (the
//! service manager may be gone, which must not stop the daemon).

use std::os::unix::net::{SocketAddr, UnixDatagram};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NotifyError {
    #[error("NOTIFY_SOCKET={0:?} is neither a path nor an @abstract name")]
    BadAddress(String),
    #[error("cannot open a datagram socket for NOTIFY_SOCKET")]
    Socket(#[source] std::io::Error),
}

/// Where notifications go (nowhere without `NOTIFY_SOCKET`).
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
}

impl Notifier {
    /// A notifier that sends nothing.
    pub fn none() -> Notifier {
        Notifier { target: None }
    }

    /// Read (and unset) `NOTIFY_SOCKET`. Call before any thread starts.
    pub fn from_env() -> Result<Notifier, NotifyError> {
        let v = std::env::var_os("NOTIFY_SOCKET");
        // SAFETY: called at start-up, before the daemon starts any thread, so
        // nothing reads the environment concurrently.
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        let Some(v) = v else {
            return Ok(Notifier::none());
        };
        let s = v.to_string_lossy().into_owned();
        let addr = parse_address(&s).ok_or_else(|| NotifyError::BadAddress(s.clone()))?;
        let sock = UnixDatagram::unbound().map_err(NotifyError::Socket)?;
        Ok(Notifier {
            target: Some((sock, addr)),
        })
    }

    /// Whether a service manager listens.
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// Send one notification (`KEY=VALUE` lines).
    pub fn send(&self, msg: &str) {
        if let Some((sock, addr)) = &self.target {
            if let Err(e) = sock.send_to_addr(msg.as_bytes(), addr) {
                tracing::debug!("NOTIFY_SOCKET: cannot send {msg:?}: {e}");
            }
        }
    }

    /// `READY=1` with the daemon's pid and a status line.
    pub fn ready(&self, status: &str) {
        self.send(&format!(
            "READY=1\nMAINPID={}\nSTATUS={status}",
            std::process::id()
        ));
    }

    /// `RELOADING=1` with the monotonic clock, as `Type=notify-reload` wants.
    pub fn reloading(&self) {
        self.send(&format!("RELOADING=1\nMONOTONIC_USEC={}", monotonic_usec()));
    }

    /// `STOPPING=1`.
    pub fn stopping(&self) {
        self.send("STOPPING=1");
    }
}

/// The socket address `NOTIFY_SOCKET` names: `/path` or `@abstract`.
pub fn parse_address(s: &str) -> Option<SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    if let Some(name) = s.strip_prefix('@') {
        return SocketAddr::from_abstract_name(name.as_bytes()).ok();
    }
    if s.starts_with('/') {
        return SocketAddr::from_pathname(s).ok();
    }
    None
}

fn monotonic_usec() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000)
        .saturating_add(t.tv_nsec as u64 / 1000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::linux::net::SocketAddrExt;

    #[test]
    fn addresses() {
        assert_eq!(
            parse_address("/run/x").unwrap().as_pathname(),
            Some(std::path::Path::new("/run/x"))
        );
        assert_eq!(
            parse_address("@sd").unwrap().as_abstract_name(),
            Some(&b"sd"[..])
        );
        assert!(parse_address("relative").is_none());
        assert!(parse_address("").is_none());
    }

    #[test]
    fn sends_datagrams() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("n.sock");
        let rx = UnixDatagram::bind(&p).unwrap();
        let n = Notifier {
            target: Some((
                UnixDatagram::unbound().unwrap(),
                parse_address(p.to_str().unwrap()).unwrap(),
            )),
        };
        n.ready("serving 1 devices");
        let mut buf = [0u8; 256];
        let len = rx.recv(&mut buf).unwrap();
        let m = std::str::from_utf8(&buf[..len]).unwrap();
        assert!(m.starts_with("READY=1\nMAINPID="), "{m}");
        assert!(m.ends_with("STATUS=serving 1 devices"), "{m}");
        n.stopping();
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"STOPPING=1");
    }
}
