//! `loopd kernel attach/detach/list`: kernel loop devices set up in one
//! LOOP_CONFIGURE.  Needs root and /dev/loop-control.  Images live in a
//! private directory under /var/tmp (a disk filesystem, so direct I/O is
//! available).  Every device a test attaches is detached by a guard
//! ([`KernelLoop`]) even when the test fails; devices this suite did not
//! create are never touched.

mod common;

use common::gpt::{TWO_PARTS, two_partition_image};
use common::*;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Skips nothing: these tests need root; fail clearly if it is missing.
fn require_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "the kernel loop tests must run as root");
    assert!(
        Path::new("/dev/loop-control").exists(),
        "/dev/loop-control missing (is the loop module loaded?)"
    );
}

/// A private directory for images on a disk filesystem.
fn image_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-kloop")
        .tempdir_in("/var/tmp")
        .expect("tempdir in /var/tmp")
}

/// `len` bytes at a 4096-aligned address (for O_DIRECT), filled from `data`.
struct Aligned {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let buf = vec![0u8; len + 4096];
        let start = buf.as_ptr().align_offset(4096);
        Aligned { buf, start, len }
    }

    fn from(data: &[u8]) -> Aligned {
        let mut a = Aligned::new(data.len());
        a.as_mut().copy_from_slice(data);
        a
    }

    fn as_ref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

fn open_direct(dev: &Path, write: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
}

/// Writes `data` at `off` on the device with O_DIRECT, then fsync.
#[track_caller]
fn direct_write(dev: &Path, off: u64, data: &[u8]) {
    let f = open_direct(dev, true).unwrap_or_else(|e| panic!("open {}: {e}", dev.display()));
    f.write_all_at(Aligned::from(data).as_ref(), off)
        .unwrap_or_else(|e| {
            panic!(
                "O_DIRECT write {}+{} on {}: {e}",
                off,
                data.len(),
                dev.display()
            )
        });
    f.sync_all().expect("fsync loop device");
}

/// Reads `len` bytes at `off` from the device with O_DIRECT.
#[track_caller]
fn direct_read(dev: &Path, off: u64, len: usize) -> Vec<u8> {
    let f = open_direct(dev, false).unwrap_or_else(|e| panic!("open {}: {e}", dev.display()));
    let mut a = Aligned::new(len);
    f.read_exact_at(a.as_mut(), off)
        .unwrap_or_else(|e| panic!("O_DIRECT read {off}+{len} on {}: {e}", dev.display()));
    a.as_ref().to_vec()
}

/// `loopd kernel list --json` (in `losetup -J`'s shape), only the entries
/// backed by `image`.
fn listed(image: &Path) -> Vec<Json> {
    let out = loopd_run(["kernel", "list", "--json"]).assert_success();
    let want = canon(image);
    Json::parse(&out.stdout)
        .at("loopdevices")
        .arr()
        .iter()
        .filter(|e| Path::new(e.at("back-file").str()) == want)
        .cloned()
        .collect()
}

