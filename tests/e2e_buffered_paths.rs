//! Buffered mode's fast paths, checked the way a user would: the bytes that land in
//! the image, the path counters `loopd status` reports, and the same results with
//! busy-polling off (`--poll-us 0`) and on (the default).
//!
//! A buffered write of whole pages up to 64 KiB, without FUA, is copied into the
//! page cache on the reactor thread; anything else (partial pages, FUA, larger
//! writes) goes through the ring. Reads of cached pages are served inline.

mod common;

use common::*;

const FUA: u16 = 1 << 0;

fn paths(srv: &Server, name: &str) -> (u64, u64, u64) {
    let st = srv.ctl_json(&["status", name]);
    let ps = st.at("paths");
    (
        ps.at("inline_written").u64(),
        ps.at("buffered").u64(),
        ps.at("inline_cached").u64(),
    )
}

fn check_paths(poll: &str) {
    let dir = tempdir();
    let srv = Server::daemon().args(["--poll-us", poll]).start();
    let img = dir.path().join("buf.img");
    create_pattern_image(&img, 4 * MIB, 3);
    srv.ctl_ok(&[
        "attach",
        path_str(&img),
        "--name",
        "b",
        "--cache",
        "buffered",
    ]);
    let (mut c, _, _) = RawClient::handshake(srv.socket(), "b");
    let mut want = read_file(&img);
    let mut put = |c: &mut RawClient, h: u64, off: u64, len: usize, fua: bool| {
        let data = pattern_bytes(u8::try_from(h).unwrap(), off, len);
        let err = c.write_flags(if fua { FUA } else { 0 }, h, off, &data);
        assert_eq!(err, 0, "write {off}+{len} (fua {fua}) failed");
        let o = usize::try_from(off).unwrap();
        want[o..o + len].copy_from_slice(&data);
    };

    // Whole pages, small, no FUA: inline.
    put(&mut c, 1, 8192, 4096, false);
    put(&mut c, 2, 64 * 1024, 64 * 1024, false);
    assert_eq!(paths(&srv, "b").0, 2, "whole-page writes went inline");

    // A partial page, a FUA write, a write over 64 KiB: through the ring.
    put(&mut c, 3, 4096 + 512, 512, false);
    put(&mut c, 4, 16384, 4096, true);
    put(&mut c, 5, MIB, 128 * 1024, false);
    let (inline, ring, _) = paths(&srv, "b");
    assert_eq!(inline, 2, "no other write went inline");
    assert_eq!(
        ring, 3,
        "partial, FUA and large writes went through the ring"
    );

    // Everything reads back, the pages just written inline from the cache.
    let back = c.read(6, 0, u32::try_from(want.len()).unwrap());
    assert_bytes_eq(&back, &want, 0, "read back over NBD");
    assert!(paths(&srv, "b").2 >= 1, "cached read served inline");

    // And it is in the file once the client flushes.
    c.send_request(0, NBD_CMD_FLUSH, 7, 0, 0);
    let (err, _) = c.read_simple_reply();
    assert_eq!(err, 0, "flush");
    assert_bytes_eq(&read_file(&img), &want, 0, "image after flush");
}

#[test]
fn buffered_write_paths_with_polling() {
    check_paths("50");
}

#[test]
fn buffered_write_paths_without_polling() {
    check_paths("0");
}

/// A write-zeroes that must leave the range allocated (`NO_HOLE`) on a
/// filesystem without `FALLOC_FL_ZERO_RANGE` (tmpfs) is written as zeros, a
/// chunk at a time through a buffer shorter than the request. Its reply
/// carries no data; the connection and the device go on serving, and the
/// range reads back as zeros. (A regression: the reply once took the zero
/// fill's buffer for read data and the reactor panicked on an 8 MiB request.)
#[test]
fn a_long_zero_fill_on_tmpfs_is_answered_and_reads_back_as_zeros() {
    const WRITE_ZEROES: u16 = 6;
    const NO_HOLE: u16 = 1 << 1;
    let dir = tempfile::Builder::new()
        .prefix("loopd-e2e")
        .tempdir_in("/dev/shm")
        .expect("a directory on /dev/shm (tmpfs)");
    let srv = Server::daemon().start();
    let img = dir.path().join("z.img");
    create_pattern_image(&img, 16 * MIB, 9);
    srv.ctl_ok(&[
        "attach",
        path_str(&img),
        "--name",
        "z",
        "--cache",
        "buffered",
    ]);
    let mut want = read_file(&img);
    let (at, len) = (MIB, 8u32 << 20);
    let range = usize::try_from(at).unwrap()..usize::try_from(at).unwrap() + len as usize;
    want[range].fill(0);
    let (mut c, _, _) = RawClient::handshake(srv.socket(), "z");
    c.send_request(NO_HOLE, WRITE_ZEROES, 1, at, len);
    let (err, handle) = c.read_simple_reply();
    assert_eq!(
        (err, handle),
        (0, 1),
        "the write-zeroes is answered, without error"
    );
    // The next reply header follows at once: no data was sent after the last.
    let back = c.read(2, 0, u32::try_from(16 * MIB).unwrap());
    assert_bytes_eq(&back, &want, 0, "the image over NBD after the write-zeroes");
    c.send_request(0, NBD_CMD_FLUSH, 3, 0, 0);
    assert_eq!(c.read_simple_reply(), (0, 3), "flush");
    assert_bytes_eq(
        &read_file(&img),
        &want,
        0,
        "the image file after the write-zeroes",
    );
    let st = srv.ctl_json(&["status", "z"]);
    assert_eq!(st.at("name").str(), "z", "the device is still served");
}
