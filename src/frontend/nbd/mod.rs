//! The NBD frontend: protocol constants, pure wire parsing and encoding, the
//! sans-I/O handshake, and the transmission phase of a connection ([`conn`]),
//! which runs on a reactor.

pub mod affinity;
pub mod conn;
pub mod handshake;
pub mod lines;
pub mod proto;
mod recv;
mod reply;
mod run;
mod splice;
pub mod stall;
mod status;
pub mod tls;
pub mod wire;
