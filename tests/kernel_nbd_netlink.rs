//! `loopd::kernel_nbd` against the real kernel `nbd` driver: runs in the test
//! VM (a kernel with `nbd`; see scripts/vm-test.sh), as root, with images on
//! a tmpfs (`TMPDIR`). `loopd serve` (the harness) is the server; the test
//! does the NBD handshake client-side on Unix connections and hands those
//! sockets to the kernel over netlink, as the daemon will with socket pairs.
//! Every device a test connects is disconnected by a guard, even on failure.
#![cfg(feature = "vm-tests")]

mod common;

use common::*;
use loopd::kernel_nbd::{ConnectParams, KernelNbd, KernelNbdError, ReconfigureParams};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const IMAGE_SIZE: u64 = 16 * MIB;
const BLOCK: u32 = 4096;
const SEED: u8 = 0x5a;

fn pat(seed: u8, off: u64, len: u64) -> Vec<u8> {
    pattern_bytes(seed, off, usize::try_from(len).expect("test length"))
}

fn require_nbd() -> KernelNbd {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "the kernel nbd tests must run as root");
    let out = run_status("modprobe", ["nbd"]);
    assert!(
        out.success(),
        "modprobe nbd failed (is this the test VM?): {out}"
    );
    KernelNbd::open().unwrap_or_else(|e| panic!("open the nbd netlink family: {e}"))
}

/// Disconnects the device when dropped (a failed test leaves nothing behind).
struct Connected {
    index: u32,
}

impl Drop for Connected {
    fn drop(&mut self) {
        if let Ok(mut k) = KernelNbd::open() {
            let _ = k.disconnect(self.index);
        }
    }
}

fn sysfs(index: u32, rel: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/block/nbd{index}/{rel}"))
        .ok()
        .map(|s| s.trim().to_string())
}

fn dev_size(index: u32) -> u64 {
    sysfs(index, "size").map_or(0, |s| s.parse::<u64>().expect("sysfs size") * 512)
}

/// `n` connections to `server`, each past the handshake (NBD_OPT_EXPORT_NAME,
/// simple replies), with the read/write timeouts cleared: the kernel's
/// receive thread would otherwise see them as a dead connection.
fn negotiated(server: &Server, n: usize) -> (Vec<UnixStream>, u64, u16) {
    let mut socks = Vec::new();
    let mut size_flags = None;
    for _ in 0..n {
        let (c, size, flags) = RawClient::handshake(server.socket(), server.name());
        c.s.set_read_timeout(None).expect("clear read timeout");
        c.s.set_write_timeout(None).expect("clear write timeout");
        size_flags = Some((size, flags));
        socks.push(c.s);
    }
    let (size, flags) = size_flags.expect("at least one connection");
    (socks, size, flags)
}

fn fds(socks: &[UnixStream]) -> Vec<BorrowedFd<'_>> {
    socks.iter().map(AsFd::as_fd).collect()
}

/// `dd` with O_DIRECT on the device: the bytes really travel to loopd.
fn dd_write(index: u32, src: &Path, off: u64, len: u64) -> Out {
    let mut c = tool("dd");
    c.arg(format!("if={}", src.display()))
        .arg(format!("of=/dev/nbd{index}"))
        .arg(format!("bs={BLOCK}"))
        .arg(format!("seek={}", off / u64::from(BLOCK)))
        .arg(format!("count={}", len / u64::from(BLOCK)))
        .args(["oflag=direct", "conv=notrunc,fsync", "status=none"]);
    run_cmd_timeout(c, Duration::from_secs(120))
}

fn dd_read(index: u32, dst: &Path, off: u64, len: u64) -> Out {
    let mut c = tool("dd");
    c.arg(format!("if=/dev/nbd{index}"))
        .arg(format!("of={}", dst.display()))
        .arg(format!("bs={BLOCK}"))
        .arg(format!("skip={}", off / u64::from(BLOCK)))
        .arg(format!("count={}", len / u64::from(BLOCK)))
        .args(["iflag=direct", "status=none"]);
    run_cmd_timeout(c, Duration::from_secs(120))
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "{what}: not within {timeout:?}");
        thread::sleep(Duration::from_millis(50));
    }
}

fn image(dir: &Path) -> PathBuf {
    let img = dir.join("disk.img");
    create_pattern_image(&img, IMAGE_SIZE, SEED);
    img
}

