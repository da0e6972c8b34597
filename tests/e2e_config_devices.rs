//! Issue 27 point 7: a device of `--config` that cannot be attached (a missing
//! image, an image another device holds) does not stop the start, as it does
//! not stop a reload or the state file's restore: the server serves the
//! others, lists it `missing` with the reason and retries it; a device dropped
//! from the config is named by the reload with what becomes of it (attached
//! until the server stops, not at the next start), which a restart confirms.

mod common;

use common::*;
use std::path::Path;
use std::time::{Duration, Instant};

fn write_config(cfg: &Path, devices: &[(&str, &str)]) {
    let text: String = devices
        .iter()
        .map(|(image, name)| format!("[[device]]\nimage = \"{image}\"\nname = \"{name}\"\n\n"))
        .collect();
    std::fs::write(cfg, text).expect("write config");
}

#[test]
fn a_config_device_that_cannot_be_attached_does_not_stop_the_start() {
    let dir = tempdir();
    let a = dir.path().join("a.img");
    create_filled_image(&a, MIB, 0x5a);
    let cfg = dir.path().join("devices.toml");
    // b: its image does not exist; c: a's image, which device a holds.
    write_config(&cfg, &[("a.img", "a"), ("b.img", "b"), ("a.img", "c")]);
    let srv = Server::daemon().arg("--config").arg(&cfg).start();

    // The good device serves.
    let out = qemu_io(&srv.uri_for_name("a"), &["read -P 0x5a 0 1M"]);
    assert!(out.stdout.contains("read 1048576/1048576"), "{out}");
    // The bad ones are listed missing, each with its reason.
    let b = srv.device("b").expect("b is listed");
    assert_eq!(b.at("state").str(), "missing", "{b:?}");
    assert!(
        b.at("reason").str().contains("No such file or directory"),
        "{b:?}"
    );
    let c = srv.ctl_json(&["status", "c"]);
    assert_eq!(c.at("state").str(), "missing", "{c:?}");
    assert!(!c.at("reason").str().is_empty(), "{c:?}");
    let list = srv.ctl_ok(&["list"]);
    let row = list
        .stdout
        .lines()
        .find(|l| l.starts_with("b "))
        .unwrap_or_else(|| panic!("no row for b:\n{list}"));
    assert!(row.contains("missing: cannot open: No such file"), "{row}");
    // One error line per bad device, naming the file, the device and why.
    let err = srv.stderr_text();
    for name in ["b", "c"] {
        let line = err
            .lines()
            .find(|l| l.contains(&format!("device \"{name}\": not attached:")))
            .unwrap_or_else(|| panic!("no error line for {name}:\n{err}"));
        assert!(line.contains("devices.toml"), "{line}");
        assert!(line.contains("the other devices are served"), "{line}");
    }
    assert!(err.contains("attached 1 of 3 device(s)"), "{err}");

    // The image appears: the retry brings b back.
    create_filled_image(&dir.path().join("b.img"), 2 * MIB, 0x11);
    let deadline = Instant::now() + Duration::from_secs(20);
    while srv
        .device("b")
        .is_none_or(|b| b.at("state").str() == "missing")
    {
        assert!(Instant::now() < deadline, "b did not come back");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(nbd_size(&srv.uri_for_name("b")), 2 * MIB);

    // c still fails: a reload says so (and exits non-zero); a detach forgets it.
    let out = srv.ctl(&["reload"]);
    assert!(!out.success(), "{out}");
    assert!(out.stdout.contains("failed: c:"), "{out}");
    // Its name stays taken while it is missing, saying why.
    let other = dir.path().join("other.img");
    create_sparse_image(&other, MIB);
    let out = srv.ctl_err(
        &["attach", other.to_str().expect("utf-8"), "--name", "c"],
        "name_taken",
    );
    assert!(out.stderr.contains("of --config is missing"), "{out}");
    srv.ctl_ok(&["detach", "c"]);
    assert!(srv.device("c").is_none(), "c is still listed");
}

#[test]
fn reload_names_a_device_dropped_from_the_config_and_what_becomes_of_it() {
    let dir = tempdir();
    for n in ["a", "b"] {
        create_sparse_image(&dir.path().join(format!("{n}.img")), MIB);
    }
    let cfg = dir.path().join("devices.toml");
    let state = dir.path().join("s.state");
    write_config(&cfg, &[("a.img", "a"), ("b.img", "b")]);
    let start = || {
        Server::daemon()
            .arg("--config")
            .arg(&cfg)
            .arg("--state")
            .arg(&state)
            .start()
    };
    let mut srv = start();
    write_config(&cfg, &[("a.img", "a")]);
    let out = srv.ctl_ok(&["reload"]);
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("kept"))
        .unwrap_or_else(|| panic!("no kept line:\n{out}"));
    assert!(
        line.contains("attached until the server stops, not at its next start"),
        "{line}"
    );
    assert!(line.ends_with(": b"), "{line}");
    let err = srv.stderr_text();
    assert!(
        err.contains(
            "device \"b\" is no longer in the config file; it stays attached until the \
             server stops: it is not attached again at the next start"
        ),
        "{err}"
    );
    // Still served now.
    assert_eq!(nbd_size(&srv.uri_for_name("b")), MIB);
    // And gone after a restart, as the reload said.
    srv.stop();
    let srv = start();
    assert_eq!(srv.device_names(), ["a"]);
}
