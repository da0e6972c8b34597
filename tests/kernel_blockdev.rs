//! `loopd attach IMAGE --blockdev ublk|nbd`: a real `/dev/ublkbN` served by
//! loopd's own reactors, and `/dev/nbdN` (the kernel's NBD client connected to
//! loopd in one step), in direct and buffered cache mode: a filesystem with files
//! and checksums, `fstrim` reaching the image as holes, fio with verification,
//! read-only devices, offset/size-limit windows, set/resize as far as the kernel
//! follows, detach refusing while mounted or open, `kill -9` + restart keeping a
//! mounted filesystem (ublk recovery; NBD reconnect), 50 devices, and a
//! batch of 24 made at once.
//!
//! Runs as root inside the VM `scripts/vm-test.sh` boots (`ublk_drv` and `nbd`
//! loaded, TMPDIR on a tmpfs). Every server, mount and device is a guard released on
//! drop; a daemon's ublk devices are removed when it stops.

#![cfg(feature = "vm-tests")]

mod common;

use common::kernel::*;
use common::*;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const FIO_TIMEOUT: Duration = Duration::from_secs(180);

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-kublk")
        .tempdir()
        .expect("tempdir in TMPDIR")
}

/// A daemon (no default device) whose state file and sockets live in `dir`, so
/// that a restart finds them again.
fn daemon(dir: &Path) -> Server {
    require_root();
    require_module("ublk_drv");
    require_module("nbd");
    Server::daemon()
        .socket_path(&dir.join("nbd.sock"))
        .args([OsArg::from("--state"), dir.join("loopd.state").into()])
        .start()
}

type OsArg = std::ffi::OsString;

/// mkfs + mount + files + checksums across a remount and a page-cache drop +
/// e2fsck; then fstrim punches the deleted file's blocks out of the image.
/// The loopd threads that serve ublk queues run as I/O flushers
/// (`PR_SET_IO_FLUSHER`: PF_MEMALLOC_NOIO | PF_LOCAL_THROTTLE in their flags),
/// so memory reclaim never waits on them to write back their own device.
fn assert_reactors_are_io_flushers(srv: &Server) {
    const PF_MEMALLOC_NOIO: u64 = 0x0008_0000;
    const PF_LOCAL_THROTTLE: u64 = 0x0010_0000;
    let tasks = format!("/proc/{}/task", srv.pid());
    let mut reactors = 0;
    for e in fs::read_dir(&tasks).expect("task dir") {
        let p = e.expect("task").path();
        let comm = fs::read_to_string(p.join("comm")).unwrap_or_default();
        if !comm.starts_with("loopd-reactor") {
            continue;
        }
        reactors += 1;
        let stat = fs::read_to_string(p.join("stat")).expect("stat");
        let after = &stat[stat.rfind(')').expect("comm end") + 2..];
        let flags: u64 = after
            .split(' ')
            .nth(6)
            .and_then(|f| f.parse().ok())
            .expect("flags field");
        assert_eq!(
            flags & (PF_MEMALLOC_NOIO | PF_LOCAL_THROTTLE),
            PF_MEMALLOC_NOIO | PF_LOCAL_THROTTLE,
            "{} ({}) is an I/O flusher: flags {flags:#x}",
            p.display(),
            comm.trim()
        );
    }
    assert!(reactors > 0, "found loopd's reactor threads");
}

fn filesystem_round_trip(kind: &str, cache: &str) {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("fs.img");
    create_sparse_image(&img, 256 << 20);
    let dev = attach_blockdev(&srv, kind, &img, &["--cache", cache]);
    if kind == "ublk" {
        assert_reactors_are_io_flushers(&srv);
    }
    assert_eq!(dev_size(&dev), 256 << 20);
    mkfs_ext4(&dev);
    let mnt = t.path().join("mnt");
    let m = Mount::new(&dev, &mnt, Some("discard"));
    write_random(&mnt.join("a"), 16);
    write_random(&mnt.join("b"), 24);
    let (a, b) = (md5(&mnt.join("a")), md5(&mnt.join("b")));
    m.unmount();
    drop_caches();
    let m = Mount::new(&dev, &mnt, None);
    assert_eq!(md5(&mnt.join("a")), a, "file a after remount ({cache})");
    assert_eq!(md5(&mnt.join("b")), b, "file b after remount ({cache})");
    let before = allocated_bytes(&img);
    fs::remove_file(mnt.join("b")).expect("rm b");
    sh(KCMD_TIMEOUT, "sync", [""; 0]);
    sh(KCMD_TIMEOUT, "fstrim", [mnt.as_os_str()]);
    let after = allocated_bytes(&img);
    assert!(
        after + (16 << 20) <= before,
        "fstrim reached the image as holes ({cache}): {before} -> {after} bytes allocated"
    );
    m.unmount();
    e2fsck_clean(&dev);
    srv.ctl_ok(&["detach", "fs"]);
    assert!(gone(&dev), "{} removed by detach", dev.display());
}

#[test]
fn ublk_filesystem_direct() {
    filesystem_round_trip("ublk", "direct");
}

#[test]
fn ublk_filesystem_buffered() {
    filesystem_round_trip("ublk", "buffered");
}

#[test]
fn nbd_filesystem_direct() {
    filesystem_round_trip("nbd", "direct");
}

#[test]
fn nbd_filesystem_buffered() {
    filesystem_round_trip("nbd", "buffered");
}

fn fio_verify(kind: &str, cache: &str, extra: &[&str]) {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("fio.img");
    create_sparse_image(&img, 64 << 20);
    let mut args = vec!["--cache", cache];
    args.extend_from_slice(extra);
    let dev = attach_blockdev(&srv, kind, &img, &args);
    for engine in ["libaio", "io_uring"] {
        sh(
            FIO_TIMEOUT,
            "fio",
            [
                "--name=v".to_string(),
                format!("--filename={}", dev.display()),
                format!("--ioengine={engine}"),
                "--direct=1".into(),
                "--rw=randwrite".into(),
                "--bs=4k".into(),
                "--iodepth=16".into(),
                "--numjobs=2".into(),
                "--size=8M".into(),
                "--offset_increment=16M".into(),
                "--verify=crc32c".into(),
                "--verify_fatal=1".into(),
                "--do_verify=1".into(),
                "--group_reporting".into(),
            ],
        );
    }
    srv.ctl_ok(&["detach", "fio"]);
}

