//! A throwaway Ceph cluster for the RBD tests: [`ceph()`] and what a test does
//! with it — create, write, export, snapshot and remove RBD images through the
//! `rbd` CLI, pause the OSD, stop the monitor.
//!
//! Which cluster: `$LOOPD_TEST_CEPH_DIR`, when set, names a running cluster of
//! `scripts/ceph-cluster.sh` (`scripts/test.sh` starts one for the whole run and
//! exports it to every test). Otherwise the first call to [`ceph()`] in a test
//! binary starts a cluster of the binary's own with that script, in a temporary
//! directory (~10 s), and every later call shares it. That cluster is stopped
//! by PID and its directory removed when the binary exits: a `libc::atexit`
//! handler runs `scripts/ceph-cluster.sh stop` (the test harness leaves through
//! `exit`, also after a failed test). Should the binary die without running it
//! (SIGKILL, abort), the script's watcher (`start --owner PID`) stops the
//! cluster within a second.
//!
//! A missing `ceph-mon` (or `ceph-osd`, `rbd`) fails the test with a message
//! naming the Debian package; it is never a skip. A cluster that cannot start
//! fails every test that asks for it, with the script's error (the daemons' log
//! tails), once per test rather than starting again.
//!
//! The cluster is shared by every test of the binary (and of the run, under
//! `scripts/test.sh`): image names must be unique (the caller's job; see
//! [`unique_image_name`]). [`Ceph::pause_osd`] and [`Ceph::stop_mon`] disrupt
//! every user of the cluster while their guard lives: the I/O of other tests
//! waits meanwhile (librbd retries; nothing fails unless it has a timeout
//! shorter than the outage). Within one binary, two OSD pauses (or two monitor
//! outages) never overlap: each guard holds a lock for its kind.
//!
//! Every `rbd` command is killed after [`RBD_TIMEOUT`] (the test then fails with
//! the command line).
//!
//! In the VM of `scripts/vm-test.sh` (a `kernel_*` suite over an RBD image): the
//! guest has no network device, only a loopback of its own, so the host's
//! cluster (on the host's 127.0.0.1) is out of reach, and `LOOPD_TEST_CEPH_DIR`
//! is not passed in. [`ceph()`] starts a cluster inside the guest instead: the
//! daemons run from the shared root, the cluster's directory is on the guest's
//! tmpfs `TMPDIR` (BlueStore opens its block file `O_DIRECT`, which tmpfs takes
//! since Linux 6.6; the VM runs 6.12). Under QEMU TCG that start takes ~100 s,
//! so the start limit is 300 s there, and one client command of the script may
//! take 90 s (20 s was too little for `ceph osd pool create` on a loaded host).
//! `tests/kernel_rbd.rs` runs over that cluster.

use std::ffi::OsString;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use super::tools::{describe, tool_path_env, which};

/// Time limit of one `rbd` command.
pub const RBD_TIMEOUT: Duration = Duration::from_secs(120);

/// Time limit of `scripts/ceph-cluster.sh start`: the script's own limit
/// (`$CEPH_CLUSTER_START_TIMEOUT`, default 60 s; it reports the daemons' logs)
/// and 90 s for its bounded steps past it. This only catches a script that hangs.
fn start_timeout() -> Duration {
    Duration::from_secs(script_start_limit().saturating_add(90))
}

/// The script's start limit in seconds: `$CEPH_CLUSTER_START_TIMEOUT`, else
/// 60, or 300 inside the VM of `scripts/vm-test.sh` (`$LOOPD_VM_9P_DIR` set),
/// where QEMU TCG takes ~100 s to start the cluster.
fn script_start_limit() -> u64 {
    std::env::var("CEPH_CLUSTER_START_TIMEOUT")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(if std::env::var_os("LOOPD_VM_9P_DIR").is_some() {
            300
        } else {
            60
        })
}

