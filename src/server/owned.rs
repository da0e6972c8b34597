//! Files the server puts at paths it is given (its Unix sockets, its pid
//! file): what it may replace at start, and what it may remove at stop.
//!
//! Contract: at start, a path is used only if nothing is there, or what is
//! there is one of loopd's own leftovers (a socket nobody answers on; for the
//! pid file, see [`super::pidfile`]); anything else — a regular file, a
//! directory, a symbolic link, a FIFO, a device — is refused with its path
//! named, and nothing is created or removed. The new file is made under a
//! temporary name and moved into place without replacing anything
//! (`RENAME_NOREPLACE`, or a hard link where the filesystem lacks it), so a
//! file that appeared meanwhile is never overwritten. The stale leftover is
//! removed only if the path still names the very file that was checked.
//! At stop, [`Owned::remove`] unlinks the path only if it still names the
//! file this server made (same `st_dev` and `st_ino`); a path that was
//! replaced meanwhile is left alone, with a warning. The comparison is sound
//! because the caller still holds what it made (the bound socket, the locked
//! pid file) when it removes it, so the inode cannot have been reused.

use crate::backing::create::rename_noreplace_unsupported;
use rustix::fs::{AtFlags, CWD, FileType, RenameFlags};
use rustix::io::Errno;
use std::path::{Path, PathBuf};

/// Which file a path names: device and inode, as `lstat` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    /// What `path` names now (the link itself for a symbolic link), or
    /// `None` if nothing is there.
    pub fn of(path: &Path) -> std::io::Result<Option<(FileId, FileType)>> {
        match rustix::fs::lstat(path) {
            Ok(st) => Ok(Some((
                FileId {
                    dev: st.st_dev,
                    ino: st.st_ino,
                },
                FileType::from_raw_mode(st.st_mode),
            ))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The file an open descriptor is (for a regular file, what the path
    /// names as long as it was not replaced).
    pub fn of_fd(fd: impl std::os::fd::AsFd) -> std::io::Result<FileId> {
        let st = rustix::fs::fstat(fd)?;
        Ok(FileId {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

/// How a file type is named in a refusal.
pub fn kind_name(t: FileType) -> &'static str {
    match t {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symbolic link",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Unknown => "a file of unknown type",
    }
}

/// Why a stale leftover was not removed, or its replacement not placed.
#[derive(Debug)]
pub enum StaleError {
    /// The path names another file than the one checked.
    Changed,
    Io(std::io::Error),
}

/// Remove the stale leftover `stale` at `path`, if the path still names it.
pub fn remove_stale(path: &Path, stale: FileId) -> Result<(), StaleError> {
    match FileId::of(path) {
        Ok(Some((now, _))) if now == stale => std::fs::remove_file(path).map_err(StaleError::Io),
        Ok(None) => Ok(()),
        Ok(Some(_)) => Err(StaleError::Changed),
        Err(e) => Err(StaleError::Io(e)),
    }
}

/// Give `tmp` the name `path` unless that name is taken (`EEXIST` then);
/// `tmp` is gone afterwards either way, unless an error other than EEXIST
/// came from the link fallback (the caller removes it then).
pub fn place(tmp: &Path, path: &Path) -> std::io::Result<()> {
    match rustix::fs::renameat_with(CWD, tmp, CWD, path, RenameFlags::NOREPLACE) {
        Ok(()) => Ok(()),
        Err(e) if rename_noreplace_unsupported(e) => {
            rustix::fs::linkat(CWD, tmp, CWD, path, AtFlags::empty())?;
            let _ = std::fs::remove_file(tmp);
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// A file this server made at a path, removed by [`Owned::remove`] only if
/// the path still names it.
#[derive(Debug)]
pub struct Owned {
    path: PathBuf,
    id: FileId,
    /// What it is, for the warning (`socket`, `pid file`).
    what: &'static str,
}

impl Owned {
    pub fn new(path: PathBuf, id: FileId, what: &'static str) -> Owned {
        Owned { path, id, what }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Unlink the path if it still names the file made; else leave whatever
    /// is there now, and say so.
    pub fn remove(&self) {
        match FileId::of(&self.path) {
            Ok(Some((id, _))) if id == self.id => {
                let _ = std::fs::remove_file(&self.path);
            }
            Ok(None) => {}
            Ok(Some((_, t))) => tracing::warn!(
                "{} no longer names the {} loopd made (it is {} now): left as it is",
                self.path.display(),
                self.what,
                kind_name(t)
            ),
            Err(e) => tracing::warn!(
                "cannot check {} before removing it: {e}; left as it is",
                self.path.display()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_path_is_not_removed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"mine").unwrap();
        // Held open, as loopd holds its pid file and its bound sockets: the
        // inode cannot be reused by the file put in its place.
        let _held = std::fs::File::open(&p).unwrap();
        let (id, _) = FileId::of(&p).unwrap().unwrap();
        let o = Owned::new(p.clone(), id, "pid file");
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, b"someone else's").unwrap();
        o.remove();
        assert_eq!(std::fs::read(&p).unwrap(), b"someone else's");
        // The same file is removed.
        let (id, _) = FileId::of(&p).unwrap().unwrap();
        Owned::new(p.clone(), id, "pid file").remove();
        assert!(!p.exists());
    }

    #[test]
    fn place_never_replaces() {
        let d = tempfile::tempdir().unwrap();
        let (tmp, p) = (d.path().join("tmp"), d.path().join("p"));
        std::fs::write(&tmp, b"new").unwrap();
        std::fs::write(&p, b"old").unwrap();
        let e = place(&tmp, &p).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        std::fs::remove_file(&p).unwrap();
        place(&tmp, &p).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert!(!tmp.exists());
    }
}
