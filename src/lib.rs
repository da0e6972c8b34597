//! loopd: a userspace loop device that serves disk-image files over NBD.
//!
//! Data flows client → [`nbd`] (handshake, wire) → [`engine`] (reactor,
//! io_uring) → [`device`] (window, range lock, stats) → backing file.

pub mod backing;
pub mod blockdev;
pub mod control;
pub mod daemon;
pub mod device;
pub mod engine;
pub mod kernel_loop;
pub mod nbd;
pub mod server;
pub mod size;
