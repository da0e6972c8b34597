//! Which file an image path names, proven: a root daemon re-opens a path only if
//! it still names the file it first opened.
//!
//! Contract:
//! - Every open of an image goes through a [`Pinned`] file: an `O_PATH`
//!   descriptor (no read, no write, no side effect: a FIFO or a device node
//!   planted at the path is not opened for real, so nothing blocks) whose type
//!   is checked (a regular file or a block device) before any real open. The
//!   real descriptors are then opened *through* it (`/proc/self/fd/N`, the same
//!   inode, no path lookup), and each is checked to be that inode.
//! - The first open ([`Pinned::first`], an `attach`, `serve IMAGE`, `--config`)
//!   follows the path as given and records its [`FileIdentity`]: device and
//!   inode, owner, kind, whether the path went through a symbolic link (and
//!   then the file's own name, where the links led), and the boot it was seen
//!   in. The state file keeps it.
//! - A re-open by path ([`Pinned::again`]: a restart from the state file, the
//!   retry of a missing device) resolves the path with no symbolic link at all
//!   (`openat2(RESOLVE_NO_SYMLINKS)`) when the first open followed none, and
//!   accepts the file only if it is the recorded one:
//!   - in the same boot (same `/proc/sys/kernel/random/boot_id`): the same
//!     device and inode (a block device: the same device number);
//!   - after a reboot, where device numbers of some filesystems (btrfs
//!     subvolumes, NFS, overlayfs, tmpfs) and disks change: the same inode and
//!     owner, and, if the first open went through a link, the links still lead
//!     to the same name. A block device after a reboot: reached the same way
//!     (no link, or links that lead to the same name); nobody but root can make
//!     a device node.
//!
//!   Anything else is refused ([`IdentityError::NowSymlink`],
//!   [`IdentityError::Different`], [`IdentityError::NotAFile`]) with what to do.
//! - A record without an identity (a state file of an older loopd) is re-opened
//!   as if its first open had followed no link ([`Pinned::unrecorded`]): a path
//!   that goes through one is refused. Nothing proves the file found is the one
//!   attached, so it is trusted only if nobody but the owner of its directory
//!   (or root) can have put it there, as theirs ([`unrecorded_doubt`]): it has
//!   one link (a hard link to someone else's file has two, and needs no write
//!   permission on that file, where `fs.protected_hardlinks` is off), its
//!   directory is writable by its owner alone, and the file belongs to that
//!   owner, or the directory to root. Otherwise it is refused
//!   ([`IdentityError::UnrecordedDoubt`]), saying to attach it again; a
//!   trusted file's identity is recorded from then on. The directory and the
//!   file are opened in turn (`O_PATH`, no link followed), so the facts
//!   checked are those of the file opened.
//! - A reconfiguration (`set`, `resize`) never looks at the path: it re-opens
//!   the device's own [`Pinned`] file.
//!
//! Blocking: these are metadata system calls on the image's filesystem (which
//! may be a network filesystem); no lock is held.

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;
use thiserror::Error;

/// What kind of file an image is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    File,
    Block,
}

impl FileKind {
    fn name(self) -> &'static str {
        match self {
            FileKind::File => "a regular file",
            FileKind::Block => "a block device",
        }
    }
}

/// The identity of an image file as first opened (kept in the state file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileIdentity {
    pub kind: FileKind,
    /// `st_dev` and `st_ino`.
    pub dev: u64,
    pub ino: u64,
    /// The owner (`st_uid`).
    pub uid: u32,
    /// A block device's device number (`st_rdev`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rdev: u64,
    /// The path went through a symbolic link.
    #[serde(default, skip_serializing_if = "is_false")]
    pub symlink: bool,
    /// Where the links led: the file's own name (only with `symlink`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<PathBuf>,
    /// The boot it was seen in (`/proc/sys/kernel/random/boot_id`; empty if
    /// unknown, which counts as another boot).
    #[serde(default)]
    pub boot: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Error)]
