//! The RBD devices that are not in the state file — `loopd serve rbd:…` (the
//! default export) and `--config` devices — after a `kill -9`: the daemon
//! restarted with the same command and the same `--state` takes the image's
//! exclusive lock back from its dead self at once (not after Ceph's ~30 s
//! watch timeout, during which its start would block), from the owner its
//! previous run kept in the state file's sidecar `STATE.rbd-owners`; and an
//! owner from anywhere else — a config file, or a sidecar entry recorded for
//! another image under the same name — never breaks a live holder's lock.
//! Every byte check is against `rbd export`.

mod common;

use common::CephImage as Image;
use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How soon after the kill the restarted daemon serves again.
const BACK_WITHIN: Duration = Duration::from_secs(15);

/// The state file's sidecar of RBD lock owners.
fn sidecar(state: &Path) -> PathBuf {
    let mut s = state.as_os_str().to_owned();
    s.push(".rbd-owners");
    PathBuf::from(s)
}

/// The owners the sidecar of `state` records, as (name, image, owner).
fn recorded(state: &Path) -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(sidecar(state)).expect("the sidecar");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(r#"{"loopd_rbd_owners":1}"#), "{text}");
    lines
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            let s = |k: &str| v[k].as_str().expect("a string field").to_owned();
            (s("name"), s("image"), s("owner"))
        })
        .collect()
}

/// `loopd serve rbd:… --name r --cache direct --state STATE` on `sock`: the
/// same command every time. Its start blocks until the device has its lock,
/// so it may take up to [`BACK_WITHIN`] and a little more (a daemon that
/// waits for Ceph's watch timeout fails the test here).
fn serve(img: &Image, sock: &Path, state: &Path) -> Server {
    Server::builder(Path::new(&img.spec()))
        .name("r")
        .socket_path(sock)
        .args(ceph().loopd_args())
        .args(["--cache", "direct", "--state"])
        .arg(state)
        .ready_timeout(BACK_WITHIN + Duration::from_secs(5))
        .start()
}

/// `loopd serve rbd:POOL/IMAGE` killed with `-9` while a client writes (each
/// round written and flushed, librbd's cache off), then the same command
/// again: it serves within [`BACK_WITHIN`] of the kill (it took the lock back
/// from its dead self, and says so), every acknowledged round is in the
/// image, and a clean stop empties the sidecar (the lock goes with it).
#[test]
fn serve_rbd_killed_then_the_same_command_takes_the_lock_back_at_once() {
    const REGION: u64 = 16 * 1024;
    const ROUNDS: u64 = 400;
    let img = Image::new("static-serve", ROUNDS * REGION);
    let dir = tempdir();
    let (sock, state) = (dir.path().join("nbd.sock"), dir.path().join("loopd.state"));
    let mut srv = serve(&img, &sock, &state);
    let uri = srv.uri();
    let first = recorded(&state);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(
        (first[0].0.as_str(), first[0].1.as_str()),
        ("r", img.spec().as_str())
    );
    assert_eq!(
        watchers(&img.name),
        vec![first[0].2.clone()],
        "the owner is our client"
    );
    let mode = std::fs::metadata(sidecar(&state))
        .expect("sidecar")
        .permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600
    );
    let Killed { acked, at: killed } = kill9_under_writes(&mut srv, &uri, ROUNDS, REGION);
    let srv = serve(&img, &sock, &state);
    let took = killed.elapsed() + wait_serving(&uri, BACK_WITHIN);
    eprintln!(
        "kill -9 → `loopd serve rbd:…` serving again: {:.2} s ({} rounds acknowledged)",
        took.as_secs_f64(),
        acked.len()
    );
    assert!(
        took < BACK_WITHIN,
        "serving within {BACK_WITHIN:?} (took {took:?})"
    );
    let log = srv.stderr_text();
    assert!(
        log.contains("previous run") && log.contains("took it back"),
        "the log says the lock was taken back:\n{log}"
    );
    // The sidecar names this run's owner now.
    let second = recorded(&state);
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(second[0].2, first[0].2, "a new owner");
    assert!(watchers(&img.name).contains(&second[0].2));
    qemu_io(&uri, &["write -P 0xee 0 512", "flush"]);
    let mut srv = srv;
    srv.stop_ok();
    assert_eq!(recorded(&state), vec![], "a clean stop lets the lock go");
    let got = ceph().export_image(&img.name);
    assert_eq!(
        &got[..512],
        &[0xee; 512][..],
        "the restarted daemon's write"
    );
    assert_acked_rounds(&got, &acked, REGION, 512);
}

/// A `[[device]]` of `--config` for `img`, named `name`, plus `extra` lines.
fn config_device(img: &Image, name: &str, extra: &str) -> String {
    format!(
        "[[device]]\nimage = \"{}\"\nname = \"{name}\"\nceph_conf = \"{}\"\nceph_id = \"{}\"\n{extra}",
        img.spec(),
        path_str(&ceph().conf),
        ceph().id
    )
}

