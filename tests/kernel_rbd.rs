//! `loopd attach rbd:POOL/IMAGE --blockdev ublk|nbd` under a real kernel: an
//! RBD image of a Ceph cluster as `/dev/ublkbN` and as `/dev/nbdN`. Raw bytes
//! written with `O_DIRECT` and fsync'ed are in `rbd export` of the image at
//! the same offsets; ext4 made, filled, checked (`e2fsck -fn`), remounted and
//! read back through the device; after detach the exported image holds that
//! filesystem (checked clean and its files read by `debugfs` from the export).
//! `kill -9` of loopd while a file is being written, then a restart over the
//! same state file: ublk user recovery (the same `/dev/ublkbN`) and kernel-NBD
//! reconnect bring the mounted filesystem back; what was fsync'ed before the
//! kill is in `rbd export` taken while the daemon was dead. An `rbd resize`
//! by another client reaches `/dev/ublkbN` where the kernel has UPDATE_SIZE
//! (6.14+: the new size, and a write past the old end lands in the image;
//! checked under the newest kernel of `scripts/vm-test.sh`'s two), else the
//! audit line says why not (6.12).
//!
//! Runs as root inside the VM of `scripts/vm-test.sh`. The guest has no
//! network, so the cluster runs inside the guest: [`ceph()`] starts one per
//! test binary (~100 s under TCG; see tests/common/ceph.rs), on the guest's
//! tmpfs. Images are small (32 MiB) and the tests few: the whole suite adds a
//! few minutes to the VM run. Every server, device, mount and image is a guard
//! released on drop.

#![cfg(feature = "vm-tests")]

mod common;

use common::kernel::*;
use common::*;
use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The size of every image here.
const SIZE: u64 = 32 * MIB;

/// How long the restarted daemon may take to get a killed daemon's device
/// back. The image's exclusive lock is still held by the dead daemon's RADOS
/// client; the restarted daemon breaks it at once because its state record
/// names that client as its own previous run (`backing::rbd::lock`). Without
/// that it would wait for Ceph's watch timeout (~30 s; 21–25 s after the
/// restart was measured here under TCG): the limit sits well under it and far
/// above the take-back (~1 s measured under TCG).
const COME_BACK_LIMIT: Duration = Duration::from_secs(15);

/// A daemon restoring RBD devices opens them before it prints its control
/// line: connecting to the cluster and opening the image are slow under TCG.
const RESTART_READY: Duration = Duration::from_secs(60);

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-krbd")
        .tempdir()
        .expect("tempdir in TMPDIR")
}

/// An image of the test cluster of [`SIZE`] bytes, removed when dropped.
fn image(prefix: &str) -> CephImage {
    CephImage::new(prefix, SIZE)
}

/// `rbd export` of `img` into the file `to`.
fn export_to(img: &CephImage, to: &Path) {
    let bytes = img.export();
    assert_eq!(bytes.len() as u64, SIZE, "export length");
    fs::write(to, bytes).unwrap_or_else(|e| panic!("write {}: {e}", to.display()));
}

/// A daemon (no default device) whose state file and sockets live in `dir`,
/// so that a restart finds them again.
fn daemon(dir: &Path) -> Server {
    require_root();
    require_module("ublk_drv");
    require_module("nbd");
    Server::daemon()
        .socket_path(&dir.join("nbd.sock"))
        .args([OsString::from("--state"), dir.join("loopd.state").into()])
        .ready_timeout(RESTART_READY)
        .start()
}

/// `loopd attach rbd:… --name NAME --blockdev KIND --ceph-conf … --ceph-id …
/// ARGS`: the block device it printed (it exists and has its size).
fn attach(srv: &Server, kind: &str, img: &CephImage, name: &str, args: &[&str]) -> PathBuf {
    let spec = img.spec();
    let conf = path_str(&ceph().conf).to_owned();
    let mut a = vec![
        "attach",
        spec.as_str(),
        "--name",
        name,
        "--blockdev",
        kind,
        "--ceph-conf",
        conf.as_str(),
        "--ceph-id",
        ceph().id,
    ];
    a.extend_from_slice(args);
    let dev = attach_blockdev_with(srv, kind, &a);
    assert_eq!(
        dev_size(&dev),
        SIZE,
        "{} has the image's size",
        dev.display()
    );
    dev
}

