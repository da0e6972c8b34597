//! `--fork`: run in the background, for scripts without a service manager.
//!
//! Contract: [`fork`] must be called before the process starts any thread. The
//! parent never returns: it waits on a pipe until the child reports, then exits
//! 0 when the child is ready, or prints the child's error and exits with the
//! status the child gives (1 when the child dies without a word). The child returns a [`ReadyPipe`]; it is in a
//! new session, its working directory is `/` (the caller makes relative paths
//! absolute first) and its stdin is `/dev/null`. Its stdout and stderr stay
//! those of the command until [`ReadyPipe::ready`], so start-up output (URIs,
//! warnings) still reaches the caller; then they go to `/dev/null` too.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum DaemonizeError {
    #[error("--fork: cannot make the start-up pipe")]
    Pipe(#[source] std::io::Error),
    #[error("--fork: fork failed")]
    Fork(#[source] std::io::Error),
    #[error("--fork: cannot detach from the terminal")]
    Detach(#[source] std::io::Error),
}

/// The child's end of the start-up pipe.
pub struct ReadyPipe(Option<File>);

/// Fork; returns only in the child (see the module doc).
pub fn fork() -> Result<ReadyPipe, DaemonizeError> {
    let (rx, tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| DaemonizeError::Pipe(e.into()))?;
    // SAFETY: the caller guarantees no other thread runs, so the child's copy
    // of the process is consistent (no lock is held by a thread that is gone).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(DaemonizeError::Fork(std::io::Error::last_os_error()));
    }
    if pid > 0 {
        drop(tx);
        parent(File::from(rx));
    }
    drop(rx);
    rustix::process::setsid().map_err(|e| DaemonizeError::Detach(e.into()))?;
    std::env::set_current_dir("/").map_err(DaemonizeError::Detach)?;
    let null = null().map_err(DaemonizeError::Detach)?;
    rustix::stdio::dup2_stdin(&null).map_err(|e| DaemonizeError::Detach(e.into()))?;
    Ok(ReadyPipe(Some(File::from(tx))))
}

/// The parent: wait for the child's word, then exit.
fn parent(mut rx: File) -> ! {
    let mut msg = Vec::new();
    // Bounded: the read ends when the child writes and closes its end, or exits.
    let _ = Read::by_ref(&mut rx).take(64 << 10).read_to_end(&mut msg);
    let text = String::from_utf8_lossy(&msg);
    if text == "ok" {
        std::process::exit(0);
    }
    if text.is_empty() {
        eprintln!("loopd: error: the daemon exited during start-up");
        std::process::exit(1);
    }
    // "STATUS\nMESSAGE" (see `ReadyPipe::fail`).
    let (status, msg) = match text.split_once('\n') {
        Some((n, m)) => (n.parse::<u8>().ok().filter(|&n| n != 0), m),
        None => (None, &*text),
    };
    eprintln!("loopd: error: {msg}");
    std::process::exit(i32::from(status.unwrap_or(1)));
}

fn null() -> std::io::Result<OwnedFd> {
    Ok(OwnedFd::from(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?,
    ))
}

impl ReadyPipe {
    /// Start-up succeeded: let the parent exit 0, and let go of the terminal.
    pub fn ready(&mut self) {
        if let Some(mut f) = self.0.take() {
            let _ = std::io::stdout().flush();
            if let Ok(null) = null() {
                let _ = rustix::stdio::dup2_stdout(null.as_fd());
                let _ = rustix::stdio::dup2_stderr(null.as_fd());
            }
            let _ = f.write_all(b"ok");
        }
    }

    /// Start-up failed: the parent prints `msg` and exits with `status`.
    pub fn fail(&mut self, status: u8, msg: &str) {
        if let Some(mut f) = self.0.take() {
            let _ = f.write_all(format!("{status}\n{msg}").as_bytes());
            // The parent prints it; the child's own report would repeat it.
            if let Ok(null) = null() {
                let _ = rustix::stdio::dup2_stderr(null.as_fd());
            }
        }
    }
}
