//! TLS as remote users meet it: libnbd's tools with `nbds://` URIs and
//! `tls-certificates=`, qemu-img and qemu-io with `tls-creds-x509`, against
//! `loopd serve --tls on|require`, with client certificates
//! (`--tls-verify-peer`), per-device identities (`--tls-allow`) and
//! certificate renewal without a restart. The PKI is made by each test
//! (tests/common/pki.rs); nothing is committed.

mod common;

use common::pki::{Leaf, Pki};
use common::*;
use std::path::Path;
use std::time::Duration;

const SIZE: u64 = 64 * MIB;

/// `nbds://127.0.0.1:PORT/NAME?tls-certificates=DIR`
fn tls_uri(srv: &Server, name: &str, certs: &Path) -> String {
    format!(
        "nbds://127.0.0.1:{}/{name}?tls-certificates={}",
        srv.port(),
        certs.display()
    )
}

/// A server for `img` with `--tls MODE --tls-certs DIR` and `extra` args, on
/// its Unix socket and TCP, with its control socket.
fn tls_server(img: &Path, mode: &str, certs: &Path, extra: &[&str]) -> Server {
    let mut args = vec!["--tls", mode, "--tls-certs", path_str(certs)];
    args.extend_from_slice(extra);
    Server::builder(img).tcp().with_control().args(args).start()
}

fn nbdinfo(uri: &str) -> Out {
    run_status_timeout(Duration::from_secs(60), "nbdinfo", [uri])
}

/// `qemu-io` over TLS with client credentials in `creds` (a directory with
/// `ca-cert.pem`, and `client-cert.pem`/`client-key.pem` if it has them).
fn qemu_io_tls(srv: &Server, name: &str, creds: &Path, cmds: &[&str]) -> Out {
    let mut args: Vec<String> = vec![
        "--object".into(),
        format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=client",
            creds.display()
        ),
        "--image-opts".into(),
        format!(
            "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},export={name},tls-creds=tls0",
            srv.port()
        ),
    ];
    for c in cmds {
        args.push("-c".into());
        args.push((*c).into());
    }
    run_status_timeout(Duration::from_secs(120), "qemu-io", &args)
}

#[track_caller]
fn assert_qemu_ok(out: &Out) {
    let all = format!("{}\n{}", out.stdout, out.stderr);
    assert!(
        out.success() && !all.contains("Pattern verification failed") && !all.contains("failed"),
        "qemu-io over TLS failed:\n{out}"
    );
}

/// Issue 13: `nbdinfo nbds://` works (it failed with "connection is closed"),
/// and nbdcopy moves 48 MiB each way through the userspace record layer with
/// every byte intact, in direct and buffered mode, over TCP and the Unix socket.
#[test]
fn libnbd_tools_read_and_write_over_tls() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let trust = pki.trust_dir("trust");
    for cache in ["direct", "buffered"] {
        let img = dir.path().join(format!("{cache}.img"));
        create_sparse_image(&img, SIZE);
        let srv = tls_server(&img, "require", &certs, &["--cache", cache]);
        let uri = tls_uri(&srv, srv.name(), &trust);

        let info = nbdinfo(&uri);
        assert!(info.success(), "nbdinfo over TLS ({cache}):\n{info}");
        assert!(
            info.stdout.contains("with TLS"),
            "nbdinfo did not negotiate TLS ({cache}):\n{info}"
        );

        let src = dir.path().join(format!("{cache}.src"));
        create_pattern_image(&src, 48 * MIB, 7);
        run_status_timeout(
            Duration::from_secs(120),
            "nbdcopy",
            [path_str(&src), uri.as_str()],
        )
        .assert_success();
        assert_file_pattern(&img, 0, 48 * MIB, 7, "image after nbdcopy over TLS");

        let back = dir.path().join(format!("{cache}.back"));
        run_status_timeout(
            Duration::from_secs(120),
            "nbdcopy",
            [uri.as_str(), path_str(&back)],
        )
        .assert_success();
        assert_file_pattern(&back, 0, 48 * MIB, 7, "nbdcopy back over TLS");
        assert_file_filled(&back, 48 * MIB, SIZE - 48 * MIB, 0, "unwritten tail");

        // The Unix socket requires TLS as well.
        let unix = format!(
            "nbds+unix:///{}?socket={}&tls-certificates={}",
            srv.name(),
            srv.socket().display(),
            trust.display()
        );
        let script = format!(
            "g = nbd.NBD()\n\
             g.set_uri_allow_local_file(True)\n\
             g.connect_uri({u})\n\
             assert g.get_tls_negotiated(), 'TLS not negotiated'\n\
             g.pwrite(b'\\xa5' * 3000, 12345)\n\
             assert g.pread(3000, 12345) == b'\\xa5' * 3000\n\
             g.flush()\n\
             g.shutdown()\n",
            u = py_str(&unix)
        );
        nbdsh(&script);
        assert_file_filled(
            &img,
            12345,
            3000,
            0xa5,
            "nbdsh write over TLS on the Unix socket",
        );
    }
}

