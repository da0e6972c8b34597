//! The NBD frontend: protocol constants, pure wire parsing and encoding, the
//! sans-I/O handshake, and the transmission phase of a connection, which runs
//! on a reactor.
//!
//! A connection is split by what it owns, like the ublk frontend: pure parts
//! that take bytes or events and return decisions — [`framing`] (bytes in →
//! requests), [`slots`] (the in-flight table), [`replies`] (the reply queue)
//! — the [`transport`] (plaintext or userspace TLS behind one interface), and
//! the driver [`conn`], which owns the socket and buffers and feeds them
//! ([`recv`] and [`send`] are its two directions, [`run`] where it meets the
//! engine, with [`splice`] and [`status`]; [`stall`] its progress deadline;
//! [`idle`] what it gives back while idle: its lent receive buffer, its slots).

pub mod affinity;
pub mod conn;
mod facts;
mod framing;
pub mod handshake;
mod idle;
pub mod lines;
pub mod proto;
mod recv;
mod replies;
mod run;
mod send;
mod slots;
mod splice;
pub mod stall;
mod status;
pub mod tls;
mod transport;
pub mod wire;
