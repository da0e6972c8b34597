//! Creating an image file of a given size, sparse or preallocated, published
//! atomically.
//!
//! Contract: [`create_image`] makes the file under a temporary name in the
//! image's own directory, sizes it (`ftruncate`: sparse; or `fallocate`: every
//! block allocated, reading as zeros), and only then publishes it under the final
//! name, and only if nothing is there: a concurrent opener never sees a
//! half-made image and an existing file is never replaced. Publishing is
//! `renameat2(RENAME_NOREPLACE)`. Where the filesystem refuses that flag (9p,
//! NFS, some FUSE filesystems answer EINVAL; old kernels ENOSYS or EOPNOTSUPP)
//! it falls back to `link(tmp, path)` then `unlink(tmp)`, which is just as
//! exclusive: `link` fails with EEXIST when the name is taken. If the
//! filesystem refuses hard links too, the error says so and what to do.
//!
//! The temporary name is removed on every path. Nothing is locked and no state
//! is kept; the calls are a handful of metadata system calls on the image's
//! filesystem, which may block (a network filesystem).

use rustix::fs::{AtFlags, CWD, RenameFlags};
use rustix::io::Errno;
use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use thiserror::Error;

/// Why an image could not be created.
#[derive(Debug, Error)]
pub enum CreateError {
    #[error("cannot create the temporary file {tmp}")]
    Temp {
        tmp: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot size the new image to {size} bytes")]
    Size {
        size: u64,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot allocate the new image's {size} bytes (fallocate; leave out \
         preallocate for a sparse image)"
    )]
    Preallocate {
        size: u64,
        #[source]
        source: io::Error,
    },
    #[error("cannot move the new image into place")]
    Publish {
        #[source]
        source: io::Error,
    },
    #[error(
        "the filesystem can neither rename without replacing ({rename}) nor make a hard \
         link, so the image cannot be created atomically here; create it with \
         'truncate -s SIZE PATH' and serve it without --create"
    )]
    NoExclusivePublish {
        rename: io::Error,
        #[source]
        link: io::Error,
    },
}

/// Whether `renameat2(RENAME_NOREPLACE)` failing with `e` means "this
/// filesystem (or kernel) does not do that flag", so that the `link` fallback
/// should be tried, rather than a real failure.
pub fn rename_noreplace_unsupported(e: Errno) -> bool {
    e == Errno::INVAL || e == Errno::NOSYS || e == Errno::OPNOTSUPP
}

/// Whether `link` failing with `e` means the filesystem does not do hard links
/// (rather than, say, a permission or space problem worth reporting as is).
fn link_unsupported(e: Errno) -> bool {
    e == Errno::PERM || e == Errno::OPNOTSUPP
}

/// Create an image of `size` bytes at `path` (see the module doc): sparse, or
/// with every block allocated if `preallocate` (writes into it then allocate
/// nothing: no io_uring worker hand-over, see README "Block devices").
/// `Ok(true)`: created; `Ok(false)`: something already exists at `path` (it is
/// left as it was).
pub fn create_image(path: &Path, size: u64, preallocate: bool) -> Result<bool, CreateError> {
    let tmp = temp_name(path);
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|source| CreateError::Temp {
            tmp: tmp.clone(),
            source,
        })?;
    let sized = if preallocate {
        rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, size).map_err(|e| {
            CreateError::Preallocate {
                size,
                source: e.into(),
            }
        })
    } else {
        f.set_len(size)
            .map_err(|source| CreateError::Size { size, source })
    };
    if let Err(e) = sized {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    drop(f);
    let r = publish(&tmp, path);
    // After a rename the temporary name is gone (this fails harmlessly);
    // after a link, or a failure, it is removed here.
    let _ = std::fs::remove_file(&tmp);
    r
}

/// A fresh name beside `path`: hidden, naming loopd, unique per process and call.
fn temp_name(path: &Path) -> PathBuf {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.loopd-create.{}.{seq}", std::process::id()))
}

/// Give the finished file `tmp` the name `path` unless that name is taken.
/// The caller removes `tmp` afterwards whatever happened.
fn publish(tmp: &Path, path: &Path) -> Result<bool, CreateError> {
    match rustix::fs::renameat_with(CWD, tmp, CWD, path, RenameFlags::NOREPLACE) {
        Ok(()) => Ok(true),
        Err(Errno::EXIST) => Ok(false),
        Err(e) if rename_noreplace_unsupported(e) => match publish_by_link(tmp, path) {
            Err(Errno::EXIST) => Ok(false),
            Err(l) if link_unsupported(l) => Err(CreateError::NoExclusivePublish {
                rename: e.into(),
                link: l.into(),
            }),
            Err(l) => Err(CreateError::Publish { source: l.into() }),
            Ok(()) => Ok(true),
        },
        Err(e) => Err(CreateError::Publish { source: e.into() }),
    }
}

