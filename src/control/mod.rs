//! The control plane: the JSON-lines protocol ([`proto`]), the socket server that
//! runs requests against the daemon ([`server`]), and the client the CLI uses
//! ([`client`]).

pub mod client;
pub mod proto;
pub mod server;
