//! The daemon and its control plane: `loopd serve` without an image, the
//! control socket (CLI and raw JSON protocol), attach/detach/list/status/
//! set/resize, autoclear, the durable state file across `kill -9`, `--config`
//! with many devices, and isolation of a reconfigured device from a loaded one.

mod common;

use common::*;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

/// A Unix NBD URI for export `name` on the daemon's socket.
fn uri(srv: &Server, name: &str) -> String {
    srv.uri_for_name(name)
}

/// Asserts the control socket is a socket with mode 0600.
#[track_caller]
fn assert_control_socket_0600(path: &Path) {
    let m = std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("control socket {} missing: {e}", path.display()));
    assert!(
        m.file_type().is_socket(),
        "{} is not a socket",
        path.display()
    );
    assert_eq!(
        m.permissions().mode() & 0o7777,
        0o600,
        "control socket {} has mode {:o}, expected 0600",
        path.display(),
        m.permissions().mode() & 0o7777
    );
}

/// The devices of a state file: a `{"loopd_state":1}` header, then one JSON
/// record per line, `{"put":DEVICE}` or `{"del":"NAME"}`, replayed in order.
fn state_devices(path: &Path) -> Vec<Json> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read state file {}: {e}", path.display()));
    let mut lines = text.lines();
    let header = Json::parse(lines.next().unwrap_or_default());
    assert_eq!(
        header.at("loopd_state").u64(),
        1,
        "state file header: {text}"
    );
    let mut table: Vec<Json> = Vec::new();
    for line in lines {
        let rec = Json::parse(line);
        if let Some(dev) = rec.get("put") {
            let name = dev.at("name").str().to_string();
            match table.iter_mut().find(|d| d.at("name").str() == name) {
                Some(slot) => *slot = dev.clone(),
                None => table.push(dev.clone()),
            }
        } else {
            let name = rec.at("del").str().to_string();
            table.retain(|d| d.at("name").str() != name);
        }
    }
    table
}

fn state_names(path: &Path) -> Vec<String> {
    state_devices(path)
        .iter()
        .map(|d| d.at("name").str().to_string())
        .collect()
}

