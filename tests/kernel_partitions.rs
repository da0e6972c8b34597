//! Partitions without races, under a kernel that parses partition tables
//! (the 6.12 VM: this build host's kernel has no partition parser at all).
//! Needs root, loop, `nbd` (modprobed here), mkfs.ext4, qemu-nbd.
//!
//! - `loopd kernel attach --partscan`: the partition nodes exist the moment
//!   the command returns, 20 times over; ext4 on p1 works; detach removes them.
//! - without `--partscan` the kernel does not scan.
//! - `loopd::blockdev::partitions::settle` on kernel NBD, whose scan the kernel
//!   defers to the first open ([`Rescan::FirstOpen`]).
//!
//! Images live on a tmpfs this suite mounts in a private directory (the VM's
//! root is read-only 9p); every loop device, NBD connection, mount and
//! process started here is undone by a guard, by PID or device.

#![cfg(feature = "vm-tests")]

mod common;

use common::gpt::{TWO_PARTS, two_partition_image};
use common::*;
use loopd::blockdev::partitions::{self, Rescan};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn require_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "the kernel partition tests must run as root");
    assert!(
        Path::new("/dev/loop-control").exists(),
        "/dev/loop-control missing (is the loop module loaded?)"
    );
}

/// Unmounts (lazily, if it must) when dropped.
struct Mounted(PathBuf);

impl Mounted {
    #[track_caller]
    fn mount(args: &[&str], dir: &Path) -> Mounted {
        std::fs::create_dir_all(dir).expect("mkdir mountpoint");
        let mut a: Vec<&str> = args.to_vec();
        a.push(path_str(dir));
        run("mount", a);
        Mounted(dir.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if !run_status("umount", [path_str(&self.0)]).success() {
            let _ = run_status("umount", ["-l", path_str(&self.0)]);
        }
    }
}

/// A private directory with a tmpfs on it (images must not live on 9p).
/// Field order: the mount is dropped before the directory.
struct Scratch {
    mount: Mounted,
    _dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Scratch {
        let dir = tempfile::Builder::new()
            .prefix("loopd-kpart")
            .tempdir()
            .expect("tempdir");
        let mount = Mounted::mount(&["-t", "tmpfs", "-o", "size=256m", "tmpfs"], dir.path());
        Scratch { mount, _dir: dir }
    }

