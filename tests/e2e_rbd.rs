//! loopd serving RBD images (`rbd:POOL/IMAGE`) of a throwaway Ceph cluster
//! (`common::ceph`): real NBD clients (qemu-io, qemu-img, nbdcopy, nbdinfo)
//! read and write through loopd, and every byte is checked against `rbd
//! export` of the image — a client of the cluster that is not loopd.
//!
//! Each test uses images of its own (`unique_image_name`) and removes them.

mod common;

use common::CephImage as Image;
use common::pki::Pki;
use common::*;
use std::path::Path;
use std::time::Duration;

const SIZE: u64 = 16 * MIB;

/// `loopd serve rbd:…` with the test cluster's configuration and `extra`.
fn serve(img: &Image, extra: &[&str]) -> Server {
    let spec = img.spec();
    Server::builder(Path::new(&spec))
        .name("rbd0")
        .args(ceph().loopd_args())
        .args(extra)
        .start()
}

/// A daemon with a control socket and no devices.
fn daemon() -> Server {
    Server::daemon().start()
}

/// `loopd attach rbd:… --ceph-conf … --ceph-id …` with `extra`.
fn attach(srv: &Server, spec: &str, extra: &[&str]) -> Out {
    let conf = ceph().conf.to_str().expect("utf-8 conf path").to_owned();
    let mut a = vec![
        "attach",
        spec,
        "--ceph-conf",
        conf.as_str(),
        "--ceph-id",
        ceph().id,
    ];
    a.extend_from_slice(extra);
    srv.ctl(&a)
}

/// The bytes a pattern write of qemu-io (`write -P byte off len`) leaves.
fn fill(v: &mut [u8], off: u64, len: u64, byte: u8) {
    let (a, b) = (us(off), us(off + len));
    v[a..b].fill(byte);
}

/// Reads, writes (aligned and not), flush, FUA, write-zeroes and trim through
/// qemu-io over NBD on an RBD image; `rbd export` holds exactly what the
/// client wrote. Run in both cache modes: with librbd's cache on (buffered)
/// the export is taken while loopd still serves, so only a flush or FUA can
/// have put the bytes on the OSDs.
#[test]
fn qemu_io_bytes_match_rbd_export_in_both_cache_modes() {
    for cache in ["direct", "buffered"] {
        let img = Image::new("qio", SIZE);
        let seed: Vec<u8> = pattern_bytes(7, 0, us(SIZE));
        ceph().write_image(&img.name, &seed);
        let srv = serve(&img, &["--cache", cache]);
        let uri = srv.uri();
        let mut want = seed.clone();
        // What was there reads back through loopd.
        let dir = tempdir();
        let seed_file = dir.path().join("seed");
        std::fs::write(&seed_file, &seed).unwrap();
        let out = run_status(
            "qemu-img",
            [
                "compare",
                "-f",
                "raw",
                "-F",
                "raw",
                uri.as_str(),
                path_str(&seed_file),
            ],
        );
        assert!(
            out.success(),
            "[{cache}] qemu-img compare of the seed:\n{out}"
        );
        qemu_io(
            &uri,
            &[
                "write -P 0xab 4096 65536",
                "write -P 0xcd 1000 3000",
                "write -P 0x11 5242880 1048576",
                "flush",
                "write -f -P 0x22 8388608 12345",
                "write -z 9437184 70000",
                "write -z -u 10485760 2097152",
                "discard 13631488 1048576",
                "flush",
            ],
        );
        fill(&mut want, 4096, 65536, 0xab);
        fill(&mut want, 1000, 3000, 0xcd);
        fill(&mut want, 5 << 20, 1 << 20, 0x11);
        fill(&mut want, 8 << 20, 12345, 0x22);
        fill(&mut want, 9 << 20, 70000, 0);
        fill(&mut want, 10 << 20, 2 << 20, 0);
        // loopd discards with librbd's partial discards off: trimmed bytes
        // read as zeros.
        fill(&mut want, 13 << 20, 1 << 20, 0);
        let got = img.export();
        assert_eq!(got.len(), want.len(), "[{cache}] export size");
        assert_bytes_eq(
            &got,
            &want,
            0,
            &format!("[{cache}] rbd export vs the writes"),
        );
        // And loopd reads what it wrote.
        qemu_io(
            &uri,
            &["read -P 0xab 4096 65536", "read -P 0 13631488 1048576"],
        );
        drop(srv);
    }
}

