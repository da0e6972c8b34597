//! Issue 27 point 5: the facts the command line prints are fresh and clear.
//! The file's size is read when it is shown; a size limit says which part
//! of the file it caps; sizes have a human form (`--bytes` for scripts); no
//! limit is one word; a `set` that changes nothing says why; config errors
//! say where; a reload keeps the OS error and says what it changed; devices
//! come in natural order; a `--json` usage error names the argument.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

fn grow(img: &Path, size: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(img)
        .and_then(|f| f.set_len(size))
        .expect("grow the image");
}

/// The file grows behind the device's back: `set` (changing nothing),
/// `resize` and `status` give its size now, not the size it had.
#[test]
fn the_files_size_is_read_when_shown() {
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
    grow(&img, 4 * MIB);

    let out = srv.ctl_ok(&["set", "c", "--read-only", "false"]);
    assert!(
        out.stdout.contains(
            "c: size limit 1 MiB (1048576 bytes) caps the file's 4 MiB (4194304 bytes)\n"
        ),
        "{out}"
    );
    let j = srv.ctl_json(&["set", "c", "--read-only", "false"]);
    assert_eq!(j.at("file_size").u64(), 4 * MIB, "{j:?}");
    let j = srv.ctl_json(&["status", "c"]);
    assert_eq!(j.at("file_size").u64(), 4 * MIB, "{j:?}");
    let out = srv.ctl_ok(&["status", "c"]);
    assert!(
        out.stdout.contains("file_size: 4 MiB (4194304 bytes)\n"),
        "{out}"
    );

    grow(&img, 6 * MIB);
    let j = srv.ctl_json(&["resize", "c"]);
    assert_eq!(j.at("file_size").u64(), 6 * MIB, "{j:?}");
    assert_eq!(
        srv.ctl_json(&["status", "c"]).at("file_size").u64(),
        6 * MIB
    );
}

/// "The file's 1535 MiB" meant the part after the offset, in a unit of its
/// own: the message names the part, every size follows one unit rule with
/// its bytes, and `--bytes` gives plain counts.
#[test]
fn a_cap_names_the_part_after_the_offset_in_one_unit_rule() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("o.img");
    create_sparse_image(&img, 2 * MIB);
    srv.ctl_ok(&[
        "attach",
        path_str(&img),
        "--name",
        "o",
        "--offset",
        "512K",
        "--size-limit",
        "1M",
    ]);
    let out = srv.ctl_ok(&["resize", "o"]);
    assert!(
        out.stdout.contains(
            "o: size limit 1 MiB (1048576 bytes) caps the 1.5 MiB (1572864 bytes) of the file \
             after offset 512 KiB (524288 bytes) (the file is 2 MiB (2097152 bytes))"
        ),
        "{out}"
    );
    let out = srv.ctl_ok(&["resize", "o", "--bytes"]);
    assert!(
        out.stdout.contains(
            "o: size limit 1048576 bytes caps the 1572864 bytes of the file after offset \
             524288 bytes (the file is 2097152 bytes)"
        ),
        "{out}"
    );
    let out = srv.ctl_ok(&["set", "o", "--size-limit", "1.25M"]);
    assert!(
        out.stdout
            .contains("size 1.3 MiB (1310720 bytes), offset 512 KiB (524288 bytes)"),
        "{out}"
    );
}