fn canon(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Default attach: one device path on stdout, direct I/O on (sysfs
/// `loop/dio` = 1) on this disk filesystem, the image's size; reads return
/// the image's bytes and O_DIRECT writes (Rust and `dd oflag=direct`) land in
/// the image at the same offsets; detach removes the device.
#[test]
fn attach_default_direct_io_and_data_path() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("k1.img");
    create_pattern_image(&img, 8 * MIB, 5);

    let (dev, out) = KernelLoop::attach(&img, &[]);
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        vec![path_str(&dev.dev)],
        "attach prints the device only"
    );
    assert!(
        !out.stderr.contains("did not enable direct I/O"),
        "direct I/O should be on by default here:\n{out}"
    );
    assert_eq!(
        dev.sysfs("loop/dio").as_deref(),
        Some("1"),
        "sysfs loop/dio"
    );
    assert_eq!(
        dev.sysfs("loop/backing_file").map(PathBuf::from),
        Some(canon(&img))
    );
    assert_eq!(dev.size(), 8 * MIB, "device size");
    assert_eq!(dev.sysfs("ro").as_deref(), Some("0"));
    assert_eq!(dev.sysfs("loop/offset").as_deref(), Some("0"));
    let lbs: u64 = dev
        .sysfs("queue/logical_block_size")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        lbs.is_power_of_two() && (512..=4096).contains(&lbs),
        "logical block size {lbs}"
    );

    // Reads: the image's bytes.
    assert_bytes_eq(
        &direct_read(&dev.dev, 3 * MIB, 64 * 1024),
        &pattern_bytes(5, 3 * MIB, 64 * 1024),
        3 * MIB,
        "O_DIRECT read through the loop device",
    );
    // Writes land at the same offset in the image.
    let data = pattern_bytes(6, 0, 64 * 1024);
    direct_write(&dev.dev, MIB, &data);
    assert_bytes_eq(
        &read_range(&img, MIB, 64 * KIB),
        &data,
        MIB,
        "image after O_DIRECT write",
    );
    assert_file_pattern(&img, MIB - 4096, 4096, 5, "bytes before the write");
    assert_file_pattern(&img, MIB + 64 * KIB, 4096, 5, "bytes after the write");

    // dd with oflag=direct.
    let src = dir.path().join("ee.bin");
    create_filled_image(&src, 8192, 0xee);
    let out = run(
        "dd",
        [
            format!("if={}", path_str(&src)),
            format!("of={}", path_str(&dev.dev)),
            "bs=4096".into(),
            "seek=1024".into(), // 4 MiB
            "count=2".into(),
            "oflag=direct".into(),
            "conv=notrunc,fsync".into(),
        ],
    );
    assert!(out.stderr.contains("8192 bytes"), "dd:\n{out}");
    assert_file_filled(&img, 4 * MIB, 8192, 0xee, "image after dd oflag=direct");
    assert_file_pattern(&img, 4 * MIB + 8192, 4096, 5, "bytes after the dd write");
    assert_eq!(file_len(&img), 8 * MIB, "the image did not grow");

    // Detach.
    loopd_run(["kernel", "detach", path_str(&dev.dev)]).assert_success();
    assert!(dev.wait_detached(), "{} still attached", dev.dev.display());
    assert!(listed(&img).is_empty(), "still listed after detach");
}

/// `--block-size 4096`: the logical block size is 4096 (sysfs and --json),
/// direct I/O stays on, 4096-aligned O_DIRECT I/O works and 512-byte
/// O_DIRECT I/O is refused.
#[test]
fn attach_block_size_4096() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("k4k.img");
    create_pattern_image(&img, 4 * MIB, 8);

    let (dev, out) = KernelLoop::attach(&img, &["--block-size", "4096", "--json"]);
    let j = Json::parse(&out.stdout);
    assert_eq!(j.at("device").str(), path_str(&dev.dev));
    assert_eq!(j.at("block_size").u64(), 4096, "{}", out.stdout);
    assert!(j.at("direct_io").bool(), "{}", out.stdout);
    assert!(j.at("attempts").u64() >= 1);
    assert_eq!(
        dev.sysfs("queue/logical_block_size").as_deref(),
        Some("4096")
    );
    assert_eq!(dev.sysfs("loop/dio").as_deref(), Some("1"));

    direct_write(&dev.dev, 8192, &[0x4b; 4096]);
    assert_file_filled(&img, 8192, 4096, 0x4b, "4096-byte write");
    assert_file_pattern(&img, 4096, 4096, 8, "block before");
    assert_file_pattern(&img, 12288, 4096, 8, "block after");

    // 512-byte O_DIRECT I/O does not fit the 4096 logical block size.
    let f = open_direct(&dev.dev, true).unwrap();
    let a = Aligned::from(&[0x11; 512]);
    let e = f
        .write_at(a.as_ref(), 512)
        .expect_err("512-byte O_DIRECT write on a 4096-byte-block device");
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    drop(f);
    assert_file_pattern(&img, 0, 4096, 8, "refused write changed nothing");

    let l = listed(&img);
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].at("log-sec").u64(), 4096);
    assert!(l[0].at("dio").bool());
}

