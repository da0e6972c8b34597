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
