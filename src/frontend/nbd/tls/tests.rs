//! The record layer against a real rustls client, in memory: plaintext the
//! client sends arrives whole and in order whatever the receives' sizes, a
//! batch of replies is encrypted once and reported sent only when all its
//! ciphertext is, and a close_notify reads as the end of the session. The
//! certificates are made with `openssl` (a test tool of the project).

use super::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("this test needs openssl (scripts/install-test-deps.sh installs it): {e}")
        });
    assert!(
        out.status.success(),
        "openssl {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A server for `localhost` whose certificate a test CA issued, and a client
/// that trusts that CA.
fn configs() -> (Arc<ServerConfig>, Arc<ClientConfig>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca-key.pem", "-out", "ca-cert.pem", "-days", "2"]);
    ca.extend(["-subj", "/CN=loopd record layer test CA"]);
    openssl(d, &ca);
    let mut csr = vec!["req"];
    csr.extend(ec);
    csr.extend(["-keyout", "server-key.pem", "-out", "server.csr"]);
    csr.extend(["-subj", "/CN=localhost"]);
    openssl(d, &csr);
    std::fs::write(d.join("ext.cnf"), "subjectAltName=DNS:localhost\n").expect("ext.cnf");
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "server-cert.pem",
        ],
    );
    let read = |f: &str| std::fs::read(d.join(f)).expect("read a PEM file");
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&read("server-cert.pem"))
            .collect::<Result<_, _>>()
            .expect("server certificate");
    let key = PrivateKeyDer::from_pem_slice(&read("server-key.pem")).expect("server key");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("server config");
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&read("ca-cert.pem")) {
        roots.add(c.expect("CA certificate")).expect("add the CA");
    }
    let client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    (Arc::new(server), Arc::new(client))
}

/// Move what `$from` has to send into `$to` (a client and a server
/// connection, either way round).
macro_rules! flush {
    ($from:expr, $to:expr) => {{
        let mut wire = Vec::new();
        while $from.wants_write() {
            $from.write_tls(&mut wire).expect("write_tls");
        }
        let mut rest = &wire[..];
        while !rest.is_empty() {
            $to.read_tls(&mut rest).expect("read_tls");
            $to.process_new_packets().expect("process");
        }
    }};
}

/// A session whose handshake is done: the server side as a record layer,
/// and the client.
fn session() -> (TlsIo, ClientConnection) {
    let (sc, cc) = configs();
    let name = ServerName::try_from("localhost").expect("name");
    let mut client = ClientConnection::new(cc, name).expect("client");
    // The tests hand it more plaintext at once than rustls buffers by default.
    client.set_buffer_limit(None);
    let mut server = ServerConnection::new(sc).expect("server");
    for _ in 0..10 {
        flush!(client, server);
        flush!(server, client);
        if !client.is_handshaking() && !server.is_handshaking() {
            break;
        }
    }
    assert!(!client.is_handshaking() && !server.is_handshaking());
    flush!(server, client);
    (TlsIo::new(server), client)
}

/// Ciphertext of `plain`, as the client sends it.
fn client_sends(client: &mut ClientConnection, plain: &[u8]) -> Vec<u8> {
    client.writer().write_all(plain).expect("write");
    let mut wire = Vec::new();
    while client.wants_write() {
        client.write_tls(&mut wire).expect("write_tls");
    }
    wire
}

