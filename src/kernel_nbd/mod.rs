//! Kernel NBD devices driven over generic netlink: hand the kernel's `nbd`
//! driver sockets that are already past the NBD handshake and get
//! `/dev/nbdN` back, in one `NBD_CMD_CONNECT`; give a connected device new
//! sockets after a daemon restart (`NBD_CMD_RECONFIGURE`); disconnect it;
//! ask which devices are connected (`NBD_CMD_STATUS`).
//!
//! Contract:
//! - The caller owns the sockets. The kernel takes its own reference to each
//!   during the call, so the caller may close its descriptors afterwards; the
//!   other ends must speak NBD transmission (simple replies only: the kernel
//!   client knows no structured replies) with the flags passed as
//!   [`ConnectParams::server_flags`].
//! - Each call blocks until the kernel answered: at most
//!   [`socket::reply_timeout`] (the daemon's `--kernel-timeout`, 30 s by
//!   default) for the request to be taken and as long again for the
//!   answer, then [`socket::SocketError::NoReply`] says how long it waited.
//!   The kernel runs the request inside the sending call, which nothing can
//!   interrupt: it runs on a thread of its own, left behind at the deadline
//!   (the [`KernelNbd`] is then unusable: [`socket::SocketError::Stuck`]);
//!   a CONNECT the kernel carries out after it is disconnected again by that
//!   thread. A [`KernelNbd`] is one netlink socket; use it from one thread
//!   at a time.
//! - Client flags: loopd sets neither `DISCONNECT_ON_CLOSE` (the device would
//!   be torn down when its last opener closes it, e.g. after every `dd`) nor
//!   by default `DESTROY_ON_DISCONNECT` (when the dead-connection timeout runs
//!   out, the node would vanish, and a daemon that comes back late could not
//!   find its index again). The device lives until [`KernelNbd::disconnect`].
//! - Restart: with a dead-connection timeout, requests issued while every
//!   connection is dead wait that long for [`KernelNbd::reconfigure`]
//!   instead of failing. Requests in flight when a connection died are sent
//!   again once they time out ([`ConnectParams::timeout`]: set it). The
//!   kernel replaces only connections it has already marked dead (it notices
//!   EOF at once and announces it, see [`LinkDeadWatcher`]); a socket given
//!   when none is dead is dropped without an error (nbd.c turns `ENOSPC` into
//!   success): the caller must check that the kernel kept each socket (its
//!   own end of the pair hung up means dropped) and give dropped ones again
//!   once the old connections are dead (`daemon::blockdev` does). A
//!   restarted daemon finds its device with [`KernelNbd::find_backend`].
//! - The per-request timeout cuts both ways: a request slower than it makes
//!   the kernel shut that connection down and resend the request elsewhere,
//!   so a live daemon should watch [`LinkDeadWatcher`] and reconfigure.
//!
//! Does not import the engine, NBD server or daemon: the daemon makes the
//! socket pairs and hands one end here, the other to a reactor.

pub mod msg;
pub mod proto;
pub mod socket;

pub use proto::DeviceStatus;

use proto::DeviceAttrs;
use socket::{GenlSocket, SocketError};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;
use thiserror::Error;

/// NBD transmission flags the kernel looks at (nbd.c).
pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

const NBDS_MAX_PARAM: &str = "/sys/module/nbd/parameters/nbds_max";
const MAX_PART_PARAM: &str = "/sys/module/nbd/parameters/max_part";

