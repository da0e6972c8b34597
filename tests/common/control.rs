//! The control plane as a test drives it: `loopd attach/detach/list/status/…`
//! client commands ([`loopd_ctl`], [`Server::ctl`]), their error codes and exit
//! statuses, and [`ControlConn`], a raw JSON-lines connection to the socket.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::json::{Json, JsonExt};
use super::server::{Server, loopd_bin};
use super::tools::{Out, run_cmd_timeout};

/// Runs `loopd ARGS --control CONTROL` (a client command) to completion.
pub fn loopd_ctl(control: &Path, args: &[&str]) -> Out {
    let mut c = Command::new(loopd_bin());
    c.args(args).arg("--control").arg(control);
    c.env_remove("LOOPD_CONTROL").stdin(Stdio::null());
    run_cmd_timeout(c, Duration::from_secs(60))
}

/// The machine code a failed client command ends its message with, e.g.
/// `busy` for "loopd: error: … (busy)".
pub fn error_code(out: &Out) -> Option<String> {
    let line = out.stderr.lines().rev().find(|l| !l.trim().is_empty())?;
    let line = line.trim_end();
    let inner = line.strip_suffix(')')?;
    let open = inner.rfind('(')?;
    Some(inner[open + 1..].to_string())
}

/// The exit status `loopd` documents (in `--help` and the README) for a
/// failure with machine code `code`.
pub fn exit_status_for(code: &str) -> i32 {
    match code {
        "usage" => 2,
        "not_running" | "shutting_down" => 3,
        "not_found" => 4,
        "busy" => 5,
        "name_taken" => 6,
        "invalid" | "bad_request" | "unsupported_version" => 7,
        "unavailable" => 8,
        _ => 1,
    }
}

/// Asserts a client command failed with the exit status of `code` and the
/// machine code `code` at the end of its error message.
#[track_caller]
pub fn assert_ctl_error(out: &Out, code: &str) {
    assert!(
        !out.success(),
        "expected failure with ({code}), but the command succeeded:\n{out}"
    );
    assert_eq!(
        out.status.code(),
        Some(exit_status_for(code)),
        "wrong exit status for ({code}):\n{out}"
    );
    assert!(
        out.stderr.contains("loopd: error:"),
        "error message missing on stderr:\n{out}"
    );
    assert_eq!(
        error_code(out).as_deref(),
        Some(code),
        "wrong error code:\n{out}"
    );
}

impl Server {
    /// The control socket (daemon mode only).
    pub fn control(&self) -> &Path {
        self.control
            .as_deref()
            .expect("no control line seen (start the server with Server::daemon())")
    }

    /// Runs a client command against this daemon (whatever its exit status).
    pub fn ctl(&self, args: &[&str]) -> Out {
        loopd_ctl(self.control(), args)
    }

    /// Runs a client command and panics unless it exited 0.
    #[track_caller]
    pub fn ctl_ok(&self, args: &[&str]) -> Out {
        let out = self.ctl(args);
        if !out.success() {
            panic!("loopd client command failed:\n{out}");
        }
        out
    }

    /// Runs a client command and asserts it failed with `code`.
    #[track_caller]
    pub fn ctl_err(&self, args: &[&str], code: &str) -> Out {
        let out = self.ctl(args);
        assert_ctl_error(&out, code);
        out
    }

    /// Runs a client command with `--json` and parses its output.
    #[track_caller]
    pub fn ctl_json(&self, args: &[&str]) -> Json {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.ctl_ok(&a);
        Json::parse(&out.stdout)
    }

    /// One of device `name`'s path counters from `loopd status` (`spliced`,
    /// `buffered`, `inline_cached`, ...).
    #[track_caller]
    pub fn path_count(&self, name: &str, path: &str) -> u64 {
        self.ctl_json(&["status", name]).at("paths").at(path).u64()
    }

    /// `loopd list --json`: the devices.
    #[track_caller]
    pub fn list_json(&self) -> Vec<Json> {
        self.ctl_json(&["list"]).arr().to_vec()
    }

    /// The device named `name` in `loopd list --json`, if any.
    #[track_caller]
    pub fn device(&self, name: &str) -> Option<Json> {
        self.list_json()
            .into_iter()
            .find(|d| d.at("name").str() == name)
    }

