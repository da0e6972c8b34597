//! TLS in userspace on the reactor: the record layer of a connection whose
//! kernel cannot take the session keys (no kTLS).
//!
//! The connection keeps issuing its receives and sends on the reactor's ring;
//! only their buffers change. A receive is posted into [`TlsIo::rx`]
//! (ciphertext); its completion is decrypted by rustls into the place the
//! connection asked for ([`TlsIo::want`], its header buffer or a write's payload
//! buffer). When plaintext is already decrypted and waiting, the "receive" is a
//! NOP on the ring whose completion carries the count in [`TlsIo::ready`], so
//! the connection's receive path runs unchanged. Replies are encrypted into
//! [`TlsIo::tx`] and sent from there; the connection is told how many plaintext
//! bytes went out only once all their ciphertext has.
//!
//! Contract: owned by one connection and used on its reactor thread only; the
//! pointer in `want` is the connection's receive target, valid (by the
//! connection's `post_recv` contract) until that receive completes. Nothing here
//! blocks: rustls works on memory only. Spliced replies cannot go through a
//! userspace record layer: a connection with a `TlsIo` answers reads from memory.

use rustls::ServerConnection;
use std::io::{ErrorKind, Read, Write};
use thiserror::Error;

/// Ciphertext received per receive (a few full TLS records).
pub const RX_BUF: usize = 64 << 10;
/// Plaintext encrypted per send at most.
pub const TX_BATCH: usize = 256 << 10;

#[derive(Debug, Error)]
pub enum TlsIoError {
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("TLS record layer: {0}")]
    Io(#[from] std::io::Error),
}

/// What a receive completion turned into.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Received {
    /// This many plaintext bytes are in the receive target.
    Plain(usize),
    /// Only part of a record arrived: receive more ciphertext.
    NeedMore,
    /// The client closed the TLS session (close_notify).
    Closed,
}

pub struct TlsIo {
    conn: ServerConnection,
    /// Ciphertext received and not yet taken by rustls: `rx[rx_start..rx_end]`.
    rx: Box<[u8]>,
    rx_start: usize,
    rx_end: usize,
    /// The connection's receive target: pointer and length.
    want: (*mut u8, usize),
    /// Plaintext delivered without a receive (the NOP's result).
    pub(super) ready: Option<usize>,
    /// Ciphertext of the send in flight, `tx_sent` bytes of it sent.
    tx: Vec<u8>,
    tx_sent: usize,
    /// Plaintext bytes that `tx` carries.
    tx_plain: usize,
}

// SAFETY: the only pointer, `want`, is the owning connection's receive target;
// it is written through only while that receive is in flight, on the thread
// that runs the connection, and a `TlsIo` changes threads only with its
// connection when no receive is in flight (handed to its first reactor, or
// moved once `Conn::move_target` says it may go).
unsafe impl Send for TlsIo {}

impl TlsIo {
    /// Take over a session whose handshake is complete. Plaintext rustls already
    /// decrypted (a request pipelined behind the handshake) is kept.
    pub fn new(mut conn: ServerConnection) -> TlsIo {
        // The connection bounds what it hands over per send (TX_BATCH).
        conn.set_buffer_limit(None);
        TlsIo {
            conn,
            rx: vec![0u8; RX_BUF].into_boxed_slice(),
            rx_start: 0,
            rx_end: 0,
            want: (std::ptr::null_mut(), 0),
            ready: None,
            tx: Vec::new(),
            tx_sent: 0,
            tx_plain: 0,
        }
    }