/// Sizes in `list` and `status` have a human form, `--bytes` gives bytes,
/// JSON keeps bytes; no size limit is `none` in every text form and `null`
/// in JSON.
#[test]
fn sizes_are_human_with_bytes_for_scripts_and_no_limit_is_one_word() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("h.img");
    create_sparse_image(&img, 64 * MIB);
    srv.ctl_ok(&["attach", path_str(&img), "--name", "h"]);
    srv.ctl_ok(&[
        "attach",
        path_str(&img),
        "--name",
        "l",
        "--size-limit",
        "1.5G",
        "--shared",
    ]);
    let row = |args: &[&str], name: &str| -> Vec<String> {
        let out = srv.ctl_ok(args);
        out.stdout
            .lines()
            .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .find(|r| r[0] == name)
            .unwrap_or_else(|| panic!("no row {name}:\n{out}"))
    };
    // NAME SIZE OFFSET SIZELIMIT ...
    assert_eq!(&row(&["list"], "h")[1..4], ["64M", "0B", "none"]);
    assert_eq!(&row(&["list"], "l")[1..4], ["1.5G", "0B", "1.5G"]);
    assert_eq!(
        &row(&["list", "--bytes"], "h")[1..4],
        ["67108864", "0", "none"]
    );
    let text = srv.ctl_ok(&["status", "h"]).stdout;
    for line in [
        "size: 64 MiB (67108864 bytes)\n",
        "offset: 0 bytes\n",
        "size_limit: none\n",
    ] {
        assert!(text.contains(line), "{line:?} missing:\n{text}");
    }
    let text = srv.ctl_ok(&["status", "h", "--bytes"]).stdout;
    for line in ["size: 67108864\n", "offset: 0\n", "size_limit: none\n"] {
        assert!(text.contains(line), "{line:?} missing:\n{text}");
    }
    let j = srv.ctl_json(&["status", "h"]);
    assert!(j.at("size_limit").is_null(), "{j:?}");
    assert_eq!(j.at("size").u64(), 64 * MIB);
    let j = srv.ctl_json(&["list"]);
    assert!(j.arr()[0].at("size_limit").is_null(), "{j:?}");
}

/// Devices come in the order people count: new1 new2 new10, in `list`,
/// `status`, their JSON and the NBD export list.
#[test]
fn devices_are_listed_in_natural_order() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("n.img");
    create_sparse_image(&img, MIB);
    for n in ["new10", "new2", "new1"] {
        srv.ctl_ok(&["attach", path_str(&img), "--name", n, "--shared"]);
    }
    let want = ["new1", "new2", "new10"];
    assert_eq!(srv.device_names(), want);
    let names = |args: &[&str]| -> Vec<String> {
        srv.ctl_ok(args)
            .stdout
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect()
    };
    assert_eq!(names(&["list"]), want);
    assert_eq!(names(&["status"]), want);
    let j = srv.ctl_json(&["status"]);
    let got: Vec<&str> = j.arr().iter().map(|d| d.at("name").str()).collect();
    assert_eq!(got, want);
    // NBD clients listing the exports (NBD_OPT_LIST) see the same order.
    let uri = format!("nbd+unix:///?socket={}", srv.socket().display());
    let out = run("nbdinfo", ["--list", "--json", &uri]);
    let info = Json::parse_first_object(&out.stdout);
    let got: Vec<&str> = info
        .at("exports")
        .arr()
        .iter()
        .map(|e| e.at("export-name").str())
        .collect();
    assert_eq!(got, want, "{out}");
}

/// `set -r false` on a write-protected image changes nothing, and says why.
#[test]
fn a_set_that_changes_nothing_says_why() {
    let dir = tempdir();
    let img = dir.path().join("ro.img");
    create_sparse_image(&img, MIB);
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
    srv.ctl_ok(&["attach", path_str(&served), "--name", "ro"]);
    let out = srv.ctl_ok(&["set", "ro", "-r", "false"]);
    assert!(
        out.stdout.starts_with("ro: nothing to change: ")
            && out.stdout.contains("ro.img\" is write-protected")
            && out.stdout.contains("so the device stays read-only"),
        "{out}"
    );
    let j = srv.ctl_json(&["set", "ro", "-r", "false"]);
    assert!(j.at("note").str().contains("stays read-only"), "{j:?}");
    // Any other no-op says the device is already so.
    let out = srv.ctl_ok(&["set", "ro", "--cache", "auto"]);
    assert_eq!(
        out.stdout.trim(),
        "ro: nothing to change: the device already has these settings",
        "{out}"
    );
    drop(srv);
}

/// A daemon serving `cfg`, its control socket.
fn serve_config(cfg: &Path) -> Server {
    Server::daemon().arg("--config").arg(cfg).start()
}

const BAD: &str = "[[device]]\nimage = \"a.img\"\n\n[[device]]\nname = \"c1\"\nimage = \"b.img\"\nsise_limit = \"1M\"\n";
const WHERE: &str =
    "line 7, column 1, in the [[device]] table 2 (\"c1\"): unknown field `sise_limit`";

