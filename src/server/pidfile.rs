//! `--pid-file`: the daemon's pid, for scripts without a service manager.
//!
//! Contract: [`check`] refuses a pid file another running daemon holds (it keeps
//! an exclusive `flock` on it while running); a file nobody holds is stale and
//! is replaced. [`PidFile::write`] publishes the pid atomically (written under a
//! temporary name, locked, renamed into place) once start-up succeeded; the lock
//! is held until the [`PidFile`] is dropped, which removes the file.

use rustix::fs::FlockOperation;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum PidFileError {
    #[error(
        "the pid file {path} belongs to a running loopd{pid}; stop it, or pass another --pid-file"
    )]
    Held { path: PathBuf, pid: String },
    #[error("cannot write the pid file {0}")]
    Write(PathBuf, #[source] std::io::Error),
}

/// Refuse `path` if a running daemon holds it.
pub fn check(path: &Path) -> Result<(), PidFileError> {
    let Ok(f) = File::open(path) else {
        return Ok(());
    };
    match rustix::fs::flock(&f, FlockOperation::NonBlockingLockShared) {
        Ok(()) => Ok(()),
        Err(_) => {
            let pid = std::fs::read_to_string(path)
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .map_or(String::new(), |s| format!(" (pid {s})"));
            Err(PidFileError::Held {
                path: path.to_path_buf(),
                pid,
            })
        }
    }
}

/// A pid file this process wrote and holds.
pub struct PidFile {
    path: PathBuf,
    _file: File,
}

impl PidFile {
    /// Write this process's pid to `path` atomically, and lock it.
    pub fn write(path: &Path) -> Result<PidFile, PidFileError> {
        check(path)?;
        let err = |e: std::io::Error| PidFileError::Write(path.to_path_buf(), e);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let made = (|| {
            let mut f = File::create(&tmp)?;
            rustix::fs::flock(&f, FlockOperation::NonBlockingLockExclusive)?;
            writeln!(f, "{}", std::process::id())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            Ok(f)
        })();
        match made {
            Ok(f) => Ok(PidFile {
                path: path.to_path_buf(),
                _file: f,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(err(e))
            }
        }
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_held_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("loopd.pid");
        // A stale file (nobody holds it) is replaced.
        std::fs::write(&p, "999999\n").unwrap();
        check(&p).unwrap();
        let f = PidFile::write(&p).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.trim(), std::process::id().to_string());
        let e = check(&p).unwrap_err().to_string();
        assert!(
            e.contains("running loopd") && e.contains("--pid-file"),
            "{e}"
        );
        drop(f);
        assert!(!p.exists());
    }
}
