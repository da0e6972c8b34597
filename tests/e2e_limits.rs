//! The daemon-wide memory budget (`loopd serve --memory-budget`), checked the way
//! an operator would: the daemon's peak resident memory (`VmHWM` in
//! /proc/PID/status) while hostile clients send 32 MiB reads and writes and never
//! read a reply, then service for a well-behaved client once they are gone.

mod common;

use common::*;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

const BUDGET_MIB: u64 = 128;
/// What the daemon holds besides request and reply buffers: its code and
/// libraries, thread stacks, the rings, each busy connection's 64 KiB receive
/// buffer and slots, small charged buffers. Measured at about 12 MiB idle.
const OVERHEAD_MIB: u64 = 48;
const HOSTILE: usize = 12;
const BIG: u32 = 32 << 20;

fn status_kib(pid: u32, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/status: {e}"));
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
}

/// A client that sends requests and never reads a reply; its socket can be shut
/// from another thread to stop it.
fn hostile(
    socket: &std::path::Path,
    name: &str,
    i: usize,
) -> (UnixStream, std::thread::JoinHandle<()>) {
    let (c, size, _) = RawClient::handshake(socket, name);
    let s = c.s;
    s.set_write_timeout(None).unwrap();
    let stop = s.try_clone().unwrap();
    let mut w = s;
    let t = std::thread::spawn(move || {
        use std::io::Write;
        let slots = size / u64::from(BIG);
        let payload = vec![0x5au8; BIG as usize];
        for k in 0..64u64 {
            let off = ((k + i as u64) % slots) * u64::from(BIG);
            // One client in three starts with three writes; the rest only read.
            let write = i % 3 == 0 && k < 3;
            let typ = if write { NBD_CMD_WRITE } else { NBD_CMD_READ };
            let req = RawClient::request_bytes(REQUEST_MAGIC, 0, typ, k, off, BIG);
            if w.write_all(&req).is_err() {
                return;
            }
            if write && w.write_all(&payload).is_err() {
                return;
            }
        }
        // The test keeps the socket (and so what loopd holds for it) open
        // until it shuts it down.
    });
    (stop, t)
}

fn budget_holds(cache: &str) {
    let dir = tempdir();
    let img = dir.path().join("big.img");
    create_sparse_image(&img, 512 * MIB);
    let mut srv = Server::builder(&img)
        .args([
            "--cache",
            cache,
            "--memory-budget",
            &format!("{BUDGET_MIB}M"),
        ])
        .start();
    let pid = srv.pid();
    let name = srv.name().to_string();
    let clients: Vec<_> = (0..HOSTILE)
        .map(|i| hostile(srv.socket(), &name, i))
        .collect();
    // Let them push: with no budget each would hold up to 128 MiB of replies.
    std::thread::sleep(Duration::from_secs(4));
    srv.assert_running();
    let hwm_mib = status_kib(pid, "VmHWM:") / 1024;
    let rss_mib = status_kib(pid, "VmRSS:") / 1024;
    eprintln!("{cache}: VmHWM {hwm_mib} MiB, VmRSS {rss_mib} MiB with {HOSTILE} hostile clients");
    assert!(
        hwm_mib <= BUDGET_MIB + OVERHEAD_MIB,
        "{cache}: peak RSS {hwm_mib} MiB passed the {BUDGET_MIB} MiB budget + {OVERHEAD_MIB} MiB"
    );
    for (s, _) in &clients {
        let _ = s.shutdown(Shutdown::Both);
    }
    for (_, t) in clients {
        t.join().expect("hostile client thread");
    }
    // Everything they held comes back: a well-behaved client gets a full-size
    // read and write through promptly, with the right bytes.
    let t0 = Instant::now();
    let (mut c, _, _) = RawClient::handshake(srv.socket(), &name);
    let data = pattern_bytes(7, 0, BIG as usize);
    assert_eq!(
        c.write(1, 64 * MIB, &data),
        0,
        "{cache}: write after the flood"
    );
    let back = c.read(2, 64 * MIB, BIG);
    assert_bytes_eq(&back, &data, 64 * MIB, cache);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "{cache}: a well-behaved client took {took:?} once the hostile ones left"
    );
    srv.assert_running();
    let hwm_after = status_kib(pid, "VmHWM:") / 1024;
    assert!(
        hwm_after <= BUDGET_MIB + OVERHEAD_MIB,
        "{cache}: peak RSS {hwm_after} MiB after the flood"
    );
    srv.stop_ok();
}

