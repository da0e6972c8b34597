//! TLS certificates for the NBD server (placeholder until the full module:
//! loads the directory, no client identities, no kTLS).

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{0}: {1}")]
    File(String, String),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub dir: PathBuf,
    pub verify_peer: bool,
}

pub fn load(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let cert_path = files.dir.join("server-cert.pem");
    let key_path = files.dir.join("server-key.pem");
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert_path)
        .map_err(|e| TlsError::File(cert_path.display().to_string(), e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::File(cert_path.display().to_string(), e.to_string()))?;
    let key = PrivateKeyDer::from_pem_file(&key_path)
        .map_err(|e| TlsError::File(key_path.display().to_string(), e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    cfg.send_tls13_tickets = 0;
    cfg.enable_secret_extraction = true;
    Ok(Arc::new(cfg))
}

pub struct TlsContext {
    files: TlsFiles,
    cfg: RwLock<Arc<ServerConfig>>,
}

impl TlsContext {
    pub fn new(files: TlsFiles) -> Result<TlsContext, TlsError> {
        let cfg = load(&files)?;
        Ok(TlsContext {
            files,
            cfg: RwLock::new(cfg),
        })
    }
    pub fn current(&self) -> Arc<ServerConfig> {
        match self.cfg.read() {
            Ok(g) => Arc::clone(&g),
            Err(p) => Arc::clone(&p.into_inner()),
        }
    }
    pub fn reload(&self) -> Result<(), TlsError> {
        let cfg = load(&self.files)?;
        match self.cfg.write() {
            Ok(mut g) => *g = cfg,
            Err(p) => *p.into_inner() = cfg,
        }
        Ok(())
    }
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

pub fn identities(_conn: &rustls::ServerConnection) -> Vec<String> {
    Vec::new()
}

pub fn allowed(allow: &[String], ids: &[String]) -> bool {
    allow.is_empty() || allow.iter().any(|a| ids.contains(a))
}

pub mod ktls {
    use std::os::fd::BorrowedFd;
    use thiserror::Error;
    #[derive(Debug, Error)]
    pub enum KtlsError {
        #[error("the kernel has no TLS (kTLS)")]
        Unavailable,
    }
    /// kTLS was not turned on: why, and the session if it is still whole.
    pub struct Refused {
        pub error: KtlsError,
        pub session: Option<Box<rustls::ServerConnection>>,
    }
    pub fn enable(_fd: BorrowedFd<'_>, conn: Box<rustls::ServerConnection>) -> Result<(), Refused> {
        Err(Refused {
            error: KtlsError::Unavailable,
            session: Some(conn),
        })
    }
}