/// The state file is written by a background thread shortly after each
/// change: waits (up to 5 s) until it lists exactly `want`.
#[track_caller]
fn assert_state_names(path: &Path, want: &[&str]) {
    let start = Instant::now();
    loop {
        let got = if path.exists() {
            state_names(path)
        } else {
            Vec::new()
        };
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "state file {} lists {got:?}, expected {want:?}",
            path.display()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------
// Startup, endpoints, control socket
// ---------------------------------------------------------------------------

/// `loopd serve --socket S` without an image: the ready lines are the URI with
/// an empty export name and `control: S.ctl`; the control socket is mode 0600;
/// there are no devices; the state file (the harness's `--state`, beside the
/// control socket) appears on the first attach; `LOOPD_CONTROL` selects the
/// daemon. (The default state path is tested in e2e_state.rs.)
#[test]
fn serve_without_image_defaults() {
    let dir = tempdir();
    let mut srv = Server::daemon().start();
    let sock = srv.socket().to_path_buf();
    let ctl = sock.with_extension("ctl");
    assert_eq!(srv.control(), ctl.as_path(), "default control socket path");
    assert_eq!(
        srv.stdout_lines(),
        vec![
            format!("nbd+unix:///?socket={}", sock.display()),
            format!("control: {}", ctl.display()),
        ],
        "ready lines of `loopd serve --socket S` without an image"
    );
    assert_control_socket_0600(&ctl);

    assert!(srv.list_json().is_empty(), "a fresh daemon has no devices");
    let table = srv.ctl_ok(&["list"]).stdout;
    assert_eq!(
        table.lines().collect::<Vec<_>>(),
        vec!["NAME SIZE OFFSET SIZELIMIT BLOCK CACHE DIO RO AUTOCLEAR CLIENTS BLOCKDEV IMAGE"],
        "empty list table"
    );
    // Connecting with the empty name finds nothing to serve.
    let out = run_status("nbdinfo", ["--size", &srv.uri_for_name("")]);
    assert!(
        !out.success(),
        "nbdinfo on a daemon without devices should fail:\n{out}"
    );

    let state = ctl.with_extension("state");
    assert!(!state.exists(), "no state file before the first attach");
    let img = dir.path().join("first.img");
    create_sparse_image(&img, 4 * MIB);
    srv.ctl_ok(&["attach", path_str(&img)]);
    assert_state_names(&state, &["first"]);

    // LOOPD_CONTROL instead of --control.
    let mut c = Command::new(loopd_bin());
    c.args(["list", "--json"]).env("LOOPD_CONTROL", &ctl);
    let out = run_cmd_timeout(c, Duration::from_secs(20)).assert_success();
    let devs = Json::parse(&out.stdout);
    assert_eq!(devs.arr().len(), 1, "list via LOOPD_CONTROL:\n{out}");
    assert_eq!(devs.arr()[0].at("name").str(), "first");
    assert_eq!(devs.arr()[0].at("size").u64(), 4 * MIB);

    srv.stop_ok();
    assert!(!ctl.exists(), "control socket removed on SIGTERM");
    assert!(!sock.exists(), "NBD socket removed on SIGTERM");
    // Without a daemon, client commands fail clearly.
    let out = loopd_ctl(&ctl, &["list"]);
    assert!(!out.success(), "list without a daemon must fail:\n{out}");
    assert!(
        out.stderr.contains("cannot connect to the control socket"),
        "message for a missing daemon:\n{out}"
    );
}

/// Explicit `--control` (in a directory that does not exist yet) and
/// `--state` are used instead of the defaults; a second daemon cannot take
/// over a control socket that is in use.
#[test]
fn explicit_control_and_state_paths() {
    let dir = tempdir();
    let ctl = dir.path().join("run/sub/my.ctl");
    let state = dir.path().join("devices.json");
    let srv = Server::daemon()
        .arg("--control")
        .arg(&ctl)
        .arg("--state")
        .arg(&state)
        .start();
    assert_eq!(srv.control(), ctl.as_path());
    assert_control_socket_0600(&ctl);
    let default_ctl = srv.socket().with_extension("ctl");
    assert!(
        !default_ctl.exists(),
        "the default control socket must not be created when --control is given"
    );

    let img = dir.path().join("x.img");
    create_sparse_image(&img, MIB);
    let out = srv.ctl_ok(&["attach", path_str(&img), "--name", "xdev"]);
    assert_eq!(out.stdout.lines().next(), Some("xdev"));
    assert_state_names(&state, &["xdev"]);
    assert!(
        !default_ctl.with_extension("state").exists(),
        "the default state file must not be written when --state is given"
    );

    // Another daemon with the same control socket refuses to start.
    let sock2 = dir.path().join("other.sock");
    let mut c = Command::new(loopd_bin());
    c.arg("serve")
        .arg("--socket")
        .arg(&sock2)
        .arg("--control")
        .arg(&ctl)
        .arg("--state")
        .arg(dir.path().join("other.state"));
    let out = run_cmd_timeout(c, Duration::from_secs(20));
    assert!(
        !out.success(),
        "a second daemon on a control socket in use must fail:\n{out}"
    );
    assert!(out.stderr.contains("in use"), "{out}");
    // The first daemon still answers.
    assert_eq!(srv.device_names(), vec!["xdev"]);
    assert_control_socket_0600(&ctl);
}

// ---------------------------------------------------------------------------
// attach / list / status / detach
// ---------------------------------------------------------------------------

/// Attach prints the name and the URIs; the device serves the image's bytes;
/// `list` (table and JSON) and `status` (counters) describe it; options such
/// as offset, size limit, block size, cache and read-only are honoured;
/// detach removes it and further requests get `not_found`.
#[test]
fn attach_list_status_detach() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("pat.img");
    create_pattern_image(&img, 8 * MIB, 7);

    let out = srv.ctl_ok(&["attach", path_str(&img), "--name", "disk1"]);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines,
        vec!["disk1".to_string(), uri(&srv, "disk1")],
        "attach output: name, then one URI per line"
    );
    assert_eq!(nbd_size(&uri(&srv, "disk1")), 8 * MIB);

    // Data path: bytes of the image come back; writes land in the image.
    let (mut c, size, _) = RawClient::handshake(srv.socket(), "disk1");
    assert_eq!(size, 8 * MIB);
    assert_bytes_eq(
        &c.read(1, 3 * MIB, 4096),
        &pattern_bytes(7, 3 * MIB, 4096),
        3 * MIB,
        "read through disk1",
    );
    drop(c);
    qemu_io(&uri(&srv, "disk1"), &["write -P 0xa5 1M 64k", "flush"]);
    assert_file_filled(&img, MIB, 64 * KIB, 0xa5, "write through disk1");
    assert_file_pattern(&img, MIB + 64 * KIB, 4096, 7, "bytes after the write");

    // list: table.
    let table = srv.ctl_ok(&["list"]).stdout;
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "header + one row:\n{table}");
    assert_eq!(
        rows[0],
        vec![
            "NAME",
            "SIZE",
            "OFFSET",
            "SIZELIMIT",
            "BLOCK",
            "CACHE",
            "DIO",
            "RO",
            "AUTOCLEAR",
            "CLIENTS",
            "BLOCKDEV",
            "IMAGE"
        ]
    );
    let r = &rows[1];
    assert_eq!(r[0], "disk1", "{table}");
    assert_eq!(r[1], "8M", "{table}");
    assert_eq!(r[2], "0B", "{table}");
    assert_eq!(r[3], "none", "{table}");
    assert!(["512", "1024", "2048", "4096"].contains(&r[4]), "{table}");
    assert_eq!(r[5], "auto", "{table}");
    assert_eq!(&r[7..10], &["no", "no", "0"], "{table}");
    assert_eq!(r[10], "-", "no block device: {table}");
    assert_eq!(r[11], path_str(&img), "{table}");

    // list --json.
    let d = srv.device("disk1").expect("disk1 listed");
    assert_eq!(d.at("image").str(), path_str(&img));
    assert_eq!(d.at("size").u64(), 8 * MIB);
    assert_eq!(d.at("offset").u64(), 0);
    assert!(d.at("size_limit").is_null());
    assert_eq!(d.at("cache").str(), "auto");
    assert!(!d.at("read_only").bool());
    assert!(!d.at("autoclear").bool());
    assert_eq!(d.at("clients").u64(), 0);
    assert_eq!(
        d.at("uris").arr(),
        &[Json::String(uri(&srv, "disk1"))],
        "uris in list"
    );

    // status: counters reflect the I/O above.
    let st = srv.ctl_json(&["status", "disk1"]);
    assert_eq!(st.at("name").str(), "disk1");
    assert_eq!(st.at("size").u64(), 8 * MIB);
    assert_eq!(st.at("in_flight").u64(), 0);
    let req = st.at("requests");
    assert!(req.at("read").u64() >= 1, "reads counted: {st:?}");
    assert!(req.at("write").u64() >= 1, "writes counted: {st:?}");
    assert!(req.at("flush").u64() >= 1, "flushes counted: {st:?}");
    assert!(
        st.at("bytes_written").u64() >= 64 * KIB,
        "bytes_written: {st:?}"
    );
    assert!(st.at("bytes_read").u64() >= 4096, "bytes_read: {st:?}");
    let paths = st.at("paths");
    let path_total: u64 = [
        "direct",
        "bounced",
        "buffered",
        "inline_cached",
        "inline_written",
        "spliced",
    ]
    .iter()
    .map(|k| paths.at(k).u64())
    .sum();
    assert!(path_total >= 2, "reads and writes took some path: {st:?}");
    match st.at("errors") {
        Json::Object(m) => {
            assert!(!m.is_empty(), "errors by errno: {st:?}");
            for (k, v) in m {
                assert_eq!(v.u64(), 0, "no {k} errors expected: {st:?}");
            }
        }
        other => panic!("errors is not an object: {other:?}"),
    }
    let lat = st.at("latency");
    let (p50, p99, max) = (
        lat.at("p50_us").f64(),
        lat.at("p99_us").f64(),
        lat.at("max_us").f64(),
    );
    assert!(
        p50 > 0.0 && p50 <= p99 && p99 <= max,
        "latency p50 {p50} <= p99 {p99} <= max {max}"
    );
    let text = srv.ctl_ok(&["status", "disk1"]).stdout;
    for key in [
        "name: disk1",
        "clients: 0",
        "in_flight: 0",
        "requests: ",
        "paths: ",
        "errors: ",
        "latency_us: p50=",
    ] {
        assert!(text.contains(key), "status text lacks {key:?}:\n{text}");
    }

    // A second device with every option, attached with --json.
    let ro = srv.ctl_json(&[
        "attach",
        path_str(&img),
        "--name",
        "win",
        "--offset",
        "1M",
        "--size-limit",
        "2M",
        "--block-size",
        "4096",
        "--strict-block-size",
        "--cache",
        "buffered",
        "--read-only",
        // disk1 writes this image: a second device on it is on purpose.
        "--shared",
    ]);
    assert_eq!(ro.at("name").str(), "win");
    assert_eq!(ro.at("offset").u64(), MIB);
    assert_eq!(ro.at("size").u64(), 2 * MIB);
    assert_eq!(ro.at("size_limit").u64(), 2 * MIB);
    assert_eq!(ro.at("block_size").u64(), 4096);
    assert!(ro.at("strict_block_size").bool(), "{ro:?}");
    assert_eq!(ro.at("cache").str(), "buffered");
    assert!(!ro.at("direct").bool(), "buffered means no direct I/O");
    assert!(ro.at("read_only").bool());
    assert_eq!(ro.at("uris").arr(), &[Json::String(uri(&srv, "win"))]);
    let info = nbd_info(&uri(&srv, "win"));
    assert_eq!(info.at("export-size").u64(), 2 * MIB);
    assert!(info.at("is_read_only").bool(), "{info:?}");
    // --strict-block-size: the block size is the minimum (else 1).
    assert_eq!(info.at("block_size_minimum").u64(), 4096, "{info:?}");
    let (mut c, _, tflags) = RawClient::handshake(srv.socket(), "win");
    assert_ne!(tflags & NBD_FLAG_READ_ONLY, 0, "read-only flag");
    // Byte 0 of the window is byte 1M of the file (which now holds 0xa5).
    assert_eq!(c.read(1, 0, 4096), vec![0xa5; 4096]);
    assert_bytes_eq(
        &c.read(2, 64 * KIB, 4096),
        &pattern_bytes(7, MIB + 64 * KIB, 4096),
        MIB + 64 * KIB,
        "window read",
    );
    assert_eq!(
        c.write(3, 0, &[0u8; 4096]),
        1,
        "write to a read-only device: EPERM"
    );
    drop(c);
    assert_file_filled(&img, MIB, 4096, 0xa5, "read-only device wrote nothing");

    // status without a name: every device, in one call.
    let all = srv.ctl_json(&["status"]);
    let names: Vec<&str> = all.arr().iter().map(|d| d.at("name").str()).collect();
    assert_eq!(names, vec!["disk1", "win"], "{all:?}");
    for d in all.arr() {
        let one = srv.ctl_json(&["status", d.at("name").str()]);
        assert_eq!(d.at("image").str(), one.at("image").str());
        assert!(d.at("requests").at("read").u64() <= one.at("requests").at("read").u64());
    }
    assert!(
        all.arr()[0].at("requests").at("write").u64() >= 1,
        "{all:?}"
    );
    assert!(all.arr()[1].at("requests").at("read").u64() >= 2, "{all:?}");
    let table = srv.ctl_ok(&["status"]).stdout;
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 3, "header + one row per device:\n{table}");
    assert_eq!(rows[0][0], "NAME", "{table}");
    assert_eq!(rows[0][4], "READS", "{table}");
    assert_eq!((rows[1][0], rows[1][1]), ("disk1", "live"), "{table}");
    assert_eq!(rows[2][0], "win", "{table}");
    assert!(rows[2][4].parse::<u64>().unwrap_or(0) >= 2, "{table}");

    // Detach.
    let out = srv.ctl_ok(&["detach", "disk1"]);
    assert_eq!(out.stdout.trim(), "detached disk1");
    assert_eq!(srv.device_names(), vec!["win"]);
    let out = run_status("nbdinfo", ["--size", &uri(&srv, "disk1")]);
    assert!(!out.success(), "a detached export is gone:\n{out}");
    srv.ctl_err(&["detach", "disk1"], "not_found");
    srv.ctl_err(&["status", "disk1"], "not_found");
    srv.ctl_err(&["set", "disk1", "--size-limit", "1M"], "not_found");
    srv.ctl_err(&["resize", "disk1"], "not_found");
    srv.ctl_ok(&["detach", "win"]);
    assert!(srv.list_json().is_empty());
    // The image is untouched by detaching.
    assert_eq!(file_len(&img), 8 * MIB);
}

