//! An RBD device follows its image's size: `rbd resize` (another client of the
//! cluster, not loopd) grows or shrinks the image, and without any `loopd
//! resize` the device takes the new size — `loopd status` shows it, a new NBD
//! connection is told it, the new area is written through to the image (`rbd
//! export`), and past a shrunk end requests fail cleanly. A `--size-limit`
//! window keeps its size, and a window the image no longer holds is refused
//! with an error in the log while the device keeps its size.
//!
//! Each test uses images of its own (`unique_image_name`) on the throwaway
//! cluster of `common::ceph`, and removes them.

mod common;

use common::CephImage as Image;
use common::*;
use std::time::{Duration, Instant};

/// How long the device may take to follow an `rbd resize` (the daemon
/// coalesces notifications for up to a second).
const FOLLOW: Duration = Duration::from_secs(5);

/// A daemon with `img` attached as `name`, with `extra` attach options.
fn daemon_with(img: &Image, name: &str, extra: &[&str]) -> Server {
    let srv = Server::daemon().start();
    let spec = ceph().loopd_image(&img.name);
    let conf = ceph().conf.to_str().expect("utf-8 conf path").to_owned();
    let mut a = vec![
        "attach",
        spec.as_str(),
        "--name",
        name,
        "--ceph-conf",
        conf.as_str(),
        "--ceph-id",
        ceph().id,
    ];
    a.extend_from_slice(extra);
    srv.ctl_ok(&a);
    srv
}

/// `loopd status NAME --json`'s size.
fn status_size(srv: &Server, name: &str) -> u64 {
    srv.ctl_json(&["status", name]).at("size").u64()
}

