//! TLS for NBD: the server's certificates, their reload, what a client's
//! certificate proves, and handing an established session to the kernel
//! (kTLS).
//!
//! This module knows nothing of loopd's other layers: it turns a directory of
//! PEM files into a [`rustls::ServerConfig`] and answers questions about
//! finished handshakes. Driving the handshake over a socket is the caller's.
//!
//! - [`files`]: [`TlsFiles`] and [`load`]. The directory holds
//!   `server-cert.pem` (the chain, leaf first), `server-key.pem` (PKCS#8,
//!   PKCS#1 or SEC1, unencrypted) and, with `verify_peer`, `ca-cert.pem` (the
//!   roots client certificates must chain to) — the layout nbdkit's
//!   `--tls-certificates` and qemu's `tls-creds-x509,dir=` use.
//!   The configuration offers TLS 1.3 and 1.2 with rustls's ring cipher suites
//!   (AES-128-GCM, AES-256-GCM, CHACHA20-POLY1305 with ECDHE), no ALPN, no
//!   TLS 1.3 session tickets, and secret extraction enabled (for kTLS).
//!   Client certificates: with `verify_peer` every client must present one
//!   that chains to `ca-cert.pem` (for TLS client authentication with
//!   extendedKeyUsage clientAuth), or the handshake fails. Without it, none is
//!   asked for and `ca-cert.pem` is not read, as in nbdkit and qemu without
//!   verify-peer: a client's certificate is then neither needed nor checked,
//!   so a client with one from any CA still connects, and [`identities`] is
//!   empty.
//! - [`crl`]: with `verify_peer`, `ca-crl.pem` (if present) lists revoked
//!   client certificates: each CRL must be signed by a CA of `ca-cert.pem`
//!   (else loading fails, naming the file), and a client whose certificate
//!   (or an intermediate) it revokes fails the handshake. A certificate
//!   whose issuer has no CRL in the file is not revocation-checked (as with
//!   GnuTLS). A CRL past its nextUpdate still revokes, with a warning.
//!   Without `verify_peer` the file is not read (a warning says so).
//! - [`context`]: [`TlsContext`], the configuration in use, swapped whole by
//!   [`TlsContext::reload`]. A handshake takes [`TlsContext::current`] once at
//!   its start, so a reload never changes a handshake under way, and
//!   established sessions keep the keys they negotiated.
//! - [`identity`]: [`identities`] / [`identities_of_der`] name what a
//!   verified client certificate proves; [`allowed`] matches them against an
//!   allow list (the scheme is documented there and in README.md).
//! - [`ktls`]: moves an established session's record layer into the kernel.
//! - [`record`]: [`RecordBoundary`], for reading a socket no further than
//!   the TLS record in progress (what [`ktls::enable`] needs of its caller).
//! - [`error`]: [`TlsError`], what every file here reports (each message
//!   names the file it is about).
//!
//! TLS-PSK (nbdkit's and qemu's `tls-creds-psk`) is not offered: rustls has
//! no external pre-shared keys (rustls/rustls#174 is open), and loopd does
//! not ship a second TLS stack for it.
//!
//! Nothing here blocks except [`load`] / [`TlsContext::new`] /
//! [`TlsContext::reload`], which read small files, and
//! [`ktls::available`]'s one-time loopback probe.

pub mod context;
pub mod crl;
pub mod error;
pub mod files;
pub mod identity;
pub mod ktls;
pub mod record;

pub use context::TlsContext;
pub use error::TlsError;
pub use files::{TlsFiles, load};
pub use identity::{allowed, identities, identities_of_der};
pub use record::RecordBoundary;
