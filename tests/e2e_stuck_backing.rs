//! A backing store that stops answering must hold up its own clients only.
//!
//! The stuck store is a FUSE file (`nbdfuse`) over an `nbdkit` whose process is
//! paused with SIGSTOP: every request that reaches the FUSE server waits until it
//! is continued. One daemon with a single reactor serves it as device `stuck` and
//! an image on the local disk as `healthy`, so both share the reactor thread. While
//! a 4 KiB buffered write, 24 reads and a BLOCK_STATUS of `stuck` are outstanding,
//! a client of `healthy` must get each read and FUA write (which go through the
//! ring's kernel workers) answered promptly, and a new
//! client must be placed and served; once nbdkit continues, the stuck write
//! completes and its bytes read back.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longest a healthy client's request may take while the other store hangs.
const HEALTHY_OP_MAX: Duration = Duration::from_secs(2);
/// Reads outstanding on the stuck store.
const STUCK_READS: u64 = 24;
const FUA: u16 = 1;
/// How long the store stays paused.
const STUCK_FOR: Duration = Duration::from_secs(8);

/// nbdkit + nbdfuse + the mount; undone (continued, unmounted, killed by PID) on
/// drop, whatever happened.
struct FuseStore {
    nbdkit: Child,
    nbdfuse: Child,
    mnt: PathBuf,
}

impl FuseStore {
    fn start(dir: &Path) -> FuseStore {
        require_tool("nbdkit");
        require_tool("nbdfuse");
        let sock = dir.join("nbdkit.sock");
        let mnt = dir.join("mnt");
        std::fs::create_dir(&mnt).expect("mkdir mnt");
        let nbdkit = tool("nbdkit")
            .args(["-f", "--exit-with-parent", "--unix"])
            .arg(&sock)
            .args(["memory", "64M"])
            .spawn()
            .expect("spawn nbdkit");
        let mut store = FuseStore {
            nbdkit,
            // Replaced below; a placeholder child that exits at once.
            nbdfuse: Command::new("true").spawn().expect("spawn true"),
            mnt,
        };
        wait_for(|| sock.exists(), "nbdkit's socket");
        let _ = store.nbdfuse.wait();
        store.nbdfuse = tool("nbdfuse")
            .arg(&store.mnt)
            .arg("--unix")
            .arg(&sock)
            .spawn()
            .expect("spawn nbdfuse");
        let file = store.file();
        wait_for(
            || file.metadata().is_ok_and(|m| m.len() == 64 * MIB),
            "the FUSE file",
        );
        store
    }

    fn file(&self) -> PathBuf {
        self.mnt.join("nbd")
    }

    fn signal(&self, sig: libc::c_int) {
        signal(&self.nbdkit, sig);
    }
}

fn signal(c: &Child, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(c.id()).expect("pid");
    // SAFETY: kill(2) on the PID of a child we spawned and have not reaped.
    unsafe { libc::kill(pid, sig) };
}

impl Drop for FuseStore {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        signal(&self.nbdfuse, libc::SIGCONT);
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        for c in [&mut self.nbdfuse, &mut self.nbdkit] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Continues nbdkit on drop (so a failing test never leaves requests hanging).
struct Paused<'a>(&'a FuseStore);

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        self.0.signal(libc::SIGCONT);
    }
}