/// The script's limit for one client command (`$CEPH_CLUSTER_CMD_TIMEOUT`):
/// as set, else its default (20 s), or 90 s inside the VM, where a `ceph`
/// command under TCG on a loaded host took longer than 20 s.
fn script_cmd_limit() -> Option<String> {
    std::env::var("CEPH_CLUSTER_CMD_TIMEOUT")
        .ok()
        .or_else(|| std::env::var_os("LOOPD_VM_9P_DIR").map(|_| "90".to_string()))
}

/// `scripts/ceph-cluster.sh WHAT DIR` with the time limits of [`script_start_limit`]
/// and [`script_cmd_limit`].
fn script_command(what: &str, dir: &Path) -> Command {
    let mut cmd = Command::new(SCRIPT);
    cmd.env(
        "CEPH_CLUSTER_START_TIMEOUT",
        script_start_limit().to_string(),
    );
    if let Some(t) = script_cmd_limit() {
        cmd.env("CEPH_CLUSTER_CMD_TIMEOUT", t);
    }
    cmd.arg(what).arg(dir);
    cmd
}

/// The script that starts and stops clusters.
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ceph-cluster.sh");

/// A running test cluster (see the module doc).
pub struct Ceph {
    /// The cluster's directory (its daemons' PIDs, logs, data).
    pub dir: PathBuf,
    /// Its configuration file (`-c`, `--ceph-conf`, `CEPH_CONF`); it names the
    /// admin keyring.
    pub conf: PathBuf,
    /// The client id of the admin user (`--id`, `--ceph-id`).
    pub id: &'static str,
    /// The pool every image lives in.
    pub pool: &'static str,
    osd_pause: Mutex<()>,
    mon_outage: Mutex<()>,
}

static CEPH: OnceLock<Result<Ceph, String>> = OnceLock::new();
/// The directory of the cluster this binary started (for the atexit handler).
static OWNED_DIR: OnceLock<PathBuf> = OnceLock::new();

/// The test cluster (started on first use unless `$LOOPD_TEST_CEPH_DIR` names
/// one). Panics, with the reason, when there is none and none can be started.
pub fn ceph() -> &'static Ceph {
    match CEPH.get_or_init(join_or_start) {
        Ok(c) => c,
        Err(e) => panic!("no Ceph test cluster: {e}"),
    }
}

/// An image name no other test (of this run) uses: `PREFIX-PID-N`.
pub fn unique_image_name(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn require_ceph_tools() -> Result<(), String> {
    for (tool, package) in [
        ("ceph-mon", "ceph-mon"),
        ("ceph-osd", "ceph-osd"),
        ("rbd", "ceph-common"),
        ("ceph", "ceph-common"),
    ] {
        if which(tool).is_none() {
            return Err(format!(
                "{tool} not found: the RBD tests need a Ceph cluster; install the Debian package \
                 {package} (scripts/install-test-deps.sh, as root, installs ceph-mon ceph-osd \
                 ceph-common)"
            ));
        }
    }
    Ok(())
}

fn join_or_start() -> Result<Ceph, String> {
    require_ceph_tools()?;
    let dir = match std::env::var_os("LOOPD_TEST_CEPH_DIR") {
        Some(d) if !d.is_empty() => {
            let dir = fs::canonicalize(&d).unwrap_or_else(|_| PathBuf::from(&d));
            if !dir.join("ceph.conf").is_file() {
                return Err(format!(
                    "LOOPD_TEST_CEPH_DIR={} has no ceph.conf (start a cluster there with \
                     scripts/ceph-cluster.sh start DIR, or unset it)",
                    dir.display()
                ));
            }
            dir
        }
        _ => start_own()?,
    };
    let c = Ceph {
        conf: dir.join("ceph.conf"),
        dir,
        id: "admin",
        pool: "rbd",
        osd_pause: Mutex::new(()),
        mon_outage: Mutex::new(()),
    };
    // The cluster answers (a shared one may have died). Not through `rbd()`,
    // which panics on a timeout: an error here is reported to every caller.
    let out = run_bytes(c.rbd_command(&["ls", "--pool", c.pool]), RBD_TIMEOUT)
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "the cluster in {} does not answer `rbd ls`: {}",
            c.dir.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(c)
}

/// Starts this binary's own cluster in a temporary directory, stopped at exit.
fn start_own() -> Result<PathBuf, String> {
    let dir = tempfile::Builder::new()
        .prefix("loopd-ceph")
        .tempdir()
        .map_err(|e| format!("cannot create a temporary directory: {e}"))?
        .keep();
    let dir = fs::canonicalize(&dir).unwrap_or(dir);
    let _ = OWNED_DIR.set(dir.clone());
    // SAFETY: `stop_own_cluster` is an `extern "C" fn()` that never unwinds
    // (it catches every panic) and only reads a static set just above.
    if unsafe { libc::atexit(stop_own_cluster) } != 0 {
        let _ = fs::remove_dir_all(&dir);
        return Err("atexit failed: the cluster could not be stopped at exit".into());
    }
    let started = Instant::now();
    let mut cmd = script_command("start", &dir);
    cmd.arg("--owner").arg(std::process::id().to_string());
    let out = run_bytes(cmd, start_timeout()).map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "{SCRIPT} start {} failed ({}):\n{}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    eprintln!(
        "ceph test cluster started in {:.1} s in {} (stopped at exit)",
        started.elapsed().as_secs_f64(),
        dir.display()
    );
    Ok(dir)
}