#[test]
fn ublk_fio_verifies_direct() {
    fio_verify("ublk", "direct", &[]);
}

#[test]
fn ublk_fio_verifies_buffered() {
    fio_verify("ublk", "buffered", &[]);
}

#[test]
fn nbd_fio_verifies_direct_two_connections() {
    fio_verify("nbd", "direct", &["--connections", "2"]);
}

#[test]
fn nbd_fio_verifies_buffered() {
    fio_verify("nbd", "buffered", &[]);
}

fn read_only_device_refuses_writes(kind: &str) {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("ro.img");
    create_pattern_image(&img, 16 << 20, 7);
    let dev = attach_blockdev(&srv, kind, &img, &["--read-only"]);
    assert_eq!(
        sysblock(&dev, "ro"),
        "1",
        "the kernel sees a read-only disk"
    );
    let w = sh_status(
        KCMD_TIMEOUT,
        "dd",
        [
            "if=/dev/zero".to_string(),
            format!("of={}", dev.display()),
            "bs=4k".into(),
            "count=1".into(),
            "oflag=direct".into(),
        ],
    );
    assert!(
        !w.success(),
        "a write to a read-only ublk device fails: {w}"
    );
    let r = fs::File::open(&dev).expect("open for reading");
    let mut buf = vec![0u8; 4096];
    r.read_exact_at(&mut buf, 1 << 20).expect("read");
    assert_eq!(buf, pattern_bytes(7, 1 << 20, 4096), "reads see the image");
    drop(r);
    assert_file_pattern(&img, 0, 16 << 20, 7, "image untouched");
    srv.ctl_ok(&["detach", "ro"]);
}

#[test]
fn ublk_read_only_device_refuses_writes() {
    read_only_device_refuses_writes("ublk");
}

#[test]
fn nbd_read_only_device_refuses_writes() {
    read_only_device_refuses_writes("nbd");
}

#[test]
fn offset_and_size_limit_make_a_window() {
    for kind in ["ublk", "nbd"] {
        window(kind);
    }
}

fn window(kind: &str) {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("win.img");
    create_pattern_image(&img, 32 << 20, 3);
    let dev = attach_blockdev(
        &srv,
        kind,
        &img,
        &["--offset", "4M", "--size-limit", "8M", "--cache", "direct"],
    );
    assert_eq!(dev_size(&dev), 8 << 20);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&dev)
        .expect("open");
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 0).expect("read at 0");
    assert_eq!(buf, pattern_bytes(3, 4 << 20, 4096), "device 0 is file 4M");
    f.write_all_at(&[0xab; 4096], (8 << 20) - 4096)
        .expect("write the last block");
    f.sync_all().expect("fsync");
    drop(f);
    assert_file_filled(
        &img,
        (12 << 20) - 4096,
        4096,
        0xab,
        "written inside the window",
    );
    assert_file_pattern(&img, 12 << 20, 4096, 3, "nothing past the window");
    srv.ctl_ok(&["detach", "win"]);
}

/// `loopd resize` and `loopd set` on a live block device go as far as the
/// kernel follows. A ublk device grows live where the kernel has
/// `UPDATE_SIZE` (6.14+, the newest kernel of the VM matrix): the guest's
/// `blockdev --getsize64` sees the new size at once and a mounted ext4 grows
/// online (`resize2fs`) with its file intact and `e2fsck` clean. On 6.12 the
/// resize is refused, saying it needs 6.14, and nothing changes; the kernel NBD
/// client cannot change a connected device's size on any kernel; a block-size
/// change is refused everywhere.
#[test]
fn set_and_resize_go_as_far_as_the_kernel_follows() {
    for kind in ["ublk", "nbd"] {
        set_and_resize(kind);
    }
}

fn set_and_resize(kind: &str) {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("rs.img");
    create_sparse_image(&img, 16 << 20);
    let dev = attach_blockdev(&srv, kind, &img, &[]);
    assert_eq!(dev_size(&dev), 16 << 20);
    let grows = kind == "ublk" && kernel_at_least(6, 14);
    let mnt = t.path().join("mnt");
    let mut fs_before = None;
    let m = grows.then(|| {
        mkfs_ext4(&dev);
        let m = Mount::new(&dev, &mnt, None);
        write_random(&mnt.join("a"), 4);
        fs_before = Some((md5(&mnt.join("a")), fs_size(&mnt)));
        m
    });
    fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .expect("open image")
        .set_len(32 << 20)
        .expect("grow image");
    if let (Some(m), Some((a, small))) = (m, fs_before) {
        let out = srv.ctl_ok(&["resize", "rs"]);
        eprintln!(
            "{} grows live on {}: {out}",
            dev.display(),
            kernel_release()
        );
        let size = sh(
            KCMD_TIMEOUT,
            "blockdev",
            [OsArg::from("--getsize64"), dev.clone().into()],
        );
        assert_eq!(
            size.stdout.trim(),
            (32u64 << 20).to_string(),
            "blockdev --getsize64 {} after loopd resize",
            dev.display()
        );
        sh(KCMD_TIMEOUT, "resize2fs", [dev.as_os_str()]);
        let big = fs_size(&mnt);
        assert!(
            big > small + (12 << 20),
            "the mounted ext4 grew online: {small} -> {big} bytes"
        );
        m.unmount();
        drop_caches();
        let m = Mount::new(&dev, &mnt, None);
        assert_eq!(md5(&mnt.join("a")), a, "the file after the grow");
        m.unmount();
        e2fsck_clean(&dev);
    } else {
        let out = srv.ctl_err(&["resize", "rs"], "unavailable");
        let why = if kind == "ublk" { "6.14" } else { "size" };
        assert!(out.stderr.contains(why), "the refusal says why: {out}");
        assert_eq!(dev_size(&dev), 16 << 20, "nothing changed");
    }
    let out = srv.ctl_err(
        &["set", "rs", "--block-size", "4096", "--force"],
        "unavailable",
    );
    assert!(out.stderr.contains("block size"), "{out}");
    srv.ctl_ok(&["detach", "rs"]);
}

