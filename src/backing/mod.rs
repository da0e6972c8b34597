//! The backing file, below the device: creating one (atomically, see `create`),
//! which file a path names and opening it again only if it is the same one
//! (`identity`), what an image file is (format probe), how direct I/O must be aligned on it,
//! who else may use it (QEMU-compatible image locking), and how much of it the
//! page cache holds (`cache`).
//!
//! This layer knows nothing of devices, the engine or any frontend; `device`
//! calls it when it opens an image.

pub mod align;
pub mod cache;
pub mod create;
pub mod format;
pub mod identity;
pub mod lock;

/// Whether opening an image for writing failed because it is write-protected
/// (a read-only mount, mode 0444, an immutable file): such an image is opened
/// read-only instead, with a notice, as losetup does.
pub fn write_protected(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EROFS | libc::EACCES | libc::EPERM)
    )
}
