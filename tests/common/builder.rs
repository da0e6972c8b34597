//! [`ServerBuilder`]: how a test configures and starts `loopd serve` — the
//! arguments, sockets, limits and environment — and waits for its ready lines.

use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::matrix::Combo;
use super::server::{Server, free_port, loopd_bin};
use super::tools::{describe, tool_path_env};

/// How long a server may take to print its "ready" lines.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Builder for a `loopd serve` process.
pub struct ServerBuilder {
    /// `None`: `loopd serve` without an image (a daemon with no default device).
    image: Option<PathBuf>,
    /// Ready when the `control: PATH` line is printed (instead of the URI line).
    ready_on_control: bool,
    args: Vec<OsString>,
    unix: bool,
    tcp: bool,
    name: Option<String>,
    socket_path: Option<PathBuf>,
    /// Process limits and umask for the server (set in the child before exec).
    limits: ChildLimits,
    /// Leave out the `--state` the harness adds (test the default path).
    default_state: bool,
    /// Extra environment for the server (e.g. `LOOPD_LOG`).
    envs: Vec<(OsString, OsString)>,
    /// How long it may take to be ready (default [`READY_TIMEOUT`]).
    ready_timeout: Duration,
    /// The server's current directory (default: the test's).
    cwd: Option<PathBuf>,
}

/// What a server process starts with, set between fork and exec.
#[derive(Clone, Copy, Default)]
pub struct ChildLimits {
    /// RLIMIT_NOFILE, soft and hard.
    pub nofile: Option<u64>,
    pub umask: Option<u32>,
}

impl ChildLimits {
    /// Apply to `cmd` (in the child, before exec).
    pub fn apply(self, cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        if self.nofile.is_none() && self.umask.is_none() {
            return;
        }
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe system calls (setrlimit, umask).
        unsafe {
            cmd.pre_exec(move || {
                if let Some(n) = self.nofile {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some(m) = self.umask {
                    libc::umask(m);
                }
                Ok(())
            });
        }
    }
}

impl ServerBuilder {
    /// Start the server with this open-file limit (soft and hard).
    pub fn nofile(mut self, n: u64) -> Self {
        self.limits.nofile = Some(n);
        self
    }

    /// Start the server with this umask.
    pub fn umask(mut self, m: u32) -> Self {
        self.limits.umask = Some(m);
        self
    }

    /// Do not pass `--state` (by default the harness passes the control
    /// socket's path with extension `.state`, so parallel servers never share
    /// the persistent default state file).
    pub fn default_state(mut self) -> Self {
        self.default_state = true;
        self
    }

    /// Use this Unix socket path instead of a fresh one in a private tempdir.
    pub fn socket_path(mut self, p: &Path) -> Self {
        self.socket_path = Some(p.to_path_buf());
        self.unix = true;
        self
    }

    /// Extra arguments passed to `loopd serve` after the image.
    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.args.push(a.as_ref().to_owned());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        for a in args {
            self.args.push(a.as_ref().to_owned());
        }
        self
    }

    /// Adds `--cache X --block-size Y`.
    pub fn combo(self, c: Combo) -> Self {
        self.args(c.args())
    }

    /// Also wait for the `control: PATH` line (printed after the URI lines), so
    /// that [`Server::ctl`] works on a server started with an image.
    pub fn with_control(mut self) -> Self {
        self.ready_on_control = true;
        self
    }

    /// Sets `--name` (the empty string is allowed).
    pub fn name(mut self, n: &str) -> Self {
        self.name = Some(n.to_string());
        self
    }

    /// Also listen on TCP 127.0.0.1 (free port).
    pub fn tcp(mut self) -> Self {
        self.tcp = true;
        self
    }

    /// Allow `t` (instead of [`READY_TIMEOUT`]) until the ready lines: a
    /// daemon that restores devices of a remote backend (RBD under QEMU TCG)
    /// opens them before it prints its control line.
    pub fn ready_timeout(mut self, t: Duration) -> Self {
        self.ready_timeout = t;
        self
    }

