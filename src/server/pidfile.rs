//! `--pid-file`: the daemon's pid, for scripts without a service manager.
//!
//! Contract: [`check`] accepts a path where nothing is, or a stale pid file: a
//! regular file of at most [`MAX_LEN`] bytes holding one decimal pid and a
//! newline, that no running loopd holds locked and whose pid is not a running
//! process. It refuses a pid file a running loopd holds (it keeps an exclusive
//! `flock` on it while running), one whose pid is alive (a daemon that does
//! not lock its pid file, or a pid reused since), and anything else — a file
//! with other contents (an image named by a typo), a directory, a symbolic
//! link, a FIFO, a device — naming the path; nothing is created or removed
//! then. [`PidFile::write`] publishes the pid once start-up succeeded: written
//! and locked under a temporary name, the stale file (if the path still names
//! the one checked) removed, then moved into place without replacing
//! anything. The lock is held until the [`PidFile`] is dropped, which removes
//! the file if the path still names it (see [`super::owned`]).

use super::owned::{self, FileId, Owned, StaleError, kind_name};
use rustix::fs::{FileType, FlockOperation};
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The largest file taken for a stale pid file: a pid (at most 10 digits
/// on Linux) and a newline, with room to spare.
pub const MAX_LEN: u64 = 32;

#[derive(Debug, Error)]
pub enum PidFileError {
    #[error(
        "the pid file {path} belongs to a running loopd{pid}; stop it, or pass another --pid-file"
    )]
    Held { path: PathBuf, pid: String },
    #[error(
        "--pid-file {}: it holds pid {pid}, which is a running process ({comm}); if that \
         is not a loopd of this pid file, remove the file, or pass another --pid-file",
        .path.display()
    )]
    Alive {
        path: PathBuf,
        pid: i32,
        comm: String,
    },
    #[error(
        "--pid-file {}: it is {what}, not a pid file; loopd replaces only a stale pid file \
         (one pid and a newline) and never removes anything else: give --pid-file a path \
         of its own",
        .path.display()
    )]
    NotPidFile { path: PathBuf, what: String },
    #[error("cannot inspect the pid file {0}")]
    Inspect(PathBuf, #[source] std::io::Error),
    #[error("--pid-file {0}: it changed while loopd was starting; nothing there was replaced")]
    Changed(PathBuf),
    #[error("cannot write the pid file {0}")]
    Write(PathBuf, #[source] std::io::Error),
}

/// The pid in a pid file's bytes: one decimal number without a sign or
/// leading zero, then one newline, nothing else.
pub fn parse_pid(bytes: &[u8]) -> Option<i32> {
    let digits = bytes.strip_suffix(b"\n")?;
    if digits.is_empty() || digits[0] == b'0' || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse::<i32>().ok()
}

/// The command name of a running process, for the refusal.
fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| crate::text::escape(s.trim_end()).into_owned())
        .unwrap_or_else(|_| "?".into())
}