/// A child process killed (by PID) and reaped on drop.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(mut ok: impl FnMut() -> bool, what: &str) {
    let t0 = Instant::now();
    while !ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what} did not appear"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_paused_fuse_store_stalls_its_own_clients_only() {
    let dir = tempdir();
    let store = FuseStore::start(dir.path());
    let healthy_img = dir.path().join("healthy.img");
    create_pattern_image(&healthy_img, 16 * MIB, 4);
    let srv = Server::daemon().args(["--reactors", "1"]).start();
    srv.ctl_ok(&[
        "attach",
        path_str(&store.file()),
        "--name",
        "stuck",
        "--cache",
        "buffered",
    ]);
    srv.ctl_ok(&[
        "attach",
        path_str(&healthy_img),
        "--name",
        "healthy",
        "--cache",
        "buffered",
    ]);
    let (mut h, _, _) = RawClient::handshake(srv.socket(), "healthy");
    let (mut s, _, _) = RawClient::handshake(srv.socket(), "stuck");
    let (mut sr, _, _) = RawClient::handshake(srv.socket(), "stuck");
    assert_eq!(h.write(1, 0, &[1u8; 4096]), 0);

    let paused = Paused(&store);
    store.signal(libc::SIGSTOP);
    let paused_at = Instant::now();
    // A whole-page buffered write (the inline-write case), a read of pages never
    // cached, and a BLOCK_STATUS, all on the stuck store.
    let data = pattern_bytes(9, 0, 4096);
    let (tx, rx) = mpsc::channel();
    let writer = {
        let data = data.clone();
        std::thread::spawn(move || {
            s.s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let err = s.write(7, 8 * MIB, &data);
            let _ = tx.send(err);
            s
        })
    };
    // More reads than the kernel's default io_uring worker count (4 per CPU), so
    // they would hold every worker a reactor has for file I/O.
    for r in 0..STUCK_READS {
        sr.send_request(0, NBD_CMD_READ, 8 + r, 32 * MIB + r * MIB, 4096);
    }
    let uri = srv.uri_for_name("stuck");
    let script = format!(
        "{NBDSH_PRELUDE}\ng = connect({})\nents = []\n\
         g.block_status(65536, 0, lambda m, o, e, err: ents.extend(e))\nprint('block status', ents)\n",
        py_str(&uri)
    );
    let bs = Reaped(
        tool("nbdsh")
            .args(["-c", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nbdsh"),
    );

    // Meanwhile the healthy device answers every request promptly, and a new
    // client is placed and served.
    let t0 = Instant::now();
    let mut k = 0u64;
    while t0.elapsed() < STUCK_FOR {
        k += 1;
        let off = (k % 1024) * 4096;
        let byte = u8::try_from(k % 251).expect("below 251");
        let t = Instant::now();
        // FUA: the write and its sync go through the ring's workers.
        assert_eq!(h.write_flags(FUA, 100 + k, off, &[byte; 4096]), 0);
        let back = h.read(200 + k, off, 4096);
        assert_eq!(back, vec![byte; 4096], "healthy read-back at {off}");
        let took = t.elapsed();
        assert!(
            took < HEALTHY_OP_MAX,
            "a healthy device's write+read took {took:?} while another device's store hung"
        );
        if k == 5 {
            let t = Instant::now();
            let (mut n, _, _) = RawClient::handshake(srv.socket(), "healthy");
            let got = n.read(1, 0, 4096);
            assert_eq!(got, vec![1u8; 4096]);
            assert!(
                t.elapsed() < HEALTHY_OP_MAX,
                "a new client of the healthy device took {:?}",
                t.elapsed()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(k >= 20, "only {k} healthy round trips in {STUCK_FOR:?}");
    if let Ok(answer) = rx.try_recv() {
        panic!(
            "the write to the paused store was answered ({answer:?}, {:?} after the pause): \
             the store was not stuck",
            paused_at.elapsed()
        );
    }

    // The store continues: everything outstanding completes, correctly.
    drop(paused);
    let err = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the stuck write never completed after the store continued");
    assert_eq!(err, 0, "the stuck write failed with NBD error {err}");
    let mut s = writer.join().expect("writer thread");
    let mut answered = Vec::new();
    for _ in 0..STUCK_READS {
        let (err, h) = sr.read_simple_reply();
        assert_eq!(err, 0, "stuck read {h}");
        assert_eq!(sr.read_exact(4096), vec![0u8; 4096]);
        answered.push(h);
    }
    answered.sort_unstable();
    assert_eq!(answered, (8..8 + STUCK_READS).collect::<Vec<_>>());
    assert_eq!(s.read(9, 8 * MIB, 4096), data, "the stuck write's bytes");
    let mut bs = bs;
    let status = exit_within(
        &mut bs.0,
        Duration::from_secs(20),
        "BLOCK_STATUS never completed",
    );
    let mut out = String::new();
    for o in [
        bs.0.stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn std::io::Read>),
        bs.0.stderr
            .take()
            .map(|o| Box::new(o) as Box<dyn std::io::Read>),
    ]
    .into_iter()
    .flatten()
    {
        let mut o = o;
        let _ = o.read_to_string(&mut out);
    }
    assert!(
        status.success() && out.contains("block status"),
        "nbdsh: {status} {out}"
    );
    drop(srv);
    drop(store);
}

/// Continues the FUSE server (nbdfuse itself) on drop.
struct FusePaused<'a>(&'a FuseStore);

impl Drop for FusePaused<'_> {
    fn drop(&mut self) {
        signal(&self.0.nbdfuse, libc::SIGCONT);
    }
}

/// BLOCK_STATUS asks the file's size (`fstat`) and holes (`lseek`): with the FUSE
/// server itself paused, once its cached attributes expire the `fstat` waits for
/// it. That wait must not hold up the other device on the same reactor.
#[test]
fn block_status_on_a_paused_fuse_server_stalls_its_own_device_only() {
    let dir = tempdir();
    let store = FuseStore::start(dir.path());
    let healthy_img = dir.path().join("healthy.img");
    create_pattern_image(&healthy_img, 16 * MIB, 4);
    let srv = Server::daemon().args(["--reactors", "1"]).start();
    for (img, name) in [(store.file(), "stuck"), (healthy_img.clone(), "healthy")] {
        srv.ctl_ok(&[
            "attach",
            path_str(&img),
            "--name",
            name,
            "--cache",
            "buffered",
        ]);
    }
    let (mut h, _, _) = RawClient::handshake(srv.socket(), "healthy");
    let uri = srv.uri_for_name("stuck");
    let script = format!(
        "{NBDSH_PRELUDE}\ng = connect({})\nimport time\nprint('connected', flush=True)\n\
         time.sleep(3)\nents = []\n\
         g.block_status(65536, 0, lambda m, o, e, err: ents.extend(e))\nprint('block status', ents)\n",
        py_str(&uri)
    );
    let mut bs = Reaped(
        tool("nbdsh")
            .args(["-c", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nbdsh"),
    );
    // Connected (the handshake needs no backing file), then pause the FUSE
    // server; the BLOCK_STATUS goes out 3 s later, after the attribute cache
    // (1 s) has expired.
    std::thread::sleep(Duration::from_millis(1500));
    let paused = FusePaused(&store);
    signal(&store.nbdfuse, libc::SIGSTOP);
    let t0 = Instant::now();
    let mut k = 0u64;
    while t0.elapsed() < STUCK_FOR {
        k += 1;
        let off = (k % 1024) * 4096;
        let byte = u8::try_from(k % 251).expect("below 251");
        let t = Instant::now();
        assert_eq!(h.write(100 + k, off, &[byte; 4096]), 0);
        assert_eq!(h.read(200 + k, off, 4096), vec![byte; 4096]);
        let took = t.elapsed();
        assert!(
            took < HEALTHY_OP_MAX,
            "a healthy device's write+read took {took:?} while BLOCK_STATUS of another hung"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(k >= 20, "only {k} healthy round trips in {STUCK_FOR:?}");
    assert!(
        bs.0.try_wait().expect("wait nbdsh").is_none(),
        "BLOCK_STATUS was answered while the FUSE server was paused: it was not stuck"
    );
    drop(paused);
    let status = exit_within(
        &mut bs.0,
        Duration::from_secs(20),
        "BLOCK_STATUS never completed",
    );
    let mut out = String::new();
    if let Some(mut o) = bs.0.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut out);
    }
    assert!(
        status.success() && out.contains("block status"),
        "nbdsh: {status} {out}"
    );
    drop(srv);
    drop(store);
}

/// Queries sent to the stuck device at once: twice the offload workers there
/// were for all devices together before they were shared out per device.
const STUCK_QUERIES: usize = 32;

/// `nbdsh -c SCRIPT` with piped output, killed on drop.
fn nbdsh_child(script: &str) -> Reaped {
    Reaped(
        tool("nbdsh")
            .args(["-c", &format!("{NBDSH_PRELUDE}\n{script}")])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nbdsh"),
    )
}

/// What a finished child printed (stdout then stderr).
fn output_of(c: &mut std::process::Child) -> String {
    let mut out = String::new();
    if let Some(mut o) = c.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut out);
    }
    if let Some(mut o) = c.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut out);
    }
    out
}