const NBD_REP_ERR_TLS_REQD: u32 = (1 << 31) | 5;

/// One option reply: (option, reply type, data as text).
fn read_option_reply(c: &mut RawClient) -> (u32, u32, String) {
    let magic = c.read_u64();
    assert_eq!(magic, 0x0003_e889_0455_65a9, "option reply magic");
    let opt = c.read_u32();
    let kind = c.read_u32();
    let len = c.read_u32();
    let data = c.read_exact(len as usize);
    (opt, kind, String::from_utf8_lossy(&data).into_owned())
}

/// Issue 13: with `--tls require` a plaintext client is refused (over TCP and
/// the Unix socket), and nothing it asks is answered; with `--tls on` both kinds
/// of client are served.
#[test]
fn require_refuses_plaintext_and_on_serves_both() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let trust = pki.trust_dir("trust");
    let img = dir.path().join("d.img");
    create_pattern_image(&img, SIZE, 3);

    let srv = tls_server(&img, "require", &certs, &[]);
    let plain = nbdinfo(&srv.tcp_uri());
    assert!(!plain.success(), "plaintext nbdinfo got in:\n{plain}");
    // What a plaintext client is told: NBD_REP_ERR_TLS_REQD for GO, INFO,
    // LIST and STRUCTURED_REPLY alike, with a message saying so; ABORT is
    // acknowledged.
    let mut raw = RawClient::connect(srv.socket());
    raw.greeting();
    raw.send(&3u32.to_be_bytes());
    let mut go = Vec::new();
    go.extend_from_slice(&u32::try_from(srv.name().len()).unwrap().to_be_bytes());
    go.extend_from_slice(srv.name().as_bytes());
    go.extend_from_slice(&0u16.to_be_bytes());
    for (opt, data) in [
        (7u32, go.as_slice()),
        (6, go.as_slice()),
        (3, &[][..]),
        (8, &[][..]),
    ] {
        raw.send_option(opt, data);
        let (o, kind, msg) = read_option_reply(&mut raw);
        assert_eq!(o, opt, "reply to option {opt}");
        assert_eq!(
            kind, NBD_REP_ERR_TLS_REQD,
            "option {opt}: reply type {kind:#x} ({msg})"
        );
        assert!(msg.contains("TLS"), "option {opt}: message {msg:?}");
    }
    raw.send_option(2, &[]);
    let (_, kind, _) = read_option_reply(&mut raw);
    assert_eq!(kind, 1, "ABORT is acknowledged");
    let plain_unix = nbdinfo(&srv.uri_for_name(srv.name()));
    assert!(
        !plain_unix.success(),
        "plaintext Unix client got in:\n{plain_unix}"
    );
    let listed = run_status_timeout(
        Duration::from_secs(60),
        "nbdinfo",
        ["--list", srv.tcp_uri().as_str()],
    );
    assert!(
        !listed.stdout.contains(srv.name()),
        "a plaintext client listed the exports:\n{listed}"
    );
    drop(srv);

    let srv = tls_server(&img, "on", &certs, &[]);
    let plain = nbdinfo(&srv.tcp_uri());
    assert!(
        plain.success(),
        "--tls on refused a plaintext client:\n{plain}"
    );
    assert!(plain.stdout.contains("without TLS"), "{plain}");
    let tls = nbdinfo(&tls_uri(&srv, srv.name(), &trust));
    assert!(tls.success(), "--tls on refused a TLS client:\n{tls}");
    assert!(tls.stdout.contains("with TLS"), "{tls}");
}

