//! Spliced reads: in buffered mode, reads of 64 KiB and more are answered from
//! the page cache by reference (file → pipe → socket), not copied. Checked as a
//! client sees it: the bytes and the framing of every reply, mixed with copied
//! replies on one connection, with simple and structured replies; zeros past the
//! end of a shrunken file; acknowledged writes visible to later reads; and clients
//! that never take their replies, which must not hold up the daemon.

mod common;

use common::*;
use std::time::{Duration, Instant};

/// `loopd serve` of an 8 MiB pattern image as buffered device `b`.
fn setup(extra: &[&str]) -> (tempfile::TempDir, Server, std::path::PathBuf) {
    let dir = tempdir();
    let img = dir.path().join("s.img");
    create_pattern_image(&img, 8 * MIB, 7);
    let srv = Server::builder(&img)
        .name("b")
        .with_control()
        .args(["--cache", "buffered"])
        .args(extra)
        .start();
    (dir, srv, img)
}

/// Pipelines reads of many sizes (spliced and copied) on one connection, then
/// takes the replies in whatever order they come and checks each one's bytes.
fn pipelined_reads(extra: &[&str]) -> u64 {
    let (_dir, srv, img) = setup(extra);
    let want = read_file(&img);
    let (mut c, _, _) = RawClient::handshake(srv.socket(), "b");
    let reads: &[(u64, u32)] = &[
        (0, 1 << 20),
        (4096, 4096),
        (3 * 512, 1 << 20), // not page aligned
        (2 * MIB, 64 << 10),
        (2 * MIB + 512, 512),
        (5 * MIB + 100 * 512, 200 << 10),
        (6 * MIB, 2 << 20), // more than two 1 MiB pipes hold
        (MIB, 60 << 10),    // below the splice threshold
        (7 * MIB - 4096, 1 << 20),
    ];
    for round in 0..3u64 {
        for (i, &(off, len)) in reads.iter().enumerate() {
            c.send_request(0, NBD_CMD_READ, round * 100 + i as u64, off, len);
        }
        for _ in reads {
            let (err, h) = c.read_simple_reply();
            assert_eq!(err, 0, "read with handle {h} failed");
            let (off, len) = reads[usize::try_from(h % 100).unwrap()];
            let data = c.read_exact(len as usize);
            let o = usize::try_from(off).unwrap();
            assert_bytes_eq(&data, &want[o..o + len as usize], off, "pipelined read");
        }
    }
    srv.path_count("b", "spliced")
}

#[test]
fn spliced_and_copied_replies_keep_their_bytes_and_framing() {
    let n = pipelined_reads(&[]);
    // Per round: 1M, 1M unaligned, 64K, 200K and 1M near the end always fit two
    // pipes; the 2 MiB read only where pipes may grow past 1 MiB.
    assert!(n >= 15, "large reads were spliced: spliced={n}");
}

#[test]
fn no_splice_switch_copies_every_read() {
    assert_eq!(pipelined_reads(&["--no-splice"]), 0);
}

#[test]
fn spliced_reads_with_structured_replies() {
    let (_dir, srv, img) = setup(&[]);
    let uri = format!("nbd+unix:///b?socket={}", path_str(srv.socket()));
    let out = nbdsh(&format!(
        r#"
h = connect({uri})
assert h.get_structured_replies_negotiated()
want = open({img}, "rb").read()
for off, n in [(0, 1 << 20), (512, 1 << 20), (3 << 20, 64 << 10), (7 << 20, 1 << 20)]:
    got = h.pread(n, off)
    assert got == want[off:off + n], "read %d+%d differs" % (off, n)
# Many in flight at once, answered in any order.
bufs = [nbd.Buffer(1 << 20) for _ in range(8)]
for i, b in enumerate(bufs):
    h.aio_pread(b, i * 512 * 1024)
while h.aio_in_flight() > 0:
    h.poll(-1)
for i, b in enumerate(bufs):
    off = i * 512 * 1024
    assert b.to_bytearray() == want[off:off + (1 << 20)], "aio read %d" % i
print("ok")
"#,
        uri = py_str(&uri),
        img = py_str(path_str(&img)),
    ));
    assert!(out.stdout.contains("ok"), "{out}");
    assert!(srv.path_count("b", "spliced") >= 12, "reads were spliced");
}