/// The md5 of file `/NAME` of the ext4 filesystem in the image file `img`
/// (read by `debugfs`, not through any kernel mount).
fn md5_in_image(img: &Path, name: &str, scratch: &Path) -> String {
    let out = scratch.join(format!("{name}.dumped"));
    sh(
        KCMD_TIMEOUT,
        "debugfs",
        [
            OsString::from("-R"),
            format!("dump /{name} {}", out.display()).into(),
            img.into(),
        ],
    );
    assert!(out.exists(), "debugfs found /{name} in {}", img.display());
    let sum = md5(&out);
    fs::remove_file(&out).expect("rm the dumped file");
    sum
}

/// `len` zeroed bytes at a 4 KiB-aligned address (for `O_DIRECT`): a slice
/// of `store`, which is replaced.
fn aligned(store: &mut Vec<u8>, len: usize) -> &mut [u8] {
    *store = vec![0u8; len + 4096];
    let at = store.as_ptr().align_offset(4096);
    &mut store[at..at + len]
}

/// Raw bytes with `O_DIRECT` + fsync, checked in `rbd export` (and read back
/// through the device); then ext4 made, filled, checked, remounted and read;
/// detach; the export after detach holds the filesystem and its files.
fn filesystem_over_rbd(kind: &str, cache: &str) {
    let t = scratch();
    let img = image(&format!("kfs-{kind}"));
    let srv = daemon(t.path());
    let started = Instant::now();
    let dev = attach(&srv, kind, &img, "rfs", &["--cache", cache]);

    // At 0, across the 4 MiB object boundary, and the last block.
    let writes: [(u64, usize, u8); 3] = [
        (0, 64 * 1024, 1),
        (4 * MIB - 8192, 16 * 1024, 2),
        (SIZE - 4096, 4096, 3),
    ];
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&dev)
        .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", dev.display()));
    let mut store = Vec::new();
    let mut model = vec![0u8; usize::try_from(SIZE).expect("size")];
    for (off, len, seed) in writes {
        let buf = aligned(&mut store, len);
        buf.copy_from_slice(&pattern_bytes(seed, off, len));
        f.write_all_at(buf, off)
            .unwrap_or_else(|e| panic!("O_DIRECT write at {off}: {e}"));
        let at = usize::try_from(off).expect("offset");
        model[at..at + len].copy_from_slice(buf);
    }
    f.sync_all().expect("fsync the device");
    assert_bytes_eq(
        &ceph().export_image(&img.name),
        &model,
        0,
        &format!("rbd export after O_DIRECT writes and fsync on {kind} ({cache})"),
    );
    for (off, len, seed) in writes {
        let rbuf = aligned(&mut store, len);
        f.read_exact_at(rbuf, off)
            .unwrap_or_else(|e| panic!("O_DIRECT read at {off}: {e}"));
        assert_bytes_eq(rbuf, &pattern_bytes(seed, off, len), off, "read back");
    }
    drop(f);

    mkfs_ext4(&dev);
    let mnt = t.path().join("mnt");
    let m = Mount::new(&dev, &mnt, None);
    write_random(&mnt.join("a"), 4);
    write_random(&mnt.join("b"), 2);
    let (a, b) = (md5(&mnt.join("a")), md5(&mnt.join("b")));
    sh(KCMD_TIMEOUT, "sync", [""; 0]);
    m.unmount();
    e2fsck_clean(&dev);
    drop_caches();
    let m = Mount::new(&dev, &mnt, None);
    assert_eq!(
        md5(&mnt.join("a")),
        a,
        "file a after remount ({kind}, {cache})"
    );
    assert_eq!(
        md5(&mnt.join("b")),
        b,
        "file b after remount ({kind}, {cache})"
    );
    m.unmount();
    srv.ctl_ok(&["detach", "rfs"]);
    assert!(gone(&dev), "{} removed by detach", dev.display());

    // The image itself (not loopd, not the kernel's cache) holds the filesystem.
    let copy = t.path().join("exported.img");
    export_to(&img, &copy);
    e2fsck_clean(&copy);
    assert_eq!(md5_in_image(&copy, "a", t.path()), a, "a in the export");
    assert_eq!(md5_in_image(&copy, "b", t.path()), b, "b in the export");
    eprintln!(
        "{kind} over rbd ({cache}): bytes, ext4, fsck and export checked in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn ublk_over_rbd_bytes_and_ext4_match_rbd_export() {
    filesystem_over_rbd("ublk", "direct");
}