/// `--offset` and `--size-limit`: the device is the window; writes land in
/// the image at offset + position; nothing outside the window changes; the
/// device ends at the size limit.
#[test]
fn attach_offset_and_size_limit() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("kwin.img");
    create_pattern_image(&img, 8 * MIB, 12);

    let (dev, _) = KernelLoop::attach(&img, &["--offset", "1M", "--size-limit", "2M"]);
    assert_eq!(dev.size(), 2 * MIB, "window size");
    assert_eq!(dev.sysfs("loop/offset").as_deref(), Some("1048576"));
    assert_eq!(dev.sysfs("loop/sizelimit").as_deref(), Some("2097152"));
    assert_eq!(dev.sysfs("loop/dio").as_deref(), Some("1"));

    assert_bytes_eq(
        &direct_read(&dev.dev, 0, 8192),
        &pattern_bytes(12, MIB, 8192),
        MIB,
        "device byte 0 is image byte 1M",
    );
    direct_write(&dev.dev, 0, &[0xab; 4096]);
    direct_write(&dev.dev, 2 * MIB - 4096, &[0xcd; 4096]);
    assert_file_filled(&img, MIB, 4096, 0xab, "first block of the window");
    assert_file_filled(&img, 3 * MIB - 4096, 4096, 0xcd, "last block of the window");
    assert_file_pattern(&img, 0, MIB, 12, "before the window");
    assert_file_pattern(&img, MIB + 4096, 4096, 12, "inside the window");
    assert_file_pattern(&img, 3 * MIB, 5 * MIB, 12, "after the window");

    // Past the end of the window: nothing is written.
    let f = open_direct(&dev.dev, true).unwrap();
    let a = Aligned::from(&[0xff; 4096]);
    match f.write_at(a.as_ref(), 2 * MIB) {
        Ok(n) => assert_eq!(n, 0, "write past the end of the device"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}"),
    }
    drop(f);
    assert_file_pattern(&img, 3 * MIB, 4096, 12, "after the window, again");

    let l = listed(&img);
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].at("name").str(), path_str(&dev.dev));
    assert_eq!(l[0].at("offset").u64(), MIB);
    assert_eq!(l[0].at("sizelimit").u64(), 2 * MIB);
}

/// `--size-limit none` and `--size-limit 0` are no limit (the kernel's
/// `lo_sizelimit` 0), as on every loopd command: the device is the file
/// from the offset to its end.
#[test]
fn attach_size_limit_none_or_zero_is_the_rest_of_the_file() {
    require_root();
    let dir = image_dir();
    for (i, none) in ["none", "0"].into_iter().enumerate() {
        let img = dir.path().join(format!("knone{i}.img"));
        create_pattern_image(&img, 4 * MIB, 13);
        let (dev, _) = KernelLoop::attach(&img, &["--offset", "1M", "--size-limit", none]);
        assert_eq!(dev.size(), 3 * MIB, "--size-limit {none}");
        assert_eq!(dev.sysfs("loop/sizelimit").as_deref(), Some("0"), "{none}");
    }
}

/// `--read-only`: sysfs `ro` is 1, opening for writing and `dd` fail, reads
/// work, and the image is unchanged.
#[test]
fn attach_read_only_refuses_writes() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("kro.img");
    create_pattern_image(&img, 2 * MIB, 14);

    let (dev, _) = KernelLoop::attach(&img, &["--read-only"]);
    assert_eq!(dev.sysfs("ro").as_deref(), Some("1"));
    // The kernel may refuse the open or (as Linux does for root) the write.
    match open_direct(&dev.dev, true) {
        Err(e) => assert!(
            matches!(e.raw_os_error(), Some(libc::EROFS) | Some(libc::EACCES)),
            "{e}"
        ),
        Ok(f) => {
            let a = Aligned::from(&[0x5a; 4096]);
            let e = f
                .write_at(a.as_ref(), 0)
                .expect_err("write to a read-only loop device");
            assert!(
                matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EROFS)),
                "{e}"
            );
        }
    }
    let src = dir.path().join("zz.bin");
    create_filled_image(&src, 4096, 0x5a);
    let out = run_status(
        "dd",
        [
            format!("if={}", path_str(&src)),
            format!("of={}", path_str(&dev.dev)),
            "bs=4096".into(),
            "count=1".into(),
            "oflag=direct".into(),
            "conv=notrunc".into(),
        ],
    );
    assert!(
        !out.success(),
        "dd to a read-only loop device succeeded:\n{out}"
    );
    assert_bytes_eq(
        &direct_read(&dev.dev, 0, 4096),
        &pattern_bytes(14, 0, 4096),
        0,
        "read from the read-only device",
    );
    assert_file_pattern(&img, 0, 2 * MIB, 14, "read-only image unchanged");
    let l = listed(&img);
    assert_eq!(l.len(), 1);
    assert!(l[0].at("ro").bool());
}

