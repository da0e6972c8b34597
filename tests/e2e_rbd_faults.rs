//! Faults of loopd's RBD backend on a throwaway Ceph cluster
//! (`common::ceph`): `kill -9` under writes and the restart that takes the
//! exclusive lock back from its dead self, the monitor down at attach and at
//! restart, an unreachable cluster beside a reachable one, the image removed
//! (fenced) under a device, a second daemon on the state file of one that is
//! still stopping. Every byte check is against `rbd export`.
//!
//! The cluster is shared by the tests of this binary: the tests that stop
//! the monitor (or the OSD) take [`outage`], the others [`cluster_ok`], so no
//! test's attach meets another test's outage. Each test uses images of its
//! own and removes them.

mod common;

use common::CephImage as Image;
use common::*;
use std::path::{Path, PathBuf};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Held (read) by tests that need the cluster whole, (write) by those that
/// stop a part of it.
static CLUSTER: RwLock<()> = RwLock::new(());

fn cluster_ok() -> RwLockReadGuard<'static, ()> {
    CLUSTER.read().unwrap_or_else(|e| e.into_inner())
}

fn outage() -> RwLockWriteGuard<'static, ()> {
    CLUSTER.write().unwrap_or_else(|e| e.into_inner())
}

/// `loopd attach SPEC --ceph-conf CONF --ceph-id admin EXTRA…`.
fn attach_with(srv: &Server, spec: &str, conf: &Path, extra: &[&str]) -> Out {
    let mut a = vec![
        "attach",
        spec,
        "--ceph-conf",
        path_str(conf),
        "--ceph-id",
        ceph().id,
    ];
    a.extend_from_slice(extra);
    srv.ctl(&a)
}

/// `loopd attach` of an image of the test cluster.
fn attach(srv: &Server, spec: &str, extra: &[&str]) -> Out {
    attach_with(srv, spec, &ceph().conf, extra)
}

/// A daemon whose control socket (and so state file, `SOCKET.state`) is at
/// `sock`: started again on the same path, it restores the same devices.
fn daemon_at(sock: &Path) -> Server {
    Server::daemon().socket_path(sock).start()
}

/// `kill -9` of loopd while a client writes (every write flushed, with
/// librbd's cache off): the daemon restarted over the same state file takes
/// the exclusive lock back from its dead self at once — not after Ceph's
/// ~30 s watch timeout — and every acknowledged write is in the image.
#[test]
fn kill9_under_writes_then_restart_takes_the_lock_back_at_once() {
    let _c = cluster_ok();
    const REGION: u64 = 16 * 1024;
    const ROUNDS: u64 = 400;
    let img = Image::new("k9", ROUNDS * REGION);
    let dir = tempdir();
    let sock = dir.path().join("ctl.sock");
    let mut srv = daemon_at(&sock);
    attach(&srv, &img.spec(), &["--name", "r", "--cache", "direct"]).assert_success();
    let uri = srv.uri_for_name("r");
    let Killed { acked, at: killed } = kill9_under_writes(&mut srv, &uri, ROUNDS, REGION);
    let srv = daemon_at(&sock);
    let took = killed.elapsed() + wait_serving(&uri, Duration::from_secs(15));
    eprintln!(
        "kill -9 → restarted daemon serving the RBD device again: {:.2} s ({} rounds acknowledged)",
        took.as_secs_f64(),
        acked.len()
    );
    assert!(
        took < Duration::from_secs(15),
        "the restarted daemon serves within 15 s of the kill (took {took:?})"
    );
    let log = srv.stderr_text();
    assert!(
        log.contains("previous run") && log.contains("took it back"),
        "the log says the lock was taken back:\n{log}"
    );
    // It writes, too (it holds the lock), and the state record names the
    // new owner: a second kill -9 is taken back as well.
    qemu_io(&uri, &["write -P 0xee 0 512", "flush"]);
    let state = std::fs::read_to_string(sock.with_extension("state")).expect("the state file");
    assert!(state.contains("rbd_lock_owner"), "{state}");
    let mut srv = srv;
    srv.kill9();
    let again = Instant::now();
    let srv = daemon_at(&sock);
    let took2 = again.elapsed() + wait_serving(&uri, Duration::from_secs(15));
    eprintln!(
        "second kill -9 → serving again: {:.2} s",
        took2.as_secs_f64()
    );
    srv.ctl_ok(&["detach", "r"]);
    let got = img.export();
    assert_eq!(
        &got[..512],
        &[0xee; 512][..],
        "the restarted daemon's write"
    );
    assert_acked_rounds(&got, &acked, REGION, 512);
}