    /// Names of all devices, in listing order.
    #[track_caller]
    pub fn device_names(&self) -> Vec<String> {
        self.list_json()
            .iter()
            .map(|d| d.at("name").str().to_string())
            .collect()
    }

    /// Polls `list` until `name` has `n` clients (panics after `timeout`).
    #[track_caller]
    pub fn wait_clients(&self, name: &str, n: u64, timeout: Duration) {
        let start = Instant::now();
        loop {
            let d = self.device(name);
            let got = d.as_ref().map(|d| d.at("clients").u64());
            if got == Some(n) {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "device {name:?} did not reach {n} client(s) within {timeout:?} (now {got:?})"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls `list` until `name` is gone; returns how long it took, or `None`
    /// if it was still there after `timeout`.
    pub fn wait_gone(&self, name: &str, timeout: Duration) -> Option<Duration> {
        let start = Instant::now();
        loop {
            if self.device(name).is_none() {
                return Some(start.elapsed());
            }
            if start.elapsed() > timeout {
                return None;
            }
            thread::sleep(Duration::from_millis(25));
        }
    }

    /// All stdout lines printed so far.
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout_lines.lock().unwrap().clone()
    }
}

/// A raw connection to the control socket: one JSON line per request.
pub struct ControlConn {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl ControlConn {
    pub fn connect(path: &Path) -> ControlConn {
        let s = UnixStream::connect(path)
            .unwrap_or_else(|e| panic!("connect control socket {}: {e}", path.display()));
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
        ControlConn {
            w: s.try_clone().expect("clone control stream"),
            r: BufReader::new(s),
        }
    }

    /// Sends raw bytes (no newline is added).
    pub fn send_raw(&mut self, data: &[u8]) {
        self.w.write_all(data).expect("write control request");
    }

    /// Reads one reply line and parses it.
    pub fn read_reply(&mut self) -> Json {
        let mut line = String::new();
        let n = self
            .r
            .read_line(&mut line)
            .expect("read control reply (timed out?)");
        assert!(n > 0, "the daemon closed the control connection");
        assert!(line.ends_with('\n'), "reply line not terminated: {line:?}");
        Json::parse(line.trim_end())
    }

    /// Sends one request line and returns the parsed reply.
    pub fn request(&mut self, line: &str) -> Json {
        self.send_raw(format!("{line}\n").as_bytes());
        self.read_reply()
    }

    /// Sends a request that must succeed; returns its `result`.
    #[track_caller]
    pub fn ok(&mut self, line: &str) -> Json {
        let r = self.request(line);
        assert_eq!(r.at("v").u64(), 1, "reply to {line}: {r:?}");
        assert_eq!(r.at("ok"), &Json::Bool(true), "reply to {line}: {r:?}");
        assert!(r.get("error").is_none(), "reply to {line}: {r:?}");
        r.at("result").clone()
    }

    /// Sends a request that must fail with `code`; returns the error message.
    #[track_caller]
    pub fn err(&mut self, line: &str, code: &str) -> String {
        let r = self.request(line);
        assert_reply_error(&r, code, line)
    }
}

/// Asserts a control reply is `{"v":1,"ok":false,"error":{"code":CODE,"message":…}}`.
#[track_caller]
pub fn assert_reply_error(r: &Json, code: &str, ctx: &str) -> String {
    assert_eq!(r.at("v").u64(), 1, "reply to {ctx}: {r:?}");
    assert_eq!(r.at("ok"), &Json::Bool(false), "reply to {ctx}: {r:?}");
    assert!(r.get("result").is_none(), "reply to {ctx}: {r:?}");
    let e = r.at("error");
    assert_eq!(e.at("code").str(), code, "reply to {ctx}: {r:?}");
    let msg = e.at("message").str().to_string();
    assert!(!msg.is_empty(), "empty error message in reply to {ctx}");
    msg
}

pub use loopd::text::repeated_cause;

/// Asserts no `loopd: error:` line of `out` repeats a cause.
#[track_caller]
pub fn assert_each_cause_once(out: &Out) {
    for l in out.stderr.lines().filter(|l| l.contains("error")) {
        if let Some(r) = repeated_cause(l) {
            panic!("a cause repeated ({r}) in:\n{l}\n{out}");
        }
    }
}
