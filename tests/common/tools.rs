//! External tools and the processes that run them: the tool `PATH`, running a
//! command to completion under a time limit ([`run_cmd_timeout`], [`Out`]),
//! temporary directories and mounts a test owns.
//!
//! A missing tool fails the test with a message pointing at
//! `scripts/install-test-deps.sh`; it is never skipped.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Default time limit for one external tool invocation.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// PATH for external tools: /usr/bin first, so that `nbdsh` (a wrapper that
/// runs `python3`) finds the system Python that has the `nbd` module rather
/// than e.g. a pyenv Python.
pub fn tool_path_env() -> OsString {
    let mut p = OsString::from("/usr/bin:/usr/sbin:/bin:/sbin");
    if let Some(old) = std::env::var_os("PATH") {
        p.push(":");
        p.push(old);
    }
    p
}

/// Looks a tool up on [`tool_path_env`].
pub fn which(name: &str) -> Option<PathBuf> {
    let path = tool_path_env();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// Panics with a clear message if `name` is not installed.
pub fn require_tool(name: &str) -> PathBuf {
    which(name).unwrap_or_else(|| {
        panic!(
            "{name} not found: run scripts/install-test-deps.sh (as root) to install the test tools"
        )
    })
}

/// A `Command` for an external tool, with the tool PATH and no stdin.
pub fn tool(name: &str) -> Command {
    let path = require_tool(name);
    let mut c = Command::new(path);
    c.env("PATH", tool_path_env()).stdin(Stdio::null());
    c
}

/// Output of a finished process.
pub struct Out {
    pub desc: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Panics (showing stdout and stderr) unless the process exited 0.
    pub fn assert_success(self) -> Out {
        if !self.status.success() {
            panic!(
                "command failed ({}): {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                self.status, self.desc, self.stdout, self.stderr
            );
        }
        self
    }
}

impl fmt::Display for Out {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} -> {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.desc, self.status, self.stdout, self.stderr
        )
    }
}

pub(super) fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        let a = a.to_string_lossy();
        if a.contains(|c: char| c.is_whitespace() || c == '\'' || c == '"') || a.is_empty() {
            s.push('\'');
            s.push_str(&a.replace('\'', "'\\''"));
            s.push('\'');
        } else {
            s.push_str(&a);
        }
    }
    s
}

fn drain<R: Read + Send + 'static>(mut r: R) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

/// Runs `cmd` to completion (killing it after `timeout`), capturing output.
/// Does not look at the exit status.
pub fn run_cmd_timeout(mut cmd: Command, timeout: Duration) -> Out {
    use std::os::unix::process::CommandExt;
    let desc = describe(&cmd);
    // Its own process group, so a timeout kills the children too (fio's jobs),
    // which would otherwise hold the output pipes open.
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {desc}: {e}"));
    let out_h = drain(child.stdout.take().expect("stdout"));
    let err_h = drain(child.stderr.take().expect("stderr"));
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if start.elapsed() > timeout {
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill(2) has no memory-safety preconditions; -pid names
                // the process group this child leads.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
            }
            let _ = child.kill();
            let _ = child.wait();
            // Not joined: a descendant in a session of its own (fio's jobs call
            // setsid) may hold the pipes open for as long as the server does.
            drop((out_h, err_h));
            panic!("command timed out after {timeout:?}: {desc}");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let stdout = String::from_utf8_lossy(&out_h.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_h.join().unwrap_or_default()).into_owned();
    Out {
        desc,
        status,
        stdout,
        stderr,
    }
}

/// Runs a tool and returns its output whatever the exit status.
pub fn run_status<I, S>(name: &str, args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run_status_timeout(TOOL_TIMEOUT, name, args)
}

/// Runs a tool (killed after `timeout`) and returns its output whatever the
/// exit status.
pub fn run_status_timeout<I, S>(timeout: Duration, name: &str, args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = tool(name);
    c.args(args);
    run_cmd_timeout(c, timeout)
}

/// Runs a tool and panics (showing its stderr) on a non-zero exit.
pub fn run<I, S>(name: &str, args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run_status(name, args).assert_success()
}

/// A path as the `&str` a command line or script wants (test paths are UTF-8).
pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Unmounts a test's mount when dropped (also when the test fails); a failed
/// umount is reported on stderr.
pub struct Unmount(pub PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let out = run_status("umount", [self.0.as_os_str()]);
        if !out.success() {
            eprintln!("umount {} failed:\n{out}", self.0.display());
        }
    }
}

/// A read-only bind mount of `dir` at `dir/mnt` (needs root): a file under
/// it cannot be opened for writing, whatever its mode. Unmounted when the
/// guard drops.
pub fn read_only_bind(dir: &Path) -> (PathBuf, Unmount) {
    let mnt = dir.join("mnt");
    fs::create_dir(&mnt).expect("mkdir mnt");
    run("mount", ["--bind", path_str(dir), path_str(&mnt)]);
    let guard = Unmount(mnt.clone());
    run("mount", ["-o", "remount,ro,bind", path_str(&mnt)]);
    (mnt, guard)
}

/// Temporary directory for a test's images.
pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-e2e")
        .tempdir()
        .expect("tempdir")
}
