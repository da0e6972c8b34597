//! Socket activation (systemd's `LISTEN_FDS` protocol, without libsystemd).
//!
//! Contract: the service manager passes listening sockets as descriptors 3, 4, …
//! with `LISTEN_PID` (this process), `LISTEN_FDS` (how many) and optionally
//! `LISTEN_FDNAMES` (colon-separated names, from `FileDescriptorName=` or
//! `--fdname`). [`parse_env`] is the pure reading of those variables; [`take`]
//! reads them once, removes them from the environment (children never inherit
//! them), marks the descriptors close-on-exec and classifies each one:
//!
//! - `control`: the control socket; must be a listening Unix stream socket;
//! - `nbd`, `unknown` or no name: an NBD listener (Unix or TCP stream, listening);
//! - any other name is refused, naming it.
//!
//! Activated sockets belong to the service manager: the server never unlinks
//! their files.

use std::net::TcpListener;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use thiserror::Error;

/// The first descriptor passed (`SD_LISTEN_FDS_START`).
pub const FIRST_FD: RawFd = 3;
/// More descriptors than this is not a sane activation (and would overflow).
const MAX_FDS: usize = 4096;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ActivationError {
    #[error("LISTEN_PID={0:?} is not a process id")]
    BadPid(String),
    #[error("LISTEN_FDS={0:?} is not a number of descriptors (0 to {MAX_FDS})")]
    BadCount(String),
    #[error("LISTEN_FDNAMES has {names} names for LISTEN_FDS={fds}")]
    NameCount { names: usize, fds: usize },
    #[error(
        "activated socket {fd} is named {name:?}; loopd takes only `nbd` (or `unknown`, or no name) \
         and `control` (FileDescriptorName= in the .socket unit)"
    )]
    UnknownName { fd: RawFd, name: String },
    #[error("activated socket {fd} ({name}) is not a listening stream socket: {why}")]
    NotListening {
        fd: RawFd,
        name: String,
        why: String,
    },
    #[error("activated socket {fd} is named `control` but is not a Unix socket")]
    ControlNotUnix { fd: RawFd },
    #[error("more than one activated socket is named `control`")]
    TwoControls,
}

/// The descriptors the variables announce, each with its name (`None` when
/// unnamed or named empty). Empty when the variables are absent or addressed to
/// another process (`LISTEN_PID` is not `my_pid`), as `sd_listen_fds` does.
pub fn parse_env(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    listen_fdnames: Option<&str>,
    my_pid: u32,
) -> Result<Vec<(RawFd, Option<String>)>, ActivationError> {
    let (Some(pid), Some(fds)) = (listen_pid, listen_fds) else {
        return Ok(Vec::new());
    };
    let pid: u32 = pid
        .trim()
        .parse()
        .map_err(|_| ActivationError::BadPid(pid.to_owned()))?;
    if pid != my_pid {
        return Ok(Vec::new());
    }
    let n: usize = match fds.trim().parse() {
        Ok(n) if n <= MAX_FDS => n,
        _ => return Err(ActivationError::BadCount(fds.to_owned())),
    };
    let names: Vec<Option<String>> = match listen_fdnames {
        None => vec![None; n],
        Some(s) => {
            let v: Vec<Option<String>> = if n == 0 && s.is_empty() {
                Vec::new()
            } else {
                s.split(':')
                    .map(|x| (!x.is_empty()).then(|| x.to_owned()))
                    .collect()
            };
            if v.len() != n {
                return Err(ActivationError::NameCount {
                    names: v.len(),
                    fds: n,
                });
            }
            v
        }
    };
    Ok((FIRST_FD..).zip(names).collect())
}

/// An activated NBD listener.
pub enum NbdSocket {
    /// With its path when it has one (not abstract, not unnamed).
    Unix(UnixListener, Option<PathBuf>),
    Tcp(TcpListener),
}

/// The sockets the service manager passed.
#[derive(Default)]
pub struct Activated {
    pub nbd: Vec<NbdSocket>,
    /// The control socket, with its path when it has one.
    pub control: Option<(UnixListener, Option<PathBuf>)>,
}

impl Activated {
    /// Whether the service manager passed anything.
    pub fn is_empty(&self) -> bool {
        self.nbd.is_empty() && self.control.is_none()
    }

    /// The path of the first activated Unix NBD socket.
    pub fn first_unix_path(&self) -> Option<&PathBuf> {
        self.nbd.iter().find_map(|s| match s {
            NbdSocket::Unix(_, p) => p.as_ref(),
            NbdSocket::Tcp(_) => None,
        })
    }
}