pub enum IdentityError {
    #[error("cannot open {}", crate::text::quoted_path(.path))]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is {what}, not a regular file or block device", crate::text::quoted_path(.path))]
    NotAFile { path: PathBuf, what: &'static str },
    #[error(
        "{} now goes through a symbolic link, which it did not when the device was \
         attached: it may name another file, so it is not opened; detach the device, or attach \
         {} again under the device's name (`loopd attach {} --name NAME`) to accept \
         the file it names now", crate::text::quoted_path(.path), crate::text::quoted_path(.path), crate::text::quoted_path(.path))]
    NowSymlink { path: PathBuf },
    #[error(
        "{} was recorded by an older loopd without its file's identity and goes through a \
         symbolic link, so it is not opened; attach {} again under the device's name \
         (`loopd attach {} --name NAME`) to accept the file it names now", crate::text::quoted_path(.path), crate::text::quoted_path(.path), crate::text::quoted_path(.path))]
    UnrecordedSymlink { path: PathBuf },
    #[error(
        "{} was recorded by an older loopd without its file's identity, and {why}: another \
         user may have put it there, so it is not opened; attach {} again under the device's \
         name (`loopd attach {} --name NAME`) to accept the file it names now", crate::text::quoted_path(.path), crate::text::quoted_path(.path), crate::text::quoted_path(.path))]
    UnrecordedDoubt { path: PathBuf, why: String },
    #[error(
        "{} now names a different file ({why}) than when the device was attached, so it is \
         not opened; detach the device, or attach {} again under the device's name \
         (`loopd attach {} --name NAME`) to accept the file it names now", crate::text::quoted_path(.path), crate::text::quoted_path(.path), crate::text::quoted_path(.path))]
    Different { path: PathBuf, why: String },
    #[error("cannot open {} again through its descriptor ({proc}; is /proc mounted?)", crate::text::quoted_path(.path))]
    Reopen {
        path: PathBuf,
        proc: String,
        #[source]
        source: std::io::Error,
    },
}

/// This boot's id (empty if it cannot be read).
pub fn boot_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    })
}

/// Why the file seen now (`now`) is not the one recorded (`rec`), if it is not
/// (pure: the rule of the module documentation).
pub fn mismatch(rec: &FileIdentity, now: &FileIdentity) -> Option<String> {
    if rec.kind != now.kind {
        return Some(format!(
            "it was {} and is now {}",
            rec.kind.name(),
            now.kind.name()
        ));
    }
    let same_boot = !rec.boot.is_empty() && rec.boot == now.boot;
    if same_boot {
        return match rec.kind {
            FileKind::File if (rec.dev, rec.ino) != (now.dev, now.ino) => Some(format!(
                "device:inode {}:{} recorded, {}:{} now",
                rec.dev, rec.ino, now.dev, now.ino
            )),
            FileKind::Block if rec.rdev != now.rdev => Some(format!(
                "block device {} recorded, {} now",
                devno(rec.rdev),
                devno(now.rdev)
            )),
            _ => None,
        };
    }
    if rec.kind == FileKind::File && rec.ino != now.ino {
        return Some(format!("inode {} recorded, {} now", rec.ino, now.ino));
    }
    if rec.kind == FileKind::File && rec.uid != now.uid {
        return Some(format!("owner uid {} recorded, {} now", rec.uid, now.uid));
    }
    if rec.symlink && rec.target != now.target {
        let shown = |t: &Option<PathBuf>| {
            t.as_ref().map_or_else(
                || "?".to_owned(),
                |p| crate::text::quoted_path(p).to_string(),
            )
        };
        return Some(format!(
            "its links led to {} and lead to {} now",
            shown(&rec.target),
            shown(&now.target)
        ));
    }
    None
}

fn devno(rdev: u64) -> String {
    format!("{}:{}", rustix::fs::major(rdev), rustix::fs::minor(rdev))
}

/// An image file, pinned by an `O_PATH` descriptor: every real descriptor of
/// the device is opened through it. See the module documentation.
#[derive(Debug)]
pub struct Pinned {
    path: PathBuf,
    fd: OwnedFd,
    identity: FileIdentity,
}