/// The size of the filesystem mounted at `mnt`, in bytes (`df`).
fn fs_size(mnt: &Path) -> u64 {
    let out = sh(
        KCMD_TIMEOUT,
        "df",
        [OsArg::from("--output=size"), "-B1".into(), mnt.into()],
    );
    out.stdout
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("df {}: {}", mnt.display(), out.stdout))
}

#[test]
fn detach_refuses_while_mounted_and_force_removes() {
    for kind in ["ublk", "nbd"] {
        detach_refusals(kind);
    }
}

fn detach_refusals(kind: &str) {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("busy.img");
    create_sparse_image(&img, 64 << 20);
    let dev = attach_blockdev(&srv, kind, &img, &[]);
    mkfs_ext4(&dev);
    let mnt = t.path().join("mnt");
    let m = Mount::new(&dev, &mnt, None);
    let out = srv.ctl_err(&["detach", "busy"], "busy");
    assert!(
        out.stderr.contains("mounted on") && out.stderr.contains(mnt.to_str().expect("utf-8")),
        "the refusal says where it is mounted: {out}"
    );
    assert!(!gone(&dev), "still there after the refusal");
    m.unmount();
    // Mounted only in another mount namespace (a container's, here
    // `unshare -m`'s): this daemon's own mount table does not show it, the
    // refusal does, naming the namespace's process.
    mounted_in_another_namespace_refuses_detach(&srv, &dev, &t.path().join("ns-mnt"));
    // Held open by another process: refused, and named.
    let mut holder = std::process::Command::new("sleep")
        .arg("60")
        .stdin(fs::File::open(&dev).expect("open"))
        .spawn()
        .expect("spawn holder");
    let out = srv.ctl_err(&["detach", "busy"], "busy");
    assert!(out.stderr.contains("open by \"sleep\""), "{out}");
    srv.ctl_ok(&["detach", "busy", "--force"]);
    assert!(
        matches!(holder.try_wait(), Ok(None)),
        "the forced detach returned while the opener still holds the disk (it does not wait \
         for the opener to close it)"
    );
    if kind == "ublk" {
        assert!(gone(&dev), "--force removes it at once");
    } else {
        // The kernel NBD client keeps a device its opener holds configured
        // (every I/O to it fails) until the opener closes it.
        let mut buf = vec![0u8; 4096];
        let r = fs::File::open(&dev).and_then(|f| f.read_exact_at(&mut buf, 0));
        assert!(r.is_err(), "I/O to a force-detached nbd device fails");
    }
    let _ = holder.kill();
    let _ = holder.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gone(&dev) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        gone(&dev),
        "{} is gone once its opener closed it",
        dev.display()
    );
}

#[test]
fn ublk_kill_9_and_restart_recovers_a_mounted_filesystem() {
    kill_9_and_restart("ublk", "recovered /dev/ublkb");
}

#[test]
fn nbd_kill_9_and_restart_reconnects_a_mounted_filesystem() {
    kill_9_and_restart("nbd", "reconnected /dev/nbd");
}

fn kill_9_and_restart(kind: &str, says: &str) {
    let t = scratch();
    let mut srv = daemon(t.path());
    let img = t.path().join("rec.img");
    create_sparse_image(&img, 128 << 20);
    let dev = attach_blockdev(&srv, kind, &img, &["--cache", "buffered"]);
    mkfs_ext4(&dev);
    let mnt = t.path().join("mnt");
    let m = Mount::new(&dev, &mnt, None);
    write_random(&mnt.join("before"), 8);
    let before = md5(&mnt.join("before"));
    srv.kill9();
    assert!(dev.exists(), "the disk stays when the daemon dies");
    // I/O issued now waits for the new daemon instead of failing.
    let bg_path = mnt.join("during");
    let bg = std::thread::spawn(move || {
        write_random(&bg_path, 4);
        md5(&bg_path)
    });
    std::thread::sleep(Duration::from_secs(1));
    let srv = daemon(t.path());
    let during = bg.join().expect("the write during the outage completed");
    assert!(
        srv.stderr_text().contains(says),
        "the restarted daemon took the device back:\n{}",
        srv.stderr_text()
    );
    assert_eq!(md5(&mnt.join("before")), before, "fsync'd data intact");
    remount_and_check(m, &dev, &mnt, &[("before", &before), ("during", &during)]);
    srv.ctl_ok(&["detach", "rec"]);
    assert!(gone(&dev));
}

#[test]
fn ublk_restart_with_keep_blockdevs_keeps_a_mounted_filesystem_under_writes() {
    keep_and_restart("ublk", "recovered /dev/ublkb");
}

#[test]
fn nbd_restart_with_keep_blockdevs_keeps_a_mounted_filesystem_under_writes() {
    keep_and_restart("nbd", "reconnected /dev/nbd");
}

