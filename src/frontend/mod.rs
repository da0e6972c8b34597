//! Frontends: the ways requests reach loopd's engine. Each turns its wire
//! requests into the block vocabulary ([`crate::block`]), runs them through the
//! engine's shared execution step, and encodes the results its own way.
//!
//! - [`nbd`]: the NBD protocol (handshake, transmission on the reactors).
//! - [`ublk`]: the kernel's ublk driver (`/dev/ublkbN`), a queue per reactor.

pub mod nbd;
pub mod ublk;