impl Pinned {
    /// The first open of `path` (an attach): follow it as given, check what it
    /// names, record its identity.
    pub fn first(path: &Path) -> Result<Pinned, IdentityError> {
        let (fd, symlink) = match open_path(path, true) {
            Ok(fd) => (fd, false),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => (
                open_path(path, false).map_err(|source| open_err(path, source))?,
                true,
            ),
            Err(source) => return Err(open_err(path, source)),
        };
        Self::pin(path, fd, symlink)
    }

    /// A re-open of a recorded device's `path`: only the file `rec` describes
    /// (see the module documentation).
    pub fn again(path: &Path, rec: &FileIdentity) -> Result<Pinned, IdentityError> {
        let fd = match open_path(path, !rec.symlink) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(IdentityError::NowSymlink {
                    path: path.to_path_buf(),
                });
            }
            Err(source) => return Err(open_err(path, source)),
        };
        let p = Self::pin(path, fd, rec.symlink)?;
        match mismatch(rec, &p.identity) {
            None => Ok(p),
            Some(why) => Err(IdentityError::Different {
                path: path.to_path_buf(),
                why,
            }),
        }
    }

    /// A re-open of a device recorded without an identity (an older state
    /// file): the path must go through no symbolic link, and the file must be
    /// one only its directory's owner (or root) can have put there (see the
    /// module documentation).
    pub fn unrecorded(path: &Path) -> Result<Pinned, IdentityError> {
        let (dir, fd) = match open_in_dir(path) {
            Ok(both) => both,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(IdentityError::UnrecordedSymlink {
                    path: path.to_path_buf(),
                });
            }
            Err(source) => return Err(open_err(path, source)),
        };
        let d = rustix::fs::fstat(&dir).map_err(|e| open_err(path, e.into()))?;
        let f = rustix::fs::fstat(&fd).map_err(|e| open_err(path, e.into()))?;
        // nlink_t is 32 bits on some targets.
        #[allow(clippy::useless_conversion)]
        let (file, in_dir) = (
            Facts {
                uid: f.st_uid,
                mode: f.st_mode,
                nlink: u64::from(f.st_nlink),
            },
            Facts {
                uid: d.st_uid,
                mode: d.st_mode,
                nlink: u64::from(d.st_nlink),
            },
        );
        if let Some(why) = unrecorded_doubt(&file, &in_dir) {
            return Err(IdentityError::UnrecordedDoubt {
                path: path.to_path_buf(),
                why,
            });
        }
        Self::pin(path, fd, false)
    }

    fn pin(path: &Path, fd: OwnedFd, symlink: bool) -> Result<Pinned, IdentityError> {
        let st = rustix::fs::fstat(&fd).map_err(|e| open_err(path, e.into()))?;
        let ft = rustix::fs::FileType::from_raw_mode(st.st_mode);
        let kind = match ft {
            rustix::fs::FileType::RegularFile => FileKind::File,
            rustix::fs::FileType::BlockDevice => FileKind::Block,
            // What open(2) of a directory for I/O says.
            rustix::fs::FileType::Directory => {
                return Err(open_err(path, Errno::ISDIR.into()));
            }
            other => {
                return Err(IdentityError::NotAFile {
                    path: path.to_path_buf(),
                    what: type_name(other),
                });
            }
        };
        let target = if symlink {
            std::fs::read_link(proc_fd(&fd)).ok()
        } else {
            None
        };
        let identity = FileIdentity {
            kind,
            dev: st.st_dev,
            ino: st.st_ino,
            uid: st.st_uid,
            rdev: if kind == FileKind::Block {
                st.st_rdev
            } else {
                0
            },
            symlink,
            target,
            boot: boot_id().to_owned(),
        };
        Ok(Pinned {
            path: path.to_path_buf(),
            fd,
            identity,
        })
    }

    pub fn identity(&self) -> &FileIdentity {
        &self.identity
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Open the pinned file for I/O (read, and write unless `read_only`;
    /// `O_DIRECT` with `direct`), through its descriptor: no path lookup.
    pub fn open(&self, read_only: bool, direct: bool) -> std::io::Result<File> {
        reopen_as(
            &self.fd,
            (self.identity.dev, self.identity.ino),
            read_only,
            direct,
        )
    }

    /// As [`Pinned::open`], with the new descriptor's `statx` (see
    /// [`reopen_statx`]).
    pub fn open_statx(
        &self,
        read_only: bool,
        direct: bool,
    ) -> std::io::Result<(File, rustix::fs::Statx)> {
        reopen_statx(
            &self.fd,
            (self.identity.dev, self.identity.ino),
            read_only,
            direct,
        )
    }

    /// The device and inode the pin names.
    pub fn key(&self) -> (u64, u64) {
        (self.identity.dev, self.identity.ino)
    }

    /// As [`Pinned::open`], with the error naming the image.
    pub fn open_err(&self, e: std::io::Error) -> IdentityError {
        IdentityError::Reopen {
            path: self.path.clone(),
            proc: proc_fd(&self.fd),
            source: e,
        }
    }

    /// Whether `path` (looked at now, without following a final link) still
    /// names this file: for a notice when a device outlives its name.
    pub fn path_still_names_it(&self) -> bool {
        let m = if self.identity.symlink {
            std::fs::metadata(&self.path)
        } else {
            std::fs::symlink_metadata(&self.path)
        };
        m.is_ok_and(|m| (m.dev(), m.ino()) == (self.identity.dev, self.identity.ino))
    }
}

/// What [`unrecorded_doubt`] looks at of a file or directory (`stat`).
#[derive(Debug, Clone, Copy)]
pub struct Facts {
    pub uid: u32,
    pub mode: u32,
    pub nlink: u64,
}

/// Why the file found for a record without an identity is not trusted, if
/// it is not (pure: the rule of the module documentation). `file` is the
/// file, `dir` the directory holding it.
pub fn unrecorded_doubt(file: &Facts, dir: &Facts) -> Option<String> {
    let regular = file.mode & libc::S_IFMT == libc::S_IFREG;
    if regular && file.nlink != 1 {
        return Some(format!("it has {} hard links", file.nlink));
    }
    if dir.mode & 0o022 != 0 {
        return Some(format!(
            "its directory may be written by others than its owner (mode {:o})",
            dir.mode & 0o7777
        ));
    }
    if file.uid != dir.uid && dir.uid != 0 {
        return Some(format!(
            "it belongs to uid {} and its directory to uid {}",
            file.uid, dir.uid
        ));
    }
    None
}

/// `O_PATH` descriptors of the directory holding `path` and of the file in
/// it, neither reached through a symbolic link (`ELOOP` if one is met).
fn open_in_dir(path: &Path) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = open_path(parent, true)?;
    let flags = OFlags::PATH | OFlags::CLOEXEC;
    let fd = match rustix::fs::openat2(&dir, name, flags, Mode::empty(), ResolveFlags::NO_SYMLINKS)
    {
        Ok(fd) => fd,
        // No openat2: one name, opened without following it.
        Err(Errno::NOSYS | Errno::PERM) => {
            let fd = rustix::fs::openat(&dir, name, flags | OFlags::NOFOLLOW, Mode::empty())?;
            let st = rustix::fs::fstat(&fd)?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink {
                return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
            }
            fd
        }
        Err(e) => return Err(e.into()),
    };
    Ok((dir, fd))
}

