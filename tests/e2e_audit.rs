//! Audit lines in the daemon's log (stderr), one info line each: attach, set,
//! resize, detach with the control client's uid and pid; NBD clients connecting
//! (peer, export, tls) and disconnecting (duration, requests, reason).

mod common;

use common::*;

#[test]
fn control_changes_and_nbd_clients_are_audited() {
    let dir = tempdir();
    let img = dir.path().join("a.img");
    create_sparse_image(&img, 4 * MIB);
    let mut srv = Server::daemon().tcp().start();
    srv.ctl_ok(&["attach", path_str(&img), "--name", "aud"]);
    srv.ctl_ok(&["set", "aud", "--size-limit", "2M"]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .and_then(|f| f.set_len(8 * MIB))
        .expect("grow image");
    srv.ctl_ok(&["set", "aud", "--size-limit", "6M"]);
    srv.ctl_ok(&["resize", "aud"]);
    qemu_io(&srv.uri_for_name("aud"), &["read 0 64k", "write 0 4k"]);
    srv.ctl_ok(&["detach", "aud"]);
    srv.ctl_err(&["detach", "aud"], "not_found");
    srv.stop_ok();
    let log = srv.stderr_text();
    let uid = rustix::process::getuid().as_raw();
    let who = format!("by uid={uid} pid=");
    let line = |needle: &str| -> String {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{log}"))
            .to_string()
    };
    let a = line("audit: attach \"aud\"");
    assert!(
        a.contains(path_str(&img)) && a.contains(&who) && a.ends_with(": ok"),
        "{a}"
    );
    assert!(a.contains(" INFO "), "at info: {a}");
    let s = line("audit: set \"aud\" size_limit=2097152");
    assert!(s.contains("changed") && s.contains(&who), "{s}");
    let r = line("audit: resize \"aud\"");
    assert!(r.contains(&who), "{r}");
    let d = line("audit: detach \"aud\" by");
    assert!(d.ends_with(": ok"), "{d}");
    assert!(
        log.contains("audit: detach \"aud\" by") && log.contains("refused: "),
        "a refused detach is audited too:\n{log}"
    );
    let c = line("audit: NBD client unix uid=");
    assert!(c.contains("connected to \"aud\", tls no"), "{c}");
    let g = line("disconnected from \"aud\"");
    assert!(g.contains("requests") && g.contains("NBD_CMD_DISC"), "{g}");
}

#[test]
fn tcp_clients_are_audited_with_their_address() {
    let dir = tempdir();
    let img = dir.path().join("t.img");
    create_sparse_image(&img, MIB);
    let mut srv = Server::builder(&img).tcp().start();
    qemu_io(&srv.tcp_uri(), &["read 0 4k"]);
    srv.stop_ok();
    let log = srv.stderr_text();
    let c = log
        .lines()
        .find(|l| l.contains("audit: NBD client 127.0.0.1:"))
        .unwrap_or_else(|| panic!("no TCP connect line:\n{log}"));
    assert!(c.contains("tls no"), "{c}");
    assert!(
        log.lines()
            .any(|l| l.contains("audit: NBD client 127.0.0.1:") && l.contains("disconnected")),
        "{log}"
    );
}