/// Refuse `path` unless nothing is there or it is a stale pid file (see the
/// module doc); `Ok(Some(id))`: the stale file to remove.
pub fn check(path: &Path) -> Result<Option<FileId>, PidFileError> {
    let not = |what: &str| PidFileError::NotPidFile {
        path: path.to_path_buf(),
        what: what.into(),
    };
    let inspect = |e| PidFileError::Inspect(path.to_path_buf(), e);
    let (id, kind) = match FileId::of(path).map_err(inspect)? {
        None => return Ok(None),
        Some(x) => x,
    };
    if kind != FileType::RegularFile {
        return Err(not(kind_name(kind)));
    }
    // Not through a symbolic link put there since, and never waiting on a FIFO.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(inspect)?;
    if FileId::of_fd(&f).map_err(inspect)? != id {
        return Err(PidFileError::Changed(path.to_path_buf()));
    }
    let mut bytes = Vec::new();
    (&f).take(MAX_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(inspect)?;
    if bytes.len() as u64 > MAX_LEN {
        return Err(not("a regular file of more than a pid"));
    }
    let Some(pid) = parse_pid(&bytes) else {
        return Err(not(
            "a regular file that does not hold one pid and a newline",
        ));
    };
    if rustix::fs::flock(&f, FlockOperation::NonBlockingLockShared).is_err() {
        return Err(PidFileError::Held {
            path: path.to_path_buf(),
            pid: format!(" (pid {pid})"),
        });
    }
    if crate::blockdev::users::process_alive(pid) {
        return Err(PidFileError::Alive {
            path: path.to_path_buf(),
            pid,
            comm: comm(pid),
        });
    }
    Ok(Some(id))
}

/// A pid file this process wrote and holds.
pub struct PidFile {
    owned: Owned,
    _file: File,
}

impl PidFile {
    /// Write this process's pid to `path` (see the module doc), and lock it.
    pub fn write(path: &Path) -> Result<PidFile, PidFileError> {
        let stale = check(path)?;
        let err = |e: std::io::Error| PidFileError::Write(path.to_path_buf(), e);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.loopd-{}", std::process::id()));
        let made = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .custom_flags(libc::O_CLOEXEC)
                .open(&tmp)?;
            rustix::fs::flock(&f, FlockOperation::NonBlockingLockExclusive)?;
            writeln!(f, "{}", std::process::id())?;
            f.sync_all()?;
            Ok::<_, std::io::Error>(f)
        })();
        let f = match made {
            Ok(f) => f,
            Err(e) => {
                // create_new failed on a file that is not ours: leave it.
                if e.kind() != std::io::ErrorKind::AlreadyExists {
                    let _ = std::fs::remove_file(&tmp);
                }
                return Err(err(e));
            }
        };
        let id = FileId::of_fd(&f).map_err(err)?;
        let placed = match stale {
            Some(old) => owned::remove_stale(path, old),
            None => Ok(()),
        }
        .and_then(|()| owned::place(&tmp, path).map_err(StaleError::Io));
        match placed {
            Ok(()) => Ok(PidFile {
                owned: Owned::new(path.to_path_buf(), id, "pid file"),
                _file: f,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(match e {
                    StaleError::Changed => PidFileError::Changed(path.to_path_buf()),
                    StaleError::Io(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        PidFileError::Changed(path.to_path_buf())
                    }
                    StaleError::Io(e) => err(e),
                })
            }
        }
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        self.owned.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid no process has: past the kernel's pid_max.
    const DEAD: i32 = 1 << 30;

    #[test]
    fn written_held_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("loopd.pid");
        // A stale file (nobody holds it, its pid is gone) is replaced.
        std::fs::write(&p, format!("{DEAD}\n")).unwrap();
        assert!(check(&p).unwrap().is_some());
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

    #[test]
    fn only_a_stale_pid_file_is_taken() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x");
        for (bytes, why) in [
            (&b"QFI\xfb\0\0\0\x03 an image"[..], "does not hold one pid"),
            (b"", "does not hold one pid"),
            (b"123", "does not hold one pid"),
            (b"0123\n", "does not hold one pid"),
            (b"-5\n", "does not hold one pid"),
            (b"12\n13\n", "does not hold one pid"),
            (&[b'1'; 40][..], "more than a pid"),
        ] {
            std::fs::write(&p, bytes).unwrap();
            let e = check(&p).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(&*p.to_string_lossy()), "{e}");
            assert!(PidFile::write(&p).is_err());
            assert_eq!(std::fs::read(&p).unwrap(), bytes, "the file was touched");
        }
        // A live pid that no loopd locked: this test's own.
        std::fs::write(&p, format!("{}\n", std::process::id())).unwrap();
        let e = check(&p).unwrap_err().to_string();
        assert!(e.contains("running process"), "{e}");
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        assert!(check(&p).unwrap_err().to_string().contains("a directory"));
        std::fs::remove_dir(&p).unwrap();
        let target = d.path().join("target");
        std::fs::write(&target, format!("{DEAD}\n")).unwrap();
        std::os::unix::fs::symlink(&target, &p).unwrap();
        assert!(check(&p).unwrap_err().to_string().contains("symbolic link"));
        assert!(PidFile::write(&p).is_err());
        assert!(target.exists() && p.symlink_metadata().is_ok());
    }

    #[test]
    fn pids_are_parsed_strictly() {
        assert_eq!(parse_pid(b"4242\n"), Some(4242));
        assert_eq!(parse_pid(b"4242"), None);
        assert_eq!(parse_pid(b" 4242\n"), None);
        assert_eq!(parse_pid(b"99999999999\n"), None);
    }

    proptest::proptest! {
        #[test]
        fn pid_parser_never_panics(b in proptest::collection::vec(proptest::num::u8::ANY, 0..40)) {
            let _ = parse_pid(&b);
        }
    }
}