extern "C" fn stop_own_cluster() {
    let _ = std::panic::catch_unwind(|| {
        let Some(dir) = OWNED_DIR.get() else { return };
        let mut cmd = Command::new(SCRIPT);
        cmd.arg("stop").arg(dir);
        match run_bytes(cmd, Duration::from_secs(60)) {
            Ok(out) if out.status.success() => {
                let _ = fs::remove_dir_all(dir);
            }
            Ok(out) => eprintln!(
                "stopping the ceph test cluster in {} failed ({}): {}",
                dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("stopping the ceph test cluster: {e}"),
        }
    });
}

/// A command that could not start or ran past its time limit (it was killed).
#[derive(Debug)]
struct RunError(String);

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Runs `cmd` (in a process group of its own, stdin null) to completion and
/// returns its output as bytes; kills the group and returns an error after
/// `timeout`.
fn run_bytes(mut cmd: Command, timeout: Duration) -> Result<Output, RunError> {
    use std::os::unix::process::CommandExt;
    let desc = describe(&cmd);
    cmd.env("PATH", tool_path_env())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd
        .spawn()
        .map_err(|e| RunError(format!("cannot start {desc}: {e}")))?;
    let drain = |r: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out_h = drain(child.stdout.take().map(|r| Box::new(r) as _));
    let err_h = drain(child.stderr.take().map(|r| Box::new(r) as _));
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) => {}
            Err(e) => return Err(RunError(format!("waiting for {desc}: {e}"))),
        }
        if start.elapsed() > timeout {
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill(2) has no memory-safety preconditions; -pid is
                // the process group this unreaped child leads.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
            }
            let _ = child.wait();
            return Err(RunError(format!(
                "command timed out after {timeout:?} (killed): {desc}"
            )));
        }
        thread::sleep(Duration::from_millis(5));
    };
    Ok(Output {
        status,
        stdout: out_h.join().unwrap_or_default(),
        stderr: err_h.join().unwrap_or_default(),
    })
}

