//! NBD URIs (`nbd+unix:///NAME?socket=PATH`, `nbd://HOST:PORT/NAME`) with
//! their parts percent-encoded as the NBD URI specification asks (RFC 3986):
//! an export `a b` on a socket `/tmp/with space/loopd.sock` is
//! `nbd+unix:///a%20b?socket=/tmp/with%20space/loopd.sock`.
//!
//! Contract: [`encode`] leaves only RFC 3986 unreserved bytes and `/` as they
//! are and writes every other byte as `%XX` (upper-case hex), so its output
//! is valid in a URI path and in a query value; [`decode`] is its inverse and
//! refuses a `%` not followed by two hex digits. Both are pure.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum UriError {
    #[error("bad percent-encoding at byte {0}")]
    BadEscape(usize),
}

fn keep(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/')
}

/// Percent-encode `bytes` for a URI path or query value.
pub fn encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len());
    for &b in bytes {
        if keep(b) {
            s.push(char::from(b));
        } else {
            s.push('%');
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
    s
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Undo [`encode`] (or any percent-encoding): the bytes it stands for.
pub fn decode(s: &str) -> Result<Vec<u8>, UriError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hi = b.get(i + 1).copied().and_then(hex);
            let lo = b.get(i + 2).copied().and_then(hex);
            match (hi, lo) {
                (Some(h), Some(l)) => out.push(h << 4 | l),
                _ => return Err(UriError::BadEscape(i)),
            }
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(out)
}

/// `nbd[s]+unix:///NAME?socket=PATH`
pub fn unix_uri(tls: bool, name: &str, socket: &Path) -> String {
    let s = if tls { "s" } else { "" };
    format!(
        "nbd{s}+unix:///{}?socket={}",
        encode(name.as_bytes()),
        encode(socket.as_os_str().as_bytes())
    )
}

/// `nbd[s]://HOSTPORT/NAME` (`hostport` as the listener prints it).
pub fn tcp_uri(tls: bool, hostport: &str, name: &str) -> String {
    let s = if tls { "s" } else { "" };
    format!("nbd{s}://{hostport}/{}", encode(name.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn spaces_and_specials_are_escaped() {
        assert_eq!(
            unix_uri(false, "a b", Path::new("/tmp/with space/loopd.sock")),
            "nbd+unix:///a%20b?socket=/tmp/with%20space/loopd.sock"
        );
        assert_eq!(
            tcp_uri(true, "127.0.0.1:10809", "x?y#z&%"),
            "nbds://127.0.0.1:10809/x%3Fy%23z%26%25"
        );
        assert_eq!(encode("disk-1_a.~/b".as_bytes()), "disk-1_a.~/b");
        assert_eq!(encode("é".as_bytes()), "%C3%A9");
    }

    #[test]
    fn bad_escapes_are_refused() {
        assert_eq!(decode("%"), Err(UriError::BadEscape(0)));
        assert_eq!(decode("a%4"), Err(UriError::BadEscape(1)));
        assert_eq!(decode("%zz"), Err(UriError::BadEscape(0)));
        assert_eq!(decode("%41%6a"), Ok(b"Aj".to_vec()));
    }

    proptest! {
        #[test]
        fn decode_inverts_encode(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assert_eq!(decode(&encode(&b)), Ok(b));
        }

        #[test]
        fn encoded_is_uri_safe(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let e = encode(&b);
            prop_assert!(e.bytes().all(|c| keep(c) || c == b'%' || c.is_ascii_hexdigit()));
        }

        #[test]
        fn decode_never_panics(s in ".{0,64}") {
            let _ = decode(&s);
        }
    }
}
