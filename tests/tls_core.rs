//! The TLS core (src/tls) against certificates made by the test PKI:
//! loading and its error messages, reload, client identities, handshakes
//! with and without client certificates, and kTLS refusing on this host's
//! kernel (which cannot load the `tls` module) without losing the session.
//! kTLS itself is exercised in the VM by tests/kernel_ktls.rs.

mod common;

use common::pki::{KeyFormat, Leaf, Pki, Role, cert_der, serial_of, subject_of};
use common::tls::{client_config, handshake, handshake_pipelined};
use loopd::tls::{self, TlsContext, TlsFiles, identities, identities_of_der, ktls};
use rustls::version::{TLS12, TLS13};
use std::fs;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

fn files(dir: &Path, verify_peer: bool) -> TlsFiles {
    TlsFiles {
        dir: dir.to_path_buf(),
        verify_peer,
    }
}

/// The error as loopd prints it: with its causes, each once.
fn load_err(dir: &Path, verify_peer: bool) -> String {
    match tls::load(&files(dir, verify_peer)) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => loopd::text::error_chain(&e),
    }
}

fn copy_dir(from: &Path, to: &Path) -> PathBuf {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_file() {
            fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    to.to_path_buf()
}

#[test]
fn load_errors_name_the_file_and_the_fault() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let good = pki.server_dir("server");
    tls::load(&files(&good, true)).expect("a complete directory loads");

    let d = copy_dir(&good, &tmp.path().join("no-cert"));
    fs::remove_file(d.join("server-cert.pem")).unwrap();
    let e = load_err(&d, false);
    assert!(e.contains("server-cert.pem: missing"), "{e}");

    let d = copy_dir(&good, &tmp.path().join("no-key"));
    fs::remove_file(d.join("server-key.pem")).unwrap();
    let e = load_err(&d, false);
    assert!(e.contains("server-key.pem: missing"), "{e}");

    // ca-cert.pem: needed with verify_peer only.
    let d = copy_dir(&good, &tmp.path().join("no-ca"));
    fs::remove_file(d.join("ca-cert.pem")).unwrap();
    let e = load_err(&d, true);
    assert!(
        e.contains("ca-cert.pem: missing, needed by --tls-verify-peer"),
        "{e}"
    );
    tls::load(&files(&d, false)).expect("no CA is needed without verify_peer");

    let d = copy_dir(&good, &tmp.path().join("garbage"));
    fs::write(d.join("server-cert.pem"), "hello\n").unwrap();
    let e = load_err(&d, false);
    assert!(e.contains("server-cert.pem: no certificate found"), "{e}");
    fs::copy(good.join("server-cert.pem"), d.join("server-cert.pem")).unwrap();
    fs::write(d.join("server-key.pem"), "hello\n").unwrap();
    let e = load_err(&d, false);
    assert!(e.contains("server-key.pem: no private key found"), "{e}");
    // A certificate where the key should be: still no key.
    fs::copy(good.join("server-cert.pem"), d.join("server-key.pem")).unwrap();
    let e = load_err(&d, false);
    assert!(e.contains("server-key.pem: no private key found"), "{e}");
    fs::copy(good.join("server-cert.pem"), d.join("server-key.pem")).unwrap();
    fs::write(
        d.join("ca-cert.pem"),
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    fs::copy(good.join("server-key.pem"), d.join("server-key.pem")).unwrap();
    let e = load_err(&d, true);
    assert!(
        e.contains("ca-cert.pem: not a usable CA certificate"),
        "{e}"
    );

    // An encrypted key.
    let d = copy_dir(&good, &tmp.path().join("encrypted"));
    let key = d.join("server-key.pem");
    let st = Command::new("openssl")
        .args(["pkcs8", "-topk8", "-passout", "pass:secret", "-in"])
        .arg(&key)
        .arg("-out")
        .arg(d.join("enc.pem"))
        .status()
        .unwrap();
    assert!(st.success());
    fs::rename(d.join("enc.pem"), &key).unwrap();
    let e = load_err(&d, false);
    assert!(
        e.contains("server-key.pem: the private key is encrypted"),
        "{e}"
    );

    // Another certificate's key.
    let other = pki.server_dir("other-server");
    let d = copy_dir(&good, &tmp.path().join("mismatch"));
    fs::copy(other.join("server-key.pem"), d.join("server-key.pem")).unwrap();
    let e = load_err(&d, false);
    assert!(
        e.contains("server-cert.pem does not match") && e.contains("server-key.pem"),
        "{e}"
    );

    // Unreadable: a directory where the key should be.
    let d = copy_dir(&good, &tmp.path().join("unreadable"));
    fs::remove_file(d.join("server-key.pem")).unwrap();
    fs::create_dir(d.join("server-key.pem")).unwrap();
    let e = load_err(&d, false);
    assert!(e.contains("server-key.pem: Is a directory"), "{e}");

    let e = load_err(&tmp.path().join("nowhere"), false);
    assert!(e.contains("nowhere/server-cert.pem: missing"), "{e}");
}

#[test]
fn every_key_format_loads_and_serves() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let client = pki.trust_dir("trust");
    for fmt in [
        KeyFormat::Pkcs8Ec,
        KeyFormat::Pkcs8Rsa,
        KeyFormat::Pkcs1Rsa,
        KeyFormat::Sec1Ec,
    ] {
        let leaf = Leaf {
            key: fmt,
            ..Leaf::server()
        };
        let dir = pki.server_dir_with(&format!("{fmt:?}"), &leaf);
        let cfg = tls::load(&files(&dir, false)).unwrap_or_else(|e| panic!("{fmt:?}: {e}"));
        assert_eq!(cfg.send_tls13_tickets, 0);
        assert!(cfg.enable_secret_extraction);
        assert!(cfg.alpn_protocols.is_empty());
        for v in [&TLS13, &TLS12] {
            let h = handshake(cfg.clone(), client_config(&client, &[v], None));
            h.server
                .unwrap_or_else(|e| panic!("{fmt:?} {v:?}: server: {e}"));
            h.client
                .unwrap_or_else(|e| panic!("{fmt:?} {v:?}: client: {e}"));
        }
    }
}