    /// Set an environment variable for the server (e.g. `LOOPD_LOG=debug`).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((key.as_ref().to_os_string(), value.as_ref().to_os_string()));
        self
    }

    /// Run the server in `dir` (relative paths in its arguments are then
    /// relative to `dir`).
    pub fn current_dir(mut self, dir: &Path) -> Self {
        self.cwd = Some(dir.to_path_buf());
        self
    }

    /// No `--socket` from the harness (the test passes its own endpoints,
    /// e.g. qemu-nbd's `-k`); for [`Server::daemon`], ready on its control line.
    pub fn no_socket(mut self) -> Self {
        self.unix = false;
        self
    }

    /// Listen on TCP only (no --socket).
    pub fn tcp_only(mut self) -> Self {
        self.tcp = true;
        self.unix = false;
        self
    }

    /// Spawns the server and waits until it printed its ready line(s).
    pub fn start(self) -> Server {
        // A port from `free_port` is free when chosen, not necessarily when
        // loopd binds it (another test's client may take it as its ephemeral
        // port in between): try again with another port.
        for attempt in 1.. {
            match self.start_once() {
                Ok(s) => return s,
                Err(e) if self.tcp && attempt < 4 && e.contains("Address already in use") => {
                    eprintln!("retrying with another port: {e}");
                }
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    /// Spawns the server once: the server once ready, or why it exited
    /// before it was ready (its stderr) — for tests that expect a refusal.
    pub fn try_start(self) -> Result<Server, String> {
        self.start_once()
    }

    /// One try of [`ServerBuilder::start`]: the server, or why it exited before
    /// it was ready.
    fn start_once(&self) -> Result<Server, String> {
        let dir = tempfile::Builder::new()
            .prefix("loopd-sock")
            .tempdir()
            .expect("tempdir");
        let export_name = self.name.clone().unwrap_or_else(|| {
            self.image
                .as_deref()
                .and_then(Path::file_stem)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        let socket = self.unix.then(|| {
            self.socket_path
                .clone()
                .unwrap_or_else(|| dir.path().join("nbd.sock"))
        });
        let port = self.tcp.then(free_port);

        let mut cmd = Command::new(loopd_bin());
        cmd.arg("serve");
        if let Some(img) = &self.image {
            cmd.arg(img);
        }
        if let Some(s) = &socket {
            cmd.arg("--socket").arg(s);
        }
        if let Some(p) = port {
            cmd.arg("--listen").arg(format!("127.0.0.1:{p}"));
        }
        if let Some(n) = &self.name {
            cmd.arg("--name").arg(n);
        }
        cmd.args(&self.args);
        self.limits.apply(&mut cmd);
        let has = |flag: &str| {
            self.args.iter().any(|a| {
                let a = a.to_string_lossy();
                a == flag || a.starts_with(&format!("{flag}="))
            })
        };
        // No NBD socket to put it beside: the control socket goes in the
        // test's directory, not the default /run/loopd (which would be left
        // behind).
        if socket.is_none() && !has("--control") {
            cmd.arg("--control").arg(dir.path().join("nbd.ctl"));
        }
        if !self.default_state && !has("--state") {
            let ctl = self
                .args
                .iter()
                .position(|a| a == "--control")
                .and_then(|i| self.args.get(i + 1))
                .map(PathBuf::from)
                .or_else(|| socket.as_ref().map(|s| s.with_extension("ctl")))
                .unwrap_or_else(|| dir.path().join("nbd.ctl"));
            cmd.arg("--state").arg(ctl.with_extension("state"));
        }
        cmd.envs(self.envs.iter().map(|(k, v)| (k, v)));
        if let Some(d) = &self.cwd {
            cmd.current_dir(d);
        }
        cmd.env("PATH", tool_path_env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let desc = describe(&cmd);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {desc}: {e}"));
        let pid = child.id();

        let stderr_buf = Arc::new(Mutex::new(Vec::new()));
        {
            let buf = Arc::clone(&stderr_buf);
            let mut err = child.stderr.take().expect("stderr");
            thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                loop {
                    match err.read(&mut chunk) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.lock().unwrap().extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
        let stdout_lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel::<String>();
        {
            let lines = Arc::clone(&stdout_lines);
            let out = child.stdout.take().expect("stdout");
            thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push(line.clone());
                    let _ = tx.send(line);
                }
            });
        }

        let mut server = Server {
            child: Some(child),
            pid,
            desc,
            name: export_name,
            socket,
            port,
            stderr: stderr_buf,
            stdout_lines,
            control: None,
            _dir: dir,
        };

        let (want_unix, want_tcp) = if self.ready_on_control {
            // The control line is printed last, after every URI line.
            (Some("control: ".to_string()), None)
        } else {
            (
                server.socket.as_ref().map(|_| server.uri()),
                server.port.map(|_| server.tcp_uri()),
            )
        };
        let mut seen_unix = want_unix.is_none();
        let mut seen_tcp = want_tcp.is_none();
        let deadline = Instant::now() + self.ready_timeout;
        while !(seen_unix && seen_tcp) {
            if let Some(st) = server.try_wait() {
                return Err(format!(
                    "loopd exited ({st}) before it was ready: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                    server.desc,
                    server.stdout_lines.lock().unwrap().join("\n"),
                    server.stderr_text()
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                panic!(
                    "loopd not ready after {:?} (expected stdout lines containing {:?} {:?}): {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                    self.ready_timeout,
                    want_unix,
                    want_tcp,
                    server.desc,
                    server.stdout_lines.lock().unwrap().join("\n"),
                    server.stderr_text()
                );
            }
            match rx.recv_timeout((deadline - now).min(Duration::from_millis(50))) {
                Ok(line) => {
                    if let Some(u) = &want_unix {
                        seen_unix |= line.contains(u.as_str());
                    }
                    if let Some(u) = &want_tcp {
                        seen_tcp |= line.contains(u.as_str());
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // stdout closed; the exit check above reports it.
                    thread::sleep(Duration::from_millis(20));
                }
            }
        }
        if self.ready_on_control {
            let line = server
                .stdout_lines
                .lock()
                .unwrap()
                .iter()
                .find_map(|l| l.strip_prefix("control: ").map(PathBuf::from));
            server.control = line;
        }
        Ok(server)
    }
}

impl Server {
    /// Starts configuring a server for `image`.
    pub fn builder(image: &Path) -> ServerBuilder {
        ServerBuilder {
            image: Some(image.to_path_buf()),
            ready_on_control: false,
            args: Vec::new(),
            unix: true,
            tcp: false,
            name: None,
            socket_path: None,
            limits: ChildLimits::default(),
            default_state: false,
            envs: Vec::new(),
            ready_timeout: READY_TIMEOUT,
            cwd: None,
        }
    }

    /// Starts configuring `loopd serve` without an image (a daemon that starts
    /// with no default device; devices come from --config, the state file or
    /// `loopd attach`).  It counts as ready once it printed `control: PATH`.
    pub fn daemon() -> ServerBuilder {
        ServerBuilder {
            image: None,
            ready_on_control: true,
            args: Vec::new(),
            unix: true,
            tcp: false,
            name: None,
            socket_path: None,
            limits: ChildLimits::default(),
            default_state: false,
            envs: Vec::new(),
            ready_timeout: READY_TIMEOUT,
            cwd: None,
        }
    }

    /// Starts a Unix-socket server for `image` with the given combination.
    pub fn start(image: &Path, combo: Combo) -> Server {
        Server::builder(image).combo(combo).start()
    }
}
