//! Kernel block devices loopd makes: who uses one ([`users`]).

pub mod users;