#[test]
fn identities_name_the_subject_and_alt_names() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let leaf = Leaf {
        role: Role::Client,
        subject: "/DC=example/O=Example, Inc./OU=Dev+UID=u1/CN=J\u{e9}r\u{f4}me #1 ".into(),
        sans: vec![
            "DNS:Host.Example.".into(),
            "email:Alice@Example.COM".into(),
            "URI:spiffe://example/alice".into(),
            "IP:192.0.2.7".into(),
            "IP:2001:db8:0:0:0:0:0:1".into(),
        ],
        key: KeyFormat::Pkcs8Ec,
        days: 30,
    };
    let dir = pki.client_dir_with("fancy", &leaf);
    let cert = dir.join("client-cert.pem");
    let ids = identities_of_der(&cert_der(&cert)).unwrap();
    let openssl_dn = subject_of(&cert);
    assert_eq!(
        openssl_dn,
        "CN=J\\C3\\A9r\\C3\\B4me #1\\ ,UID=u1+OU=Dev,O=Example\\, Inc.,DC=example"
    );
    assert_eq!(
        ids,
        vec![
            format!("dn:{openssl_dn}"),
            "cn:J\u{e9}r\u{f4}me #1 ".to_string(),
            "dns:host.example".to_string(),
            "email:Alice@example.com".to_string(),
            "uri:spiffe://example/alice".to_string(),
            "ip:192.0.2.7".to_string(),
            "ip:2001:db8::1".to_string(),
        ]
    );
    for id in &ids {
        assert!(tls::allowed(std::slice::from_ref(id), &ids), "{id}");
    }
    let allow =
        |a: &[&str]| tls::allowed(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>(), &ids);
    assert!(allow(&["ip:2001:db8::1"]));
    assert!(allow(&["dns:HOST.example"]));
    assert!(allow(&[&format!("dn:{openssl_dn}")]));
    assert!(!allow(&["alice", "ip:192.0.2.8"]));

    // A plain client: its DN and CN; the serial as openssl prints it.
    let alice = pki.client_dir("alice");
    let der = cert_der(&alice.join("client-cert.pem"));
    assert_eq!(
        identities_of_der(&der).unwrap(),
        vec!["dn:CN=alice".to_string(), "cn:alice".to_string()]
    );
    let info = loopd::tls::identity::cert_info(&der).unwrap();
    assert_eq!(info.serial, serial_of(&alice.join("client-cert.pem")));
    assert_eq!(info.subject, "CN=alice");
    // A certificate with bytes after it is refused.
    let mut long = der.clone();
    long.push(0);
    assert!(identities_of_der(&long).is_err());
}

