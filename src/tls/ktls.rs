//! kTLS: after a handshake in userspace, the kernel encrypts and decrypts the
//! session's records, so plain `read`/`write` (and io_uring, splice,
//! sendfile) on the socket carry plaintext.
//!
//! [`enable`] takes the finished [`ServerConnection`] by value and, in this
//! order:
//! 1. processes records rustls already received, then refuses — handing the
//!    connection back — if the handshake is not finished, TLS output is
//!    still to be sent (`wants_write`), decrypted plaintext is waiting to be
//!    read, the client has closed, or the cipher suite has no kTLS
//!    counterpart;
//! 2. sets `TCP_ULP` `"tls"` on the socket. If the kernel has no kTLS (the
//!    `tls` module missing or not loadable) that fails with
//!    [`KtlsError::Unavailable`], and the connection is handed back: setting
//!    the ULP alone does not change the data path, so the caller goes on with
//!    the userspace record layer as if nothing happened;
//! 3. extracts the secrets (`dangerous_extract_secrets`) and gives them to
//!    the kernel with `TLS_TX` and `TLS_RX` (`SOL_TLS`). From here on the
//!    connection is gone: an error means the socket must be closed.
//!
//! So `Err((e, Some(conn)))` means "nothing happened, keep using `conn`", and
//! `Err((e, None))` means "the session is lost, close the socket".
//!
//! Supported: TLS 1.3 and 1.2 with AES-128-GCM, AES-256-GCM and
//! CHACHA20-POLY1305 (every suite of the configuration [`super::load`]
//! builds). The layouts sent are `struct tls12_crypto_info_*` of the
//! kernel's `include/uapi/linux/tls.h`: the 12-byte AEAD nonce base is split
//! into a 4-byte salt and an 8-byte IV for GCM (whole for ChaCha20), and
//! `rec_seq` is rustls's next sequence number, big-endian. Copies of key
//! material are wiped (zeroize) when dropped; rustls wipes its own.
//!
//! After `enable`, what the caller must know:
//! - A record that is not application data (the client's close_notify
//!   alert, a TLS 1.3 KeyUpdate) makes `read` fail with `EIO`; loopd treats
//!   that as the end of the connection. A client that updates its keys is
//!   therefore disconnected: clients do so near their cipher's
//!   confidentiality limit (rustls: 2^24 AES-GCM records, 256 GiB of 16 KiB
//!   records), and the 6.12 kernel cannot take new keys. [`send_close_notify`]
//!   ends a session politely from the server side.
//! - rustls must not have read bytes of a record it has not yet processed
//!   (a partial record in its buffer is lost, and the kernel then fails the
//!   next record with `EBADMSG`). Complete records are processed by step 1;
//!   a caller that reads the socket no further than the record in progress
//!   ([`super::RecordBoundary`]) is safe.
//!
//! [`available`] probes once per process (on a loopback TCP pair) whether
//! this kernel has kTLS, for logs and status.

use rustls::{CipherSuite, ConnectionTrafficSecrets, ProtocolVersion, ServerConnection};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::OnceLock;
use zeroize::Zeroizing;

// include/uapi/linux/tls.h
const TLS_TX: libc::c_int = 1;
const TLS_RX: libc::c_int = 2;
const TLS_SET_RECORD_TYPE: libc::c_int = 1;
const TLS_1_2_VERSION: u16 = 0x0303;
const TLS_1_3_VERSION: u16 = 0x0304;
const TLS_CIPHER_AES_GCM_128: u16 = 51;
const TLS_CIPHER_AES_GCM_256: u16 = 52;
const TLS_CIPHER_CHACHA20_POLY1305: u16 = 54;
/// TLS record content type of an alert.
const CONTENT_ALERT: u8 = 21;

