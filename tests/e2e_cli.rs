//! The command line as scripts use it: closed pipes, errors as JSON with
//! their exit statuses, URIs for names and paths with spaces, losetup and
//! qemu-nbd spellings, sizes with suffixes, `set` rules and `resize` messages.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Runs `sh -c SCRIPT` with `$LOOPD` and `$CTL` set; returns its output.
fn sh(srv: &Server, dir: &std::path::Path, script: &str) -> Out {
    let mut c = Command::new("sh");
    c.current_dir(dir)
        .arg("-c")
        .arg(script)
        .env("LOOPD", loopd_bin())
        .env("CTL", srv.control())
        .env_remove("LOOPD_CONTROL")
        .stdin(Stdio::null());
    run_cmd_timeout(c, Duration::from_secs(60))
}

/// A daemon with `n` small devices attached (named d0, d1, ...).
fn daemon_with_devices(dir: &std::path::Path, n: usize) -> Server {
    let srv = Server::daemon().start();
    for i in 0..n {
        let img = dir.join(format!("d{i}.img"));
        create_sparse_image(&img, MIB);
        srv.ctl_ok(&["attach", path_str(&img)]);
    }
    srv
}

/// `loopd list | head -1` and `loopd status | true`: the reader goes away
/// early; loopd ends quietly (no panic, no "Broken pipe" message), killed by
/// SIGPIPE like other Unix tools.
#[test]
fn closed_pipe_ends_quietly() {
    let dir = tempdir();
    let srv = daemon_with_devices(dir.path(), 40);
    let out = sh(
        &srv,
        dir.path(),
        r#"for i in 1 2 3 4 5; do
             "$LOOPD" list --control "$CTL" | head -1 >/dev/null
           done
           "$LOOPD" list --control "$CTL" | true
           "$LOOPD" status d0 --control "$CTL" | true
           "$LOOPD" list --json --control "$CTL" | head -c 1 >/dev/null
           "$LOOPD" --help | head -1 >/dev/null
           echo done"#,
    );
    assert!(out.success(), "{out}");
    assert!(out.stdout.contains("done"), "{out}");
    for bad in ["panicked", "Broken pipe", "error"] {
        assert!(
            !out.stderr.contains(bad),
            "loopd complained ({bad}):\n{out}"
        );
    }
    // The exit status of loopd itself: killed by SIGPIPE (128+13) or 0 if it
    // finished writing before the reader left; never 101 (a panic).
    let out = sh(
        &srv,
        dir.path(),
        r#"mkfifo p; ( "$LOOPD" list --control "$CTL"; echo "rc=$?" >rc ) >p &
           head -c 1 <p >/dev/null; wait; cat rc"#,
    );
    let rc = out.stdout.trim();
    assert!(rc == "rc=141" || rc == "rc=0", "{out}");
}

