//! `ca-crl.pem`: the certificate revocation lists client certificates are
//! checked against when the server verifies its peers — the file nbdkit's
//! `--tls-certificates` and QEMU's `tls-creds-x509` read from the same
//! directory.
//!
//! Contract: [`check`] is pure (bytes in). Every PEM `X509 CRL` section of the
//! file must parse, and be signed by a certificate of `ca-cert.pem` whose
//! subject is the CRL's issuer; otherwise the whole file is refused, naming
//! it and the CRL (a CRL of another CA would never match a client, and its
//! revocations would be silently ignored). What is returned goes to rustls'
//! client verifier, which refuses a revoked certificate during the handshake.
//! A CRL past its nextUpdate is used all the same (its revocations still
//! hold) and reported in [`CrlInfo::expired`], for a warning.

use super::error::TlsError;
use super::identity::dn_string;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer};
use std::path::Path;
use x509_parser::certificate::X509Certificate;
use x509_parser::prelude::FromDer;
use x509_parser::revocation_list::CertificateRevocationList;

/// The revocation lists, beside `ca-cert.pem`.
pub const CA_CRL: &str = "ca-crl.pem";

/// What the server log says about one CRL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CrlInfo {
    /// The issuer, as [`super::identity`]'s `dn:` form (without `dn:`).
    pub issuer: String,
    /// How many certificates it revokes.
    pub revoked: usize,
    /// nextUpdate, RFC 2822 (`None`: the CRL has none).
    pub next_update: Option<String>,
    /// nextUpdate is in the past (at `now` given to [`check`]).
    pub expired: bool,
}

fn content(path: &Path, what: impl Into<String>) -> TlsError {
    TlsError::Content {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// Parse and check the CRLs of `bytes` (the file at `path`) against the CA
/// certificates `cas`, at time `now` (seconds since the epoch); see the
/// module doc.
pub fn check(
    path: &Path,
    bytes: &[u8],
    cas: &[CertificateDer<'_>],
    now: i64,
) -> Result<(Vec<CertificateRevocationListDer<'static>>, Vec<CrlInfo>), TlsError> {
    let ders = CertificateRevocationListDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| content(path, format!("not PEM: {e}")))?;
    if ders.is_empty() {
        return Err(content(path, "no CRL found (no BEGIN X509 CRL section)"));
    }
    let cas: Vec<X509Certificate<'_>> = cas
        .iter()
        .filter_map(|c| X509Certificate::from_der(c).ok().map(|(_, c)| c))
        .collect();
    let mut infos = Vec::with_capacity(ders.len());
    for (i, der) in ders.iter().enumerate() {
        let which = format!("CRL {} of {}", i + 1, ders.len());
        let crl = match CertificateRevocationList::from_der(der) {
            Ok(([], c)) => c,
            Ok((rest, _)) => {
                return Err(content(
                    path,
                    format!("{which}: {} bytes after the CRL", rest.len()),
                ));
            }
            Err(e) => return Err(content(path, format!("{which}: not a CRL: {e}"))),
        };
        let issuer = dn_string(crl.issuer());
        let signer = cas
            .iter()
            .filter(|ca| ca.subject().as_raw() == crl.issuer().as_raw())
            .find(|ca| crl.verify_signature(ca.public_key()).is_ok());
        if signer.is_none() {
            let named = cas
                .iter()
                .any(|ca| ca.subject().as_raw() == crl.issuer().as_raw());
            return Err(content(
                path,
                if named {
                    format!(
                        "{which} (issuer {issuer}): its signature does not verify with that \
                         CA's certificate in ca-cert.pem"
                    )
                } else {
                    format!(
                        "{which} is issued by {issuer}, which is not a CA of ca-cert.pem: \
                         it could never revoke a client certificate"
                    )
                },
            ));
        }
        let next = crl.next_update();
        infos.push(CrlInfo {
            issuer,
            revoked: crl.iter_revoked_certificates().count(),
            next_update: next.map(|t| t.to_rfc2822().unwrap_or_else(|_| t.to_string())),
            expired: next.is_some_and(|t| t.timestamp() < now),
        });
    }
    Ok((ders, infos))
}
