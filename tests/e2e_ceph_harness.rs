//! The Ceph test harness itself (tests/common/ceph.rs, scripts/ceph-cluster.sh):
//! the cluster it starts (or joins, under `scripts/test.sh`) creates, writes,
//! exports and snapshots images with the bytes a test gives it; a paused OSD
//! stalls I/O until resumed; a stopped monitor refuses new clients and comes
//! back; every daemon listens on 127.0.0.1 only; fio's `rbd` engine (what
//! `bench/rbd` measures) writes into the cluster. No loopd here: the RBD
//! backend's own tests (tests/e2e_rbd.rs) stand on these.

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;

/// A model of an image: writes applied to a zeroed buffer.
fn apply(model: &mut [u8], offset: u64, bytes: &[u8]) {
    let at = usize::try_from(offset).expect("offset fits usize");
    model[at..at + bytes.len()].copy_from_slice(bytes);
}

#[test]
fn create_write_export_round_trip() {
    let c = ceph();
    let name = unique_image_name("harness-rt");
    // Neither a multiple of the 4 MiB object size nor of 4 KiB.
    let size = 9 * MIB + 4096 + 512;
    c.create_image(&name, size);
    assert_eq!(c.image_size(&name), Some(size), "rbd info size");
    let fresh = c.export_image(&name);
    assert_eq!(fresh.len() as u64, size, "export length of a new image");
    assert!(fresh.iter().all(|&b| b == 0), "a new image reads as zeroes");

    let mut model = vec![0u8; usize::try_from(size).expect("size")];
    // At 0, across an object boundary at an odd offset, and the last bytes.
    let writes: [(u64, usize, u8); 3] = [
        (0, 64 * 1024, 1),
        (4 * MIB - 1000, 3000, 2),
        (size - 777, 777, 3),
    ];
    for (off, len, seed) in writes {
        let bytes = pattern_bytes(seed, off, len);
        c.write_image_at(&name, off, &bytes);
        apply(&mut model, off, &bytes);
    }
    assert_bytes_eq(&c.export_image(&name), &model, 0, "export after writes");
    assert_eq!(c.image_size(&name), Some(size), "writes keep the size");
    c.remove_image(&name);
    assert_eq!(c.image_size(&name), None, "removed");
}

#[test]
fn write_image_creates_a_missing_image() {
    let c = ceph();
    let name = unique_image_name("harness-new");
    let bytes = pattern_bytes(7, 0, 2 * 1024 * 1024 + 4096);
    c.write_image(&name, &bytes);
    assert_eq!(c.image_size(&name), Some(bytes.len() as u64));
    assert_bytes_eq(&c.export_image(&name), &bytes, 0, "export");
    c.remove_image(&name);
}

#[test]
fn write_past_the_end_is_refused() {
    let c = ceph();
    let name = unique_image_name("harness-past");
    c.create_image(&name, MIB);
    let r = std::panic::catch_unwind(|| c.write_image_at(&name, MIB - 10, &[1u8; 20]));
    assert!(r.is_err(), "a write past the end must panic");
    assert!(
        c.export_image(&name).iter().all(|&b| b == 0),
        "nothing written"
    );
    c.remove_image(&name);
}

#[test]
fn create_image_with_extra_args() {
    let c = ceph();
    let name = unique_image_name("harness-obj");
    c.create_image_with(&name, 3 * MIB, &["--object-size", "64K"]);
    let spec = c.image_spec(&name);
    let out = c.rbd(&["info", "--format", "json", &spec]);
    assert!(out.status.success(), "rbd info: {out:?}");
    let info = Json::parse(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(info.at("object_size").u64(), 64 * KIB, "object size");
    c.remove_image(&name);
}

#[test]
fn snapshot_keeps_the_old_bytes() {
    let c = ceph();
    let name = unique_image_name("harness-snap");
    let old = pattern_bytes(11, 0, 1024 * 1024);
    c.write_image(&name, &old);
    c.snap_create(&name, "before");
    let new = pattern_bytes(12, 0, 1024 * 1024);
    c.write_image(&name, &new);
    assert_bytes_eq(
        &c.export_image(&format!("{name}@before")),
        &old,
        0,
        "snapshot",
    );
    assert_bytes_eq(&c.export_image(&name), &new, 0, "head");
    let out = c.rbd(&["snap", "ls", "--format", "json", &c.image_spec(&name)]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"before\""),
        "{out:?}"
    );
    // remove_image purges the snapshot first.
    c.remove_image(&name);
}

