//! Helpers for the kernel-side suites (`tests/kernel_*.rs`, feature `vm-tests`),
//! which run as root inside the VM that `scripts/vm-test.sh` boots.
//!
//! Every resource is a guard that releases it on drop, also when the test
//! panics: [`NbdDev`] disconnects its `/dev/nbdN`, [`Mount`] unmounts. Declare
//! them in use order (server, then device, then mount) so that Rust drops them
//! in the reverse, safe order. Nothing is ever found or cleaned up by name:
//! a device is the one this guard connected, a mount the one it mounted.
//!
//! A missing kernel module or tool panics with what to do; nothing is skipped.

use super::{Out, require_tool};
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one external command (mkfs, mount, fio, ...) may take under TCG.
pub const KCMD_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs `name args` (killed after `timeout`) and panics with its output unless
/// it exits 0.
#[track_caller]
pub fn sh<I, S>(timeout: Duration, name: &str, args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    sh_status(timeout, name, args).assert_success()
}

/// Runs `name args` (killed after `timeout`), whatever its exit status.
pub use super::run_status_timeout as sh_status;

/// Panics unless the kernel module `module` is loaded (the runner loads
/// `nbd` and `ublk_drv`; a test never loads modules behind the user's back).
pub fn require_module(module: &str) {
    if !Path::new("/sys/module").join(module).exists() {
        panic!(
            "kernel module {module} is not loaded: run 'modprobe {module}' \
             (scripts/vm-test.sh does, inside its VM)"
        );
    }
}

/// Panics unless running as root (block devices, mounts).
pub fn require_root() {
    if rustix::process::geteuid().as_raw() != 0 {
        panic!("the kernel-side tests need root (run them with scripts/vm-test.sh)");
    }
}

/// The running kernel's release (`uname -r`), e.g. `6.12.95+deb12-amd64`.
/// `scripts/vm-test.sh` runs every suite under two kernels (6.12 and the
/// newest of Debian's backports); a test whose kernel behaviour differs
/// between them asks [`kernel_at_least`] and checks what that kernel does.
pub fn kernel_release() -> String {
    sysfs("/proc/sys/kernel/osrelease").expect("/proc/sys/kernel/osrelease")
}

/// Whether the running kernel's release is at least `major.minor`.
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let rel = kernel_release();
    let mut parts = rel
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let have = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    have >= (major, minor)
}

/// Reads a sysfs attribute, trimmed; `None` if it does not exist.
pub fn sysfs(path: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Whether the block device `dev` is gone (ublk: no node; nbd: the node
/// stays, disconnected: size 0).
pub fn gone(dev: &Path) -> bool {
    !dev.exists() || sysblock(dev, "size") == "0"
}

/// `/sys/block/NAME/ATTR` of the block device `dev` (panics when missing).
pub fn sysblock(dev: &Path, attr: &str) -> String {
    let name = dev.file_name().expect("device name").to_string_lossy();
    sysfs(format!("/sys/block/{name}/{attr}"))
        .unwrap_or_else(|| panic!("/sys/block/{name}/{attr} missing"))
}

/// The size of the block device `dev` in bytes, as the kernel sees it.
pub fn dev_size(dev: &Path) -> u64 {
    sysblock(dev, "size").parse::<u64>().expect("size") * 512
}

/// `md5sum` of `path` (a file or a block device).
pub fn md5(path: &Path) -> String {
    let out = sh(KCMD_TIMEOUT, "md5sum", [path]);
    out.stdout
        .split_whitespace()
        .next()
        .expect("md5")
        .to_string()
}

/// `dd` of `mib` MiB of random bytes into `path`, fsync'ed.
pub fn write_random(path: &Path, mib: u32) {
    sh(
        KCMD_TIMEOUT,
        "dd",
        [
            "if=/dev/urandom".to_string(),
            format!("of={}", path.display()),
            "bs=1M".into(),
            format!("count={mib}"),
            "conv=fsync".into(),
            "status=none".into(),
        ],
    );
}

/// Drop the page cache (and dentries, inodes), so reads reach the device.
pub fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches");
}

/// Serialises picking and connecting an NBD device between test threads.
static NBD_PICK: Mutex<()> = Mutex::new(());

/// A kernel NBD device connected by `nbd-client` to a Unix socket; dropping
/// it runs `nbd-client -d` on it (and waits until the kernel let go).
pub struct NbdDev {
    dev: PathBuf,
    index: u32,
}

/// What [`NbdDev::connect`] passes to `nbd-client`.
#[derive(Clone, Debug)]
pub struct NbdClientOpts<'a> {
    pub socket: &'a Path,
    pub name: &'a str,
    /// `-b`: the device's logical block size.
    pub block_size: u32,
}

impl NbdDev {
    /// Connects the first free `/dev/nbdN` with `nbd-client -unix SOCK -N NAME
    /// -b BS /dev/nbdN` and waits until the device has its size.
    pub fn connect(o: &NbdClientOpts<'_>) -> NbdDev {
        let bs = o.block_size.to_string();
        NbdDev::connect_with(&[
            OsStr::new("-unix"),
            o.socket.as_os_str(),
            OsStr::new("-N"),
            OsStr::new(o.name),
            OsStr::new("-b"),
            OsStr::new(&bs),
        ])
    }