/// Issue 13: qemu-img and qemu-io with `--object tls-creds-x509` read and
/// write through loopd's TLS, in both cache modes, and qemu 10 negotiates
/// extended headers after STARTTLS (everything before it is forgotten).
#[test]
fn qemu_with_tls_creds_x509() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let client = pki.client_dir("qemu");
    for cache in ["direct", "buffered"] {
        let img = dir.path().join(format!("q-{cache}.img"));
        create_sparse_image(&img, SIZE);
        let srv = Server::builder(&img)
            .tcp()
            .with_control()
            .env("LOOPD_LOG", "debug")
            .args([
                "--tls",
                "require",
                "--tls-certs",
                path_str(&certs),
                "--cache",
                cache,
            ])
            .start();
        let out = qemu_io_tls(
            &srv,
            srv.name(),
            &client,
            &[
                "write -P 0x5c 1M 3M",
                "write -P 0x11 7 4099",
                "read -P 0x5c 1M 3M",
                "read -P 0x11 7 4099",
                "flush",
            ],
        );
        assert_qemu_ok(&out);
        assert_file_filled(&img, MIB, 3 * MIB, 0x5c, "qemu-io write over TLS");
        assert_file_filled(&img, 7, 4099, 0x11, "unaligned qemu-io write over TLS");
        let log = srv.stderr_text();
        assert!(
            log.contains("Extended replies"),
            "qemu did not get extended headers over TLS:\n{log}"
        );

        let info = run_status_timeout(
            Duration::from_secs(60),
            "qemu-img",
            [
                "info",
                "--output=json",
                "--object",
                &format!(
                    "tls-creds-x509,id=tls0,dir={},endpoint=client",
                    client.display()
                ),
                "--image-opts",
                &format!(
                    "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},export={},tls-creds=tls0",
                    srv.port(),
                    srv.name()
                ),
            ],
        );
        assert!(info.success(), "qemu-img info over TLS:\n{info}");
        assert_eq!(
            Json::parse(&info.stdout).at("virtual-size").u64(),
            SIZE,
            "{info}"
        );
    }
}

/// Issue 13: `--tls-verify-peer` admits a client certificate of the CA and
/// refuses a client without one and a client whose certificate another CA
/// signed.
#[test]
fn verify_peer_requires_a_certificate_of_the_ca() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let other = Pki::new(dir.path().join("other"));
    let certs = pki.server_dir("server");
    let good = pki.client_dir("alice");
    let none = pki.trust_dir("trust");
    // Trusts the server's CA, but its own certificate is the other CA's.
    let foreign = other.client_dir("mallory");
    pki.install_ca(&foreign);
    let img = dir.path().join("v.img");
    create_pattern_image(&img, SIZE, 9);
    let mut srv = tls_server(&img, "require", &certs, &["--tls-verify-peer"]);

    let ok = nbdinfo(&tls_uri(&srv, srv.name(), &good));
    assert!(ok.success(), "a client of the CA was refused:\n{ok}");
    let no_cert = nbdinfo(&tls_uri(&srv, srv.name(), &none));
    assert!(
        !no_cert.success(),
        "a client without a certificate got in:\n{no_cert}"
    );
    let bad = nbdinfo(&tls_uri(&srv, srv.name(), &foreign));
    assert!(!bad.success(), "a certificate of another CA got in:\n{bad}");
    let q = qemu_io_tls(&srv, srv.name(), &foreign, &["read 0 4k"]);
    assert!(
        !q.success(),
        "qemu-io with another CA's certificate got in:\n{q}"
    );
    srv.assert_running();
}

