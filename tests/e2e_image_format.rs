//! Images that are not raw are refused, with the format named and the way to
//! convert it, unless the user declares `--format raw`. Images are made by the
//! real `qemu-img create`.

mod common;

use common::*;
use std::path::{Path, PathBuf};

fn qemu_img_create(dir: &Path, fmt: &str) -> PathBuf {
    let p = dir.join(format!("vm.{fmt}"));
    let mut args: Vec<String> = vec!["create".into(), "-q".into(), "-f".into(), fmt.into()];
    if fmt == "luks" {
        args.extend(
            [
                "--object",
                "secret,id=sec0,data=loopd",
                "-o",
                "key-secret=sec0,iter-time=10",
            ]
            .map(String::from),
        );
    }
    args.push(path_str(&p).into());
    args.push("1M".into());
    run("qemu-img", &args);
    p
}

#[test]
fn serve_refuses_a_qcow2_image_and_says_how_to_convert_it() {
    let dir = tempdir();
    let img = qemu_img_create(dir.path(), "qcow2");
    let out = loopd_run([
        "serve",
        path_str(&img),
        "--socket",
        path_str(&dir.path().join("l.sock")),
    ]);
    assert!(!out.success(), "a qcow2 image was served:\n{out}");
    let raw = dir.path().join("vm.raw");
    let want = format!(
        "{:?} is a qcow2 image; loopd serves raw images only: convert it with 'qemu-img \
         convert -f qcow2 -O raw {:?} {:?}', or pass --format raw to serve its bytes as they are",
        img.display().to_string(),
        img.display().to_string(),
        raw.display().to_string()
    );
    assert!(out.stderr.contains(&want), "expected {want:?}:\n{out}");
}

#[test]
fn attach_refuses_every_known_container_format_by_name() {
    let dir = tempdir();
    let d = Server::daemon().start();
    for fmt in ["qcow2", "qcow", "vmdk", "vhdx", "vdi", "vpc", "qed", "luks"] {
        let img = qemu_img_create(dir.path(), fmt);
        let out = d.ctl_err(&["attach", path_str(&img)], "invalid");
        assert!(
            out.stderr.contains(&format!("is a {fmt} image"))
                && out.stderr.contains("--format raw"),
            "{fmt}: {out}"
        );
    }
    assert!(
        d.device_names().is_empty(),
        "a refused attach left a device"
    );
}

#[test]
fn format_raw_serves_a_qcow2_file_byte_for_byte_and_is_remembered() {
    let dir = tempdir();
    let img = qemu_img_create(dir.path(), "qcow2");
    let state = dir.path().join("loopd.state");
    let len = file_len(&img);
    let mut d = Server::daemon().arg("--state").arg(&state).start();
    d.ctl_ok(&["attach", path_str(&img), "--format", "raw", "--read-only"]);
    let check = |d: &Server| {
        let uri = d.uri_for_name("vm");
        assert_eq!(nbd_size(&uri), len.div_ceil(512) * 512);
        // "QFI\xfb": the qcow2 header itself, as the bytes of the disk.
        run(
            "qemu-io",
            [
                "-r",
                "-f",
                "raw",
                &uri,
                "-c",
                "read -P 0x51 0 1",
                "-c",
                "read -P 0xfb 3 1",
            ],
        );
    };
    check(&d);
    d.stop_ok();
    // The state file carries the declaration: the restart serves it again.
    let d = Server::daemon().arg("--state").arg(&state).start();
    assert_eq!(d.device_names(), vec!["vm".to_string()]);
    check(&d);
}

#[test]
fn config_file_format_raw_serves_a_vmdk_file() {
    let dir = tempdir();
    let img = qemu_img_create(dir.path(), "vmdk");
    let cfg = dir.path().join("loopd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nimage = {:?}\nname = \"v\"\nformat = \"raw\"\nread_only = true\n",
            path_str(&img)
        ),
    )
    .expect("write config");
    let d = Server::daemon().arg("--config").arg(&cfg).start();
    assert_eq!(d.device_names(), vec!["v".to_string()]);
}

#[test]
fn a_raw_image_whose_client_writes_a_qcow2_header_is_restored_after_restart() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, 1 << 20);
    let state = dir.path().join("loopd.state");
    let mut d = Server::daemon().arg("--state").arg(&state).start();
    d.ctl_ok(&["attach", path_str(&img)]);
    // A guest makes a qcow2 image inside its raw disk.
    let nested = qemu_img_create(dir.path(), "qcow2");
    let head = read_range(&nested, 0, 512);
    let uri = d.uri_for_name("disk");
    let pat = dir.path().join("head.bin");
    std::fs::write(&pat, &head).expect("write head");
    run(
        "qemu-img",
        [
            "dd",
            "-f",
            "raw",
            "-O",
            "raw",
            "bs=512",
            "count=1",
            &format!("if={}", path_str(&pat)),
            &format!("of={uri}"),
        ],
    );
    assert_eq!(read_range(&img, 0, 4), b"QFI\xfb".to_vec());
    d.kill9();
    let d = Server::daemon().arg("--state").arg(&state).start();
    assert_eq!(
        d.device_names(),
        vec!["disk".to_string()],
        "{}",
        d.stderr_text()
    );
}
