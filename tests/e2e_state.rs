//! The state file can neither destroy a file nor forget a device: a file that is
//! not a state file is refused (and left alone), one daemon per state file, a
//! damaged file keeps what it can and is saved aside, a device whose image is
//! missing waits for it, an attach the state file cannot record fails and leaves
//! no trace (a full tmpfs), a `--config`/state clash is logged, the file is 0600
//! whatever the umask, the default lives in /var/lib/loopd; plus the control
//! protocol's range and unknown-field errors.

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The device names a state file holds, by replaying its records.
fn state_names(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read state file {}: {e}", path.display()));
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some(r#"{"loopd_state":1}"#),
        "state file header: {text}"
    );
    let mut names: Vec<String> = Vec::new();
    for l in lines {
        let r = Json::parse(l);
        if let Some(p) = r.get("put") {
            let n = p.at("name").str().to_owned();
            if !names.contains(&n) {
                names.push(n);
            }
        } else {
            let n = r.at("del").str();
            names.retain(|x| x != n);
        }
    }
    names.sort();
    names
}

/// A `put` record line for device `name` on `image`.
fn put_line(name: &str, image: &Path) -> String {
    format!(
        "{{\"put\":{{\"image\":\"{}\",\"name\":\"{name}\",\"offset\":0,\"cache\":\"auto\",\"read_only\":false,\"autoclear\":false}}}}\n",
        image.display()
    )
}

/// `loopd serve --socket SOCK --state STATE ARGS` expected to fail quickly.
fn serve_fails(sock: &Path, state: &Path, args: &[&str]) -> Out {
    let mut c = Command::new(loopd_bin());
    c.arg("serve")
        .arg("--socket")
        .arg(sock)
        .arg("--state")
        .arg(state)
        .args(args);
    let out = run_cmd_timeout(c, Duration::from_secs(15));
    assert!(!out.success(), "serve must refuse to start:\n{out}");
    assert!(
        !sock.exists() && !sock.with_extension("ctl").exists(),
        "a refused daemon bound its sockets:\n{out}"
    );
    out
}