/// Every failed attach leaves no trace: the device list and the state file
/// are unchanged, an image `--create` would have made does not exist, and an
/// existing device of the same name is untouched.
#[test]
fn failed_attach_leaves_no_trace() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let state = srv.control().with_extension("state");
    let keep = dir.path().join("keep.img");
    create_pattern_image(&keep, 2 * MIB, 3);
    let other = dir.path().join("other.img");
    create_sparse_image(&other, 4 * MIB);
    srv.ctl_ok(&["attach", path_str(&keep), "--name", "keep"]);
    assert_state_names(&state, &["keep"]);
    let list_before = srv.ctl_ok(&["list", "--json"]).stdout;
    let state_before = std::fs::read_to_string(&state).expect("state file");
    let a_dir = dir.path().join("adir");
    std::fs::create_dir(&a_dir).unwrap();
    let files_before = {
        let mut v: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        v.sort();
        v
    };

    let missing = dir.path().join("missing.img");
    let new1 = dir.path().join("new1.img");
    let new2 = dir.path().join("new2.img");
    let new3 = dir.path().join("new3.img");
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        ("missing file", vec![path_str(&missing)], "io"),
        ("directory", vec![path_str(&a_dir)], "io"),
        (
            "block size 1000",
            vec![path_str(&other), "--block-size", "1000"],
            "invalid",
        ),
        (
            "block size 8192",
            vec![path_str(&other), "--block-size", "8192"],
            "invalid",
        ),
        (
            "unaligned offset",
            vec![path_str(&other), "--offset", "100"],
            "invalid",
        ),
        (
            "offset past the end",
            vec![path_str(&other), "--offset", "8M"],
            "invalid",
        ),
        (
            "size limit not a whole block",
            vec![path_str(&other), "--size-limit", "1000"],
            "invalid",
        ),
        (
            "name taken",
            vec![path_str(&other), "--name", "keep"],
            "name_taken",
        ),
        (
            "name taken (default name from the file stem)",
            vec![path_str(&keep)],
            "name_taken",
        ),
        (
            "name with '/'",
            vec![path_str(&other), "--name", "a/b"],
            "invalid",
        ),
        (
            "empty name",
            vec![path_str(&other), "--name", ""],
            "invalid",
        ),
        (
            "--create then bad block size",
            vec![path_str(&new1), "--create", "4M", "--block-size", "1000"],
            "invalid",
        ),
        (
            "--create then offset past the end",
            vec![path_str(&new2), "--create", "1M", "--offset", "2M"],
            "invalid",
        ),
        (
            "--create with a taken name",
            vec![path_str(&new3), "--create", "1M", "--name", "keep"],
            "name_taken",
        ),
    ];
    for (what, args, code) in cases {
        let mut a = vec!["attach"];
        a.extend(args);
        let out = srv.ctl(&a);
        assert_ctl_error(&out, code);
        assert_eq!(
            srv.ctl_ok(&["list", "--json"]).stdout,
            list_before,
            "{what}: the device list changed after a failed attach"
        );
        assert_eq!(
            std::fs::read_to_string(&state).expect("state file"),
            state_before,
            "{what}: the state file changed after a failed attach"
        );
        for f in [&missing, &new1, &new2, &new3] {
            assert!(
                !f.exists(),
                "{what}: {} exists after a failed attach",
                f.display()
            );
        }
    }
    let mut files_after: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files_after.sort();
    assert_eq!(files_before, files_after, "no files were created");
    // The device that was there all along still serves its data.
    let (mut c, size, _) = RawClient::handshake(srv.socket(), "keep");
    assert_eq!(size, 2 * MIB);
    assert_bytes_eq(
        &c.read(1, 0, 4096),
        &pattern_bytes(3, 0, 4096),
        0,
        "keep still serves keep.img",
    );
    drop(c);

    // --create that succeeds: a sparse file of that size.
    let made = dir.path().join("made.img");
    let d = srv.ctl_json(&["attach", path_str(&made), "--create", "3M"]);
    assert_eq!(d.at("name").str(), "made");
    assert_eq!(d.at("size").u64(), 3 * MIB);
    assert_eq!(file_len(&made), 3 * MIB);
    // --create on an existing file neither truncates nor resizes it.
    let d = srv.ctl_json(&[
        "attach",
        path_str(&keep),
        "--name",
        "keep2",
        "--shared",
        "--create",
        "1G",
    ]);
    assert_eq!(d.at("size").u64(), 2 * MIB);
    assert_eq!(file_len(&keep), 2 * MIB);
    assert_file_pattern(&keep, 0, 2 * MIB, 3, "--create on an existing image");
}

/// Racing attaches of the same new image under the same name with
/// `--create`: one wins, the others fail, and the winner's image file must
/// still exist (the losers' "leave no trace" cleanup must not delete the
/// file the winner created and serves).
#[test]
fn concurrent_create_same_name_keeps_winner_image() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    const ROUNDS: usize = 15;
    const RACERS: usize = 6;
    for round in 0..ROUNDS {
        let img = dir.path().join(format!("race{round}.img"));
        let name = format!("race{round}");
        let req = format!(
            r#"{{"v":1,"op":"attach","image":"{}","name":"{name}","create":1048576}}"#,
            path_str(&img)
        );
        let barrier = Arc::new(Barrier::new(RACERS));
        let handles: Vec<_> = (0..RACERS)
            .map(|_| {
                let mut conn = ControlConn::connect(srv.control());
                let req = req.clone();
                let b = Arc::clone(&barrier);
                thread::spawn(move || {
                    b.wait();
                    conn.request(&req)
                })
            })
            .collect();
        let replies: Vec<Json> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let wins = replies
            .iter()
            .filter(|r| r.at("ok") == &Json::Bool(true))
            .count();
        assert_eq!(
            wins, 1,
            "round {round}: exactly one attach wins: {replies:?}"
        );
        for r in replies.iter().filter(|r| r.at("ok") == &Json::Bool(false)) {
            // Losers may see the name taken, or the half-made file: any code.
            assert!(!r.at("error").at("code").str().is_empty(), "{r:?}");
        }
        assert!(
            img.exists(),
            "round {round}: {} was deleted although device {name:?} serves it: {replies:?}",
            img.display()
        );
        // Data written through the device lands in the file on disk.
        qemu_io(&uri(&srv, &name), &["write -P 0x5a 0 4k", "flush"]);
        assert_file_filled(&img, 0, 4096, 0x5a, &format!("round {round}"));
    }
}