/// The fallback publish: a second name for `tmp`, created only if `path` does
/// not exist (`link` never replaces). `tmp` keeps its name; the caller unlinks it.
fn publish_by_link(tmp: &Path, path: &Path) -> Result<(), Errno> {
    rustix::fs::linkat(CWD, tmp, CWD, path, AtFlags::empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .expect("read_dir")
            .map(|e| {
                e.expect("dir entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|n| n.contains("loopd-create"))
            .collect()
    }

    #[test]
    fn creates_a_sparse_file_of_the_size_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("new.img");
        assert!(create_image(&img, 16 << 20, false).expect("create"));
        let m = std::fs::metadata(&img).expect("stat");
        assert_eq!(m.len(), 16 << 20);
        assert!(
            m.blocks() * 512 < 1 << 20,
            "not sparse: {} blocks",
            m.blocks()
        );
        assert_eq!(m.nlink(), 1, "the temporary link is still there");
        assert!(
            leftovers(dir.path()).is_empty(),
            "{:?}",
            leftovers(dir.path())
        );
    }

    #[test]
    fn a_preallocated_file_has_its_blocks_and_reads_as_zeros() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("full.img");
        assert!(create_image(&img, 4 << 20, true).expect("create"));
        let m = std::fs::metadata(&img).expect("stat");
        assert_eq!(m.len(), 4 << 20);
        assert!(m.blocks() * 512 >= 4 << 20, "{} blocks", m.blocks());
        assert!(std::fs::read(&img).expect("read").iter().all(|b| *b == 0));
        assert!(leftovers(dir.path()).is_empty());
    }

    #[test]
    fn a_preallocation_the_filesystem_refuses_leaves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("huge.img");
        // 2^62 bytes: past any test machine's free space and past ext4's
        // largest file (EFBIG or ENOSPC, never success).
        let e = create_image(&img, 1 << 62, true).expect_err("4 EiB allocated");
        assert!(matches!(e, CreateError::Preallocate { .. }), "{e:?}");
        assert!(!img.exists());
        assert!(leftovers(dir.path()).is_empty());
    }

    #[test]
    fn an_existing_file_is_neither_replaced_nor_resized() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("old.img");
        std::fs::write(&img, b"keep me").expect("write");
        assert!(!create_image(&img, 1 << 20, false).expect("create"));
        assert_eq!(std::fs::read(&img).expect("read"), b"keep me");
        assert!(
            leftovers(dir.path()).is_empty(),
            "{:?}",
            leftovers(dir.path())
        );
    }

    #[test]
    fn the_link_fallback_publishes_only_onto_a_free_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tmp = dir.path().join("tmp");
        std::fs::write(&tmp, b"new").expect("write");
        let free = dir.path().join("free.img");
        publish_by_link(&tmp, &free).expect("link onto a free name");
        assert_eq!(std::fs::read(&free).expect("read"), b"new");

        let taken = dir.path().join("taken.img");
        std::fs::write(&taken, b"old").expect("write");
        assert_eq!(publish_by_link(&tmp, &taken), Err(Errno::EXIST));
        assert_eq!(std::fs::read(&taken).expect("read"), b"old");
    }

    #[test]
    fn only_flag_refusals_take_the_fallback() {
        for e in [Errno::INVAL, Errno::NOSYS, Errno::OPNOTSUPP] {
            assert!(rename_noreplace_unsupported(e), "{e}");
        }
        for e in [
            Errno::EXIST,
            Errno::ACCESS,
            Errno::NOSPC,
            Errno::XDEV,
            Errno::ROFS,
        ] {
            assert!(!rename_noreplace_unsupported(e), "{e}");
        }
    }

    #[test]
    fn a_missing_directory_is_reported_with_the_temporary_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("no/such/dir/x.img");
        match create_image(&img, 1 << 20, false) {
            Err(CreateError::Temp { tmp, source }) => {
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
                assert!(tmp.starts_with(dir.path().join("no/such/dir")), "{tmp:?}");
            }
            other => panic!("expected a Temp error, got {other:?}"),
        }
    }
}
