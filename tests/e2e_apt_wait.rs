//! The install scripts' apt wrapper (`apt_get` in scripts/apt.sh, used by
//! scripts/install-test-deps.sh, scripts/install-vm-deps.sh and
//! bench/install-deps.sh) waits for another apt or dpkg that holds its locks
//! instead of failing at once (issue 27: the README's test command must work
//! while another apt runs). Another process takes the locks as apt and dpkg
//! do (fcntl locks on the lock files) and keeps them a few seconds; `apt_get`
//! started meanwhile succeeds after they are let go. Plain `apt-get` fails at
//! once in the same situation ("Could not get lock"), which is what the
//! wrapper is for.
//!
//! The package-lists case runs `apt-get update` with no sources and a lists
//! directory of its own (nothing is downloaded; the system's lists are not
//! touched); the dpkg case runs `apt-get install` of a package that is already
//! installed (bash), which takes dpkg's frontend lock and changes nothing.

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long the other process keeps the locks.
const HOLD: Duration = Duration::from_secs(4);

/// Panics unless root: the locks are apt's and dpkg's own.
fn require_root() {
    if rustix::process::geteuid().as_raw() != 0 {
        panic!("these tests take apt's and dpkg's locks: run them as root (scripts/test.sh does)");
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A process holding write locks on `paths` (created if missing) for
/// [`HOLD`], as apt and dpkg hold theirs; returns once they are held.
struct Holder(Child);

impl Holder {
    fn start(paths: &[&Path]) -> Holder {
        let mut c = Command::new("python3");
        c.arg("-c")
            .arg(
                "import fcntl, sys, time\n\
                 fs = [open(p, 'a') for p in sys.argv[2:]]\n\
                 for f in fs: fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n\
                 print('held', flush=True)\n\
                 time.sleep(float(sys.argv[1]))\n",
            )
            .arg(HOLD.as_secs_f64().to_string())
            .args(paths)
            .stdout(Stdio::piped());
        let mut child = c.spawn().expect("python3 (the lock holder)");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the holder's line");
        if line.trim() != "held" {
            let _ = child.kill();
            let _ = child.wait();
            panic!("could not take the locks {paths:?} (is another apt running?): {line:?}");
        }
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `apt_get ARGS` from scripts/apt.sh, waiting at most 120 s; its output and
/// how long it took.
fn apt_get(args: &[&str]) -> (Out, Duration) {
    let mut c = Command::new("bash");
    c.arg("-c")
        .arg(r#"set -o pipefail; . "$1"; shift; apt_get "$@""#)
        .arg("apt_get")
        .arg(repo().join("scripts/apt.sh"))
        .args(args)
        .env("LOOPD_APT_WAIT", "120")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .env("PATH", tool_path_env());
    let start = Instant::now();
    let out = run_cmd_timeout(c, Duration::from_secs(180));
    (out, start.elapsed())
}

#[test]
fn apt_get_waits_for_the_package_lists_lock() {
    require_root();
    let lists = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(lists.path().join("partial")).expect("partial");
    let lock = lists.path().join("lock");
    let dir = format!("Dir::State::Lists={}", lists.path().display());
    let args = [
        "-o",
        dir.as_str(),
        "-o",
        "Dir::Etc::sourcelist=/dev/null",
        "-o",
        "Dir::Etc::sourceparts=/nonexistent",
        "update",
    ];
    let held = Holder::start(&[&lock]);
    let (out, took) = apt_get(&args);
    drop(held);
    let out = out.assert_success();
    assert!(
        took >= HOLD - Duration::from_millis(500),
        "apt_get update returned after {took:?}, before the lists lock was let go: {out}"
    );
    assert!(
        out.stderr.contains("lock") || out.stdout.contains("lock"),
        "it says what it waited for: {out}"
    );
}

#[test]
fn apt_get_waits_for_dpkgs_lock() {
    require_root();
    let frontend = Path::new("/var/lib/dpkg/lock-frontend");
    let lock = Path::new("/var/lib/dpkg/lock");
    let held = Holder::start(&[frontend, lock]);
    let (out, took) = apt_get(&["install", "-y", "--no-install-recommends", "bash"]);
    drop(held);
    let out = out.assert_success();
    assert!(
        took >= HOLD - Duration::from_millis(500),
        "apt_get install returned after {took:?}, before dpkg's lock was let go: {out}"
    );
}