/// A relative IMAGE path is relative to the *client's* working directory
/// (like `losetup`), not to wherever the daemon happens to run.
#[test]
fn attach_relative_path_is_relative_to_client_cwd() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let cwd = dir.path().join("client-cwd");
    std::fs::create_dir(&cwd).unwrap();
    create_pattern_image(&cwd.join("rel.img"), MIB, 9);
    let mut c = Command::new(loopd_bin());
    c.args(["attach", "rel.img", "--control"])
        .arg(srv.control())
        .current_dir(&cwd);
    let out = run_cmd_timeout(c, Duration::from_secs(20));
    assert!(
        out.success(),
        "attach of a relative path from the client's directory failed:\n{out}"
    );
    let d = srv.device("rel").expect("rel attached");
    assert_eq!(
        Path::new(d.at("image").str()),
        cwd.join("rel.img"),
        "the recorded image path must be absolute"
    );
}

// ---------------------------------------------------------------------------
// detach with clients
// ---------------------------------------------------------------------------

/// `detach` refuses (busy) while clients are connected — a raw NBD client and
/// a python libnbd handle — says so, and the clients keep working; once they
/// disconnect, a plain detach succeeds.
#[test]
fn detach_refuses_while_clients_connected() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("busy.img");
    create_pattern_image(&img, 4 * MIB, 11);
    srv.ctl_ok(&["attach", path_str(&img)]);

    let (mut c, _, _) = RawClient::handshake(srv.socket(), "busy");
    srv.wait_clients("busy", 1, Duration::from_secs(5));
    let out = srv.ctl_err(&["detach", "busy"], "busy");
    assert!(
        out.stderr.contains("1 connected client"),
        "the refusal says a client is connected:\n{out}"
    );
    assert!(srv.device("busy").is_some(), "still attached after refusal");
    // The client was not disturbed.
    assert_eq!(c.write(1, 8192, &[0x77; 4096]), 0);
    c.send_request(0, NBD_CMD_FLUSH, 2, 0, 0);
    assert_eq!(c.read_simple_reply(), (0, 2));
    assert_eq!(c.read(3, 8192, 4096), vec![0x77; 4096]);

    // A second client (python libnbd): the count and the message follow.
    let (mut py, _hold) = python_client(dir.path(), &uri(&srv, "busy"));
    srv.wait_clients("busy", 2, Duration::from_secs(5));
    let out = srv.ctl_err(&["detach", "busy"], "busy");
    assert!(out.stderr.contains("2 connected client"), "{out}");
    py.kill();
    c.send_request(0, NBD_CMD_DISC, 4, 0, 0);
    drop(c);
    srv.wait_clients("busy", 0, Duration::from_secs(5));
    let out = srv.ctl_ok(&["detach", "busy"]);
    assert_eq!(out.stdout.trim(), "detached busy");
    assert!(srv.list_json().is_empty());
    assert_file_filled(&img, 8192, 4096, 0x77, "data written by the client");
    assert_file_pattern(&img, 0, 8192, 11, "rest of the image");
}

/// Starts a python libnbd client holding a connection to `uri` open (for up
/// to 30 s); returns once it is connected.
fn python_client(dir: &Path, uri: &str) -> (ChildGuard, std::path::PathBuf) {
    let hold = dir.join(format!(
        "py-connected-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    let script = format!(
        "import nbd, time\nh = nbd.NBD()\nh.connect_uri({})\nopen({}, 'w').close()\ntime.sleep(30)\n",
        py_str(uri),
        py_str(path_str(&hold))
    );
    // /usr/bin first: the system python has the nbd module.
    let mut py = Command::new(which("python3").unwrap_or_else(|| panic!("python3 not found")));
    py.env("PATH", tool_path_env()).arg("-c").arg(script);
    let child = ChildGuard::spawn(py);
    let start = Instant::now();
    while !hold.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "python libnbd client did not connect to {uri}"
        );
        thread::sleep(Duration::from_millis(20));
    }
    (child, hold)
}

/// Sends reads in a loop until the server closes the connection; returns how
/// many reads succeeded.
fn read_until_closed(mut c: RawClient) -> u64 {
    use std::io::{Read, Write};
    let mut n = 0u64;
    loop {
        let req = RawClient::request_bytes(REQUEST_MAGIC, 0, NBD_CMD_READ, n, 0, 4096);
        if c.s.write_all(&req).is_err() {
            return n;
        }
        let mut hdr = [0u8; 16];
        if c.s.read_exact(&mut hdr).is_err() {
            return n;
        }
        assert_eq!(&hdr[0..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&hdr[4..8], &[0, 0, 0, 0], "read failed before the detach");
        let mut data = vec![0u8; 4096];
        if c.s.read_exact(&mut data).is_err() {
            return n;
        }
        n += 1;
        thread::sleep(Duration::from_millis(5));
    }
}

/// `detach --force` with an active client: the detach completes promptly,
/// the client is disconnected and the device is gone; flushed data is in the
/// image.
#[test]
fn detach_force_disconnects_active_client() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("act.img");
    create_sparse_image(&img, 4 * MIB);
    srv.ctl_ok(&["attach", path_str(&img)]);
    qemu_io(&uri(&srv, "act"), &["write -P 0x42 0 64k", "flush"]);

    let (c, _, _) = RawClient::handshake(srv.socket(), "act");
    let reader = thread::spawn(move || read_until_closed(c));
    srv.wait_clients("act", 1, Duration::from_secs(5));
    thread::sleep(Duration::from_millis(100));
    srv.ctl_err(&["detach", "act"], "busy");

    let t = Instant::now();
    let out = srv.ctl_ok(&["detach", "act", "--force"]);
    let took = t.elapsed();
    assert_eq!(out.stdout.trim(), "detached act");
    assert!(took < Duration::from_secs(5), "forced detach took {took:?}");
    let t = Instant::now();
    while !reader.is_finished() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the client was not disconnected by detach --force"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let reads = reader.join().unwrap();
    assert!(reads > 0, "the client did some reads before the detach");
    assert!(srv.device("act").is_none());
    let out = run_status("nbdinfo", ["--size", &uri(&srv, "act")]);
    assert!(!out.success(), "the export is gone:\n{out}");
    assert_file_filled(&img, 0, 64 * KIB, 0x42, "data flushed before detach");
}

/// `detach --force` with idle clients (connected, no request in flight — a
/// raw NBD client after the handshake and a python libnbd handle): the
/// detach must complete promptly and disconnect them.
#[test]
fn detach_force_disconnects_idle_clients() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("idle.img");
    create_sparse_image(&img, 4 * MIB);
    srv.ctl_ok(&["attach", path_str(&img)]);

    let (mut c, _, _) = RawClient::handshake(srv.socket(), "idle");
    assert_eq!(c.write(1, 0, &[0x66; 4096]), 0);
    c.send_request(0, NBD_CMD_FLUSH, 2, 0, 0);
    assert_eq!(c.read_simple_reply(), (0, 2));
    let (_py, _hold) = python_client(dir.path(), &uri(&srv, "idle"));
    srv.wait_clients("idle", 2, Duration::from_secs(5));

    let t = Instant::now();
    let out = srv.ctl_ok(&["detach", "idle", "--force"]);
    let took = t.elapsed();
    assert_eq!(out.stdout.trim(), "detached idle");
    assert!(srv.device("idle").is_none(), "gone after --force");
    let stray = c.expect_closed("idle raw client after detach --force");
    assert!(stray.is_empty(), "unexpected bytes after forced detach");
    assert!(
        took < Duration::from_secs(5),
        "detach --force with idle clients took {took:?}"
    );
    assert_file_filled(&img, 0, 4096, 0x66, "data flushed before detach");
}

/// A spawned helper process killed (by PID) and reaped on drop.
struct ChildGuard(Option<std::process::Child>);

