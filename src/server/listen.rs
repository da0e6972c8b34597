//! Where the server listens: the default runtime directory, Unix sockets bound
//! with an explicit mode (never the umask's), TCP listeners.
//!
//! A Unix socket is bound under a temporary name, given its mode (and group),
//! then moved into place (never over another file), so it is never reachable
//! with looser permissions. Only a stale socket is replaced; see
//! [`super::owned`] for what else is refused and what is removed at stop.
//! The default runtime directory is refused unless it is a real directory owned
//! by this user and writable by nobody else: another user could otherwise
//! replace the socket, or read the state kept beside it.

use super::owned::{self, FileId, Owned, kind_name};
use rustix::fs::{FileType, Gid, Mode, Uid};
use std::net::TcpListener;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// A bound NBD endpoint.
pub(crate) enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Unix(u) => u.as_fd(),
            Listener::Tcp(t) => t.as_fd(),
        }
    }
}

#[derive(Debug, Error)]
pub enum ListenError {
    #[error("cannot create directory {0} for the socket")]
    SocketDir(PathBuf, #[source] std::io::Error),
    #[error("{0} is in use by another server; {1}")]
    SocketInUse(PathBuf, &'static str),
    #[error("cannot listen on {0}")]
    BindUnix(PathBuf, #[source] std::io::Error),
    #[error(
        "{option} {}: it is {kind}, not a socket; loopd replaces only a socket left \
         behind by a server that stopped, and never removes anything else: give {option} \
         a path of its own", .path.display()
    )]
    NotASocket {
        option: &'static str,
        path: PathBuf,
        kind: &'static str,
    },
    #[error("cannot inspect {0}")]
    Inspect(PathBuf, #[source] std::io::Error),
    #[error("{0} appeared or changed while loopd was starting; nothing there was replaced")]
    Appeared(PathBuf),
    #[error("cannot set the mode or group of {0}")]
    SocketMode(PathBuf, #[source] std::io::Error),
    #[error("cannot listen on {0}")]
    BindTcp(String, #[source] std::io::Error),
    #[error(
        "refusing the runtime directory {path}: {why}; remove it, or set XDG_RUNTIME_DIR or --socket/--control"
    )]
    UnsafeDir { path: PathBuf, why: String },
    #[error(
        "--listen {0:?}: expected HOST:PORT, HOST (port 10809), :PORT (every address) or [IPV6]:PORT"
    )]
    BadListen(String),
    #[error("unknown group {0:?}")]
    UnknownGroup(String),
}

/// The default socket directory: `/run/loopd` for root, else
/// `$XDG_RUNTIME_DIR/loopd`, else `/tmp/loopd-UID`.
pub fn default_socket_dir() -> PathBuf {
    let uid = rustix::process::geteuid();
    if uid.is_root() {
        return PathBuf::from("/run/loopd");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => Path::new(&d).join("loopd"),
        _ => PathBuf::from(format!("/tmp/loopd-{}", uid.as_raw())),
    }
}

/// Make sure the default runtime directory `dir` exists and is safe: created
/// 0755 (root) or 0700 (others) if missing; if present, a directory (not a
/// symlink) owned by this user and not writable by group or others.
pub fn ensure_runtime_dir(dir: &Path) -> Result<(), ListenError> {
    let uid = rustix::process::geteuid();
    if !dir.exists() {
        if let Some(parent) = dir.parent() {
            if !parent.as_os_str().is_empty() && !parent.exists() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| ListenError::SocketDir(parent.to_path_buf(), e))?;
            }
        }
        let mode = if uid.is_root() { 0o755 } else { 0o700 };
        match std::fs::DirBuilder::new().mode(mode).create(dir) {
            Ok(()) => {
                // The umask may have taken bits away; set exactly this mode.
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| ListenError::SocketDir(dir.to_path_buf(), e))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(ListenError::SocketDir(dir.to_path_buf(), e)),
        }
    }
    check_private_dir(dir, uid)
}

fn check_private_dir(dir: &Path, uid: Uid) -> Result<(), ListenError> {
    let refuse = |why: String| ListenError::UnsafeDir {
        path: dir.to_path_buf(),
        why,
    };
    let st =
        rustix::fs::lstat(dir).map_err(|e| ListenError::SocketDir(dir.to_path_buf(), e.into()))?;
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind != rustix::fs::FileType::Directory {
        return Err(refuse(format!("it is a {kind:?}, not a directory")));
    }
    if st.st_uid != uid.as_raw() {
        return Err(refuse(format!(
            "it is owned by uid {}, not by this user (uid {})",
            st.st_uid,
            uid.as_raw()
        )));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(refuse(format!(
            "its mode {:o} lets others write to it",
            st.st_mode & 0o7777
        )));
    }
    Ok(())
}

