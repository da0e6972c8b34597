//! [`CtlError`]: why a control action failed, and its wire form.
//!
//! One variant per way an action fails; [`CtlError::code`] maps each to the
//! control protocol's [`ErrorCode`] in one exhaustive match (no `_` arm: a new
//! cause of failure must be given a code), and [`CtlError::body`] is the reply's
//! error: the code and the message with its chain of causes. Pure.

use super::blockdev::BlockdevError;
use super::state;
use crate::backing::format::RawError;
use crate::backing::identity::IdentityError;
use crate::backing::lock::LockError;
use crate::backing::rbd::ErrorClass;
use crate::control::proto::{ErrorBody, ErrorCode};
use crate::device::DeviceError;
use crate::frontend::ublk::ctrl::CtrlError;
use crate::kernel_nbd::KernelNbdError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CtlError {
    #[error("no device named {0:?}")]
    NotFound(String),
    #[error("a device named {0:?} already exists")]
    NameTaken(String),
    #[error(
        "a device named {name:?} is recorded for {image} but missing ({reason}); attach that image, or detach {name:?} first"
    )]
    MissingTaken {
        name: String,
        image: String,
        reason: String,
    },
    #[error(
        "a device named {name:?} is recorded for {image} (missing: {reason}) with another \
         configuration than this attach asks: {differs}; attach {image} --name {name:?} without \
         these options to bring it back as recorded, or `loopd detach {name:?}` first and attach \
         it anew"
    )]
    MissingDiffers {
        name: String,
        image: String,
        reason: String,
        differs: String,
    },
    #[error(
        "a device named {name:?} of --config is missing ({reason}); it comes back from the \
         config file (retried every 2 s and by `loopd reload`), or `loopd detach {name:?}` \
         first to attach another device by that name"
    )]
    ConfigMissing { name: String, reason: String },
    #[error("{0}")]
    Busy(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{msg}")]
    Device {
        msg: String,
        #[source]
        source: DeviceError,
    },
    #[error("the daemon is stopping")]
    ShuttingDown,
    #[error("{msg}")]
    State {
        msg: String,
        #[source]
        source: state::StateError,
    },
    #[error("cannot give device {name:?} to the kernel as a block device")]
    Blockdev {
        name: String,
        #[source]
        source: BlockdevError,
    },
    /// `reload`: the config file cannot be read or parsed.
    #[error("config not reloaded, nothing changed")]
    Config(#[source] super::config::ConfigError),
    #[error("TLS is off: start the server with --tls on|require --tls-certs DIR")]
    TlsOff,
    #[error("TLS certificates not reloaded (the old ones stay in use)")]
    Tls(#[source] crate::tls::TlsError),
}

impl CtlError {
    /// The wire code of an error (exhaustive: every variant maps explicitly).
    pub fn code(&self) -> ErrorCode {
        match self {
            CtlError::NotFound(_) => ErrorCode::NotFound,
            CtlError::NameTaken(_)
            | CtlError::MissingTaken { .. }
            | CtlError::MissingDiffers { .. }
            | CtlError::ConfigMissing { .. } => ErrorCode::NameTaken,
            CtlError::Busy(_) => ErrorCode::Busy,
            CtlError::Invalid(_) => ErrorCode::Invalid,
            CtlError::ShuttingDown => ErrorCode::ShuttingDown,
            CtlError::TlsOff => ErrorCode::Invalid,
            CtlError::Config(c) => match c {
                super::config::ConfigError::Parse(..) => ErrorCode::Invalid,
                super::config::ConfigError::Read(..) => ErrorCode::Io,
            },
            CtlError::Tls(_) => ErrorCode::Io,
            CtlError::State { .. } => ErrorCode::Io,
            CtlError::Blockdev { source, .. } => match source {
                BlockdevError::TooManyQueues { .. }
                | BlockdevError::Depth(_)
                | BlockdevError::Connections(_) => ErrorCode::Invalid,
                BlockdevError::Nbd(
                    KernelNbdError::NoModule | KernelNbdError::NotPermitted { .. },
                )
                | BlockdevError::Nbd(KernelNbdError::NoDevice { .. }) => ErrorCode::Unavailable,
                BlockdevError::Nbd(KernelNbdError::BlockSize(_)) => ErrorCode::Invalid,
                BlockdevError::Nbd(_)
                | BlockdevError::SocketPair(_)
                | BlockdevError::Partitions(_) => ErrorCode::Io,
                BlockdevError::Unfollowable(_) => ErrorCode::Unavailable,
                BlockdevError::NbdLive { .. } | BlockdevError::Open(_) => ErrorCode::Busy,
                BlockdevError::Ctrl(CtrlError::Params(_)) => ErrorCode::Invalid,
                BlockdevError::Ctrl(
                    CtrlError::NotAvailable { .. }
                    | CtrlError::NoAccess { .. }
                    | CtrlError::Unsupported { .. },
                ) => ErrorCode::Unavailable,
                BlockdevError::Ctrl(e) if e.errno().is_some_and(|n| n == libc::EACCES) => {
                    ErrorCode::Unavailable
                }
                BlockdevError::Ctrl(_)
                | BlockdevError::Char(_)
                | BlockdevError::Queue { .. }
                | BlockdevError::NoReactors => ErrorCode::Io,
            },
            CtlError::Device { source, .. } => match source {
                DeviceError::BadBlockSize(_)
                | DeviceError::OffsetPastEnd { .. }
                | DeviceError::UnalignedOffset { .. }
                | DeviceError::BadSizeLimit(..)
                | DeviceError::Empty
                | DeviceError::TooLarge { .. }
                | DeviceError::NotAFile { .. } => ErrorCode::Invalid,
                DeviceError::Raw(RawError::NotRaw { .. }) => ErrorCode::Invalid,
                DeviceError::Raw(RawError::Probe { .. }) => ErrorCode::Io,
                DeviceError::DirectRefused { .. } => ErrorCode::DirectRefused,
                DeviceError::Lock(l) => match l {
                    LockError::InUse { .. } => ErrorCode::Busy,
                    LockError::Open { .. }
                    | LockError::Replaced { .. }
                    | LockError::Fcntl { .. } => ErrorCode::Io,
                },
                DeviceError::Create { .. }
                | DeviceError::Open { .. }
                | DeviceError::Stat { .. } => ErrorCode::Io,
                DeviceError::NotForRbd { .. } => ErrorCode::Invalid,
                DeviceError::Rbd(r) => match r.class() {
                    ErrorClass::Invalid => ErrorCode::Invalid,
                    ErrorClass::NotFound => ErrorCode::NotFound,
                    ErrorClass::Busy => ErrorCode::Busy,
                    ErrorClass::Unavailable => ErrorCode::Unavailable,
                    ErrorClass::Io => ErrorCode::Io,
                },
                DeviceError::Identity(i) => match i {
                    IdentityError::NotAFile { .. } => ErrorCode::Invalid,
                    IdentityError::Open { .. }
                    | IdentityError::NowSymlink { .. }
                    | IdentityError::UnrecordedSymlink { .. }
                    | IdentityError::UnrecordedDoubt { .. }
                    | IdentityError::Different { .. }
                    | IdentityError::Reopen { .. } => ErrorCode::Io,
                },
            },
        }
    }

    /// The reply's error: the code, and the message with its causes, each
    /// once ([`crate::text::error_chain`]).
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code(),
            message: crate::text::error_chain(self),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn name_errors_are_name_taken_whatever_the_cause() {
        let missing = CtlError::MissingTaken {
            name: "a".into(),
            image: "'/x'".into(),
            reason: "gone".into(),
        };
        let differs = CtlError::MissingDiffers {
            name: "a".into(),
            image: "'/x'".into(),
            reason: "gone".into(),
            differs: "offset".into(),
        };
        for e in [CtlError::NameTaken("a".into()), missing, differs] {
            assert_eq!(e.code(), ErrorCode::NameTaken, "{e}");
        }
        assert_eq!(CtlError::NotFound("a".into()).code(), ErrorCode::NotFound);
        assert_eq!(CtlError::TlsOff.code(), ErrorCode::Invalid);
        assert_eq!(CtlError::ShuttingDown.code(), ErrorCode::ShuttingDown);
    }

    #[test]
    fn a_locked_image_is_busy_and_a_bad_shape_invalid() {
        let locked = CtlError::Device {
            msg: "cannot attach '/x'".into(),
            source: DeviceError::Lock(LockError::InUse {
                path: PathBuf::from("/x"),
                why: "qemu holds it".into(),
            }),
        };
        assert_eq!(locked.code(), ErrorCode::Busy);
        let empty = CtlError::Device {
            msg: "cannot attach '/x'".into(),
            source: DeviceError::Empty,
        };
        assert_eq!(empty.code(), ErrorCode::Invalid);
        let depth = CtlError::Blockdev {
            name: "a".into(),
            source: BlockdevError::Depth(0),
        };
        assert_eq!(depth.code(), ErrorCode::Invalid);
    }

    #[test]
    fn body_carries_the_chain_of_causes() {
        let e = CtlError::Device {
            msg: "cannot attach '/x'".into(),
            source: DeviceError::Empty,
        };
        let b = e.body();
        assert_eq!(b.code, ErrorCode::Invalid);
        assert_eq!(
            b.message,
            format!("cannot attach '/x': {}", DeviceError::Empty)
        );
        let plain = CtlError::NotFound("a".into()).body();
        assert_eq!(plain.message, "no device named \"a\"");
    }
}