/// Why the kernel did not take the session.
#[derive(Debug, thiserror::Error)]
pub enum KtlsError {
    /// The kernel has no kTLS (`TCP_ULP` "tls" refused with ENOENT,
    /// ENOPROTOOPT or EOPNOTSUPP).
    #[error("the kernel has no kTLS (TCP_ULP \"tls\": {0})")]
    Unavailable(io::Error),
    /// `TCP_ULP` failed otherwise (a socket not connected, the ULP already set).
    #[error("TCP_ULP \"tls\": {0}")]
    Ulp(io::Error),
    /// The handshake is not finished.
    #[error("the TLS handshake is not finished")]
    Handshaking,
    /// rustls holds TLS output not yet written to the socket.
    #[error("TLS output is still to be sent")]
    PendingWrite,
    /// rustls holds decrypted bytes the caller has not read.
    #[error("{0} bytes of received plaintext are still to be read")]
    BufferedPlaintext(usize),
    /// The client sent close_notify.
    #[error("the client closed the TLS session")]
    PeerClosed,
    /// Processing the records already received failed.
    #[error("TLS: {0}")]
    Tls(rustls::Error),
    /// A protocol version or cipher suite kTLS cannot take.
    #[error("{0} has no kTLS counterpart")]
    Unsupported(String),
    /// rustls would not give the secrets (after this the session is lost).
    #[error("extracting the TLS secrets: {0}")]
    Extract(rustls::Error),
    /// The kernel refused the keys for one direction (the session is lost).
    #[error("setting the kernel's {dir} keys: {source}")]
    Keys {
        dir: &'static str,
        #[source]
        source: io::Error,
    },
}

fn setsockopt(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    val: &[u8],
) -> io::Result<()> {
    let len = libc::socklen_t::try_from(val.len())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `fd` is a descriptor borrowed for the call; `val` is `len`
    // readable bytes that outlive the call, and the kernel only copies them.
    let r = unsafe { libc::setsockopt(fd.as_raw_fd(), level, name, val.as_ptr().cast(), len) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn set_ulp(fd: BorrowedFd<'_>) -> Result<(), KtlsError> {
    setsockopt(fd, libc::SOL_TCP, libc::TCP_ULP, b"tls").map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT | libc::ENOPROTOOPT | libc::EOPNOTSUPP) => KtlsError::Unavailable(e),
        _ => KtlsError::Ulp(e),
    })
}

/// Whether the kernel can take `suite` (before any secret is extracted).
fn supported(
    version: Option<ProtocolVersion>,
    suite: Option<CipherSuite>,
) -> Result<(), KtlsError> {
    match version {
        Some(ProtocolVersion::TLSv1_2 | ProtocolVersion::TLSv1_3) => {}
        v => return Err(KtlsError::Unsupported(format!("TLS version {v:?}"))),
    }
    match suite {
        Some(
            CipherSuite::TLS13_AES_128_GCM_SHA256
            | CipherSuite::TLS13_AES_256_GCM_SHA384
            | CipherSuite::TLS13_CHACHA20_POLY1305_SHA256
            | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
            | CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
            | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
            | CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384
            | CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
            | CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ) => Ok(()),
        s => Err(KtlsError::Unsupported(format!("cipher suite {s:?}"))),
    }
}

/// The kernel's `struct tls12_crypto_info_*` for one direction of
/// `secrets`, whose next record has sequence number `seq`.
fn crypto_info(
    version: u16,
    seq: u64,
    secrets: &ConnectionTrafficSecrets,
) -> Result<Zeroizing<Vec<u8>>, KtlsError> {
    match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv } => layout(
            version,
            TLS_CIPHER_AES_GCM_128,
            key.as_ref(),
            iv.as_ref(),
            seq,
        ),
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => layout(
            version,
            TLS_CIPHER_AES_GCM_256,
            key.as_ref(),
            iv.as_ref(),
            seq,
        ),
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => layout(
            version,
            TLS_CIPHER_CHACHA20_POLY1305,
            key.as_ref(),
            iv.as_ref(),
            seq,
        ),
        _ => Err(KtlsError::Unsupported("these traffic secrets".into())),
    }
}

/// `struct tls12_crypto_info_*`: version and cipher type (host order), then
/// iv, key, salt and rec_seq (big-endian). `nonce` is the 12-byte AEAD nonce
/// base: salt (4 bytes for GCM, none for ChaCha20) then iv.
fn layout(
    version: u16,
    cipher: u16,
    key: &[u8],
    nonce: &[u8],
    seq: u64,
) -> Result<Zeroizing<Vec<u8>>, KtlsError> {
    let (key_len, salt_len) = match cipher {
        TLS_CIPHER_AES_GCM_128 => (16, 4),
        TLS_CIPHER_AES_GCM_256 => (32, 4),
        _ => (32, 0),
    };
    if key.len() != key_len || nonce.len() != 12 {
        return Err(KtlsError::Unsupported(format!(
            "a {}-byte key and {}-byte nonce for cipher {cipher}",
            key.len(),
            nonce.len()
        )));
    }
    let (salt, iv) = nonce.split_at(salt_len);
    let mut out = Zeroizing::new(Vec::with_capacity(4 + 12 + 32 + 4 + 8));
    out.extend_from_slice(&version.to_ne_bytes());
    out.extend_from_slice(&cipher.to_ne_bytes());
    out.extend_from_slice(iv);
    out.extend_from_slice(key);
    out.extend_from_slice(salt);
    out.extend_from_slice(&seq.to_be_bytes());
    Ok(out)
}