/// Bind a Unix socket at `path` with exactly `mode` (and `group`, if given).
/// A stale socket (nobody answers on it) is replaced; a live one is an error,
/// and so is anything at `path` that is not a socket (see [`super::owned`]):
/// a regular file, a directory, a symbolic link, a FIFO or a device is left
/// as it is. A missing parent directory is created 0755. Returns the listener
/// and the socket file, for removal at stop.
pub fn bind_unix(
    path: &Path,
    mode: u32,
    group: Option<Gid>,
    hint: Hint,
) -> Result<(UnixListener, Owned), ListenError> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() && !dir.exists() {
            std::fs::DirBuilder::new()
                .mode(0o755)
                .recursive(true)
                .create(dir)
                .map_err(|e| ListenError::SocketDir(dir.to_path_buf(), e))?;
        }
    }
    let inspect = |e| ListenError::Inspect(path.to_path_buf(), e);
    let stale = match FileId::of(path).map_err(inspect)? {
        None => None,
        Some((id, FileType::Socket)) => {
            if UnixStream::connect(path).is_ok() {
                return Err(ListenError::SocketInUse(path.to_path_buf(), hint.text()));
            }
            // A stale socket from a server that died: nobody answers on it.
            Some(id)
        }
        Some((_, t)) => {
            return Err(ListenError::NotASocket {
                option: hint.option(),
                path: path.to_path_buf(),
                kind: kind_name(t),
            });
        }
    };
    let (l, tmp) = bind_temp(path)?;
    let placed = (|| {
        if let Some(g) = group {
            rustix::fs::chown(&tmp, None, Some(g))?;
        }
        rustix::fs::chmod(&tmp, Mode::from_raw_mode(mode))?;
        let id = FileId::of(&tmp)?.map(|(id, _)| id);
        Ok::<_, std::io::Error>(id)
    })();
    let id = match placed {
        Ok(Some(id)) => id,
        Ok(None) => {
            return Err(ListenError::SocketMode(
                path.to_path_buf(),
                std::io::ErrorKind::NotFound.into(),
            ));
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(ListenError::SocketMode(path.to_path_buf(), e));
        }
    };
    let r = match stale {
        Some(old) => owned::remove_stale(path, old),
        None => Ok(()),
    }
    .and_then(|()| owned::place(&tmp, path).map_err(owned::StaleError::Io));
    match r {
        Ok(()) => Ok((l, Owned::new(path.to_path_buf(), id, "socket"))),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(match e {
                owned::StaleError::Io(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    ListenError::Appeared(path.to_path_buf())
                }
                owned::StaleError::Io(e) => ListenError::BindUnix(path.to_path_buf(), e),
                owned::StaleError::Changed => ListenError::Appeared(path.to_path_buf()),
            })
        }
    }
}

/// Bind a listener under a fresh temporary name beside `path` (never one
/// that exists: another file there is left alone and the next name tried).
fn bind_temp(path: &Path) -> Result<(UnixListener, PathBuf), ListenError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut last = None;
    for n in 0..16 {
        let tmp = path.with_file_name(format!(".{name}.loopd-{}.{n}", std::process::id()));
        match UnixListener::bind(&tmp) {
            Ok(l) => return Ok((l, tmp)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(ListenError::BindUnix(path.to_path_buf(), e)),
        }
    }
    Err(ListenError::BindUnix(
        path.to_path_buf(),
        last.unwrap_or_else(|| std::io::ErrorKind::AddrInUse.into()),
    ))
}

/// Which option moves a socket, for the message when its path is taken.
#[derive(Debug, Clone, Copy)]
pub enum Hint {
    /// The NBD socket (`--socket`).
    Socket,
    /// The control socket (`--control`).
    Control,
    /// The metrics socket (`--metrics PATH`).
    Metrics,
}

impl Hint {
    /// The option that names the path.
    pub fn option(self) -> &'static str {
        match self {
            Hint::Socket => "--socket",
            Hint::Control => "--control",
            Hint::Metrics => "--metrics",
        }
    }

    fn text(self) -> &'static str {
        match self {
            Hint::Socket => {
                "stop it, or pass --socket PATH (and --control/--state) to run a second one"
            }
            Hint::Control => "stop it, or pass --control PATH (and --state) to run a second one",
            Hint::Metrics => "stop it, or pass another --metrics PATH",
        }
    }
}