#[test]
fn connect_two_sockets_serves_io_then_disconnect_clears_the_device() {
    let mut k = require_nbd();
    let dir = tempdir();
    let img = image(dir.path());
    let server = Server::builder(&img).start();
    let (socks, size, flags) = negotiated(&server, 2);
    assert_eq!(size, IMAGE_SIZE);

    let p = ConnectParams {
        size_bytes: size,
        block_size: BLOCK,
        server_flags: flags,
        timeout: Some(Duration::from_secs(30)),
        backend: Some("loopd-test-connect".into()),
        ..ConnectParams::default()
    };
    let index = k.connect(&p, &fds(&socks)).expect("connect");
    let dev = Connected { index };
    // The kernel holds its own references: our copies may go.
    drop(socks);

    assert_eq!(dev_size(index), IMAGE_SIZE, "device size");
    assert_eq!(
        sysfs(index, "queue/logical_block_size").as_deref(),
        Some("4096")
    );
    assert_eq!(
        sysfs(index, "backend").as_deref(),
        Some("loopd-test-connect")
    );
    assert_eq!(sysfs(index, "ro").as_deref(), Some("0"));
    let st = k.status(Some(index)).expect("status");
    assert_eq!(st.len(), 1, "status of one index: {st:?}");
    assert!(st[0].connected && st[0].index == index, "{st:?}");
    assert!(
        k.status(None)
            .expect("status all")
            .iter()
            .any(|d| d.index == index && d.connected),
        "STATUS of all devices lists /dev/nbd{index}"
    );

    // Write a new pattern through the device: it lands in the image file.
    let src = dir.path().join("src.bin");
    let (woff, wlen) = (MIB, 256 * KIB);
    std::fs::write(&src, pat(0x77, 0, wlen)).expect("write src");
    dd_write(index, &src, woff, wlen).assert_success();
    assert_bytes_eq(
        &read_range(&img, woff, wlen),
        &pat(0x77, 0, wlen),
        woff,
        "image after dd to /dev/nbd",
    );
    // Read back through the device: written range and untouched image data.
    let dst = dir.path().join("dst.bin");
    dd_read(index, &dst, 0, 2 * MIB).assert_success();
    let got = read_file(&dst);
    assert_bytes_eq(
        &got,
        &read_range(&img, 0, 2 * MIB),
        0,
        "device read vs image",
    );

    // A second connect on the same index: EBUSY, said so.
    let (more, _, _) = negotiated(&server, 1);
    let busy = k
        .connect(
            &ConnectParams {
                index: Some(index),
                ..p.clone()
            },
            &fds(&more),
        )
        .expect_err("connect to an index in use");
    assert!(matches!(busy, KernelNbdError::Busy { .. }), "{busy:?}");
    let text = busy.to_string();
    assert!(
        text.contains(&format!("/dev/nbd{index}: the device is already in use"))
            && text.contains("leave out the index"),
        "{text}"
    );
    eprintln!("busy: {text}");

    // An index beyond the minor numbers the module can give: EINVAL, said so.
    let far = k
        .connect(
            &ConnectParams {
                index: Some(1 << 20),
                ..p.clone()
            },
            &fds(&more),
        )
        .expect_err("connect beyond the minor range");
    assert!(
        matches!(
            far,
            KernelNbdError::BadIndex {
                index: 0x10_0000,
                ..
            }
        ),
        "{far:?}"
    );
    let text = far.to_string();
    assert!(text.contains("takes indexes up to"), "{text}");
    eprintln!("index beyond range: {text}");

    k.disconnect(index).expect("disconnect");
    wait_until("device disconnected", Duration::from_secs(10), || {
        dev_size(index) == 0
            && k.status(Some(index))
                .map(|s| s.iter().all(|d| !d.connected))
                .unwrap_or(false)
    });
    // Reconfiguring a disconnected device is refused with a reason.
    let e = k
        .reconfigure(index, &ReconfigureParams::default(), &fds(&more))
        .expect_err("reconfigure a disconnected device");
    assert!(matches!(e, KernelNbdError::NotConnected { .. }), "{e:?}");
    eprintln!("reconfigure after disconnect: {e}");
    drop(dev);
}

