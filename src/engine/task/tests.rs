//! A task's reply data: what a frontend sends after a request is done.

use super::*;
use crate::device::{CacheMode, DeviceParams};
use crate::engine::sync;

/// A buffered device on `/dev/shm` (tmpfs: no `FALLOC_FL_ZERO_RANGE`, so a
/// write-zeroes that must not punch holes takes the zero-fill fallback).
fn tmpfs_device(len: u64) -> (Device, tempfile::TempDir) {
    let dir = tempfile::tempdir_in("/dev/shm").expect("a directory on /dev/shm");
    let p = DeviceParams {
        path: dir.path().join("x.img"),
        name: "x".into(),
        cache: CacheMode::Buffered,
        create: Some(len),
        ..DeviceParams::default()
    };
    (Device::open(&p).expect("open the device"), dir)
}

#[test]
fn a_zero_fill_longer_than_its_buffer_has_no_reply_data() {
    const LEN: u32 = 8 << 20;
    let (dev, _dir) = tmpfs_device(u64::from(LEN));
    let mut pool = Pool::default();
    let flags = ReqFlags {
        no_hole: true,
        ..ReqFlags::default()
    };
    let mut t = Task::plan(&dev, Op::WriteZeroes, flags, 0, LEN, &mut pool);
    assert_eq!(sync::drive(&dev, &mut t, &mut pool), Ok(0));
    assert!(
        t.buffer_capacity() > 0 && t.buffer_capacity() < LEN as usize,
        "the zero fill ran through a buffer ({} bytes) shorter than the request",
        t.buffer_capacity()
    );
    assert!(t.read_data().is_empty());
}

#[test]
fn a_read_replies_with_exactly_its_bytes() {
    let (dev, _dir) = tmpfs_device(1 << 20);
    let mut pool = Pool::default();
    let mut w = Task::plan(&dev, Op::Write, ReqFlags::default(), 4096, 8192, &mut pool);
    w.payload_mut().fill(0xa5);
    assert_eq!(sync::drive(&dev, &mut w, &mut pool), Ok(0));
    assert!(w.read_data().is_empty(), "a write has no reply data");
    let mut r = Task::plan(&dev, Op::Read, ReqFlags::default(), 4096, 8192, &mut pool);
    assert_eq!(sync::drive(&dev, &mut r, &mut pool), Ok(8192));
    assert_eq!(r.read_data(), &[0xa5; 8192][..]);
}