/// A group given by name or number.
pub fn group_id(g: &str) -> Result<Gid, ListenError> {
    if let Ok(n) = g.parse::<u32>() {
        return Ok(Gid::from_raw(n));
    }
    let name = std::ffi::CString::new(g).map_err(|_| ListenError::UnknownGroup(g.into()))?;
    let mut buf = vec![0u8; 16 << 10];
    // SAFETY: `group` and `result` are plain C out-parameters; `buf` outlives
    // the call and its length is passed; `name` is a NUL-terminated string.
    let mut group: libc::group = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: see above; getgrnam_r writes only into `group`, `buf` and `result`.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut group,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return Err(ListenError::UnknownGroup(g.into()));
    }
    Ok(Gid::from_raw(group.gr_gid))
}

/// NBD's registered TCP port, used when `--listen` gives none.
pub const NBD_PORT: u16 = 10809;

/// `--listen`'s value as `HOST:PORT`: `:PORT` is every IPv4 address
/// (`0.0.0.0:PORT`), a host without a port gets NBD's port, a bare IPv6 address
/// is bracketed (`::1` → `[::1]:10809`).
pub fn normalize_listen(s: &str) -> Result<String, ListenError> {
    let bad = || ListenError::BadListen(s.to_owned());
    let port_ok = |p: &str| p.parse::<u16>().is_ok();
    if s.is_empty() || s.chars().any(char::is_whitespace) {
        return Err(bad());
    }
    if s.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok(format!("[{s}]:{NBD_PORT}"));
    }
    if let Some(port) = s.strip_prefix(':') {
        return port_ok(port)
            .then(|| format!("0.0.0.0:{port}"))
            .ok_or_else(bad);
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(bad)?;
        host.parse::<std::net::Ipv6Addr>().map_err(|_| bad())?;
        return match after {
            "" => Ok(format!("[{host}]:{NBD_PORT}")),
            _ => match after.strip_prefix(':') {
                Some(p) if port_ok(p) => Ok(s.to_owned()),
                _ => Err(bad()),
            },
        };
    }
    match s.rsplit_once(':') {
        None => Ok(format!("{s}:{NBD_PORT}")),
        Some((host, port)) if !host.is_empty() && !host.contains(':') && port_ok(port) => {
            Ok(s.to_owned())
        }
        Some(_) => Err(bad()),
    }
}

/// Bind a TCP listener; warn when other hosts can reach it without TLS
/// (`tls_required`: `--tls require`).
pub fn bind_tcp(addr: &str, tls_required: bool) -> Result<TcpListener, ListenError> {
    let l = TcpListener::bind(addr).map_err(|e| ListenError::BindTcp(addr.to_owned(), e))?;
    if let Some(w) = l
        .local_addr()
        .ok()
        .and_then(|a| exposure_warning(a, tls_required))
    {
        tracing::warn!("{w}");
    }
    Ok(l)
}

/// The warning for a TCP listener other hosts may reach (any address but
/// loopback) when TLS is not required, or `None`.
pub fn exposure_warning(a: std::net::SocketAddr, tls_required: bool) -> Option<String> {
    (!a.ip().is_loopback() && !tls_required).then(|| {
        format!(
            "listening on {a} without --tls require: any host that can reach it can read \
             and write every device not limited to client certificates (and list them \
             unless --no-list); use --tls require --tls-certs DIR [--tls-verify-peer], \
             or listen on 127.0.0.1 or a Unix socket, or firewall it"
        )
    })
}

/// The warning for a metrics listener other hosts may reach (any address but
/// loopback), or `None`: the metrics name every device and count its I/O,
/// with no authentication.
pub fn metrics_exposure_warning(a: std::net::SocketAddr) -> Option<String> {
    (!a.ip().is_loopback()).then(|| {
        format!(
            "--metrics on {a}: any host that can reach it can read the metrics (every \
             device's name and I/O counters; there is no authentication); listen on \
             127.0.0.1 or a Unix socket, or firewall it"
        )
    })
}

/// The address a client on this host connects to for a listener bound to
/// `a`: `a` itself, but loopback for an unspecified address (`0.0.0.0`,
/// `[::]`), which names no host a client can reach.
pub fn client_addr(a: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    match a.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, a.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, a.port()).into(),
        _ => a,
    }
}

/// The line that says where a listener whose URIs name loopback is really
/// bound (an unspecified address), or `None`.
pub fn bind_note(a: std::net::SocketAddr) -> Option<String> {
    let every = if a.is_ipv4() { "IPv4" } else { "IPv6" };
    a.ip().is_unspecified().then(|| {
        format!(
            "listening on {} (every {every} address; the URIs name loopback: from another \
             host, put this host's name or address in their place)",
            uri_host(&a)
        )
    })
}

