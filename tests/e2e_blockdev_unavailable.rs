//! `--blockdev` on whatever kernel runs the tests: where the driver is missing
//! (this project's CI machines have neither ublk nor nbd) the attach is refused
//! with the control protocol's `unavailable` code and a message that says what to
//! do, and no device is left behind; where the driver is there, the block device
//! appears (the VM suites test it in depth). Either way an attach that asked for
//! a block device has one or did not happen.

mod common;

use common::*;

fn attach_refused_or_made(kind: &str, present: bool, must_say: &str) {
    let t = tempfile::tempdir().expect("tempdir");
    let srv = Server::daemon().start();
    let img = t.path().join("d.img");
    create_sparse_image(&img, 16 << 20);
    if present {
        let out = srv.ctl_ok(&["attach", img.to_str().expect("utf-8"), "--blockdev", kind]);
        assert!(
            out.stdout.contains("/dev/"),
            "the block device is printed: {out}"
        );
        srv.ctl_ok(&["detach", "d"]);
        return;
    }
    let out = srv.ctl_err(
        &["attach", img.to_str().expect("utf-8"), "--blockdev", kind],
        "unavailable",
    );
    assert_eq!(
        out.stderr.matches(must_say).count(),
        1,
        "the error says what to do ({must_say}), once: {out}"
    );
    let list = srv.ctl_json(&["list"]);
    assert!(
        list.arr().is_empty(),
        "no device is left attached after a refused --blockdev {kind}"
    );
    // The image is free again: the same name attaches without a block device.
    srv.ctl_ok(&["attach", img.to_str().expect("utf-8")]);
}

#[test]
fn ublk_without_the_driver_names_modprobe() {
    let present = std::path::Path::new("/dev/ublk-control").exists();
    attach_refused_or_made("ublk", present, "modprobe ublk_drv");
}

#[test]
fn nbd_without_the_module_names_modprobe() {
    // Looking the netlink family up loads an installed module, so "present" is
    // whether one is installed for this kernel, not whether it is loaded.
    let present = std::path::Path::new("/sys/module/nbd").exists()
        || std::process::Command::new("modinfo")
            .arg("nbd")
            .output()
            .is_ok_and(|o| o.status.success());
    attach_refused_or_made("nbd", present, "modprobe nbd");
}

/// A device of the state file whose block device cannot be made at start (the
/// driver is not loaded yet) is still attached and served over NBD, and keeps
/// its record: a missing module at boot must not erase the configuration.
#[test]
fn restored_device_keeps_its_record_when_the_block_device_cannot_be_made() {
    let present = std::path::Path::new("/dev/ublk-control").exists();
    let t = tempfile::tempdir().expect("tempdir");
    let img = t.path().join("keep.img");
    create_filled_image(&img, 4 << 20, 0x5a);
    let state = t.path().join("loopd.state");
    std::fs::write(
        &state,
        format!(
            "{{\"loopd_state\":1}}\n{{\"put\":{{\"image\":\"{}\",\"name\":\"keep\",\"blockdev\":\"ublk\"}}}}\n",
            img.display()
        ),
    )
    .expect("write state");
    let srv = Server::daemon()
        .args([std::ffi::OsStr::new("--state"), state.as_os_str()])
        .start();
    let d = srv.device("keep").expect("the device is attached");
    if present {
        assert!(d.get("blockdev").is_some(), "the driver is there: {d:?}");
    } else {
        assert!(d.get("blockdev").is_none(), "no block device: {d:?}");
        assert!(
            srv.stderr_text().contains("modprobe ublk_drv"),
            "the log says why and what to do:\n{}",
            srv.stderr_text()
        );
    }
    let text = std::fs::read_to_string(&state).expect("read state");
    assert!(
        text.contains("\"name\":\"keep\"") && text.contains("\"blockdev\":\"ublk\""),
        "the record stays:\n{text}"
    );
    let out = qemu_io(&srv.uri_for_name("keep"), &["read -P 0x5a 0 4k"]);
    assert!(
        out.stdout.contains("read 4096/4096"),
        "served over NBD: {out}"
    );
}

/// The failed attach `args` (with `--create 4M` of a new image) exits with
/// `code`, leaves no device, and leaves no image: it created one, and a failed
/// attach leaves no trace.
fn refused_create_leaves_no_image(srv: &Server, args: &[&str], code: &str) {
    let t = tempfile::tempdir().expect("tempdir");
    let img = t.path().join("new.img");
    let mut a = vec!["attach", img.to_str().expect("utf-8"), "--create", "4M"];
    a.extend_from_slice(args);
    let out = srv.ctl_err(&a, code);
    assert!(
        !img.exists(),
        "loopd {}: the image it created is removed again: {out}",
        a.join(" ")
    );
    assert!(
        srv.ctl_json(&["list"]).arr().is_empty(),
        "no device is left: {out}"
    );
}

/// `attach --create SIZE --blockdev ublk|nbd` whose block device cannot be
/// made removes the image it created: on every host through options the
/// block device refuses once the device is published (`--queue-depth 0`,
/// `--connections 0`), and where the driver is missing (as on this project's
/// CI machines) through the missing module.
#[test]
fn a_failed_blockdev_attach_removes_the_image_it_created() {
    let srv = Server::daemon().start();
    refused_create_leaves_no_image(
        &srv,
        &["--blockdev", "ublk", "--queue-depth", "0"],
        "invalid",
    );
    refused_create_leaves_no_image(
        &srv,
        &["--blockdev", "nbd", "--connections", "0"],
        "invalid",
    );
    if !std::path::Path::new("/dev/ublk-control").exists() {
        refused_create_leaves_no_image(&srv, &["--blockdev", "ublk"], "unavailable");
    }
    let nbd_installed = std::path::Path::new("/sys/module/nbd").exists()
        || std::process::Command::new("modinfo")
            .arg("nbd")
            .output()
            .is_ok_and(|o| o.status.success());
    if !nbd_installed {
        refused_create_leaves_no_image(&srv, &["--blockdev", "nbd"], "unavailable");
    }
    // An image that was there before stays, whatever the failure.
    let t = tempfile::tempdir().expect("tempdir");
    let img = t.path().join("old.img");
    create_filled_image(&img, 4 << 20, 0x33);
    srv.ctl_err(
        &[
            "attach",
            img.to_str().expect("utf-8"),
            "--create",
            "4M",
            "--blockdev",
            "ublk",
            "--queue-depth",
            "0",
        ],
        "invalid",
    );
    assert_eq!(
        std::fs::metadata(&img).expect("the old image stays").len(),
        4 << 20
    );
}

/// `serve IMAGE --create SIZE --blockdev ublk` that cannot make its block
/// device exits with the class of that failure and leaves no image.
#[test]
fn a_failed_serve_with_a_blockdev_removes_the_image_it_created() {
    let t = tempfile::tempdir().expect("tempdir");
    let img = t.path().join("new.img");
    let sock = t.path().join("s.sock");
    let out = std::process::Command::new(loopd_bin())
        .arg("serve")
        .arg(&img)
        .args(["--create", "4M", "--blockdev", "ublk", "--queue-depth", "0"])
        .arg("--socket")
        .arg(&sock)
        .arg("--state")
        .arg(t.path().join("st"))
        .output()
        .expect("run loopd serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "invalid (7): {stderr}");
    assert!(stderr.contains("(invalid)"), "{stderr}");
    assert!(!img.exists(), "the image it created is removed: {stderr}");
}