    /// Connects the first free `/dev/nbdN` with `nbd-client ARGS... /dev/nbdN`
    /// (any transport, TLS files, ...; the device goes last) and waits until
    /// the device has its size.
    pub fn connect_with(args: &[&OsStr]) -> NbdDev {
        require_module("nbd");
        require_tool("nbd-client");
        let _g = NBD_PICK.lock().unwrap_or_else(|e| e.into_inner());
        let mut tried = Vec::new();
        for index in 0..nbds_max() {
            if !nbd_is_free(index) {
                continue;
            }
            let dev = PathBuf::from(format!("/dev/nbd{index}"));
            let out = sh_status(
                KCMD_TIMEOUT,
                "nbd-client",
                args.iter().copied().chain([dev.as_os_str()]),
            );
            if !out.success() {
                // Another process may have taken it between the check and the
                // connect; try the next one, and report all if none works.
                tried.push(out.to_string());
                continue;
            }
            let d = NbdDev { dev, index };
            d.wait_sized();
            return d;
        }
        panic!(
            "no free /dev/nbdN could be connected (nbds_max {}):\n{}",
            nbds_max(),
            tried.join("\n")
        );
    }

    pub fn path(&self) -> &Path {
        &self.dev
    }

    /// The device's sysfs attribute `name` (`/sys/block/nbdN/NAME`), trimmed.
    pub fn attr(&self, name: &str) -> Option<String> {
        sysfs(format!("/sys/block/nbd{}/{name}", self.index))
    }

    /// The device's size in bytes, as the kernel sees it.
    pub fn size(&self) -> u64 {
        let sectors: u64 = self.attr("size").and_then(|s| s.parse().ok()).unwrap_or(0);
        sectors * 512
    }

