//! What a client's certificate proves, and allow lists over it.
//!
//! [`identities_of_der`] is a pure function of untrusted bytes (it parses
//! with x509-parser and never panics; property-tested here and fuzzed by
//! `fuzz/fuzz_targets/x509_identity.rs`). [`identities`] applies it to the
//! certificate rustls verified during the handshake, so what it returns is
//! vouched for by a CA in `ca-cert.pem`; without `verify_peer` no certificate
//! is asked for and the list is empty.
//!
//! # Identities
//!
//! Each identity is `KIND:VALUE`, one per fact:
//!
//! | identity | from |
//! |---|---|
//! | `cn:alice` | each commonName of the subject, its value as is |
//! | `dn:CN=alice,O=Example` | the whole subject, RFC 4514, as `openssl x509 -noout -subject -nameopt RFC2253` prints it |
//! | `dns:host.example` | each subjectAltName dNSName, lower-cased, without trailing dots |
//! | `email:alice@example.com` | each subjectAltName rfc822Name, the domain lower-cased |
//! | `uri:spiffe://example/alice` | each subjectAltName URI, as is |
//! | `ip:192.0.2.7`, `ip:2001:db8::1` | each subjectAltName iPAddress, in Rust's (RFC 5952) form |
//!
//! The `dn:` form: the attributes in the reverse of their encoded order (so
//! the most specific RDN first, and inside a multi-valued RDN the last
//! first, as openssl does), `,` between RDNs, `+` inside a multi-valued one, short names `CN`, `C`, `L`, `ST`, `street`, `O`,
//! `OU`, `DC`, `UID`, `emailAddress`, `serialNumber`, `title`, `SN`, `GN`
//! (others as a dotted OID). In values, `, + " \ < > ;`, a leading `#` or
//! space and a trailing space are escaped by `\`; control bytes and bytes of
//! non-ASCII UTF-8 as `\XX` (upper-case hex). Values that are not a
//! character string are `#` and the hex of their DER encoding.
//!
//! # Allow lists
//!
//! [`allowed`]: an empty list lets everyone in; otherwise some entry must
//! equal some identity. An entry may be written without its kind: an entry
//! that does not start with `cn:`, `dn:`, `dns:`, `email:`, `uri:` or `ip:`
//! (the kind in any case) is a commonName, so `alice` means `cn:alice`.
//! Entries are normalised as identities are (so every identity, as an entry,
//! admits itself): `dns:` lower-cased without trailing dots, `email:` with
//! its domain lower-cased, `ip:` parsed and
//! printed again (an unparsable address matches nothing). `cn:`, `dn:` and
//! `uri:` compare exactly.

use super::error::TlsError;
use std::fmt::Write as _;
use std::net::IpAddr;
use x509_parser::asn1_rs::{Class, Tag};
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::FromDer;
use x509_parser::x509::{AttributeTypeAndValue, X509Name};

/// What the server log says about a certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// The subject, in the `dn:` form of the module doc (without `dn:`).
    pub subject: String,
    /// The serial number, upper-case hex as openssl prints it.
    pub serial: String,
    /// notAfter, RFC 2822.
    pub not_after: String,
    /// notAfter, seconds since the epoch.
    pub not_after_unix: i64,
}

fn parse(der: &[u8]) -> Result<X509Certificate<'_>, TlsError> {
    match X509Certificate::from_der(der) {
        Ok(([], cert)) => Ok(cert),
        Ok((rest, _)) => Err(TlsError::Certificate(format!(
            "{} bytes after the certificate",
            rest.len()
        ))),
        Err(e) => Err(TlsError::Certificate(e.to_string())),
    }
}

/// Subject, serial and notAfter of a DER certificate.
pub fn cert_info(der: &[u8]) -> Result<CertInfo, TlsError> {
    let cert = parse(der)?;
    let not_after = cert.validity().not_after;
    let mut serial = String::new();
    for b in cert.raw_serial() {
        let _ = write!(serial, "{b:02X}");
    }
    // openssl prints "0" for an empty serial and drops one leading zero byte
    // (DER's sign padding).
    if serial.len() > 2 && serial.starts_with("00") {
        serial.drain(..2);
    }
    Ok(CertInfo {
        subject: dn_string(cert.subject()),
        serial,
        not_after: not_after
            .to_rfc2822()
            .unwrap_or_else(|_| not_after.to_string()),
        not_after_unix: not_after.timestamp(),
    })
}

/// The identities of the client's verified certificate (the module doc lists
/// them); empty when the client presented none. A certificate rustls
/// accepted but x509-parser cannot read proves nothing here: empty too, and
/// logged.
pub fn identities(conn: &rustls::ServerConnection) -> Vec<String> {
    let Some(leaf) = conn.peer_certificates().and_then(|c| c.first()) else {
        return Vec::new();
    };
    identities_of_der(leaf).unwrap_or_else(|e| {
        tracing::warn!("client certificate: {e}; it grants no identity");
        Vec::new()
    })
}

