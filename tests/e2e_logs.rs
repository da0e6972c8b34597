//! Issue 22, point 7 (part): a forked daemon's log lines go somewhere — to
//! `--log-file`, else to syslog (`--syslog-socket`, /dev/log by default),
//! else to a file beside the state file, said before the fork — audit lines
//! included; the log file is re-opened on SIGHUP (logrotate); and a reload,
//! by SIGHUP (naming the sender) or `loopd reload`, leaves an audit line with
//! its outcome.

mod common;

use common::*;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const START: Duration = Duration::from_secs(30);

/// The forked daemon (not a child of the test): SIGTERM, then SIGKILL, by
/// pid on drop if it still runs.
struct Forked(i32);

impl Forked {
    fn alive(&self) -> bool {
        // SAFETY: kill(2) with signal 0 only checks the process exists.
        unsafe { libc::kill(self.0, 0) == 0 }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) has no memory-safety preconditions; the pid is the
        // daemon's, read from its pid file while it runs.
        assert_eq!(unsafe { libc::kill(self.0, sig) }, 0, "kill {sig}");
    }

    fn stop(&self) {
        self.signal(libc::SIGTERM);
        wait_for("the daemon to exit", || !self.alive());
    }
}

impl Drop for Forked {
    fn drop(&mut self) {
        if self.alive() {
            // SAFETY: as in `signal`.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `loopd serve --fork` in `dir` with `extra`: the command's output and the
/// daemon.
fn fork(dir: &Path, extra: &[&str]) -> (Out, Forked, PathBuf) {
    let ctl = dir.join("f.ctl");
    let pidf = dir.join("f.pid");
    let mut c = Command::new(loopd_bin());
    c.arg("serve")
        .arg("--socket")
        .arg(dir.join("f.sock"))
        .arg("--control")
        .arg(&ctl)
        .arg("--state")
        .arg(dir.join("f.state"))
        .arg("--pid-file")
        .arg(&pidf)
        .arg("--fork")
        .args(extra)
        .env_remove("JOURNAL_STREAM")
        .stdin(Stdio::null());
    let out = run_cmd_timeout(c, START).assert_success();
    let pid: i32 = std::fs::read_to_string(&pidf)
        .expect("the pid file exists when --fork returns")
        .trim()
        .parse()
        .unwrap();
    (out, Forked(pid), ctl)
}

/// Attach and detach a device over `ctl`.
fn attach_detach(dir: &Path, ctl: &Path, name: &str) {
    let img = dir.join(format!("{name}.img"));
    create_sparse_image(&img, MIB);
    loopd_ctl(ctl, &["attach", path_str(&img), "--name", name]).assert_success();
    loopd_ctl(ctl, &["detach", name]).assert_success();
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

#[test]
fn fork_with_a_log_file_keeps_audit_lines_and_reopens_it_on_sighup() {
    let dir = tempdir();
    let log = dir.path().join("loopd.log");
    let (_, daemon, ctl) = fork(dir.path(), &["--log-file", path_str(&log)]);
    attach_detach(dir.path(), &ctl, "a");
    daemon.signal(libc::SIGHUP);
    let by_signal = format!(
        "audit: reload by signal SIGHUP from pid={}",
        std::process::id()
    );
    wait_for("the SIGHUP reload's audit line", || {
        read(&log).contains(&by_signal)
    });
    loopd_ctl(&ctl, &["reload"]).assert_success();
    wait_for("the reload's audit line", || {
        read(&log).contains("audit: reload by uid=0 pid=")
    });
    let text = read(&log);
    for want in [
        "audit: attach \"a\" image=",
        "audit: detach \"a\" by uid=0 pid=",
        "ok: no --config: 0 attached, 0 changed, 0 unchanged, 0 not applied, 0 kept, 0 \
         failed; TLS off",
    ] {
        assert!(
            text.contains(want),
            "{want:?} is not in the log file:\n{text}"
        );
    }
    let mode = std::fs::metadata(&log).unwrap().permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600
    );

    // logrotate: the file is moved away, SIGHUP opens a new one.
    let rotated = dir.path().join("loopd.log.1");
    std::fs::rename(&log, &rotated).unwrap();
    daemon.signal(libc::SIGHUP);
    wait_for("a new log file", || read(&log).contains(&by_signal));
    attach_detach(dir.path(), &ctl, "b");
    wait_for("b's lines in the new file", || {
        read(&log).contains("audit: detach \"b\"")
    });
    assert!(!read(&rotated).contains("\"b\""), "written to the old file");
    daemon.stop();
    assert!(read(&log).contains("stopping"), "{}", read(&log));
}

#[test]
fn fork_without_a_log_file_logs_to_syslog() {
    let dir = tempdir();
    let sock = dir.path().join("log.sock");
    let rx = UnixDatagram::bind(&sock).unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let (out, daemon, ctl) = fork(dir.path(), &["--syslog-socket", path_str(&sock)]);
    assert!(
        out.stderr
            .contains(&format!("logs to syslog ({})", sock.display())),
        "the command does not say where the logs go:\n{out}"
    );
    attach_detach(dir.path(), &ctl, "s");
    daemon.signal(libc::SIGHUP);
    let mut got = Vec::new();
    let mut buf = vec![0u8; 16 << 10];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !got
        .iter()
        .any(|l: &String| l.contains("audit: reload by signal SIGHUP"))
    {
        assert!(
            Instant::now() < deadline,
            "no reload line reached syslog: {got:#?}"
        );
        if let Ok(n) = rx.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    let tag = format!(" loopd[{}]: ", daemon.0);
    for want in ["audit: attach \"s\"", "audit: detach \"s\""] {
        let line = got
            .iter()
            .find(|l| l.contains(want))
            .unwrap_or_else(|| panic!("{want:?} did not reach syslog: {got:#?}"));
        // <daemon.info>Mmm dd hh:mm:ss loopd[PID]: message
        assert!(line.starts_with("<30>") && line.contains(&tag), "{line}");
    }
    daemon.stop();
}

#[test]
fn fork_without_syslog_logs_beside_the_state_file_and_says_so() {
    let dir = tempdir();
    let missing = dir.path().join("no-syslog-here");
    let (out, daemon, ctl) = fork(dir.path(), &["--syslog-socket", path_str(&missing)]);
    let file = dir.path().join("f.log");
    assert!(
        out.stderr.contains(&format!("logs to {}", file.display())),
        "{out}"
    );
    attach_detach(dir.path(), &ctl, "x");
    wait_for("the audit lines in the fallback file", || {
        read(&file).contains("audit: detach \"x\"")
    });
    daemon.stop();
}

/// In the foreground, SIGHUP's audit line names the sender too.
#[test]
fn sighup_reload_is_audited_with_its_sender() {
    let mut d = Server::daemon().start();
    d.signal(libc::SIGHUP);
    let want = format!(
        "audit: reload by signal SIGHUP from pid={} uid=0: ok",
        std::process::id()
    );
    wait_for("the audit line", || d.stderr_text().contains(&want));
    d.stop_ok();
}