/// Every client command failure under `--json` is one JSON object on stdout
/// with the control protocol's code, and the exit status is the documented
/// one for that code.
#[test]
fn json_errors_and_exit_statuses() {
    let dir = tempdir();
    let srv = daemon_with_devices(dir.path(), 1);
    let cases: &[(&[&str], &str)] = &[
        (&["status", "nope"], "not_found"),
        (&["detach", "nope"], "not_found"),
        (&["resize", "nope"], "not_found"),
        (&["set", "nope", "--size-limit", "1M"], "not_found"),
        (
            &[
                "attach",
                &format!("{}/d0.img", dir.path().display()),
                "--name",
                "d0",
                "--shared",
            ],
            "name_taken",
        ),
        (&["set", "d0", "--block-size", "3000"], "invalid"),
        (&["attach", "/nonexistent/x.img"], "io"),
        (&["list", "--bogus"], "usage"),
        (&["set", "d0", "--size-limit", "1.5"], "usage"),
    ];
    for (args, code) in cases {
        let out = srv.ctl(args);
        if *code == "usage" {
            // clap's own message; the status is the usage one.
            assert_eq!(out.status.code(), Some(2), "{args:?}:\n{out}");
        } else {
            assert_ctl_error(&out, code);
        }
        let mut a = args.to_vec();
        a.push("--json");
        let out = srv.ctl(&a);
        assert_eq!(
            out.status.code(),
            Some(exit_status_for(code)),
            "{args:?} --json:\n{out}"
        );
        let j = Json::parse(&out.stdout);
        assert_eq!(j.at("error").at("code").str(), *code, "{args:?}:\n{out}");
        assert!(
            !j.at("error").at("message").str().is_empty(),
            "{args:?}:\n{out}"
        );
    }

    // busy: a client is connected and detach needs --force.
    let (c, _, _) = RawClient::handshake(srv.socket(), "d0");
    srv.wait_clients("d0", 1, Duration::from_secs(10));
    let out = srv.ctl(&["detach", "d0", "--json"]);
    assert_eq!(out.status.code(), Some(exit_status_for("busy")), "{out}");
    assert_eq!(
        Json::parse(&out.stdout).at("error").at("code").str(),
        "busy",
        "{out}"
    );
    drop(c);

    // The daemon is not running: its own code and status.
    let gone = dir.path().join("gone.ctl");
    let out = loopd_ctl(&gone, &["list", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(exit_status_for("not_running")),
        "{out}"
    );
    assert_eq!(
        Json::parse(&out.stdout).at("error").at("code").str(),
        "not_running",
        "{out}"
    );
    assert_ctl_error(&loopd_ctl(&gone, &["status", "x"]), "not_running");

    // Success under --json: detach and reload-tls print JSON too.
    let j = srv.ctl_json(&["detach", "d0"]);
    assert_eq!(j.at("name").str(), "d0");
}

/// `loopd --help` shows the exit status table and LOOPD_LOG; the
/// `--reactors` default is shown once.
#[test]
fn help_documents_exit_statuses() {
    let out = loopd_run(["--help"]);
    for s in [
        "Exit status:",
        "4  no such device, or no such RBD pool, image or snapshot (not_found)",
        "3  the daemon is not running",
        "LOOPD_LOG",
    ] {
        assert!(out.stdout.contains(s), "{s:?} missing:\n{out}");
    }
    let out = loopd_run(["serve", "--help"]);
    let reactors: Vec<&str> = out
        .stdout
        .split("--reactors")
        .nth(1)
        .and_then(|s| s.split("\n\n").next())
        .into_iter()
        .collect();
    let text = reactors.join("");
    assert_eq!(text.matches("default").count(), 1, "{text}");
}

/// Names, images and socket paths with spaces: the printed URIs are
/// percent-encoded and nbdinfo opens them.
#[test]
fn uris_with_spaces_work() {
    let dir = tempdir();
    let sockdir = dir.path().join("with space");
    std::fs::create_dir(&sockdir).expect("mkdir");
    let sock = sockdir.join("loopd.sock");
    let srv = Server::daemon().socket_path(&sock).start();
    let img = dir.path().join("my disk.img");
    create_sparse_image(&img, 3 * MIB);
    let enc_sock = format!("{}/with%20space/loopd.sock", dir.path().display());

    // The name from the file stem: `my disk`.
    let out = srv.ctl_ok(&["attach", path_str(&img), "--shared"]);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], "my disk", "{out}");
    let want = format!("nbd+unix:///my%20disk?socket={enc_sock}");
    assert!(lines.contains(&want.as_str()), "want {want}:\n{out}");
    assert_eq!(nbd_size(&want), 3 * MIB);

    // An explicit name with a space, and one with URI delimiters.
    for (name, enc) in [("a b", "a%20b"), ("x#z&1%", "x%23z%261%25")] {
        let j = srv.ctl_json(&["attach", path_str(&img), "--shared", "--name", name]);
        let want = format!("nbd+unix:///{enc}?socket={enc_sock}");
        let uris: Vec<&str> = j.at("uris").arr().iter().map(Json::str).collect();
        assert_eq!(uris, vec![want.as_str()], "{j:?}");
        assert_eq!(nbd_size(&want), 3 * MIB, "{name}");
        let out = run("nbdinfo", ["--json", &want]);
        let info = Json::parse_first_object(&out.stdout);
        assert_eq!(info.at("exports").arr()[0].at("export-name").str(), name);
    }
    // The status output carries the same URIs.
    let j = srv.ctl_json(&["status", "a b"]);
    assert_eq!(
        j.at("uris").arr()[0].str(),
        format!("nbd+unix:///a%20b?socket={enc_sock}")
    );
}

