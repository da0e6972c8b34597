//! The baseline kernel path: the kernel's NBD client (`nbd-client -unix SOCK
//! -N NAME /dev/nbdN`) connected to `loopd serve`, in direct and in buffered
//! cache mode: a filesystem on it, fio with verification, `fstrim` reaching the
//! image as holes, read-only exports; and `--create` on a 9p directory (a
//! filesystem without RENAME_NOREPLACE).
//!
//! Runs as root inside the VM `scripts/vm-test.sh` boots (the `nbd` module
//! loaded, TMPDIR on a tmpfs, LOOPD_VM_9P_DIR a writable 9p directory). Every
//! server, device and mount is a guard (`common::kernel`) released on drop.

#![cfg(feature = "vm-tests")]

mod common;

use common::kernel::*;
use common::*;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The logical block size the server advertises and `nbd-client -b` sets.
const BS: u32 = 4096;

/// Bound on one fio run (each is a few seconds under TCG).
const FIO_TIMEOUT: Duration = Duration::from_secs(120);

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-knbd")
        .tempdir()
        .expect("tempdir in TMPDIR")
}

fn serve(img: &Path, cache: &str, extra: &[&str]) -> Server {
    require_root();
    Server::builder(img)
        .args(["--cache", cache, "--block-size", &BS.to_string()])
        .args(extra)
        .start()
}

fn connect(srv: &Server) -> NbdDev {
    NbdDev::connect(&NbdClientOpts {
        socket: srv.socket(),
        name: srv.name(),
        block_size: BS,
    })
}

/// A path or a string as a command argument.
struct OsArg(std::ffi::OsString);

impl From<&str> for OsArg {
    fn from(s: &str) -> Self {
        OsArg(s.into())
    }
}

impl From<&Path> for OsArg {
    fn from(p: &Path) -> Self {
        OsArg(p.as_os_str().to_owned())
    }
}

impl AsRef<std::ffi::OsStr> for OsArg {
    fn as_ref(&self) -> &std::ffi::OsStr {
        &self.0
    }
}

/// mkfs.ext4, files written and synced, then a fresh device (so nothing can
/// come from the kernel's caches): e2fsck finds the filesystem clean and every
/// file reads back byte for byte.
fn ext4_files_survive_remount(cache: &str) {
    let dir = scratch();
    let img = dir.path().join("ext4.img");
    create_sparse_image(&img, 64 * MIB);
    let srv = serve(&img, cache, &[]);
    let mnt = dir.path().join("mnt");
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("big.bin", pattern_bytes(1, 0, 3 * 1024 * 1024 + 123)),
        ("sub/small.bin", pattern_bytes(2, 0, 5000)),
        ("sub/deeper/one-block.bin", pattern_bytes(3, 0, 4096)),
        ("empty", Vec::new()),
    ];

    let nbd = connect(&srv);
    mkfs_ext4(nbd.path());
    let m = Mount::new(nbd.path(), &mnt, None);
    for (name, data) in &files {
        let p = m.dir().join(name);
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).expect("mkdir in the mounted filesystem");
        }
        fs::write(&p, data).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
    }
    sh(KCMD_TIMEOUT, "sync", [OsArg::from("-f"), m.dir().into()]);
    m.unmount();
    nbd.disconnect();

    // The ext4 superblock magic (0xEF53 at byte 1024 + 56) is in the image.
    assert_eq!(
        read_range(&img, 1024 + 56, 2),
        [0x53, 0xEF],
        "no ext4 superblock in the image file"
    );

    let nbd = connect(&srv);
    let fsck = sh_status(
        KCMD_TIMEOUT,
        "e2fsck",
        [OsArg::from("-fn"), nbd.path().into()],
    );
    assert!(fsck.success(), "e2fsck -fn found problems: {fsck}");
    let m = Mount::new(nbd.path(), &mnt, Some("ro"));
    for (name, data) in &files {
        let got = read_file(&m.dir().join(name));
        assert_bytes_eq(&got, data, 0, &format!("{name} after remount ({cache})"));
    }
    m.unmount();
    nbd.disconnect();
}