impl ChildGuard {
    fn spawn(mut c: Command) -> ChildGuard {
        c.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit());
        ChildGuard(Some(c.spawn().expect("spawn helper")))
    }

    fn kill(&mut self) {
        if let Some(mut ch) = self.0.take() {
            let _ = ch.kill();
            let _ = ch.wait();
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------
// set / resize
// ---------------------------------------------------------------------------

/// `set`: no effective change → `changed: false`, nothing frozen; size limit
/// on an idle device changes the size clients see; offset, block size, a
/// smaller size and read-only on are refused (busy) while a client is
/// connected unless `--force`; read-only can be toggled; invalid values leave
/// the device as it was.
#[test]
fn set_reconfigures_live() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("cfg.img");
    create_pattern_image(&img, 8 * MIB, 21);
    srv.ctl_ok(&[
        "attach",
        path_str(&img),
        "--name",
        "cfg",
        "--block-size",
        "512",
    ]);
    let u = uri(&srv, "cfg");

    // No effective change.
    for args in [
        vec!["set", "cfg"],
        vec!["set", "cfg", "--size-limit", "8M"],
        vec!["set", "cfg", "--offset", "0"],
        vec!["set", "cfg", "--block-size", "512"],
        vec!["set", "cfg", "--read-only", "false"],
    ] {
        let r = srv.ctl_json(&args);
        assert!(!r.at("changed").bool(), "{args:?}: {r:?}");
        assert_eq!(r.at("quiesced_us").u64(), 0, "{args:?}: {r:?}");
        assert_eq!(r.at("size").u64(), 8 * MIB, "{args:?}");
    }
    let out = srv.ctl_ok(&["set", "cfg"]);
    assert_eq!(
        out.stdout.trim(),
        "cfg: nothing to change: the device already has these settings"
    );

    // Size limit on an idle device.
    let r = srv.ctl_json(&["set", "cfg", "--size-limit", "2M"]);
    assert!(r.at("changed").bool(), "{r:?}");
    assert_eq!(r.at("size").u64(), 2 * MIB);
    assert_eq!(r.at("size_limit").u64(), 2 * MIB);
    assert_eq!(nbd_size(&u), 2 * MIB, "nbdinfo after set --size-limit 2M");
    let out = srv.ctl_ok(&["set", "cfg", "--size-limit", "6M"]);
    assert!(
        out.stdout
            .contains("cfg: updated (size 6 MiB (6291456 bytes), offset 0 bytes,"),
        "{out}"
    );
    assert_eq!(nbd_size(&u), 6 * MIB);
    // Past the end of the file: reads as zeros there.
    srv.ctl_ok(&["set", "cfg", "--size-limit", "9M"]);
    assert_eq!(nbd_size(&u), 9 * MIB);
    qemu_io(&u, &["read -P 0 8M 1M"]);
    srv.ctl_ok(&["set", "cfg", "--size-limit", "8M"]);

    // Invalid values change nothing.
    let before = srv.ctl_ok(&["list", "--json"]).stdout;
    srv.ctl_err(&["set", "cfg", "--block-size", "1000"], "invalid");
    srv.ctl_err(&["set", "cfg", "--offset", "100"], "invalid");
    srv.ctl_err(&["set", "cfg", "--size-limit", "1000"], "invalid");
    srv.ctl_err(&["set", "nope", "--size-limit", "1M"], "not_found");
    assert_eq!(srv.ctl_ok(&["list", "--json"]).stdout, before);
    assert_eq!(nbd_size(&u), 8 * MIB);

    // With a client connected: offset and block size need --force.
    let (mut c, _, _) = RawClient::handshake(srv.socket(), "cfg");
    srv.wait_clients("cfg", 1, Duration::from_secs(5));
    let out = srv.ctl_err(&["set", "cfg", "--offset", "4096"], "busy");
    assert!(out.stderr.contains("--force"), "{out}");
    srv.ctl_err(&["set", "cfg", "--block-size", "4096"], "busy");
    assert_eq!(
        strip_volatile(&srv.device("cfg").unwrap()),
        strip_volatile(&Json::parse(&before).arr()[0]),
        "refused set changed the device"
    );
    // The client keeps working with the old configuration.
    assert_bytes_eq(
        &c.read(1, 0, 4096),
        &pattern_bytes(21, 0, 4096),
        0,
        "client after refused set",
    );
    // Shrinking and read-only on break the client too; growing does not.
    let out = srv.ctl_err(&["set", "cfg", "--size-limit", "4M"], "busy");
    assert!(out.stderr.contains("a smaller size"), "{out}");
    let out = srv.ctl_err(&["set", "cfg", "--read-only", "true"], "busy");
    assert!(out.stderr.contains("read-only on"), "{out}");
    let r = srv.ctl_json(&["set", "cfg", "--size-limit", "9M"]);
    assert!(r.at("changed").bool());
    let r = srv.ctl_json(&["set", "cfg", "--size-limit", "4M", "--force"]);
    assert!(r.at("changed").bool());
    assert_bytes_eq(
        &c.read(2, 4096, 4096),
        &pattern_bytes(21, 4096, 4096),
        4096,
        "client after size-limit change",
    );
    // --force applies the offset.
    let r = srv.ctl_json(&["set", "cfg", "--offset", "1M", "--force"]);
    assert!(r.at("changed").bool(), "{r:?}");
    assert_eq!(r.at("offset").u64(), MIB);
    drop(c);
    let (mut c2, size, _) = RawClient::handshake(srv.socket(), "cfg");
    assert_eq!(size, 4 * MIB, "size limit kept across the offset change");
    assert_bytes_eq(
        &c2.read(1, 0, 4096),
        &pattern_bytes(21, MIB, 4096),
        MIB,
        "byte 0 is now byte 1M of the file",
    );
    drop(c2);
    // The daemon notices the hang-up on its own time; read-only on below is
    // refused while a client is still counted.
    srv.wait_clients("cfg", 0, Duration::from_secs(5));

    // Read-only toggling.
    let r = srv.ctl_json(&["set", "cfg", "--read-only", "true"]);
    assert!(r.at("changed").bool() && r.at("read_only").bool(), "{r:?}");
    assert!(nbd_info(&u).at("is_read_only").bool());
    let (mut c3, _, tflags) = RawClient::handshake(srv.socket(), "cfg");
    assert_ne!(tflags & NBD_FLAG_READ_ONLY, 0);
    assert_eq!(c3.write(1, 0, &[1u8; 512]), 1, "EPERM while read-only");
    drop(c3);
    srv.wait_clients("cfg", 0, Duration::from_secs(5));
    let r = srv.ctl_json(&["set", "cfg", "--read-only", "false"]);
    assert!(r.at("changed").bool() && !r.at("read_only").bool(), "{r:?}");
    assert!(!nbd_info(&u).at("is_read_only").bool());
    qemu_io(&u, &["write -P 0x3c 0 4k", "flush"]);
    assert_file_filled(&img, MIB, 4096, 0x3c, "write after read-only off");

    // The configuration is what the state file remembers (written shortly
    // after the change by a background thread).
    let state = srv.control().with_extension("state");
    let start = Instant::now();
    loop {
        let st = state_devices(&state);
        assert_eq!(st.len(), 1);
        let d = &st[0];
        if d.at("offset").u64() == MIB
            && d.get("size_limit").map(Json::u64) == Some(4 * MIB)
            && !d.at("read_only").bool()
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "state file does not have the last configuration: {d:?}"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// `resize` re-reads the file size after the file grew (and shrank).
#[test]
fn resize_follows_file_size() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("grow.img");
    create_sparse_image(&img, 4 * MIB);
    srv.ctl_ok(&["attach", path_str(&img)]);
    let u = uri(&srv, "grow");
    assert_eq!(nbd_size(&u), 4 * MIB);

    let r = srv.ctl_json(&["resize", "grow"]);
    assert!(!r.at("changed").bool(), "nothing to re-read yet: {r:?}");

    run("truncate", ["-s", "12M", path_str(&img)]);
    let r = srv.ctl_json(&["resize", "grow"]);
    assert!(r.at("changed").bool(), "{r:?}");
    assert_eq!(r.at("size").u64(), 12 * MIB);
    assert_eq!(nbd_size(&u), 12 * MIB);
    assert_eq!(srv.device("grow").unwrap().at("size").u64(), 12 * MIB);
    qemu_io(&u, &["write -P 0x99 11M 1M", "flush"]);
    assert_file_filled(&img, 11 * MIB, MIB, 0x99, "write into the grown part");

    let out = srv.ctl_ok(&["resize", "grow"]);
    assert_eq!(
        out.stdout.trim(),
        "grow: nothing to change: the device already has the size the file gives it"
    );

    run("truncate", ["-s", "6M", path_str(&img)]);
    let r = srv.ctl_json(&["resize", "grow"]);
    assert!(r.at("changed").bool());
    assert_eq!(nbd_size(&u), 6 * MIB);
}

// ---------------------------------------------------------------------------
// autoclear
// ---------------------------------------------------------------------------

/// An autoclear device stays while nobody has connected yet and while any
/// client is connected, and goes away after the last client disconnects (and
/// from the state file too). A device without autoclear stays.
#[test]
fn autoclear_after_last_client() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("ac.img");
    create_sparse_image(&img, 2 * MIB);
    let keep_img = dir.path().join("stay.img");
    create_sparse_image(&keep_img, 2 * MIB);
    let d = srv.ctl_json(&["attach", path_str(&img), "--autoclear"]);
    assert!(d.at("autoclear").bool());
    srv.ctl_ok(&["attach", path_str(&keep_img)]);
    let table = srv.ctl_ok(&["list"]).stdout;
    let ac_row = table.lines().find(|l| l.starts_with("ac ")).unwrap();
    assert_eq!(ac_row.split_whitespace().nth(8), Some("yes"), "{table}");
    let state = srv.control().with_extension("state");
    assert_state_names(&state, &["ac", "stay"]);

    // Never connected: stays.
    thread::sleep(Duration::from_millis(300));
    assert!(srv.device("ac").is_some(), "removed before any client came");

    let (mut a, _, _) = RawClient::handshake(srv.socket(), "ac");
    let (b, _, _) = RawClient::handshake(srv.socket(), "ac");
    srv.wait_clients("ac", 2, Duration::from_secs(5));
    assert_eq!(a.write(1, 0, &[0xac; 4096]), 0);
    a.send_request(0, NBD_CMD_DISC, 2, 0, 0);
    drop(a);
    srv.wait_clients("ac", 1, Duration::from_secs(5));
    thread::sleep(Duration::from_millis(200));
    assert!(
        srv.device("ac").is_some(),
        "removed while a client is still connected"
    );
    drop(b); // disconnect without NBD_CMD_DISC
    let gone = srv.wait_gone("ac", Duration::from_secs(5));
    assert!(
        gone.is_some(),
        "autoclear device still listed 5 s after its last client left"
    );
    assert_state_names(&state, &["stay"]);
    assert_file_filled(&img, 0, 4096, 0xac, "data written before autoclear");

    // The non-autoclear device stays after a client came and went.
    let (s, _, _) = RawClient::handshake(srv.socket(), "stay");
    srv.wait_clients("stay", 1, Duration::from_secs(5));
    drop(s);
    srv.wait_clients("stay", 0, Duration::from_secs(5));
    thread::sleep(Duration::from_millis(300));
    assert_eq!(srv.device_names(), vec!["stay"]);
}

// ---------------------------------------------------------------------------
// Durable state
// ---------------------------------------------------------------------------

/// Devices attached over the control socket come back after `kill -9` and a
/// restart with the same `--socket` (state file beside it), with the same
/// configuration and the data written and flushed before the kill; a device
/// detached before the kill does not come back.
#[test]
fn state_survives_kill9() {
    let dir = tempdir();
    let sock = dir.path().join("nbd.sock");
    let a = dir.path().join("alpha.img");
    let b = dir.path().join("beta.img");
    let c = dir.path().join("gamma.img");
    create_sparse_image(&a, 8 * MIB);
    create_sparse_image(&b, 8 * MIB);
    create_sparse_image(&c, MIB);

    let mut srv = Server::daemon().socket_path(&sock).start();
    assert_eq!(srv.control(), dir.path().join("nbd.ctl"));
    srv.ctl_ok(&["attach", path_str(&a)]);
    srv.ctl_ok(&[
        "attach",
        path_str(&b),
        "--name",
        "b-win",
        "--offset",
        "1M",
        "--size-limit",
        "4M",
        "--block-size",
        "4096",
        "--cache",
        "buffered",
    ]);
    srv.ctl_ok(&["attach", path_str(&c), "--read-only"]);
    srv.ctl_ok(&["attach", path_str(&c), "--name", "temp", "--shared"]);
    srv.ctl_ok(&["detach", "temp"]);
    qemu_io(
        &uri(&srv, "alpha"),
        &["write -P 0x1a 0 64k", "write -P 0x1b 7M 1M", "flush"],
    );
    qemu_io(&uri(&srv, "b-win"), &["write -P 0x2b 0 128k", "flush"]);
    let before: Vec<Json> = srv
        .list_json()
        .into_iter()
        .map(|d| strip_volatile(&d))
        .collect();
    assert_eq!(before.len(), 3);
    assert_state_names(&dir.path().join("nbd.state"), &["alpha", "b-win", "gamma"]);

    srv.kill9();
    assert!(sock.exists(), "stale NBD socket after kill -9");
    assert!(
        dir.path().join("nbd.state").exists(),
        "state file beside the sockets"
    );

    let srv2 = Server::daemon().socket_path(&sock).start();
    let after: Vec<Json> = srv2
        .list_json()
        .into_iter()
        .map(|d| strip_volatile(&d))
        .collect();
    assert_eq!(after, before, "devices after restart");
    assert_eq!(srv2.device_names(), vec!["alpha", "b-win", "gamma"]);
    qemu_io(
        &uri(&srv2, "alpha"),
        &[
            "read -P 0x1a 0 64k",
            "read -P 0 64k 1M",
            "read -P 0x1b 7M 1M",
        ],
    );
    qemu_io(
        &uri(&srv2, "b-win"),
        &["read -P 0x2b 0 128k", "read -P 0 128k 64k"],
    );
    assert_eq!(nbd_size(&uri(&srv2, "b-win")), 4 * MIB);
    assert!(nbd_info(&uri(&srv2, "gamma")).at("is_read_only").bool());
    assert_file_filled(&b, MIB, 128 * KIB, 0x2b, "b-win data at offset 1M");
    // Restored devices are still managed (and persisted) as before.
    srv2.ctl_ok(&["detach", "gamma"]);
    assert_state_names(&dir.path().join("nbd.state"), &["alpha", "b-win"]);
}

/// An acknowledged attach is durable: `kill -9` right after the reply (no
/// grace period for a background state writer) still brings the device back
/// on restart.
#[test]
fn acknowledged_attach_survives_immediate_kill9() {
    let dir = tempdir();
    let sock = dir.path().join("nbd.sock");
    const ROUNDS: usize = 10;
    let mut want: Vec<String> = Vec::new();
    for i in 0..ROUNDS {
        let mut srv = Server::daemon().socket_path(&sock).start();
        let got = srv.device_names();
        assert_eq!(got, want, "round {i}: devices after restart");
        let img = dir.path().join(format!("k{i:02}.img"));
        create_sparse_image(&img, MIB);
        let mut c = ControlConn::connect(srv.control());
        c.ok(&format!(
            r#"{{"v":1,"op":"attach","image":"{}"}}"#,
            path_str(&img)
        ));
        srv.kill9();
        want.push(format!("k{i:02}"));
    }
    let srv = Server::daemon().socket_path(&sock).start();
    assert_eq!(srv.device_names(), want, "devices after the last restart");
}

/// `list` fields that describe the configuration (not live counters).
fn strip_volatile(d: &Json) -> Json {
    let mut d = d.clone();
    if let Some(m) = d.as_object_mut() {
        m.remove("clients");
    }
    d
}

// ---------------------------------------------------------------------------
// --config
// ---------------------------------------------------------------------------

/// `--config` with 200 `[[device]]` tables: all attached at start, quickly;
/// every field of a table is honoured; config devices are not written to the
/// state file.
#[test]
fn config_with_200_devices() {
    const N: usize = 200;
    let dir = tempdir();
    let imgs = dir.path().join("imgs");
    std::fs::create_dir(&imgs).unwrap();
    let mut toml = String::from("# 200 devices\n");
    for i in 0..N {
        let img = imgs.join(format!("d{i:03}.img"));
        create_sparse_image(&img, MIB);
        toml.push_str(&format!("[[device]]\nimage = \"{}\"\n", path_str(&img)));
        match i % 4 {
            // Default name: the file stem.
            0 => {}
            1 => toml.push_str(&format!(
                "name = \"vol-{i}\"\noffset = 4096\nsize_limit = 524288\nblock_size = 4096\n"
            )),
            2 => toml.push_str(&format!(
                "name = \"vol-{i}\"\nread_only = true\ncache = \"buffered\"\n"
            )),
            _ => toml.push_str(&format!("name = \"vol-{i}\"\nautoclear = true\n")),
        }
    }
    let cfg = dir.path().join("devices.toml");
    std::fs::write(&cfg, &toml).unwrap();
    write_at(&imgs.join("d001.img"), 4096, &[0xd1; 4096]);

    let t = Instant::now();
    let srv = Server::daemon().arg("--config").arg(&cfg).start();
    let startup = t.elapsed();
    eprintln!("startup with {N} config devices: {startup:?}");
    assert!(
        startup < Duration::from_secs(5),
        "starting with {N} config devices took {startup:?}"
    );

    let devs = srv.list_json();
    assert_eq!(devs.len(), N, "list --json after --config");
    let by_name = |n: &str| {
        devs.iter()
            .find(|d| d.at("name").str() == n)
            .unwrap_or_else(|| panic!("device {n} missing"))
            .clone()
    };
    let d0 = by_name("d000");
    assert_eq!(d0.at("size").u64(), MIB);
    assert!(!d0.at("read_only").bool());
    let d1 = by_name("vol-1");
    assert_eq!(d1.at("offset").u64(), 4096);
    assert_eq!(d1.at("size").u64(), 512 * KIB);
    assert_eq!(d1.at("block_size").u64(), 4096);
    let d2 = by_name("vol-2");
    assert!(d2.at("read_only").bool());
    assert_eq!(d2.at("cache").str(), "buffered");
    assert!(by_name("vol-3").at("autoclear").bool());
    assert_eq!(
        by_name("vol-199").at("image").str(),
        path_str(&imgs.join("d199.img"))
    );

    // They serve: the window of vol-1 starts at byte 4096 of d001.img.
    let (mut c, size, _) = RawClient::handshake(srv.socket(), "vol-1");
    assert_eq!(size, 512 * KIB);
    assert_eq!(c.read(1, 0, 4096), vec![0xd1; 4096]);
    drop(c);
    assert!(nbd_info(&uri(&srv, "vol-198")).at("is_read_only").bool());

    // Config devices come back from the config, not from the state file.
    let state = srv.control().with_extension("state");
    assert!(
        !state.exists() || state_devices(&state).is_empty(),
        "config devices must not be recorded in the state file"
    );
    // They are managed like any other device.
    srv.ctl_ok(&["detach", "d000"]);
    assert_eq!(srv.list_json().len(), N - 1);
}

/// Without IMAGE there is no default device: even when --config attaches
/// devices, the ready line carries the empty export name, and the empty name
/// does not silently select one of the devices.
#[test]
fn no_default_device_without_image() {
    let dir = tempdir();
    let img = dir.path().join("d.img");
    create_sparse_image(&img, MIB);
    let cfg = dir.path().join("two.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nimage = \"{0}\"\nname = \"zz\"\n[[device]]\nimage = \"{0}\"\nname = \"bb\"\nshared = true\n",
            path_str(&img)
        ),
    )
    .unwrap();
    let srv = Server::daemon().arg("--config").arg(&cfg).start();
    assert_eq!(
        srv.stdout_lines()[0],
        format!("nbd+unix:///?socket={}", srv.socket().display()),
        "ready line without IMAGE"
    );
    let out = run_status("nbdinfo", ["--json", &srv.uri_for_name("")]);
    assert!(
        !out.success(),
        "the empty export name selected a device although none is the default:\n{out}"
    );
}

