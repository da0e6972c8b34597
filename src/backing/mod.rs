//! The backing file, below the device: creating one (atomically, see `create`),
//! what an image file is (format probe), how direct I/O must be aligned on it,
//! who else may use it (QEMU-compatible image locking), and how much of it the
//! page cache holds (`cache`).
//!
//! This layer knows nothing of devices, the engine or any frontend; `device`
//! calls it when it opens an image.

pub mod align;
pub mod cache;
pub mod create;
pub mod format;
pub mod lock;