#[test]
fn reconfigure_after_daemon_restart_completes_io_issued_during_the_outage() {
    let mut k = require_nbd();
    let dir = tempdir();
    let img = image(dir.path());
    let sock_path = dir.path().join("nbd.sock");
    let mut server = Server::builder(&img).socket_path(&sock_path).start();
    let (socks, size, flags) = negotiated(&server, 2);
    let backend = "loopd-test-restart".to_string();
    let p = ConnectParams {
        size_bytes: size,
        block_size: BLOCK,
        server_flags: flags,
        timeout: Some(Duration::from_secs(5)),
        dead_conn_timeout: Some(Duration::from_secs(60)),
        backend: Some(backend.clone()),
        ..ConnectParams::default()
    };
    let mut watcher = k.watch_link_dead().expect("watch_link_dead");
    let index = k.connect(&p, &fds(&socks)).expect("connect");
    let _dev = Connected { index };
    drop(socks);
    let dst = dir.path().join("before.bin");
    dd_read(index, &dst, 0, 64 * KIB).assert_success();

    // A read in flight when loopd dies: sent while it is stopped, unanswered.
    let (ioff, ilen) = (12 * MIB, 64 * KIB);
    let inflight = dir.path().join("inflight.bin");
    let (itx, irx) = mpsc::channel();
    server.signal(libc::SIGSTOP);
    {
        let inflight = inflight.clone();
        thread::spawn(move || {
            let _ = itx.send(dd_read(index, &inflight, ioff, ilen));
        });
    }
    assert!(
        irx.recv_timeout(Duration::from_secs(1)).is_err(),
        "a read completed while loopd was stopped"
    );
    server.kill9();
    // The kernel's receive threads see EOF, mark both connections dead and
    // announce it.
    let start = Instant::now();
    let mut dead = Vec::new();
    while dead.iter().filter(|&&i| i == index).count() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no NBD_CMD_LINK_DEAD for both connections of /dev/nbd{index}: got {dead:?}"
        );
        dead.extend(watcher.wait(Duration::from_millis(200)).expect("watch"));
    }

    // I/O during the outage: a write and a read, both with O_DIRECT.
    let src = dir.path().join("src.bin");
    let (woff, wlen) = (4 * MIB, 128 * KIB);
    std::fs::write(&src, pat(0x33, 0, wlen)).expect("write src");
    let (roff, rlen) = (8 * MIB, 128 * KIB);
    let out = dir.path().join("outage.bin");
    let (tx, rx) = mpsc::channel();
    {
        let (src, out) = (src.clone(), out.clone());
        thread::spawn(move || {
            let w = dd_write(index, &src, woff, wlen);
            let r = dd_read(index, &out, roff, rlen);
            let _ = tx.send((w, r));
        });
    }
    // Still waiting for a connection two seconds later (not failed).
    assert!(
        rx.recv_timeout(Duration::from_secs(2)).is_err(),
        "I/O during the outage finished before any new connection: it should wait"
    );

    // The restarted daemon finds its device by backend identifier.
    assert_eq!(k.find_backend(&backend).expect("find_backend"), Some(index));
    assert_eq!(k.find_backend("someone-else").expect("find_backend"), None);
    let server2 = Server::builder(&img).socket_path(&sock_path).start();
    let (socks2, size2, flags2) = negotiated(&server2, 2);
    assert_eq!((size2, flags2), (size, flags));
    let rp = ReconfigureParams {
        backend: Some(backend),
        ..ReconfigureParams::default()
    };
    k.reconfigure(index, &rp, &fds(&socks2))
        .expect("reconfigure");
    drop(socks2);

    let (w, r) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("I/O issued during the outage did not complete after RECONFIGURE");
    w.assert_success();
    r.assert_success();
    // The read in flight at the crash timed out (5 s), was requeued and
    // served by the new connections.
    let i = irx
        .recv_timeout(Duration::from_secs(60))
        .expect("the read in flight at the crash did not complete after RECONFIGURE");
    i.assert_success();
    assert_bytes_eq(
        &read_file(&inflight),
        &pat(SEED, ioff, ilen),
        ioff,
        "read in flight at the crash",
    );
    assert_bytes_eq(
        &read_range(&img, woff, wlen),
        &pat(0x33, 0, wlen),
        woff,
        "outage write in the image",
    );
    assert_bytes_eq(
        &read_file(&out),
        &pat(SEED, roff, rlen),
        roff,
        "outage read",
    );
    let st = k.status(Some(index)).expect("status");
    assert!(st.iter().any(|d| d.index == index && d.connected), "{st:?}");

    // And the device keeps working on the new connections.
    let after = dir.path().join("after.bin");
    dd_read(index, &after, woff, wlen).assert_success();
    assert_bytes_eq(
        &read_file(&after),
        &pat(0x33, 0, wlen),
        woff,
        "read after reconfigure",
    );

    // Disconnect while loopd still runs: it gets NBD_CMD_DISC on both.
    k.disconnect(index).expect("disconnect");
    wait_until("device disconnected", Duration::from_secs(10), || {
        dev_size(index) == 0
    });
    drop(server2);
}

