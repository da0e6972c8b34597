//! Issue 22, point 4: `ca-crl.pem` in `--tls-certs DIR` (the layout of
//! nbdkit and QEMU) is honoured with `--tls-verify-peer`: a revoked client
//! certificate fails the TLS handshake (logged with the client's address), an
//! unrevoked one is served, and the file is re-read by `loopd reload-tls` /
//! SIGHUP; a bad CRL stops the start or keeps the old configuration at a
//! reload, naming the file. The PKI (and its CRLs, with `openssl ca`) is made
//! by each test (tests/common/pki.rs).

mod common;

use common::pki::Pki;
use common::*;
use std::path::Path;
use std::time::{Duration, Instant};

/// `nbds://127.0.0.1:PORT/NAME?tls-certificates=DIR`
fn tls_uri(srv: &Server, certs: &Path) -> String {
    format!(
        "nbds://127.0.0.1:{}/{}?tls-certificates={}",
        srv.port(),
        srv.name(),
        certs.display()
    )
}

fn nbdinfo(uri: &str) -> Out {
    run_status_timeout(Duration::from_secs(60), "nbdinfo", ["--size", uri])
}

fn verifying_server(img: &Path, certs: &Path) -> Server {
    Server::builder(img)
        .tcp()
        .with_control()
        .args([
            "--tls",
            "require",
            "--tls-certs",
            path_str(certs),
            "--tls-verify-peer",
        ])
        .start()
}

/// The refusals of a revoked certificate, as the log names them: the
/// client's TCP address and the reason. (Only the first is waited for:
/// repeated refusals from one address may be rate-limited in the log.)
fn revoked_refusals(srv: &Server) -> usize {
    srv.stderr_text()
        .lines()
        .filter(|l| {
            l.contains("NBD client 127.0.0.1:")
                && l.contains("refused: TLS handshake failed")
                && l.to_ascii_lowercase().contains("revoked")
        })
        .count()
}

/// Waits (10 s at most) until `cond` holds.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn revoked_client_certificates_are_refused_and_reload_picks_up_new_revocations() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let bob = pki.client_dir("bob");
    let carol = pki.client_dir("carol");
    pki.revoke(&bob.join("client-cert.pem"));
    pki.write_crl(&certs);
    let img = dir.path().join("c.img");
    create_pattern_image(&img, MIB, 3);
    let mut srv = verifying_server(&img, &certs);

    let a = nbdinfo(&tls_uri(&srv, &alice));
    assert!(a.success(), "an unrevoked client was refused:\n{a}");
    assert_eq!(a.stdout.trim(), MIB.to_string());
    let b = nbdinfo(&tls_uri(&srv, &bob));
    assert!(
        !b.success(),
        "a revoked client certificate was served:\n{b}"
    );
    wait_for("the refusal's log line", || revoked_refusals(&srv) >= 1);
    wait_for("the CRL reported at start", || {
        srv.stderr_text()
            .contains("1 revoked certificate(s) of CN=loopd test CA pki,O=loopd tests")
    });
    // libnbd's own client (nbdsh) is refused the same way.
    let script = format!(
        "h.set_uri_allow_local_file(True)\nh.set_tls_certificates({})\ntry:\n    h.connect_uri({})\n    print('CONNECTED')\nexcept nbd.Error as e:\n    print('REFUSED', e)\n",
        py_str(path_str(&bob)),
        py_str(&tls_uri(&srv, &bob))
    );
    let sh = nbdsh(&script);
    assert!(sh.stdout.contains("REFUSED"), "nbdsh with bob:\n{sh}");
    let c = nbdinfo(&tls_uri(&srv, &carol));
    assert!(c.success(), "carol is not revoked yet:\n{c}");

    // Carol is revoked: new connections are refused after `reload-tls`.
    pki.revoke(&carol.join("client-cert.pem"));
    pki.write_crl(&certs);
    srv.ctl_ok(&["reload-tls"]);
    let c = nbdinfo(&tls_uri(&srv, &carol));
    assert!(!c.success(), "carol was served after her revocation:\n{c}");
    wait_for("the reloaded CRL reported", || {
        srv.stderr_text()
            .contains("2 revoked certificate(s) of CN=loopd test CA pki")
    });
    let a = nbdinfo(&tls_uri(&srv, &alice));
    assert!(a.success(), "alice was refused after the reload:\n{a}");

    // And by SIGHUP: a new client revoked, then a reload by signal.
    let dave = pki.client_dir("dave");
    assert!(nbdinfo(&tls_uri(&srv, &dave)).success());
    pki.revoke(&dave.join("client-cert.pem"));
    pki.write_crl(&certs);
    srv.signal(libc::SIGHUP);
    wait_for("SIGHUP to pick up the CRL", || {
        !nbdinfo(&tls_uri(&srv, &dave)).success()
    });
    srv.assert_running();
}