#[test]
fn nbd_over_rbd_bytes_and_ext4_match_rbd_export() {
    filesystem_over_rbd("nbd", "buffered");
}

/// `kill -9` while a file is written on the mounted filesystem; the export
/// taken while no daemon runs holds what was fsync'ed before; a restart over
/// the same state file takes the kernel device back (`says` + the device), the
/// interrupted write completes, and the filesystem is intact and clean.
///
/// `--cache direct`: librbd's cache off, so nothing the kernel was told is
/// written lives only in the dead daemon's memory (with librbd's cache on, a
/// write acknowledged before the kill and not yet flushed is lost with it).
fn kill_9_and_restart_over_rbd(kind: &str, says: &str) {
    let t = scratch();
    let img = image(&format!("kkill-{kind}"));
    let mut srv = daemon(t.path());
    let dev = attach(&srv, kind, &img, "rrec", &["--cache", "direct"]);
    mkfs_ext4(&dev);
    let mnt = t.path().join("mnt");
    let m = Mount::new(&dev, &mnt, None);
    write_random(&mnt.join("before"), 4);
    let before = md5(&mnt.join("before"));

    // A write in flight when the daemon dies: it waits for the new daemon.
    // The kill comes once the file has grown (its data is on the way down).
    let bg_path = mnt.join("during");
    let bg = {
        let p = bg_path.clone();
        std::thread::spawn(move || {
            write_random(&p, 8);
            md5(&p)
        })
    };
    let t0 = Instant::now();
    while fs::metadata(&bg_path).map_or(0, |m| m.len()) < MIB
        && !bg.is_finished()
        && t0.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    srv.kill9();
    let killed_at = Instant::now();
    eprintln!(
        "{kind} over rbd: killed loopd with {} bytes of the 8 MiB file written, the writer {}",
        fs::metadata(&bg_path).map_or(0, |m| m.len()),
        if bg.is_finished() {
            "done"
        } else {
            "still writing"
        }
    );
    assert!(dev.exists(), "the disk stays when the daemon dies");

    // Nothing fsync'ed is lost: the image, read by `rbd export` while no
    // daemon serves it (e2fsck replays the journal on this copy).
    let killed = t.path().join("killed.img");
    export_to(&img, &killed);
    let fsck = sh_status(
        KCMD_TIMEOUT,
        "e2fsck",
        [OsString::from("-fy"), killed.clone().into()],
    );
    assert!(
        matches!(fsck.status.code(), Some(0 | 1)),
        "e2fsck -fy of the export taken after the kill: at most a replayed journal: {fsck}"
    );
    assert_eq!(
        md5_in_image(&killed, "before", t.path()),
        before,
        "the file fsync'ed before the kill is in rbd export"
    );
    fs::remove_file(&killed).expect("rm the copy");

    let restarted = Instant::now();
    let srv = daemon(t.path());
    // "recovered /dev/ublkbN from …", "reconnected /dev/nbdN left by …".
    let want = format!("{says}{} ", dev.display());
    loop {
        if srv.stderr_text().contains(&want) {
            break;
        }
        if restarted.elapsed() > COME_BACK_LIMIT {
            let list = srv.ctl(&["list"]);
            panic!(
                "the restarted daemon did not take {} back within {COME_BACK_LIMIT:?} \
                 (wanted {want:?} in its log)\n{list}\n--- stderr ---\n{}",
                dev.display(),
                srv.stderr_text()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let back = restarted.elapsed();
    eprintln!(
        "{kind} over rbd: the restarted daemon took {} back {:.1} s after it started \
         ({:.1} s after the kill)",
        dev.display(),
        back.as_secs_f64(),
        killed_at.elapsed().as_secs_f64()
    );
    let during = bg.join().expect("the write during the outage completed");
    assert_eq!(md5(&mnt.join("before")), before, "fsync'd data intact");
    m.unmount();
    drop_caches();
    let m = Mount::new(&dev, &mnt, None);
    assert_eq!(md5(&mnt.join("before")), before, "before, after remount");
    assert_eq!(md5(&mnt.join("during")), during, "during, after remount");
    m.unmount();
    e2fsck_clean(&dev);
    srv.ctl_ok(&["detach", "rrec"]);
    assert!(gone(&dev), "{} removed by detach", dev.display());
    let copy = t.path().join("exported.img");
    export_to(&img, &copy);
    e2fsck_clean(&copy);
    assert_eq!(md5_in_image(&copy, "during", t.path()), during, "in export");
}

#[test]
fn ublk_over_rbd_kill_9_and_restart_recovers_the_device() {
    kill_9_and_restart_over_rbd("ublk", "recovered ");
}

#[test]
fn nbd_over_rbd_kill_9_and_restart_reconnects_the_device() {
    kill_9_and_restart_over_rbd("nbd", "reconnected ");
}

/// An `rbd resize` by another client (a grow) reaches the ublk device over
/// the image through the daemon's update watch: on a kernel with ublk's
/// `UPDATE_SIZE` (6.14 and later) `/dev/ublkbN` takes the new size and a
/// write past the old end lands in the image; on older kernels (6.12) the
/// device keeps its size and the daemon's audit line says why and what to
/// do — detach and attach — as `loopd resize` does.
#[test]
fn ublk_over_rbd_follows_an_rbd_resize_as_far_as_the_kernel_can() {
    let t = scratch();
    let img = image("kgrow");
    let srv = daemon(t.path());
    let dev = attach(&srv, "ublk", &img, "grow", &["--cache", "direct"]);
    assert_eq!(dev_size(&dev), SIZE);
    let out = ceph().rbd(&[
        "resize",
        "--no-progress",
        "--size",
        &format!("{}B", 2 * SIZE),
        &ceph().image_spec(&img.name),
    ]);
    assert!(
        out.status.success(),
        "rbd resize: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t0 = Instant::now();
    let limit = Duration::from_secs(60);
    let line = loop {
        let log = srv.stderr_text();
        if let Some(l) = log
            .lines()
            .find(|l| l.contains("audit: resize") && l.contains("by the RBD image"))
        {
            break l.to_owned();
        }
        assert!(
            t0.elapsed() < limit,
            "no resize line within {limit:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("{line}");
    if kernel_at_least(6, 14) {
        assert!(line.ends_with(": ok"), "{line}");
        assert_eq!(dev_size(&dev), 2 * SIZE, "the kernel's size follows");
        // A write past the old end lands in the image.
        let pattern = vec![0x6bu8; 64 * 1024];
        let f = fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&dev)
            .expect("open the device");
        let mut store = Vec::new();
        let buf = aligned(&mut store, pattern.len());
        buf.copy_from_slice(&pattern);
        f.write_all_at(buf, SIZE + MIB)
            .expect("write past the old end");
        f.sync_all().expect("fsync");
        drop(f);
        srv.ctl_ok(&["detach", "grow"]);
        let bytes = ceph().export_image(&img.name);
        let at = usize::try_from(SIZE + MIB).expect("fits");
        assert_eq!(&bytes[at..at + pattern.len()], &pattern[..]);
    } else {
        assert!(
            line.contains("refused") && line.contains("6.14") && line.contains("detach and attach"),
            "{line}"
        );
        assert_eq!(dev_size(&dev), SIZE, "the kernel's size is unchanged");
        srv.ctl_ok(&["detach", "grow"]);
    }
}