#[test]
fn memory_budget_bounds_peak_rss_direct() {
    budget_holds("direct");
}

#[test]
fn memory_budget_bounds_peak_rss_buffered() {
    budget_holds("buffered");
}

/// A budget must hold the largest request's buffer (64 MiB: 32 MiB bounced
/// with its alignment blocks) twice: in the share and in the reserve (review
/// F7: with 64M the reserve was 32 MiB, too small for another device's
/// largest request). 64M and 16M are refused, 128M accepted.
#[test]
fn memory_budget_below_the_largest_request_is_refused() {
    for small in ["16M", "64M", "127M"] {
        let out = loopd_run(["serve", "--memory-budget", small, "/nonexistent.img"]);
        assert!(!out.success(), "a {small} budget was accepted");
        assert!(
            out.stderr.contains("too small") && out.stderr.contains("at least 128M"),
            "{small}: no reason given: {}",
            out.stderr
        );
    }
    let out = loopd_run(["serve", "--memory-budget", "128M", "/nonexistent.img"]);
    assert!(
        !out.stderr.contains("too small"),
        "128M was refused: {}",
        out.stderr
    );
}

/// A connection refused budget waits — its request is neither dropped nor
/// failed — and resumes when a connection on the other reactor frees what it
/// held (here the device's share: 64 MiB of a 128M budget, which a's two
/// unread 32 MiB replies hold); one client pipelining past the budget gets
/// every reply, in full.
#[test]
fn a_refused_request_waits_for_budget_freed_on_another_reactor() {
    let dir = tempdir();
    let img = dir.path().join("two.img");
    create_pattern_image(&img, 256 * MIB, 5);
    let srv = Server::builder(&img)
        .args([
            "--cache",
            "direct",
            "--memory-budget",
            "128M",
            "--reactors",
            "2",
            "--no-follow",
        ])
        .start();
    let name = srv.name().to_string();
    // New connections go to the least loaded reactor: a and b get one each.
    let (mut a, _, _) = RawClient::handshake(srv.socket(), &name);
    let (mut b, _, _) = RawClient::handshake(srv.socket(), &name);
    a.send_request(0, NBD_CMD_READ, 1, 0, BIG);
    a.send_request(0, NBD_CMD_READ, 3, 128 * MIB, BIG);
    std::thread::sleep(Duration::from_millis(500));
    b.send_request(0, NBD_CMD_READ, 2, 64 * MIB, BIG);
    // a's 32 MiB replies wait unread, so b's read does not fit.
    b.s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut first = [0u8; 16];
    let early = std::io::Read::read(&mut b.s, &mut first);
    assert!(
        early.is_err(),
        "b was answered while a held the budget: {early:?}"
    );
    b.s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (err, h) = a.read_simple_reply();
    assert_eq!((err, h), (0, 1));
    let got = a.read_exact(BIG as usize);
    assert_bytes_eq(&got, &pattern_bytes(5, 0, BIG as usize), 0, "a's read");
    let t = Instant::now();
    let (err, h) = b.read_simple_reply();
    assert_eq!((err, h), (0, 2), "b's read after a freed the budget");
    let got = b.read_exact(BIG as usize);
    assert_bytes_eq(
        &got,
        &pattern_bytes(5, 64 * MIB, BIG as usize),
        64 * MIB,
        "b's read",
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "b waited {:?}",
        t.elapsed()
    );
    let (err, h) = a.read_simple_reply();
    assert_eq!((err, h), (0, 3));
    let got = a.read_exact(BIG as usize);
    assert_bytes_eq(
        &got,
        &pattern_bytes(5, 128 * MIB, BIG as usize),
        128 * MIB,
        "a's second read",
    );
    // One client, eight 32 MiB reads in flight: twice the budget.
    for k in 0..8u64 {
        a.send_request(0, NBD_CMD_READ, 10 + k, k * u64::from(BIG), BIG);
    }
    let mut seen = Vec::new();
    for _ in 0..8u64 {
        let (err, h) = a.read_simple_reply();
        assert_eq!(err, 0, "pipelined read {h}");
        assert!((10..18).contains(&h), "unknown handle {h}");
        seen.push(h);
        let got = a.read_exact(BIG as usize);
        let off = (h - 10) * u64::from(BIG);
        assert_bytes_eq(
            &got,
            &pattern_bytes(5, off, BIG as usize),
            off,
            "pipelined read",
        );
    }
    seen.sort_unstable();
    assert_eq!(seen, (10..18).collect::<Vec<_>>());
}