/// losetup and qemu-nbd spellings and suffixed sizes: `-o`, `-r`, `-b 4k`,
/// `-f raw`, `-x NAME`, `--sizelimit 1.5M`; `1.5` and `1.1K` bytes refused.
#[test]
fn short_options_and_sizes() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("s.img");
    create_pattern_image(&img, 4 * MIB, 3);
    let j = srv.ctl_json(&[
        "attach",
        path_str(&img),
        "-x",
        "short",
        "-o",
        "0.5M",
        "--sizelimit",
        "1.5M",
        "-b",
        "4k",
        "-r",
        "-f",
        "raw",
    ]);
    assert_eq!(j.at("name").str(), "short");
    assert_eq!(j.at("offset").u64(), MIB / 2);
    assert_eq!(j.at("size").u64(), 3 * MIB / 2);
    assert_eq!(j.at("block_size").u64(), 4096);
    assert!(j.at("read_only").bool(), "{j:?}");
    let u = srv.uri_for_name("short");
    assert_eq!(nbd_size(&u), 3 * MIB / 2);
    assert!(nbd_info(&u).at("is_read_only").bool());
    // qemu-nbd's long spelling of -x.
    let j = srv.ctl_json(&[
        "attach",
        path_str(&img),
        "--export-name",
        "long",
        "--shared",
        "-r",
    ]);
    assert_eq!(j.at("name").str(), "long");
    for bad in ["1.5", "1.1K", "1.5X"] {
        let out = srv.ctl(&["set", "short", "--size-limit", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}: {out}");
        assert!(out.stderr.contains(bad), "{out}");
    }
    srv.ctl_json(&[
        "set",
        "short",
        "--sector-size",
        "512",
        "--sizelimit",
        "2.5M",
    ]);
    assert_eq!(nbd_size(&u), 5 * MIB / 2);
}

/// `set` rules: shrinking and read-only on need --force with a client
/// connected (growing does not); `--size-limit none` removes the limit;
/// `set` and `resize` say when the limit caps the file.
#[test]
fn set_rules_size_limit_none_and_cap_message() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("c.img");
    create_sparse_image(&img, 2 * MIB);
    srv.ctl_ok(&[
        "attach",
        path_str(&img),
        "--name",
        "c",
        "--size-limit",
        "1M",
    ]);
    let u = srv.uri_for_name("c");

    // The limit caps the file: said in text and JSON.
    let out = srv.ctl_ok(&["resize", "c"]);
    assert!(
        out.stdout
            .contains("c: size limit 1 MiB (1048576 bytes) caps the file's 2 MiB (2097152 bytes)"),
        "{out}"
    );
    let j = srv.ctl_json(&["resize", "c"]);
    assert!(j.at("capped_by_size_limit").bool(), "{j:?}");
    assert_eq!(j.at("file_size").u64(), 2 * MIB);

    let (c, _, _) = RawClient::handshake(srv.socket(), "c");
    srv.wait_clients("c", 1, Duration::from_secs(10));
    let out = srv.ctl_err(&["set", "c", "--size-limit", "512K"], "busy");
    assert!(out.stderr.contains("--force"), "{out}");
    srv.ctl_err(&["set", "c", "-r"], "busy");
    assert_eq!(nbd_size(&u), MIB, "refused changes changed nothing");
    // Growing is safe: removing the limit gives the whole file.
    let j = srv.ctl_json(&["set", "c", "--size-limit", "none"]);
    assert!(j.at("changed").bool(), "{j:?}");
    assert!(j.at("size_limit").is_null(), "{j:?}");
    assert!(!j.at("capped_by_size_limit").bool(), "{j:?}");
    assert_eq!(nbd_size(&u), 2 * MIB);
    let out = srv.ctl_ok(&["set", "c", "--size-limit", "1M", "--force"]);
    assert!(
        out.stdout.contains("caps the file's 2 MiB (2097152 bytes)"),
        "{out}"
    );
    srv.ctl_ok(&["set", "c", "--read-only", "true", "--force"]);
    assert!(nbd_info(&u).at("is_read_only").bool());
    drop(c);

    // The raw protocol: `"size_limit": null` removes the limit; absent keeps it.
    let mut conn = ControlConn::connect(srv.control());
    conn.ok(r#"{"v":1,"op":"set","name":"c","read_only":false}"#);
    assert_eq!(nbd_size(&u), MIB);
    conn.ok(r#"{"v":1,"op":"set","name":"c","size_limit":null}"#);
    assert_eq!(nbd_size(&u), 2 * MIB);
}

/// An image that cannot be opened for writing (mode 0444 for a normal user;
/// a read-only bind mount for root, whom modes do not stop) is served
/// read-only with a notice, instead of failing with EACCES/EROFS.
#[test]
fn write_protected_image_gives_a_read_only_device() {
    let dir = tempdir();
    let img = dir.path().join("ro.img");
    create_pattern_image(&img, MIB, 9);
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let mut _mount = None;
    let served = if root {
        let (mnt, guard) = read_only_bind(dir.path());
        _mount = Some(guard);
        mnt.join("ro.img")
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o444)).expect("chmod");
        img.clone()
    };
    let srv = Server::daemon().start();
    let out = srv.ctl_ok(&["attach", path_str(&served), "--name", "ro"]);
    assert!(out.stderr.contains("write-protected"), "{out}");
    let j = srv.ctl_json(&["status", "ro"]);
    assert!(
        j.at("read_only").bool() && j.at("write_protected").bool(),
        "{j:?}"
    );
    let u = srv.uri_for_name("ro");
    assert!(nbd_info(&u).at("is_read_only").bool());
    let (mut c, _, _) = RawClient::handshake(srv.socket(), "ro");
    assert_bytes_eq(&c.read(1, 0, 4096), &pattern_bytes(9, 0, 4096), 0, "read");
    assert_eq!(
        c.write(2, 0, &[0u8; 512]),
        1,
        "EPERM on a write-protected image"
    );
    drop(c);
    // Asking for read-only is not "write-protected".
    let j = srv.ctl_json(&[
        "attach",
        path_str(&served),
        "--name",
        "ro2",
        "-r",
        "--shared",
    ]);
    assert!(
        j.at("read_only").bool() && !j.at("write_protected").bool(),
        "{j:?}"
    );
    drop(srv);
}