/// Hands the established session on `fd` to the kernel (see the module doc
/// for the order of steps and what each error leaves). `fd` must be the TCP
/// socket `conn` ran over.
#[allow(clippy::result_large_err)] // the connection goes back by value, once
pub fn enable(
    fd: BorrowedFd<'_>,
    mut conn: ServerConnection,
) -> Result<(), (KtlsError, Option<ServerConnection>)> {
    if conn.is_handshaking() {
        return Err((KtlsError::Handshaking, Some(conn)));
    }
    let state = match conn.process_new_packets() {
        Ok(s) => s,
        Err(e) => return Err((KtlsError::Tls(e), Some(conn))),
    };
    let refusal = if conn.wants_write() {
        Some(KtlsError::PendingWrite)
    } else if state.plaintext_bytes_to_read() != 0 {
        Some(KtlsError::BufferedPlaintext(
            state.plaintext_bytes_to_read(),
        ))
    } else if state.peer_has_closed() {
        Some(KtlsError::PeerClosed)
    } else {
        supported(
            conn.protocol_version(),
            conn.negotiated_cipher_suite().map(|s| s.suite()),
        )
        .err()
    };
    if let Some(e) = refusal {
        return Err((e, Some(conn)));
    }
    let version = match conn.protocol_version() {
        Some(ProtocolVersion::TLSv1_3) => TLS_1_3_VERSION,
        _ => TLS_1_2_VERSION,
    };
    if let Err(e) = set_ulp(fd) {
        return Err((e, Some(conn)));
    }
    let secrets = conn
        .dangerous_extract_secrets()
        .map_err(|e| (KtlsError::Extract(e), None))?;
    let (tx_seq, tx) = &secrets.tx;
    let (rx_seq, rx) = &secrets.rx;
    let tx = crypto_info(version, *tx_seq, tx).map_err(|e| (e, None))?;
    let rx = crypto_info(version, *rx_seq, rx).map_err(|e| (e, None))?;
    setsockopt(fd, libc::SOL_TLS, TLS_TX, &tx)
        .map_err(|source| (KtlsError::Keys { dir: "TX", source }, None))?;
    setsockopt(fd, libc::SOL_TLS, TLS_RX, &rx)
        .map_err(|source| (KtlsError::Keys { dir: "RX", source }, None))?;
    Ok(())
}

/// Whether this kernel has kTLS: tries `TCP_ULP` "tls" once per process on
/// a connected loopback TCP socket, and remembers the answer.
pub fn available() -> bool {
    static ANSWER: OnceLock<bool> = OnceLock::new();
    *ANSWER.get_or_init(|| match probe_loopback() {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!("kTLS unavailable: {e}");
            false
        }
    })
}

fn probe_loopback() -> Result<(), KtlsError> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(KtlsError::Ulp)?;
    let addr = l.local_addr().map_err(KtlsError::Ulp)?;
    let client = std::net::TcpStream::connect(addr).map_err(KtlsError::Ulp)?;
    let (_server, _) = l.accept().map_err(KtlsError::Ulp)?;
    set_ulp(client.as_fd())
}

