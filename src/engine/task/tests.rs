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

#[test]
fn a_fixed_plan_names_the_slot_zero_fills_the_tail_and_never_bounces() {
    let mut pool = Pool::default();
    let (buffered, _d) = tmpfs_device(1 << 20);
    let plain = ReqFlags::default();
    assert!(
        Task::plan_fixed(&buffered, Op::Read, plain, 0, 4096, 3).is_none(),
        "a buffered device has no zero copy"
    );
    assert!(zero_copy_fits(&buffered).is_err());
    let dir = tempfile::tempdir().expect("tempdir");
    let p = DeviceParams {
        path: dir.path().join("d.img"),
        name: "d".into(),
        cache: CacheMode::Direct,
        create: Some(1 << 20),
        ..DeviceParams::default()
    };
    let Ok(dev) = Device::open(&p) else {
        eprintln!("no direct I/O in this TMPDIR: only the buffered half checked");
        return;
    };
    if !dev.direct {
        assert!(Task::plan_fixed(&dev, Op::Read, plain, 0, 4096, 3).is_none());
        return;
    }
    assert!(Task::plan_fixed(&dev, Op::Flush, plain, 0, 0, 3).is_none());
    let mut r = Task::plan_fixed(&dev, Op::Read, plain, 8192, 16384, 5).expect("aligned read");
    assert!(r.fixed == Some(5) && r.buffer_capacity() == 0 && r.read_data().is_empty());
    let fixed_read = |at: u64, len: u32, off: u64| {
        Next::Submit(FileOp(IoOp::ReadFixed {
            index: 5,
            at,
            len,
            off,
        }))
    };
    assert_eq!(r.start(), fixed_read(0, 16384, 8192));
    let a = dev.dio_align as usize;
    // A whole-block part, then end of file: the rest comes from /dev/zero.
    assert_eq!(
        r.complete(i32::try_from(a).expect("align"), &mut pool),
        fixed_read(a as u64, 16384 - dev.dio_align, 8192 + a as u64)
    );
    let zero = |at: usize| {
        Next::Submit(FileOp(IoOp::ZeroFixed {
            index: 5,
            at: at as u64,
            len: u32::try_from(16384 - at).expect("len"),
        }))
    };
    assert_eq!(r.complete(0, &mut pool), zero(a));
    assert_eq!(
        r.complete(512, &mut pool),
        zero(a + 512),
        "short zeros go on"
    );
    let rest = i32::try_from(16384 - a - 512).expect("rest");
    assert_eq!(r.complete(rest, &mut pool), Next::Done(Ok(16384)));
    let mut w = Task::plan_fixed(&dev, Op::Write, plain, 0, 4096, 9).expect("aligned write");
    assert_eq!(
        w.start(),
        Next::Submit(FileOp(IoOp::WriteFixed {
            index: 9,
            at: 0,
            len: 4096,
            off: 0,
            dsync: false
        }))
    );
    if dev.dio_align > 512 {
        assert!(
            Task::plan_fixed(&dev, Op::Write, plain, 512, 512, 9).is_none(),
            "a request that would be bounced has no fixed plan"
        );
    }
    // The synchronous engine has no ring, so no registered buffers.
    let mut s = Task::plan_fixed(&dev, Op::Read, plain, 0, 4096, 1).expect("read");
    assert!(sync::drive(&dev, &mut s, &mut pool).is_err());
}
