//! How a connection's bytes reach its socket: in plaintext ([`Transport::Plain`]:
//! no TLS, or TLS whose records the kernel carries, kTLS), or through the
//! userspace TLS record layer ([`Transport::UserTls`], see [`super::tls`]),
//! behind one interface: post a receive into a target, take its completion;
//! send pieces of plaintext, take its completion.
//!
//! Every operation goes through the reactor's ring with the connection's
//! `user_data` (`TAG_RECV`, `TAG_SEND`): a userspace TLS receive whose
//! plaintext is already decrypted completes as a NOP carrying the count, and
//! a TLS send of more ciphertext than one send took is resumed here, so the
//! connection sees one completion per receive and per send either way.
//!
//! Contract: owned by its connection, used on its reactor thread only. The
//! `sendmsg` header and iovecs of a plain send live in a box of the
//! transport, stable while a send is in flight; the memory they point at is
//! the caller's ([`Transport::send`]'s contract). Nothing here blocks.

use super::tls::{Received, TlsIo, TlsIoError};
use crate::ring::{Io, TAG_RECV, TAG_SEND, ud};
use io_uring::{opcode, types};
use std::os::fd::RawFd;

/// Pieces in one `sendmsg`.
pub const MAX_IOV: usize = 64;

/// A plain send's `msghdr` and iovecs.
pub(crate) struct Vectored {
    iov: [libc::iovec; MAX_IOV],
    msg: libc::msghdr,
}

pub(crate) enum Transport {
    Plain(Box<Vectored>),
    UserTls(Box<TlsIo>),
}

// SAFETY: the raw pointers in a plain send's iovecs point into its
// connection's slots and are only dereferenced (by the kernel) while a send is
// in flight; the transport changes threads only with its connection, when
// nothing of it is in flight. `TlsIo` is `Send` on the same terms.
unsafe impl Send for Vectored {}

/// What a receive completion means for the connection.
#[derive(Debug)]
pub(crate) enum RecvDone {
    /// The receive's result, as a plaintext receive's: bytes in the target,
    /// 0 at the end of the stream, or an errno.
    Result(i32),
    /// More ciphertext was asked for: the receive goes on.
    Again,
    /// The TLS session failed (reported as `-EPROTO`).
    Failed(TlsIoError),
}

/// What a send completion means for the connection.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SendDone {
    /// The send's result, as a plaintext send's: plaintext bytes sent, or an
    /// errno.
    Result(i32),
    /// More ciphertext of the batch is being sent.
    Again,
    /// A message of the record layer's own (an alert) went out.
    Own,
}

impl Transport {
    /// Plaintext on the socket (no TLS, or kTLS); with `tls`, the userspace
    /// record layer.
    pub(crate) fn new(tls: Option<Box<TlsIo>>) -> Transport {
        match tls {
            Some(t) => Transport::UserTls(t),
            None => {
                // SAFETY: msghdr and iovec are plain C structs for which
                // all-zero is valid.
                let msg: libc::msghdr = unsafe { std::mem::zeroed() };
                let iov = [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; MAX_IOV];
                Transport::Plain(Box::new(Vectored { iov, msg }))
            }
        }
    }

    /// Whether replies may be spliced out of pipes (a userspace record layer
    /// sends from memory only).
    pub(crate) fn can_splice(&self) -> bool {
        matches!(self, Transport::Plain(_))
    }

    /// Whether the record layer has something of its own to send.
    pub(crate) fn wants_write(&self) -> bool {
        match self {
            Transport::Plain(_) => false,
            Transport::UserTls(t) => t.wants_write(),
        }
    }

    /// Post a receive of up to `len` bytes into `ptr` on socket `fd` for
    /// session `ci`. With TLS, plaintext already decrypted is delivered at
    /// once (a NOP completes the receive); an `Err` (the session failed)
    /// still completes it, with 0 bytes.
    ///
    /// # Safety
    /// `ptr..ptr+len` is writable memory of the connection that stays put
    /// until the receive completes.
    pub(crate) unsafe fn post_recv(
        &mut self,
        io: &mut Io,
        ci: u32,
        fd: RawFd,
        ptr: *mut u8,
        len: usize,
    ) -> Result<(), TlsIoError> {
        let Transport::UserTls(tls) = self else {
            // SAFETY: by this function's contract.
            unsafe { push_recv(io, ci, fd, ptr, len) };
            return Ok(());
        };
        // SAFETY: by this function's contract, the target stays valid until
        // this receive completes.
        let (now, err) = match unsafe { tls.set_target(ptr, len) } {
            Ok(Received::NeedMore) => (None, Ok(())),
            Ok(Received::Plain(n)) => (Some(n), Ok(())),
            Ok(Received::Closed) => (Some(0), Ok(())),
            Err(e) => (Some(0), Err(e)),
        };
        match now {
            None => {
                let (ptr, len) = tls.rx_space();
                // SAFETY: the free tail of the record layer's ciphertext
                // buffer, which lives in the connection until the receive
                // completes.
                unsafe { push_recv(io, ci, fd, ptr, len) };
            }
            Some(n) => {
                tls.ready = Some(n);
                let e = opcode::Nop::new().build().user_data(ud(TAG_RECV, ci, 0));
                // SAFETY: a NOP refers to no memory.
                unsafe { io.push(e) };
            }
        }
        err
    }