/// Issue 13: a device limited to some identities is invisible to every other
/// client: not listed, and opening it is "no such export", while the same
/// client uses an unrestricted device.
#[test]
fn tls_allow_hides_a_device_from_other_identities() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let bob = pki.client_dir("bob");
    let img = dir.path().join("open.img");
    let secret = dir.path().join("secret.img");
    create_pattern_image(&img, SIZE, 1);
    create_pattern_image(&secret, SIZE, 2);
    let srv = tls_server(&img, "require", &certs, &["--tls-verify-peer"]);
    srv.ctl_ok(&[
        "attach",
        path_str(&secret),
        "--name",
        "secret",
        "--tls-allow",
        "alice",
    ]);

    let a = nbdinfo(&tls_uri(&srv, "secret", &alice));
    assert!(a.success(), "alice was refused her device:\n{a}");
    let b = nbdinfo(&tls_uri(&srv, "secret", &bob));
    assert!(!b.success(), "bob opened alice's device:\n{b}");
    assert!(
        !b.stderr.contains("secret.img"),
        "the refusal names the image:\n{b}"
    );
    let b_open = nbdinfo(&tls_uri(&srv, srv.name(), &bob));
    assert!(
        b_open.success(),
        "bob was refused the open device:\n{b_open}"
    );

    let list = |who: &Path| {
        let uri = format!(
            "nbds://127.0.0.1:{}?tls-certificates={}",
            srv.port(),
            who.display()
        );
        run_status_timeout(
            Duration::from_secs(60),
            "nbdinfo",
            ["--list", "--json", uri.as_str()],
        )
    };
    let lb = list(&bob);
    assert!(lb.success(), "{lb}");
    assert!(
        !lb.stdout.contains("\"secret\""),
        "bob's list shows alice's device:\n{lb}"
    );
    assert!(lb.stdout.contains(&format!("\"{}\"", srv.name())), "{lb}");
    let la = list(&alice);
    assert!(
        la.stdout.contains("\"secret\""),
        "alice's list lacks her device:\n{la}"
    );
}