fn read_param(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The highest index nbd.c accepts: `MINORMASK >> part_shift`, where
/// `part_shift` is the bit width of `max_part` (minor numbers are 20 bits, and
/// each device takes `max_part + 1` of them).
pub fn max_index(max_part: u32) -> u32 {
    const MINORMASK: u32 = (1 << 20) - 1;
    MINORMASK >> (u32::BITS - max_part.leading_zeros())
}

fn index_limit_text(max_part: Option<&str>) -> String {
    match max_part.and_then(|s| s.parse::<u32>().ok()) {
        Some(m) => format!(
            "the nbd module (max_part={m}) takes indexes up to {}",
            max_index(m)
        ),
        None => "it is beyond what the nbd module's max_part allows".to_string(),
    }
}

/// What [`KernelNbd::connect`] asks for.
#[derive(Debug, Clone, Default)]
pub struct ConnectParams {
    /// `/dev/nbdN` to use; `None`: the kernel picks an unused device, or adds one.
    pub index: Option<u32>,
    pub size_bytes: u64,
    /// Logical block size: a power of two from 512 to 4096.
    pub block_size: u32,
    /// The export's transmission flags as the handshake sent them. More than
    /// one socket needs `NBD_FLAG_CAN_MULTI_CONN`.
    pub server_flags: u16,
    /// Per-request timeout (whole seconds; `None`: the kernel's 30 s).
    pub timeout: Option<Duration>,
    /// How long requests wait for dead connections to be replaced
    /// (whole seconds; `None`: they fail as soon as every connection is dead).
    pub dead_conn_timeout: Option<Duration>,
    /// Remove the device node on disconnect (see the module doc).
    pub destroy_on_disconnect: bool,
    /// Shown in `/sys/block/nbdN/backend`; a reconfigure must then give the same.
    pub backend: Option<String>,
}

/// What [`KernelNbd::reconfigure`] changes besides the sockets; `None` keeps
/// the current value.
#[derive(Debug, Clone, Default)]
pub struct ReconfigureParams {
    pub timeout: Option<Duration>,
    pub dead_conn_timeout: Option<Duration>,
    /// Must be the identifier given at connect, if one was.
    pub backend: Option<String>,
}

#[derive(Debug, Error)]
pub enum KernelNbdError {
    #[error("the kernel has no nbd module loaded: `modprobe nbd`")]
    NoModule,
    #[error("{op}: not permitted: controlling nbd devices needs CAP_SYS_ADMIN (run as root)")]
    NotPermitted { op: &'static str },
    #[error(
        "connect /dev/nbd{index}: the device is already in use (connected: {in_use}); \
         leave out the index to let the kernel pick a free device"
    )]
    Busy { index: u32, in_use: String },
    #[error(
        "connect /dev/nbd{index}: the kernel refused the index (EINVAL): {limit}, or the \
         device is being removed; see `dmesg`"
    )]
    BadIndex { index: u32, limit: String },
    #[error(
        "connect: the kernel could not add an nbd device ({errno}): {limit} (connected: \
         {in_use}); disconnect devices no one uses, or reload the module with fewer \
         partitions per device: `modprobe -r nbd && modprobe nbd max_part=0` \
         (nbds_max={nbds_max} only pre-creates devices: `modprobe nbd nbds_max=N`)"
    )]
    NoDevice {
        errno: io::Error,
        limit: String,
        nbds_max: String,
        in_use: String,
    },
    #[error("connect: block size {0} is not a power of two from 512 to 4096")]
    BlockSize(u32),
    #[error("{op}: no sockets given")]
    NoSockets { op: &'static str },
    #[error(
        "connect: {n} sockets need the export to allow several connections \
         (NBD_FLAG_CAN_MULTI_CONN), its flags are {flags:#x}"
    )]
    NotMultiConn { n: usize, flags: u16 },
    #[error(
        "{op} /dev/nbd{index}: the kernel refused it (EINVAL): the device is not \
         connected, or its backend identifier differs; see `dmesg`{}",
        message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default()
    )]
    NotConnected {
        op: &'static str,
        index: u32,
        message: Option<String>,
    },
    #[error("{op}: the kernel answered {errno}{}; see `dmesg`", message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Kernel {
        op: &'static str,
        errno: io::Error,
        message: Option<String>,
    },
    #[error("{op}")]
    Socket {
        op: &'static str,
        #[source]
        source: SocketError,
    },
}

/// Tests only (the `vm-tests` feature, never a release build):
/// `LOOPD_TEST_NBD_CONNECT_DELAY=SECS` in the daemon's environment holds every
/// NBD_CMD_CONNECT that long before it is sent, as a kernel that does not
/// answer would, and then sends it: the attach fails at its deadline, and the
/// late connect is undone.
fn test_connect_delay() -> Duration {
    #[cfg(feature = "vm-tests")]
    if let Some(s) = std::env::var_os("LOOPD_TEST_NBD_CONNECT_DELAY")
        && let Some(secs) = s.to_str().and_then(|s| s.parse::<u64>().ok())
    {
        return Duration::from_secs(secs);
    }
    Duration::ZERO
}

/// `/dev/nbdN`.
pub fn device_path(index: u32) -> PathBuf {
    PathBuf::from(format!("/dev/nbd{index}"))
}

