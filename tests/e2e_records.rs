//! The daemon's record of a device is what the administrator set, on every
//! path that brings a device back: a missing device attached again with a
//! plain `loopd attach IMAGE --name N` comes back read-only, windowed and
//! limited to its TLS identity, as recorded (real clients check the bytes, the
//! errno and who may see it), and a request that asks for something else is
//! refused saying what differs; a device removed from `--config` and put back
//! while still attached is unchanged for `loopd reload`, not a second attach.

mod common;

use common::pki::Pki;
use common::*;
use std::path::Path;

/// The last `put` record of device `name` in a state file.
fn recorded(state: &Path, name: &str) -> Json {
    let text = std::fs::read_to_string(state).expect("read the state file");
    text.lines()
        .skip(1)
        .map(Json::parse)
        .filter_map(|r| r.get("put").cloned())
        .filter(|p| p.at("name").str() == name)
        .last()
        .unwrap_or_else(|| panic!("no record of {name:?} in:\n{text}"))
}

/// `nbds+unix://` to device `name` with the client certificates in `certs`.
fn tls_uri(sock: &Path, name: &str, certs: &Path) -> String {
    format!(
        "nbds+unix:///{name}?socket={}&tls-certificates={}",
        sock.display(),
        certs.display()
    )
}

/// Whether a client holding `certs` can open device `name`.
fn can_open(sock: &Path, name: &str, certs: &Path) -> bool {
    let script = format!(
        "g = nbd.NBD()\n\
         g.set_uri_allow_local_file(True)\n\
         try:\n    g.connect_uri({u})\n    print('OPENED')\n\
         except nbd.Error as e:\n    print('REFUSED', e.string)\n",
        u = py_str(&tls_uri(sock, name, certs))
    );
    let out = nbdsh(&script);
    out.stdout.contains("OPENED")
}

/// Issue 22 point 1. A device recorded read-only, windowed and allowed to one
/// identity, whose image vanished, is brought back by a plain `loopd attach
/// IMAGE --name N` with all of that: the state file keeps the record; a write
/// fails with EPERM and changes no byte of the file (inside the window or past
/// its end); the export is the window; a client without the identity cannot
/// see it. A request asking another offset or identity is refused (name_taken)
/// naming what differs and what to do.
#[test]
fn missing_device_comes_back_with_its_record() {
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let alice = pki.client_dir("alice");
    let bob = pki.client_dir("bob");
    let img = dir.path().join("rec.img");
    create_pattern_image(&img, 8 * MIB, 3);
    let state = dir.path().join("d.state");
    let sock = dir.path().join("s.sock");
    let serve = || {
        Server::daemon()
            .socket_path(&sock)
            .arg("--state")
            .arg(&state)
            .args(["--tls", "on", "--tls-verify-peer", "--tls-certs"])
            .arg(&certs)
            .start()
    };
    let mut srv = serve();
    srv.ctl_ok(&[
        "attach",
        path_str(&img),
        "--name",
        "rec",
        "--read-only",
        "--offset",
        "1M",
        "--size-limit",
        "2M",
        "--tls-allow",
        "alice",
    ]);
    srv.stop_ok();

    // The image vanishes; the device is missing after a restart.
    let away = dir.path().join("rec.away");
    std::fs::rename(&img, &away).unwrap();
    let srv = serve();
    let d = srv.device("rec").expect("the missing device is listed");
    assert_eq!(d.at("state").str(), "missing", "{d:?}");
    // The image is back (a copy: the retry, which wants the recorded file,
    // leaves it to the administrator's attach).
    std::fs::copy(&away, &img).unwrap();
    let before = read_file(&img);

    let out = srv.ctl_err(
        &[
            "attach",
            path_str(&img),
            "--name",
            "rec",
            "--offset",
            "4096",
            "--tls-allow",
            "bob",
        ],
        "name_taken",
    );
    for want in [
        "offset 4096 asked, 1048576 recorded",
        "tls_allow [\"bob\"] asked",
        "without these options to bring it back as recorded",
        "`loopd detach \"rec\"` first",
    ] {
        assert!(out.stderr.contains(want), "{want:?} missing:\n{out}");
    }
    assert_eq!(srv.device("rec").unwrap().at("state").str(), "missing");

    srv.ctl_ok(&["attach", path_str(&img), "--name", "rec"]);
    let r = recorded(&state, "rec");
    assert!(r.at("read_only").bool(), "{r:?}");
    assert_eq!(r.at("offset").u64(), MIB, "{r:?}");
    assert_eq!(r.at("size_limit").u64(), 2 * MIB, "{r:?}");
    assert_eq!(r.at("tls_allow").arr().len(), 1, "{r:?}");
    let d = srv.device("rec").unwrap();
    assert_eq!(d.at("state").str(), "live", "{d:?}");
    assert!(d.at("read_only").bool(), "{d:?}");
    assert_eq!(
        (d.at("offset").u64(), d.at("size").u64()),
        (MIB, 2 * MIB),
        "{d:?}"
    );
    assert!(d.at("tls_allow").arr()[0].str().contains("alice"), "{d:?}");
    let st = srv.ctl_json(&["status", "rec"]);
    assert!(
        format!("{st:?}").contains("alice"),
        "status shows the allow list: {st:?}"
    );

    // Alice: the window, read-only (the server answers EPERM: libnbd's own
    // checks are off).
    let window_head = read_range(&img, MIB, 16);
    let script = format!(
        "g = nbd.NBD()\n\
         g.set_uri_allow_local_file(True)\n\
         g.set_strict_mode(0)\n\
         g.connect_uri({u})\n\
         assert g.get_size() == 2 * 1024 * 1024, g.get_size()\n\
         assert g.is_read_only(), 'not advertised read-only'\n\
         assert g.pread(16, 0).hex() == {head}, g.pread(16, 0).hex()\n\
         expect_err('write in the window', lambda: g.pwrite(b'\\xee' * 4096, 2 * 1024 * 1024 - 4096), [errno.EPERM])\n\
         expect_err('write across its end', lambda: g.pwrite(b'\\xee' * 8192, 2 * 1024 * 1024 - 4096), [errno.EPERM, errno.EINVAL, errno.ENOSPC])\n\
         g.shutdown()\n",
        u = py_str(&tls_uri(&sock, "rec", &alice)),
        head = py_str(
            &window_head
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        ),
    );
    nbdsh(&script);
    assert!(
        read_file(&img) == before,
        "a byte of the image changed (the window ends at {} bytes)",
        3 * MIB
    );
    assert!(
        !can_open(&sock, "rec", &bob),
        "bob opened a device allowed to alice only"
    );
    assert!(can_open(&sock, "rec", &alice), "alice was refused");
}

