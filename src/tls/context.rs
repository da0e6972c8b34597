//! [`TlsContext`]: the server configuration in use, replaced whole on reload.
//!
//! Locking: one `RwLock` around an `Arc` of the configuration and what its
//! certificate says. [`TlsContext::current`] holds the read lock only to
//! clone the `Arc`; [`TlsContext::reload`] reads and checks the files
//! *without* the lock and takes the write lock only to swap. A poisoned lock
//! is used as is (the value inside is always a whole configuration).
//! Handshakes that already took a configuration keep it.

use super::error::TlsError;
use super::files::{Loaded, TlsFiles, load_info};
use super::identity::CertInfo;
use rustls::ServerConfig;
use std::sync::{Arc, PoisonError, RwLock};

/// The TLS files and the configuration last loaded from them.
pub struct TlsContext {
    files: TlsFiles,
    current: RwLock<(Arc<ServerConfig>, CertInfo)>,
}

fn log_loaded(files: &TlsFiles, what: &str, l: &Loaded) {
    let c = &l.server_cert;
    tracing::info!(
        "TLS {what} from {}: server certificate subject {}, serial {}, valid until {}{}",
        files.dir.display(),
        c.subject,
        c.serial,
        c.not_after,
        if files.verify_peer {
            "; clients must present a certificate of ca-cert.pem"
        } else {
            "; client certificates are not asked for"
        }
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    if u64::try_from(c.not_after_unix).is_ok_and(|t| t < now) {
        tracing::warn!(
            "TLS server certificate in {} expired on {}: clients will refuse it",
            files.dir.display(),
            c.not_after
        );
    }
    let crl_path = files.dir.join(super::crl::CA_CRL);
    for r in &l.crls {
        tracing::info!(
            "TLS {}: {} revoked certificate(s) of {}, next update {}",
            crl_path.display(),
            r.revoked,
            r.issuer,
            r.next_update.as_deref().unwrap_or("not given")
        );
        if r.expired {
            tracing::warn!(
                "TLS {}: the CRL of {} expired on {} (nextUpdate): its revocations are still \
                 enforced, but certificates revoked since are not in it; install a fresh CRL \
                 and reload (SIGHUP or `loopd reload-tls`)",
                crl_path.display(),
                r.issuer,
                r.next_update.as_deref().unwrap_or("?")
            );
        }
    }
    for w in &l.warnings {
        tracing::warn!("TLS: {w}");
    }
}

impl TlsContext {
    /// Loads the files (see [`super::load`]); logs what was loaded.
    pub fn new(files: TlsFiles) -> Result<TlsContext, TlsError> {
        let l = load_info(&files)?;
        log_loaded(&files, "loaded", &l);
        Ok(TlsContext {
            files,
            current: RwLock::new((l.config, l.server_cert)),
        })
    }

    /// The configuration for a new handshake.
    pub fn current(&self) -> Arc<ServerConfig> {
        let g = self.current.read().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(&g.0)
    }

    /// What the current server certificate says (subject, serial, notAfter).
    pub fn server_cert(&self) -> CertInfo {
        let g = self.current.read().unwrap_or_else(PoisonError::into_inner);
        g.1.clone()
    }

    /// Reads the files again. On success new handshakes use them (logged at
    /// info: subject, serial, notAfter); on error the configuration in use
    /// stays and the error is returned (for the caller to log or report).
    pub fn reload(&self) -> Result<(), TlsError> {
        let l = load_info(&self.files)?;
        log_loaded(&self.files, "reloaded", &l);
        let mut g = self.current.write().unwrap_or_else(PoisonError::into_inner);
        *g = (l.config, l.server_cert);
        Ok(())
    }

    /// Where the files are, and whether clients must present a certificate.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

// Shared by the accept loop, the reactors and the reload signal handler.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<TlsContext>();
};