/// `kernel list` (table and JSON) shows each device with its settings;
/// `--direct-io off|on` is honoured; `kernel detach` removes exactly the
/// device named.
#[test]
fn list_direct_io_modes_and_detach() {
    require_root();
    let dir = image_dir();
    let on = dir.path().join("kon.img");
    let off = dir.path().join("koff.img");
    create_sparse_image(&on, 2 * MIB);
    create_sparse_image(&off, 3 * MIB);

    let (d_on, _) = KernelLoop::attach(&on, &["--direct-io", "on"]);
    let (d_off, out) = KernelLoop::attach(&off, &["--direct-io", "off", "--json"]);
    assert!(!Json::parse(&out.stdout).at("direct_io").bool());
    assert_eq!(d_on.sysfs("loop/dio").as_deref(), Some("1"));
    assert_eq!(d_off.sysfs("loop/dio").as_deref(), Some("0"));
    assert_ne!(d_on.dev, d_off.dev);
    // Writes through the buffered device still land in the image.
    direct_write(&d_off.dev, 4096, &[0x0f; 4096]);
    assert_file_filled(&off, 4096, 4096, 0x0f, "write through a dio=0 device");

    let table = loopd_run(["kernel", "list"]).assert_success().stdout;
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        vec![
            "DEVICE",
            "OFFSET",
            "SIZELIMIT",
            "BLOCK",
            "DIO",
            "RO",
            "AUTOCLEAR",
            "BACKING"
        ]
    );
    for (d, img, dio) in [(&d_on, &on, "1"), (&d_off, &off, "0")] {
        let row: Vec<&str> = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(path_str(&d.dev)))
            .unwrap_or_else(|| panic!("{} not in kernel list:\n{table}", d.dev.display()))
            .split_whitespace()
            .collect();
        assert_eq!(row[4], dio, "DIO column:\n{table}");
        assert_eq!(row[5], "0", "RO column:\n{table}");
        assert_eq!(Path::new(row[7]), canon(img), "BACKING column:\n{table}");
    }
    let l_on = listed(&on);
    assert_eq!(l_on.len(), 1);
    assert_eq!(l_on[0].at("name").str(), path_str(&d_on.dev));
    assert!(l_on[0].at("dio").bool());
    assert!(!l_on[0].at("ro").bool());
    assert!(!l_on[0].at("autoclear").bool());
    let l_off = listed(&off);
    assert_eq!(l_off.len(), 1);
    assert!(!l_off[0].at("dio").bool());

    // Detach one: the other stays.
    let out = loopd_run(["kernel", "detach", path_str(&d_on.dev)]).assert_success();
    assert!(out.stdout.is_empty(), "{out}");
    assert!(d_on.wait_detached());
    assert!(listed(&on).is_empty(), "detached device still listed");
    assert_eq!(listed(&off).len(), 1, "the other device was touched");
    assert_eq!(d_off.sysfs("loop/dio").as_deref(), Some("0"));
    loopd_run(["kernel", "detach", path_str(&d_off.dev)]).assert_success();
    assert!(d_off.wait_detached());
    assert!(listed(&off).is_empty());
}

/// `--partscan` sets the partscan flag (sysfs and list --json); on an image
/// without a partition table attach reports no partitions (`partitions: []`
/// in --json, only the device in the plain output).
#[test]
fn attach_partscan_flag() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("kps.img");
    create_sparse_image(&img, 2 * MIB);
    let (dev, out) = KernelLoop::attach(&img, &["--partscan", "--json"]);
    assert!(
        Json::parse(&out.stdout).at("partitions").arr().is_empty(),
        "{out}"
    );
    assert_eq!(dev.sysfs("loop/partscan").as_deref(), Some("1"));
    let l = listed(&img);
    assert_eq!(l.len(), 1);
    assert!(!l[0].at("autoclear").bool());
    let img2 = dir.path().join("kps2.img");
    create_sparse_image(&img2, 2 * MIB);
    let (dev2, out) = KernelLoop::attach(&img2, &["--partscan"]);
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        vec![path_str(&dev2.dev)]
    );
}

/// Removes the partitions `partx --add` put on a loop device (they would
/// outlive the detach: the kernel drops only partitions it scanned itself).
struct BlkpgParts<'a>(&'a Path);