    fn wait_sized(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.size() == 0 {
            if Instant::now() > deadline {
                panic!(
                    "{} has no size 30 s after nbd-client returned",
                    self.dev.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Disconnects now (the drop does it otherwise), panicking if it fails.
    pub fn disconnect(mut self) {
        let r = self.try_disconnect();
        self.dev = PathBuf::new();
        if let Err(e) = r {
            panic!("{e}");
        }
    }

    fn try_disconnect(&mut self) -> Result<(), String> {
        let out = sh_status(
            KCMD_TIMEOUT,
            "nbd-client",
            [OsStr::new("-d"), self.dev.as_os_str()],
        );
        if !out.success() {
            return Err(format!("nbd-client -d failed: {out}"));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !nbd_is_free(self.index) {
            if Instant::now() > deadline {
                return Err(format!(
                    "{} still connected 30 s after nbd-client -d",
                    self.dev.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Drop for NbdDev {
    fn drop(&mut self) {
        if self.dev.as_os_str().is_empty() {
            return;
        }
        if let Err(e) = self.try_disconnect() {
            eprintln!("cleanup: {e}");
            if !std::thread::panicking() {
                panic!("{e}");
            }
        }
    }
}

/// How many NBD devices the module made (`nbds_max`, 16 by default).
fn nbds_max() -> u32 {
    sysfs("/sys/module/nbd/parameters/nbds_max")
        .and_then(|s| s.parse().ok())
        .unwrap_or(16)
}

/// The first `/dev/nbdN` that [`nbd_is_free`], if any.
pub fn first_free_nbd() -> Option<u32> {
    (0..nbds_max()).find(|&i| nbd_is_free(i))
}

/// A device is free when no client task holds it (`pid` absent) and it has no size.
pub fn nbd_is_free(index: u32) -> bool {
    let base = PathBuf::from(format!("/sys/block/nbd{index}"));
    base.exists()
        && !base.join("pid").exists()
        && sysfs(base.join("size")).is_some_and(|s| s == "0")
}

/// A mounted filesystem; dropping it unmounts (retrying while busy).
pub struct Mount {
    dir: PathBuf,
}

impl Mount {
    /// `mount [-o OPTS] DEV DIR` (DIR is created).
    pub fn new(dev: &Path, dir: &Path, opts: Option<&str>) -> Mount {
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let mut args: Vec<&OsStr> = Vec::new();
        if let Some(o) = opts {
            args.extend([OsStr::new("-o"), OsStr::new(o)]);
        }
        args.extend([dev.as_os_str(), dir.as_os_str()]);
        sh(KCMD_TIMEOUT, "mount", args);
        Mount {
            dir: dir.to_path_buf(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Unmounts now (the drop does it otherwise), panicking if it fails.
    pub fn unmount(mut self) {
        let r = self.try_unmount();
        self.dir = PathBuf::new();
        if let Err(e) = r {
            panic!("{e}");
        }
    }

    fn try_unmount(&mut self) -> Result<(), String> {
        let mut last = None;
        for _ in 0..20 {
            let out = sh_status(KCMD_TIMEOUT, "umount", [self.dir.as_os_str()]);
            if out.success() {
                return Ok(());
            }
            last = Some(out);
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(format!(
            "cannot unmount {}: {}",
            self.dir.display(),
            last.map(|o| o.to_string()).unwrap_or_default()
        ))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.dir.as_os_str().is_empty() {
            return;
        }
        if let Err(e) = self.try_unmount() {
            eprintln!("cleanup: {e}");
            if !std::thread::panicking() {
                panic!("{e}");
            }
        }
    }
}

/// Bytes the file occupies on disk (`st_blocks` × 512).
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .blocks()
        * 512
}

/// The type of the filesystem mounted at or above `path` (`/proc/self/mountinfo`,
/// the longest mount point that is a prefix of the canonical path). `statfs`
/// cannot tell: 9p reports the host filesystem's magic.
pub fn fs_type(path: &Path) -> String {
    let path =
        fs::canonicalize(path).unwrap_or_else(|e| panic!("canonicalize {}: {e}", path.display()));
    let info = fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    let mut best: Option<(usize, String)> = None;
    for line in info.lines() {
        // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        let fields: Vec<&str> = line.split(' ').collect();
        let (Some(mp), Some(dash)) = (fields.get(4), fields.iter().position(|f| *f == "-")) else {
            continue;
        };
        let Some(fstype) = fields.get(dash + 1) else {
            continue;
        };
        let mp = mp.replace("\\040", " ");
        if path.starts_with(&mp) && best.as_ref().is_none_or(|(len, _)| mp.len() >= *len) {
            best = Some((mp.len(), (*fstype).to_string()));
        }
    }
    best.map(|(_, t)| t)
        .unwrap_or_else(|| panic!("no mount holds {}", path.display()))
}

/// `mkfs.ext4` with no lazy initialisation, so nothing writes in the background
/// after mount (which would disturb allocation counts).
pub fn mkfs_ext4(dev: &Path) {
    sh(
        KCMD_TIMEOUT,
        "mkfs.ext4",
        [
            OsStr::new("-q"),
            OsStr::new("-F"),
            OsStr::new("-E"),
            OsStr::new("lazy_itable_init=0,lazy_journal_init=0"),
            dev.as_os_str(),
        ],
    );
}

/// `loopd attach IMG --blockdev KIND ARGS`: the block device it printed.
pub fn attach_blockdev(
    srv: &crate::common::Server,
    kind: &str,
    img: &Path,
    args: &[&str],
) -> PathBuf {
    let mut a = vec![
        "attach",
        img.to_str().expect("utf-8 path"),
        "--blockdev",
        kind,
    ];
    a.extend_from_slice(args);
    attach_blockdev_with(srv, kind, &a)
}

/// Run the attach command `a` (whose `--blockdev` is `kind`): the block
/// device it printed, checked to exist and to have its size already.
pub fn attach_blockdev_with(srv: &crate::common::Server, kind: &str, a: &[&str]) -> PathBuf {
    let out = srv.ctl_ok(a);
    let prefix = if kind == "ublk" {
        "/dev/ublkb"
    } else {
        "/dev/nbd"
    };
    let dev = out
        .stdout
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("attach printed no {prefix}N:\n{out}"))
        .to_string();
    let dev = PathBuf::from(dev);
    // Printed only once it exists and serves I/O.
    let meta = std::fs::metadata(&dev).unwrap_or_else(|e| panic!("{}: {e}", dev.display()));
    use std::os::unix::fs::FileTypeExt;
    assert!(
        meta.file_type().is_block_device(),
        "{} is a block device",
        dev.display()
    );
    assert!(
        sysblock(&dev, "size").parse::<u64>().expect("size") > 0,
        "{} has its size when attach returns",
        dev.display()
    );
    dev
}

/// The strings of the JSON list `v[key]` (e.g. `ublk_fast_paths` of a status).
pub fn json_names(v: &serde_json::Value, key: &str) -> Vec<String> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} is a list: {v}"))
        .iter()
        .map(|n| n.as_str().expect("a name").to_owned())
        .collect()
}

/// `e2fsck -fn` of `target` (a block device or an image file): must be clean.
pub fn e2fsck_clean(target: &Path) {
    sh(
        KCMD_TIMEOUT,
        "e2fsck",
        [std::ffi::OsStr::new("-fn"), target.as_os_str()],
    );
}

/// The last step of a durability check: unmount `m` (of `dev`, at `mnt`),
/// drop the page cache, mount again and compare each `(file, md5)` read
/// from the disk itself; unmount, then `e2fsck -fn` must find it clean.
pub fn remount_and_check(m: Mount, dev: &Path, mnt: &Path, files: &[(&str, &str)]) {
    m.unmount();
    drop_caches();
    let m = Mount::new(dev, mnt, None);
    for (name, want) in files {
        assert_eq!(&md5(&mnt.join(name)), want, "{name} after a remount");
    }
    m.unmount();
    e2fsck_clean(dev);
}
