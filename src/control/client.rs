//! The client side of the control protocol, used by `loopd attach`, `list`, ….

use super::proto::{self, ErrorBody, Request};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error(
        "cannot connect to the control socket {0} (is `loopd serve` running? set --control or LOOPD_CONTROL)"
    )]
    Connect(PathBuf, #[source] std::io::Error),
    #[error("control socket {0}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("the daemon closed the control connection without replying")]
    NoReply,
    #[error("{0}")]
    Protocol(String),
}

/// Send one request and wait for its reply: the result, or the daemon's error.
pub fn call(
    path: &Path,
    req: &Request,
) -> Result<Result<serde_json::Value, ErrorBody>, ClientError> {
    let s = UnixStream::connect(path).map_err(|e| ClientError::Connect(path.to_path_buf(), e))?;
    let io = |e| ClientError::Io(path.to_path_buf(), e);
    let mut line = proto::encode_request(req);
    line.push('\n');
    // Written and read through `&UnixStream`: no second descriptor.
    (&s).write_all(line.as_bytes()).map_err(io)?;
    let mut r = BufReader::new(&s);
    let mut reply = Vec::new();
    r.read_until(b'\n', &mut reply).map_err(io)?;
    if reply.is_empty() {
        return Err(ClientError::NoReply);
    }
    proto::parse_reply(reply.trim_ascii_end()).map_err(ClientError::Protocol)
}