/// Our restarted daemon never breaks a lock someone else holds: after a clean
/// stop, another daemon takes the image; ours, restarted over its state file
/// (which records its own old owner), lists the device missing naming the
/// holder, and the other keeps writing (it was not blocklisted).
#[test]
fn a_lock_held_by_another_live_daemon_is_not_taken_after_a_restart() {
    let _c = cluster_ok();
    let img = Image::new("other", 4 * MIB);
    let dir = tempdir();
    let sock = dir.path().join("ctl.sock");
    let mut ours = daemon_at(&sock);
    attach(&ours, &img.spec(), &["--name", "r"]).assert_success();
    qemu_io(&ours.uri_for_name("r"), &["write -P 0x11 0 4096"]);
    // Our client's address (its watch outlives the stop until Ceph's timeout).
    let ours_addr = watchers(&img.name);
    assert_eq!(ours_addr.len(), 1, "{ours_addr:?}");
    ours.stop_ok();
    let other = Server::daemon().start();
    attach(&other, &img.spec(), &["--name", "theirs"]).assert_success();
    let theirs = other.uri_for_name("theirs");
    qemu_io(&theirs, &["write -P 0x22 4096 4096"]);
    // A request naming the holder as "our previous owner" is not believed:
    // only the daemon's own record is (else any client could have a lock
    // broken).
    let holder: Vec<String> = watchers(&img.name)
        .into_iter()
        .filter(|a| !ours_addr.contains(a))
        .collect();
    assert_eq!(holder.len(), 1, "{holder:?}");
    let third = Server::daemon().start();
    let req = format!(
        r#"{{"v":1,"op":"attach","image":"{}","name":"forged","ceph_conf":"{}","ceph_id":"admin","rbd_lock_owner":"{}"}}"#,
        img.spec(),
        path_str(&ceph().conf),
        holder[0]
    );
    let msg = ControlConn::connect(third.control()).err(&req, "busy");
    assert!(
        msg.contains(&format!("exclusive lock is held by {}", holder[0])),
        "refused, naming the very owner the request gave: {msg}"
    );
    drop(third);
    qemu_io(&theirs, &["write -P 0x22 4096 4096", "flush"]);
    let ours = daemon_at(&sock);
    let dev = ours.device("r").expect("the recorded device is listed");
    assert_eq!(dev.at("state").str(), "missing", "{dev:?}");
    let reason = dev.at("reason").str().to_owned();
    assert!(
        reason.contains("exclusive lock is held by 127.0.0.1:"),
        "the reason names the holder: {reason}"
    );
    assert!(
        !ours.stderr_text().contains("took it back"),
        "{}",
        ours.stderr_text()
    );
    // The holder was not fenced: it still writes, and flushes.
    qemu_io(
        &theirs,
        &["write -P 0x33 8192 4096", "flush", "read -P 0x11 0 4096"],
    );
    // And a retry of ours (every 2 s) keeps refusing.
    std::thread::sleep(Duration::from_millis(2500));
    let dev = ours.device("r").expect("still listed");
    assert_eq!(dev.at("state").str(), "missing", "{dev:?}");
    qemu_io(&theirs, &["write -P 0x44 12288 4096", "flush"]);
    other.ctl_ok(&["detach", "theirs"]);
    let got = img.export();
    for (off, b) in [(0, 0x11u8), (4096, 0x22), (8192, 0x33), (12288, 0x44)] {
        assert_bytes_eq(
            &got[off..off + 4096],
            &[b; 4096],
            off as u64,
            "the holder's writes",
        );
    }
    // Once the holder is gone, ours comes back by itself (the retrier).
    wait_serving(&ours.uri_for_name("r"), Duration::from_secs(15));
}