/// Receive everything into `out` in targets of `target` bytes, the kernel
/// handing over at most `chunk` bytes of ciphertext per receive.
fn receive_all(tls: &mut TlsIo, wire: &[u8], out: &mut [u8], target: usize, chunk: usize) {
    let (mut got, mut at) = (0, 0);
    let mut rounds = 0;
    while got < out.len() {
        rounds += 1;
        assert!(rounds < 100_000, "no progress");
        let len = target.min(out.len() - got);
        // SAFETY: `out` outlives this receive, which completes in this loop.
        let mut r = unsafe { tls.set_target(out[got..].as_mut_ptr(), len) }.expect("target");
        while r == Received::NeedMore {
            let (ptr, space) = tls.rx_space();
            let n = chunk.min(space).min(wire.len() - at);
            assert!(n > 0, "ciphertext ran out");
            // SAFETY: `rx_space` is writable for `space` >= n bytes.
            unsafe { std::ptr::copy_nonoverlapping(wire[at..].as_ptr(), ptr, n) };
            at += n;
            r = tls.received(n).expect("decrypt");
        }
        match r {
            Received::Plain(n) => {
                assert!(n <= len, "never past the target");
                got += n;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn what_the_client_sends_arrives_whole_and_in_order_in_any_receive_sizes() {
    let (mut tls, mut client) = session();
    let plain: Vec<u8> = (0..200_000u32)
        .map(|i| u8::try_from(i % 251).expect("below 251"))
        .collect();
    let wire = client_sends(&mut client, &plain);
    for (target, chunk) in [(28, 7), (4096, 65536), (100_000, 1), (200_000, 300)] {
        let mut out = vec![0u8; plain.len()];
        // The same plaintext each round, sent anew.
        let wire = if target == 28 {
            wire.clone()
        } else {
            client_sends(&mut client, &plain)
        };
        receive_all(&mut tls, &wire, &mut out, target, chunk);
        assert!(out == plain, "target {target}, chunk {chunk}: bytes differ");
    }
}

/// Take the plaintext the client has decrypted.
fn read_plain(client: &mut ClientConnection, out: &mut Vec<u8>) {
    let mut buf = [0u8; 16 << 10];
    loop {
        match client.reader().read(&mut buf) {
            Ok(0) => return,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(e) => panic!("client read: {e}"),
        }
    }
}

#[test]
fn a_batch_is_sent_once_and_reported_only_when_all_its_ciphertext_is() {
    let (mut tls, mut client) = session();
    let pieces: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 10_000]).collect();
    let all: Vec<u8> = pieces.concat();
    let mut delivered = Vec::new();
    let mut plain_sent = 0;
    for _ in 0..10 {
        if plain_sent == all.len() {
            break;
        }
        // What is left, as the reply queue would gather it.
        let taken = tls
            .encrypt(|emit| emit(&all[plain_sent..]))
            .expect("encrypt");
        assert!(taken > 0 && taken <= TX_BATCH);
        let mut report = None;
        while tls.sending() {
            let (ptr, len) = tls.tx_pending();
            let n = len.min(1000);
            // SAFETY: `tx_pending` points at `len` bytes of ciphertext.
            let chunk = unsafe { std::slice::from_raw_parts(ptr, n) };
            let mut rest = chunk;
            while !rest.is_empty() {
                client.read_tls(&mut rest).expect("read_tls");
                client.process_new_packets().expect("decrypt");
                read_plain(&mut client, &mut delivered);
            }
            assert_eq!(report, None, "reported before all was sent");
            report = tls.sent(n);
        }
        assert_eq!(report, Some(taken));
        plain_sent += taken;
    }
    assert_eq!(plain_sent, all.len());
    assert!(delivered == all, "the client read other bytes");
}

#[test]
fn a_close_notify_ends_the_session() {
    let (mut tls, mut client) = session();
    client.send_close_notify();
    let wire = client_sends(&mut client, &[]);
    let mut out = [0u8; 28];
    // SAFETY: `out` outlives this receive.
    let mut r = unsafe { tls.set_target(out.as_mut_ptr(), out.len()) }.expect("target");
    if r == Received::NeedMore {
        let (ptr, space) = tls.rx_space();
        assert!(space >= wire.len());
        // SAFETY: `rx_space` is writable for `space` bytes.
        unsafe { std::ptr::copy_nonoverlapping(wire.as_ptr(), ptr, wire.len()) };
        r = tls.received(wire.len()).expect("close");
    }
    assert_eq!(r, Received::Closed);
}