/// BLOCK_STATUS runs on offload workers (its fstat and lseeks can wait on the
/// backing store). 32 queries to a device whose FUSE server is paused hold at
/// most its share of the workers: another device's BLOCK_STATUS (what
/// `qemu-img convert` and `nbdcopy` send first) is answered within
/// HEALTHY_OP_MAX all through the stall. Before, the 32 held all 16 workers
/// and every device's BLOCK_STATUS waited for the store (18 s of 20.5 in the
/// issue).
#[test]
fn block_status_of_a_hung_store_holds_no_other_devices_workers() {
    let dir = tempdir();
    let store = FuseStore::start(dir.path());
    let healthy_img = dir.path().join("healthy.img");
    create_pattern_image(&healthy_img, 16 * MIB, 4);
    let srv = Server::daemon().start();
    for (img, name) in [(store.file(), "stuck"), (healthy_img.clone(), "healthy")] {
        srv.ctl_ok(&[
            "attach",
            path_str(&img),
            "--name",
            name,
            "--cache",
            "buffered",
        ]);
    }
    // Connect, then (once the FUSE server is paused and its cached attributes
    // have expired) send every query at once and wait for the answers.
    let mut stuck = nbdsh_child(&format!(
        "g = connect({})\nimport time\nprint('connected', flush=True)\ntime.sleep(3)\n\
         for i in range({STUCK_QUERIES}):\n    \
         g.aio_block_status(65536, i * 65536, lambda m, o, e, err: 0)\n\
         print('sent', flush=True)\n\
         while g.aio_in_flight() > 0:\n    g.poll(-1)\n\
         print('answered', flush=True)\n",
        py_str(&srv.uri_for_name("stuck"))
    ));
    std::thread::sleep(Duration::from_millis(1500));
    let paused = FusePaused(&store);
    signal(&store.nbdfuse, libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(3));
    // The healthy device's client asks again and again for STUCK_FOR.
    let mut healthy = nbdsh_child(&format!(
        "g = connect({})\nimport time\nworst = 0.0\nn = 0\n\
         end = time.monotonic() + {}\n\
         while time.monotonic() < end:\n    \
         t = time.monotonic()\n    \
         g.block_status(65536, 0, lambda m, o, e, err: 0)\n    \
         worst = max(worst, time.monotonic() - t)\n    n += 1\n    time.sleep(0.05)\n\
         print('healthy', n, worst, flush=True)\n",
        py_str(&srv.uri_for_name("healthy")),
        STUCK_FOR.as_secs()
    ));
    let status = exit_within(
        &mut healthy.0,
        STUCK_FOR + Duration::from_secs(10),
        "the healthy device's BLOCK_STATUS loop did not finish: a query hung behind the stuck store's",
    );
    let out = output_of(&mut healthy.0);
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("healthy "))
        .unwrap_or_else(|| panic!("nbdsh (healthy): {status}\n{out}"));
    let mut f = line.split_whitespace();
    let n: u32 = f.next().and_then(|v| v.parse().ok()).expect("count");
    let worst: f64 = f.next().and_then(|v| v.parse().ok()).expect("worst");
    eprintln!("healthy BLOCK_STATUS: {n} queries, worst {worst:.3} s while the other store hung");
    assert!(
        worst < HEALTHY_OP_MAX.as_secs_f64(),
        "a healthy device's BLOCK_STATUS took {worst:.3} s while another device's store hung"
    );
    assert!(n >= 20, "only {n} healthy queries in {STUCK_FOR:?}");
    assert!(
        stuck.0.try_wait().expect("wait nbdsh").is_none(),
        "the stuck device's queries were all answered: its store was not stuck"
    );
    // The store continues: every query of the stuck device is answered.
    drop(paused);
    let status = exit_within(
        &mut stuck.0,
        Duration::from_secs(30),
        "the stuck device's queries never completed",
    );
    let out = output_of(&mut stuck.0);
    assert!(
        status.success() && out.contains("answered"),
        "nbdsh (stuck): {status}\n{out}"
    );
    drop(srv);
    drop(store);
}

/// Wait up to `within` for `child` to exit; its status (`what` says what did
/// not happen otherwise).
fn exit_within(
    child: &mut std::process::Child,
    within: Duration,
    what: &str,
) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("wait for a child") {
            return st;
        }
        assert!(t.elapsed() < within, "{what} (within {within:?})");
        std::thread::sleep(Duration::from_millis(50));
    }
}