#[test]
fn spliced_reads_see_acknowledged_writes_and_zeros_past_the_end() {
    let (_dir, srv, img) = setup(&[]);
    let (mut c, _, _) = RawClient::handshake(srv.socket(), "b");
    let a = pattern_bytes(21, 0, 1 << 20);
    assert_eq!(c.write(1, MIB, &a), 0);
    assert_bytes_eq(&c.read(2, MIB, 1 << 20), &a, MIB, "after the first write");
    let b = pattern_bytes(22, 0, 4096);
    assert_eq!(c.write(3, MIB + 8192, &b), 0);
    let mut want = a.clone();
    want[8192..8192 + 4096].copy_from_slice(&b);
    assert_bytes_eq(&c.read(4, MIB, 1 << 20), &want, MIB, "after the overwrite");

    let spliced_before = srv.path_count("b", "spliced");
    assert!(spliced_before >= 2, "the 1 MiB reads were spliced");
    let copied_before = srv.path_count("b", "buffered");

    // Shrink the file under the server: what lies past its end reads as zeros.
    let keep = 4 * MIB + 100 * 1024;
    std::fs::File::options()
        .write(true)
        .open(&img)
        .and_then(|f| f.set_len(keep))
        .expect("truncate");
    let before = read_range(&img, 4 * MIB, 100 * 1024);
    let got = c.read(5, 4 * MIB, 1 << 20);
    assert_bytes_eq(&got[..100 * 1024], &before, 4 * MIB, "before the end");
    assert!(
        got[100 * 1024..].iter().all(|&x| x == 0),
        "past the end of the file: zeros"
    );
    let got = c.read(6, 6 * MIB, 1 << 20);
    assert!(got.iter().all(|&x| x == 0), "wholly past the end: zeros");
    // Both met the end of the file while splicing and were copied instead.
    assert_eq!(
        srv.path_count("b", "spliced"),
        spliced_before,
        "no reply spliced past the end"
    );
    let copied = srv.path_count("b", "buffered");
    assert_eq!(
        copied,
        copied_before + 2,
        "both fell back to the copying path"
    );
}

#[test]
fn clients_that_never_read_their_replies_do_not_hold_up_the_daemon() {
    let (_dir, mut srv, img) = setup(&[]);
    let want = read_file(&img);
    // One client asks for 64 MiB of replies and hangs up without reading any.
    let mut gone = RawClient::handshake(srv.socket(), "b").0;
    for i in 0..64u64 {
        gone.send_request(0, NBD_CMD_READ, i, (i % 7) * MIB, 1 << 20);
    }
    drop(gone);
    // Another asks for as much and just stops reading.
    let mut stuck = RawClient::handshake(srv.socket(), "b").0;
    for i in 0..64u64 {
        stuck.send_request(0, NBD_CMD_READ, i, (i % 7) * MIB, 1 << 20);
    }
    // A third is served all the while.
    let (mut c, _, _) = RawClient::handshake(srv.socket(), "b");
    for i in 0..8u64 {
        let got = c.read(i, i * 512 * 1024, 1 << 20);
        let o = usize::try_from(i * 512 * 1024).unwrap();
        assert_bytes_eq(
            &got,
            &want[o..o + (1 << 20)],
            i * 512 * 1024,
            "third client",
        );
    }
    srv.assert_running();
    // Stopping gives the stuck client its drain time, then closes it.
    let t = Instant::now();
    let status = srv.stop();
    assert!(status.success(), "daemon exit: {status:?}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "stopping took {:?}",
        t.elapsed()
    );
    drop(stuck);
}