/// `serve --keep-blockdevs`, SIGTERM while a direct-I/O writer runs on the
/// mounted disk: the daemon exits 0 saying it left the disk (quiesced, where
/// the kernel offers `UBLK_F_QUIESCE`), the disk stays, the writer waits and
/// finishes once a daemon on the same state file takes the disk back, and
/// every byte written before, during and after the restart is there after a
/// remount, with a clean `e2fsck`.
fn keep_and_restart(kind: &str, says: &str) {
    let t = scratch();
    let mut srv = Server::daemon()
        .socket_path(&t.path().join("nbd.sock"))
        .args([OsArg::from("--state"), t.path().join("loopd.state").into()])
        .args(["--keep-blockdevs"])
        .start();
    let img = t.path().join("keep.img");
    create_sparse_image(&img, 128 << 20);
    let dev = attach_blockdev(&srv, kind, &img, &["--cache", "direct"]);
    mkfs_ext4(&dev);
    let mnt = t.path().join("mnt");
    let m = Mount::new(&dev, &mnt, None);
    write_random(&mnt.join("before"), 4);
    let before = md5(&mnt.join("before"));
    let src = t.path().join("src");
    write_random(&src, 32);
    let want = md5(&src);
    // 8,192 direct 4 KiB writes, each to the disk at once (seconds under
    // emulation): some are in flight when the daemon stops.
    let mut writer = Reaped(
        std::process::Command::new("dd")
            .arg(format!("if={}", src.display()))
            .arg(format!("of={}", mnt.join("during").display()))
            .args(["bs=4k", "oflag=direct", "conv=fsync", "status=none"])
            .spawn()
            .expect("dd runs"),
    );
    let writer = &mut writer.0;
    std::thread::sleep(Duration::from_millis(300));
    let stopping = Instant::now();
    let st = srv.stop();
    let log = srv.stderr_text();
    eprintln!(
        "{} {kind}: the stop took {:?}: {}",
        kernel_release(),
        stopping.elapsed(),
        log.lines().find(|l| l.contains("left for")).unwrap_or("-")
    );
    assert!(
        st.success(),
        "a stop that keeps the disks exits 0 ({st}):\n{log}"
    );
    assert!(
        log.contains("left for the next daemon"),
        "the daemon says it left the disk:\n{log}"
    );
    if kind == "ublk" {
        let quiesce = kernel_at_least(6, 16);
        assert_eq!(
            log.contains("quiesced"),
            quiesce,
            "QUIESCE_DEV used exactly where the kernel has it ({}):\n{log}",
            kernel_release()
        );
        // Elsewhere (6.12) the daemon holds the disk's requests until they
        // stop coming before its queues' commands are cancelled (a request
        // arriving then can be completed twice by that kernel: an oops).
        assert_eq!(
            log.contains("left for the next daemon on this state file (held: "),
            !quiesce,
            "held exactly where the kernel cannot quiesce ({}):\n{log}",
            kernel_release()
        );
    }
    assert!(dev.exists(), "the disk stays when the daemon stops");
    assert!(
        writer.try_wait().expect("wait dd").is_none(),
        "the writer waits for the next daemon (its I/O neither fails nor finishes)"
    );
    std::thread::sleep(Duration::from_millis(500));
    let mut srv = daemon(t.path());
    let deadline = Instant::now() + FIO_TIMEOUT;
    let st = loop {
        if let Some(st) = writer.try_wait().expect("wait dd") {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "dd did not finish after the restart"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(st.success(), "no write failed across the restart: dd {st}");
    assert!(
        srv.stderr_text().contains(says),
        "the restarted daemon took the device back:\n{}",
        srv.stderr_text()
    );
    assert_eq!(md5(&mnt.join("during")), want, "what dd wrote, read back");
    remount_and_check(m, &dev, &mnt, &[("before", &before), ("during", &want)]);
    // A stop without --keep-blockdevs removes the disk.
    srv.stop_ok();
    assert!(gone(&dev), "{} removed by a plain stop", dev.display());
}

/// A disk the kernel holds with no process, mount or holder link showing it:
/// a kernel loop device on top is found by its backing file and refuses a
/// detach without --force on every kernel (busy, exit 5, naming the loop
/// device); a holder nothing shows (an io_uring registered file), where the
/// kernel offers `UBLK_F_SAFE_STOP_DEV` (7.0+), is refused by the kernel
/// itself (TRY_STOP_DEV). The disk goes on serving its bytes; once nothing
/// holds it the same detach removes it.
#[test]
fn ublk_detach_without_force_is_refused_while_the_kernel_holds_the_disk() {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("held.img");
    create_pattern_image(&img, 1 << 20, 5);
    let dev = attach_blockdev(&srv, "ublk", &img, &[]);
    let st = srv.ctl_json(&["status", "held"]);
    let safe = json_names(&st, "ublk_fast_paths")
        .iter()
        .any(|p| p == "safe_stop_dev");
    assert_eq!(
        safe,
        json_names(&st, "ublk_kernel_features")
            .iter()
            .any(|f| f == "safe_stop_dev"),
        "made with safe_stop_dev exactly where offered"
    );
    let out = sh(
        KCMD_TIMEOUT,
        "losetup",
        [
            OsArg::from("-f"),
            "--show".into(),
            "-r".into(),
            dev.clone().into(),
        ],
    );
    let lo = PathBuf::from(out.stdout.trim());
    let lo_guard = LoopOnTop(lo.clone());
    // A loop device on top holds the disk from the kernel (no process, no
    // mount, no holder link): loopd's own look finds it by the loop
    // device's backing file, on every kernel.
    let out = srv.ctl(&["detach", "held"]);
    assert_eq!(out.status.code(), Some(5), "busy:\n{out}");
    assert!(
        out.stderr.contains("the backing file of loop device")
            && out.stderr.contains(lo.to_str().expect("utf-8"))
            && out.stderr.contains("--force"),
        "says who holds it and what to do:\n{out}"
    );
    assert_still_serves(&lo);
    drop(lo_guard);
    if safe {
        // A holder loopd cannot see: the disk open only as an io_uring
        // registered file (its descriptor closed, so no /proc/*/fd entry).
        // The kernel's TRY_STOP_DEV still refuses.
        let ring = io_uring::IoUring::new(2).expect("io_uring");
        let f = fs::File::open(&dev).expect("open the disk");
        ring.submitter()
            .register_files(&[std::os::fd::AsRawFd::as_raw_fd(&f)])
            .expect("register the disk as a fixed file");
        drop(f);
        let out = srv.ctl(&["detach", "held"]);
        assert_eq!(out.status.code(), Some(5), "busy:\n{out}");
        assert!(
            out.stderr.contains("is open") && out.stderr.contains("--force"),
            "says why and what to do:\n{out}"
        );
        assert_still_serves(&dev);
        drop(ring);
    } else {
        eprintln!(
            "{}: no safe_stop_dev; a holder loopd cannot see (an io_uring registered file) \
             is not guarded against",
            kernel_release()
        );
    }
    srv.ctl_ok(&["detach", "held"]);
    assert!(
        gone(&dev),
        "{} removed once nothing holds it",
        dev.display()
    );
}

/// `path` (the disk, or a loop device on it) reads the pattern image's bytes
/// (pattern 5) at 8 KiB.
fn assert_still_serves(path: &Path) {
    let mut buf = vec![0u8; 4096];
    fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut buf, 8192))
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert_eq!(buf, pattern_bytes(5, 8192, 4096), "the disk still serves");
}

