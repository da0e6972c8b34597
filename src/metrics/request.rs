//! The head of an HTTP/1.x request, as a scraper sends it: a pure parser of
//! untrusted bytes (no I/O; fuzzed by `fuzz/fuzz_targets/metrics_request.rs`).
//!
//! Only the request line matters (method and path); header lines are checked
//! for shape and otherwise ignored. The head ends at the first empty line.

/// Longest request head accepted; a scraper's is a few hundred bytes.
pub const MAX_HEAD: usize = 8192;

/// A parsed request line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head<'a> {
    pub method: &'a str,
    /// The path, without the query string.
    pub path: &'a str,
}

/// What [`parse`] makes of the bytes read so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// The head is not complete yet: read more.
    Partial,
    /// A complete head.
    Done(Head<'a>),
    /// Not an HTTP/1.x request head (or longer than [`MAX_HEAD`]): answer 400.
    Bad(&'static str),
}

/// Parse the bytes received so far.
pub fn parse(buf: &[u8]) -> Parsed<'_> {
    let Some(end) = find_end(buf) else {
        if buf.len() >= MAX_HEAD {
            return Parsed::Bad("request head too long");
        }
        // A request line that is already wrong need not wait for the rest.
        if let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            if let Err(e) = request_line(&buf[..nl]) {
                return Parsed::Bad(e);
            }
        }
        return Parsed::Partial;
    };
    if end > MAX_HEAD {
        return Parsed::Bad("request head too long");
    }
    let head = &buf[..end];
    let mut lines = head.split(|&b| b == b'\n');
    let first = lines.next().unwrap_or_default();
    let h = match request_line(first) {
        Ok(h) => h,
        Err(e) => return Parsed::Bad(e),
    };
    for l in lines {
        let l = l.strip_suffix(b"\r").unwrap_or(l);
        if l.is_empty() {
            break;
        }
        match l.iter().position(|&b| b == b':') {
            Some(0) | None => return Parsed::Bad("malformed header line"),
            Some(c) if !l[..c].iter().all(|&b| is_token(b)) => {
                return Parsed::Bad("malformed header name");
            }
            Some(_) => {}
        }
    }
    Parsed::Done(h)
}

/// Index just past the blank line ending the head (`\r\n\r\n` or `\n\n`).
fn find_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(p) = buf[i..].iter().position(|&b| b == b'\n') {
        let nl = i + p;
        let rest = &buf[nl + 1..];
        if rest.starts_with(b"\n") {
            return Some(nl + 2);
        }
        if rest.starts_with(b"\r\n") {
            return Some(nl + 3);
        }
        i = nl + 1;
    }
    None
}

fn request_line(l: &[u8]) -> Result<Head<'_>, &'static str> {
    let l = l.strip_suffix(b"\r").unwrap_or(l);
    let s = std::str::from_utf8(l).map_err(|_| "request line is not text")?;
    let mut parts = s.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("request line is not METHOD TARGET VERSION");
    };
    if method.is_empty() || !method.bytes().all(is_token) {
        return Err("bad method");
    }
    if !target.starts_with('/') || !target.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("bad request target");
    }
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return Err("not HTTP/1.0 or HTTP/1.1");
    }
    let path = target.split('?').next().unwrap_or(target);
    Ok(Head { method, path })
}

/// RFC 9110 token characters.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_scrape() {
        let r = b"GET /metrics?x=1 HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n";
        assert_eq!(
            parse(r),
            Parsed::Done(Head {
                method: "GET",
                path: "/metrics"
            })
        );
        assert_eq!(parse(&r[..20]), Parsed::Partial);
        assert_eq!(
            parse(b"HEAD / HTTP/1.0\n\n"),
            Parsed::Done(Head {
                method: "HEAD",
                path: "/"
            })
        );
    }

    #[test]
    fn malformed_heads_are_bad() {
        for r in [
            &b"GET /metrics\r\n\r\n"[..],
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/2.0\r\n\r\n",
            b"G(T /metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n",
            b"GET  /metrics HTTP/1.1\r\n\r\n",
        ] {
            assert!(matches!(parse(r), Parsed::Bad(_)), "{r:?}");
        }
        assert!(matches!(parse(&[b'a'; MAX_HEAD]), Parsed::Bad(_)));
    }

    proptest! {
        #[test]
        fn never_panics_and_done_is_a_prefix(buf in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Parsed::Done(h) = parse(&buf) {
                prop_assert!(h.path.starts_with('/'));
                prop_assert!(!h.method.is_empty());
            }
        }

        #[test]
        fn well_formed_requests_parse(
            method in "[A-Z]{1,8}",
            path in "/[a-z0-9/._-]{0,40}",
            headers in proptest::collection::vec(("[A-Za-z-]{1,20}", "[ -~]{0,40}"), 0..8),
        ) {
            let mut r = format!("{method} {path} HTTP/1.1\r\n");
            for (k, v) in &headers {
                r.push_str(&format!("{k}: {v}\r\n"));
            }
            r.push_str("\r\n");
            prop_assert_eq!(parse(r.as_bytes()), Parsed::Done(Head { method: &method, path: &path }));
            // Any prefix is partial (never bad, never done).
            for cut in 0..r.len() - 1 {
                prop_assert_eq!(parse(&r.as_bytes()[..cut]), Parsed::Partial, "cut {}", cut);
            }
        }
    }
}