/// Panics with the command's stderr unless it succeeded.
fn check(what: &str, out: Output) -> Output {
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// The PID in `DIR/NAME.pid`, if that process is alive and runs with this
/// cluster's configuration (a recycled PID is never signalled).
fn daemon_pid(dir: &Path, name: &str) -> Option<libc::pid_t> {
    let pid: libc::pid_t = fs::read_to_string(dir.join(format!("{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let conf = dir.join("ceph.conf");
    let ours = cmdline
        .split(|&b| b == 0)
        .any(|arg| arg == conf.as_os_str().as_encoded_bytes());
    ours.then_some(pid)
}

fn signal(pid: libc::pid_t, sig: libc::c_int) -> std::io::Result<()> {
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` was just checked
    // to be this cluster's daemon (daemon_pid).
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The rbd "diff v1" stream that writes `bytes` at `offset` (ceph's
/// doc/dev/rbd-diff.rst): a header, data records of at most 4 MiB, the end.
fn diff_v1(offset: u64, bytes: &[u8]) -> Vec<u8> {
    const CHUNK: usize = 4 << 20;
    let mut v = Vec::with_capacity(bytes.len() + 64);
    v.extend_from_slice(b"rbd diff v1\n");
    let mut at = offset;
    for chunk in bytes.chunks(CHUNK) {
        let len = chunk.len() as u64;
        v.push(b'w');
        v.extend_from_slice(&at.to_le_bytes());
        v.extend_from_slice(&len.to_le_bytes());
        v.extend_from_slice(chunk);
        at += len;
    }
    v.push(b'e');
    v
}

impl Ceph {
    /// `POOL/NAME` (NAME may end in `@SNAP`), as the `rbd` CLI spells an image.
    pub fn image_spec(&self, name: &str) -> String {
        format!("{}/{}", self.pool, name)
    }

    /// `rbd:POOL/NAME`, as loopd is given the image.
    pub fn loopd_image(&self, name: &str) -> String {
        format!("rbd:{}/{}", self.pool, name)
    }

    /// Runs `rbd -c CONF --id admin ARGS…` (killed after [`RBD_TIMEOUT`]:
    /// the test fails) and returns its output whatever its exit status.
    pub fn rbd(&self, args: &[&str]) -> Output {
        self.rbd_timeout(RBD_TIMEOUT, args)
    }

    /// [`Ceph::rbd`] with a time limit of the caller's.
    pub fn rbd_timeout(&self, timeout: Duration, args: &[&str]) -> Output {
        run_bytes(self.rbd_command(args), timeout).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `rbd -c CONF --id admin ARGS…` (`rbd` is on the path: checked when the
    /// cluster was joined).
    fn rbd_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(which("rbd").unwrap_or_else(|| PathBuf::from("rbd")));
        cmd.arg("-c")
            .arg(&self.conf)
            .args(["--id", self.id])
            .args(args);
        cmd
    }

    /// Creates image `name` of `size` bytes (format 2, the defaults' features).
    pub fn create_image(&self, name: &str, size: u64) {
        self.create_image_with(name, size, &[]);
    }

    /// Creates image `name` of `size` bytes with more `rbd create` arguments
    /// (`--object-size 64K`, `--image-feature layering`, …).
    pub fn create_image_with(&self, name: &str, size: u64, extra_args: &[&str]) {
        let size = format!("{size}B");
        let spec = self.image_spec(name);
        let mut args = vec!["create", "--size", &size];
        args.extend_from_slice(extra_args);
        args.push(&spec);
        check(&format!("rbd create {spec}"), self.rbd(&args));
    }

    /// The size of image `name` in bytes, or `None` if there is no such image.
    pub fn image_size(&self, name: &str) -> Option<u64> {
        let spec = self.image_spec(name);
        let out = self.rbd(&["info", "--format", "json", &spec]);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            if err.contains("No such file or directory") {
                return None;
            }
            panic!("rbd info {spec} failed ({}):\n{err}", out.status);
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("rbd info {spec}: not JSON: {e}"));
        Some(
            v["size"]
                .as_u64()
                .unwrap_or_else(|| panic!("rbd info {spec}: no size in {v}")),
        )
    }

    /// Writes `bytes` at offset 0 of image `name`; creates the image
    /// (`bytes.len()` bytes) if there is none. See [`Ceph::write_image_at`].
    pub fn write_image(&self, name: &str, bytes: &[u8]) {
        self.write_image_at(name, 0, bytes);
    }

    /// Writes `bytes` at `offset` of image `name` through `rbd import-diff`
    /// (the rest of an existing image is untouched, its size unchanged;
    /// panics on a write past its end). A missing image is created first,
    /// `offset + bytes.len()` bytes. The image must not be open elsewhere
    /// with an exclusive lock (a serving loopd): stop that first.
    pub fn write_image_at(&self, name: &str, offset: u64, bytes: &[u8]) {
        let end = offset
            .checked_add(bytes.len() as u64)
            .expect("offset + length overflows");
        match self.image_size(name) {
            None => self.create_image(name, end),
            Some(size) if end > size => {
                panic!("write_image_at {name}: [{offset}, {end}) is past the image's end ({size})")
            }
            Some(_) => {}
        }
        let tmp = tempfile::NamedTempFile::new().expect("temporary diff file");
        fs::write(tmp.path(), diff_v1(offset, bytes)).expect("write the diff file");
        let path = tmp.path().to_str().expect("utf-8 temp path");
        let spec = self.image_spec(name);
        check(
            &format!("rbd import-diff {spec}"),
            self.rbd(&["import-diff", "--no-progress", path, &spec]),
        );
    }

    /// Every byte of image `name` (or `name@snap`), through `rbd export … -`.
    pub fn export_image(&self, name: &str) -> Vec<u8> {
        let spec = self.image_spec(name);
        check(
            &format!("rbd export {spec}"),
            self.rbd(&["export", "--no-progress", &spec, "-"]),
        )
        .stdout
    }

    /// Removes image `name` and its snapshots.
    pub fn remove_image(&self, name: &str) {
        let spec = self.image_spec(name);
        check(
            &format!("rbd snap purge {spec}"),
            self.rbd(&["snap", "purge", "--no-progress", &spec]),
        );
        check(
            &format!("rbd rm {spec}"),
            self.rbd(&["rm", "--no-progress", &spec]),
        );
    }

    /// Takes snapshot `snap` of image `name` (`name@snap` afterwards).
    pub fn snap_create(&self, name: &str, snap: &str) {
        let spec = format!("{}@{snap}", self.image_spec(name));
        check(
            &format!("rbd snap create {spec}"),
            self.rbd(&["snap", "create", "--no-progress", &spec]),
        );
    }

    /// The OSD's PID (panics if it is not running).
    pub fn osd_pid(&self) -> libc::pid_t {
        daemon_pid(&self.dir, "osd")
            .unwrap_or_else(|| panic!("the OSD of {} is not running", self.dir.display()))
    }

    /// The monitor's PID, if it is running.
    pub fn mon_pid(&self) -> Option<libc::pid_t> {
        daemon_pid(&self.dir, "mon")
    }

    /// Stops the OSD with SIGSTOP: every read and write of every client waits
    /// (nothing fails) until it is resumed — when the guard drops, or by
    /// [`Ceph::resume_osd`]. Waits for another pause of this binary to end.
    #[must_use = "the OSD is resumed when the guard drops"]
    pub fn pause_osd(&self) -> OsdPaused<'_> {
        let lock = self.osd_pause.lock().unwrap_or_else(|e| e.into_inner());
        let pid = self.osd_pid();
        signal(pid, libc::SIGSTOP).unwrap_or_else(|e| panic!("SIGSTOP osd {pid}: {e}"));
        OsdPaused {
            ceph: self,
            _lock: lock,
        }
    }

    /// Continues the OSD (SIGCONT; harmless when it is not paused).
    pub fn resume_osd(&self) {
        let pid = self.osd_pid();
        signal(pid, libc::SIGCONT).unwrap_or_else(|e| panic!("SIGCONT osd {pid}: {e}"));
    }

    /// Stops the monitor (by PID: SIGTERM, waited for): clients that are not
    /// connected yet cannot connect, connected ones keep their OSD sessions. It
    /// starts again when the guard drops, or by [`Ceph::start_mon`]. Waits for
    /// another outage of this binary to end.
    #[must_use = "the monitor is started again when the guard drops"]
    pub fn stop_mon(&self) -> MonStopped<'_> {
        let lock = self.mon_outage.lock().unwrap_or_else(|e| e.into_inner());
        self.script("stop-mon").unwrap_or_else(|e| panic!("{e}"));
        MonStopped {
            ceph: self,
            _lock: lock,
        }
    }

    /// Starts the monitor unless it is running, and waits (bounded) until it
    /// answers.
    pub fn start_mon(&self) {
        self.script("start-mon").unwrap_or_else(|e| panic!("{e}"));
    }

    fn script(&self, what: &str) -> Result<(), String> {
        let cmd = script_command(what, &self.dir);
        let out = run_bytes(cmd, start_timeout()).map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{SCRIPT} {what} {} failed ({}):\n{}",
                self.dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// The args a loopd command line needs for this cluster:
    /// `--ceph-conf CONF --ceph-id admin`.
    pub fn loopd_args(&self) -> Vec<OsString> {
        vec![
            "--ceph-conf".into(),
            self.conf.clone().into_os_string(),
            "--ceph-id".into(),
            self.id.into(),
        ]
    }
}

/// The OSD is paused while this lives (see [`Ceph::pause_osd`]).
pub struct OsdPaused<'a> {
    ceph: &'a Ceph,
    _lock: MutexGuard<'a, ()>,
}

impl Drop for OsdPaused<'_> {
    fn drop(&mut self) {
        match daemon_pid(&self.ceph.dir, "osd") {
            Some(pid) => {
                if let Err(e) = signal(pid, libc::SIGCONT) {
                    eprintln!("SIGCONT osd {pid}: {e}");
                }
            }
            None => eprintln!("the paused OSD of {} is gone", self.ceph.dir.display()),
        }
    }
}

/// The monitor is stopped while this lives (see [`Ceph::stop_mon`]).
pub struct MonStopped<'a> {
    ceph: &'a Ceph,
    _lock: MutexGuard<'a, ()>,
}

impl Drop for MonStopped<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.ceph.script("start-mon") {
            eprintln!("{e}");
        }
    }
}

/// An image of the test cluster for one test: made with a unique name,
/// removed (with its snapshots) when dropped.
pub struct CephImage {
    pub name: String,
}

impl CephImage {
    pub fn new(prefix: &str, size: u64) -> CephImage {
        let name = unique_image_name(prefix);
        ceph().create_image(&name, size);
        CephImage { name }
    }

    /// `rbd:rbd/NAME`, as loopd is given it.
    pub fn spec(&self) -> String {
        ceph().loopd_image(&self.name)
    }

    /// Every byte of the image, as `rbd export` reads it.
    pub fn export(&self) -> Vec<u8> {
        ceph().export_image(&self.name)
    }

    /// `rbd resize` by the `rbd` CLI (a client of its own); `shrink` adds
    /// `--allow-shrink`.
    pub fn resize(&self, size: u64, shrink: bool) {
        let size = format!("{size}B");
        let spec = ceph().image_spec(&self.name);
        let mut args = vec!["resize", "--no-progress", "--size", &size];
        if shrink {
            args.push("--allow-shrink");
        }
        args.push(&spec);
        let out = ceph().rbd(&args);
        assert!(
            out.status.success(),
            "rbd {}: {}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for CephImage {
    fn drop(&mut self) {
        let spec = ceph().image_spec(&self.name);
        let _ = ceph().rbd(&["snap", "purge", "--no-progress", &spec]);
        let _ = ceph().rbd(&["rm", "--no-progress", &spec]);
    }
}