/// The identities a DER certificate names (see the module doc), in the
/// order `dn:`, `cn:`…, then subjectAltNames as they appear. Fails on bytes
/// that are not one whole certificate, or a malformed subjectAltName.
pub fn identities_of_der(cert_der: &[u8]) -> Result<Vec<String>, TlsError> {
    let cert = parse(cert_der)?;
    let subject = cert.subject();
    let mut ids = vec![format!("dn:{}", dn_string(subject))];
    for cn in subject.iter_common_name() {
        if let Some(v) = string_value(cn) {
            ids.push(format!("cn:{v}"));
        }
    }
    let san = cert
        .subject_alternative_name()
        .map_err(|e| TlsError::Certificate(format!("subjectAltName: {e}")))?;
    for name in san.iter().flat_map(|s| s.value.general_names.iter()) {
        match name {
            GeneralName::DNSName(d) => ids.push(format!("dns:{}", norm_dns(d))),
            GeneralName::RFC822Name(m) => ids.push(format!("email:{}", norm_email(m))),
            GeneralName::URI(u) => ids.push(format!("uri:{u}")),
            GeneralName::IPAddress(b) => {
                if let Some(ip) = ip_of(b) {
                    ids.push(format!("ip:{ip}"));
                }
            }
            _ => {}
        }
    }
    Ok(ids)
}

/// Whether `ids` may pass `allow` (see the module doc): an empty list lets
/// everyone in; otherwise some normalised entry equals some identity.
pub fn allowed(allow: &[String], ids: &[String]) -> bool {
    allow.is_empty()
        || allow
            .iter()
            .filter_map(|a| normalise(a))
            .any(|a| ids.contains(&a))
}

const KINDS: [&str; 6] = ["cn", "dn", "dns", "email", "uri", "ip"];

/// An allow-list entry in the form identities have; None if it can match
/// nothing (an `ip:` that is no address).
fn normalise(entry: &str) -> Option<String> {
    let split = entry.split_once(':').and_then(|(k, v)| {
        let k = k.to_ascii_lowercase();
        KINDS.contains(&k.as_str()).then_some((k, v))
    });
    let Some((kind, value)) = split else {
        return Some(format!("cn:{entry}"));
    };
    let value = match kind.as_str() {
        "dns" => norm_dns(value),
        "email" => norm_email(value),
        "ip" => value.parse::<IpAddr>().ok()?.to_string(),
        _ => value.to_string(),
    };
    Some(format!("{kind}:{value}"))
}

fn norm_dns(d: &str) -> String {
    d.trim_end_matches('.').to_ascii_lowercase()
}

fn norm_email(m: &str) -> String {
    match m.rsplit_once('@') {
        Some((local, domain)) => format!("{local}@{}", domain.to_ascii_lowercase()),
        None => m.to_ascii_lowercase(),
    }
}

fn ip_of(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => <[u8; 4]>::try_from(b).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(b).ok().map(IpAddr::from),
        _ => None,
    }
}

/// The value of an attribute as text, for the character-string types
/// (UTF8String, PrintableString, IA5String, NumericString, BMPString,
/// UniversalString, T61String read as Latin-1).
fn string_value(attr: &AttributeTypeAndValue<'_>) -> Option<String> {
    if let Ok(s) = attr.as_str() {
        return Some(s.to_string());
    }
    let any = attr.attr_value();
    let data = any.data;
    match any.tag() {
        Tag::BmpString => {
            if data.len() % 2 != 0 {
                return None;
            }
            let units = data
                .chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]));
            char::decode_utf16(units)
                .collect::<Result<String, _>>()
                .ok()
        }
        Tag::UniversalString => {
            if data.len() % 4 != 0 {
                return None;
            }
            data.chunks_exact(4)
                .map(|c| char::from_u32(u32::from_be_bytes([c[0], c[1], c[2], c[3]])))
                .collect()
        }
        Tag::T61String => Some(data.iter().map(|&b| char::from(b)).collect()),
        _ => None,
    }
}

fn short_name(attr: &AttributeTypeAndValue<'_>) -> String {
    let oid = attr.attr_type().to_id_string();
    let name = match oid.as_str() {
        "2.5.4.3" => "CN",
        "2.5.4.6" => "C",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.9" => "street",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.4" => "SN",
        "2.5.4.42" => "GN",
        "2.5.4.5" => "serialNumber",
        "2.5.4.12" => "title",
        "0.9.2342.19200300.100.1.25" => "DC",
        "0.9.2342.19200300.100.1.1" => "UID",
        "1.2.840.113549.1.9.1" => "emailAddress",
        _ => return oid,
    };
    name.to_string()
}

/// `#` and the hex of the value's DER encoding (for values that are not
/// character strings).
fn hex_der(attr: &AttributeTypeAndValue<'_>) -> String {
    let any = attr.attr_value();
    let mut out = String::from("#");
    let class = match any.class() {
        Class::Universal => 0u8,
        Class::Application => 0x40,
        Class::ContextSpecific => 0x80,
        Class::Private => 0xc0,
    };
    let constructed = if any.header.is_constructed() { 0x20 } else { 0 };
    let tag = any.tag().0;
    if let Ok(t) = u8::try_from(tag)
        && t < 31
    {
        let _ = write!(out, "{:02X}", class | constructed | t);
        let len = any.data.len();
        if let Ok(l) = u8::try_from(len)
            && l < 0x80
        {
            let _ = write!(out, "{l:02X}");
        } else {
            let bytes = len.to_be_bytes();
            let skip = bytes.iter().take_while(|&&b| b == 0).count();
            let _ = write!(out, "{:02X}", 0x80 | (bytes.len() - skip));
            for b in &bytes[skip..] {
                let _ = write!(out, "{b:02X}");
            }
        }
    }
    for b in any.data {
        let _ = write!(out, "{b:02X}");
    }
    out
}

