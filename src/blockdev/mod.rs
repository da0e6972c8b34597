//! Block devices that loopd hands to its user, whichever frontend made them
//! (kernel loop, ublk, kernel NBD): what is true of every whole-disk device
//! once it exists, independent of how it was set up.
//!
//! This layer sits below the frontends and beside `backing`: it imports only
//! std, libc and serde, never the engine, a frontend, the daemon or the
//! control plane, so every frontend can share it.
//!
//! - [`uevent`]: pure parsers of the sysfs text the kernel writes for a block
//!   device (`uevent`, `dev`, sector counts).
//! - [`kernel_timeout`]: how long the kernel has to answer a control
//!   request of a block device (`--kernel-timeout`), for ublk and kernel NBD.
//! - [`partitions`]: after a frontend has made a whole-disk device, trigger the
//!   partition scan the kernel may have deferred, read the partitions it found
//!   and wait (bounded) until their `/dev` nodes exist.
//! - [`users`]: who uses a block device (mounts, holders, openers), for
//!   detach to refuse while it is in use.
//! - [`udev`]: close a writer of a whole disk under an exclusive `flock` and
//!   wait for udev's answer, so udev does not re-read the partition table
//!   (dropping and re-adding every partition) after the caller returns.

pub mod kernel_timeout;
pub mod partitions;
pub mod udev;
pub mod uevent;
pub mod users;

pub use partitions::{Partition, PartitionError, Rescan, settle};