/// With the monitor down, an attach fails after about --ceph-timeout with
/// exit status 8 (unavailable) and says what is wrong.
#[test]
fn attach_with_the_monitor_down_fails_after_the_timeout() {
    let img = Image::new("nomon", 4 * MIB);
    let srv = Server::daemon().start();
    let _o = outage();
    let _mon = ceph().stop_mon();
    let t = Instant::now();
    let out = attach(&srv, &img.spec(), &["--name", "x", "--ceph-timeout", "3"]);
    let took = t.elapsed();
    eprintln!(
        "attach with the monitor down failed after {:.2} s",
        took.as_secs_f64()
    );
    assert_ctl_error(&out, "unavailable");
    assert_eq!(out.status.code(), Some(8), "{out}");
    assert!(
        out.stderr.contains("cannot connect to the Ceph cluster")
            && out.stderr.contains("monitors up and reachable"),
        "{out}"
    );
    assert!(
        took >= Duration::from_millis(2500) && took < Duration::from_secs(12),
        "about the 3 s timeout: {took:?}"
    );
    assert!(srv.list_json().is_empty());
}

/// A daemon restarted (over its state file) while the monitor is down lists
/// its RBD device missing with the reason, serves its file device meanwhile,
/// and brings the RBD device back, with its bytes, once the monitor returns.
#[test]
fn restart_with_the_monitor_down_then_the_device_comes_back() {
    let img = Image::new("monback", 4 * MIB);
    let dir = tempdir();
    let file = dir.path().join("f.img");
    create_pattern_image(&file, 4 * MIB, 9);
    let sock = dir.path().join("ctl.sock");
    let _o = outage();
    let mut srv = daemon_at(&sock);
    attach(&srv, &img.spec(), &["--name", "r", "--ceph-timeout", "3"]).assert_success();
    srv.ctl_ok(&["attach", path_str(&file), "--name", "f"]);
    qemu_io(&srv.uri_for_name("r"), &["write -P 0x5c 0 65536", "flush"]);
    srv.stop_ok();
    let mon = ceph().stop_mon();
    let started = Instant::now();
    let srv = daemon_at(&sock);
    eprintln!(
        "daemon started with the monitor down in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let dev = srv.device("r").expect("the RBD device is listed");
    assert_eq!(dev.at("state").str(), "missing", "{dev:?}");
    let reason = dev.at("reason").str().to_owned();
    assert!(
        reason.contains("cannot connect to the Ceph cluster"),
        "{reason}"
    );
    // The file device serves meanwhile.
    let f = Instant::now();
    qemu_io(
        &srv.uri_for_name("f"),
        &["write -P 0x7 0 4096", "read -P 0x7 0 4096"],
    );
    assert!(
        f.elapsed() < Duration::from_secs(2),
        "the file device answered in {:?}",
        f.elapsed()
    );
    drop(mon);
    let back = wait_serving(&srv.uri_for_name("r"), Duration::from_secs(30));
    eprintln!(
        "the RBD device is back {:.2} s after the monitor answered",
        back.as_secs_f64()
    );
    qemu_io(&srv.uri_for_name("r"), &["read -P 0x5c 0 65536"]);
    assert_eq!(srv.device("r").unwrap().at("state").str(), "live");
    srv.ctl_ok(&["detach", "r"]);
    assert_bytes_eq(
        &img.export()[..65536],
        &[0x5c; 65536],
        0,
        "the image after the outage",
    );
}

/// A Ceph configuration naming a monitor nobody listens on (a closed port of
/// 127.0.0.1), with the test cluster's keyring.
fn unreachable_conf(dir: &Path) -> PathBuf {
    let port = free_port();
    let conf = dir.join("unreachable.conf");
    let keyring = ceph().dir.join("keyring");
    std::fs::write(
        &conf,
        format!(
            "[global]\nmon_host = v2:127.0.0.1:{port}\nms_bind_msgr1 = false\nkeyring = {}\n",
            keyring.display()
        ),
    )
    .expect("write the configuration");
    conf
}

/// An attach hanging on an unreachable cluster does not hold up an attach to
/// a reachable one (one connect per cluster at a time, clusters in parallel).
#[test]
fn an_unreachable_cluster_does_not_hold_up_an_attach_to_another() {
    let _c = cluster_ok();
    let img = Image::new("par", 4 * MIB);
    let dir = tempdir();
    let bad = unreachable_conf(dir.path());
    let srv = Server::daemon().start();
    let hanging = {
        let ctl = srv.control().to_path_buf();
        let bad = bad.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let out = loopd_ctl(
                &ctl,
                &[
                    "attach",
                    "rbd:rbd/nowhere",
                    "--name",
                    "nowhere",
                    "--ceph-conf",
                    path_str(&bad),
                    "--ceph-id",
                    "admin",
                    "--ceph-timeout",
                    "8",
                ],
            );
            (out, t.elapsed())
        })
    };
    // Let the hanging attach start connecting.
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    attach(&srv, &img.spec(), &["--name", "ok"]).assert_success();
    let took = t.elapsed();
    eprintln!(
        "attach to the reachable cluster while another connects: {:.2} s",
        took.as_secs_f64()
    );
    qemu_io(
        &srv.uri_for_name("ok"),
        &["write -P 0x3 0 4096", "read -P 0x3 0 4096"],
    );
    let (out, hung) = hanging.join().expect("the hanging attach");
    assert_ctl_error(&out, "unavailable");
    assert!(
        hung >= Duration::from_secs(7),
        "the unreachable one timed out: {hung:?}"
    );
    assert!(
        took < Duration::from_secs(4),
        "the reachable cluster's attach did not wait for the unreachable one (took {took:?})"
    );
    srv.ctl_ok(&["detach", "ok"]);
}

