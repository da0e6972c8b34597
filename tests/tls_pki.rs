//! The test PKI (tests/common/pki.rs) makes certificates that the real TLS
//! stacks accept: openssl verifies each leaf for its purpose, and GnuTLS —
//! nbdkit serving, nbdinfo (libnbd) and qemu-img connecting — completes a
//! mutually authenticated NBD handshake with the directories as they are.

mod common;

use common::pki::{KeyFormat, Leaf, Pki, serial_of, subject_of};
use common::*;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn verify(ca: &Path, cert: &Path, purpose: &str) -> Out {
    run_status(
        "openssl",
        [
            "verify",
            "-purpose",
            purpose,
            "-CAfile",
            ca.to_str().unwrap(),
            cert.to_str().unwrap(),
        ],
    )
}

#[test]
fn leaves_verify_for_their_purpose_and_only_under_their_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let other = Pki::new(tmp.path().join("other"));
    let server = pki.server_dir("server");
    let client = pki.client_dir("alice");
    for f in ["ca-cert.pem", "server-cert.pem", "server-key.pem"] {
        assert!(server.join(f).is_file(), "{f} in the server dir");
    }
    for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        assert!(client.join(f).is_file(), "{f} in the client dir");
    }
    assert!(!server.join("ca-key.pem").exists() && !client.join("ca-key.pem").exists());
    verify(pki.ca_cert(), &server.join("server-cert.pem"), "sslserver").assert_success();
    verify(pki.ca_cert(), &client.join("client-cert.pem"), "sslclient").assert_success();
    assert!(!verify(pki.ca_cert(), &client.join("client-cert.pem"), "sslserver").success());
    assert!(
        !verify(
            other.ca_cert(),
            &server.join("server-cert.pem"),
            "sslserver"
        )
        .success()
    );
    assert_eq!(subject_of(&client.join("client-cert.pem")), "CN=alice");

    // Renewal by the same CA: a new serial, still valid; by the other CA:
    // valid under that CA only.
    let before = serial_of(&server.join("server-cert.pem"));
    pki.renew_server(&server);
    assert_ne!(serial_of(&server.join("server-cert.pem")), before);
    verify(pki.ca_cert(), &server.join("server-cert.pem"), "sslserver").assert_success();
    other.renew_server(&server);
    verify(
        other.ca_cert(),
        &server.join("server-cert.pem"),
        "sslserver",
    )
    .assert_success();
    assert!(!verify(pki.ca_cert(), &server.join("server-cert.pem"), "sslserver").success());
}

#[test]
fn key_formats_are_what_they_say() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    for (fmt, header) in [
        (KeyFormat::Pkcs8Ec, "-----BEGIN PRIVATE KEY-----"),
        (KeyFormat::Pkcs8Rsa, "-----BEGIN PRIVATE KEY-----"),
        (KeyFormat::Pkcs1Rsa, "-----BEGIN RSA PRIVATE KEY-----"),
        (KeyFormat::Sec1Ec, "-----BEGIN EC PRIVATE KEY-----"),
    ] {
        let leaf = Leaf {
            key: fmt,
            ..Leaf::server()
        };
        let dir = pki.server_dir_with(&format!("{fmt:?}"), &leaf);
        let key = std::fs::read_to_string(dir.join("server-key.pem")).unwrap();
        assert!(key.starts_with(header), "{fmt:?}: {key}");
        verify(pki.ca_cert(), &dir.join("server-cert.pem"), "sslserver").assert_success();
    }
}

/// nbdkit in the foreground, killed by PID when dropped.
struct Nbdkit(Child);

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nbdkit_tls(dir: &Path, port: u16) -> Nbdkit {
    let mut c = Command::new(require_tool("nbdkit"));
    c.env("PATH", tool_path_env())
        .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string()])
        .arg("--tls=require")
        .arg(format!("--tls-certificates={}", dir.display()))
        .arg("--tls-verify-peer")
        .args(["memory", "1M"])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let child = Nbdkit(c.spawn().expect("start nbdkit"));
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "nbdkit did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn gnutls_clients_and_server_accept_the_directories() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path().join("pki"));
    let other = Pki::new(tmp.path().join("other"));
    let server = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let mallory = other.client_dir("mallory");
    let port = free_port();
    let _nbdkit = nbdkit_tls(&server, port);

    let uri = |dir: &Path| {
        format!(
            "nbds://localhost:{port}/?tls-certificates={}",
            dir.display()
        )
    };
    let ok = run("nbdinfo", ["--size", &uri(&alice)]);
    assert_eq!(ok.stdout.trim(), "1048576");
    let bad = run_status("nbdinfo", ["--size", &uri(&mallory)]);
    assert!(!bad.success(), "a client of another CA got in: {bad}");

    let creds = format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={}",
        alice.display()
    );
    let image = format!("driver=nbd,host=localhost,port={port},tls-creds=tls0");
    let q = run(
        "qemu-img",
        ["info", "--object", &creds, "--image-opts", &image],
    );
    assert!(q.stdout.contains("1 MiB"), "{q}");
}