/// A `--config` RBD device, `kill -9`, the same command again: serving
/// within [`BACK_WITHIN`], its acknowledged data there; a detach forgets
/// its owner.
#[test]
fn config_device_killed_then_the_restart_takes_the_lock_back_at_once() {
    let img = Image::new("static-config", 4 * MIB);
    let dir = tempdir();
    let (sock, state) = (dir.path().join("nbd.sock"), dir.path().join("loopd.state"));
    let cfg = dir.path().join("devices.toml");
    std::fs::write(&cfg, config_device(&img, "c", "cache = \"direct\"\n")).expect("config");
    let start = || {
        Server::daemon()
            .socket_path(&sock)
            .arg("--config")
            .arg(&cfg)
            .arg("--state")
            .arg(&state)
            .ready_timeout(BACK_WITHIN + Duration::from_secs(5))
            .start()
    };
    let mut srv = start();
    let uri = srv.uri_for_name("c");
    qemu_io(&uri, &["write -P 0x5a 0 1M", "flush"]);
    let before = recorded(&state);
    assert_eq!(before.len(), 1, "{before:?}");
    assert_eq!(before[0].0, "c");
    srv.kill9();
    let killed = Instant::now();
    let srv = start();
    let took = killed.elapsed() + wait_serving(&uri, BACK_WITHIN);
    eprintln!(
        "kill -9 → --config RBD device serving again: {:.2} s",
        took.as_secs_f64()
    );
    assert!(
        took < BACK_WITHIN,
        "serving within {BACK_WITHIN:?} (took {took:?})"
    );
    assert!(
        srv.stderr_text().contains("took it back"),
        "{}",
        srv.stderr_text()
    );
    qemu_io(&uri, &["write -P 0xa5 1M 1M", "flush"]);
    let now = recorded(&state);
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now[0].2, before[0].2);
    srv.ctl_ok(&["detach", "c"]);
    assert_eq!(recorded(&state), vec![], "a detach forgets the owner");
    let got = ceph().export_image(&img.name);
    assert_bytes_eq(&got[..us(MIB)], &vec![0x5a; us(MIB)], 0, "before the kill");
    assert_bytes_eq(
        &got[us(MIB)..us(2 * MIB)],
        &vec![0xa5; us(MIB)],
        MIB,
        "after",
    );
}

/// Another daemon holds an image, live. Its owner, given to ours as "our
/// previous owner" from anywhere but our own record of that very device,
/// breaks nothing: not from a config file's `rbd_lock_owner`, nor from our
/// sidecar's entry for the same name but another image. Ours is refused
/// naming the holder; the holder keeps writing (it was not blocklisted).
/// (The sidecar itself is trusted as the state file is: only who can write
/// the state directory can plant an owner there.)
#[test]
fn an_owner_from_a_config_file_or_for_another_image_is_never_used() {
    let (a, b) = (
        Image::new("static-a", 4 * MIB),
        Image::new("static-b", 4 * MIB),
    );
    let theirs = Server::builder(Path::new(&b.spec()))
        .name("theirs")
        .args(ceph().loopd_args())
        .start();
    qemu_io(&theirs.uri(), &["write -P 0x22 0 4096", "flush"]);
    let holder = watchers(&b.name);
    assert_eq!(holder.len(), 1, "{holder:?}");
    let holder = &holder[0];
    let dir = tempdir();
    let state = dir.path().join("ours.state");
    let refused = |out: &Out| {
        assert!(!out.success(), "ours must not start: {out}");
        assert!(
            out.stderr
                .contains(&format!("exclusive lock is held by {holder}")),
            "refused naming the holder: {out}"
        );
        assert!(!out.stderr.contains("took it back"), "{out}");
    };
    // A config file's owner is not believed: the device is not attached
    // (the server starts without it, as for any device of the file that
    // cannot be attached), its reason naming the holder.
    let cfg = dir.path().join("devices.toml");
    let owner_line = format!("rbd_lock_owner = \"{holder}\"\n");
    std::fs::write(&cfg, config_device(&b, "r", &owner_line)).expect("config");
    {
        let ours = Server::daemon()
            .arg("--config")
            .arg(&cfg)
            .arg("--state")
            .arg(&state)
            .start();
        let r = ours.device("r").expect("r is listed");
        assert_eq!(r.at("state").str(), "missing", "{r:?}");
        let held = format!("exclusive lock is held by {holder}");
        assert!(r.at("reason").str().contains(&held), "{r:?}");
        let err = ours.stderr_text();
        assert!(err.contains(&held), "refused naming the holder: {err}");
        assert!(!err.contains("took it back"), "{err}");
    }
    // Our own sidecar's owner for the name "r", recorded for image a, is
    // not used for image b.
    let planted = format!(
        "{{\"loopd_rbd_owners\":1}}\n{{\"name\":\"r\",\"image\":\"{}\",\"ceph_conf\":\"{}\",\
         \"ceph_id\":\"{}\",\"owner\":\"{holder}\"}}\n",
        a.spec(),
        path_str(&ceph().conf),
        ceph().id
    );
    std::fs::write(sidecar(&state), &planted).expect("sidecar");
    let spec = b.spec();
    let mut args = vec![
        "serve".to_owned(),
        spec,
        "--name".into(),
        "r".into(),
        "--socket".into(),
        path_str(&dir.path().join("2.sock")).to_owned(),
        "--state".into(),
        path_str(&state).to_owned(),
    ];
    args.extend(
        ceph()
            .loopd_args()
            .iter()
            .map(|s| s.to_string_lossy().into_owned()),
    );
    let out = loopd_run(&args);
    refused(&out);
    assert!(
        !out.stderr.contains("rbd-owners"),
        "the planted sidecar was read whole (not ignored as damaged): {out}"
    );
    // The holder was not fenced: it writes and flushes.
    qemu_io(&theirs.uri(), &["write -P 0x33 4096 4096", "flush"]);
    drop(theirs);
    let got = ceph().export_image(&b.name);
    assert_bytes_eq(&got[..4096], &[0x22; 4096], 0, "the holder's first write");
    assert_bytes_eq(
        &got[4096..8192],
        &[0x33; 4096],
        4096,
        "the holder's write after",
    );
}