    fn path(&self) -> &Path {
        &self.mount.0
    }
}

fn part_node(dev: &Path, k: u32) -> PathBuf {
    PathBuf::from(format!("{}p{k}", dev.display()))
}

/// `/sys/class/block/<disk>p<k>/<rel>`.
fn part_sysfs(dev: &Path, k: u32, rel: &str) -> Option<String> {
    let name = part_node(dev, k);
    let name = name.file_name()?.to_str()?;
    std::fs::read_to_string(format!("/sys/class/block/{name}/{rel}"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Asserts — one stat, no waiting — that `/dev/<disk>pK` is the block device
/// sysfs says partition K is.
#[track_caller]
fn assert_node_now(dev: &Path, k: u32, ctx: &str) {
    let node = part_node(dev, k);
    let md = std::fs::metadata(&node)
        .unwrap_or_else(|e| panic!("{ctx}: {} missing: {e}", node.display()));
    assert!(
        md.file_type().is_block_device(),
        "{ctx}: {} is not a block device",
        node.display()
    );
    let want = part_sysfs(dev, k, "dev")
        .unwrap_or_else(|| panic!("{ctx}: no sysfs entry for {}", node.display()));
    let got = format!("{}:{}", libc::major(md.rdev()), libc::minor(md.rdev()));
    assert_eq!(
        got,
        want,
        "{ctx}: {} has the wrong device number",
        node.display()
    );
}

/// How long each round watches the partition nodes after attach returned.
const SETTLE_WATCH: Duration = Duration::from_millis(500);

/// Inode numbers of `/dev/<disk>p1` and `p2` (0 for a missing node).
fn node_inodes(dev: &Path) -> [u64; 2] {
    [1, 2].map(|k| std::fs::metadata(part_node(dev, k)).map_or(0, |m| m.ino()))
}

/// Kernel uevents (`ACTION@DEVPATH` headers), as they arrive, from a
/// `NETLINK_KOBJECT_UEVENT` socket read by a thread; stopped on drop.
struct Uevents {
    log: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn socklen<T>() -> libc::socklen_t {
    libc::socklen_t::try_from(std::mem::size_of::<T>()).unwrap()
}

impl Uevents {
    fn listen() -> Uevents {
        // SAFETY: plain socket(2) call; the result is checked below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                libc::NETLINK_KOBJECT_UEVENT,
            )
        };
        assert!(
            fd >= 0,
            "uevent socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` is a fresh socket nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: all-zero is a valid sockaddr_nl; the fields are set below.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::sa_family_t::try_from(libc::AF_NETLINK).unwrap();
        addr.nl_groups = 1; // the kernel's multicast group
        // SAFETY: `addr` is a valid sockaddr_nl of the size passed.
        let r = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                socklen::<libc::sockaddr_nl>(),
            )
        };
        assert_eq!(
            r,
            0,
            "bind uevent socket: {}",
            std::io::Error::last_os_error()
        );
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 50_000,
        };
        let big: libc::c_int = 4 << 20;
        // SAFETY: both options take the pointed-to value of the size passed.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                socklen::<libc::timeval>(),
            );
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                &big as *const libc::c_int as *const libc::c_void,
                socklen::<libc::c_int>(),
            );
        }
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (l, st) = (log.clone(), stop.clone());
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 16 * 1024];
            while !st.load(Ordering::Relaxed) {
                // SAFETY: `buf` is writable for its length; `sock` is open.
                let n = unsafe {
                    libc::recv(
                        sock.as_raw_fd(),
                        buf.as_mut_ptr() as *mut libc::c_void,
                        buf.len(),
                        0,
                    )
                };
                let Ok(n) = usize::try_from(n) else {
                    continue; // timeout (or EINTR): look at `stop` again
                };
                let msg = &buf[..n];
                let mut fields = msg.split(|&b| b == 0);
                let head = String::from_utf8_lossy(fields.next().unwrap_or(&[])).into_owned();
                if head.contains('@') {
                    let extra: Vec<String> = fields
                        .filter(|f| f.starts_with(b"SEQNUM=") || f.starts_with(b"SYNTH_UUID="))
                        .map(|f| String::from_utf8_lossy(f).into_owned())
                        .collect();
                    let at = started.elapsed();
                    l.lock()
                        .unwrap()
                        .push(format!("{head}\t{at:?} {}", extra.join(" ")));
                }
            }
        });
        Uevents {
            log,
            stop,
            thread: Some(thread),
        }
    }

    /// Every event since `from` whose devpath contains `needle`, with times.
    fn dump(&self, from: usize, needle: &str) -> String {
        self.log.lock().unwrap()[from..]
            .iter()
            .filter(|h| h.contains(needle))
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn len(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    /// Events since `from` whose header is exactly `ACTION@DEVPATH`.
    fn count(&self, from: usize, action: &str, devpath_end: &str) -> usize {
        self.log.lock().unwrap()[from..]
            .iter()
            .filter(|h| {
                let h = h.split('\t').next().unwrap_or("");
                h.split_once('@')
                    .is_some_and(|(a, p)| a == action && p.ends_with(devpath_end))
            })
            .count()
    }
}

impl Drop for Uevents {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn backing_of(dev: &Path) -> Option<String> {
    loop_sysfs(dev, "loop/backing_file")
}

/// `--partscan` on a GPT image with two partitions, 20 times: the moment
/// `loopd kernel attach` returns, both partition nodes exist and are the
/// partitions sysfs lists (one stat each, no waiting), and they are not
/// dropped and re-added in the next 500 ms (same inodes; exactly one `add`
/// and no `remove` uevent for each from the kernel); `--json` and the plain
/// output list them with the table's start and size; ext4 made on p1 mounts
/// and keeps a file across detach/attach; p2's bytes are untouched; after
/// detach the partitions are gone.
#[test]
fn loop_partscan_nodes_exist_on_return() {
    require_root();
    require_tool("mkfs.ext4");
    let scratch = Scratch::new();
    let img = scratch.path().join("kgpt.img");
    two_partition_image(&img, 21);
    let mnt = scratch.path().join("mnt");
    let events = Uevents::listen();
    const ROUNDS: u32 = 20;
    let started = Instant::now();
    for round in 0..ROUNDS {
        let ctx = format!("round {round}");
        let json = round % 2 == 0;
        let args: &[&str] = if json {
            &["--partscan", "--json"]
        } else {
            &["--partscan"]
        };
        let mark = events.len();
        let t0 = Instant::now();
        let (dev, out) = KernelLoop::attach(&img, args);
        let took = t0.elapsed();
        // First thing after the command returned: the nodes.
        assert_node_now(&dev.dev, 1, &ctx);
        assert_node_now(&dev.dev, 2, &ctx);
        assert!(!part_node(&dev.dev, 3).exists(), "{ctx}: a third partition");
        assert_eq!(dev.sysfs("loop/partscan").as_deref(), Some("1"), "{ctx}");
        // No second scan after the return (udev re-reading the table on our
        // close would drop and re-add the partitions: devtmpfs then makes new
        // nodes, with new inode numbers).
        let inodes = node_inodes(&dev.dev);
        std::thread::sleep(SETTLE_WATCH);
        assert_eq!(
            node_inodes(&dev.dev),
            inodes,
            "{ctx}: partition nodes were re-created within {SETTLE_WATCH:?} after attach returned"
        );
        // And the kernel's own account: each partition added once, never
        // removed, from before the attach until now.
        let name = path_str(&dev.dev).trim_start_matches("/dev/").to_string();
        for k in [1, 2] {
            let tail = format!("/{name}/{name}p{k}");
            let (adds, removes) = (
                events.count(mark, "add", &tail),
                events.count(mark, "remove", &tail),
            );
            assert_eq!(
                (adds, removes),
                (1, 0),
                "{ctx}: uevents for {name}p{k}: {adds} add, {removes} remove (one scan wanted); \
                 attach took {took:?}; events:\n{}",
                events.dump(mark, &format!("/{name}"))
            );
        }

        if json {
            let j = Json::parse(&out.stdout);
            let parts = j.at("partitions").arr();
            assert_eq!(parts.len(), 2, "{ctx}:\n{}", out.stdout);
            for (i, (p, want)) in parts.iter().zip(TWO_PARTS).enumerate() {
                let k = u32::try_from(i).unwrap() + 1;
                assert_eq!(
                    p.at("device").str(),
                    path_str(&part_node(&dev.dev, k)),
                    "{ctx}"
                );
                assert_eq!(p.at("number").u64(), u64::from(k), "{ctx}");
                assert_eq!(p.at("start").u64(), want.start_bytes(), "{ctx}");
                assert_eq!(p.at("size").u64(), want.size_bytes(), "{ctx}");
            }
        } else {
            let want: Vec<String> = [
                dev.dev.clone(),
                part_node(&dev.dev, 1),
                part_node(&dev.dev, 2),
            ]
            .iter()
            .map(|p| path_str(p).to_string())
            .collect();
            assert_eq!(
                out.stdout.lines().collect::<Vec<_>>(),
                want,
                "{ctx}: plain output"
            );
        }

        if round == 0 {
            run("mkfs.ext4", ["-q", "-F", path_str(&part_node(&dev.dev, 1))]);
            let m = Mounted::mount(&[path_str(&part_node(&dev.dev, 1))], &mnt);
            std::fs::write(mnt.join("hello"), b"partition one\n").expect("write on p1");
            drop(m);
        }
        if round == ROUNDS - 1 {
            let m = Mounted::mount(&[path_str(&part_node(&dev.dev, 1))], &mnt);
            assert_eq!(
                std::fs::read(mnt.join("hello")).expect("read back on p1"),
                b"partition one\n"
            );
            drop(m);
        }

        let node1 = part_node(&dev.dev, 1);
        let loopdev = dev.dev.clone();
        let removed_from = events.len();
        drop(dev); // detach and wait
        // The detach's own `remove` uevents, before the next round's mark.
        let t = Instant::now();
        while [1, 2]
            .iter()
            .any(|k| events.count(removed_from, "remove", &format!("/{name}/{name}p{k}")) == 0)
        {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{ctx}: no remove uevents for the partitions of {name} after detach"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let t = Instant::now();
        while node1.exists() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        // (A parallel test may reuse the number, but never with partscan.)
        assert!(
            !node1.exists(),
            "{ctx}: {} left after detach (backing now {:?})",
            node1.display(),
            backing_of(&loopdev)
        );
    }
    // ext4 superblock magic on p1; p2 untouched by mkfs, mount and detach.
    let sb = read_range(&img, TWO_PARTS[0].start_bytes() + 1024 + 56, 2);
    assert_eq!(sb, [0x53, 0xef], "ext4 magic on partition 1");
    assert_file_pattern(
        &img,
        TWO_PARTS[1].start_bytes(),
        TWO_PARTS[1].size_bytes(),
        21,
        "partition 2 unchanged",
    );
    eprintln!(
        "{ROUNDS} partscan attach/detach rounds in {:?}",
        started.elapsed()
    );
}

/// Without `--partscan` the kernel does not scan: the same GPT image gets no
/// partition in sysfs or /dev, and only the device is printed.
#[test]
fn loop_without_partscan_has_no_partition_nodes() {
    require_root();
    let scratch = Scratch::new();
    let img = scratch.path().join("knops.img");
    two_partition_image(&img, 22);
    let (dev, out) = KernelLoop::attach(&img, &[]);
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        vec![path_str(&dev.dev)]
    );
    // The same image a second time (read-only, beside the first device, which
    // writes it): loopd's lock rules want --shared for that.
    let (dev2, out2) = KernelLoop::attach(&img, &["--json", "--read-only", "--shared"]);
    assert!(
        Json::parse(&out2.stdout).at("partitions").arr().is_empty(),
        "{out2}"
    );
    std::thread::sleep(Duration::from_millis(200));
    for d in [&dev, &dev2] {
        assert_eq!(d.sysfs("loop/partscan").as_deref(), Some("0"));
        for k in [1, 2] {
            assert!(
                part_sysfs(&d.dev, k, "dev").is_none(),
                "sysfs has p{k} of {}",
                d.dev.display()
            );
            assert!(
                !part_node(&d.dev, k).exists(),
                "{} exists",
                part_node(&d.dev, k).display()
            );
        }
    }
}

/// A kernel NBD device connected by `qemu-nbd -c` (foreground, our child).
/// Dropping it disconnects the device and reaps the process by PID.
struct NbdConn {
    dev: PathBuf,
    child: Child,
}

impl NbdConn {
    fn connect(img: &Path) -> NbdConn {
        let qemu_nbd = require_tool("qemu-nbd");
        if !Path::new("/sys/block/nbd0").exists() {
            run("modprobe", ["nbd"]);
        }
        let dev = (0..16)
            .map(|i| PathBuf::from(format!("/dev/nbd{i}")))
            .find(|d| {
                let name = d.file_name().and_then(|n| n.to_str()).unwrap_or("");
                d.exists() && !Path::new(&format!("/sys/block/{name}/pid")).exists()
            })
            .expect("no free /dev/nbdN");
        let child = Command::new(qemu_nbd)
            .args(["--verbose", "--format=raw", "--cache=none", "--connect"])
            .arg(&dev)
            .arg(img)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn qemu-nbd");
        let mut conn = NbdConn { dev, child };
        let name = conn.dev.file_name().unwrap().to_str().unwrap().to_owned();
        let t = Instant::now();
        // `pid` appears before the size is set: wait for both.
        let size = || {
            std::fs::read_to_string(format!("/sys/block/{name}/size"))
                .map_or(0, |s| s.trim().parse::<u64>().unwrap_or(0))
        };
        while !Path::new(&format!("/sys/block/{name}/pid")).exists() || size() == 0 {
            if let Ok(Some(st)) = conn.child.try_wait() {
                panic!("qemu-nbd exited before connecting {name}: {st}");
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{name} not connected after 20 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        conn
    }
}

impl Drop for NbdConn {
    fn drop(&mut self) {
        let _ = run_status("qemu-nbd", ["--disconnect", path_str(&self.dev)]);
        let t = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if t.elapsed() > Duration::from_secs(10) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// The shared helper on kernel NBD: after the connect, the kernel has only
/// marked the disk for a scan at its next open; `settle(FirstOpen)` returns
/// both partitions with their table's start and size and their /dev nodes in
/// place, and reading p2's node gives p2's bytes.
#[test]
fn nbd_settle_first_open_scans_and_waits() {
    require_root();
    let scratch = Scratch::new();
    let img = scratch.path().join("nbdgpt.img");
    two_partition_image(&img, 24);
    let conn = NbdConn::connect(&img);
    // qemu-nbd connects through the ioctl interface, whose NBD_DO_IT marks
    // the disk for a scan a second time after the size is set; udev's open
    // may then rescan after ours. Let udev finish first (loopd's netlink
    // connect marks it once).
    if which("udevadm").is_some() && Path::new("/run/udev/control").exists() {
        let _ = run_status("udevadm", ["settle", "--timeout=10"]);
    }
    let parts = partitions::settle(&conn.dev, Rescan::FirstOpen, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("settle {}: {e:#}", conn.dev.display()));
    assert_eq!(parts.len(), 2, "{parts:?}");
    for (i, (p, want)) in parts.iter().zip(TWO_PARTS).enumerate() {
        let k = u32::try_from(i).unwrap() + 1;
        assert_eq!(p.device, part_node(&conn.dev, k));
        assert_eq!(p.number, k);
        assert_eq!(p.start, want.start_bytes());
        assert_eq!(p.size, want.size_bytes());
        assert_node_now(&conn.dev, k, "nbd");
    }
    let got = read_range(&parts[1].device, 0, 64 * KIB);
    assert_bytes_eq(
        &got,
        &pattern_bytes(24, TWO_PARTS[1].start_bytes(), 64 * 1024),
        0,
        "p2 through its node",
    );
    // A partition is not a whole disk.
    let e = partitions::settle(&parts[0].device, Rescan::AlreadyDone, Duration::ZERO)
        .expect_err("settle on a partition");
    assert!(e.to_string().contains("not a whole disk"), "{e}");
    drop(conn);
}
