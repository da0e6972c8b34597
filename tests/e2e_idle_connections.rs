//! Idle NBD connections are cheap: what the daemon holds for a negotiated
//! connection that sends nothing, checked the way an operator would — the
//! daemon's resident memory (`VmRSS` in /proc/PID/status) before and after
//! opening a few hundred of them, per connection — and a fresh client is
//! still served the right bytes. The bound is generous (a memory property, not
//! a speed one): an idle connection used to hold a 64 KiB receive buffer and a
//! table of 128 request slots, about 112 KiB.

mod common;

use common::*;
use std::time::{Duration, Instant};

/// Idle connections opened by each test.
const IDLE: usize = 300;
/// Resident bytes per idle connection at most (with the daemon's spare
/// receive buffers and whatever the allocator keeps counted in).
const BOUND_KIB: u64 = 32;

fn rss_kib(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/status: {e}"));
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

/// The image and a server for it (`--max-connections` above what the tests
/// open), with one client served and gone so the start-up allocations are
/// behind the baseline.
fn start(dir: &std::path::Path) -> (Server, std::path::PathBuf) {
    let img = dir.join("idle.img");
    create_pattern_image(&img, 16 * MIB, 7);
    let srv = Server::builder(&img)
        .args(["--max-connections", "1024"])
        .start();
    let (mut c, _, _) = RawClient::handshake(srv.socket(), srv.name());
    assert_eq!(c.read(1, 0, 4096), pattern_bytes(7, 0, 4096));
    drop(c);
    std::thread::sleep(Duration::from_millis(300));
    (srv, img)
}

/// Resident KiB per connection over `base` once it is at most the bound, or
/// after 10 s (idle connections give back what they borrowed within about
/// two seconds).
fn settled_per_conn(pid: u32, base: u64, n: usize) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let per = rss_kib(pid).saturating_sub(base) / n as u64;
        if per <= BOUND_KIB || Instant::now() >= deadline {
            return per;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A fresh client reads `want` at `off`.
fn fresh_read(srv: &Server, off: u64, want: &[u8]) {
    let (mut c, _, _) = RawClient::handshake(srv.socket(), srv.name());
    let got = c.read(99, off, u32::try_from(want.len()).unwrap());
    assert!(got == want, "a fresh client read the wrong bytes at {off}");
}

#[test]
fn idle_connections_hold_little_and_a_fresh_client_is_served() {
    let dir = tempdir();
    let (mut srv, _img) = start(dir.path());
    let pid = srv.pid();
    let base = rss_kib(pid);
    let idle: Vec<_> = (0..IDLE)
        .map(|_| RawClient::handshake(srv.socket(), srv.name()).0)
        .collect();
    let per = settled_per_conn(pid, base, IDLE);
    assert!(
        per <= BOUND_KIB,
        "{IDLE} idle negotiated connections hold {per} KiB each of the daemon's \
         resident memory (at most {BOUND_KIB} expected)"
    );
    fresh_read(&srv, 5 * MIB, &pattern_bytes(7, 5 * MIB, 4096));
    srv.assert_running();
    drop(idle);
}

/// Connections that were busy (16 writes of 4 KiB sent at once, which fill
/// the receive buffer a busy connection borrows) and then go idle give the
/// buffer back: the daemon's memory comes down to the same bound, and what
/// they wrote is there.
#[test]
fn connections_that_go_idle_give_their_buffers_back() {
    const WRITES: u64 = 16;
    let dir = tempdir();
    let (mut srv, _img) = start(dir.path());
    let pid = srv.pid();
    let base = rss_kib(pid);
    let mut conns = Vec::with_capacity(IDLE);
    for i in 0..IDLE as u64 {
        let (mut c, _, _) = RawClient::handshake(srv.socket(), srv.name());
        let mut burst = Vec::new();
        for k in 0..WRITES {
            let off = (i * WRITES + k) * 4096 % (16 * MIB);
            burst.extend(RawClient::request_bytes(
                REQUEST_MAGIC,
                0,
                NBD_CMD_WRITE,
                k,
                off,
                4096,
            ));
            burst.extend(pattern_bytes(9, off, 4096));
        }
        c.send(&burst);
        for _ in 0..WRITES {
            let (err, _) = c.read_simple_reply();
            assert_eq!(err, 0, "a write of connection {i} failed");
        }
        conns.push(c);
    }
    let per = settled_per_conn(pid, base, IDLE);
    assert!(
        per <= BOUND_KIB,
        "{IDLE} connections idle after a burst of writes still hold {per} KiB each \
         of the daemon's resident memory 10 s later (at most {BOUND_KIB} expected)"
    );
    let off = (IDLE as u64 - 1) * WRITES * 4096 % (16 * MIB);
    fresh_read(&srv, off, &pattern_bytes(9, off, 4096));
    // An idle connection that gave its buffer back is served again.
    let got = conns[0].read(7, 0, 4096);
    assert!(
        got == pattern_bytes(9, 0, 4096),
        "connection 0 read back wrong bytes"
    );
    srv.assert_running();
}