impl Drop for BlkpgParts<'_> {
    /// `partx --delete` fails while a partition is open (udev, where it runs,
    /// probes new partitions): retry for up to 5 s until none is left.
    fn drop(&mut self) {
        let n = loop_number(self.0);
        let left = || {
            std::fs::read_dir(format!("/sys/block/loop{n}"))
                .map(|rd| {
                    rd.flatten().any(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .starts_with(&format!("loop{n}p"))
                    })
                })
                .unwrap_or(false)
        };
        let t = std::time::Instant::now();
        while left() && t.elapsed() < std::time::Duration::from_secs(5) {
            let _ = run_status("partx", ["--delete", path_str(self.0)]);
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

/// The shared partition helper (`loopd::blockdev::partitions`) against this
/// kernel: it has no partition-table parser (so `--partscan` finds nothing
/// here; the scan itself is tested in tests/kernel_partitions.rs under the
/// VM), but partitions added with BLKPG (`partx --add`) are real ones. `settle`
/// returns both with the GPT's start and size and checked /dev nodes, p2's
/// node reads p2's bytes, a partition is refused as a whole disk, and after
/// `partx --delete` `current` lists none.
#[test]
fn blockdev_settle_reads_blkpg_partitions() {
    use loopd::blockdev::partitions::{self, Rescan};
    use std::time::Duration;
    require_root();
    require_tool("partx");
    let dir = image_dir();
    let img = dir.path().join("kblkpg.img");
    two_partition_image(&img, 23);
    let (dev, _) = KernelLoop::attach(&img, &[]);
    let added = BlkpgParts(&dev.dev);
    run("partx", ["--add", path_str(&dev.dev)]);
    let parts = partitions::settle(&dev.dev, Rescan::AlreadyDone, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("settle {}: {e}", dev.dev.display()));
    assert_eq!(parts.len(), 2, "{parts:?}");
    for (i, (p, want)) in parts.iter().zip(TWO_PARTS).enumerate() {
        let k = u32::try_from(i).unwrap() + 1;
        assert_eq!(
            p.device,
            PathBuf::from(format!("{}p{k}", dev.dev.display()))
        );
        assert_eq!(p.number, k);
        assert_eq!(p.start, want.start_bytes(), "p{k} start");
        assert_eq!(p.size, want.size_bytes(), "p{k} size");
    }
    assert_bytes_eq(
        &read_range(&parts[1].device, 0, 64 * KIB),
        &pattern_bytes(23, TWO_PARTS[1].start_bytes(), 64 * 1024),
        0,
        "p2 through its node",
    );
    let e = partitions::settle(&parts[0].device, Rescan::AlreadyDone, Duration::ZERO)
        .expect_err("settle on a partition");
    assert!(e.to_string().contains("not a whole disk"), "{e}");
    drop(added);
    assert!(
        partitions::current(&dev.dev).unwrap().is_empty(),
        "partitions left after partx --delete"
    );
    assert!(
        !parts[0].device.exists(),
        "{} left",
        parts[0].device.display()
    );
}

/// `--autoclear`: the kernel clears such a device at its last close. When loopd's
/// own close is the last one (nothing else holds the device), the device is gone
/// at once, and loopd says so with an error instead of printing a dead device.
#[test]
fn attach_autoclear_without_a_holder_is_reported() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("kac.img");
    create_sparse_image(&img, 2 * MIB);
    let out = loopd_run(["kernel", "attach", path_str(&img), "--autoclear"]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("autoclear"), "{out}");
    assert!(out.stdout.is_empty(), "no device printed:\n{out}");
    assert!(listed(&img).is_empty(), "a device was left behind");
}

/// Failed attaches leave no device behind; detach refuses what is not a
/// loop device.
#[test]
fn attach_and_detach_errors() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("kerr.img");
    create_sparse_image(&img, MIB);
    let missing = dir.path().join("missing.img");

    let out = loopd_run(["kernel", "attach", path_str(&img), "--block-size", "1000"]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("block size 1000"), "{out}");
    assert!(out.stdout.is_empty(), "no device printed:\n{out}");
    assert!(listed(&img).is_empty(), "a device was left behind");

    let out = loopd_run(["kernel", "attach", path_str(&missing)]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("missing.img"), "{out}");
    assert!(!missing.exists());

    let out = loopd_run(["kernel", "detach", "/dev/null"]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("not a loop device"), "{out}");
    let out = loopd_run(["kernel", "detach", path_str(&img)]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("not a loop device"), "{out}");
    assert!(listed(&img).is_empty());
}