/// nbdcopy (several connections) writes a file into the image and qemu-img
/// convert reads it back: both equal to the source and to `rbd export`.
#[test]
fn nbdcopy_in_and_qemu_img_convert_out() {
    let img = Image::new("copy", SIZE);
    let dir = tempdir();
    let src = dir.path().join("src.img");
    create_pattern_image(&src, SIZE, 3);
    let srv = serve(&img, &["--cache", "buffered"]);
    run(
        "nbdcopy",
        ["--connections=4", path_str(&src), srv.uri().as_str()],
    );
    let back = dir.path().join("back.img");
    run(
        "qemu-img",
        [
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            srv.uri().as_str(),
            path_str(&back),
        ],
    );
    drop(srv);
    let want = read_file(&src);
    assert_bytes_eq(&read_file(&back), &want, 0, "qemu-img convert out of loopd");
    assert_bytes_eq(&img.export(), &want, 0, "rbd export after nbdcopy");
}

/// Block status of a sparse image: the written object is data, the rest
/// holes, as `nbdinfo --map` shows it.
#[test]
fn block_status_maps_a_sparse_image() {
    let img = Image::new("map", 64 * MIB);
    ceph().write_image_at(&img.name, 8 * MIB, &vec![0x5a; us(4 * MIB)]);
    let srv = serve(&img, &["--cache", "direct"]);
    let out = run("nbdinfo", ["--map", "--json", srv.uri().as_str()]);
    let map = Json::parse(&out.stdout);
    let mut runs: Vec<(u64, u64, bool)> = Vec::new();
    for e in map.arr() {
        let (off, len) = (e.at("offset").u64(), e.at("length").u64());
        let data = e.at("type").u64() & 1 == 0;
        match runs.last_mut() {
            Some(l) if l.2 == data && l.0 + l.1 == off => l.1 += len,
            _ => runs.push((off, len, data)),
        }
    }
    assert_eq!(
        runs,
        [
            (0, 8 * MIB, false),
            (8 * MIB, 4 * MIB, true),
            (12 * MIB, 52 * MIB, false),
        ],
        "nbdinfo --map:\n{}",
        out.stdout
    );
}

/// `rbd:POOL/IMAGE@SNAP` is served read-only: the export says so, a write
/// fails, and the bytes are the snapshot's, not the image's now.
#[test]
fn a_snapshot_is_served_read_only() {
    let img = Image::new("snap", 4 * MIB);
    ceph().write_image(&img.name, &vec![0x31; us(4 * MIB)]);
    ceph().snap_create(&img.name, "s1");
    ceph().write_image(&img.name, &vec![0x32; us(MIB)]);
    let spec = format!("{}@s1", img.spec());
    let srv = Server::builder(Path::new(&spec))
        .name("snap")
        .args(ceph().loopd_args())
        .start();
    let info = nbd_info(&srv.uri());
    assert!(info.at("is_read_only").bool(), "{info:?}");
    let out = run(
        "qemu-io",
        [
            "-r",
            "-f",
            "raw",
            srv.uri().as_str(),
            "-c",
            "read -P 0x31 0 4194304",
        ],
    );
    assert!(!out.stdout.contains("verification failed"), "{out}");
    let out = qemu_io_status(&srv.uri(), &["write -P 0x33 0 4096"]);
    let all = format!("{}{}", out.stdout, out.stderr).to_lowercase();
    assert!(
        !out.success() || all.contains("not permitted") || all.contains("read-only"),
        "a write to a snapshot must fail:\n{out}"
    );
    drop(srv);
    assert_bytes_eq(
        &ceph().export_image(&format!("{}@s1", img.name)),
        &vec![0x31; us(4 * MIB)],
        0,
        "the snapshot",
    );
}

/// A second loopd on an image another holds is refused, naming the holder;
/// with --shared it is served.
#[test]
fn a_second_loopd_on_the_image_is_refused_naming_the_holder() {
    let img = Image::new("lock", 4 * MIB);
    let first = serve(&img, &[]);
    qemu_io(&first.uri(), &["write -P 0x44 0 4096"]);
    let second = daemon();
    let out = attach(&second, &img.spec(), &["--name", "again"]);
    assert_ctl_error(&out, "busy");
    assert!(
        // librbd names the holder by its address (the cluster is on loopback).
        out.stderr.contains("exclusive lock is held by 127.0.0.1:"),
        "the holder is named:\n{out}"
    );
    // The first keeps serving.
    qemu_io(&first.uri(), &["read -P 0x44 0 4096"]);
    drop(first);
    // Once it is gone, the lock is free.
    attach(&second, &img.spec(), &["--name", "again"]).assert_success();
    second.ctl_ok(&["detach", "again"]);
}