/// Polls `list --json` until `name` has `state` (or panics after `timeout`).
fn wait_state(srv: &Server, name: &str, state: &str, timeout: Duration) -> Json {
    let t = Instant::now();
    loop {
        if let Some(d) = srv.device(name) {
            if d.at("state").str() == state {
                return d;
            }
        }
        assert!(
            t.elapsed() < timeout,
            "device {name:?} not {state} after {timeout:?}: {:?}",
            srv.list_json()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A `--state` naming a disk image (a mistyped path) makes the daemon refuse
/// to start, naming the file; the file is unchanged byte for byte.
#[test]
fn foreign_file_as_state_is_refused_and_untouched() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    let bytes: Vec<u8> = (0..256 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(&img, &bytes).unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "shopping list\n").unwrap();
    for f in [&img, &text] {
        let sock = dir.path().join("s.sock");
        let out = serve_fails(&sock, f, &[]);
        assert!(
            out.stderr
                .contains(&format!("{} is not a loopd state file", f.display())),
            "the refusal names the file:\n{out}"
        );
    }
    assert_eq!(std::fs::read(&img).unwrap(), bytes, "disk image changed");
    assert_eq!(std::fs::read_to_string(&text).unwrap(), "shopping list\n");
}

/// A second daemon on the same state file refuses to start, naming the file and
/// the first daemon's pid; the first keeps working and its next attach
/// survives `kill -9` + restart.
#[test]
fn second_daemon_on_the_same_state_is_refused() {
    let dir = tempdir();
    let state = dir.path().join("devs.state");
    let sock = dir.path().join("a.sock");
    let img = dir.path().join("one.img");
    let img2 = dir.path().join("two.img");
    create_sparse_image(&img, MIB);
    create_sparse_image(&img2, MIB);
    let mut srv = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    srv.ctl_ok(&["attach", path_str(&img)]);

    let out = serve_fails(&dir.path().join("b.sock"), &state, &[]);
    assert!(
        out.stderr.contains(&format!(
            "the state file {} is in use by another loopd (pid {})",
            state.display(),
            srv.pid()
        )),
        "the refusal names the file and the holder:\n{out}"
    );
    assert!(out.stderr.contains("its own --state"), "{out}");

    srv.ctl_ok(&["attach", path_str(&img2)]);
    srv.kill9();
    let srv2 = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    assert_eq!(srv2.device_names(), vec!["one", "two"]);
    assert_eq!(state_names(&state), vec!["one", "two"]);
}

/// A damaged middle line: the good devices come back, the file as it was is
/// saved where the log says, and the state does not shrink (also not after a
/// clean stop).
#[test]
fn damaged_line_keeps_the_rest_and_is_saved_aside() {
    let dir = tempdir();
    let state = dir.path().join("d.state");
    let (a, b, c) = (
        dir.path().join("a.img"),
        dir.path().join("b.img"),
        dir.path().join("c.img"),
    );
    for i in [&a, &b, &c] {
        create_sparse_image(i, MIB);
    }
    let original = format!(
        "{{\"loopd_state\":1}}\n{}{{\"put\":{{\"image\":\"{}\",\"na\n{}{}",
        put_line("a", &a),
        b.display(),
        put_line("c", &c),
        put_line("b", &b).trim_end(), // torn last line: no newline
    );
    std::fs::write(&state, &original).unwrap();
    let mut srv = Server::daemon().arg("--state").arg(&state).start();
    assert_eq!(srv.device_names(), vec!["a", "c"]);

    let saved: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("d.state.damaged-"))
        .collect();
    assert_eq!(saved.len(), 1, "one saved copy: {saved:?}");
    assert_eq!(
        std::fs::read_to_string(&saved[0]).unwrap(),
        original,
        "the saved copy is the damaged file as it was"
    );
    let log = srv.stderr_text();
    assert!(
        log.contains(&saved[0].display().to_string()) && log.contains("line 3"),
        "the log says what was damaged and where the copy is:\n{log}"
    );
    assert_eq!(state_names(&state), vec!["a", "c"]);
    srv.stop_ok();
    assert_eq!(state_names(&state), vec!["a", "c"], "after a clean stop");
}

/// A recorded device whose image is missing at start (its filesystem not
/// mounted yet) is listed as missing with the reason, keeps its name and its
/// record, and comes back by itself once the image is there; another comes
/// back on `loopd attach` of its name; `detach` of a missing one forgets it.
#[test]
fn missing_image_waits_and_comes_back() {
    let dir = tempdir();
    let state = dir.path().join("m.state");
    let mnt = dir.path().join("mnt");
    let (late, other, gone) = (
        mnt.join("late.img"),
        mnt.join("other.img"),
        mnt.join("gone.img"),
    );
    std::fs::write(
        &state,
        format!(
            "{{\"loopd_state\":1}}\n{}{}{}",
            put_line("late", &late),
            put_line("other", &other),
            put_line("gone", &gone)
        ),
    )
    .unwrap();
    let srv = Server::daemon().arg("--state").arg(&state).start();
    let d = wait_state(&srv, "late", "missing", Duration::from_secs(5));
    assert!(
        d.at("reason").str().contains("No such file or directory"),
        "{d:?}"
    );
    let table = srv.ctl_ok(&["list"]).stdout;
    assert!(
        table.contains(&format!("{} (missing: ", late.display())),
        "the table says missing:\n{table}"
    );
    let st = srv.ctl_ok(&["status", "late"]).stdout;
    assert!(st.contains("state: missing: "), "{st}");
    // The name stays taken (by another image); nothing is created.
    let x = dir.path().join("x.img");
    let out = srv.ctl_err(
        &["attach", path_str(&x), "--name", "late", "--create", "1M"],
        "name_taken",
    );
    assert!(out.stderr.contains("missing"), "{out}");
    assert!(!x.exists(), "an attach refused the name created its image");
    assert_eq!(state_names(&state), vec!["gone", "late", "other"]);

    srv.ctl_ok(&["detach", "gone"]);
    assert_eq!(state_names(&state), vec!["late", "other"]);

    // The filesystem appears: both images are there.
    std::fs::create_dir(&mnt).unwrap();
    create_sparse_image(&other, 2 * MIB);
    srv.ctl_ok(&["attach", path_str(&other), "--name", "other"]);
    let t = Instant::now();
    create_sparse_image(&late, MIB);
    wait_state(&srv, "late", "live", Duration::from_secs(10));
    eprintln!("late came back after {:?}", t.elapsed());
    assert_eq!(nbd_size(&srv.uri_for_name("late")), MIB);
    assert_eq!(nbd_size(&srv.uri_for_name("other")), 2 * MIB);
    assert!(srv.stderr_text().contains("device \"late\" is back"));
    assert_eq!(state_names(&state), vec!["late", "other"]);
}

/// Fills the file system holding `dir` (a file `dir/filler`).
fn fill(dir: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    let chunk = vec![0u8; 4096];
    loop {
        if let Err(e) = f.write_all(&chunk) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "filling: {e}");
            return;
        }
    }
}