/// losetup's spellings: `kernel attach -f --show -r -o 1M --sizelimit 1M -b 4k`
/// prints the device and sets it up as asked; `kernel list -J` equals real
/// `losetup -J`'s entries for our devices (same fields, same values);
/// `kernel detach DEV DEV` detaches several. (`kernel detach -D` detaches
/// every loop device on the machine, as `losetup -D` does, so it is not run
/// here: other users' devices would go too.)
#[test]
fn losetup_spellings_list_json_and_detach_several() {
    require_root();
    require_tool("losetup");
    let dir = image_dir();
    let a = dir.path().join("ka.img");
    let b = dir.path().join("kb.img");
    create_pattern_image(&a, 4 * MIB, 31);
    create_sparse_image(&b, 2 * MIB);

    let (da, out) = KernelLoop::attach(
        &a,
        &[
            "-f",
            "--show",
            "-r",
            "-o",
            "1M",
            "--sizelimit",
            "1M",
            "-b",
            "4k",
        ],
    );
    assert_eq!(out.stdout.trim(), path_str(&da.dev), "{out}");
    assert_eq!(da.sysfs("ro").as_deref(), Some("1"));
    assert_eq!(da.size(), MIB);
    assert_eq!(
        da.sysfs("queue/logical_block_size").as_deref(),
        Some("4096")
    );
    let (db, _) = KernelLoop::attach(&b, &["-P"]);
    assert_eq!(db.sysfs("loop/partscan").as_deref(), Some("1"));

    // list -J against losetup -J, entry by entry for our two devices.
    let ours = |j: &Json| -> Vec<Json> {
        j.at("loopdevices")
            .arr()
            .iter()
            .filter(|e| [path_str(&da.dev), path_str(&db.dev)].contains(&e.at("name").str()))
            .cloned()
            .collect()
    };
    let mine_text = loopd_run(["kernel", "list", "-J"]).assert_success().stdout;
    let real_text = run("losetup", ["-J"]).stdout;
    let (mine, real) = (Json::parse(&mine_text), Json::parse(&real_text));
    let (mut m, mut r) = (ours(&mine), ours(&real));
    assert_eq!(m.len(), 2, "{mine:?}");
    let key = |e: &Json| e.at("name").str().to_string();
    m.sort_by_key(key);
    r.sort_by_key(key);
    for (m, r) in m.iter().zip(&r) {
        for f in ["name", "back-file"] {
            assert_eq!(m.at(f).str(), r.at(f).str(), "{f}: {m:?} vs {r:?}");
        }
        for f in ["sizelimit", "offset", "log-sec"] {
            assert_eq!(m.at(f).u64(), r.at(f).u64(), "{f}: {m:?} vs {r:?}");
        }
        for f in ["autoclear", "ro", "dio"] {
            assert_eq!(m.at(f).bool(), r.at(f).bool(), "{f}: {m:?} vs {r:?}");
        }
    }
    // A `Json` object's keys are sorted: read the field order from the text.
    let keys = |text: &str| -> Vec<String> {
        let doc: BTreeMap<String, Vec<OrderedObject>> =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let first = m[0].at("name");
        let e = doc["loopdevices"]
            .iter()
            .find(|e| e.get("name") == Some(first));
        e.unwrap_or_else(|| panic!("{first} not in {text}")).keys()
    };
    assert_eq!(
        keys(&mine_text),
        keys(&real_text),
        "same fields in the same order"
    );

    // Detach both in one command.
    let out = loopd_run([
        "kernel",
        "detach",
        path_str(&da.dev),
        path_str(&db.dev),
        "--json",
    ]);
    assert!(out.success(), "{out}");
    assert_eq!(
        Json::parse(&out.stdout).at("detached").arr().len(),
        2,
        "{out}"
    );
    assert!(da.wait_detached() && db.wait_detached(), "both detached");
    // One bad device among good ones: the good ones are still detached.
    let (dc, _) = KernelLoop::attach(&b, &[]);
    let out = loopd_run(["kernel", "detach", "/dev/null", path_str(&dc.dev)]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("not a loop device"), "{out}");
    assert!(
        dc.wait_detached(),
        "the loop device after the bad one was detached"
    );
}