/// Sends a close_notify alert on a socket whose TX is in the kernel's hands
/// (after [`enable`]): the polite end of a TLS session.
pub fn send_close_notify(fd: BorrowedFd<'_>) -> io::Result<()> {
    // level warning (1), description close_notify (0)
    let mut alert = [1u8, 0u8];
    let mut iov = libc::iovec {
        iov_base: alert.as_mut_ptr().cast(),
        iov_len: alert.len(),
    };
    // One cmsg with one byte of data, in a buffer aligned for cmsghdr.
    let mut buf = [0u64; 4];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(1) } as usize;
    if space > std::mem::size_of_val(&buf) {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = buf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points to `space` zeroed, aligned bytes, enough for
    // one header, so CMSG_FIRSTHDR is non-null and inside `buf`; CMSG_LEN(1)
    // and CMSG_DATA stay within CMSG_SPACE(1).
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_TLS;
        (*c).cmsg_type = TLS_SET_RECORD_TYPE;
        (*c).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(c) = CONTENT_ALERT;
    }
    // SAFETY: `msg` points at `iov` (2 readable bytes) and `buf`, both live
    // for the call; `fd` is borrowed for it.
    let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::crypto::cipher::{AeadKey, Iv};

    const NONCE: [u8; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

    #[test]
    fn gcm_128_layout() {
        let b = layout(
            TLS_1_3_VERSION,
            TLS_CIPHER_AES_GCM_128,
            &[7; 16],
            &NONCE,
            0x0102,
        )
        .unwrap();
        assert_eq!(b.len(), 40, "sizeof(struct tls12_crypto_info_aes_gcm_128)");
        assert_eq!(&b[0..2], &0x0304u16.to_ne_bytes());
        assert_eq!(&b[2..4], &51u16.to_ne_bytes());
        assert_eq!(&b[4..12], &[5, 6, 7, 8, 9, 10, 11, 12], "iv");
        assert_eq!(&b[12..28], &[7; 16], "key");
        assert_eq!(&b[28..32], &[1, 2, 3, 4], "salt");
        assert_eq!(&b[32..40], &[0, 0, 0, 0, 0, 0, 1, 2], "rec_seq");
        assert!(layout(TLS_1_3_VERSION, TLS_CIPHER_AES_GCM_128, &[7; 32], &NONCE, 0).is_err());
    }

    #[test]
    fn gcm_256_and_chacha_layouts() {
        let s = ConnectionTrafficSecrets::Aes256Gcm {
            key: AeadKey::from([9u8; 32]),
            iv: Iv::new(NONCE),
        };
        let b = crypto_info(TLS_1_2_VERSION, 5, &s).unwrap();
        assert_eq!(b.len(), 56, "sizeof(struct tls12_crypto_info_aes_gcm_256)");
        assert_eq!(&b[0..2], &0x0303u16.to_ne_bytes());
        assert_eq!(&b[2..4], &52u16.to_ne_bytes());
        assert_eq!(&b[4..12], &[5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(&b[12..44], &[9; 32]);
        assert_eq!(&b[44..48], &[1, 2, 3, 4]);
        assert_eq!(&b[48..56], &5u64.to_be_bytes());

        let s = ConnectionTrafficSecrets::Chacha20Poly1305 {
            key: AeadKey::from([3u8; 32]),
            iv: Iv::new(NONCE),
        };
        let b = crypto_info(TLS_1_3_VERSION, u64::MAX, &s).unwrap();
        assert_eq!(
            b.len(),
            56,
            "sizeof(struct tls12_crypto_info_chacha20_poly1305)"
        );
        assert_eq!(&b[2..4], &54u16.to_ne_bytes());
        assert_eq!(&b[4..16], &NONCE, "the whole nonce is the iv, no salt");
        assert_eq!(&b[16..48], &[3; 32]);
        assert_eq!(&b[48..56], &[0xff; 8]);
        // A 32-byte key is not AES-128's.
        let s = ConnectionTrafficSecrets::Aes128Gcm {
            key: AeadKey::from([3u8; 32]),
            iv: Iv::new(NONCE),
        };
        assert!(crypto_info(TLS_1_3_VERSION, 0, &s).is_err());
    }

    #[test]
    fn unsupported_suites_are_refused_before_extraction() {
        let v13 = Some(ProtocolVersion::TLSv1_3);
        assert!(supported(v13, Some(CipherSuite::TLS13_AES_128_CCM_SHA256)).is_err());
        let gcm = Some(CipherSuite::TLS13_AES_128_GCM_SHA256);
        assert!(supported(Some(ProtocolVersion::TLSv1_1), gcm).is_err());
        assert!(supported(None, None).is_err());
        let chacha12 = Some(CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256);
        assert!(supported(Some(ProtocolVersion::TLSv1_2), chacha12).is_ok());
    }
}
