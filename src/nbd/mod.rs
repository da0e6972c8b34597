//! The NBD protocol: constants, pure wire parsing, and the blocking handshake.
//! Transmission (the data phase) runs in the reactor, `crate::engine`.

pub mod handshake;
pub mod proto;
pub mod wire;
