//! ublk zero copy (`UBLK_F_AUTO_BUF_REG`, Linux 6.16+): a `--cache direct`
//! device on a kernel that offers it registers each request's pages in the
//! serving ring and reads/writes the image straight from them. Checked
//! here: the device says so (`ublk_fast_paths` has `auto_buf_reg`) exactly
//! when the kernel offers it, and not with `--no-zero-copy` or buffered;
//! `set --cache buffered` is refused on it; fio with crc32c verification,
//! ext4 + files + `e2fsck -n`, the image's bytes equal to what went through
//! the device, and `kill -9` + restart recovering it (still in zero copy)
//! with the right bytes. On a kernel without it (6.12) the same attach works
//! in copy mode and every data check passes the same.
//!
//! Runs as root inside the VM `scripts/vm-test.sh` boots.

#![cfg(feature = "vm-tests")]

mod common;

use common::kernel::*;
use common::*;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const FIO_TIMEOUT: Duration = Duration::from_secs(300);

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-kzc")
        .tempdir()
        .expect("tempdir in TMPDIR")
}

fn daemon(dir: &Path) -> Server {
    require_root();
    require_module("ublk_drv");
    Server::daemon()
        .socket_path(&dir.join("nbd.sock"))
        .args([
            std::ffi::OsString::from("--state"),
            dir.join("loopd.state").into(),
        ])
        .start()
}

/// Whether the kernel offers automatic buffer registration (GET_FEATURES, as
/// the device's status reports it).
fn kernel_offers(st: &serde_json::Value) -> bool {
    json_names(st, "ublk_kernel_features")
        .iter()
        .any(|f| f == "auto_buf_reg")
}

fn zero_copy(st: &serde_json::Value) -> bool {
    json_names(st, "ublk_fast_paths")
        .iter()
        .any(|f| f == "auto_buf_reg")
}

/// A `--cache direct` device of `name`: zero copy exactly when the kernel
/// offers it (6.16+).
fn direct_device(srv: &Server, img: &Path, name: &str) -> PathBuf {
    let dev = attach_blockdev(srv, "ublk", img, &["--cache", "direct"]);
    let st = srv.ctl_json(&["status", name]);
    eprintln!(
        "{}: kernel offers auto_buf_reg: {}, device uses it: {}",
        kernel_release(),
        kernel_offers(&st),
        zero_copy(&st)
    );
    assert_eq!(
        kernel_offers(&st),
        kernel_at_least(6, 16),
        "AUTO_BUF_REG is offered from 6.16 on: {st}"
    );
    assert_eq!(
        zero_copy(&st),
        kernel_offers(&st),
        "a --cache direct device uses zero copy where the kernel offers it: {st}"
    );
    dev
}

#[test]
fn zero_copy_only_where_offered_and_asked_and_set_buffered_is_refused() {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("zc.img");
    create_sparse_image(&img, 16 << 20);
    let dev = direct_device(&srv, &img, "zc");
    let st = srv.ctl_json(&["status", "zc"]);
    // Zero copy takes requests up to 1 MiB (no tag buffer to size), copy
    // mode up to 512 KiB (each tag's buffer).
    let largest = if zero_copy(&st) { 1024 } else { 512 };
    assert_eq!(max_hw_sectors_kb(&dev), largest, "largest request: {st}");
    if zero_copy(&st) {
        let out = srv.ctl(&["set", "zc", "--cache", "buffered"]);
        assert!(!out.success(), "set --cache buffered refused:\n{out}");
        assert!(
            out.stderr.contains("zero copy") && out.stderr.contains("--no-zero-copy"),
            "the refusal says why and what to do:\n{out}"
        );
        let st = srv.ctl_json(&["status", "zc"]);
        assert!(zero_copy(&st), "still zero copy after the refusal: {st}");
    }
    srv.ctl_ok(&["detach", "zc"]);
    assert!(gone(&dev));

    let dev = attach_blockdev(&srv, "ublk", &img, &["--cache", "direct", "--no-zero-copy"]);
    let st = srv.ctl_json(&["status", "zc"]);
    assert!(!zero_copy(&st), "--no-zero-copy: copy mode: {st}");
    assert_eq!(max_hw_sectors_kb(&dev), 512, "largest request in copy mode");
    // A copy-mode device may change its cache mode.
    srv.ctl_ok(&["set", "zc", "--cache", "buffered"]);
    srv.ctl_ok(&["detach", "zc"]);
    assert!(gone(&dev));

    let dev = attach_blockdev(&srv, "ublk", &img, &["--cache", "buffered"]);
    let st = srv.ctl_json(&["status", "zc"]);
    assert!(!zero_copy(&st), "buffered: copy mode: {st}");
    srv.ctl_ok(&["detach", "zc"]);
    assert!(gone(&dev));
}