/// Read the activation variables once (removing them) and take the sockets.
/// Call before any thread starts (the environment is changed).
pub fn take() -> Result<Activated, ActivationError> {
    let var = |k: &str| std::env::var(k).ok();
    let fds = parse_env(
        var("LISTEN_PID").as_deref(),
        var("LISTEN_FDS").as_deref(),
        var("LISTEN_FDNAMES").as_deref(),
        std::process::id(),
    );
    for k in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        // SAFETY: called at start-up, before the daemon starts any thread, so
        // nothing reads the environment concurrently.
        unsafe { std::env::remove_var(k) };
    }
    let mut out = Activated::default();
    for (fd, name) in fds? {
        // SAFETY: fcntl(F_GETFD) on any integer only reads the descriptor
        // table; it tells whether `fd` is open before anything owns it.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(ActivationError::NotListening {
                fd,
                name: name.unwrap_or_else(|| "unnamed".into()),
                why: "the descriptor is not open".into(),
            });
        }
        // SAFETY: the service manager passed `fd` to this process for it to own
        // (LISTEN_PID is ours); nothing else in the process uses descriptors
        // from 3 up before this runs, and each is taken exactly once.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let label = name.clone().unwrap_or_else(|| "unnamed".into());
        let not_listening = |why: String| ActivationError::NotListening {
            fd,
            name: label.clone(),
            why,
        };
        rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)
            .map_err(|e| not_listening(e.to_string()))?;
        let ty = rustix::net::sockopt::socket_type(&owned)
            .map_err(|e| not_listening(format!("not a socket ({e})")))?;
        if ty != rustix::net::SocketType::STREAM {
            return Err(not_listening("not a stream socket".into()));
        }
        if !rustix::net::sockopt::socket_acceptconn(&owned).unwrap_or(false) {
            return Err(not_listening("not listening (Accept=no is needed)".into()));
        }
        let domain = rustix::net::sockopt::socket_domain(&owned)
            .map_err(|e| not_listening(e.to_string()))?;
        let unix = domain == rustix::net::AddressFamily::UNIX;
        let tcp = domain == rustix::net::AddressFamily::INET
            || domain == rustix::net::AddressFamily::INET6;
        match name.as_deref() {
            Some("control") => {
                if !unix {
                    return Err(ActivationError::ControlNotUnix { fd });
                }
                if out.control.is_some() {
                    return Err(ActivationError::TwoControls);
                }
                let l = UnixListener::from(owned);
                let path = unix_path(&l);
                out.control = Some((l, path));
            }
            None | Some("nbd") | Some("unknown") => {
                if unix {
                    let l = UnixListener::from(owned);
                    let path = unix_path(&l);
                    out.nbd.push(NbdSocket::Unix(l, path));
                } else if tcp {
                    out.nbd.push(NbdSocket::Tcp(TcpListener::from(owned)));
                } else {
                    return Err(not_listening("neither a Unix nor a TCP socket".into()));
                }
            }
            Some(other) => {
                return Err(ActivationError::UnknownName {
                    fd,
                    name: other.to_owned(),
                });
            }
        }
    }
    if !out.is_empty() {
        tracing::info!(
            "socket activation: {} NBD socket(s){}",
            out.nbd.len(),
            if out.control.is_some() {
                " and the control socket"
            } else {
                ""
            }
        );
    }
    Ok(out)
}

fn unix_path(l: &UnixListener) -> Option<PathBuf> {
    l.local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(|p| p.to_path_buf()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn absent_or_foreign_means_not_activated() {
        assert_eq!(parse_env(None, None, None, 7), Ok(vec![]));
        assert_eq!(parse_env(Some("7"), None, None, 7), Ok(vec![]));
        assert_eq!(parse_env(Some("8"), Some("2"), None, 7), Ok(vec![]));
    }

    #[test]
    fn names_are_matched_to_descriptors_from_3() {
        let v = parse_env(Some("7"), Some("3"), Some("nbd::control"), 7).unwrap();
        assert_eq!(
            v,
            vec![
                (3, Some("nbd".into())),
                (4, None),
                (5, Some("control".into()))
            ]
        );
        let v = parse_env(Some("7"), Some("2"), None, 7).unwrap();
        assert_eq!(v, vec![(3, None), (4, None)]);
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(matches!(
            parse_env(Some("x"), Some("1"), None, 7),
            Err(ActivationError::BadPid(_))
        ));
        assert!(matches!(
            parse_env(Some("7"), Some("-1"), None, 7),
            Err(ActivationError::BadCount(_))
        ));
        assert!(matches!(
            parse_env(Some("7"), Some("99999"), None, 7),
            Err(ActivationError::BadCount(_))
        ));
        assert_eq!(
            parse_env(Some("7"), Some("1"), Some("a:b"), 7),
            Err(ActivationError::NameCount { names: 2, fds: 1 })
        );
        assert_eq!(parse_env(Some("7"), Some("0"), Some(""), 7), Ok(vec![]));
    }

    proptest! {
        #[test]
        fn never_panics(pid in proptest::option::of(".{0,12}"),
                        fds in proptest::option::of(".{0,12}"),
                        names in proptest::option::of(".{0,40}"),
                        me in any::<u32>()) {
            let _ = parse_env(pid.as_deref(), fds.as_deref(), names.as_deref(), me);
        }

        #[test]
        fn counts_and_names_round_trip(n in 0usize..64, me in 1u32..1_000_000,
                                       named in proptest::collection::vec(proptest::option::of("[a-z]{1,8}"), 64)) {
            let names: Vec<Option<String>> = named.into_iter().take(n).collect();
            let joined = names.iter().map(|x| x.clone().unwrap_or_default()).collect::<Vec<_>>().join(":");
            let v = parse_env(Some(&me.to_string()), Some(&n.to_string()),
                              (n > 0).then_some(joined.as_str()), me).unwrap();
            prop_assert_eq!(v.len(), n);
            for ((fd, name), (want_fd, want)) in v.into_iter().zip((FIRST_FD..).zip(&names)) {
                prop_assert_eq!(fd, want_fd);
                prop_assert_eq!(&name, want);
            }
        }
    }
}