#[test]
fn paused_osd_stalls_io_until_resumed() {
    let c = ceph();
    let name = unique_image_name("harness-pause");
    let bytes = pattern_bytes(21, 0, 256 * 1024);
    c.write_image(&name, &bytes);

    let paused = c.pause_osd();
    let (tx, rx) = mpsc::channel();
    let spec = c.image_spec(&name);
    let reader = thread::spawn(move || {
        let t = Instant::now();
        let out = ceph().rbd(&["export", "--no-progress", &spec, "-"]);
        let _ = tx.send(t.elapsed());
        out
    });
    // A fresh client needs the OSD for the image's header: it waits.
    match rx.recv_timeout(Duration::from_secs(3)) {
        Err(mpsc::RecvTimeoutError::Timeout) => {}
        Ok(took) => panic!("rbd export finished in {took:?} with the OSD paused"),
        Err(e) => panic!("reader thread: {e}"),
    }
    let resumed = Instant::now();
    drop(paused);
    let took = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("rbd export finishes after the OSD is resumed");
    let out = reader.join().expect("reader thread");
    assert!(out.status.success(), "export after resume: {out:?}");
    assert_bytes_eq(&out.stdout, &bytes, 0, "export after resume");
    eprintln!(
        "export waited {took:?} in all, {:?} after the resume",
        resumed.elapsed()
    );
    c.remove_image(&name);
}

#[test]
fn stopped_mon_refuses_new_clients_then_comes_back() {
    let c = ceph();
    let name = unique_image_name("harness-mon");
    let bytes = pattern_bytes(31, 0, 128 * 1024);
    c.write_image(&name, &bytes);

    let mon = c.stop_mon();
    assert_eq!(c.mon_pid(), None, "the monitor is stopped");
    let t = Instant::now();
    let out = c.rbd_timeout(
        Duration::from_secs(60),
        &["ls", "--pool", c.pool, "--client-mount-timeout", "3"],
    );
    assert!(!out.status.success(), "rbd ls with no monitor: {out:?}");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "rbd ls took {:?} to fail",
        t.elapsed()
    );
    // Started while the guard still holds this binary's outage lock (another
    // test could stop it again the moment the guard drops).
    c.start_mon();
    assert!(c.mon_pid().is_some(), "the monitor runs again");
    drop(mon);
    // The same cluster: the image and its bytes are still there.
    assert_bytes_eq(&c.export_image(&name), &bytes, 0, "export after restart");
    c.remove_image(&name);
}

#[test]
fn start_mon_is_explicit_and_idempotent() {
    let c = ceph();
    let mon = c.stop_mon();
    c.start_mon();
    let pid = c.mon_pid().expect("the monitor runs after start_mon");
    c.start_mon(); // already running: left alone
    assert_eq!(
        c.mon_pid(),
        Some(pid),
        "start_mon did not start a second monitor"
    );
    drop(mon); // the same
}

/// Every socket the daemons listen on is on 127.0.0.1 (the project's rule:
/// loopback and Unix sockets only).
#[test]
fn daemons_listen_on_loopback_only() {
    let c = ceph();
    // (The monitor may be stopped by a test running alongside: then only the
    // OSD's sockets are checked.)
    let osd = c.osd_pid().to_string();
    let pids: Vec<String> = c
        .mon_pid()
        .map(|p| p.to_string())
        .into_iter()
        .chain([osd.clone()])
        .collect();
    let out = run("ss", ["-Htlnp"]);
    let mut osd_sockets = 0;
    for line in out.stdout.lines() {
        if !pids.iter().any(|p| line.contains(&format!("pid={p},"))) {
            continue;
        }
        if line.contains(&format!("pid={osd},")) {
            osd_sockets += 1;
        }
        let local = line.split_whitespace().nth(3).unwrap_or("");
        assert!(
            local.starts_with("127.0.0.1:"),
            "a daemon listens beyond loopback: {line}"
        );
    }
    // The OSD's public, cluster and heartbeat ports.
    assert!(
        osd_sockets >= 2,
        "no listening socket found for the OSD (pid {osd}):\n{}",
        out.stdout
    );
}

/// fio's rbd engine writes through librbd into the cluster: every byte it
/// wrote is what `rbd export` reads.
#[test]
fn fio_rbd_engine_writes_into_the_cluster() {
    require_tool("fio");
    let c = ceph();
    let name = unique_image_name("harness-fio");
    let size = 8 * MIB;
    c.create_image(&name, size);
    let mut cmd = tool("fio");
    cmd.env("CEPH_CONF", &c.conf).args([
        "--name=w".to_string(),
        "--ioengine=rbd".into(),
        format!("--clientname={}", c.id),
        format!("--pool={}", c.pool),
        format!("--rbdname={name}"),
        "--rw=write".into(),
        "--bs=64k".into(),
        "--iodepth=8".into(),
        format!("--size={size}"),
        "--buffer_pattern=0x5a17c3e1".into(),
        "--output-format=json".into(),
    ]);
    let out = run_cmd_timeout(cmd, TOOL_TIMEOUT);
    assert!(out.success(), "fio rbd:\n{out}");
    let doc = Json::parse_first_object(&out.stdout);
    let job = &doc.at("jobs").arr()[0];
    assert_eq!(job.at("error").i64(), 0, "fio job error:\n{out}");
    assert_eq!(job.at("write").at("io_bytes").u64(), size, "bytes written");
    let want: Vec<u8> = [0x5a, 0x17, 0xc3, 0xe1]
        .into_iter()
        .cycle()
        .take(usize::try_from(size).expect("size"))
        .collect();
    assert_bytes_eq(&c.export_image(&name), &want, 0, "fio's bytes");
    c.remove_image(&name);
}
