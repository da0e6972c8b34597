//! [`TlsError`]: why the TLS files could not be used, or a certificate not be
//! read. Every module of `tls` reports through it; every message names the
//! file it is about.

use std::path::PathBuf;

/// Why the TLS files could not be used, or a certificate not be read. Every
/// message names the file it is about.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file that must be there is not.
    #[error("{}: missing{why}", path.display())]
    Missing { path: PathBuf, why: &'static str },
    /// A file could not be read (permissions, a directory, ...).
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file's content is not what it must be.
    #[error("{}: {what}", path.display())]
    Content { path: PathBuf, what: String },
    /// The server certificate's public key is not the private key's.
    #[error("{} does not match {}", cert.display(), key.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    /// rustls refused the configuration for another reason.
    #[error("{}: the TLS configuration is refused", dir.display())]
    Config {
        dir: PathBuf,
        #[source]
        source: rustls::Error,
    },
    /// Bytes that are not an X.509 certificate loopd can read.
    #[error("not an X.509 certificate: {0}")]
    Certificate(String),
}