/// Poll `loopd status` until device `name` is `want` bytes (at most
/// [`FOLLOW`]); how long that took.
#[track_caller]
fn wait_size(srv: &Server, name: &str, want: u64) -> Duration {
    let t0 = Instant::now();
    loop {
        let got = status_size(srv, name);
        if got == want {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < FOLLOW,
            "device {name} is still {got} bytes {FOLLOW:?} after the rbd resize (want \
             {want}); daemon log:\n{}",
            srv.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Poll the daemon's log until a line holds every one of `needles` (at most
/// [`FOLLOW`]); that line.
#[track_caller]
fn wait_log_line(srv: &Server, needles: &[&str]) -> String {
    let t0 = Instant::now();
    loop {
        let log = srv.stderr_text();
        if let Some(l) = log.lines().find(|l| needles.iter().all(|n| l.contains(n))) {
            return l.to_owned();
        }
        assert!(
            t0.elapsed() < FOLLOW,
            "no log line with {needles:?} within {FOLLOW:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The size a new NBD connection is told in the handshake.
fn handshake_size(srv: &Server, name: &str) -> u64 {
    RawClient::handshake(srv.socket(), name).1
}

/// An NBD read's error value (0: it succeeded; its data is read off).
fn read_error(c: &mut RawClient, handle: u64, off: u64, len: u32) -> u32 {
    c.send_request(0, NBD_CMD_READ, handle, off, len);
    let (err, h) = c.read_simple_reply();
    assert_eq!(h, handle, "reply handle mismatch");
    if err == 0 {
        c.read_exact(us(u64::from(len)));
    }
    err
}

/// Grown by `rbd resize`: within a few seconds `status` shows the new size,
/// nbdinfo and a raw handshake are told it, a connection made before still
/// works, bytes written in the new area reach the image, and the log has the
/// audit line.
#[test]
fn a_grown_image_grows_the_device() {
    let img = Image::new("grow", 4 * MIB);
    let mut srv = daemon_with(&img, "g", &[]);
    let (mut before, size, _) = RawClient::handshake(srv.socket(), "g");
    assert_eq!(size, 4 * MIB);

    img.resize(8 * MIB, false);
    let took = wait_size(&srv, "g", 8 * MIB);
    eprintln!("the device followed the grow in {took:?}");
    assert_eq!(handshake_size(&srv, "g"), 8 * MIB);
    let uri = srv.uri_for_name("g");
    assert_eq!(nbd_size(&uri), 8 * MIB);
    // The connection from before keeps working (it knows the old size).
    assert_eq!(before.read(1, 0, 4096), vec![0u8; 4096]);

    // The new area is the image's: written through loopd, read by `rbd export`.
    qemu_io(&uri, &["write -P 0x5a 6291456 65536", "flush"]);
    let data = ceph().export_image(&img.name);
    assert_eq!(data.len() as u64, 8 * MIB);
    assert!(data[us(6 * MIB)..][..65536].iter().all(|&b| b == 0x5a));
    assert!(data[..us(6 * MIB)].iter().all(|&b| b == 0));

    let line = wait_log_line(&srv, &["audit: resize \"g\"", "by the RBD image"]);
    assert!(
        line.contains("4194304 -> 8388608 bytes")
            && line.contains("grew from 4194304 to 8388608 bytes")
            && line.ends_with(": ok"),
        "{line}"
    );
    // librbd calls back more than once for one resize: still one resize.
    std::thread::sleep(Duration::from_millis(1500));
    let log = srv.stderr_text();
    assert_eq!(log.matches("audit: resize \"g\"").count(), 1, "{log}");
    srv.assert_running();
}

/// Shrunk by `rbd resize --allow-shrink`: the device shrinks; a read past the
/// new end fails with an NBD error — on a new connection and on one made
/// before the shrink — while reads inside still work, and the daemon runs on.
#[test]
fn a_shrunk_image_shrinks_the_device_and_refuses_reads_past_its_end() {
    let img = Image::new("shrink", 8 * MIB);
    ceph().write_image(&img.name, &pattern_bytes(3, 0, us(8 * MIB)));
    let mut srv = daemon_with(&img, "s", &[]);
    let (mut before, size, _) = RawClient::handshake(srv.socket(), "s");
    assert_eq!(size, 8 * MIB);
    assert_eq!(read_error(&mut before, 1, 6 * MIB, 4096), 0);

    img.resize(4 * MIB, true);
    wait_size(&srv, "s", 4 * MIB);
    assert_eq!(nbd_size(&srv.uri_for_name("s")), 4 * MIB);
    let (mut after, size, _) = RawClient::handshake(srv.socket(), "s");
    assert_eq!(size, 4 * MIB);
    for (c, what) in [(&mut before, "before"), (&mut after, "after")] {
        let err = read_error(c, 2, 6 * MIB, 4096);
        assert_ne!(
            err, 0,
            "a read past the new end on the connection made {what}"
        );
        let err = read_error(c, 3, 4 * MIB - 2048, 4096);
        assert_ne!(
            err, 0,
            "a read across the new end on the connection made {what}"
        );
        assert_eq!(
            c.read(4, 4 * MIB - 4096, 4096),
            pattern_bytes(3, 4 * MIB - 4096, 4096),
            "a read inside, connection made {what}"
        );
    }
    let line = wait_log_line(&srv, &["audit: resize \"s\"", "by the RBD image"]);
    assert!(
        line.contains("8388608 -> 4194304 bytes")
            && line.contains("shrank from 8388608 to 4194304 bytes"),
        "{line}"
    );
    srv.assert_running();
}

/// `--size-limit 2M`: the image grows, the device stays 2 MiB (the log says
/// the window is unchanged); the image shrinks below the window: refused,
/// with an error in the log, and the device keeps its 2 MiB.
#[test]
fn a_size_limit_window_keeps_its_size_and_a_window_past_the_end_is_refused() {
    let img = Image::new("limit", 4 * MIB);
    let mut srv = daemon_with(&img, "l", &["--size-limit", "2M"]);
    assert_eq!(status_size(&srv, "l"), 2 * MIB);

    img.resize(8 * MIB, false);
    let line = wait_log_line(
        &srv,
        &["audit: resize \"l\"", "grew from 4194304 to 8388608"],
    );
    assert!(line.contains("window"), "{line}");
    assert_eq!(status_size(&srv, "l"), 2 * MIB);
    assert_eq!(handshake_size(&srv, "l"), 2 * MIB);
    // The device reports the image's new size.
    let j = srv.ctl_json(&["resize", "l"]);
    assert_eq!(j.at("file_size").u64(), 8 * MIB, "{j:?}");
    assert!(j.at("capped_by_size_limit").bool(), "{j:?}");

    img.resize(MIB, true);
    let line = wait_log_line(
        &srv,
        &["audit: resize \"l\"", "shrank from 8388608 to 1048576"],
    );
    assert!(
        line.contains("ERROR")
            && line.contains("refused")
            && line.contains("past the end of the image")
            && line.contains("keeps its size, 2097152 bytes"),
        "{line}"
    );
    assert_eq!(status_size(&srv, "l"), 2 * MIB);
    // Past the image's end (inside the window) a read fails; the daemon runs on.
    let (mut c, _, _) = RawClient::handshake(srv.socket(), "l");
    assert_ne!(read_error(&mut c, 1, MIB + 4096, 4096), 0);
    assert_eq!(c.read(2, 0, 4096), vec![0u8; 4096]);
    srv.assert_running();
}