#[test]
fn verify_peer_requires_a_client_certificate_of_the_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let other = Pki::new(tmp.path().join("other"));
    let server = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let anon = pki.trust_dir("anon");
    // Trusts our CA (to check the server) but presents a certificate of
    // the other CA.
    let mallory = other.client_dir("mallory");
    pki.install_ca(&mallory);

    let strict = tls::load(&files(&server, true)).unwrap();
    for v in [&TLS13, &TLS12] {
        let h = handshake(strict.clone(), client_config(&alice, &[v], None));
        let conn = h.server.unwrap_or_else(|e| panic!("alice {v:?}: {e}"));
        assert_eq!(
            identities(&conn),
            vec!["dn:CN=alice".to_string(), "cn:alice".to_string()]
        );
        assert!(tls::allowed(&["alice".to_string()], &identities(&conn)));
        assert!(!tls::allowed(&["bob".to_string()], &identities(&conn)));

        let h = handshake(strict.clone(), client_config(&anon, &[v], None));
        let e = h.server.expect_err("a client without a certificate got in");
        assert!(e.contains("certificate"), "{v:?}: {e}");
        let h = handshake(strict.clone(), client_config(&mallory, &[v], None));
        let e = h.server.expect_err("a client of another CA got in");
        assert!(e.to_lowercase().contains("unknown"), "{v:?}: {e}");
    }

    // Without verify_peer no certificate is asked for: everyone connects,
    // nobody has an identity.
    let open = tls::load(&files(&server, false)).unwrap();
    for c in [&alice, &anon, &mallory] {
        let h = handshake(open.clone(), client_config(c, &[&TLS13], None));
        let conn = h.server.expect("handshake without verify_peer");
        assert!(identities(&conn).is_empty());
    }
}

#[test]
fn reload_takes_a_renewed_certificate_and_keeps_the_old_one_on_error() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let other = Pki::new(tmp.path().join("other"));
    let server = pki.server_dir("server");
    let anon = pki.trust_dir("anon");
    let ctx = TlsContext::new(files(&server, false)).unwrap();
    assert_eq!(ctx.files().dir, server);
    let presented = |ctx: &TlsContext| -> Vec<u8> {
        let h = handshake(ctx.current(), client_config(&anon, &[&TLS13], None));
        h.server.expect("server handshake");
        let c = h.client.expect("client handshake");
        c.conn.peer_certificates().unwrap()[0].to_vec()
    };
    let first = cert_der(&server.join("server-cert.pem"));
    assert_eq!(presented(&ctx), first);
    assert_eq!(
        ctx.server_cert().serial,
        serial_of(&server.join("server-cert.pem"))
    );

    pki.renew_server(&server);
    let renewed = cert_der(&server.join("server-cert.pem"));
    assert_ne!(renewed, first);
    let before = ctx.current();
    assert_eq!(presented(&ctx), first, "nothing changes before reload");
    ctx.reload().expect("reload the renewed certificate");
    assert_eq!(presented(&ctx), renewed);
    assert_eq!(
        ctx.server_cert().serial,
        serial_of(&server.join("server-cert.pem"))
    );
    // A configuration taken before the reload still serves the old one.
    let h = handshake(before, client_config(&anon, &[&TLS13], None));
    assert_eq!(
        h.client.unwrap().conn.peer_certificates().unwrap()[0].to_vec(),
        first
    );

    // A broken key: reload fails, the renewed certificate stays in use.
    fs::write(server.join("server-key.pem"), "broken").unwrap();
    let e = ctx
        .reload()
        .expect_err("reload of a broken key")
        .to_string();
    assert!(e.contains("server-key.pem: no private key found"), "{e}");
    assert_eq!(presented(&ctx), renewed);

    // Renewed by another CA: the client trusting only the first CA refuses
    // the server after the reload.
    other.renew_server(&server);
    ctx.reload().expect("reload");
    let h = handshake(ctx.current(), client_config(&anon, &[&TLS13], None));
    assert!(h.client.is_err(), "the client accepted another CA's server");
}

