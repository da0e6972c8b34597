//! The control socket: accepts clients and runs their requests against the daemon.
//!
//! One thread accepts; each client gets a thread of its own that reads a request
//! line, runs it ([`Daemon::handle`]) and writes the reply line, so a slow client
//! or a long action (a forced detach) holds up nobody else. The socket is created
//! mode 0600 (owner only): it is bound under a temporary name, chmod-ed, then
//! renamed into place, so it is never reachable with looser permissions.

use super::proto::{self, ErrorBody, ErrorCode, MAX_LINE, err_reply};
use crate::daemon::Daemon;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ControlError {
    #[error("cannot create directory {0} for the control socket")]
    Dir(PathBuf, #[source] std::io::Error),
    #[error("{0} is in use by another daemon")]
    InUse(PathBuf),
    #[error("cannot listen on control socket {0}")]
    Bind(PathBuf, #[source] std::io::Error),
    #[error("cannot start the control thread")]
    Spawn(#[source] std::io::Error),
}

/// Bind the control socket at `path`, owner-only.
pub fn bind(path: &Path) -> Result<UnixListener, ControlError> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() && !dir.exists() {
            std::fs::create_dir_all(dir).map_err(|e| ControlError::Dir(dir.to_path_buf(), e))?;
        }
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(ControlError::InUse(path.to_path_buf()));
        }
        let _ = std::fs::remove_file(path);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let l = UnixListener::bind(&tmp).map_err(|e| ControlError::Bind(path.to_path_buf(), e))?;
    let perms = std::fs::Permissions::from_mode(0o600);
    std::fs::set_permissions(&tmp, perms).map_err(|e| ControlError::Bind(path.to_path_buf(), e))?;
    std::fs::rename(&tmp, path).map_err(|e| ControlError::Bind(path.to_path_buf(), e))?;
    Ok(l)
}

/// Serve control clients on `listener` for the life of the process.
pub fn spawn(listener: UnixListener, daemon: Arc<Daemon>) -> Result<(), ControlError> {
    std::thread::Builder::new()
        .name("loopd-control".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => {
                        let d = Arc::clone(&daemon);
                        let r = std::thread::Builder::new()
                            .name("loopd-control-client".into())
                            .spawn(move || {
                                if let Err(e) = serve_client(s, &d) {
                                    tracing::debug!("control client: {e}");
                                }
                            });
                        if let Err(e) = r {
                            tracing::warn!("cannot start a control client thread: {e}");
                        }
                    }
                    Err(e) => tracing::warn!("control accept failed: {e}"),
                }
            }
        })
        .map(|_| ())
        .map_err(ControlError::Spawn)
}

fn serve_client(s: UnixStream, daemon: &Daemon) -> std::io::Result<()> {
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        let n = (&mut r)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') && n > MAX_LINE {
            let e = ErrorBody {
                code: ErrorCode::BadRequest,
                message: format!("request longer than {MAX_LINE} bytes"),
            };
            w.write_all(err_reply(&e).as_bytes())?;
            w.write_all(b"\n")?;
            return Ok(());
        }
        while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            line.pop();
        }
        if line.is_empty() {
            continue;
        }
        let reply = match proto::parse_request(&line) {
            Ok(req) => daemon.handle(req),
            Err(e) => err_reply(&e),
        };
        w.write_all(reply.as_bytes())?;
        w.write_all(b"\n")?;
    }
}
