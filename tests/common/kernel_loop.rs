//! Kernel loop devices attached with `loopd kernel attach`: sysfs reads and a
//! guard that detaches only a device still backed by the test's image.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::server::{loopd_bin, loopd_run};
use super::tools::{Out, run_cmd_timeout, run_status};

/// The loop number of `/dev/loopN`.
pub fn loop_number(dev: &Path) -> u32 {
    dev.to_str()
        .and_then(|s| s.strip_prefix("/dev/loop"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{} is not /dev/loopN", dev.display()))
}

/// `/sys/block/loopN/REL`, trimmed; `None` if it does not exist.
pub fn loop_sysfs(dev: &Path, rel: &str) -> Option<String> {
    fs::read_to_string(format!("/sys/block/loop{}/{rel}", loop_number(dev)))
        .ok()
        .map(|s| s.trim().to_string())
}

/// A kernel loop device this test attached.  Dropping it detaches the
/// device — but only while it is still backed by this test's image, so a
/// device number reused by someone else is never touched.
pub struct KernelLoop {
    pub dev: PathBuf,
    pub image: PathBuf,
}

impl KernelLoop {
    /// `loopd kernel attach IMAGE ARGS`: asserts success and returns a guard.
    /// The guard is created as soon as a device path is printed, before any
    /// other assertion, so a device is never leaked.
    #[track_caller]
    pub fn attach(image: &Path, args: &[&str]) -> (KernelLoop, Out) {
        let mut c = Command::new(loopd_bin());
        c.arg("kernel").arg("attach").arg(image).args(args);
        c.stdin(Stdio::null());
        let out = run_cmd_timeout(c, Duration::from_secs(30));
        let guard = if args.contains(&"--json") {
            out.stdout
                .lines()
                .find_map(|l| {
                    let l = l.trim();
                    let rest = l.strip_prefix("\"device\":")?;
                    Some(
                        rest.trim()
                            .trim_end_matches(',')
                            .trim_matches('"')
                            .to_string(),
                    )
                })
                .map(PathBuf::from)
        } else {
            out.stdout
                .lines()
                .next()
                .filter(|l| l.starts_with("/dev/loop"))
                .map(|l| PathBuf::from(l.trim()))
        }
        .map(|dev| KernelLoop {
            dev,
            image: image.to_path_buf(),
        });
        match guard {
            Some(g) if out.success() => (g, out),
            Some(g) => {
                drop(g);
                panic!("loopd kernel attach printed a device but failed:\n{out}")
            }
            None => panic!("loopd kernel attach failed:\n{out}"),
        }
    }

    /// Whether the device is (still) backed by this guard's image.
    pub fn is_ours(&self) -> bool {
        let Some(b) = loop_sysfs(&self.dev, "loop/backing_file") else {
            return false;
        };
        let want = fs::canonicalize(&self.image).unwrap_or_else(|_| self.image.clone());
        Path::new(&b) == want || Path::new(&b) == self.image
    }

    pub fn sysfs(&self, rel: &str) -> Option<String> {
        loop_sysfs(&self.dev, rel)
    }

    /// Size of the block device in bytes (sysfs `size` is in 512-byte sectors).
    pub fn size(&self) -> u64 {
        let sectors: u64 = self
            .sysfs("size")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no sysfs size for {}", self.dev.display()));
        sectors * 512
    }

    /// Waits (up to 5 s) until the device is no longer backed by our image
    /// (another test may already have reused the number for its own image).
    pub fn wait_detached(&self) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if !self.is_ours() {
                return true;
            }
            thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for KernelLoop {
    fn drop(&mut self) {
        if !self.is_ours() {
            return;
        }
        let out = loopd_run([
            OsStr::new("kernel"),
            OsStr::new("detach"),
            self.dev.as_os_str(),
        ]);
        if !out.success() && self.is_ours() {
            // Fall back to losetup (the device is still ours).
            let _ = run_status("losetup", [OsStr::new("-d"), self.dev.as_os_str()]);
        }
        if !self.wait_detached() {
            eprintln!(
                "warning: {} is still attached to {} after detach",
                self.dev.display(),
                self.image.display()
            );
        }
    }
}