/// `dev` (an ext4 disk of device "busy") mounted at `mnt` in a new mount
/// namespace only: a detach without `--force` is refused naming that
/// namespace's process; its mount goes when that process is reaped.
fn mounted_in_another_namespace_refuses_detach(srv: &Server, dev: &Path, mnt: &Path) {
    use std::io::BufRead;
    fs::create_dir_all(mnt).expect("mount point");
    let script = format!(
        "mount {} {} && echo mounted && exec sleep 60",
        dev.display(),
        mnt.display()
    );
    let mut child = std::process::Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("unshare (util-linux)");
    let out = child.stdout.take().expect("stdout");
    // unshare and sh exec: the namespace's one process keeps this pid.
    let pid = child.id();
    let ns = Reaped(child);
    let mut line = String::new();
    // Bounded: the line comes, or sh exits (mount failed) and the pipe closes.
    std::io::BufReader::new(out)
        .read_line(&mut line)
        .expect("read");
    assert_eq!(line.trim(), "mounted", "mounted in the new namespace");
    assert!(
        !fs::read_to_string("/proc/self/mountinfo")
            .expect("mountinfo")
            .contains(mnt.to_str().expect("utf-8")),
        "not mounted in the test's namespace"
    );
    let out = srv.ctl_err(&["detach", "busy"], "busy");
    assert!(
        out.stderr.contains("in the mount namespace of \"")
            && out.stderr.contains(&format!("(pid {pid})"))
            && out.stderr.contains(mnt.to_str().expect("utf-8"))
            && out.stderr.contains("--force"),
        "the refusal names the other namespace's mount: {out}"
    );
    assert!(!gone(dev), "still there after the refusal");
    // The namespace, and its mount, go with its last process (reaped here).
    drop(ns);
}

/// `losetup -d` of a loop device when the test ends, also on a panic.
struct LoopOnTop(PathBuf);

impl Drop for LoopOnTop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .arg("-d")
            .arg(&self.0)
            .status();
    }
}

/// A child process killed and reaped when the test ends, also on a panic
/// (waited for 10 s at most: one stuck on a disk whose server is gone cannot
/// die until the disk goes, and is left to the VM's end).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn ublk_fifty_devices_attach_and_detach() {
    let t = scratch();
    let srv = daemon(t.path());
    let start = Instant::now();
    let mut devs = Vec::new();
    for i in 0..50u8 {
        let img = t.path().join(format!("m{i}.img"));
        create_pattern_image(&img, 1 << 20, i);
        let dev = attach_blockdev(&srv, "ublk", &img, &["--queues", "1", "--queue-depth", "4"]);
        devs.push((img, dev, i));
    }
    for (_, dev, i) in &devs {
        let mut buf = vec![0u8; 4096];
        fs::File::open(dev)
            .expect("open")
            .read_exact_at(&mut buf, 8192)
            .expect("read");
        assert_eq!(buf, pattern_bytes(*i, 8192, 4096), "{}", dev.display());
    }
    let listed = srv.ctl_json(&["list"]);
    assert_eq!(listed.arr().len(), 50);
    for (img, dev, _) in &devs {
        let name = img.file_stem().expect("stem").to_str().expect("utf-8");
        srv.ctl_ok(&["detach", name]);
        assert!(!dev.exists(), "{} removed", dev.display());
    }
    eprintln!(
        "50 ublk devices attached, read and detached in {:?}",
        start.elapsed()
    );
}

/// One `loopd attach --blockdev ublk IMG…` (an `attach_batch`, whose block
/// devices are made several at once): every outcome comes back in the
/// images' order, the image that cannot be opened fails alone, and each
/// device printed serves its own image's bytes; a detach removes each.
#[test]
fn ublk_batch_outcomes_in_order_each_device_its_image() {
    let t = scratch();
    let srv = daemon(t.path());
    let mut imgs = Vec::new();
    for i in 0..24u8 {
        let img = t.path().join(format!("b{i}.img"));
        if i != 7 {
            create_pattern_image(&img, 1 << 20, i);
        }
        imgs.push(img);
    }
    let mut args = vec!["attach", "--blockdev", "ublk", "--queues", "1"];
    args.extend(["--queue-depth", "4", "--json"]);
    args.extend(imgs.iter().map(|p| p.to_str().expect("utf-8 path")));
    let out = srv.ctl(&args);
    assert!(!out.success(), "b7.img is missing: the batch fails:\n{out}");
    let items = Json::parse(&out.stdout);
    assert_eq!(items.arr().len(), 24, "{out}");
    let mut devs = Vec::new();
    for (i, (item, img)) in items.arr().iter().zip(&imgs).enumerate() {
        assert_eq!(
            item.at("image").str(),
            img.to_str().expect("utf-8"),
            "{out}"
        );
        if i == 7 {
            assert!(!item.at("ok").bool(), "{out}");
            assert!(!img.exists(), "a failed attach creates nothing");
            continue;
        }
        assert!(item.at("ok").bool(), "{out}");
        let r = item.at("result");
        assert_eq!(r.at("name").str(), format!("b{i}"), "{out}");
        let dev = PathBuf::from(r.at("blockdev").str());
        let mut buf = vec![0u8; 4096];
        fs::File::open(&dev)
            .expect("open")
            .read_exact_at(&mut buf, 8192)
            .expect("read");
        let i = u8::try_from(i).expect("small");
        assert_eq!(buf, pattern_bytes(i, 8192, 4096), "{}", dev.display());
        devs.push((format!("b{i}"), dev));
    }
    assert_eq!(srv.ctl_json(&["list"]).arr().len(), 23);
    for (name, dev) in &devs {
        srv.ctl_ok(&["detach", name]);
        assert!(gone(dev), "{} removed", dev.display());
    }
}

