//! kTLS for real: a rustls handshake on loopback against a configuration from
//! `loopd::tls::load`, then `ktls::enable` on the server's socket, then data
//! both ways through the kernel's record layer — the server with plain
//! `read`/`write` on the socket, the client with rustls — for TLS 1.3 with
//! AES-128-GCM, AES-256-GCM and CHACHA20-POLY1305 and TLS 1.2 with the same
//! three, checking every byte; close_notify in both directions.
//!
//! Runs as root inside the VM `scripts/vm-test.sh kernel_ktls` boots (the
//! `tls` module loaded by the runner).

#![cfg(feature = "vm-tests")]

mod common;

use common::kernel::require_module;
use common::pki::Pki;
use common::tls::{client_config, handshake, handshake_pipelined};
use common::{pattern_bytes, tls::Handshake};
use loopd::tls::{self, TlsFiles, identities, ktls};
use rustls::CipherSuite;
use rustls::version::{TLS12, TLS13};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;

const UP: usize = 300 * 1024;
const DOWN: usize = 500 * 1024 + 17;

/// After `enable`: `UP` bytes client → server and `DOWN` bytes server →
/// client, the server on the bare socket.
fn exchange(h: Handshake, what: &str) {
    let conn = h
        .server
        .unwrap_or_else(|e| panic!("{what}: server handshake: {e}"));
    let mut client = h
        .client
        .unwrap_or_else(|e| panic!("{what}: client handshake: {e}"));
    let mut sock = h.server_sock;
    if let Err((e, back)) = ktls::enable(sock.as_fd(), conn) {
        panic!(
            "{what}: kTLS refused: {e} (connection {})",
            if back.is_some() {
                "handed back"
            } else {
                "lost"
            }
        );
    }
    let up = pattern_bytes(1, 0, UP);
    let down = pattern_bytes(2, 0, DOWN);
    let (up2, down2) = (up.clone(), down.clone());
    let t = std::thread::spawn(move || {
        client.write_all(&up2).expect("client write");
        client.flush().expect("client flush");
        let mut got = vec![0u8; DOWN];
        client.read_exact(&mut got).expect("client read");
        assert!(
            got == down2,
            "the client read other bytes than the kernel sent"
        );
        client
    });
    let mut got = vec![0u8; UP];
    sock.read_exact(&mut got).expect("server read (kTLS RX)");
    assert!(
        got == up,
        "{what}: the kernel decrypted other bytes than the client sent"
    );
    sock.write_all(&down).expect("server write (kTLS TX)");
    let mut client = t.join().expect("client thread");

    // The server ends the session: the client sees a clean close_notify.
    ktls::send_close_notify(sock.as_fd()).expect("send close_notify");
    let mut rest = Vec::new();
    let n = client
        .read_to_end(&mut rest)
        .expect("client sees close_notify");
    assert_eq!(n, 0, "{what}");
}

#[test]
fn ktls_carries_data_both_ways_for_every_suite() {
    require_module("tls");
    assert!(
        ktls::available(),
        "kTLS probe says no although tls is loaded"
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(tmp.path().join("pki"));
    let server = pki.server_dir("server");
    let anon = pki.trust_dir("anon");
    let cfg = tls::load(&TlsFiles {
        dir: server,
        verify_peer: false,
    })
    .expect("load");
    let cases = [
        (&TLS13, CipherSuite::TLS13_AES_128_GCM_SHA256),
        (&TLS13, CipherSuite::TLS13_AES_256_GCM_SHA384),
        (&TLS13, CipherSuite::TLS13_CHACHA20_POLY1305_SHA256),
        (&TLS12, CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256),
        (&TLS12, CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384),
        (
            &TLS12,
            CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
    ];
    for (v, suite) in cases {
        let what = format!("{v:?} {suite:?}");
        let h = handshake(cfg.clone(), client_config(&anon, &[v], Some(suite)));
        if let Ok(c) = &h.server {
            assert_eq!(c.negotiated_cipher_suite().map(|s| s.suite()), Some(suite));
        }
        exchange(h, &what);
    }
}

#[test]
fn ktls_after_client_authentication_and_the_clients_close() {
    require_module("tls");
    let tmp = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(tmp.path().join("pki"));
    let server = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let cfg = tls::load(&TlsFiles {
        dir: server,
        verify_peer: true,
    })
    .expect("load");
    let h = handshake(cfg, client_config(&alice, &[&TLS13], None));
    let conn = h.server.expect("server handshake");
    assert!(identities(&conn).contains(&"cn:alice".to_string()));
    let mut client = h.client.expect("client handshake");
    let mut sock = h.server_sock;
    ktls::enable(sock.as_fd(), conn)
        .map_err(|(e, _)| e)
        .expect("kTLS");
    client.write_all(b"hello kernel").unwrap();
    client.flush().unwrap();
    let mut buf = [0u8; 12];
    sock.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello kernel");
    // The client's close_notify is not data: read fails with EIO, which is
    // how the caller learns the session ended.
    client.conn.send_close_notify();
    client.flush().unwrap();
    let e = sock.read(&mut buf).expect_err("a read after close_notify");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert_ne!(e.kind(), ErrorKind::WouldBlock);
}

/// The client sends data right behind its Finished; the server read the
/// handshake record by record (RecordBoundary), so the data is still in the
/// socket and the kernel decrypts it.
#[test]
fn ktls_takes_data_pipelined_behind_the_handshake() {
    require_module("tls");
    let tmp = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(tmp.path().join("pki"));
    let server = pki.server_dir("server");
    let anon = pki.trust_dir("anon");
    let cfg = tls::load(&TlsFiles {
        dir: server,
        verify_peer: false,
    })
    .expect("load");
    for v in [&TLS13, &TLS12] {
        let (h, records) = handshake_pipelined(
            cfg.clone(),
            client_config(&anon, &[v], None),
            b"pipelined request".to_vec(),
        );
        assert!(records.at_boundary());
        let conn = h.server.expect("server handshake");
        let _client = h.client.expect("client handshake");
        let mut sock = h.server_sock;
        ktls::enable(sock.as_fd(), conn)
            .map_err(|(e, _)| e)
            .unwrap_or_else(|e| panic!("{v:?}: kTLS: {e}"));
        let mut buf = [0u8; 17];
        sock.read_exact(&mut buf).expect("kTLS read");
        assert_eq!(&buf, b"pipelined request", "{v:?}");
    }
}
