//! Nobody gets in where they should not: sockets get their modes from loopd,
//! not the umask; a runtime directory another user controls is refused;
//! listing can be turned off and no client learns where an image lives.

mod common;

use common::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Issue item 11. Under umask 000 the NBD socket is 0600 (or what
/// `--socket-mode` says), the control socket 0600, and a socket directory
/// loopd creates is not world-writable.
#[test]
fn sockets_have_explicit_modes_under_umask_000() {
    let dir = tempdir();
    let run = dir.path().join("run");
    let sock = run.join("nbd.sock");
    let srv = Server::daemon().socket_path(&sock).umask(0).start();
    assert_eq!(mode(&sock), 0o600, "NBD socket");
    assert_eq!(mode(srv.control()), 0o600, "control socket");
    // Created by loopd (for the state file, 0700, or the socket, 0755): never
    // writable by others.
    assert_eq!(
        mode(&run) & 0o022,
        0,
        "socket directory created by loopd: {:o}",
        mode(&run)
    );
    drop(srv);

    let sock2 = dir.path().join("grp.sock");
    let _srv = Server::daemon()
        .socket_path(&sock2)
        .umask(0)
        .args(["--socket-mode", "660", "--socket-group", "1"])
        .start();
    assert_eq!(mode(&sock2), 0o660, "--socket-mode 660");
    assert_eq!(
        std::fs::metadata(&sock2).unwrap().gid(),
        1,
        "--socket-group 1"
    );
}

/// A uid no account uses, distinct per test process.
fn stranger_uid() -> u32 {
    61_000 + std::process::id() % 1000
}

/// `loopd serve` as `uid` with no XDG_RUNTIME_DIR (so the default runtime
/// directory is /tmp/loopd-UID); returns the process.
fn serve_as(uid: u32, state: &Path) -> std::process::Child {
    let mut c = Command::new(require_tool("setpriv"));
    c.args([
        &format!("--reuid={uid}"),
        &format!("--regid={uid}"),
        "--clear-groups",
        "--",
    ])
    .arg(loopd_bin())
    .arg("serve")
    .arg("--state")
    .arg(state)
    .env_remove("XDG_RUNTIME_DIR")
    .env_remove("LOOPD_CONTROL")
    .env("HOME", "/nonexistent")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c.spawn().expect("spawn setpriv loopd serve")
}

/// Waits up to 10 s for `c` to exit (then kills it, by its PID): its output.
fn finish(mut c: std::process::Child) -> std::process::Output {
    let t = std::time::Instant::now();
    while c.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = c.kill();
    c.wait_with_output().unwrap()
}

/// Removes a directory tree on drop (the runtime directory under /tmp).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Issue item 12. A non-root user without XDG_RUNTIME_DIR falls back to
/// /tmp/loopd-UID: loopd refuses it when another user owns it or others may
/// write to it, and uses it when it is the user's own and private.
#[test]
fn runtime_dir_owned_by_another_user_is_refused() {
    let uid = stranger_uid();
    let rt = std::path::PathBuf::from(format!("/tmp/loopd-{uid}"));
    let _ = std::fs::remove_dir_all(&rt);
    let _cleanup = RemoveOnDrop(rt.clone());
    let home = tempdir();
    std::os::unix::fs::chown(home.path(), Some(uid), Some(uid)).unwrap();
    let state = home.path().join("s.state");

    // Made by root (another user), mode 0777: the trap from the issue.
    std::fs::create_dir(&rt).unwrap();
    std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = finish(serve_as(uid, &state));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "loopd used a directory root owns:\n{err}"
    );
    assert!(
        err.contains(&format!("refusing the runtime directory {}", rt.display()))
            && err.contains("owned by uid 0"),
        "the error names the directory and why:\n{err}"
    );
    assert!(
        std::fs::read_dir(&rt).unwrap().next().is_none(),
        "nothing was created in the refused directory"
    );

    // Its own, but writable by others.
    std::os::unix::fs::chown(&rt, Some(uid), Some(uid)).unwrap();
    let out = finish(serve_as(uid, &state));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("lets others write"),
        "{err}"
    );

    // Missing: created private, and the daemon serves.
    std::fs::remove_dir(&rt).unwrap();
    let mut child = serve_as(uid, &state);
    let sock = rt.join("loopd.sock");
    let t = std::time::Instant::now();
    while !sock.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let ok = sock.exists();
    let meta = std::fs::symlink_metadata(&rt);
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(ok, "no socket: {}", String::from_utf8_lossy(&out.stderr));
    let meta = meta.unwrap();
    assert_eq!(meta.uid(), uid);
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
}

/// Issue item 13. `--no-list` refuses NBD_OPT_LIST; no client learns the
/// image's path (there is no export description).
#[test]
fn listing_can_be_turned_off_and_paths_stay_private() {
    let dir = tempdir();
    let img = dir.path().join("secret-place.img");
    create_sparse_image(&img, MIB);
    let srv = Server::builder(&img).tcp().start();
    let out = run("nbdinfo", ["--list", "--json", &srv.tcp_uri()]);
    assert!(
        out.stdout.contains("secret-place"),
        "listed by name:\n{out}"
    );
    let out = run("nbdinfo", ["--json", &srv.tcp_uri()]);
    assert!(
        !out.stdout.contains(path_str(dir.path())),
        "nbdinfo shows the image's path:\n{out}"
    );
    drop(srv);

    let srv = Server::builder(&img).tcp().arg("--no-list").start();
    let out = run_status("nbdinfo", ["--list", &srv.tcp_uri()]);
    assert!(!out.success(), "listing must be refused:\n{out}");
    assert!(!out.stdout.contains("secret-place"), "{out}");
    // Opening a known name still works.
    let out = run("nbdinfo", ["--size", &srv.tcp_uri()]);
    assert_eq!(out.stdout.trim(), MIB.to_string());
}