/// Bad input fails with a clear message and the exit status of its class.
#[test]
fn bad_specs_missing_images_and_wrong_ids_fail_clearly() {
    let srv = daemon();
    let img = Image::new("bad", 4 * MIB);
    for (spec, code, says) in [
        ("rbd:nopool", "invalid", "give the pool"),
        ("rbd:a/b/c/d", "invalid", "too many '/'"),
        ("rbd:rbd/x:id=admin", "invalid", "--ceph-conf and --ceph-id"),
        (
            "rbd:no-such-pool/x",
            "not_found",
            "no pool \"no-such-pool\"",
        ),
        (
            "rbd:rbd/no-such-image",
            "not_found",
            "no image rbd:rbd/no-such-image",
        ),
    ] {
        let out = attach(&srv, spec, &["--name", "x"]);
        assert_ctl_error(&out, code);
        assert!(
            out.stderr.contains(says),
            "{spec}: {says:?} expected:\n{out}"
        );
    }
    let missing_snap = format!("{}@nosnap", img.spec());
    assert_ctl_error(&attach(&srv, &missing_snap, &["--name", "x"]), "not_found");
    let out = srv.ctl(&[
        "attach",
        &img.spec(),
        "--name",
        "x",
        "--ceph-conf",
        ceph().conf.to_str().unwrap(),
        "--ceph-id",
        "nobody",
    ]);
    assert_ctl_error(&out, "unavailable");
    assert!(out.stderr.contains("refused client.nobody"), "{out}");
    let out = srv.ctl(&[
        "attach",
        &img.spec(),
        "--name",
        "x",
        "--ceph-conf",
        "/nonexistent.conf",
    ]);
    assert_ctl_error(&out, "unavailable");
    assert!(out.stderr.contains("/nonexistent.conf"), "{out}");
    let out = loopd_run(["kernel", "attach", img.spec().as_str()]);
    assert_eq!(out.status.code(), Some(exit_status_for("invalid")), "{out}");
    assert!(out.stderr.contains("needs a file"), "{out}");
    assert!(srv.list_json().is_empty(), "nothing was attached");
}

/// `list` names the image by its spec and the state file records the
/// cluster's configuration and id (never a key); detach lets the lock go.
#[test]
fn list_and_the_state_record_name_the_image_and_never_a_key() {
    let img = Image::new("list", 4 * MIB);
    let srv = daemon();
    attach(&srv, &img.spec(), &[]).assert_success();
    let name = img.name.clone();
    let dev = srv
        .device(&name)
        .expect("the device is named after the image");
    assert_eq!(dev.at("image").str(), img.spec());
    let state = std::fs::read_to_string(srv.socket().with_extension("state")).unwrap();
    assert!(state.contains(&img.spec()), "{state}");
    assert!(
        state.contains("ceph_id") && state.contains("admin"),
        "{state}"
    );
    assert!(state.contains(ceph().conf.to_str().unwrap()), "{state}");
    assert!(!state.to_lowercase().contains("key"), "{state}");
    srv.ctl_ok(&["detach", &name]);
    // The lock went with the device: another client takes it.
    let again = serve(&img, &[]);
    qemu_io(&again.uri(), &["write -P 1 0 512"]);
}

/// A stopped OSD fails requests with an error after the RADOS timeout
/// instead of hanging; when it continues, requests succeed again.
#[test]
fn a_stalled_osd_fails_requests_after_the_timeout_then_recovers() {
    let img = Image::new("stall", 4 * MIB);
    // The RBD device and a file device in one daemon: the stalled cluster
    // is not the file device's trouble.
    let srv = daemon();
    let spec = img.spec();
    let a = attach(
        &srv,
        &spec,
        &["--name", "rbd0", "--cache", "direct", "--ceph-timeout", "3"],
    );
    assert!(a.success(), "attach the RBD image:\n{a}");
    let rbd_uri = srv.uri_for_name("rbd0");
    let dir = tempdir();
    let file = dir.path().join("f.img");
    create_pattern_image(&file, 4 * MIB, 5);
    srv.ctl_ok(&["attach", path_str(&file), "--name", "f"]);
    let file_uri = srv.uri_for_name("f");
    qemu_io(&rbd_uri, &["write -P 0x61 0 65536"]);
    let t = std::time::Instant::now();
    let (out, file_took) = {
        let _paused = ceph().pause_osd();
        let uri = rbd_uri.clone();
        let stalled =
            std::thread::spawn(move || qemu_io_status(&uri, &["write -P 0x62 65536 65536"]));
        // While the RBD write waits on the stopped OSD, the file device serves.
        std::thread::sleep(Duration::from_millis(500));
        let f0 = std::time::Instant::now();
        qemu_io(
            &file_uri,
            &["write -P 0x77 0 65536", "read -P 0x77 0 65536"],
        );
        let file_took = f0.elapsed();
        (
            stalled.join().expect("the stalled client's thread"),
            file_took,
        )
    };
    let took = t.elapsed();
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(
        all.contains("failed"),
        "the write fails while the OSD is stopped:\n{out}"
    );
    assert!(
        took < Duration::from_secs(30),
        "bounded by the timeout: {took:?}"
    );
    assert!(
        file_took < Duration::from_secs(2),
        "the file device answered within 2 s while the cluster stalled (took {file_took:?})"
    );
    qemu_io(
        &rbd_uri,
        &["write -P 0x63 131072 65536", "read -P 0x61 0 65536"],
    );
}