#[test]
fn a_bad_crl_stops_the_start_and_a_bad_reload_keeps_the_old_one() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let other = Pki::new(dir.path().join("other"));
    let certs = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let bob = pki.client_dir("bob");
    let img = dir.path().join("b.img");
    create_sparse_image(&img, MIB);
    let sock = dir.path().join("b.sock");
    let start = |certs: &Path| {
        loopd_run([
            "serve",
            path_str(&img),
            "--socket",
            path_str(&sock),
            "--tls",
            "require",
            "--tls-certs",
            path_str(certs),
            "--tls-verify-peer",
        ])
    };
    let crl = certs.join("ca-crl.pem");
    for (bytes, why) in [
        (&b"not a CRL\n"[..], "no CRL found"),
        (
            &b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n"[..],
            "not a CRL",
        ),
    ] {
        std::fs::write(&crl, bytes).unwrap();
        let out = start(&certs);
        assert!(!out.success(), "served with a bad CRL:\n{out}");
        assert!(
            out.stderr.contains(&format!("{}: ", crl.display())) && out.stderr.contains(why),
            "{out}"
        );
        assert!(!sock.exists(), "a socket was left behind");
    }
    // A CRL of another CA could never revoke anything: refused by name.
    other.write_crl(&certs);
    let out = start(&certs);
    assert!(!out.success(), "served with another CA's CRL:\n{out}");
    assert!(
        out.stderr.contains("ca-crl.pem") && out.stderr.contains("not a CA of ca-cert.pem"),
        "{out}"
    );

    // A good one, then a broken one at reload: the old one stays in use.
    pki.revoke(&bob.join("client-cert.pem"));
    pki.write_crl(&certs);
    let srv = verifying_server(&img, &certs);
    assert!(!nbdinfo(&tls_uri(&srv, &bob)).success());
    std::fs::write(&crl, b"garbage\n").unwrap();
    let out = srv.ctl_err(&["reload-tls"], "io");
    assert!(
        out.stderr.contains("ca-crl.pem") && out.stderr.contains("old ones stay in use"),
        "{out}"
    );
    assert!(
        !nbdinfo(&tls_uri(&srv, &bob)).success(),
        "a failed reload dropped the revocations"
    );
    assert!(nbdinfo(&tls_uri(&srv, &alice)).success());
}

#[test]
fn an_expired_crl_still_revokes_and_is_warned_about() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let bob = pki.client_dir("bob");
    pki.revoke(&bob.join("client-cert.pem"));
    pki.write_expired_crl(&certs);
    let img = dir.path().join("e.img");
    create_sparse_image(&img, MIB);
    let srv = verifying_server(&img, &certs);
    assert!(!nbdinfo(&tls_uri(&srv, &bob)).success(), "bob was served");
    assert!(
        nbdinfo(&tls_uri(&srv, &alice)).success(),
        "alice was refused"
    );
    wait_for("a warning for an expired CRL", || {
        srv.stderr_text()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("expired on") && l.contains("ca-crl.pem"))
    });
}

#[test]
fn a_crl_without_verify_peer_is_warned_about() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    pki.write_crl(&certs);
    let img = dir.path().join("w.img");
    create_sparse_image(&img, MIB);
    let srv = Server::builder(&img)
        .tcp()
        .with_control()
        .args(["--tls", "require", "--tls-certs", path_str(&certs)])
        .start();
    wait_for("the warning that ca-crl.pem is not read", || {
        srv.stderr_text().lines().any(|l| {
            l.contains("WARN")
                && l.contains("ca-crl.pem is not read")
                && l.contains("--tls-verify-peer")
        })
    });
}

/// nbdkit (GnuTLS) serving `certs` with `--tls-verify-peer`: whether each
/// client directory of `clients` got in.
fn nbdkit_admits(certs: &Path, clients: &[&Path]) -> Vec<bool> {
    let port = free_port();
    let mut nbdkit = std::process::Command::new(require_tool("nbdkit"))
        .env("PATH", tool_path_env())
        .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string()])
        .arg("--tls=require")
        .arg(format!("--tls-certificates={}", certs.display()))
        .arg("--tls-verify-peer")
        .args(["memory", "1M"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start nbdkit");
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if start.elapsed() > Duration::from_secs(10) {
            let _ = nbdkit.kill();
            let _ = nbdkit.wait();
            panic!("nbdkit did not listen");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let admitted = clients
        .iter()
        .map(|c| {
            let uri = format!("nbds://127.0.0.1:{port}/?tls-certificates={}", c.display());
            nbdinfo(&uri).success()
        })
        .collect();
    let _ = nbdkit.kill();
    let _ = nbdkit.wait();
    admitted
}

/// The same directory under nbdkit (GnuTLS, as QEMU uses it): the revoked
/// client is refused there too and the other served — with a current CRL
/// and with an expired one (GnuTLS keeps enforcing it, silently; loopd
/// enforces it and warns).
#[test]
fn nbdkit_refuses_the_same_revoked_client() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let bob = pki.client_dir("bob");
    pki.revoke(&bob.join("client-cert.pem"));
    pki.write_crl(&certs);
    assert_eq!(
        nbdkit_admits(&certs, &[&alice, &bob]),
        [true, false],
        "nbdkit with a current CRL (alice, revoked bob)"
    );
    pki.write_expired_crl(&certs);
    assert_eq!(
        nbdkit_admits(&certs, &[&alice, &bob]),
        [true, false],
        "nbdkit with an expired CRL (alice, revoked bob)"
    );
}
