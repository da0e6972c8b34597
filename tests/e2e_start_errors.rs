//! Issue 27, points 3 and 4: `serve`'s start-up failures and `reload`'s
//! have the codes and exit statuses the control path gives the same failure
//! (a typo in the config is `invalid`, a missing module `unavailable`, a
//! locked state file or a taken address `busy`…), not `internal` with 1; and
//! every error line gives each cause once.

mod common;

use common::*;
use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// `loopd serve ARGS` with a socket and state file of its own in `dir`
/// (unless ARGS has `--state`); its output once it exited.
fn serve(dir: &Path, i: usize, args: &[OsString]) -> (Out, std::path::PathBuf) {
    let sock = dir.join(format!("s{i}.sock"));
    let mut c = Command::new(loopd_bin());
    c.arg("serve").arg("--socket").arg(&sock);
    if !args.iter().any(|a| a == "--state") {
        c.arg("--state").arg(sock.with_extension("state"));
    }
    c.args(args).stdin(Stdio::null());
    (run_cmd_timeout(c, Duration::from_secs(20)), sock)
}

fn os(v: &[&str]) -> Vec<OsString> {
    v.iter().map(OsString::from).collect()
}

#[test]
fn serve_start_errors_have_their_classes() {
    let t = tempfile::tempdir().expect("tempdir");
    let dir = t.path();
    let img = dir.join("d.img");
    create_sparse_image(&img, MIB);
    let typo = dir.join("typo.toml");
    std::fs::write(&typo, format!("[[device]]\nimgae = {:?}\n", img)).expect("write");
    let certs = dir.join("no-certs");
    std::fs::create_dir(&certs).expect("mkdir");
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = held.local_addr().expect("addr").port();
    let other = Server::daemon().start();
    let other_state = other.socket().with_extension("state");
    let img_s = img.to_str().expect("utf-8");
    let mut cases: Vec<(&str, Vec<OsString>, &str, String)> = vec![
        (
            "a typo in the config",
            os(&["--config", typo.to_str().expect("utf-8")]),
            "invalid",
            "unknown field `imgae`".into(),
        ),
        (
            "a missing config",
            os(&["--config", dir.join("nope.toml").to_str().expect("utf-8")]),
            "io",
            "nope.toml".into(),
        ),
        (
            "missing TLS files",
            os(&[img_s, "--tls-certs", certs.to_str().expect("utf-8")]),
            "io",
            "missing".into(),
        ),
        (
            "an address in use",
            os(&[img_s, "--listen", &format!("127.0.0.1:{port}")]),
            "busy",
            "Address already in use".into(),
        ),
        (
            "a metrics address in use",
            os(&[img_s, "--metrics", &format!("127.0.0.1:{port}")]),
            "busy",
            "Address already in use".into(),
        ),
        (
            "a state file another daemon holds",
            vec![
                img.clone().into(),
                "--state".into(),
                other_state.clone().into(),
            ],
            "busy",
            "in use by another loopd".into(),
        ),
        (
            "a bad option value",
            os(&[img_s, "--max-connections", "0"]),
            "usage",
            "--max-connections must be at least 1".into(),
        ),
        (
            "--tls require without certificates",
            os(&[img_s, "--tls", "require"]),
            "usage",
            "--tls-certs".into(),
        ),
    ];
    if Path::new("/dev/ublk-control").exists() {
        eprintln!("ublk_drv is loaded here: the missing-module case runs in the VM suites only");
    } else {
        cases.push((
            "no ublk_drv",
            os(&[img_s, "--blockdev", "ublk"]),
            "unavailable",
            "modprobe ublk_drv".into(),
        ));
    }
    for (i, (what, args, code, words)) in cases.iter().enumerate() {
        let (out, sock) = serve(dir, i, args);
        assert_eq!(
            out.status.code(),
            Some(exit_status_for(code)),
            "{what}: exit status of ({code}):\n{out}"
        );
        assert!(
            out.stderr.contains(&format!("({code})")),
            "{what}: the line ends with ({code}):\n{out}"
        );
        assert!(
            out.stderr.contains(words.as_str()),
            "{what}: says {words:?}:\n{out}"
        );
        assert_each_cause_once(&out);
        assert!(!sock.exists(), "{what}: socket left behind");
    }
    drop(held);
}

#[test]
fn reload_errors_have_their_classes() {
    let t = tempfile::tempdir().expect("tempdir");
    let cfg = t.path().join("devices.toml");
    std::fs::write(&cfg, "").expect("write");
    let srv = Server::daemon()
        .args([OsString::from("--config"), cfg.clone().into()])
        .start();
    std::fs::write(&cfg, "[[device]]\nimgae = \"/x.img\"\n").expect("write");
    let out = srv.ctl_err(&["reload"], "invalid");
    assert!(out.stderr.contains("unknown field `imgae`"), "{out}");
    assert!(out.stderr.contains("nothing changed"), "{out}");
    assert_each_cause_once(&out);
    std::fs::remove_file(&cfg).expect("rm");
    let out = srv.ctl_err(&["reload"], "io");
    assert!(
        out.stderr.contains("No such file or directory"),
        "the errno is kept: {out}"
    );
    assert_each_cause_once(&out);
}

/// A device of the state file whose image is gone: its `list` row names the
/// image once (the example had it three times), and says why.
#[test]
fn a_missing_devices_row_names_its_image_once() {
    let t = tempfile::tempdir().expect("tempdir");
    let img = t.path().join("gone.img");
    create_sparse_image(&img, MIB);
    let state = t.path().join("st.state");
    {
        let srv = Server::daemon()
            .args([OsString::from("--state"), state.clone().into()])
            .start();
        srv.ctl_ok(&["attach", img.to_str().expect("utf-8")]);
    }
    std::fs::remove_file(&img).expect("rm");
    let srv = Server::daemon()
        .args([OsString::from("--state"), state.clone().into()])
        .start();
    let list = srv.ctl_ok(&["list"]);
    let row = list
        .stdout
        .lines()
        .find(|l| l.contains("gone.img"))
        .unwrap_or_else(|| panic!("no row for the missing device:\n{list}"));
    assert_eq!(
        row.matches("gone.img").count(),
        1,
        "the missing row names its image once: {row}"
    );
    assert!(row.contains("missing: cannot open: No such file"), "{row}");
}