/// `HOST:PORT` of a listener, as it goes in a URI.
pub fn uri_host(addr: &std::net::SocketAddr) -> String {
    match addr {
        std::net::SocketAddr::V4(a) => format!("{}:{}", a.ip(), a.port()),
        std::net::SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_gets_the_mode_asked_whatever_the_umask() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.sock");
        let old = rustix::process::umask(Mode::empty());
        let r = bind_unix(&p, 0o600, None, Hint::Socket);
        rustix::process::umask(old);
        let (_l, _owned) = r.unwrap();
        let m = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, 0o600);
    }

    #[test]
    fn runtime_dir_writable_by_others_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("rt");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = ensure_runtime_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("lets others write"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        ensure_runtime_dir(&dir).unwrap();
    }

    #[test]
    fn only_non_loopback_listeners_are_warned_about() {
        let warn = |s: &str| exposure_warning(s.parse().unwrap(), false);
        assert!(warn("127.0.0.1:10809").is_none());
        assert!(warn("[::1]:10809").is_none());
        let w = warn("0.0.0.0:10809").expect("all addresses");
        assert!(
            w.contains("without --tls require") && w.contains("0.0.0.0:10809"),
            "{w}"
        );
        assert!(warn("[::]:10809").is_some());
        assert!(warn("192.0.2.7:10809").is_some());
        let required = |s: &str| exposure_warning(s.parse().unwrap(), true);
        assert!(required("0.0.0.0:10809").is_none());
    }

    #[test]
    fn listen_addresses_are_normalized() {
        let n = |s: &str| normalize_listen(s).map_err(|e| e.to_string());
        assert_eq!(n(":10809").unwrap(), "0.0.0.0:10809");
        assert_eq!(n(":0").unwrap(), "0.0.0.0:0");
        assert_eq!(n("127.0.0.1").unwrap(), "127.0.0.1:10809");
        assert_eq!(n("localhost").unwrap(), "localhost:10809");
        assert_eq!(n("127.0.0.1:7000").unwrap(), "127.0.0.1:7000");
        assert_eq!(n("[::1]:10809").unwrap(), "[::1]:10809");
        assert_eq!(n("[::1]").unwrap(), "[::1]:10809");
        assert_eq!(n("::1").unwrap(), "[::1]:10809");
        for bad in [
            "", ":", ":x", ":70000", "[::1", "[zz]:1", "[::1]x", "a:b:c", "h:", " h",
        ] {
            let e = n(bad).unwrap_err();
            assert!(e.contains("expected HOST:PORT"), "{bad}: {e}");
        }
    }

    proptest::proptest! {
        #[test]
        fn listen_parser_never_panics(s in ".{0,40}") {
            let _ = normalize_listen(&s);
        }
    }

    #[test]
    fn runtime_dir_symlink_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let real = d.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = ensure_runtime_dir(&link).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }

    #[test]
    fn missing_runtime_dir_is_created_private_under_umask_000() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("new");
        let old = rustix::process::umask(Mode::empty());
        let r = ensure_runtime_dir(&dir);
        rustix::process::umask(old);
        r.unwrap();
        let m = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        // Tests run as root.
        let want = if rustix::process::geteuid().is_root() {
            0o755
        } else {
            0o700
        };
        assert_eq!(m, want);
    }

    #[test]
    fn unspecified_addresses_print_loopback_uris_and_say_where_they_bind() {
        let any4: std::net::SocketAddr = "0.0.0.0:10809".parse().unwrap();
        let any6: std::net::SocketAddr = "[::]:10809".parse().unwrap();
        let one: std::net::SocketAddr = "192.0.2.7:10809".parse().unwrap();
        assert_eq!(uri_host(&client_addr(any4)), "127.0.0.1:10809");
        assert_eq!(uri_host(&client_addr(any6)), "[::1]:10809");
        assert_eq!(client_addr(one), one);
        let n = bind_note(any4).expect("a note for 0.0.0.0");
        assert!(
            n.starts_with("listening on 0.0.0.0:10809 (every IPv4 address"),
            "{n}"
        );
        assert!(bind_note(any6).expect("[::]").contains("[::]:10809"));
        assert_eq!(bind_note(one), None);
    }

    #[test]
    fn metrics_other_hosts_reach_are_warned_about() {
        let w = metrics_exposure_warning("0.0.0.0:9100".parse().unwrap()).expect("warned");
        assert!(
            w.contains("--metrics on 0.0.0.0:9100") && w.contains("127.0.0.1"),
            "{w}"
        );
        assert!(metrics_exposure_warning("[::]:9100".parse().unwrap()).is_some());
        assert_eq!(
            metrics_exposure_warning("127.0.0.1:9100".parse().unwrap()),
            None
        );
        assert_eq!(
            metrics_exposure_warning("[::1]:9100".parse().unwrap()),
            None
        );
    }
}