/// Several clients at once on one RBD image, with and without TLS (`--tls
/// on`): the export says it can take several connections (`can_multi_conn`:
/// they share one open image), fio writes and verifies (crc32c) with four jobs
/// on four TCP connections over their own ranges (fio's nbd engine cannot be
/// given a certificate directory), two libnbd handles over TLS see each
/// other's writes at once and one flush makes both durable, and what loopd
/// serves (nbdcopy over four TLS connections) is what `rbd export` reads from
/// the cluster — in both cache modes.
#[test]
fn fio_and_tls_clients_share_one_image_over_several_connections() {
    require_tool("fio");
    let dir = tempdir();
    let pki = Pki::new(dir.path().join("pki"));
    let certs = pki.server_dir("server");
    let trust = pki.trust_dir("trust");
    for cache in ["direct", "buffered"] {
        let img = Image::new("tls", 32 * MIB);
        let spec = img.spec();
        let srv = Server::builder(Path::new(&spec))
            .name("rbd0")
            .tcp()
            .with_control()
            .args(ceph().loopd_args())
            .args(["--cache", cache, "--tls", "on", "--tls-certs"])
            .arg(&certs)
            .start();
        let uri = format!(
            "nbds://127.0.0.1:{}/rbd0?tls-certificates={}",
            srv.port(),
            trust.display()
        );
        let plain = srv.tcp_uri();
        for u in [&uri, &plain] {
            let can = run_status_timeout(
                Duration::from_secs(60),
                "nbdinfo",
                ["--can", "multi-conn", u.as_str()],
            );
            assert!(can.success(), "[{cache}] no CAN_MULTI_CONN on {u}:\n{can}");
        }

        let out = run_status_timeout(
            Duration::from_secs(180),
            "fio",
            [
                "--name=rbd",
                "--ioengine=nbd",
                &format!("--uri={plain}"),
                "--rw=randwrite",
                "--bsrange=4k-64k",
                "--blockalign=4k",
                "--size=4M",
                "--numjobs=4",
                "--offset_increment=4M",
                "--iodepth=8",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--do_verify=1",
                "--output-format=json",
            ],
        );
        assert!(out.success(), "[{cache}] fio failed:\n{out}");
        let doc = Json::parse_first_object(&out.stdout);
        let jobs = doc.at("jobs").arr();
        assert_eq!(jobs.len(), 4, "[{cache}] four fio jobs:\n{out}");
        for j in jobs {
            assert_eq!(j.at("error").i64(), 0, "[{cache}] fio job error:\n{out}");
            assert_eq!(
                j.at("write").at("io_bytes").u64(),
                4 * MIB,
                "[{cache}] each job writes its 4 MiB:\n{out}"
            );
        }

        // Two connections share one image: a write on one is read on the
        // other at once, and a flush on the second makes it durable.
        let script = format!(
            "a = nbd.NBD()\n\
             a.set_uri_allow_local_file(True)\n\
             a.connect_uri({u})\n\
             b = nbd.NBD()\n\
             b.set_uri_allow_local_file(True)\n\
             b.connect_uri({u})\n\
             assert a.get_tls_negotiated() and b.get_tls_negotiated()\n\
             a.pwrite(b'\\x5a' * 65536, 20 * 1048576)\n\
             assert b.pread(65536, 20 * 1048576) == b'\\x5a' * 65536, 'not seen on b'\n\
             b.flush()\n\
             a.shutdown()\n\
             b.shutdown()\n",
            u = py_str(&uri)
        );
        nbdsh(&script).assert_success();
        // Durable on the OSDs while loopd still serves (buffered: only the
        // flush of the second connection can have put it there).
        let exported = img.export();
        assert_bytes_eq(
            &exported[us(20 * MIB)..us(20 * MIB + 65536)],
            &[0x5a; 65536],
            20 * MIB,
            &format!("[{cache}] written on one connection, flushed on another"),
        );

        // Everything loopd serves is what the cluster holds.
        let back = dir.path().join(format!("{cache}.back"));
        run_status_timeout(
            Duration::from_secs(120),
            "nbdcopy",
            ["-C", "4", uri.as_str(), path_str(&back)],
        )
        .assert_success();
        assert_bytes_eq(
            &std::fs::read(&back).unwrap(),
            &exported,
            0,
            &format!("[{cache}] nbdcopy over TLS against rbd export"),
        );
    }
}