#[test]
fn read_only_export_makes_a_read_only_device() {
    let mut k = require_nbd();
    let dir = tempdir();
    let img = image(dir.path());
    let server = Server::builder(&img).arg("--read-only").start();
    let (socks, size, flags) = negotiated(&server, 1);
    assert_ne!(
        flags & loopd::kernel_nbd::NBD_FLAG_READ_ONLY,
        0,
        "export flags {flags:#x}"
    );
    let p = ConnectParams {
        size_bytes: size,
        block_size: 512,
        server_flags: flags,
        ..ConnectParams::default()
    };
    let index = k.connect(&p, &fds(&socks)).expect("connect");
    let _dev = Connected { index };
    drop(socks);
    assert_eq!(sysfs(index, "ro").as_deref(), Some("1"));
    assert_eq!(
        sysfs(index, "queue/logical_block_size").as_deref(),
        Some("512")
    );
    let dst = dir.path().join("dst.bin");
    dd_read(index, &dst, 0, MIB).assert_success();
    assert_bytes_eq(
        &read_file(&dst),
        &read_range(&img, 0, MIB),
        0,
        "read-only device read",
    );
    let src = dir.path().join("src.bin");
    std::fs::write(&src, pat(1, 0, 64 * KIB)).expect("write src");
    let w = dd_write(index, &src, 0, 64 * KIB);
    assert!(
        !w.success(),
        "a write to a read-only nbd device succeeded: {w}"
    );
    assert_bytes_eq(
        &read_range(&img, 0, 64 * KIB),
        &pat(SEED, 0, 64 * KIB),
        0,
        "image untouched",
    );
    k.disconnect(index).expect("disconnect");
    wait_until("device disconnected", Duration::from_secs(10), || {
        dev_size(index) == 0
    });
}

/// Set in the copy of this test binary that runs without privileges.
const UNPRIVILEGED_ENV: &str = "LOOPD_KNBD_UNPRIVILEGED";

#[test]
fn control_without_cap_sys_admin_is_refused_with_the_reason() {
    if std::env::var_os(UNPRIVILEGED_ENV).is_some() {
        // The child: nobody, no capabilities. Resolving the family needs no
        // privilege; changing a device does.
        let mut k = KernelNbd::open().expect("open as an unprivileged user");
        let e = k
            .disconnect(0)
            .expect_err("disconnect without CAP_SYS_ADMIN");
        assert!(matches!(e, KernelNbdError::NotPermitted { .. }), "{e:?}");
        println!("unprivileged: {e}");
        return;
    }
    let _k = require_nbd();
    let exe = std::env::current_exe().expect("current_exe");
    let mut c = tool("setpriv");
    c.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ])
    .arg(exe)
    .args([
        "--exact",
        "control_without_cap_sys_admin_is_refused_with_the_reason",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(UNPRIVILEGED_ENV, "1");
    let out = run_cmd_timeout(c, Duration::from_secs(60)).assert_success();
    assert!(
        out.stdout.contains(
            "unprivileged: disconnect: not permitted: controlling nbd devices needs \
             CAP_SYS_ADMIN (run as root)"
        ),
        "{out}"
    );
}

/// `nbds_max` only says how many devices exist at load: an index past it is
/// added on connect (nbd.c `nbd_dev_add`), so it is no limit for loopd.
#[test]
fn connect_past_nbds_max_adds_the_device() {
    let mut k = require_nbd();
    let nbds_max: u32 = std::fs::read_to_string("/sys/module/nbd/parameters/nbds_max")
        .expect("nbds_max")
        .trim()
        .parse()
        .expect("nbds_max is a number");
    let index = nbds_max + 100;
    assert!(!Path::new(&format!("/sys/block/nbd{index}")).exists());
    let dir = tempdir();
    let img = image(dir.path());
    let server = Server::builder(&img).start();
    let (socks, size, flags) = negotiated(&server, 1);
    let p = ConnectParams {
        index: Some(index),
        size_bytes: size,
        block_size: 4096,
        server_flags: flags,
        ..ConnectParams::default()
    };
    let got = k.connect(&p, &fds(&socks)).expect("connect past nbds_max");
    let _dev = Connected { index: got };
    drop(socks);
    assert_eq!(got, index);
    assert_eq!(dev_size(index), IMAGE_SIZE);
    let dst = dir.path().join("dst.bin");
    dd_read(index, &dst, 0, MIB).assert_success();
    assert_bytes_eq(
        &read_file(&dst),
        &read_range(&img, 0, MIB),
        0,
        "read past nbds_max",
    );
    k.disconnect(index).expect("disconnect");
    wait_until("device disconnected", Duration::from_secs(10), || {
        dev_size(index) == 0
    });
}
