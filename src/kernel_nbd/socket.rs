//! A generic-netlink socket that sends one request at a time and reads until
//! that request is answered (its ACK or error; the data replies before it).
//!
//! Blocking, bounded by [`reply_timeout`] (the daemon's `--kernel-timeout`)
//! so that a kernel that never answers is an error rather than a hang. The
//! kernel runs a generic-netlink request inside `send` (the NBD driver's
//! CONNECT may wait there, e.g. for the device's queue to freeze), which
//! nothing can interrupt: the send runs on a thread of its own, and the
//! caller waits for it at most the timeout; the wait for the answer after
//! it is bounded by the socket's receive timeout. A send still running at
//! the deadline fails the request ([`SocketError::NoReply`]) and leaves the
//! socket unusable ([`SocketError::Stuck`]: its late answer would come
//! first); the thread finishes whenever the kernel lets it and then runs
//! the request's [`Late`] work, if any (undo what the late request did).
//! Not shared between threads (`&mut self`).

use super::msg::{MsgError, Transaction};
use rustix::net::{
    AddressFamily, RecvFlags, SendFlags, SocketType, bind, netlink, recv, send, socket,
    sockopt::{Timeout, set_socket_timeout},
};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
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
    #[error(
        "an earlier request on this netlink socket is still in the kernel (it did not \
         answer in time); open a new socket"
    )]
    Stuck,
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
    /// A send outlived its deadline and may still be in the kernel.
    stuck: bool,
}

/// Work for a request the kernel answered only after its caller gave up:
/// run on the sending thread with a duplicate of the socket (the answer,
/// if the kernel sent one, is waiting on it) and the request's sequence
/// number.
pub type Late = Box<dyn FnOnce(OwnedFd, u32) + Send>;