/// `ceph ARGS…` on the test cluster.
fn ceph_cli(args: &[&str]) -> Out {
    let conf = ceph().conf.to_str().expect("utf-8 conf").to_owned();
    let mut a = vec!["-c", conf.as_str(), "--id", ceph().id];
    a.extend_from_slice(args);
    run_status_timeout(Duration::from_secs(60), "ceph", &a)
}

/// Removes the blocklist entries it was given when dropped.
struct Blocklisted(Vec<String>);

impl Drop for Blocklisted {
    fn drop(&mut self) {
        for a in &self.0 {
            let _ = ceph_cli(&["osd", "blocklist", "rm", a]);
        }
    }
}

/// The image removed under a device: `rbd rm` is refused while loopd
/// watches it; once loopd's client is fenced (blocklisted) the removal goes
/// through, the device's requests fail with an error (bounded, no hang), the
/// daemon and its file device go on, and the fenced device detaches.
#[test]
fn the_image_removed_under_a_device_after_fencing() {
    let _c = cluster_ok();
    let img = Image::new("rm", 4 * MIB);
    let dir = tempdir();
    let file = dir.path().join("f.img");
    create_pattern_image(&file, 4 * MIB, 4);
    let mut srv = Server::daemon().start();
    attach(
        &srv,
        &img.spec(),
        &["--name", "gone", "--ceph-timeout", "3"],
    )
    .assert_success();
    srv.ctl_ok(&["attach", path_str(&file), "--name", "f"]);
    let uri = srv.uri_for_name("gone");
    qemu_io(&uri, &["write -P 0x6d 0 65536", "flush"]);
    // Refused while loopd watches the image.
    let out = ceph().rbd(&["rm", "--no-progress", &ceph().image_spec(&img.name)]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "rbd rm of a watched image must fail:\n{err}"
    );
    assert!(err.contains("image still has watchers"), "{err}");
    qemu_io(&uri, &["read -P 0x6d 0 65536"]);
    assert_bytes_eq(
        &img.export()[..65536],
        &[0x6d; 65536],
        0,
        "before the removal",
    );
    // Fence loopd's client, then the removal goes through.
    let addrs = watchers(&img.name);
    assert_eq!(addrs.len(), 1, "loopd is the one watcher: {addrs:?}");
    let _fenced = Blocklisted(addrs.clone());
    let out = ceph_cli(&["osd", "blocklist", "add", &addrs[0]]);
    assert!(out.success(), "{out}");
    let t = Instant::now();
    loop {
        let out = ceph().rbd(&["rm", "--no-progress", &ceph().image_spec(&img.name)]);
        if out.status.success() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "rbd rm after fencing: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "rbd rm went through {:.2} s after fencing",
        t.elapsed().as_secs_f64()
    );
    // The device's requests fail, bounded.
    for cmds in [&["read 0 4096"][..], &["write -P 1 0 4096", "flush"][..]] {
        let t = Instant::now();
        let out = qemu_io_status(&uri, cmds);
        let took = t.elapsed();
        let all = format!("{}{}", out.stdout, out.stderr);
        assert!(
            !out.success() || all.contains("failed"),
            "{cmds:?} on the removed image must fail:\n{out}"
        );
        assert!(
            took < Duration::from_secs(20),
            "{cmds:?} failed in {took:?}"
        );
        eprintln!(
            "{cmds:?} on the fenced device failed in {:.2} s",
            took.as_secs_f64()
        );
    }
    srv.assert_running();
    let f = Instant::now();
    qemu_io(
        &srv.uri_for_name("f"),
        &["write -P 0x2 0 4096", "read -P 0x2 0 4096"],
    );
    assert!(
        f.elapsed() < Duration::from_secs(2),
        "the file device: {:?}",
        f.elapsed()
    );
    // The fenced connection (still held by the fenced device) is not reused:
    // another image of the same cluster, same options, attaches and serves in
    // the same daemon.
    let next = Image::new("rm-next", 4 * MIB);
    attach(
        &srv,
        &next.spec(),
        &["--name", "next", "--ceph-timeout", "3"],
    )
    .assert_success();
    qemu_io(
        &srv.uri_for_name("next"),
        &["write -P 0x4e 0 4096", "flush"],
    );
    srv.ctl_ok(&["detach", "next"]);
    assert_bytes_eq(&next.export()[..4096], &[0x4e; 4096], 0, "the next image");
    let t = Instant::now();
    srv.ctl_ok(&["detach", "gone"]);
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "detach took {:?}",
        t.elapsed()
    );
    srv.assert_running();
    let log = srv.stderr_text();
    assert!(
        log.contains(&format!(
            "{}: the Ceph cluster has fenced this client",
            img.spec()
        )),
        "the log says what happened:\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
}

