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