/// With the state file on a full file system, an attach it cannot record
/// fails with a clear error: not listed, its `--create`d image removed, and
/// after `kill -9` + restart it is not there; a detach or a set it cannot
/// record fails and changes nothing. Nothing half-written is left: the next record after
/// space returns is read back whole.
#[test]
fn full_disk_fails_the_attach_and_leaves_no_trace() {
    let dir = tempdir();
    let st = dir.path().join("st");
    std::fs::create_dir(&st).unwrap();
    run(
        "mount",
        ["-t", "tmpfs", "-o", "size=256k", "tmpfs", path_str(&st)],
    );
    let _mount = Unmount(st.clone());
    let state = st.join("s.state");
    let sock = dir.path().join("s.sock");
    let a = dir.path().join("a.img");
    create_sparse_image(&a, MIB);
    let mut srv = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    srv.ctl_ok(&["attach", path_str(&a)]);
    fill(&st);

    // A record longer than what is left of the file's last page.
    let long = "n".repeat(4090);
    let new_img = dir.path().join("new.img");
    let out = srv.ctl_err(
        &[
            "attach",
            path_str(&new_img),
            "--create",
            "1M",
            "--name",
            &long,
        ],
        "io",
    );
    assert!(
        out.stderr.contains("the state file cannot record it")
            && out.stderr.contains("No space left on device"),
        "a clear error:\n{out}"
    );
    assert_eq!(
        srv.device_names(),
        vec!["a"],
        "the failed attach is not listed"
    );
    assert!(!new_img.exists(), "the --create'd image is removed");
    assert_eq!(state_names(&state), vec!["a"], "no partial record");

    // Free the space: the next attach is recorded whole.
    std::fs::remove_file(st.join("filler")).unwrap();
    let b = dir.path().join("b.img");
    create_sparse_image(&b, MIB);
    let long_b = "m".repeat(4090);
    srv.ctl_ok(&["attach", path_str(&b), "--name", &long_b]);
    assert_eq!(state_names(&state), vec!["a".to_owned(), long_b.clone()]);

    // Full again: a detach that cannot be recorded fails; the device stays.
    fill(&st);
    let out = srv.ctl_err(&["detach", &long_b], "io");
    assert!(
        out.stderr.contains("the state file cannot record it"),
        "{out}"
    );
    assert!(srv.device_names().contains(&long_b), "the device stays");
    // A change that cannot be recorded is not applied.
    let out = srv.ctl_err(&["set", &long_b, "--read-only", "true"], "io");
    assert!(
        out.stderr.contains("the state file cannot record it"),
        "{out}"
    );
    let d = srv.device(&long_b).expect("listed");
    assert!(!d.at("read_only").bool(), "the refused set was applied");
    std::fs::remove_file(st.join("filler")).unwrap();

    srv.kill9();
    let srv2 = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    let names = srv2.device_names();
    assert!(!names.contains(&long), "the failed attach came back");
    assert_eq!(
        names,
        vec!["a".to_owned(), long_b],
        "restored after kill -9"
    );
    let damaged = std::fs::read_dir(&st)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("damaged")
        })
        .count();
    assert_eq!(damaged, 0, "no damaged record was left in the state file");
    drop(srv2);
}

/// A device name in both `--config` and the state file: `--config` wins, one
/// warning names the device and both sources, and the state file drops it.
#[test]
fn config_and_state_clash_is_logged() {
    let dir = tempdir();
    let (from_cfg, from_state) = (dir.path().join("c.img"), dir.path().join("s.img"));
    create_sparse_image(&from_cfg, 2 * MIB);
    create_sparse_image(&from_state, MIB);
    let state = dir.path().join("x.state");
    std::fs::write(
        &state,
        format!("{{\"loopd_state\":1}}\n{}", put_line("dup", &from_state)),
    )
    .unwrap();
    let cfg = dir.path().join("devs.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nimage = \"{}\"\nname = \"dup\"\n",
            from_cfg.display()
        ),
    )
    .unwrap();
    let srv = Server::daemon()
        .arg("--state")
        .arg(&state)
        .arg("--config")
        .arg(&cfg)
        .start();
    let d = srv.device("dup").expect("dup listed");
    assert_eq!(d.at("image").str(), path_str(&from_cfg), "--config wins");
    let log = srv.stderr_text();
    let warn: Vec<&str> = log.lines().filter(|l| l.contains("\"dup\"")).collect();
    assert_eq!(warn.len(), 1, "one line about dup:\n{log}");
    assert!(
        warn[0].contains(&state.display().to_string()) && warn[0].contains("--config wins"),
        "the warning names both sources and the winner:\n{log}"
    );
    assert!(state_names(&state).is_empty(), "the state file drops it");
}

/// The state file (and its lock) are mode 0600 even under umask 000.
#[test]
fn state_file_is_0600_under_umask_000() {
    let dir = tempdir();
    let state = dir.path().join("u.state");
    let img = dir.path().join("u.img");
    create_sparse_image(&img, MIB);
    // SAFETY: umask(2) only sets the process's file mode mask.
    let old = unsafe { libc::umask(0) };
    let srv = Server::daemon().arg("--state").arg(&state).start();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    srv.ctl_ok(&["attach", path_str(&img)]);
    for f in [state.clone(), dir.path().join("u.state.lock")] {
        let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600, "{} has mode {mode:o}", f.display());
    }
    srv.ctl_ok(&["set", "u", "--read-only", "true"]);
    let mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600);
}

