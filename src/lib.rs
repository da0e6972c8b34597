//! loopd: a userspace loop device that serves disk-image files as block devices.
//!
//! Data flows down, and no module imports one above it:
//! [`daemon`] / [`server`] → [`reactor`] → [`frontend`] (NBD) → [`ring`] →
//! [`engine`] → [`device`] → [`backing`] file, all speaking [`block`]'s
//! vocabulary; [`text`] escapes untrusted strings for logs and terminals, for
//! every layer. `docs/ARCHITECTURE.md` draws the layers and their rules.

pub mod backing;
pub mod block;
pub mod blockdev;
pub mod control;
pub mod daemon;
pub mod device;
pub mod engine;
pub mod frontend;
pub mod kernel_loop;
pub mod kernel_nbd;
pub mod metrics;
pub mod reactor;
pub mod ring;
pub mod server;
pub mod size;
pub mod text;
pub mod tls;
