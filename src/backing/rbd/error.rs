//! What opening an RBD image can fail on ([`RbdError`]), and the class of
//! each failure ([`ErrorClass`]: the daemon maps it to a protocol code and
//! the CLI to an exit status).

use crate::text::quoted_path;
use std::path::PathBuf;
use thiserror::Error;

/// What opening an RBD image can fail on, one variant per step.
#[derive(Debug, Error)]
pub enum RbdError {
    #[error("bad RBD image spec")]
    Spec(#[from] super::spec::SpecError),
    #[error(transparent)]
    Load(#[from] super::ffi::LoadError),
    #[error("a NUL byte in {0:?}")]
    Nul(String),
    #[error("cannot create a Ceph client handle")]
    Create(#[source] std::io::Error),
    #[error("cannot read the Ceph configuration {}", quoted_path(.conf))]
    Conf {
        conf: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set the Ceph option {option}")]
    ConfSet {
        option: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the Ceph cluster of {} refused client.{} (a wrong id, no keyring with its key, or no \
         monitors configured)",
        quoted_path(.conf),
        crate::text::sanitize_line(.id)
    )]
    Auth {
        id: String,
        conf: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot connect to the Ceph cluster of {} as client.{} (are its monitors up and reachable?)",
        quoted_path(.conf),
        crate::text::sanitize_line(.id)
    )]
    Connect {
        conf: PathBuf,
        id: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no pool {pool:?} in the Ceph cluster")]
    NoPool { pool: String },
    #[error("cannot use the pool {pool:?}")]
    Pool {
        pool: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no image {spec} in the Ceph cluster (no such namespace, image or snapshot)")]
    NoImage { spec: String },
    #[error("cannot open {spec}")]
    Open {
        spec: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{spec} is in use: its exclusive lock is held by {holder} (another loopd, rbd-nbd, krbd \
         or VM writes it); give --shared to write it anyway"
    )]
    Locked { spec: String, holder: String },
    #[error("cannot take the exclusive lock of {spec}")]
    Lock {
        spec: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{spec} has no exclusive-lock feature, so loopd cannot keep other writers out: give \
         --shared, or `rbd feature enable POOL/IMAGE exclusive-lock`"
    )]
    NoLockFeature { spec: String },
}

impl RbdError {
    /// The cluster refused the client itself (`ESHUTDOWN`: blocklisted).
    pub fn fenced(&self) -> bool {
        match self {
            RbdError::Pool { source, .. }
            | RbdError::Open { source, .. }
            | RbdError::Lock { source, .. } => source.raw_os_error() == Some(libc::ESHUTDOWN),
            _ => false,
        }
    }

    /// What class of failure this is, for the control protocol's codes.
    pub fn class(&self) -> ErrorClass {
        match self {
            RbdError::Spec(_) | RbdError::Nul(_) | RbdError::NoLockFeature { .. } => {
                ErrorClass::Invalid
            }
            RbdError::NoPool { .. } | RbdError::NoImage { .. } => ErrorClass::NotFound,
            RbdError::Locked { .. } => ErrorClass::Busy,
            RbdError::Load(_)
            | RbdError::Conf { .. }
            | RbdError::Auth { .. }
            | RbdError::Connect { .. } => ErrorClass::Unavailable,
            RbdError::Create(_)
            | RbdError::ConfSet { .. }
            | RbdError::Pool { .. }
            | RbdError::Open { .. }
            | RbdError::Lock { .. } => ErrorClass::Io,
        }
    }
}

/// Classes of [`RbdError`] (mapped to the protocol's codes by the daemon).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    Invalid,
    NotFound,
    Busy,
    Unavailable,
    Io,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_id_reaches_the_message_escaped() {
        let e = RbdError::Auth {
            id: "x\u{1b}[2Jy\n".into(),
            conf: PathBuf::from("/etc/ceph/ceph.conf"),
            source: std::io::Error::from_raw_os_error(libc::EACCES),
        };
        let text = e.to_string();
        assert!(!text.chars().any(char::is_control), "{text:?}");
        let e = RbdError::Connect {
            conf: PathBuf::from("/etc/ceph/ceph.conf"),
            id: "a\u{7}b".into(),
            source: std::io::Error::from_raw_os_error(libc::ETIMEDOUT),
        };
        let text = e.to_string();
        assert!(!text.chars().any(char::is_control), "{text:?}");
    }
}