fn secs(d: Option<Duration>) -> Option<u64> {
    d.map(|d| d.as_secs())
}

/// Duplicates of `socks` (held open until the kernel took the request, see
/// [`GenlSocket::request_with`]) and their numbers for the request.
fn fds(
    op: &'static str,
    socks: &[BorrowedFd<'_>],
) -> Result<(Vec<OwnedFd>, Vec<u32>), KernelNbdError> {
    let owned = socks
        .iter()
        .map(|s| s.try_clone_to_owned())
        .collect::<io::Result<Vec<OwnedFd>>>()
        .map_err(|e| KernelNbdError::Socket {
            op,
            source: SocketError::Send(e),
        })?;
    // Descriptors are never negative.
    let nums = owned
        .iter()
        .map(|s| u32::try_from(s.as_raw_fd()).unwrap_or(u32::MAX))
        .collect();
    Ok((owned, nums))
}

/// What the kernel would refuse with a bare `EINVAL`, said before asking it.
fn check_connect(p: &ConnectParams, n_socks: usize) -> Result<(), KernelNbdError> {
    if n_socks == 0 {
        return Err(KernelNbdError::NoSockets { op: "connect" });
    }
    if !(512..=4096).contains(&p.block_size) || !p.block_size.is_power_of_two() {
        return Err(KernelNbdError::BlockSize(p.block_size));
    }
    if n_socks > 1 && p.server_flags & NBD_FLAG_CAN_MULTI_CONN == 0 {
        return Err(KernelNbdError::NotMultiConn {
            n: n_socks,
            flags: p.server_flags,
        });
    }
    Ok(())
}

/// A netlink handle on the kernel's `nbd` family.
#[derive(Debug)]
pub struct KernelNbd {
    sock: GenlSocket,
    family: u16,
    /// The `nbd_mc_group` multicast group, if the kernel has it.
    mcast: Option<u32>,
}

/// Announcements that a connection of a device died (`NBD_CMD_LINK_DEAD`):
/// the kernel gave up on it (EOF, an error, or a request past its timeout,
/// after which nbd.c shuts the socket down) and the device needs a new one
/// through [`KernelNbd::reconfigure`]. Its own socket; poll it with
/// [`std::os::fd::AsFd`] or wait with [`LinkDeadWatcher::wait`].
#[derive(Debug)]
pub struct LinkDeadWatcher {
    sock: GenlSocket,
    family: u16,
}

impl std::os::fd::AsFd for LinkDeadWatcher {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl LinkDeadWatcher {
    /// The indexes announced within `timeout` (one datagram's worth; empty
    /// if none came). An overrun (`ENOBUFS`) is an error: announcements were
    /// lost, so check every device with [`KernelNbd::status`].
    pub fn wait(&mut self, timeout: Duration) -> Result<Vec<u32>, KernelNbdError> {
        let op = "wait for dead nbd connections";
        match self.sock.recv_within(timeout) {
            Ok(None) => Ok(Vec::new()),
            Ok(Some(d)) => {
                proto::parse_link_dead(&d, self.family).map_err(|e| KernelNbdError::Socket {
                    op,
                    source: SocketError::Reply(e),
                })
            }
            Err(source) => Err(KernelNbdError::Socket { op, source }),
        }
    }
}

impl KernelNbd {
    /// Opens a generic-netlink socket and resolves the `nbd` family. Asking for
    /// the family makes the kernel load the module if it can.
    pub fn open() -> Result<KernelNbd, KernelNbdError> {
        let op = "resolve the nbd netlink family";
        let mut sock =
            GenlSocket::open().map_err(|source| KernelNbdError::Socket { op, source })?;
        let replies = sock
            .request(msg::GENL_ID_CTRL, |seq| {
                proto::get_family_request(seq, proto::NBD_GENL_FAMILY_NAME)
            })
            .map_err(|e| match e {
                SocketError::Kernel { errno, .. } if errno == libc::ENOENT => {
                    KernelNbdError::NoModule
                }
                source => KernelNbdError::Socket { op, source },
            })?;
        let family =
            family_from(&replies).map_err(|source| KernelNbdError::Socket { op, source })?;
        let mcast = replies.first().and_then(|(_, a)| {
            proto::parse_mcast_group(a, proto::NBD_GENL_MCAST_GROUP_NAME)
                .ok()
                .flatten()
        });
        Ok(KernelNbd {
            sock,
            family,
            mcast,
        })
    }

    /// Whether an earlier request is still in the kernel past its deadline:
    /// open a new handle for the next one.
    pub fn is_stuck(&self) -> bool {
        self.sock.is_stuck()
    }

    pub fn family_id(&self) -> u16 {
        self.family
    }

    /// Subscribes a new socket to the kernel's `NBD_CMD_LINK_DEAD`
    /// announcements (for every nbd device; filter by index).
    pub fn watch_link_dead(&self) -> Result<LinkDeadWatcher, KernelNbdError> {
        let op = "watch for dead nbd connections";
        let group = self.mcast.ok_or(KernelNbdError::Socket {
            op,
            source: SocketError::Reply(msg::MsgError::Missing {
                ty: msg::CTRL_ATTR_MCAST_GROUPS,
            }),
        })?;
        let mut sock =
            GenlSocket::open().map_err(|source| KernelNbdError::Socket { op, source })?;
        sock.join_group(group)
            .map_err(|source| KernelNbdError::Socket { op, source })?;
        Ok(LinkDeadWatcher {
            sock,
            family: self.family,
        })
    }

    /// Connects a device to `socks` (each already past the handshake) and
    /// returns its index. On error no device is left connected.
    pub fn connect(
        &mut self,
        p: &ConnectParams,
        socks: &[BorrowedFd<'_>],
    ) -> Result<u32, KernelNbdError> {
        let op = "connect";
        check_connect(p, socks.len())?;
        let attrs = DeviceAttrs {
            size_bytes: Some(p.size_bytes),
            block_size: Some(p.block_size),
            server_flags: Some(u64::from(p.server_flags | NBD_FLAG_HAS_FLAGS)),
            client_flags: Some(if p.destroy_on_disconnect {
                proto::NBD_CFLAG_DESTROY_ON_DISCONNECT
            } else {
                0
            }),
            timeout_secs: secs(p.timeout),
            dead_conn_timeout_secs: secs(p.dead_conn_timeout),
            backend: p.backend.clone(),
        };
        let (keep, fds) = fds(op, socks)?;
        let family = self.family;
        // A CONNECT the kernel carries out after the attach gave up on it
        // made a device nobody will use: disconnect it.
        let late: socket::Late = Box::new(move |fd, seq| {
            let made = socket::answer(std::os::fd::AsFd::as_fd(&fd), family, seq)
                .ok()
                .and_then(|r| {
                    r.iter()
                        .find(|(cmd, _)| *cmd == proto::NBD_CMD_CONNECT)
                        .and_then(|(_, a)| proto::parse_connect_reply(a).ok())
                });
            if let Some(index) = made {
                let undone = KernelNbd::open().and_then(|mut k| k.disconnect(index));
                match undone {
                    Ok(()) => tracing::warn!(
                        "the kernel carried out a connect after its deadline: /dev/nbd{index} \
                         disconnected again (its attach had failed)"
                    ),
                    Err(e) => tracing::error!(
                        "the kernel carried out a connect after its deadline, making \
                         /dev/nbd{index}, which could not be disconnected: {e}"
                    ),
                }
            }
        });
        let r = self.sock.request_with(
            family,
            |seq| proto::connect_request(family, seq, p.index, &attrs, &fds),
            keep,
            Some(late),
            test_connect_delay(),
            socket::reply_timeout(),
        );
        match r {
            Ok(replies) => replies
                .iter()
                .find(|(cmd, _)| *cmd == proto::NBD_CMD_CONNECT)
                .ok_or(SocketError::Reply(msg::MsgError::Missing {
                    ty: proto::NBD_ATTR_INDEX,
                }))
                .and_then(|(_, a)| proto::parse_connect_reply(a).map_err(SocketError::Reply))
                .map_err(|source| KernelNbdError::Socket { op, source }),
            Err(SocketError::Kernel { errno, message }) => {
                Err(self.connect_error(p.index, errno, message))
            }
            Err(source) => Err(KernelNbdError::Socket { op, source }),
        }
    }

    fn connect_error(
        &mut self,
        index: Option<u32>,
        errno: i32,
        message: Option<String>,
    ) -> KernelNbdError {
        let op = "connect";
        match (errno, index) {
            (libc::EPERM, _) => KernelNbdError::NotPermitted { op },
            (libc::EBUSY, Some(index)) => KernelNbdError::Busy {
                index,
                in_use: self.in_use(),
            },
            (libc::EINVAL, Some(index)) => KernelNbdError::BadIndex {
                index,
                limit: index_limit_text(read_param(MAX_PART_PARAM).as_deref()),
            },
            (libc::ENOSPC | libc::EEXIST | libc::ENFILE | libc::ENODEV | libc::ENOMEM, None) => {
                KernelNbdError::NoDevice {
                    errno: io::Error::from_raw_os_error(errno),
                    limit: index_limit_text(read_param(MAX_PART_PARAM).as_deref()),
                    nbds_max: read_param(NBDS_MAX_PARAM).unwrap_or_else(|| "unknown".into()),
                    in_use: self.in_use(),
                }
            }
            _ => KernelNbdError::Kernel {
                op,
                errno: io::Error::from_raw_os_error(errno),
                message,
            },
        }
    }

    /// The connected devices as text for an error message.
    fn in_use(&mut self) -> String {
        match self.status(None) {
            Ok(list) => {
                let used: Vec<String> = list
                    .iter()
                    .filter(|d| d.connected)
                    .map(|d| format!("/dev/nbd{}", d.index))
                    .collect();
                if used.is_empty() {
                    "none".into()
                } else {
                    used.join(", ")
                }
            }
            Err(_) => "unknown".into(),
        }
    }

    /// Gives connected device `index` new sockets, each replacing one dead
    /// connection (see the module doc), and changes the timeouts given.
    pub fn reconfigure(
        &mut self,
        index: u32,
        p: &ReconfigureParams,
        socks: &[BorrowedFd<'_>],
    ) -> Result<(), KernelNbdError> {
        let op = "reconfigure";
        let attrs = DeviceAttrs {
            timeout_secs: secs(p.timeout),
            dead_conn_timeout_secs: secs(p.dead_conn_timeout),
            backend: p.backend.clone(),
            ..DeviceAttrs::default()
        };
        let (keep, fds) = fds(op, socks)?;
        let family = self.family;
        self.sock
            .request_with(
                family,
                |seq| proto::reconfigure_request(family, seq, index, &attrs, &fds),
                keep,
                None,
                Duration::ZERO,
                socket::reply_timeout(),
            )
            .map(drop)
            .map_err(|e| Self::index_error(op, index, e))
    }

    /// Disconnects device `index`: the kernel sends `NBD_CMD_DISC` on every
    /// connection and shuts them down; the device's size drops to 0 once its
    /// receive threads ended (soon after this returns).
    pub fn disconnect(&mut self, index: u32) -> Result<(), KernelNbdError> {
        let family = self.family;
        self.sock
            .request(family, |seq| proto::disconnect_request(family, seq, index))
            .map(drop)
            .map_err(|e| Self::index_error("disconnect", index, e))
    }

    fn index_error(op: &'static str, index: u32, e: SocketError) -> KernelNbdError {
        match e {
            SocketError::Kernel { errno, .. } if errno == libc::EPERM => {
                KernelNbdError::NotPermitted { op }
            }
            SocketError::Kernel { errno, message } if errno == libc::EINVAL => {
                KernelNbdError::NotConnected { op, index, message }
            }
            SocketError::Kernel { errno, message } => KernelNbdError::Kernel {
                op,
                errno: io::Error::from_raw_os_error(errno),
                message,
            },
            source => KernelNbdError::Socket { op, source },
        }
    }

    /// The connected device whose backend identifier (given at connect) is
    /// `backend`: how a restarted daemon finds the device to reconfigure.
    /// Reads `/sys/block/nbdN/backend` of each connected device.
    pub fn find_backend(&mut self, backend: &str) -> Result<Option<u32>, KernelNbdError> {
        Ok(self
            .status(None)?
            .iter()
            .filter(|d| d.connected)
            .map(|d| d.index)
            .find(|&i| {
                std::fs::read_to_string(format!("/sys/block/nbd{i}/backend"))
                    .is_ok_and(|s| s.trim_end_matches('\n') == backend)
            }))
    }

    /// Every nbd device the kernel has (`None`) or just `index`, and whether
    /// each is connected. An index the kernel does not have is left out.
    pub fn status(&mut self, index: Option<u32>) -> Result<Vec<DeviceStatus>, KernelNbdError> {
        let op = "status";
        let family = self.family;
        let replies = self
            .sock
            .request(family, |seq| proto::status_request(family, seq, index))
            .map_err(|source| KernelNbdError::Socket { op, source })?;
        let mut out = Vec::new();
        for (cmd, attrs) in &replies {
            if *cmd == proto::NBD_CMD_STATUS {
                out.extend(proto::parse_status_reply(attrs).map_err(|e| {
                    KernelNbdError::Socket {
                        op,
                        source: SocketError::Reply(e),
                    }
                })?);
            }
        }
        Ok(out)
    }
}

fn family_from(replies: &[(u8, Vec<u8>)]) -> Result<u16, SocketError> {
    let (_, attrs) = replies
        .first()
        .ok_or(SocketError::Reply(msg::MsgError::Missing {
            ty: msg::CTRL_ATTR_FAMILY_ID,
        }))?;
    proto::parse_family_id(attrs).map_err(SocketError::Reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs against whatever kernel the tests run on: where no nbd module can
    /// be loaded (the build host) the error names the fix; where it can (the
    /// test VM; the family lookup loads it), the family resolves.
    #[test]
    fn open_names_modprobe_when_the_kernel_has_no_nbd() {
        match KernelNbd::open() {
            Err(e) => {
                assert!(matches!(e, KernelNbdError::NoModule), "{e:?}");
                assert_eq!(
                    e.to_string(),
                    "the kernel has no nbd module loaded: `modprobe nbd`"
                );
                assert!(
                    !std::path::Path::new("/sys/module/nbd").exists(),
                    "nbd is loaded, yet its family was not found"
                );
            }
            Ok(k) => {
                assert!(std::path::Path::new("/sys/module/nbd").exists());
                assert!(k.family_id() >= msg::GENL_ID_CTRL);
            }
        }
    }

    #[test]
    fn index_limit_follows_max_part() {
        assert_eq!(max_index(0), (1 << 20) - 1);
        assert_eq!(max_index(15), (1 << 16) - 1); // Debian's default: 16 minors each
        assert_eq!(max_index(16), (1 << 15) - 1);
        assert_eq!(
            index_limit_text(Some("15")),
            "the nbd module (max_part=15) takes indexes up to 65535"
        );
    }

    #[test]
    fn no_device_names_the_module_parameters() {
        let e = KernelNbdError::NoDevice {
            errno: io::Error::from_raw_os_error(libc::ENOSPC),
            limit: index_limit_text(Some("15")),
            nbds_max: "16".into(),
            in_use: "/dev/nbd0, /dev/nbd1".into(),
        };
        let t = e.to_string();
        for want in [
            "could not add an nbd device",
            "takes indexes up to 65535",
            "connected: /dev/nbd0, /dev/nbd1",
            "`modprobe -r nbd && modprobe nbd max_part=0`",
            "nbds_max=16 only pre-creates devices: `modprobe nbd nbds_max=N`",
        ] {
            assert!(t.contains(want), "{want:?} missing from: {t}");
        }
    }

    #[test]
    fn connect_parameters_the_kernel_would_refuse_are_named() {
        let p = ConnectParams {
            size_bytes: 1 << 20,
            block_size: 1000,
            ..ConnectParams::default()
        };
        assert!(matches!(
            check_connect(&p, 1),
            Err(KernelNbdError::BlockSize(1000))
        ));
        for bs in [256, 8192] {
            let p = ConnectParams {
                block_size: bs,
                ..p.clone()
            };
            assert!(check_connect(&p, 1).is_err(), "block size {bs}");
        }
        let p = ConnectParams {
            block_size: 4096,
            ..p
        };
        assert!(matches!(
            check_connect(&p, 0),
            Err(KernelNbdError::NoSockets { .. })
        ));
        let e = check_connect(&p, 2).expect_err("two sockets, no MULTI_CONN");
        assert!(e.to_string().contains("NBD_FLAG_CAN_MULTI_CONN"), "{e}");
        let multi = ConnectParams {
            server_flags: NBD_FLAG_CAN_MULTI_CONN,
            ..p
        };
        assert!(check_connect(&multi, 2).is_ok());
        assert!(check_connect(&multi, 1).is_ok());
    }
}
