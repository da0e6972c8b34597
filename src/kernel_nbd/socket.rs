//! A generic-netlink socket that sends one request at a time and reads until
//! that request is answered (its ACK or error; the data replies before it).
//!
//! Blocking, with a receive timeout ([`reply_timeout`], the daemon's
//! `--kernel-timeout`) so that a kernel that never answers is an error rather
//! than a hang. The kernel runs a generic-netlink request inside `send`;
//! the timeout bounds the wait for the answer after it. Not shared between threads (`&mut self`).

use super::msg::{MsgError, Transaction};
use rustix::net::{
    AddressFamily, RecvFlags, SendFlags, SocketType, bind, netlink, recv, send, socket,
    sockopt::{Timeout, set_socket_timeout},
};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;
use thiserror::Error;

const SOL_NETLINK: libc::c_int = 270;
const NETLINK_ADD_MEMBERSHIP: libc::c_int = 1;
const NETLINK_CAP_ACK: libc::c_int = 10;
const NETLINK_EXT_ACK: libc::c_int = 11;

/// How long a request waits for its answer: the daemon's
/// `--kernel-timeout` ([`crate::blockdev::kernel_timeout`]).
pub fn reply_timeout() -> Duration {
    crate::blockdev::kernel_timeout::get()
}
/// Big enough for `NBD_CMD_STATUS` of thousands of devices.
const RECV_BUF: usize = 256 * 1024;

#[derive(Debug, Error)]
pub enum SocketError {
    #[error("cannot open a generic netlink socket")]
    Open(#[source] std::io::Error),
    #[error("cannot bind the generic netlink socket")]
    Bind(#[source] std::io::Error),
    #[error("cannot send to the kernel")]
    Send(#[source] std::io::Error),
    #[error("cannot read the kernel's reply")]
    Recv(#[source] std::io::Error),
    #[error("cannot join netlink multicast group {0}")]
    Join(u32, #[source] std::io::Error),
    #[error("cannot wait for the kernel's announcements")]
    Poll(#[source] std::io::Error),
    #[error("the kernel did not answer within {:.1}s", .0.as_secs_f64())]
    NoReply(Duration),
    #[error("the kernel's reply of {0} bytes does not fit the buffer")]
    Truncated(usize),
    #[error("cannot build the request")]
    Build(#[source] MsgError),
    #[error("malformed reply from the kernel")]
    Reply(#[source] MsgError),
    /// The kernel answered with an error: the positive errno and its message.
    #[error("the kernel answered {}{}", std::io::Error::from_raw_os_error(*errno), message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Kernel { errno: i32, message: Option<String> },
}

#[derive(Debug)]
pub struct GenlSocket {
    fd: OwnedFd,
    seq: u32,
}

fn set_int_option(fd: &OwnedFd, opt: libc::c_int, value: u32) -> std::io::Result<()> {
    const LEN: libc::socklen_t = 4;
    const _: () = assert!(std::mem::size_of::<u32>() == LEN as usize);
    // SAFETY: `fd` is an open socket; the value points at a live u32 and its
    // size is passed with it; the kernel only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            SOL_NETLINK,
            opt,
            (&raw const value).cast(),
            LEN,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Asks for the kernel's extended-ack messages and for errors that echo only
/// the request's header. Both are optional: older kernels refuse them, and
/// then errors come without a message.
fn set_ack_options(fd: &OwnedFd) {
    for opt in [NETLINK_CAP_ACK, NETLINK_EXT_ACK] {
        let _ = set_int_option(fd, opt, 1);
    }
}

impl AsFd for GenlSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl GenlSocket {
    pub fn open() -> Result<GenlSocket, SocketError> {
        let fd = socket(
            AddressFamily::NETLINK,
            SocketType::RAW,
            Some(netlink::GENERIC),
        )
        .map_err(|e| SocketError::Open(e.into()))?;
        bind(&fd, &netlink::SocketAddrNetlink::new(0, 0))
            .map_err(|e| SocketError::Bind(e.into()))?;
        set_socket_timeout(&fd, Timeout::Recv, Some(reply_timeout()))
            .map_err(|e| SocketError::Open(e.into()))?;
        set_ack_options(&fd);
        Ok(GenlSocket { fd, seq: 0 })
    }

    /// Joins multicast group `group` (an id from `CTRL_CMD_GETFAMILY`).
    pub fn join_group(&mut self, group: u32) -> Result<(), SocketError> {
        set_int_option(&self.fd, NETLINK_ADD_MEMBERSHIP, group)
            .map_err(|e| SocketError::Join(group, e))
    }

    /// The next datagram, waiting at most `timeout`; `None` if none came.
    pub fn recv_within(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, SocketError> {
        let ts = rustix::event::Timespec {
            tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        let mut pfd = [rustix::event::PollFd::new(
            &self.fd,
            rustix::event::PollFlags::IN,
        )];
        match rustix::event::poll(&mut pfd, Some(&ts)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => return Ok(None),
            Ok(_) => {}
            Err(e) => return Err(SocketError::Poll(e.into())),
        }
        let mut buf = vec![0u8; RECV_BUF];
        match recv(
            &self.fd,
            &mut buf[..],
            RecvFlags::TRUNC | RecvFlags::DONTWAIT,
        ) {
            Ok((got, full)) if full > got => Err(SocketError::Truncated(full)),
            Ok((got, _)) => {
                buf.truncate(got);
                Ok(Some(buf))
            }
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => Ok(None),
            Err(e) => Err(SocketError::Recv(e.into())),
        }
    }

    /// Sends the request `build` makes for a fresh sequence number and
    /// returns the data replies of `family` (command, attribute bytes) once
    /// the kernel acknowledged it.
    pub fn request(
        &mut self,
        family: u16,
        build: impl FnOnce(u32) -> Result<Vec<u8>, MsgError>,
    ) -> Result<Vec<(u8, Vec<u8>)>, SocketError> {
        self.seq = self.seq.wrapping_add(1);
        let msg = build(self.seq).map_err(SocketError::Build)?;
        let n =
            send(&self.fd, &msg, SendFlags::empty()).map_err(|e| SocketError::Send(e.into()))?;
        if n != msg.len() {
            return Err(SocketError::Send(std::io::Error::other(format!(
                "sent {n} of {} bytes",
                msg.len()
            ))));
        }
        let mut t = Transaction::new(family, self.seq);
        let mut buf = vec![0u8; RECV_BUF];
        loop {
            let (got, full) = match recv(&self.fd, &mut buf[..], RecvFlags::TRUNC) {
                Ok(r) => r,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) => return Err(SocketError::NoReply(reply_timeout())),
                Err(e) => return Err(SocketError::Recv(e.into())),
            };
            if full > got {
                return Err(SocketError::Truncated(full));
            }
            if t.feed(&buf[..got]).map_err(SocketError::Reply)? {
                break;
            }
        }
        match t.outcome {
            Some(Ok(())) => Ok(t.replies),
            Some(Err((errno, message))) => Err(SocketError::Kernel { errno, message }),
            None => Err(SocketError::NoReply(reply_timeout())),
        }
    }
}