/// fio on the raw device: random writes of 4-64 KiB from two jobs on disjoint
/// halves, direct, each block checked with crc32c; once with libaio, once
/// with io_uring.
fn fio_verify(cache: &str) {
    let dir = scratch();
    let img = dir.path().join("fio.img");
    create_sparse_image(&img, 32 * MIB);
    let srv = serve(&img, cache, &[]);
    let nbd = connect(&srv);
    for engine in ["libaio", "io_uring"] {
        let mut cmd = tool("fio");
        cmd.args([
            "--name=verify",
            &format!("--filename={}", nbd.path().display()),
            &format!("--ioengine={engine}"),
            "--direct=1",
            "--rw=randwrite",
            "--bsrange=4k-64k",
            "--iodepth=8",
            "--numjobs=2",
            "--size=12M",
            "--offset_increment=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--group_reporting",
        ]);
        let out = run_cmd_timeout(cmd, FIO_TIMEOUT);
        assert!(
            out.success() && out.stdout.contains("err= 0"),
            "fio {engine} ({cache}) failed: {out}"
        );
    }
    nbd.disconnect();
}

/// Trimming a deleted file's blocks (`fstrim`) punches holes in the image: its
/// allocated size (`st_blocks`) drops by about the file's size.
fn fstrim_punches_holes(cache: &str) {
    const BIG: u64 = 40 * MIB;
    let dir = scratch();
    let img = dir.path().join("trim.img");
    create_sparse_image(&img, 96 * MIB);
    let srv = serve(&img, cache, &[]);
    let nbd = connect(&srv);
    mkfs_ext4(nbd.path());
    let m = Mount::new(nbd.path(), &dir.path().join("mnt"), None);
    let big = m.dir().join("big.bin");
    {
        let f = File::create(&big).expect("create big file");
        let chunk = pattern_bytes(9, 0, 1 << 20);
        for i in 0..BIG / MIB {
            f.write_all_at(&chunk, i * MIB).expect("write big file");
        }
        f.sync_all().expect("fsync big file");
    }
    sh(KCMD_TIMEOUT, "sync", [OsArg::from("-f"), m.dir().into()]);
    let before = allocated_bytes(&img);
    assert!(
        before >= BIG,
        "the image holds {before} bytes after writing a {BIG}-byte file ({cache})"
    );
    fs::remove_file(&big).expect("rm big file");
    sh(KCMD_TIMEOUT, "sync", [OsArg::from("-f"), m.dir().into()]);
    let out = sh(KCMD_TIMEOUT, "fstrim", [OsArg::from("-v"), m.dir().into()]);
    let after = allocated_bytes(&img);
    assert!(
        before.saturating_sub(after) >= BIG - 4 * MIB,
        "fstrim freed only {} of {BIG} bytes in the image ({cache}): before {before}, after {after}; {}",
        before.saturating_sub(after),
        out.stdout
    );
    m.unmount();
    nbd.disconnect();
}

/// A `--read-only` export: the kernel marks the device read-only, a write
/// through it fails with EPERM/EROFS/EACCES, reads see the image, and the
/// image's bytes are unchanged.
fn read_only_refuses_writes(cache: &str) {
    const SIZE: u64 = 8 * MIB;
    let dir = scratch();
    let img = dir.path().join("ro.img");
    create_pattern_image(&img, SIZE, 7);
    let srv = serve(&img, cache, &["--read-only"]);
    let nbd = connect(&srv);
    assert_eq!(
        nbd.attr("ro").as_deref(),
        Some("1"),
        "the kernel did not mark {} read-only",
        nbd.path().display()
    );

    let refused = |e: &std::io::Error| {
        matches!(
            e.raw_os_error(),
            Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES)
        )
    };
    match OpenOptions::new().write(true).open(nbd.path()) {
        Err(e) => {
            eprintln!("open(O_WRONLY) refused: {e}");
            assert!(refused(&e), "open for writing failed oddly: {e}");
        }
        Ok(f) => {
            let r = f.write_all_at(&[0xAB; 4096], 0).and_then(|()| f.sync_all());
            match r {
                Err(e) => {
                    eprintln!("write refused: {e}");
                    assert!(refused(&e), "the write failed oddly: {e}");
                }
                Ok(()) => panic!(
                    "a write to the read-only {} succeeded",
                    nbd.path().display()
                ),
            }
        }
    }
    let dd = sh_status(
        KCMD_TIMEOUT,
        "dd",
        [
            "if=/dev/zero".to_string(),
            format!("of={}", nbd.path().display()),
            "bs=4096".to_string(),
            "count=4".to_string(),
            "oflag=direct".to_string(),
        ],
    );
    assert!(!dd.success(), "dd wrote to a read-only device: {dd}");

    let dev = File::open(nbd.path()).expect("open the device for reading");
    let mut head = vec![0u8; 64 * 1024];
    dev.read_exact_at(&mut head, MIB)
        .expect("read from the read-only device");
    assert_bytes_eq(
        &head,
        &pattern_bytes(7, MIB, head.len()),
        MIB,
        "read through nbd",
    );
    drop(dev);
    nbd.disconnect();
    let whole = read_file(&img);
    assert_bytes_eq(
        &whole,
        &pattern_bytes(7, 0, usize::try_from(SIZE).expect("size")),
        0,
        "image after write attempts",
    );
}