/// A config error names the file, the line, the column and the device
/// table, at start and on reload.
#[test]
fn config_errors_say_where() {
    let dir = tempdir();
    for n in ["a", "b"] {
        create_sparse_image(&dir.path().join(format!("{n}.img")), MIB);
    }
    let cfg = dir.path().join("devices.toml");
    std::fs::write(&cfg, BAD).unwrap();
    let sock = dir.path().join("s.sock");
    let mut c = Command::new(loopd_bin());
    c.arg("serve")
        .arg("--socket")
        .arg(&sock)
        .arg("--state")
        .arg(dir.path().join("s.state"))
        .arg("--config")
        .arg(&cfg)
        .stdin(Stdio::null());
    let out = run_cmd_timeout(c, Duration::from_secs(20));
    assert_ctl_error(&out, "invalid");
    assert!(out.stderr.contains("devices.toml"), "{out}");
    assert!(out.stderr.contains(WHERE), "{out}");

    std::fs::write(&cfg, "[[device]]\nimage = \"a.img\"\n").unwrap();
    let srv = serve_config(&cfg);
    std::fs::write(&cfg, BAD).unwrap();
    let out = srv.ctl(&["reload"]);
    assert_ctl_error(&out, "invalid");
    assert!(out.stderr.contains(WHERE), "{out}");
    assert!(out.stderr.contains("nothing changed"), "{out}");
}

/// A reload says what it changed, field by field; a device it cannot attach
/// is reported with the OS error, once.
#[test]
fn a_reload_says_what_changed_and_keeps_the_os_error() {
    let dir = tempdir();
    create_sparse_image(&dir.path().join("a.img"), 2 * MIB);
    let cfg = dir.path().join("devices.toml");
    std::fs::write(
        &cfg,
        "[[device]]\nname = \"c1\"\nimage = \"a.img\"\nsize_limit = \"1M\"\ncache = \"auto\"\n",
    )
    .unwrap();
    let srv = serve_config(&cfg);
    std::fs::write(
        &cfg,
        "[[device]]\nname = \"c1\"\nimage = \"a.img\"\ncache = \"buffered\"\n\n\
         [[device]]\nname = \"gone\"\nimage = \"gone.img\"\n",
    )
    .unwrap();
    let out = srv.ctl(&["reload"]);
    assert!(
        out.stdout.contains(
            "changed: c1: size-limit 1 MiB (1048576 bytes) → none, cache auto → buffered\n"
        ),
        "{out}"
    );
    let failed = out
        .stdout
        .lines()
        .find(|l| l.starts_with("failed: gone: "))
        .unwrap_or_else(|| panic!("no failed line:\n{out}"));
    assert_eq!(failed.matches("(os error 2)").count(), 1, "{out}");
    assert_eq!(loopd::text::repeated_cause(failed), None, "{failed}");

    std::fs::write(
        &cfg,
        "[[device]]\nname = \"c1\"\nimage = \"a.img\"\ncache = \"buffered\"\nsize_limit = \"1M\"\n",
    )
    .unwrap();
    let out = srv.ctl(&["reload", "--json"]);
    let j = Json::parse(&out.stdout);
    let f = &j.at("changes").arr()[0];
    assert_eq!(f.at("name").str(), "c1", "{out}");
    let field = &f.at("fields").arr()[0];
    assert_eq!(field.at("field").str(), "size_limit", "{out}");
    assert!(field.at("from").is_null(), "{out}");
    assert_eq!(field.at("to").u64(), MIB, "{out}");
}

/// A usage error under `--json` names the missing argument, as the text does.
#[test]
fn json_usage_errors_name_the_argument() {
    // `detach` takes several names: clap writes its argument `<NAME>...`.
    for (args, want) in [
        (&["set", "--json"][..], "<NAME>"),
        (&["detach", "--json"], "<NAME>..."),
    ] {
        let out = loopd_run(args);
        assert_eq!(out.status.code(), Some(2), "{out}");
        let j = Json::parse(&out.stdout);
        let e = j.at("error");
        assert_eq!(e.at("code").str(), "usage", "{out}");
        assert!(e.at("message").str().contains("<NAME>"), "{out}");
        assert_eq!(e.at("argument").str(), want, "{out}");
        assert!(out.stderr.contains("<NAME>"), "{out}");
    }
}