/// An image on a read-only mount is set up read-only with a notice (as
/// losetup does) instead of failing with EROFS.
#[test]
fn write_protected_image_attaches_read_only() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("kwp.img");
    create_sparse_image(&img, MIB);
    let (mnt, _m) = read_only_bind(dir.path());
    let (dev, out) = KernelLoop::attach(&mnt.join("kwp.img"), &["--json"]);
    assert!(out.stderr.contains("write-protected"), "{out}");
    assert!(
        Json::parse(&out.stdout).at("write_protected").bool(),
        "{out}"
    );
    assert_eq!(dev.sysfs("ro").as_deref(), Some("1"));
    let out = loopd_run(["kernel", "detach", path_str(&dev.dev)]);
    assert!(out.success(), "{out}");
    assert!(dev.wait_detached());
}

/// Issue 22 point 5. `kernel attach` applies the daemon's image locks: an
/// image a loopd device serves read-write is refused (read-write and
/// read-only: the device does not share writing), with the daemon's message
/// and exit status (`busy`); `--shared` sets it up anyway. The other way
/// round, the daemon refuses an image a kernel loop device backs read-write
/// unless `--shared`.
#[test]
fn kernel_attach_respects_image_locks_both_ways() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("klock.img");
    create_sparse_image(&img, 4 * MIB);
    let srv = Server::daemon().start();
    srv.ctl_ok(&["attach", path_str(&img), "--name", "k"]);
    for extra in [&[][..], &["--read-only"][..]] {
        let mut args = vec!["kernel", "attach", path_str(&img)];
        args.extend_from_slice(extra);
        let out = loopd_run(&args);
        if out.success() {
            // Never leak a device, even when the refusal is missing.
            if let Some(dev) = out.stdout.lines().next() {
                let _ = loopd_run(["kernel", "detach", dev.trim()]);
            }
        }
        assert_ctl_error(&out, "busy");
        assert!(
            out.stderr
                .contains(&format!("{:?} is in use", img.display().to_string()))
                && out.stderr.contains("pass --shared"),
            "{extra:?}: the daemon's message:\n{out}"
        );
        assert!(out.stdout.is_empty(), "{out}");
        assert!(
            listed(&img).is_empty(),
            "{extra:?}: a device was left behind"
        );
    }
    let (lo, _) = KernelLoop::attach(&img, &["--shared"]);
    assert_eq!(lo.sysfs("ro").as_deref(), Some("0"));

    // The daemon sees the kernel loop device writing.
    srv.ctl_ok(&["detach", "k"]);
    let out = srv.ctl_err(&["attach", path_str(&img), "--name", "k2"], "busy");
    assert!(
        out.stderr.contains(&format!(
            "kernel loop device {} has the image open for writing",
            lo.dev.display()
        )),
        "{out}"
    );
    srv.ctl_ok(&["attach", path_str(&img), "--name", "k3", "--shared"]);
    srv.ctl_ok(&["detach", "k3"]);
    drop(lo);
    srv.ctl_ok(&["attach", path_str(&img), "--name", "k4"]);
}

/// Issue 22 point 5. `kernel attach` probes the format as the daemon does: a
/// qcow2 made by qemu-img is refused (`invalid`) with the format named and the
/// `qemu-img convert` line; `--format raw` sets it up.
#[test]
fn kernel_attach_refuses_a_qcow2_image_unless_format_raw() {
    require_root();
    let dir = image_dir();
    let img = dir.path().join("vm.qcow2");
    run(
        "qemu-img",
        ["create", "-q", "-f", "qcow2", path_str(&img), "4M"],
    );
    let out = loopd_run(["kernel", "attach", path_str(&img)]);
    if out.success() {
        if let Some(dev) = out.stdout.lines().next() {
            let _ = loopd_run(["kernel", "detach", dev.trim()]);
        }
    }
    assert_ctl_error(&out, "invalid");
    let want = format!(
        "{:?} is a qcow2 image; loopd serves raw images only: convert it with 'qemu-img \
         convert -f qcow2 -O raw {:?} {:?}', or pass --format raw to serve its bytes as they are",
        path_str(&img),
        path_str(&img),
        path_str(&dir.path().join("vm.raw"))
    );
    assert!(out.stderr.contains(&want), "expected {want:?}:\n{out}");
    assert!(listed(&img).is_empty(), "a device was left behind");
    let (lo, _) = KernelLoop::attach(&img, &["--format", "raw"]);
    assert!(lo.is_ours());
}