/// A bad config file stops `serve` with an error naming the file (and the
/// device); nothing is left listening. (A device whose image is missing is
/// no error of the file: see e2e_config_devices.rs.)
#[test]
fn config_errors_fail_startup() {
    let dir = tempdir();
    let img = dir.path().join("c.img");
    create_sparse_image(&img, MIB);
    let cases = [
        (
            "unknown field",
            format!(
                "[[device]]\nimage = \"{}\"\ncolour = \"red\"\n",
                path_str(&img)
            ),
        ),
        ("not TOML", "[[device]\nimage = ".to_string()),
        (
            "duplicate name",
            format!(
                "[[device]]\nimage = \"{0}\"\nname = \"x\"\n[[device]]\nimage = \"{0}\"\nname = \"x\"\n",
                path_str(&img)
            ),
        ),
        (
            "bad block size",
            format!(
                "[[device]]\nimage = \"{}\"\nblock_size = 1000\n",
                path_str(&img)
            ),
        ),
    ];
    for (i, (what, text)) in cases.iter().enumerate() {
        let cfg = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&cfg, text).unwrap();
        let sock = dir.path().join(format!("s{i}.sock"));
        let mut c = Command::new(loopd_bin());
        c.arg("serve")
            .arg("--socket")
            .arg(&sock)
            .arg("--state")
            .arg(sock.with_extension("state"))
            .arg("--config")
            .arg(&cfg);
        let out = run_cmd_timeout(c, Duration::from_secs(20));
        assert!(!out.success(), "{what}: serve must fail:\n{out}");
        assert!(
            out.stderr.contains(path_str(&cfg)),
            "{what}: the error names the config file:\n{out}"
        );
        assert!(
            !sock.with_extension("ctl").exists(),
            "{what}: control socket left behind"
        );
    }
}