/// The largest request the kernel sends `dev`, in KiB (sysfs).
fn max_hw_sectors_kb(dev: &Path) -> u64 {
    let name = dev.file_name().expect("device name").to_string_lossy();
    let p = format!("/sys/block/{name}/queue/max_hw_sectors_kb");
    fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{p}: {e}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{p}: {e}"))
}

#[test]
fn zero_copy_fio_verifies() {
    require_tool("fio");
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("fio.img");
    create_sparse_image(&img, 64 << 20);
    let dev = direct_device(&srv, &img, "fio");
    for (engine, rw, bs, depth) in [
        ("io_uring", "randwrite", "4k", "32"),
        ("libaio", "randrw", "4k", "8"),
        ("io_uring", "write", "1M", "4"),
        ("io_uring", "randwrite", "64k", "16"),
    ] {
        sh(
            FIO_TIMEOUT,
            "fio",
            [
                "--name=v".to_string(),
                format!("--filename={}", dev.display()),
                format!("--ioengine={engine}"),
                "--direct=1".into(),
                format!("--rw={rw}"),
                format!("--bs={bs}"),
                format!("--iodepth={depth}"),
                "--numjobs=2".into(),
                "--size=12M".into(),
                "--offset_increment=16M".into(),
                "--verify=crc32c".into(),
                "--verify_fatal=1".into(),
                "--do_verify=1".into(),
                "--group_reporting".into(),
            ],
        );
    }
    srv.ctl_ok(&["detach", "fio"]);
    assert!(gone(&dev));
}

/// Bytes written through the device are the image's bytes, and the image's
/// bytes are what the device reads (O_DIRECT both ways, so through the
/// queues, not the page cache); then ext4 with files and a clean fsck.
#[test]
fn zero_copy_bytes_match_the_image_and_ext4_is_clean() {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("bytes.img");
    create_sparse_image(&img, 128 << 20);
    let dev = direct_device(&srv, &img, "bytes");
    // Through the device: 8 MiB of random bytes at 4 MiB.
    let pattern = t.path().join("pattern");
    write_random(&pattern, 8);
    sh(
        KCMD_TIMEOUT,
        "dd",
        [
            format!("if={}", pattern.display()),
            format!("of={}", dev.display()),
            "bs=1M".into(),
            "seek=4".into(),
            "oflag=direct".into(),
            "conv=fsync".into(),
        ],
    );
    let want = fs::read(&pattern).expect("pattern");
    let f = fs::File::open(&img).expect("image");
    let mut got = vec![0u8; want.len()];
    f.read_exact_at(&mut got, 4 << 20).expect("image bytes");
    assert!(
        got == want,
        "the image holds what was written through the device"
    );
    // Into the image: different bytes at 20 MiB, read back through the device.
    let mut other = want.clone();
    other.reverse();
    f.sync_all().ok();
    drop(f);
    let w = fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .expect("image for writing");
    w.write_all_at(&other, 20 << 20).expect("write image");
    w.sync_all().expect("sync image");
    drop(w);
    let back = t.path().join("back");
    sh(
        KCMD_TIMEOUT,
        "dd",
        [
            format!("if={}", dev.display()),
            format!("of={}", back.display()),
            "bs=1M".into(),
            "skip=20".into(),
            "count=8".into(),
            "iflag=direct".into(),
        ],
    );
    assert!(
        fs::read(&back).expect("back") == other,
        "the device reads the image's bytes"
    );
    // A filesystem on top.
    mkfs_ext4(&dev);
    let mnt = t.path().join("mnt");
    let m = Mount::new(&dev, &mnt, None);
    write_random(&mnt.join("a"), 16);
    write_random(&mnt.join("b"), 24);
    let (a, b) = (md5(&mnt.join("a")), md5(&mnt.join("b")));
    remount_and_check(m, &dev, &mnt, &[("a", &a), ("b", &b)]);
    srv.ctl_ok(&["detach", "bytes"]);
    assert!(gone(&dev));
}

