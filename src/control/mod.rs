//! The control plane's shared half: the JSON-lines protocol ([`proto`]) and the
//! client the CLI uses ([`client`]). The daemon's side of the socket is
//! `daemon::control_socket`.

pub mod client;
pub mod proto;