/// What a request's sending thread and its caller share.
enum SendState {
    Waiting,
    Done(std::io::Result<usize>),
    /// The caller stopped waiting: the thread runs the late work itself.
    GaveUp,
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
        Ok(GenlSocket {
            fd,
            seq: 0,
            stuck: false,
        })
    }

    /// Whether a request outlived its deadline in the kernel's `send` (every
    /// later request fails with [`SocketError::Stuck`]).
    pub fn is_stuck(&self) -> bool {
        self.stuck
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
        self.request_with(
            family,
            build,
            Vec::new(),
            None,
            Duration::ZERO,
            reply_timeout(),
        )
    }

    /// [`GenlSocket::request`] for a request that names descriptors: `keep`
    /// holds them open until the kernel has taken the request (which may be
    /// after this returns: a descriptor number closed and reused meanwhile
    /// would hand the kernel another file), `late` runs if the kernel
    /// answers only after the deadline, (tests only) the send starts `delay`
    /// late, and is waited for at most `timeout` ([`reply_timeout`]).
    pub fn request_with(
        &mut self,
        family: u16,
        build: impl FnOnce(u32) -> Result<Vec<u8>, MsgError>,
        keep: Vec<OwnedFd>,
        late: Option<Late>,
        delay: Duration,
        timeout: Duration,
    ) -> Result<Vec<(u8, Vec<u8>)>, SocketError> {
        if self.stuck {
            return Err(SocketError::Stuck);
        }
        self.seq = self.seq.wrapping_add(1);
        let msg = build(self.seq).map_err(SocketError::Build)?;
        let len = msg.len();
        let n = self.send_bounded(msg, keep, late, delay, timeout)?;
        if n != len {
            return Err(SocketError::Send(std::io::Error::other(format!(
                "sent {n} of {len} bytes"
            ))));
        }
        answer(self.fd.as_fd(), family, self.seq)
    }

    /// Sends `msg` on a thread of its own and waits for it at most
    /// `timeout` (see the module documentation). Returns the bytes sent.
    fn send_bounded(
        &mut self,
        msg: Vec<u8>,
        keep: Vec<OwnedFd>,
        late: Option<Late>,
        delay: Duration,
        timeout: Duration,
    ) -> Result<usize, SocketError> {
        let fd = self.fd.try_clone().map_err(SocketError::Send)?;
        let seq = self.seq;
        let shared = Arc::new((Mutex::new(SendState::Waiting), Condvar::new()));
        let theirs = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("loopd-netlink".into())
            .spawn(move || {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                let r = send(&fd, &msg, SendFlags::empty()).map_err(std::io::Error::from);
                // The kernel took its own references to the descriptors.
                drop(keep);
                let (m, cv) = &*theirs;
                let mut st = m.lock().unwrap_or_else(|p| p.into_inner());
                if matches!(*st, SendState::GaveUp) {
                    drop(st);
                    if r.is_ok()
                        && let Some(f) = late
                    {
                        f(fd, seq);
                    }
                    return;
                }
                *st = SendState::Done(r);
                cv.notify_one();
            })
            .map_err(SocketError::Send)?;
        let deadline = Instant::now() + timeout;
        let (m, cv) = &*shared;
        let mut st = m.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match std::mem::replace(&mut *st, SendState::Waiting) {
                SendState::Done(r) => return r.map_err(SocketError::Send),
                SendState::Waiting | SendState::GaveUp => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                *st = SendState::GaveUp;
                self.stuck = true;
                return Err(SocketError::NoReply(timeout));
            }
            st = cv
                .wait_timeout(st, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

/// Reads from `fd` until request `seq` of `family` is answered (its ACK or
/// error; the data replies before it), each read bounded by the socket's
/// receive timeout. The replies are returned once the kernel acknowledged it.
pub fn answer(
    fd: BorrowedFd<'_>,
    family: u16,
    seq: u32,
) -> Result<Vec<(u8, Vec<u8>)>, SocketError> {
    let mut t = Transaction::new(family, seq);
    let mut buf = vec![0u8; RECV_BUF];
    loop {
        let (got, full) = match recv(fd, &mut buf[..], RecvFlags::TRUNC) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_nbd::{msg, proto};
    use std::sync::mpsc;

    /// A send the kernel takes only after the deadline (held back here, as a
    /// kernel stuck inside `send` would hold it): the request fails at the
    /// deadline, not later; the socket refuses further requests; once sent,
    /// the late work runs with the kernel's answer waiting on the socket.
    /// Against the host kernel's own generic-netlink controller.
    #[test]
    fn a_send_past_its_deadline_fails_then_runs_the_late_work() {
        let mut s = GenlSocket::open().expect("a generic netlink socket");
        let (tx, rx) = mpsc::channel();
        let late: Late = Box::new(move |fd, seq| {
            let got = answer(fd.as_fd(), msg::GENL_ID_CTRL, seq)
                .ok()
                .and_then(|r| r.first().map(|(_, a)| proto::parse_family_id(a).is_ok()));
            let _ = tx.send(got);
        });
        let t0 = Instant::now();
        let r = s.request_with(
            msg::GENL_ID_CTRL,
            |seq| proto::get_family_request(seq, "nlctrl"),
            Vec::new(),
            Some(late),
            Duration::from_millis(800),
            Duration::from_millis(200),
        );
        let took = t0.elapsed();
        assert!(matches!(r, Err(SocketError::NoReply(_))), "{r:?}");
        assert!(took < Duration::from_millis(700), "failed after {took:?}");
        assert!(matches!(
            s.request(msg::GENL_ID_CTRL, |seq| proto::get_family_request(
                seq, "nlctrl"
            )),
            Err(SocketError::Stuck)
        ));
        let got = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the late work ran");
        assert_eq!(got, Some(true), "the late answer was read and parsed");
    }

    /// In time: the answer, and the socket serves the next request.
    #[test]
    fn a_send_in_time_is_answered_and_the_socket_stays_usable() {
        let mut s = GenlSocket::open().expect("a generic netlink socket");
        for _ in 0..2 {
            let r = s
                .request(msg::GENL_ID_CTRL, |seq| {
                    proto::get_family_request(seq, "nlctrl")
                })
                .expect("nlctrl answers");
            assert!(proto::parse_family_id(&r[0].1).is_ok());
        }
    }
}
