//! The TLS directory ([`TlsFiles`]) turned into a [`rustls::ServerConfig`]
//! ([`load`]); the module doc of [`crate::tls`] states what the configuration
//! offers and how client certificates are treated.
//!
//! Pure with respect to loopd: reads the files once per call, keeps no state,
//! blocks only on those reads.

use super::crl::{self, CA_CRL, CrlInfo};
use super::error::TlsError;
use super::identity::{CertInfo, cert_info};
use rustls::RootCertStore;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{NoServerSessionStorage, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The CA certificates client certificates must chain to.
pub const CA_CERT: &str = "ca-cert.pem";
/// The server's certificate chain, leaf first.
pub const SERVER_CERT: &str = "server-cert.pem";
/// The server certificate's private key.
pub const SERVER_KEY: &str = "server-key.pem";

/// Where the server's TLS files are, and whether clients must present a
/// certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// Holds `server-cert.pem`, `server-key.pem` and (for `verify_peer`)
    /// `ca-cert.pem`.
    pub dir: PathBuf,
    /// Require every client to present a certificate that chains to
    /// `ca-cert.pem`.
    pub verify_peer: bool,
}

impl TlsFiles {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// A configuration and what its server certificate and CRLs say (for the
/// log), and what the log should warn about.
pub(crate) struct Loaded {
    pub config: Arc<ServerConfig>,
    pub server_cert: CertInfo,
    /// The CRLs of `ca-crl.pem` in use (none without one, or without
    /// `verify_peer`).
    pub crls: Vec<CrlInfo>,
    /// Things the files say that the administrator should hear.
    pub warnings: Vec<String>,
}

/// Reads the files of `files` and builds the server configuration.
///
/// Errors name the file and what is wrong with it: missing, unreadable, no
/// PEM certificate or key in it, an encrypted key, a certificate rustls
/// cannot use, a key that is not the certificate's.
pub fn load(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    load_info(files).map(|l| l.config)
}

/// The bytes of `path`, or `None` if there is no such file.
fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, TlsError> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TlsError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn read(path: &Path, why: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| match source.kind() {
        ErrorKind::NotFound => TlsError::Missing {
            path: path.to_path_buf(),
            why,
        },
        _ => TlsError::Read {
            path: path.to_path_buf(),
            source,
        },
    })
}

fn content(path: &Path, what: impl Into<String>) -> TlsError {
    TlsError::Content {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// Every certificate in a PEM file (other PEM sections are skipped); at
/// least one.
fn certificates(path: &Path, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| content(path, format!("not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(content(path, "no certificate found"));
    }
    Ok(certs)
}

fn private_key(path: &Path, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    match PrivateKeyDer::from_pem_slice(bytes) {
        Ok(k) => Ok(k),
        Err(pem::Error::NoItemsFound) => {
            let encrypted = bytes
                .windows(b"ENCRYPTED PRIVATE KEY".len())
                .any(|w| w == b"ENCRYPTED PRIVATE KEY");
            Err(content(
                path,
                if encrypted {
                    "the private key is encrypted (decrypt it: openssl pkey -in KEY -out KEY)"
                } else {
                    "no private key found"
                },
            ))
        }
        Err(e) => Err(content(path, format!("not PEM: {e}"))),
    }
}

pub(crate) fn load_info(files: &TlsFiles) -> Result<Loaded, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cert_path = files.path(SERVER_CERT);
    let key_path = files.path(SERVER_KEY);
    let chain = certificates(&cert_path, &read(&cert_path, "")?)?;
    let key = private_key(&key_path, &read(&key_path, "")?)?;
    let leaf = chain
        .first()
        .ok_or_else(|| content(&cert_path, "no certificate found"))?;
    let server_cert = cert_info(leaf).map_err(|e| content(&cert_path, e.to_string()))?;
    check_pair(&provider, &chain, &key, &cert_path, &key_path)?;

    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|source| TlsError::Config {
            dir: files.dir.clone(),
            source,
        })?;
    let crl_path = files.path(CA_CRL);
    let mut crls = Vec::new();
    let mut warnings = Vec::new();
    let builder = if files.verify_peer {
        let ca_path = files.path(CA_CERT);
        let cas = certificates(&ca_path, &read(&ca_path, ", needed by --tls-verify-peer")?)?;
        let mut roots = RootCertStore::empty();
        for ca in &cas {
            roots
                .add(ca.clone())
                .map_err(|e| content(&ca_path, format!("not a usable CA certificate: {e}")))?;
        }
        let mut vb = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
        if let Some(bytes) = read_optional(&crl_path)? {
            let (ders, info) = crl::check(&crl_path, &bytes, &cas, unix_now())?;
            crls = info;
            // As GnuTLS (nbdkit, qemu) does: a certificate is checked against
            // the CRL of its issuer where there is one; a CA without a CRL
            // in the file revokes nothing.
            vb = vb.with_crls(ders).allow_unknown_revocation_status();
        }
        let verifier = vb.build().map_err(|e| match e {
            rustls::server::VerifierBuilderError::InvalidCrl(c) => {
                content(&crl_path, format!("not a usable CRL: {c:?}"))
            }
            e => content(&ca_path, e.to_string()),
        })?;
        builder.with_client_cert_verifier(verifier)
    } else {
        if crl_path.exists() {
            warnings.push(format!(
                "{} is not read: without --tls-verify-peer no client certificate is asked \
                 for, so none can be revoked (nbdkit and QEMU read it only when verifying \
                 peers too)",
                crl_path.display()
            ));
        }
        builder.with_no_client_auth()
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Config {
            dir: files.dir.clone(),
            source,
        })?;
    // No resumption at all: NBD connections are few and long, and a resumed
    // session would skip the client-certificate check of the current CA.
    config.send_tls13_tickets = 0;
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.enable_secret_extraction = true;
    Ok(Loaded {
        config: Arc::new(config),
        server_cert,
        crls,
        warnings,
    })
}

/// Seconds since the epoch.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The key must be usable by the provider and be the leaf certificate's.
fn check_pair(
    provider: &CryptoProvider,
    chain: &[CertificateDer<'static>],
    key: &PrivateKeyDer<'static>,
    cert_path: &Path,
    key_path: &Path,
) -> Result<(), TlsError> {
    let signing = provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| content(key_path, format!("unusable private key: {e}")))?;
    match CertifiedKey::new(chain.to_vec(), signing).keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(()),
        Err(rustls::Error::InconsistentKeys(_)) => Err(TlsError::KeyMismatch {
            cert: cert_path.to_path_buf(),
            key: key_path.to_path_buf(),
        }),
        Err(e) => Err(content(cert_path, format!("unusable certificate: {e}"))),
    }
}
