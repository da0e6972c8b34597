//! Journald-friendly logging: with `JOURNAL_STREAM` naming the daemon's stderr
//! (as systemd sets it), every log line starts with a `<N>` priority and has no
//! timestamp; with a `JOURNAL_STREAM` that names another file, the usual format.

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Run `loopd serve` with stderr to a file and `JOURNAL_STREAM` set to `stream`
/// (or to that file's DEV:INODE when `None`), until it serves; stop it with
/// SIGTERM; return its stderr.
fn serve_log(stream: Option<&str>) -> String {
    let dir = tempdir();
    let img = dir.path().join("j.img");
    create_sparse_image(&img, MIB);
    let log = dir.path().join("stderr.log");
    let f = std::fs::File::create(&log).expect("create log");
    let m = f.metadata().expect("stat log");
    let own = format!("{}:{}", m.dev(), m.ino());
    let mut c = Command::new(loopd_bin());
    c.args(["serve", path_str(&img)])
        .arg("--socket")
        .arg(dir.path().join("j.sock"))
        .arg("--state")
        .arg(dir.path().join("j.state"))
        .env("JOURNAL_STREAM", stream.unwrap_or(&own))
        .env("LOOPD_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(f);
    let mut child = c.spawn().expect("start loopd");
    let out = child.stdout.take().expect("stdout");
    // Kept open until loopd exits (it prints to stdout while it runs).
    let mut out = BufReader::new(out);
    let mut first = String::new();
    let _ = out.read_line(&mut first);
    assert!(first.starts_with("nbd"), "loopd did not start: {first:?}");
    let pid = i32::try_from(child.id()).expect("pid");
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let mut waited = 0;
    while child.try_wait().expect("try_wait").is_none() {
        waited += 1;
        if waited > 200 {
            let _ = child.kill();
            let _ = child.wait();
            panic!("loopd did not stop on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(out);
    std::fs::read_to_string(&log).expect("read log")
}

#[test]
fn journal_stream_gets_priority_prefixes() {
    let text = serve_log(None);
    let lines: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
    assert!(lines.len() >= 2, "some lines logged:\n{text}");
    for l in &lines {
        let ok = ["<3>", "<4>", "<6>", "<7>"]
            .iter()
            .any(|p| l.starts_with(p));
        assert!(ok, "line without a priority prefix: {l:?}\n{text}");
        assert!(!l[3..].starts_with("20"), "timestamp in {l:?}");
        assert!(!l.contains(" INFO ") && !l.contains('\u{1b}'), "{l:?}");
    }
    assert!(
        lines.iter().any(|l| l.starts_with("<6>")),
        "an info line:\n{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("<6>device ") && l.contains(" errors: ")),
        "the exit summary, one line:\n{text}"
    );
}

#[test]
fn another_journal_stream_leaves_the_format_alone() {
    let text = serve_log(Some("1:1"));
    assert!(!text.is_empty(), "something logged");
    for l in text.lines().filter(|l| !l.is_empty()) {
        assert!(
            !l.starts_with('<'),
            "prefixed though stderr is not the journal: {l:?}"
        );
    }
    assert!(text.contains(" INFO "), "the usual level words:\n{text}");
}