/// `--partscan`: the partition devices exist the moment attach returns (it
/// prints them), and p2 reads p2's bytes; for ublk and for nbd.
fn partitions_on_return(kind: &str) {
    use common::gpt::{TWO_PARTS, two_partition_image};
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("gpt.img");
    two_partition_image(&img, 9);
    let out = srv.ctl_ok(&[
        "attach",
        img.to_str().expect("utf-8"),
        "--blockdev",
        kind,
        "--partscan",
    ]);
    let lines: Vec<&str> = out.stdout.lines().collect();
    let dev = PathBuf::from(lines[1]);
    let sep = "p";
    let p1 = PathBuf::from(format!("{}{sep}1", dev.display()));
    let p2 = PathBuf::from(format!("{}{sep}2", dev.display()));
    // Stat at once: no waiting, no udevadm settle.
    assert!(
        p1.exists() && p2.exists(),
        "partitions exist on return:\n{out}"
    );
    assert!(
        out.stdout.contains(p1.to_str().expect("utf-8"))
            && out.stdout.contains(p2.to_str().expect("utf-8")),
        "attach prints the partitions:\n{out}"
    );
    let p = TWO_PARTS[1];
    let mut buf = vec![0u8; 4096];
    fs::File::open(&p2)
        .expect("open p2")
        .read_exact_at(&mut buf, 0)
        .expect("read p2");
    assert_eq!(
        buf,
        pattern_bytes(9, p.start_bytes(), 4096),
        "p2 is partition 2"
    );
    srv.ctl_ok(&["detach", "gpt"]);
    assert!(gone(&dev));
}

#[test]
fn ublk_partitions_exist_when_attach_returns() {
    partitions_on_return("ublk");
}

#[test]
fn nbd_partitions_exist_when_attach_returns() {
    partitions_on_return("nbd");
}

/// Without `--partscan`, a ublk device on a kernel with
/// `UBLK_F_NO_AUTO_PART_SCAN` (7.0+) gets no partition devices, as `losetup`
/// without `-P`: START_DEV reads nothing through the queues. The table is
/// there for whoever asks: `blockdev --rereadpt` makes them (the kernel lifts
/// its suppression once the disk is added). On an older kernel the driver
/// always scans: the partitions are there.
#[test]
fn ublk_without_partscan_scans_only_where_the_kernel_always_does() {
    use common::gpt::two_partition_image;
    use loopd::frontend::ublk::ctrl::UblkCtrl;
    use loopd::frontend::ublk::sys::UBLK_F_NO_AUTO_PART_SCAN;
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("gpt.img");
    two_partition_image(&img, 5);
    let dev = attach_blockdev(&srv, "ublk", &img, &[]);
    let features = UblkCtrl::open()
        .and_then(|mut c| c.features())
        .expect("GET_FEATURES");
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let major: u32 = release
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .expect("major");
    assert!(
        major < 7 || features & UBLK_F_NO_AUTO_PART_SCAN != 0,
        "kernel {release}: 7.0 and later have UBLK_F_NO_AUTO_PART_SCAN, and loopd sees it"
    );
    let p1 = PathBuf::from(format!("{}p1", dev.display()));
    let name = dev
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let sys_p1 = PathBuf::from(format!("/sys/block/{name}/{name}p1"));
    if features & UBLK_F_NO_AUTO_PART_SCAN != 0 {
        // Give a scan that should not happen time to show.
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            !sys_p1.exists() && !p1.exists(),
            "no partition devices without --partscan on a kernel that can leave the table alone"
        );
        let out = std::process::Command::new("blockdev")
            .arg("--rereadpt")
            .arg(&dev)
            .output()
            .expect("run blockdev");
        assert!(
            out.status.success(),
            "blockdev --rereadpt {}: {}",
            dev.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while !p1.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(p1.exists(), "a scan asked for afterwards finds the table");
    } else {
        assert!(
            sys_p1.exists(),
            "a kernel without UBLK_F_NO_AUTO_PART_SCAN scans when the disk is added"
        );
    }
    srv.ctl_ok(&["detach", "gpt"]);
    assert!(gone(&dev));
}

/// A daemon with `--kernel-timeout 5` and the test hook `hook=value` in its
/// environment.
fn kernel_timeout_daemon(dir: &Path, hook: &str, value: &str) -> Server {
    Server::daemon()
        .socket_path(&dir.join("nbd.sock"))
        .args([
            OsArg::from("--state"),
            dir.join("loopd.state").into(),
            "--kernel-timeout".into(),
            "5".into(),
        ])
        .env(hook, value)
        .start()
}

/// `loopd attach IMG --blockdev KIND` on a thread of its own: its output and
/// how long it took come on the channel.
fn attach_in_background(
    srv: &Server,
    img: &Path,
    kind: &str,
) -> std::sync::mpsc::Receiver<(Out, Duration)> {
    let control = srv.control().to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    let img = img.to_str().expect("utf-8").to_owned();
    let kind = kind.to_owned();
    std::thread::spawn(move || {
        let start = Instant::now();
        let out = loopd_ctl(&control, &["attach", &img, "--blockdev", &kind]);
        let _ = tx.send((out, start.elapsed()));
    });
    rx
}