/// A second throwaway cluster (its own directory, stopped by the guard).
struct SecondCluster {
    dir: tempfile::TempDir,
}

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ceph-cluster.sh");

impl SecondCluster {
    fn start() -> SecondCluster {
        let dir = tempdir();
        let pid = std::process::id().to_string();
        let t = Instant::now();
        let out = run_status_timeout(
            Duration::from_secs(150),
            SCRIPT,
            ["start", path_str(dir.path()), "--owner", pid.as_str()],
        );
        assert!(out.success(), "a second cluster: {out}");
        eprintln!(
            "second ceph cluster started in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        SecondCluster { dir }
    }

    fn conf(&self) -> PathBuf {
        self.dir.path().join("ceph.conf")
    }

    fn rbd(&self, args: &[&str]) -> Out {
        let conf = self.conf();
        let mut a = vec!["-c", path_str(&conf), "--id", "admin"];
        a.extend_from_slice(args);
        run_status_timeout(Duration::from_secs(120), "rbd", &a)
    }
}

impl Drop for SecondCluster {
    fn drop(&mut self) {
        let out = run_status_timeout(
            Duration::from_secs(60),
            SCRIPT,
            ["stop", path_str(self.dir.path())],
        );
        if !out.success() {
            eprintln!("stopping the second cluster: {out}");
        }
    }
}

/// One daemon with an image on each of two clusters: while the first
/// cluster's OSD is stopped, the second cluster's device answers at once.
#[test]
fn an_image_on_a_second_cluster_serves_while_the_first_is_stalled() {
    let two = SecondCluster::start();
    let name = unique_image_name("two");
    let out = two.rbd(&["create", "--size", "4M", &format!("rbd/{name}")]);
    assert!(out.success(), "{out}");
    let img = Image::new("one", 4 * MIB);
    let _o = outage();
    let srv = Server::daemon().start();
    attach(&srv, &img.spec(), &["--name", "one", "--ceph-timeout", "3"]).assert_success();
    attach_with(
        &srv,
        &format!("rbd:rbd/{name}"),
        &two.conf(),
        &["--name", "two", "--ceph-timeout", "3"],
    )
    .assert_success();
    let (one, second) = (srv.uri_for_name("one"), srv.uri_for_name("two"));
    qemu_io(&one, &["write -P 0x1 0 65536"]);
    qemu_io(&second, &["write -P 0x2 0 65536"]);
    let (stalled, took) = {
        let _paused = ceph().pause_osd();
        let uri = one.clone();
        let stalled = std::thread::spawn(move || qemu_io_status(&uri, &["write -P 0x3 0 65536"]));
        std::thread::sleep(Duration::from_millis(500));
        let t = Instant::now();
        qemu_io(
            &second,
            &["write -P 0x4 0 65536", "read -P 0x4 0 65536", "flush"],
        );
        let took = t.elapsed();
        (stalled.join().expect("the stalled client"), took)
    };
    eprintln!(
        "the second cluster's device answered in {:.3} s while the first's OSD was stopped",
        took.as_secs_f64()
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let all = format!("{}{}", stalled.stdout, stalled.stderr);
    assert!(
        all.contains("failed"),
        "the first cluster's write fails after its timeout: {stalled}"
    );
    // Served again once the OSD continues (the failed write may or may not
    // have landed: it was never acknowledged).
    qemu_io(&one, &["read 0 65536"]);
    srv.ctl_ok(&["detach", "two"]);
    srv.ctl_ok(&["detach", "one"]);
}

/// A stopping daemon keeps its state file locked until it has let its
/// images go: while it waits for a write stuck on a stopped OSD, a second
/// daemon on the same state file is refused (`in use`, naming the pid) —
/// it must not find the state file free while the first still holds the
/// image's lock, which it would break as its dead self's. Once the first is
/// gone, the second starts, opens the image without any take-back (the lock
/// was released, not abandoned) and serves it.
#[test]
fn a_daemon_on_the_same_state_file_waits_until_a_stopping_one_let_its_images_go() {
    let img = Image::new("stopping", 4 * MIB);
    let dir = tempdir();
    let sock = dir.path().join("ctl.sock");
    let _o = outage();
    let mut first = daemon_at(&sock);
    attach(
        &first,
        &img.spec(),
        &["--name", "r", "--cache", "direct", "--ceph-timeout", "6"],
    )
    .assert_success();
    let uri = first.uri_for_name("r");
    qemu_io(&uri, &["write -P 0x5 0 131072", "flush"]);
    let second = {
        let _paused = ceph().pause_osd();
        let stuck = {
            let uri = uri.clone();
            std::thread::spawn(move || qemu_io_status(&uri, &["write -P 0x6 0 65536"]))
        };
        std::thread::sleep(Duration::from_millis(500));
        first.signal(libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            first.try_wait().is_none(),
            "the first daemon still drains its stuck write"
        );
        let second = Server::daemon()
            .arg("--state")
            .arg(sock.with_extension("state"))
            .try_start();
        match second {
            Ok(s) => panic!(
                "a second daemon started on the state file of a daemon that still holds the image's lock\n{}",
                s.stderr_text()
            ),
            Err(e) => assert!(
                e.contains("in use by another loopd") && e.contains(&first.pid().to_string()),
                "refused, naming the first daemon: {e}"
            ),
        }
        stuck
    };
    // The OSD continues: the stuck write ends (either way: it was never
    // acknowledged), the first daemon exits.
    let _ = second.join().expect("the stuck client");
    let st = first
        .wait_timeout(Duration::from_secs(30))
        .expect("the first daemon exits once its write has ended");
    assert!(st.success(), "{st}\n{}", first.stderr_text());
    let srv = daemon_at(&sock);
    wait_serving(&uri, Duration::from_secs(15));
    let log = srv.stderr_text();
    assert!(
        !log.contains("took it back"),
        "a lock released at stop is not taken back:\n{log}"
    );
    // (The stuck write covered the first 64 KiB; what follows is the
    // acknowledged one's.)
    qemu_io(
        &uri,
        &["read -P 0x5 65536 65536", "write -P 0x7 0 512", "flush"],
    );
    srv.ctl_ok(&["detach", "r"]);
    assert_eq!(&img.export()[..512], &[0x7; 512][..]);
}