/// Issue 22 point 14. A device `serve IMAGE` (or `serve --config`) cannot set
/// up ends with the code and exit status `attach` gives for the same device:
/// an unaligned offset, a bad block size and an offset past the end are
/// `invalid` (7), a missing image `io` (1), an image another server writes
/// `busy` (5); with `--fork` the parent exits with the same status.
#[test]
fn serve_start_errors_have_the_attach_codes() {
    let dir = tempdir();
    let img = dir.path().join("s.img");
    create_sparse_image(&img, MIB);
    let locked = dir.path().join("locked.img");
    create_sparse_image(&locked, MIB);
    let _holder = Server::builder(&locked).start();
    let daemon = Server::daemon().start();
    let missing = dir.path().join("nope.img");
    let cases: [(&str, &Path, &[&str], &str, &str); 5] = [
        (
            "offset 100",
            &img,
            &["--offset", "100"],
            "invalid",
            "offset 100 is not a multiple of the block size",
        ),
        (
            "block size 1000",
            &img,
            &["--block-size", "1000"],
            "invalid",
            "block size 1000 is not a power of two",
        ),
        (
            "offset past the end",
            &img,
            &["--offset", "2M"],
            "invalid",
            "is beyond the end of",
        ),
        ("missing image", &missing, &[], "io", "nope.img"),
        ("locked image", &locked, &[], "busy", "is in use"),
    ];
    for (i, (what, image, args, code, words)) in cases.iter().enumerate() {
        let attach = daemon.ctl(&[&["attach", path_str(image)][..], args].concat());
        assert_ctl_error(&attach, code);
        let sock = dir.path().join(format!("s{i}.sock"));
        let mut c = Command::new(loopd_bin());
        c.arg("serve")
            .arg(image)
            .arg("--socket")
            .arg(&sock)
            .arg("--state")
            .arg(sock.with_extension("state"))
            .args(*args)
            .stdin(Stdio::null());
        let out = run_cmd_timeout(c, Duration::from_secs(20));
        assert_ctl_error(&out, code);
        assert!(out.stderr.contains(words), "{what}:\n{out}");
        assert!(!sock.exists(), "{what}: socket left behind");
    }
    // Through --fork: the parent exits with the daemon's status.
    let sock = dir.path().join("f.sock");
    let mut c = Command::new(loopd_bin());
    c.arg("serve")
        .arg(&img)
        .arg("--socket")
        .arg(&sock)
        .arg("--state")
        .arg(sock.with_extension("state"))
        .args(["--offset", "100", "--fork"])
        .stdin(Stdio::null());
    let out = run_cmd_timeout(c, Duration::from_secs(20));
    assert_ctl_error(&out, "invalid");
    assert!(out.stderr.contains("offset 100 is not a multiple"), "{out}");
}