/// Open the file `fd` refers to again, for I/O, through `/proc/self/fd`: the
/// same inode, whatever its path names now (checked: device and inode).
pub fn reopen(fd: &impl AsFd, read_only: bool, direct: bool) -> std::io::Result<File> {
    let a = rustix::fs::fstat(fd)?;
    reopen_as(fd, (a.st_dev, a.st_ino), read_only, direct)
}

/// As [`reopen`], for a descriptor whose device and inode the caller already
/// knows (`dev_ino`, e.g. a [`Pinned`] file's identity): one `fstat` fewer.
pub fn reopen_as(
    fd: &impl AsFd,
    dev_ino: (u64, u64),
    read_only: bool,
    direct: bool,
) -> std::io::Result<File> {
    reopen_statx(fd, dev_ino, read_only, direct).map(|(f, _)| f)
}

/// As [`reopen_as`], returning also the new descriptor's `statx` (basic
/// facts and, where the kernel tells, the direct-I/O alignment: what an
/// attach would otherwise ask for in two more calls).
pub fn reopen_statx(
    fd: &impl AsFd,
    dev_ino: (u64, u64),
    read_only: bool,
    direct: bool,
) -> std::io::Result<(File, rustix::fs::Statx)> {
    let mut flags = OFlags::CLOEXEC | OFlags::NOCTTY;
    flags |= if read_only {
        OFlags::RDONLY
    } else {
        OFlags::RDWR
    };
    if direct {
        flags |= OFlags::DIRECT;
    }
    let f = File::from(open_through(fd, flags)?);
    let st = rustix::fs::statx(
        &f,
        "",
        rustix::fs::AtFlags::EMPTY_PATH,
        rustix::fs::StatxFlags::BASIC_STATS | rustix::fs::StatxFlags::DIOALIGN,
    )?;
    let dev = rustix::fs::makedev(st.stx_dev_major, st.stx_dev_minor);
    if dev_ino != (dev, st.stx_ino) {
        return Err(std::io::Error::other(
            "the descriptor reopened a different file",
        ));
    }
    Ok((f, st))
}

