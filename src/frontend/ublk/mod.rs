//! The ublk frontend: the kernel's ublk driver hands loopd block requests
//! through per-queue descriptor arrays and `URING_CMD`s.
//!
//! The lower half imports nothing else of loopd: the UAPI ([`sys`]), the
//! control path of one device ([`ctrl`]), its I/O char device and descriptor
//! arrays ([`chardev`]), the I/O command SQEs ([`io_cmd`]), request decoding
//! ([`iod`]) and each queue's per-tag state machine ([`tags`]). [`queue`] runs
//! one queue on the reactor that owns it, through the engine's shared step.

pub mod chardev;
pub mod ctrl;
pub mod deadline;
pub mod io_cmd;
pub mod iod;
pub mod queue;
pub mod sys;
pub mod tags;
#[cfg(feature = "vm-tests")]
pub mod test_hook;