/// Half a second into an attach that waits for the kernel: `list` answers
/// within 2 s. Returns the names it listed.
fn list_answers_meanwhile(srv: &Server) -> Vec<String> {
    std::thread::sleep(Duration::from_millis(500));
    let listed = Instant::now();
    let names = srv.device_names();
    assert!(
        listed.elapsed() < Duration::from_secs(2),
        "list answered in {:?} while an attach waits for the kernel",
        listed.elapsed()
    );
    names
}

/// A ublk control command the kernel never completes: with the test hook
/// (`LOOPD_TEST_UBLK_NO_FETCH`, feature `vm-tests`) queue 0 of device
/// "stuck" never fetches tag 0, so START_DEV waits in the kernel forever.
/// The attach fails once `--kernel-timeout` (5 s here) has passed, naming the
/// command and the time; meanwhile `list` answers and a second device is
/// attached and serves bytes; afterwards it still does, and the daemon stops
/// cleanly.
#[test]
fn ublk_start_dev_the_kernel_never_completes_fails_the_attach_at_the_deadline() {
    require_root();
    require_module("ublk_drv");
    let t = scratch();
    let mut srv = kernel_timeout_daemon(t.path(), "LOOPD_TEST_UBLK_NO_FETCH", "stuck");
    let stuck_img = t.path().join("stuck.img");
    create_sparse_image(&stuck_img, 16 << 20);
    let good_img = t.path().join("good.img");
    create_pattern_image(&good_img, 16 << 20, 7);

    let rx = attach_in_background(&srv, &stuck_img, "ublk");
    // While START_DEV of "stuck" hangs in the kernel: the daemon answers, and
    // another device is made and serves its bytes.
    let names = list_answers_meanwhile(&srv);
    assert!(!names.contains(&"good".to_string()), "{names:?}");
    let made = Instant::now();
    let dev = attach_blockdev(&srv, "ublk", &good_img, &[]);
    assert!(
        rx.try_recv().is_err(),
        "the second attach ({:?}) finished before the stuck one failed",
        made.elapsed()
    );
    let check_bytes = |dev: &Path| {
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dev)
            .expect("open the block device");
        let mut got = vec![0u8; 64 << 10];
        f.read_exact_at(&mut got, 1 << 20).expect("read");
        assert_bytes_eq(&got, &pattern_bytes(7, 1 << 20, 64 << 10), 1 << 20, "good");
        f.write_all_at(&[0x5a; 4096], 2 << 20).expect("write");
        f.sync_all().expect("fsync");
        assert_eq!(read_range(&good_img, 2 << 20, 4096), vec![0x5a; 4096]);
    };
    check_bytes(&dev);

    let (out, took) = rx
        .recv_timeout(Duration::from_secs(90))
        .expect("the attach of a device whose START_DEV never completes returned");
    assert_ctl_error(&out, "io");
    let text = out.to_string();
    for want in ["START_DEV", "did not answer within 5.0s"] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(60),
        "the attach failed after {took:?}"
    );
    let names = srv.device_names();
    assert!(
        !names.contains(&"stuck".to_string()),
        "a failed attach leaves no device: {names:?}"
    );
    // The other device still serves I/O.
    check_bytes(&dev);
    srv.ctl_ok(&["detach", "good"]);
    assert!(gone(&dev));
    let stopped = Instant::now();
    srv.stop_ok();
    assert!(
        stopped.elapsed() < Duration::from_secs(30),
        "the daemon stopped in {:?}",
        stopped.elapsed()
    );
}

/// A netlink CONNECT the kernel does not take within `--kernel-timeout`
/// (held back 12 s by a test-only hook of the daemon, as a driver waiting on
/// a lock inside the sending call would be): the attach fails after the 5 s
/// deadline, naming the call and the time, while `list` answers; no device is
/// left in the daemon; once the kernel takes the connect late, the
/// `/dev/nbdN` it made is disconnected again (its backend identifier gone).
#[test]
fn nbd_connect_the_kernel_does_not_take_fails_the_attach_at_the_deadline() {
    require_root();
    require_module("nbd");
    let t = scratch();
    let mut srv = kernel_timeout_daemon(t.path(), "LOOPD_TEST_NBD_CONNECT_DELAY", "12");
    let img = t.path().join("late.img");
    create_sparse_image(&img, 16 << 20);
    let rx = attach_in_background(&srv, &img, "nbd");
    list_answers_meanwhile(&srv);
    let (out, took) = rx
        .recv_timeout(Duration::from_secs(90))
        .expect("the attach of a connect the kernel does not take returned");
    assert_ctl_error(&out, "io");
    let text = out.to_string();
    for want in ["connect", "did not answer within 5.0s"] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(11),
        "the attach failed after {took:?} (deadline 5 s, the kernel took it after 12 s)"
    );
    assert!(
        !srv.device_names().contains(&"late".to_string()),
        "a failed attach leaves no device"
    );
    // The kernel takes the connect at 12 s; the device it made is
    // disconnected again.
    let backend_left = || {
        fs::read_dir("/sys/block")
            .expect("/sys/block")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("nbd"))
            .any(|e| {
                fs::read_to_string(e.path().join("backend"))
                    .is_ok_and(|b| b.trim_end() == "loopd:late")
            })
    };
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let log = srv.stderr_text();
        if log.contains("disconnected again") && !backend_left() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the late connect was not undone: backend left {}; log:\n{log}",
            backend_left()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    srv.stop_ok();
}