    /// Set the receive target and deliver what is already decrypted or buffered
    /// into it: `Plain(n)` if something was, else the caller receives ciphertext
    /// into [`TlsIo::rx_space`].
    ///
    /// # Safety
    /// `ptr..ptr+len` is writable and stays valid until the receive it stands
    /// for completes (the connection's `post_recv` contract).
    pub(super) unsafe fn set_target(
        &mut self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Received, TlsIoError> {
        self.want = (ptr, len);
        self.fill()
    }

    /// Free space for ciphertext: pointer and length (moves what is buffered to
    /// the front first).
    pub(super) fn rx_space(&mut self) -> (*mut u8, usize) {
        if self.rx_start > 0 {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        let at = self.rx_end;
        (self.rx[at..].as_mut_ptr(), self.rx.len() - at)
    }

    /// `n` bytes of ciphertext arrived in [`TlsIo::rx_space`].
    pub(super) fn received(&mut self, n: usize) -> Result<Received, TlsIoError> {
        self.rx_end = (self.rx_end + n).min(self.rx.len());
        self.fill()
    }

    /// Decrypt into the target as far as buffered ciphertext goes.
    fn fill(&mut self) -> Result<Received, TlsIoError> {
        let (ptr, len) = self.want;
        if ptr.is_null() || len == 0 {
            return Ok(Received::NeedMore);
        }
        // SAFETY: `want` was set by `set_target`, whose caller guarantees the
        // range is writable until this receive completes, which is now at the
        // earliest.
        let target = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        let mut got = 0;
        loop {
            match self.conn.reader().read(&mut target[got..]) {
                Ok(0) if got == 0 => return Ok(Received::Closed),
                Ok(0) => break,
                Ok(n) => {
                    got += n;
                    if got == len {
                        break;
                    }
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
            if self.rx_start == self.rx_end {
                break;
            }
            let mut pending = &self.rx[self.rx_start..self.rx_end];
            let n = self.conn.read_tls(&mut pending)?;
            self.rx_start += n;
            self.conn.process_new_packets()?;
        }
        if got > 0 {
            self.want = (std::ptr::null_mut(), 0);
            Ok(Received::Plain(got))
        } else {
            Ok(Received::NeedMore)
        }
    }

    /// Whether a send of ciphertext is under way (more of `tx` to send).
    pub(super) fn sending(&self) -> bool {
        self.tx_sent < self.tx.len()
    }

    /// Encrypt the plaintext `gather` hands its callback (in order) for one
    /// send, at most [`TX_BATCH`] bytes of it; returns the plaintext bytes
    /// taken. What rustls has to say on its own (alerts, key updates) goes
    /// along.
    pub(super) fn encrypt(
        &mut self,
        gather: impl FnOnce(&mut dyn FnMut(&[u8])),
    ) -> Result<usize, TlsIoError> {
        let mut taken = 0;
        let mut failed = None;
        let conn = &mut self.conn;
        gather(&mut |p| {
            if failed.is_some() || taken == TX_BATCH {
                return;
            }
            let p = &p[..p.len().min(TX_BATCH - taken)];
            match conn.writer().write_all(p) {
                Ok(()) => taken += p.len(),
                Err(e) => failed = Some(e),
            }
        });
        if let Some(e) = failed {
            return Err(e.into());
        }
        self.tx.clear();
        self.tx_sent = 0;
        while self.conn.wants_write() {
            self.conn.write_tls(&mut self.tx)?;
        }
        self.tx_plain = taken;
        Ok(taken)
    }

    /// The ciphertext still to send: pointer and length.
    pub(super) fn tx_pending(&self) -> (*const u8, usize) {
        (
            self.tx[self.tx_sent..].as_ptr(),
            self.tx.len() - self.tx_sent,
        )
    }

    /// `n` bytes of ciphertext were sent: `Some(plaintext bytes)` once all of
    /// the batch has gone, `None` while some is left.
    pub(super) fn sent(&mut self, n: usize) -> Option<usize> {
        self.tx_sent = (self.tx_sent + n).min(self.tx.len());
        if self.sending() {
            return None;
        }
        self.tx.clear();
        self.tx_sent = 0;
        Some(std::mem::take(&mut self.tx_plain))
    }

    /// Whether rustls has something of its own to send (an alert, say).
    pub(super) fn wants_write(&self) -> bool {
        self.conn.wants_write()
    }
}

#[cfg(test)]
mod tests;
