//! The lower half of loopd's ublk frontend: the UAPI ([`sys`]), the control path
//! of one device ([`ctrl`]), its I/O char device and descriptor arrays
//! ([`chardev`]), the I/O command SQEs ([`io_cmd`]), request decoding ([`iod`])
//! and each queue's per-tag state machine ([`tags`]).
//!
//! Nothing here runs a queue: the reactor that owns a queue issues its FETCH /
//! COMMIT_AND_FETCH commands on its own ring (128-byte SQEs) and drives a
//! [`tags::TagTable`]. This module imports nothing else of loopd.

pub mod chardev;
pub mod ctrl;
pub mod io_cmd;
pub mod iod;
pub mod sys;
pub mod tags;
