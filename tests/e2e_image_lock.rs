//! Image locking against real QEMU tools: loopd refuses an image QEMU (or another
//! loopd device) has open for writing, QEMU refuses an image loopd serves, and
//! `--shared` lets the user share it on purpose.
//!
//! Every qemu-nbd started here is stopped by its PID (SIGTERM, then SIGKILL).

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A `qemu-nbd -f raw IMAGE` serving on a Unix socket in a temp dir.
struct QemuNbd {
    child: Child,
    _dir: tempfile::TempDir,
}

impl QemuNbd {
    fn start(image: &Path, extra: &[&str]) -> QemuNbd {
        let dir = tempdir();
        let sock = dir.path().join("q.sock");
        let mut c = tool("qemu-nbd");
        c.args(["-f", "raw", "--persistent", "-k"])
            .arg(&sock)
            .args(extra)
            .arg(image)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("start qemu-nbd");
        // Started once a client's handshake gets the export's size: qemu-nbd
        // listens before it opens (and locks) the image, so its socket alone
        // does not say the image is locked.
        let uri = format!("nbd+unix:///?socket={}", sock.display());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(sock.exists() && run_status("nbdinfo", ["--size", uri.as_str()]).success()) {
            if let Ok(Some(st)) = child.try_wait() {
                panic!("qemu-nbd exited early ({st})");
            }
            assert!(
                Instant::now() < deadline,
                "qemu-nbd did not serve its export"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        QemuNbd { child, _dir: dir }
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our own
            // unreaped child, so it names no other process.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Ok(None) = self.child.try_wait() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn image(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    create_filled_image(&p, 1 << 20, 0x5a);
    p
}

/// `qemu-io -f raw IMAGE -c 'write 0 4k'` straight on the file.
fn qemu_write_file(img: &Path) -> Out {
    run_status(
        "qemu-io",
        ["-f", "raw", path_str(img), "-c", "write -P 0x11 0 4k"],
    )
}

#[track_caller]
fn assert_qemu_refused(out: &Out, perm: &str) {
    assert!(!out.success(), "QEMU was let in:\n{out}");
    let want = format!("Failed to get \"{perm}\" lock");
    assert!(out.stderr.contains(&want), "expected {want:?}:\n{out}");
}

#[test]
fn attach_refuses_an_image_qemu_nbd_serves_for_writing_unless_shared() {
    let dir = tempdir();
    let img = image(dir.path(), "b.img");
    let d = Server::daemon().start();
    let q = QemuNbd::start(&img, &[]);

    let out = d.ctl_err(&["attach", path_str(&img)], "busy");
    assert!(
        out.stderr
            .contains("another process has the image open for writing")
            && out.stderr.contains("--shared"),
        "{out}"
    );
    assert!(
        d.device_names().is_empty(),
        "a refused attach left a device"
    );
    let out = d.ctl_err(&["attach", path_str(&img), "--read-only"], "busy");
    assert!(out.stderr.contains("open for writing"), "{out}");

    // On purpose: served, and its bytes are the file's.
    d.ctl_ok(&["attach", path_str(&img), "--shared"]);
    qemu_io(&d.uri_for_name("b"), &["read -P 0x5a 0 64k"]);
    d.ctl_ok(&["detach", "b"]);

    drop(q);
    d.ctl_ok(&["attach", path_str(&img)]);
}

#[test]
fn qemu_refuses_an_image_loopd_serves_and_gets_it_back_after_detach() {
    let dir = tempdir();
    let img = image(dir.path(), "b.img");
    let d = Server::daemon().start();
    d.ctl_ok(&["attach", path_str(&img)]);

    assert_qemu_refused(&qemu_write_file(&img), "write");
    let sock = dir.path().join("q.sock");
    let out = run_status(
        "qemu-nbd",
        ["-f", "raw", "-k", path_str(&sock), path_str(&img)],
    );
    assert_qemu_refused(&out, "write");
    // A QEMU reader shares write, so it may read what loopd serves.
    run(
        "qemu-io",
        ["-r", "-f", "raw", path_str(&img), "-c", "read -P 0x5a 0 4k"],
    );

    d.ctl_ok(&["detach", "b"]);
    let out = qemu_write_file(&img);
    assert!(out.success(), "the lock outlived the device:\n{out}");
    assert_file_filled(&img, 0, 4096, 0x11, "qemu-io's write after detach");
}

#[test]
fn serve_refuses_an_image_qemu_nbd_serves() {
    let dir = tempdir();
    let img = image(dir.path(), "b.img");
    let _q = QemuNbd::start(&img, &[]);
    let out = loopd_run([
        "serve",
        path_str(&img),
        "--socket",
        path_str(&dir.path().join("l.sock")),
        // Not the default /var/lib/loopd (which the test would leave behind).
        "--state",
        path_str(&dir.path().join("l.state")),
    ]);
    assert!(!out.success(), "loopd served a written image:\n{out}");
    assert!(
        out.stderr
            .contains("another process has the image open for writing; pass --shared"),
        "{out}"
    );
}

#[test]
fn one_writer_per_image_across_device_names() {
    let dir = tempdir();
    let img = image(dir.path(), "b.img");
    let d = Server::daemon().start();
    d.ctl_ok(&["attach", path_str(&img), "--name", "a"]);

    let out = d.ctl_err(&["attach", path_str(&img), "--name", "b"], "busy");
    assert!(out.stderr.contains("device \"a\""), "{out}");
    d.ctl_err(
        &["attach", path_str(&img), "--name", "c", "--read-only"],
        "busy",
    );
    // A symlink is the same image.
    let link = dir.path().join("link.img");
    std::os::unix::fs::symlink(&img, &link).expect("symlink");
    d.ctl_err(&["attach", path_str(&link), "--name", "l"], "busy");

    d.ctl_ok(&["attach", path_str(&img), "--name", "b", "--shared"]);
    assert_eq!(d.device_names(), vec!["a".to_string(), "b".to_string()]);
    // Both write, as asked.
    qemu_io(&d.uri_for_name("a"), &["write -P 0x01 0 4k"]);
    qemu_io(&d.uri_for_name("b"), &["write -P 0x02 4k 4k"]);
    assert_file_filled(&img, 0, 4096, 0x01, "device a");
    assert_file_filled(&img, 4096, 4096, 0x02, "device b");
}

#[test]
fn read_only_devices_share_and_keep_writers_out() {
    let dir = tempdir();
    let img = image(dir.path(), "b.img");
    let d = Server::daemon().start();
    d.ctl_ok(&["attach", path_str(&img), "--name", "r1", "--read-only"]);
    d.ctl_ok(&["attach", path_str(&img), "--name", "r2", "--read-only"]);
    d.ctl_err(&["attach", path_str(&img), "--name", "w"], "busy");
    assert_qemu_refused(&qemu_write_file(&img), "write");
    let uri = d.uri_for_name("r2");
    run(
        "qemu-io",
        ["-r", "-f", "raw", &uri, "-c", "read -P 0x5a 0 64k"],
    );
}

#[test]
fn set_and_resize_keep_their_own_lock() {
    let dir = tempdir();
    let img = image(dir.path(), "b.img");
    let d = Server::daemon().start();
    d.ctl_ok(&["attach", path_str(&img), "--name", "a"]);
    // Reconfigurations open the image again while the old device serves: they
    // must not trip over their own lock, and the lock must stay.
    d.ctl_ok(&["set", "a", "--read-only", "true"]);
    d.ctl_ok(&["resize", "a"]);
    d.ctl_ok(&["set", "a", "--read-only", "false"]);
    qemu_io(&d.uri_for_name("a"), &["write -P 0x03 0 4k"]);
    assert_qemu_refused(&qemu_write_file(&img), "write");
    d.ctl_err(&["attach", path_str(&img), "--name", "b"], "busy");
    d.ctl_ok(&["detach", "a"]);
    d.ctl_ok(&["attach", path_str(&img), "--name", "b"]);
}