/// `kill -9` of the daemon under a mounted filesystem on a zero-copy device,
/// I/O during the outage, restart: the device is recovered (in zero copy
/// still: the mode is the device's) and every byte is right.
#[test]
fn zero_copy_kill_9_and_restart_recovers() {
    let t = scratch();
    let mut srv = daemon(t.path());
    let img = t.path().join("rec.img");
    create_sparse_image(&img, 128 << 20);
    let dev = direct_device(&srv, &img, "rec");
    let was_zero_copy = zero_copy(&srv.ctl_json(&["status", "rec"]));
    mkfs_ext4(&dev);
    let mnt = t.path().join("mnt");
    let m = Mount::new(&dev, &mnt, None);
    write_random(&mnt.join("before"), 8);
    let before = md5(&mnt.join("before"));
    srv.kill9();
    assert!(dev.exists(), "the disk stays when the daemon dies");
    let bg_path = mnt.join("during");
    let bg = std::thread::spawn(move || {
        write_random(&bg_path, 4);
        md5(&bg_path)
    });
    std::thread::sleep(Duration::from_secs(1));
    let srv = daemon(t.path());
    let during = bg.join().expect("the write during the outage completed");
    assert!(
        srv.stderr_text().contains("recovered /dev/ublkb"),
        "the restarted daemon took the device back:\n{}",
        srv.stderr_text()
    );
    assert_eq!(
        zero_copy(&srv.ctl_json(&["status", "rec"])),
        was_zero_copy,
        "recovered in the mode it was made with"
    );
    assert_eq!(md5(&mnt.join("before")), before, "fsync'd data intact");
    remount_and_check(m, &dev, &mnt, &[("before", &before), ("during", &during)]);
    srv.ctl_ok(&["detach", "rec"]);
    assert!(gone(&dev));
}

/// One reactor: four queues of 4096 tags fill its fixed-buffer table
/// (16,384 slots), so a fifth device is made in copy mode (and works); once
/// one of the four is detached its slots are free again and the next device
/// has zero copy.
#[test]
fn a_full_fixed_buffer_table_makes_the_next_device_in_copy_mode() {
    require_root();
    require_module("ublk_drv");
    let t = scratch();
    let srv = Server::daemon()
        .socket_path(&t.path().join("nbd.sock"))
        .args([
            std::ffi::OsString::from("--state"),
            t.path().join("loopd.state").into(),
            "--reactors".into(),
            "1".into(),
        ])
        .start();
    let deep = [
        "--cache",
        "direct",
        "--queues",
        "1",
        "--queue-depth",
        "4096",
    ];
    let mut devs = Vec::new();
    let mut offered = false;
    for i in 0..4 {
        let img = t.path().join(format!("d{i}.img"));
        create_sparse_image(&img, 8 << 20);
        devs.push(attach_blockdev(&srv, "ublk", &img, &deep));
        let st = srv.ctl_json(&["status", &format!("d{i}")]);
        offered = kernel_offers(&st);
        assert_eq!(zero_copy(&st), offered, "d{i}: {st}");
    }
    let small = ["--cache", "direct", "--queues", "1", "--queue-depth", "64"];
    let img = t.path().join("e.img");
    create_sparse_image(&img, 8 << 20);
    let e = attach_blockdev(&srv, "ublk", &img, &small);
    let st = srv.ctl_json(&["status", "e"]);
    assert!(!zero_copy(&st), "no slot left: copy mode: {st}");
    if offered {
        assert!(
            srv.stderr_text().contains("made without zero copy"),
            "the log says why:\n{}",
            srv.stderr_text()
        );
    }
    // It serves I/O: bytes in, the same bytes out (O_DIRECT both ways).
    let pattern = t.path().join("pattern");
    write_random(&pattern, 1);
    sh(
        KCMD_TIMEOUT,
        "dd",
        [
            format!("if={}", pattern.display()),
            format!("of={}", e.display()),
            "bs=1M".into(),
            "oflag=direct".into(),
        ],
    );
    let mut got = vec![0u8; 1 << 20];
    fs::File::open(&img)
        .expect("image")
        .read_exact_at(&mut got, 0)
        .expect("image bytes");
    assert!(
        got == fs::read(&pattern).expect("pattern"),
        "e's image holds the bytes"
    );
    srv.ctl_ok(&["detach", "d0"]);
    assert!(gone(&devs[0]));
    let img = t.path().join("f.img");
    create_sparse_image(&img, 8 << 20);
    let _f = attach_blockdev(&srv, "ublk", &img, &small);
    let st = srv.ctl_json(&["status", "f"]);
    assert_eq!(zero_copy(&st), offered, "d0's slots came back: {st}");
    for n in ["d1", "d2", "d3", "e", "f"] {
        srv.ctl_ok(&["detach", n]);
    }
}