/// Without --state, root's state file is persistent: /var/lib/loopd/STEM.state
/// (STEM: the control socket's), not beside the socket in /run.
#[test]
fn default_state_is_in_var_lib() {
    assert!(
        rustix_is_root(),
        "this test checks root's default state path: run the tests as root"
    );
    let dir = tempdir();
    let stem = format!("e2e-state-{}", std::process::id());
    let ctl = dir.path().join(format!("{stem}.ctl"));
    let state = PathBuf::from(format!("/var/lib/loopd/{stem}.state"));
    let lock = PathBuf::from(format!("/var/lib/loopd/{stem}.state.lock"));
    let _c = Cleanup::new(vec![state.clone(), lock]);
    let img = dir.path().join("v.img");
    create_sparse_image(&img, MIB);
    let mut srv = Server::daemon()
        .default_state()
        .arg("--control")
        .arg(&ctl)
        .start();
    srv.ctl_ok(&["attach", path_str(&img)]);
    assert_eq!(state_names(&state), vec!["v"]);
    assert!(!ctl.with_extension("state").exists());
    let dmode = std::fs::metadata("/var/lib/loopd")
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(dmode & 0o077, 0, "/var/lib/loopd is private: {dmode:o}");
    srv.stop_ok();
}

/// A state file left at the old default location (beside the control socket)
/// is not used any more; the daemon says so, naming both paths, so an upgrade
/// does not lose devices silently.
#[test]
fn old_default_state_location_is_pointed_out() {
    let dir = tempdir();
    let stem = format!("e2e-oldstate-{}", std::process::id());
    let ctl = dir.path().join(format!("{stem}.ctl"));
    let old = ctl.with_extension("state");
    let lock = PathBuf::from(format!("/var/lib/loopd/{stem}.state.lock"));
    let new = PathBuf::from(format!("/var/lib/loopd/{stem}.state"));
    let _c = Cleanup::new(vec![new.clone(), lock]);
    std::fs::write(&old, "{\"loopd_state\":1}\n").unwrap();
    let mut srv = Server::daemon()
        .default_state()
        .arg("--control")
        .arg(&ctl)
        .start();
    // The line may reach the test's stderr reader a little after the
    // control socket appears: look for up to 10 s.
    let said = |log: &str| {
        log.contains(&format!(
            "{} is a state file at the old default location",
            old.display()
        )) && log.contains(&format!("--state {}", old.display()))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut log = srv.stderr_text();
    while !said(&log) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        log = srv.stderr_text();
    }
    assert!(said(&log), "no word about the old state file:\n{log}");
    srv.stop_ok();
    assert_eq!(
        std::fs::read(&old).unwrap(),
        b"{\"loopd_state\":1}\n",
        "left alone"
    );
}

/// Files under /var/lib/loopd that a test made, removed on drop (also when
/// the test fails), and the directory itself if it was not there before this
/// test binary's first daemon made it (and nobody's files are left in it).
struct Cleanup(Vec<PathBuf>);

impl Cleanup {
    fn new(files: Vec<PathBuf>) -> Cleanup {
        var_lib_loopd_was_there();
        Cleanup(files)
    }
}

/// Whether /var/lib/loopd existed before the tests here: asked by every
/// test that may make it, before it starts its daemon.
fn var_lib_loopd_was_there() -> bool {
    static THERE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *THERE.get_or_init(|| Path::new("/var/lib/loopd").exists())
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
        if !var_lib_loopd_was_there() {
            // Fails (and is left) while another test's files are still there.
            let _ = std::fs::remove_dir("/var/lib/loopd");
        }
    }
}

fn rustix_is_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `"create": 2^64-1` says what is out of range; `list` and `version` with a
/// field the document does not name are bad requests.
#[test]
fn control_errors_follow_the_document() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let mut c = ControlConn::connect(srv.control());
    let img = dir.path().join("huge.img");
    let msg = c.err(
        &format!(
            r#"{{"v":1,"op":"attach","image":"{}","create":18446744073709551615}}"#,
            img.display()
        ),
        "invalid",
    );
    assert!(
        msg.contains("create size 18446744073709551615 is out of range")
            && msg.contains("9223372036854775807"),
        "{msg}"
    );
    assert!(!img.exists());
    for line in [
        r#"{"v":1,"op":"list","all":true}"#,
        r#"{"v":1,"op":"version","x":1}"#,
    ] {
        let msg = c.err(line, "bad_request");
        assert!(msg.contains("unknown field"), "{line}: {msg}");
    }
    c.ok(r#"{"v":1,"op":"list"}"#);
}
