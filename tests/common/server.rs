//! [`Server`]: a running `loopd serve` this test owns — its URIs, output,
//! signals, and stopping it by PID when it drops — plus one-shot `loopd` runs.

use std::ffi::OsStr;
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::tools::{Out, run_cmd_timeout};

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local_addr").port()
}

/// Path of the loopd binary under test.
pub fn loopd_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_loopd"))
}

/// A running `loopd serve`.  Dropping it stops the process (SIGTERM, then
/// SIGKILL after a timeout) by PID and reaps it.
pub struct Server {
    pub(super) child: Option<Child>,
    pub(super) pid: u32,
    pub(super) desc: String,
    pub(super) name: String,
    pub(super) socket: Option<PathBuf>,
    pub(super) port: Option<u16>,
    pub(super) stderr: Arc<Mutex<Vec<u8>>>,
    pub(super) stdout_lines: Arc<Mutex<Vec<String>>>,
    /// The control socket, as printed on the `control: PATH` ready line
    /// (daemon mode, see [`Server::daemon`]).
    pub(super) control: Option<PathBuf>,
    pub(super) _dir: tempfile::TempDir,
}

fn send_signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is the PID of
    // a child we spawned and have not reaped yet, so it cannot refer to an
    // unrelated process.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        // ESRCH cannot happen for an unreaped child; anything else is a bug.
        panic!("kill({pid}, {sig}) failed: {e}");
    }
}

impl Server {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn socket(&self) -> &Path {
        self.socket.as_deref().expect("server has no unix socket")
    }

    /// `nbd+unix:///NAME?socket=PATH`
    pub fn uri(&self) -> String {
        self.uri_for_name(&self.name)
    }

    /// A Unix URI for another export name on the same socket.
    pub fn uri_for_name(&self, name: &str) -> String {
        format!(
            "nbd+unix:///{}?socket={}",
            pct(name),
            pct(&self.socket().display().to_string())
        )
    }

    /// `nbd://127.0.0.1:PORT/NAME`
    pub fn tcp_uri(&self) -> String {
        let port = self.port.expect("server has no TCP listener");
        if self.name.is_empty() {
            format!("nbd://127.0.0.1:{port}")
        } else {
            format!("nbd://127.0.0.1:{port}/{}", pct(&self.name))
        }
    }

    pub fn port(&self) -> u16 {
        self.port.expect("server has no TCP listener")
    }

    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    pub fn stdout_text(&self) -> String {
        self.stdout_lines.lock().unwrap().join("\n")
    }

    /// Returns the exit status if the process has exited (reaping it).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
    }

    /// Panics (with the server's stderr) unless the process is still running.
    #[track_caller]
    pub fn assert_running(&mut self) {
        if let Some(st) = self.try_wait() {
            panic!(
                "loopd died unexpectedly ({st}):\n--- stderr ---\n{}",
                self.stderr_text()
            );
        }
    }

    /// Sends a signal to the server process.
    pub fn signal(&mut self, sig: libc::c_int) {
        assert!(
            self.try_wait().is_none(),
            "cannot signal loopd: it already exited\n{}",
            self.stderr_text()
        );
        send_signal(self.pid, sig);
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.try_wait() {
                return Some(st);
            }
            if start.elapsed() > timeout {
                return None;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM and wait (10 s) for a clean exit; returns the exit status.
    /// Panics (after SIGKILL) if the server does not stop in time.
    pub fn stop(&mut self) -> ExitStatus {
        self.stop_with(libc::SIGTERM)
    }

    pub fn stop_with(&mut self, sig: libc::c_int) -> ExitStatus {
        self.signal(sig);
        match self.wait_timeout(Duration::from_secs(10)) {
            Some(st) => st,
            None => {
                send_signal(self.pid, libc::SIGKILL);
                let _ = self.child.as_mut().map(|c| c.wait());
                panic!(
                    "loopd did not exit within 10 s of signal {sig}\n--- stderr ---\n{}",
                    self.stderr_text()
                );
            }
        }
    }

    /// SIGTERM, then assert exit status 0.
    pub fn stop_ok(&mut self) {
        let st = self.stop();
        assert!(
            st.success(),
            "loopd exited with {st} after SIGTERM (expected 0)\n--- stderr ---\n{}",
            self.stderr_text()
        );
    }

    /// `kill -9` the server and reap it.
    pub fn kill9(&mut self) -> ExitStatus {
        self.signal(libc::SIGKILL);
        let st = self
            .wait_timeout(Duration::from_secs(10))
            .expect("SIGKILLed process did not exit");
        assert_eq!(st.signal(), Some(libc::SIGKILL), "unexpected status {st}");
        st
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_none() {
            return;
        }
        if thread::panicking() {
            eprintln!(
                "--- loopd ({}) stderr ---\n{}\n--- end loopd stderr ---",
                self.desc,
                self.stderr_text()
            );
        }
        let Some(child) = self.child.as_mut() else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            send_signal(self.pid, libc::SIGTERM);
            let start = Instant::now();
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if start.elapsed() > Duration::from_secs(5) => {
                        send_signal(self.pid, libc::SIGKILL);
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => thread::sleep(Duration::from_millis(10)),
                }
            }
        }
        self.child = None;
    }
}

/// Runs `loopd` with arbitrary arguments (not as a long-running server).
pub fn loopd_run<I, S>(args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = Command::new(loopd_bin());
    c.args(args).stdin(Stdio::null());
    run_cmd_timeout(c, Duration::from_secs(20))
}

/// Percent-encodes `s` for an NBD URI (every byte but RFC 3986's unreserved
/// ones and `/`), written here independently of loopd's encoder.
pub fn pct(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