/// The kernel NBD client replaces only connections it has seen die and
/// silently drops a socket given while the old connection lives. loopd's
/// reconnect (a restarted daemon finds its `/dev/nbdN` by the backend
/// identifier `loopd:NAME`) must notice: a second daemon attaching a device of
/// the same name while the first one still serves it is refused within
/// `--kernel-timeout`, naming the device, instead of being told
/// "reconnected" to a device that still serves the first daemon's image; the
/// first daemon's device keeps its bytes. Then `kill -9` of the first daemon
/// and a restart right away (no pause) reconnects, and the device serves the
/// right bytes again.
#[test]
fn nbd_reconnect_never_takes_a_device_whose_old_connection_lives() {
    let t = scratch();
    let a_dir = t.path().join("a");
    let b_dir = t.path().join("b");
    fs::create_dir_all(&a_dir).expect("mkdir a");
    fs::create_dir_all(&b_dir).expect("mkdir b");
    let a_img = a_dir.join("same.img");
    create_pattern_image(&a_img, 16 << 20, 1);
    let b_img = b_dir.join("same.img");
    create_pattern_image(&b_img, 16 << 20, 2);
    let mut a = daemon(&a_dir);
    let dev = attach_blockdev(&a, "nbd", &a_img, &["--connections", "2"]);
    let read = |dev: &Path| {
        let f = fs::File::open(dev).expect("open the block device");
        let mut got = vec![0u8; 64 << 10];
        f.read_exact_at(&mut got, 3 << 20).expect("read");
        got
    };
    assert_bytes_eq(
        &read(&dev),
        &pattern_bytes(1, 3 << 20, 64 << 10),
        3 << 20,
        "a",
    );

    let mut b = Server::daemon()
        .socket_path(&b_dir.join("nbd.sock"))
        .args([
            OsArg::from("--state"),
            b_dir.join("loopd.state").into(),
            "--kernel-timeout".into(),
            "2".into(),
        ])
        .start();
    let started = Instant::now();
    let out = b.ctl(&[
        "attach",
        b_img.to_str().expect("utf-8"),
        "--blockdev",
        "nbd",
    ]);
    assert_ctl_error(&out, "busy");
    let text = out.to_string();
    for want in [
        dev.to_str().expect("utf-8"),
        "still has live connections",
        "another server",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "refused after {:?}",
        started.elapsed()
    );
    assert!(!b.device_names().contains(&"same".to_string()));
    b.stop_ok();
    // The first daemon's device still serves its own image, over both connections.
    drop_caches();
    assert_bytes_eq(
        &read(&dev),
        &pattern_bytes(1, 3 << 20, 64 << 10),
        3 << 20,
        "a after b",
    );
    a.wait_clients("same", 2, Duration::from_secs(10));

    // kill -9 and an immediate restart: the new connections replace the dead ones.
    a.kill9();
    let a = daemon(&a_dir);
    assert!(
        a.stderr_text().contains("reconnected /dev/nbd"),
        "{}",
        a.stderr_text()
    );
    a.wait_clients("same", 2, Duration::from_secs(10));
    drop_caches();
    assert_bytes_eq(
        &read(&dev),
        &pattern_bytes(1, 3 << 20, 64 << 10),
        3 << 20,
        "a restarted",
    );
    a.ctl_ok(&["detach", "same"]);
}

/// `status` and `list --json` name the ublk features the kernel offers (read
/// once with GET_FEATURES) and the fast paths the device uses; 6.12 has none
/// of the 6.16+ ones. A kernel NBD device has neither field.
#[test]
fn ublk_status_names_kernel_features_and_fast_paths() {
    let t = scratch();
    let srv = daemon(t.path());
    let img = t.path().join("fp.img");
    create_sparse_image(&img, 16 << 20);
    let dev = attach_blockdev(&srv, "ublk", &img, &["--cache", "direct"]);
    let st = srv.ctl_json(&["status", "fp"]);
    let listed = srv.ctl_json(&["list"]);
    let row = listed
        .arr()
        .iter()
        .find(|d| d["name"] == "fp")
        .unwrap_or_else(|| panic!("fp listed: {listed}"));
    let features = json_names(&st, "ublk_kernel_features");
    let paths = json_names(&st, "ublk_fast_paths");
    eprintln!(
        "{}: features {features:?}, fast paths {paths:?}",
        kernel_release()
    );
    assert_eq!(
        json_names(row, "ublk_kernel_features"),
        features,
        "list says the same"
    );
    assert_eq!(
        json_names(row, "ublk_fast_paths"),
        paths,
        "list says the same"
    );
    for f in ["user_recovery", "cmd_ioctl_encode"] {
        assert!(features.iter().any(|x| x == f), "{f} in {features:?}");
    }
    let new = ["auto_buf_reg", "quiesce", "per_io_daemon"];
    for f in new {
        assert_eq!(
            features.iter().any(|x| x == f),
            kernel_at_least(6, 16),
            "{f} offered by {} (6.16+): {features:?}",
            kernel_release()
        );
    }
    for p in &paths {
        assert!(features.contains(p), "fast path {p} is a kernel feature");
    }
    if !kernel_at_least(6, 16) {
        assert!(paths.is_empty(), "no fast path before 6.16: {paths:?}");
    }
    for f in ["no_auto_part_scan", "quiesce", "safe_stop_dev"] {
        assert_eq!(
            paths.iter().any(|p| p == f),
            features.iter().any(|x| x == f),
            "a device is made with {f} exactly where the kernel offers it: {paths:?}"
        );
    }
    let human = srv.ctl_ok(&["status", "fp"]).stdout;
    let shown = if paths.is_empty() {
        "none".to_owned()
    } else {
        paths.join(" ")
    };
    assert!(
        human.contains(&format!("\nublk_fast_paths: {shown}\n")),
        "status says the fast paths:\n{human}"
    );
    assert!(
        human.contains(&format!("\nublk_kernel_features: {}\n", features.join(" "))),
        "status says the kernel's features:\n{human}"
    );
    srv.ctl_ok(&["detach", "fp"]);
    assert!(gone(&dev));

    let dev = attach_blockdev(&srv, "nbd", &img, &[]);
    let st = srv.ctl_json(&["status", "fp"]);
    assert!(
        st.get("ublk_fast_paths").is_none() && st.get("ublk_kernel_features").is_none(),
        "no ublk fields on {}: {st}",
        dev.display()
    );
    srv.ctl_ok(&["detach", "fp"]);
    assert!(gone(&dev));
}