fn modprobe_tls_fails_here() {
    let out = Command::new("modprobe").arg("tls").output();
    let loaded = fs::read_to_string("/proc/modules")
        .map(|m| m.lines().any(|l| l.starts_with("tls ")))
        .unwrap_or(false);
    match out {
        Ok(o) => assert!(
            !o.status.success() && !loaded,
            "this host can load kTLS (modprobe tls succeeded); this test expects a kernel without it"
        ),
        Err(e) => panic!("run modprobe: {e} (install kmod)"),
    }
}

#[test]
fn ktls_is_unavailable_here_and_the_session_goes_on_in_userspace() {
    modprobe_tls_fails_here();
    assert!(!ktls::available());
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let server = pki.server_dir("server");
    let anon = pki.trust_dir("anon");
    let cfg = tls::load(&files(&server, false)).unwrap();
    for v in [&TLS13, &TLS12] {
        let h = handshake(cfg.clone(), client_config(&anon, &[v], None));
        let conn = h.server.expect("server handshake");
        let mut client = h.client.expect("client handshake");
        let sock = h.server_sock;
        let (e, back) = ktls::enable(sock.as_fd(), conn).expect_err("kTLS on this host");
        assert!(matches!(e, ktls::KtlsError::Unavailable(_)), "{v:?}: {e}");
        let conn = back.expect("the connection comes back when kTLS is unavailable");
        // The session goes on in userspace, both ways.
        let mut server = rustls::StreamOwned::new(conn, sock);
        client.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        server.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        server.write_all(b"pong").unwrap();
        client.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"pong");
    }
}

#[test]
fn ktls_refuses_buffered_plaintext_and_hands_the_connection_back() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let server = pki.server_dir("server");
    let anon = pki.trust_dir("anon");
    let cfg = tls::load(&files(&server, false)).unwrap();
    let h = handshake(cfg, client_config(&anon, &[&TLS13], None));
    let mut conn = h.server.expect("server handshake");
    let mut client = h.client.expect("client handshake");
    let mut sock = h.server_sock;
    client.write_all(b"early").unwrap();
    client.flush().unwrap();
    // Read the record into rustls without reading the plaintext out.
    while conn
        .process_new_packets()
        .unwrap()
        .plaintext_bytes_to_read()
        == 0
    {
        conn.read_tls(&mut sock).unwrap();
    }
    let (e, back) = ktls::enable(sock.as_fd(), conn).expect_err("buffered plaintext");
    assert!(matches!(e, ktls::KtlsError::BufferedPlaintext(5)), "{e}");
    let mut conn = back.expect("connection handed back");
    let mut buf = [0u8; 5];
    conn.reader().read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"early");
}

#[test]
fn record_bounded_handshake_leaves_pipelined_data_in_the_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let server = pki.server_dir("server");
    let anon = pki.trust_dir("anon");
    let cfg = tls::load(&files(&server, false)).unwrap();
    for v in [&TLS13, &TLS12] {
        let (h, records) = handshake_pipelined(
            cfg.clone(),
            client_config(&anon, &[v], None),
            b"pipelined".to_vec(),
        );
        assert!(records.at_boundary(), "{v:?}");
        let conn = h.server.expect("server handshake");
        let mut client = h.client.expect("client handshake");
        // Not BufferedPlaintext: the client's data is still in the socket,
        // so kTLS could take over here (it is refused only because this
        // host has none).
        let (e, back) = ktls::enable(h.server_sock.as_fd(), conn).expect_err("no kTLS here");
        assert!(matches!(e, ktls::KtlsError::Unavailable(_)), "{v:?}: {e}");
        let mut server = rustls::StreamOwned::new(back.expect("handed back"), h.server_sock);
        let mut buf = [0u8; 9];
        server.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"pipelined");
        server.write_all(b"ok").unwrap();
        let mut two = [0u8; 2];
        client.read_exact(&mut two).unwrap();
        assert_eq!(&two, b"ok");
    }
}