// ---------------------------------------------------------------------------
// The raw control protocol
// ---------------------------------------------------------------------------

/// The JSON-lines protocol itself: version checks, bad requests, garbage —
/// each answered with the right code on the same connection, which keeps
/// working; requests from several connections interleave.
#[test]
fn raw_control_protocol() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let mut c = ControlConn::connect(srv.control());

    c.err(r#"{"op":"list"}"#, "unsupported_version");
    c.err(r#"{"v":2,"op":"list"}"#, "unsupported_version");
    c.err(r#"{"v":"1","op":"list"}"#, "unsupported_version");
    c.err(r#"{"v":1,"op":"explode"}"#, "bad_request");
    c.err(r#"{"v":1}"#, "bad_request");
    c.err(
        r#"{"v":1,"op":"detach","name":"a","forse":true}"#,
        "bad_request",
    );
    c.err(
        r#"{"v":1,"op":"attach","image":"/x","colour":1}"#,
        "bad_request",
    );
    // Without a name, status answers for every device (none yet).
    let r = c.ok(r#"{"v":1,"op":"status"}"#);
    assert_eq!(r.at("devices").arr().len(), 0);
    c.err(r#"{"v":1,"op":"status","name":7}"#, "bad_request");
    c.err("garbage", "bad_request");
    c.err("[1,2]", "bad_request");
    c.err(r#"{"v":1,"op":"list""#, "bad_request");
    // The connection still works.
    let r = c.ok(r#"{"v":1,"op":"list"}"#);
    assert_eq!(r.at("devices").arr().len(), 0);
    let r = c.ok(r#"{"v":1,"op":"version"}"#);
    assert_eq!(r.at("protocol").u64(), 1);
    assert!(!r.at("version").str().is_empty());
    // CRLF and blank lines are tolerated.
    c.send_raw(b"\n\r\n{\"v\":1,\"op\":\"list\"}\r\n");
    let r = c.read_reply();
    assert_eq!(r.at("ok"), &Json::Bool(true), "{r:?}");

    // Daemon errors over the wire.
    c.err(r#"{"v":1,"op":"status","name":"nope"}"#, "not_found");
    let img = dir.path().join("raw.img");
    create_sparse_image(&img, 2 * MIB);
    let attach = format!(
        r#"{{"v":1,"op":"attach","image":"{}","name":"raw","block_size":4096,"read_only":true}}"#,
        path_str(&img)
    );
    let r = c.ok(&attach);
    assert_eq!(r.at("name").str(), "raw");
    assert_eq!(r.at("block_size").u64(), 4096);
    assert!(r.at("read_only").bool());
    assert_eq!(r.at("uris").arr(), &[Json::String(uri(&srv, "raw"))]);
    c.err(&attach, "name_taken");
    c.err(
        &format!(
            r#"{{"v":1,"op":"attach","image":"{}","name":"bs","block_size":1000}}"#,
            path_str(&img)
        ),
        "invalid",
    );

    // A second connection while the first stays open (and idle).
    let mut c2 = ControlConn::connect(srv.control());
    let r = c2.ok(r#"{"v":1,"op":"list"}"#);
    assert_eq!(r.at("devices").arr().len(), 1);
    // Two requests in one write: two replies, in order.
    c2.send_raw(b"{\"v\":1,\"op\":\"status\",\"name\":\"raw\"}\n{\"v\":1,\"op\":\"bogus\"}\n");
    let r1 = c2.read_reply();
    assert_eq!(r1.at("result").at("name").str(), "raw", "{r1:?}");
    assert_eq!(r1.at("result").at("in_flight").u64(), 0);
    let r2 = c2.read_reply();
    assert_reply_error(&r2, "bad_request", "bogus op");

    let r = c.ok(r#"{"v":1,"op":"set","name":"raw","size_limit":1048576}"#);
    assert!(r.at("changed").bool());
    assert_eq!(r.at("size").u64(), MIB);
    let r = c.ok(r#"{"v":1,"op":"resize","name":"raw"}"#);
    assert!(!r.at("changed").bool());
    let r = c.ok(r#"{"v":1,"op":"detach","name":"raw"}"#);
    assert_eq!(r.at("name").str(), "raw");
    c.err(r#"{"v":1,"op":"detach","name":"raw"}"#, "not_found");
    assert!(srv.list_json().is_empty());
}

// ---------------------------------------------------------------------------
// Isolation
// ---------------------------------------------------------------------------

/// Reconfiguring one device (`set --size-limit`, `set --read-only`) again and
/// again while another device is under fio load does not stall the loaded
/// device, and each `set` holds only its own device briefly.
#[test]
fn set_on_one_device_does_not_stall_another() {
    require_tool("fio");
    let dir = tempdir();
    let srv = Server::daemon().start();
    let loaded = dir.path().join("loaded.img");
    let other = dir.path().join("other.img");
    create_sparse_image(&loaded, 64 * MIB);
    create_sparse_image(&other, 16 * MIB);
    srv.ctl_ok(&["attach", path_str(&loaded)]);
    srv.ctl_ok(&["attach", path_str(&other)]);
    // A client on the reconfigured device too, so its freezes are real.
    let (mut oc, _, _) = RawClient::handshake(srv.socket(), "other");

    let fio_uri = uri(&srv, "loaded");
    let fio = thread::spawn(move || {
        let args: Vec<String> = vec![
            "--name=load".into(),
            "--ioengine=nbd".into(),
            format!("--uri={fio_uri}"),
            "--rw=randrw".into(),
            "--bs=4k".into(),
            "--iodepth=8".into(),
            "--size=64M".into(),
            "--time_based".into(),
            "--runtime=3".into(),
            "--output-format=json".into(),
        ];
        run_status("fio", &args)
    });

    // Wait until fio is connected, then reconfigure `other` until fio ends.
    srv.wait_clients("loaded", 1, Duration::from_secs(10));
    let mut sets = Vec::new();
    let mut i = 0u64;
    while !fio.is_finished() {
        let args: Vec<String> = match i % 4 {
            0 => vec!["--size-limit".into(), "8M".into()],
            1 => vec!["--read-only".into(), "true".into()],
            2 => vec!["--size-limit".into(), "12M".into()],
            _ => vec!["--read-only".into(), "false".into()],
        };
        // `other` has a reading client: shrinking and read-only on need --force.
        let mut a = vec!["set", "other", "--json", "--force"];
        a.extend(args.iter().map(String::as_str));
        let t = Instant::now();
        let out = srv.ctl_ok(&a);
        let wall = t.elapsed();
        let r = Json::parse(&out.stdout);
        assert!(
            r.at("changed").bool(),
            "set {args:?} changed nothing: {r:?}"
        );
        sets.push((args, r.at("quiesced_us").u64(), wall));
        // The other device's client still works between changes.
        let off = (i % 16) * 4096;
        oc.read(i, off, 4096);
        i += 1;
    }
    let out = fio.join().unwrap();
    assert!(out.success(), "fio failed:\n{out}");
    let doc = Json::parse_first_object(&out.stdout);
    let job = &doc.at("jobs").arr()[0];
    assert_eq!(job.at("error").i64(), 0, "fio job error:\n{out}");

    let max_q = sets.iter().map(|s| s.1).max().unwrap_or(0);
    let max_wall = sets.iter().map(|s| s.2).max().unwrap_or_default();
    eprintln!(
        "isolation: {} sets on `other`, max quiesced {max_q} µs, max command time {max_wall:?}; \
         fio max latency read {:.2} ms, write {:.2} ms",
        sets.len(),
        job.at("read").at("lat_ns").at("max").f64() / 1e6,
        job.at("write").at("lat_ns").at("max").f64() / 1e6,
    );
    assert!(
        sets.len() >= 8,
        "only {} set commands ran during the fio run",
        sets.len()
    );
    for (args, q, wall) in &sets {
        assert!(
            *q < 200_000,
            "set {args:?} held its device for {q} µs (all: {sets:?})"
        );
        assert!(
            *wall < Duration::from_secs(2),
            "set {args:?} took {wall:?} (all: {sets:?})"
        );
    }
    for dir in ["read", "write"] {
        let d = job.at(dir);
        assert!(
            d.at("io_bytes").u64() > 0,
            "fio did no {dir}s on the loaded device:\n{out}"
        );
        let max_ns = d.at("lat_ns").at("max").f64();
        assert!(
            max_ns < 1e9,
            "a {dir} on the loaded device took {:.1} ms while the other device was reconfigured",
            max_ns / 1e6
        );
    }
    let st = srv.ctl_json(&["status", "loaded"]);
    match st.at("errors") {
        Json::Object(m) => {
            for (k, v) in m {
                assert_eq!(v.u64(), 0, "loaded device had {k} errors");
            }
        }
        other => panic!("errors: {other:?}"),
    }
    drop(oc);
    // The reconfigured device ended in the last configuration asked for.
    let d = srv.device("other").unwrap();
    let last_size = if (i - 1) % 4 >= 2 { 12 * MIB } else { 8 * MIB };
    let last_ro = matches!((i - 1) % 4, 1 | 2);
    assert_eq!(d.at("size").u64(), last_size, "{d:?}");
    assert_eq!(d.at("read_only").bool(), last_ro, "{d:?}");
}