    /// A receive posted by [`Transport::post_recv`] completed with `res`.
    /// `stop`: the connection reads no further (more ciphertext is not asked
    /// for: the receive ends as cancelled).
    pub(crate) fn on_recv(
        &mut self,
        io: &mut Io,
        ci: u32,
        fd: RawFd,
        res: i32,
        stop: bool,
    ) -> RecvDone {
        let tls = match self {
            Transport::Plain(_) => return RecvDone::Result(res),
            Transport::UserTls(t) => t,
        };
        if let Some(n) = tls.ready.take() {
            return RecvDone::Result(i32::try_from(n).unwrap_or(-libc::EPROTO));
        }
        if res <= 0 {
            return RecvDone::Result(res);
        }
        match tls.received(res.unsigned_abs() as usize) {
            Ok(Received::Plain(n)) => RecvDone::Result(i32::try_from(n).unwrap_or(-libc::EPROTO)),
            Ok(Received::Closed) => RecvDone::Result(0),
            Ok(Received::NeedMore) => {
                if stop {
                    return RecvDone::Result(-libc::ECANCELED);
                }
                let (ptr, len) = tls.rx_space();
                if len == 0 {
                    return RecvDone::Result(-libc::EPROTO);
                }
                // SAFETY: the free tail of the record layer's ciphertext
                // buffer, which lives in the connection until the receive
                // completes.
                unsafe { push_recv(io, ci, fd, ptr, len) };
                RecvDone::Again
            }
            Err(e) => RecvDone::Failed(e),
        }
    }

    /// Send the pieces `gather` hands its callback (plaintext, in order; at
    /// most [`MAX_IOV`] of them) on socket `fd` for session `ci`: as one
    /// `sendmsg` whose iovecs point at them, or encrypted (as much as one
    /// batch takes) and sent from the record layer's buffer. Whether a send
    /// was posted (nothing to send posts none).
    ///
    /// # Safety
    /// Every piece stays put and unchanged until the send completes (a plain
    /// send hands the kernel their addresses).
    pub(crate) unsafe fn send(
        &mut self,
        io: &mut Io,
        ci: u32,
        fd: RawFd,
        gather: impl FnOnce(&mut dyn FnMut(&[u8])),
    ) -> Result<bool, TlsIoError> {
        match self {
            Transport::Plain(v) => {
                let mut n = 0;
                gather(&mut |p| {
                    if let Some(iov) = v.iov.get_mut(n) {
                        *iov = libc::iovec {
                            iov_base: p.as_ptr() as *mut libc::c_void,
                            iov_len: p.len(),
                        };
                        n += 1;
                    }
                });
                if n == 0 {
                    return Ok(false);
                }
                v.msg.msg_iov = v.iov.as_mut_ptr();
                v.msg.msg_iovlen = n;
                let msg: *const libc::msghdr = &v.msg;
                let e = opcode::SendMsg::new(types::Fd(fd), msg)
                    .flags(libc::MSG_NOSIGNAL as u32)
                    .build()
                    .user_data(ud(TAG_SEND, ci, 0));
                // SAFETY: `msg` and the iovecs live in the transport's box, and
                // the pieces they point at stay put until the send completes
                // (this function's contract).
                unsafe { io.push(e) };
                Ok(true)
            }
            Transport::UserTls(tls) => {
                tls.encrypt(gather)?;
                Ok(post_tls_send(tls, io, ci, fd))
            }
        }
    }

    /// A send posted by [`Transport::send`] completed with `res`.
    pub(crate) fn on_send(&mut self, io: &mut Io, ci: u32, fd: RawFd, res: i32) -> SendDone {
        match self {
            Transport::UserTls(tls) if res > 0 => match tls.sent(res.unsigned_abs() as usize) {
                None => {
                    post_tls_send(tls, io, ci, fd);
                    SendDone::Again
                }
                Some(0) => SendDone::Own,
                Some(plain) => SendDone::Result(i32::try_from(plain).unwrap_or(i32::MAX)),
            },
            _ => SendDone::Result(res),
        }
    }
}

/// Submit the receive SQE of `len` bytes into `ptr`.
///
/// # Safety
/// As [`Transport::post_recv`]: the memory stays put until the receive
/// completes.
unsafe fn push_recv(io: &mut Io, ci: u32, fd: RawFd, ptr: *mut u8, len: usize) {
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    let e = opcode::Recv::new(types::Fd(fd), ptr, len)
        .build()
        .user_data(ud(TAG_RECV, ci, 0));
    // SAFETY: by this function's contract.
    unsafe { io.push(e) };
}

/// Send the ciphertext still to send; whether there was any.
fn post_tls_send(tls: &TlsIo, io: &mut Io, ci: u32, fd: RawFd) -> bool {
    let (ptr, len) = tls.tx_pending();
    if len == 0 {
        return false;
    }
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    let e = opcode::Send::new(types::Fd(fd), ptr, len)
        .flags(libc::MSG_NOSIGNAL)
        .build()
        .user_data(ud(TAG_SEND, ci, 0));
    // SAFETY: the record layer's ciphertext buffer lives in the connection
    // (boxed) and is neither touched nor freed while the send is in flight.
    unsafe { io.push(e) };
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_may_be_spliced_and_has_nothing_of_its_own_to_send() {
        let t = Transport::new(None);
        assert!(t.can_splice());
        assert!(!t.wants_write());
    }
}