/// Open what `fd` refers to anew (a new open file description) with
/// `flags`, through its `/proc/self/fd` entry: looked up in a kept descriptor
/// of that directory (one path component, not four), or by the whole path in
/// a process other than the one that opened the directory (after a `fork`,
/// `self` there would be the parent).
fn open_through(fd: &impl AsFd, flags: OFlags) -> std::io::Result<OwnedFd> {
    static DIR: OnceLock<Option<(u32, OwnedFd)>> = OnceLock::new();
    let kept = DIR.get_or_init(|| {
        rustix::fs::open(
            "/proc/self/fd",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .ok()
        .map(|dir| (std::process::id(), dir))
    });
    let n = fd.as_fd().as_raw_fd().to_string();
    match kept {
        Some((pid, dir)) if *pid == std::process::id() => {
            Ok(rustix::fs::openat(dir, n, flags, Mode::empty())?)
        }
        _ => Ok(rustix::fs::open(proc_fd(fd), flags, Mode::empty())?),
    }
}

fn proc_fd(fd: &impl AsFd) -> String {
    format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd())
}

fn open_err(path: &Path, source: std::io::Error) -> IdentityError {
    IdentityError::Open {
        path: path.to_path_buf(),
        source,
    }
}

fn type_name(t: rustix::fs::FileType) -> &'static str {
    use rustix::fs::FileType as T;
    match t {
        T::Fifo => "a FIFO",
        T::Socket => "a socket",
        T::CharacterDevice => "a character device",
        T::Directory => "a directory",
        T::Symlink => "a symbolic link",
        _ => "an unknown kind of file",
    }
}

/// An `O_PATH` descriptor of `path` (no side effect whatever it names).
/// `no_symlinks`: fail with `ELOOP` if resolving it meets a symbolic link.
fn open_path(path: &Path, no_symlinks: bool) -> std::io::Result<OwnedFd> {
    let flags = OFlags::PATH | OFlags::CLOEXEC;
    if !no_symlinks {
        return Ok(rustix::fs::open(path, flags, Mode::empty())?);
    }
    match rustix::fs::openat2(
        rustix::fs::CWD,
        path,
        flags,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS,
    ) {
        Ok(fd) => Ok(fd),
        // No openat2 (before Linux 5.6, or a seccomp filter): follow, then
        // compare the file's own name with the path as written.
        Err(Errno::NOSYS | Errno::PERM) => {
            let fd = rustix::fs::open(path, flags, Mode::empty())?;
            let real = std::fs::read_link(proc_fd(&fd))?;
            if Some(real) == lexical(path) {
                Ok(fd)
            } else {
                Err(std::io::Error::from_raw_os_error(libc::ELOOP))
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// `path` made absolute and cleaned of `.` and `..` by its text alone.
fn lexical(path: &Path) -> Option<PathBuf> {
    let abs = std::path::absolute(path).ok()?;
    let mut out = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests;