/// RFC 4514 escaping, as openssl's `-nameopt RFC2253` does it.
fn escape(value: &str, out: &mut String) {
    let bytes = value.as_bytes();
    let last = bytes.len().saturating_sub(1);
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b',' | b'+' | b'"' | b'\\' | b'<' | b'>' | b';' => {
                out.push('\\');
                out.push(char::from(b));
            }
            b'#' if i == 0 => out.push_str("\\#"),
            b' ' if i == 0 || i == last => out.push_str("\\ "),
            0..0x20 | 0x7f.. => {
                let _ = write!(out, "\\{b:02X}");
            }
            _ => out.push(char::from(b)),
        }
    }
}

/// A name in the `dn:` form of the module doc.
pub(super) fn dn_string(name: &X509Name<'_>) -> String {
    let rdns: Vec<_> = name.iter().collect();
    let mut out = String::new();
    for (i, rdn) in rdns.iter().rev().enumerate() {
        if i != 0 {
            out.push(',');
        }
        let attrs: Vec<_> = rdn.iter().collect();
        for (j, attr) in attrs.iter().rev().enumerate() {
            if j != 0 {
                out.push('+');
            }
            out.push_str(&short_name(attr));
            out.push('=');
            match string_value(attr) {
                Some(v) => escape(&v, &mut out),
                None => out.push_str(&hex_der(attr)),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn allow_list_kinds_and_normalisation() {
        let ids = s(&[
            "dn:CN=alice,O=Example",
            "cn:alice",
            "dns:host.example",
            "email:alice@example.com",
            "uri:spiffe://example/alice",
            "ip:2001:db8::1",
        ]);
        assert!(allowed(&[], &ids));
        assert!(allowed(&[], &[]));
        for yes in [
            "alice",
            "cn:alice",
            "CN:alice",
            "dn:CN=alice,O=Example",
            "dns:HOST.example.",
            "email:alice@EXAMPLE.com",
            "uri:spiffe://example/alice",
            "ip:2001:0db8:0:0:0:0:0:1",
        ] {
            assert!(allowed(&s(&[yes]), &ids), "{yes}");
        }
        for no in [
            "bob",
            "Alice",
            "cn:Alice",
            "dn:O=Example,CN=alice",
            "dns:other.example",
            "email:Alice@example.com",
            "ip:2001:db8::2",
            "ip:not-an-address",
            "dn:CN=alice",
            "",
        ] {
            assert!(!allowed(&s(&[no]), &ids), "{no}");
        }
        assert!(allowed(&s(&["bob", "alice"]), &ids));
        assert!(!allowed(&s(&["alice"]), &[]));
        // A CN with a colon that is not a kind is still a CN.
        assert!(allowed(&s(&["host:1"]), &s(&["cn:host:1"])));
    }

    #[test]
    fn escaping_follows_rfc4514() {
        let mut out = String::new();
        escape(" #a,b+c\"d\\e<f>g;h# ", &mut out);
        assert_eq!(out, "\\ #a\\,b\\+c\\\"d\\\\e\\<f\\>g\\;h#\\ ");
        let mut out = String::new();
        escape("#Jé\n", &mut out);
        assert_eq!(out, "\\#J\\C3\\A9\\0A");
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(identities_of_der(&[]).is_err());
        assert!(identities_of_der(&[0x30, 0x03, 1, 2, 3]).is_err());
        assert!(cert_info(b"not DER").is_err());
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(b in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = identities_of_der(&b);
            let _ = cert_info(&b);
        }

        #[test]
        fn never_panics_on_a_der_sequence(body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut b = vec![0x30, 0x82];
            b.extend_from_slice(&u16::try_from(body.len()).unwrap_or(0).to_be_bytes());
            b.extend_from_slice(&body);
            let _ = identities_of_der(&b);
        }

        #[test]
        fn allowed_never_panics_and_empty_admits(
            allow in proptest::collection::vec(".{0,20}", 0..4),
            ids in proptest::collection::vec(".{0,20}", 0..4),
        ) {
            let r = allowed(&allow, &ids);
            if allow.is_empty() {
                prop_assert!(r);
            }
            if ids.is_empty() && !allow.is_empty() {
                prop_assert!(!r);
            }
        }

        #[test]
        fn a_bare_name_is_its_cn(name in "[a-zA-Z0-9 .@_-]{1,30}") {
            let id = format!("cn:{name}");
            prop_assert!(allowed(std::slice::from_ref(&name), std::slice::from_ref(&id)));
        }
    }
}