/// Issue 22 point 14. A device removed from `--config` (kept attached) and put
/// back: the reloads that follow report it unchanged, not "1 failed (a device
/// named … already exists)"; put back changed, the change is applied.
#[test]
fn device_put_back_in_config_while_attached_is_unchanged() {
    let dir = tempdir();
    for n in ["a", "s"] {
        create_sparse_image(&dir.path().join(format!("{n}.img")), 4 * MIB);
    }
    let cfg = dir.path().join("devices.toml");
    let write = |devs: &[(&str, &str)]| {
        let text: String = devs
            .iter()
            .map(|(n, extra)| {
                format!(
                    "[[device]]\nimage = \"{}\"\n{extra}\n",
                    dir.path().join(format!("{n}.img")).display()
                )
            })
            .collect();
        std::fs::write(&cfg, text).unwrap();
    };
    write(&[("a", ""), ("s", "")]);
    let srv = Server::daemon().arg("--config").arg(&cfg).start();
    let reload = || {
        let out = srv.ctl(&["reload", "--json"]);
        assert!(out.success(), "reload failed:\n{out}");
        let j = Json::parse(&out.stdout);
        assert!(j.at("failed").arr().is_empty(), "{out}");
        j
    };
    write(&[("a", "")]);
    let j = reload();
    assert_eq!(j.at("kept").arr()[0].str(), "s", "{j:?}");
    write(&[("a", ""), ("s", "")]);
    for _ in 0..2 {
        let j = reload();
        let unchanged: Vec<&str> = j.at("unchanged").arr().iter().map(Json::str).collect();
        assert_eq!(unchanged, ["a", "s"], "{j:?}");
    }
    write(&[("a", ""), ("s", "size_limit = \"1M\"")]);
    let j = reload();
    assert_eq!(j.at("changed").arr()[0].str(), "s", "{j:?}");
    assert_eq!(srv.device("s").unwrap().at("size").u64(), MIB);
    let j = reload();
    assert_eq!(j.at("unchanged").arr().len(), 2, "{j:?}");
    // Gone from the file and detached: forgotten, so putting it back attaches it.
    write(&[("a", "")]);
    reload();
    srv.ctl_ok(&["detach", "s"]);
    let j = reload();
    assert!(j.at("kept").arr().is_empty(), "{j:?}");
    write(&[("a", ""), ("s", "")]);
    let j = reload();
    assert_eq!(j.at("attached").arr()[0].str(), "s", "{j:?}");
}