/// For each `fn name(cache: &str)`, a module `name` with tests `direct` and
/// `buffered`.
macro_rules! matrix_cache_tests {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn direct() {
                    super::$name("direct")
                }
                #[test]
                fn buffered() {
                    super::$name("buffered")
                }
            }
        )*
    };
}

matrix_cache_tests!(
    ext4_files_survive_remount,
    fio_verify,
    fstrim_punches_holes,
    read_only_refuses_writes,
);

/// The 9p directory the runner shares read-write into the VM.
fn ninep_dir() -> PathBuf {
    let d = std::env::var_os("LOOPD_VM_9P_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!("LOOPD_VM_9P_DIR is not set: run this suite with scripts/vm-test.sh")
        });
    assert_eq!(
        fs_type(&d),
        "9p",
        "LOOPD_VM_9P_DIR={} is not on 9p",
        d.display()
    );
    d
}

/// `loopd serve IMG --create 16M` with IMG on 9p, which refuses
/// RENAME_NOREPLACE: the image is created (through the link fallback), sparse,
/// with no temporary left behind, and it serves.
#[test]
fn create_on_9p_falls_back_to_link() {
    require_root();
    let base = ninep_dir();
    let dir = tempfile::Builder::new()
        .prefix("loopd-create-9p")
        .tempdir_in(&base)
        .expect("tempdir on 9p");

    // The precondition: this filesystem refuses the flag, so this test
    // exercises the fallback and not the rename.
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    fs::write(&a, b"a").expect("write on 9p");
    let cwd = rustix::fs::CWD;
    let r = rustix::fs::renameat_with(cwd, &a, cwd, &b, rustix::fs::RenameFlags::NOREPLACE);
    assert_eq!(
        r,
        Err(rustix::io::Errno::INVAL),
        "9p now accepts RENAME_NOREPLACE; this test no longer covers the link fallback"
    );
    fs::remove_file(&a).expect("rm");

    let img = dir.path().join("made.img");
    let srv = Server::builder(&img)
        .args(["--create", "16M", "--cache", "buffered"])
        .start();
    assert_eq!(file_len(&img), 16 * MIB);
    assert!(
        allocated_bytes(&img) < MIB,
        "the created image is not sparse: {} bytes allocated",
        allocated_bytes(&img)
    );
    let names: Vec<String> = fs::read_dir(dir.path())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["made.img"], "left in the directory: {names:?}");

    let nbd = NbdDev::connect(&NbdClientOpts {
        socket: srv.socket(),
        name: srv.name(),
        block_size: 512,
    });
    assert_eq!(nbd.size(), 16 * MIB);
    let data = pattern_bytes(5, MIB, 64 * 1024);
    {
        let f = OpenOptions::new()
            .write(true)
            .open(nbd.path())
            .expect("open the device");
        f.write_all_at(&data, MIB).expect("write through nbd");
        f.sync_all().expect("fsync the device");
    }
    nbd.disconnect();
    assert_bytes_eq(
        &read_range(&img, MIB, data.len() as u64),
        &data,
        MIB,
        "image on 9p after a write through /dev/nbdN",
    );
    drop(srv);
}

/// Racing creators on 9p (all through the link fallback): exactly one wins,
/// the file has the winner's size, the losers and a later call leave it alone,
/// and no temporary name is left.
#[test]
fn racing_creates_on_9p_have_one_winner() {
    use loopd::backing::create::create_image;
    let dir = tempfile::Builder::new()
        .prefix("loopd-race-9p")
        .tempdir_in(ninep_dir())
        .expect("tempdir on 9p");
    let img = dir.path().join("race.img");
    let results: Vec<(u64, bool)> = std::thread::scope(|s| {
        let hs: Vec<_> = (1..=8u64)
            .map(|i| {
                let img = &img;
                s.spawn(move || {
                    (
                        i * MIB,
                        create_image(img, i * MIB, false).expect("create on 9p"),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let winners: Vec<u64> = results.iter().filter(|r| r.1).map(|r| r.0).collect();
    assert_eq!(winners.len(), 1, "creators that won: {results:?}");
    assert_eq!(file_len(&img), winners[0], "{results:?}");
    assert!(!create_image(&img, 99 * MIB, false).expect("create over an existing file"));
    assert_eq!(file_len(&img), winners[0]);
    let names: Vec<String> = fs::read_dir(dir.path())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["race.img"], "left in the directory: {names:?}");
}
