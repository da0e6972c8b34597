//! What making, changing or removing a kernel block device can fail with
//! ([`super::blockdev`] and [`super::nbd_dev`]); `super::error` maps each to
//! the control protocol's error code. Pure data.

use crate::blockdev::partitions::PartitionError;
use crate::frontend::ublk::chardev::CharError;
use crate::frontend::ublk::ctrl::CtrlError;
use crate::kernel_nbd::KernelNbdError;
use std::path::PathBuf;
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum BlockdevError {
    #[error(transparent)]
    Nbd(#[from] KernelNbdError),
    #[error("cannot make a socket pair for the kernel NBD connection")]
    SocketPair(#[source] std::io::Error),
    #[error("--connections must be 1..=64, not {0}")]
    Connections(u16),
    #[error("the partition devices did not appear")]
    Partitions(#[source] PartitionError),
    #[error(transparent)]
    Ctrl(#[from] CtrlError),
    #[error(transparent)]
    Char(#[from] CharError),
    #[error(
        "--queues {asked} is more than this daemon's {reactors} reactor(s): each ublk queue is \
         served by one reactor (raise --reactors)"
    )]
    TooManyQueues { asked: u16, reactors: usize },
    #[error("--queue-depth must be 1..=4096, not {0}")]
    Depth(u16),
    #[error("ublk queue {q_id} could not be started: {why}")]
    Queue { q_id: u16, why: String },
    #[error("the daemon's reactors are not running")]
    NoReactors,
    #[error("{0}")]
    Unfollowable(String),
    #[error("{} is open (the kernel refused to stop it); unmount or close it, or use --force", .0.display())]
    Open(PathBuf),
    #[error(
        "/dev/nbd{index} (backend {backend:?}) still has live connections after {:.1}s: the \
         kernel took {taken} of {n} new connections (it replaces only dead ones), so another \
         server still serves it (another loopd with a device of this name?); detach it there, \
         or give this device another name",
        waited.as_secs_f64()
    )]
    NbdLive {
        index: u32,
        backend: String,
        taken: u16,
        n: u16,
        waited: Duration,
    },
}