/// What loopd shows of an RBD device — `list` and `status` (text and JSON),
/// the Prometheus endpoint, the audit lines on stderr and the state file —
/// names its pool, namespace, image and snapshot, and never the client's key
/// (the secret in the cluster's admin keyring).
#[test]
fn status_metrics_and_audit_name_pool_namespace_image_snapshot_never_a_key() {
    let ns = unique_image_name("ns");
    let name = unique_image_name("shown");
    let full = format!("{}/{ns}/{name}", ceph().pool);
    let ok = |out: std::process::Output, what: &str| {
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ok(
        ceph().rbd(&[
            "namespace",
            "create",
            "--pool",
            ceph().pool,
            "--namespace",
            &ns,
        ]),
        "rbd namespace create",
    );
    ok(ceph().rbd(&["create", "--size", "4M", &full]), "rbd create");
    ok(
        ceph().rbd(&["snap", "create", &format!("{full}@s1")]),
        "rbd snap create",
    );

    let addr = format!("127.0.0.1:{}", free_port());
    let srv = Server::daemon().args(["--metrics", addr.as_str()]).start();
    let image = format!("rbd:{full}");
    let snap = format!("rbd:{full}@s1");
    attach(&srv, &image, &[]).assert_success();
    attach(&srv, &snap, &[]).assert_success();

    let mut shown = String::new();
    // list and status, as text and JSON.
    for args in [
        vec!["list"],
        vec!["list", "--json"],
        vec!["status", name.as_str()],
        vec!["status", name.as_str(), "--json"],
    ] {
        let out = srv.ctl_ok(&args);
        assert!(
            out.stdout.contains(&image),
            "{args:?} names the image:\n{out}"
        );
        shown.push_str(&out.stdout);
    }
    let snap_name = format!("{name}@s1");
    let out = srv.ctl_ok(&["status", &snap_name]);
    assert!(out.stdout.contains(&snap), "status of the snapshot:\n{out}");
    shown.push_str(&out.stdout);

    // The metrics endpoint: one info sample per RBD device.
    let scrape = run_status_timeout(
        Duration::from_secs(30),
        "curl",
        ["-sS", "--max-time", "5", &format!("http://{addr}/metrics")],
    );
    assert!(scrape.success(), "curl the metrics:\n{scrape}");
    for (dev, snapshot) in [(name.as_str(), ""), (snap_name.as_str(), "s1")] {
        let want = format!(
            "loopd_rbd_image_info{{device=\"{dev}\",pool=\"{}\",namespace=\"{ns}\",image=\"{name}\",snapshot=\"{snapshot}\"}} 1",
            ceph().pool
        );
        assert!(
            scrape.stdout.contains(&want),
            "no {want:?} in:\n{}",
            scrape.stdout
        );
    }
    shown.push_str(&scrape.stdout);

    // The audit lines.
    srv.ctl_ok(&["detach", &snap_name]);
    let log = srv.stderr_text();
    for want in [
        format!("attach \"{name}\" image=\"{image}\""),
        format!("attach \"{snap_name}\" image=\"{snap}\""),
        format!("detach \"{snap_name}\""),
    ] {
        assert!(log.contains(&want), "no audit line {want:?} in:\n{log}");
    }
    shown.push_str(&log);
    shown.push_str(&std::fs::read_to_string(srv.socket().with_extension("state")).unwrap());

    // The admin key is nowhere.
    let keyring = std::fs::read_to_string(ceph().dir.join("keyring")).unwrap();
    let keys: Vec<&str> = keyring
        .lines()
        .filter_map(|l| l.trim().strip_prefix("key = "))
        .collect();
    assert!(!keys.is_empty(), "no key in the test keyring:\n{keyring}");
    for k in keys {
        assert!(!shown.contains(k.trim()), "a key was shown:\n{shown}");
    }

    srv.ctl_ok(&["detach", &name]);
    let _ = ceph().rbd(&["snap", "purge", "--no-progress", &full]);
    let _ = ceph().rbd(&["rm", "--no-progress", &full]);
    let _ = ceph().rbd(&[
        "namespace",
        "remove",
        "--pool",
        ceph().pool,
        "--namespace",
        &ns,
    ]);
}