/// Issue 13: a renewed server certificate is used by new connections after
/// `loopd reload-tls` or SIGHUP, without a restart; a broken one is refused and
/// the old one stays in use.
#[test]
fn renewed_certificate_is_picked_up_on_reload_and_sighup() {
    let dir = tempdir();
    let old_ca = Pki::new(dir.path().join("old"));
    let new_ca = Pki::new(dir.path().join("new"));
    let certs = old_ca.server_dir("server");
    let trusts_old = old_ca.trust_dir("trust-old");
    let trusts_new = new_ca.trust_dir("trust-new");
    let img = dir.path().join("r.img");
    create_pattern_image(&img, SIZE, 4);
    let mut srv = tls_server(&img, "require", &certs, &[]);
    let works = |srv: &Server, trust: &Path| nbdinfo(&tls_uri(srv, srv.name(), trust)).success();
    assert!(works(&srv, &trusts_old));
    assert!(!works(&srv, &trusts_new));

    // Renewed by another CA: nothing changes until the reload.
    new_ca.renew_server(&certs);
    assert!(works(&srv, &trusts_old), "changed before the reload");
    srv.ctl_ok(&["reload-tls"]);
    assert!(
        works(&srv, &trusts_new),
        "the renewed certificate is not served"
    );
    assert!(
        !works(&srv, &trusts_old),
        "the old certificate is still served"
    );

    // SIGHUP does the same.
    old_ca.renew_server(&certs);
    srv.signal(libc::SIGHUP);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !works(&srv, &trusts_old) {
        assert!(
            std::time::Instant::now() < deadline,
            "SIGHUP did not reload"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    srv.assert_running();

    // A broken key: the reload fails, says why, and the old pair stays.
    std::fs::write(certs.join("server-key.pem"), b"not a key\n").unwrap();
    let out = srv.ctl_err(&["reload-tls"], "io");
    assert!(out.stderr.contains("server-key.pem"), "{out}");
    assert!(works(&srv, &trusts_old), "a failed reload broke TLS");
    srv.assert_running();
}

/// Issue 13: a bad certificate directory stops the server before it binds
/// anything, naming the file; `--tls require` without a directory is an error.
#[test]
fn bad_certificates_stop_the_server_at_start() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    std::fs::remove_file(certs.join("server-key.pem")).unwrap();
    let img = dir.path().join("b.img");
    create_sparse_image(&img, MIB);
    let sock = dir.path().join("b.sock");
    let out = loopd_run([
        "serve",
        path_str(&img),
        "--socket",
        path_str(&sock),
        "--tls",
        "require",
        "--tls-certs",
        path_str(&certs),
    ]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("server-key.pem"), "{out}");
    assert!(!sock.exists(), "a socket was left behind");

    let out = loopd_run([
        "serve",
        path_str(&img),
        "--socket",
        path_str(&sock),
        "--tls",
        "on",
    ]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("--tls-certs"), "{out}");
    assert!(!sock.exists(), "a socket was left behind");
}

/// The other side of [`Leaf`]: a client certificate with SANs is matched by
/// them in `--tls-allow`.
#[test]
fn tls_allow_matches_subject_alt_names() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let mut leaf = Leaf::client("worker-17");
    leaf.sans = vec![
        "DNS:worker17.example".into(),
        "email:ops@example.com".into(),
    ];
    let worker = pki.client_dir_with("worker", &leaf);
    let img = dir.path().join("w.img");
    create_pattern_image(&img, SIZE, 5);
    let srv = tls_server(&img, "require", &certs, &["--tls-verify-peer"]);
    for (name, id) in [
        ("by-dns", "dns:worker17.example"),
        ("by-mail", "email:ops@example.com"),
    ] {
        let f = dir.path().join(format!("{name}.img"));
        create_sparse_image(&f, MIB);
        srv.ctl_ok(&["attach", path_str(&f), "--name", name, "--tls-allow", id]);
        let r = nbdinfo(&tls_uri(&srv, name, &worker));
        assert!(r.success(), "{id} did not match:\n{r}");
    }
    let f = dir.path().join("other.img");
    create_sparse_image(&f, MIB);
    srv.ctl_ok(&[
        "attach",
        path_str(&f),
        "--name",
        "other",
        "--tls-allow",
        "dns:other.example",
    ]);
    let r = nbdinfo(&tls_uri(&srv, "other", &worker));
    assert!(
        !r.success(),
        "an identity the certificate lacks matched:\n{r}"
    );
}

/// A device limited to identities on a server that asks for no client
/// certificate can never be opened: attach says so in the log, and a TLS
/// client without a certificate does not see it.
#[test]
fn tls_allow_without_verify_peer_is_warned_about() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let trust = pki.trust_dir("trust");
    let img = dir.path().join("n.img");
    create_sparse_image(&img, MIB);
    let srv = tls_server(&img, "on", &certs, &[]);
    let f = dir.path().join("locked.img");
    create_sparse_image(&f, MIB);
    srv.ctl_ok(&[
        "attach",
        path_str(&f),
        "--name",
        "locked",
        "--tls-allow",
        "alice",
    ]);
    let st = srv.ctl_json(&["status", "locked"]);
    assert_eq!(
        st.at("tls_allow").arr()[0].str(),
        "alice",
        "status shows the allow list"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !srv.stderr_text().contains("no NBD client can open it") {
        assert!(
            std::time::Instant::now() < deadline,
            "no warning:\n{}",
            srv.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = nbdinfo(&tls_uri(&srv, "locked", &trust));
    assert!(!r.success(), "a client without identities opened it:\n{r}");
}
