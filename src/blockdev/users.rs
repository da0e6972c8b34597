//! Who uses a block device: mounts (of it or its partitions), holders
//! (device-mapper, md, ...), kernel loop devices on top of it, swap on it,
//! and processes with it open. Read from `/proc/*/mountinfo` (one process
//! per mount namespace: a container's mounts count too),
//! `/sys/class/block/*/holders`, `/sys/block/loop*/loop/backing_file`,
//! `/proc/swaps` and `/proc/*/fd`; the parsing is pure and tested. Also
//! whether a process is alive (a ublk server's, a pid file's). May block
//! briefly on procfs/sysfs reads.

use std::fmt;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, Instant};

/// One user of a block device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Use {
    /// It (or one of its partitions) is mounted here.
    Mounted(String),
    /// A stacked device (device-mapper, md, ...) holds it.
    Held(String),
    /// A kernel loop device (`/dev/loopN`) has it as its backing file (no
    /// holder link, no process: only its `backing_file` tells).
    LoopOnTop(String),
    /// It (or a partition) is in use as swap.
    Swap(String),
    /// A process has it open.
    Open { comm: String, pid: u32 },
}

impl Use {
    /// Whether the use lasts until someone acts (a mount, a holder), as opposed
    /// to an opener, which may be udev probing the disk for a moment.
    pub fn lasting(&self) -> bool {
        !matches!(self, Use::Open { .. })
    }
}

impl fmt::Display for Use {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Use::Mounted(m) => write!(f, "mounted on {m}"),
            Use::Held(h) => write!(f, "held by {h}"),
            Use::LoopOnTop(l) => write!(f, "the backing file of loop device {l}"),
            Use::Swap(p) => write!(f, "in use as swap ({p})"),
            Use::Open { comm, pid } => write!(f, "open by {comm:?} (pid {pid})"),
        }
    }
}

/// `major:minor` of a device number, as sysfs and mountinfo write it.
fn majmin(rdev: u64) -> String {
    format!("{}:{}", rustix::fs::major(rdev), rustix::fs::minor(rdev))
}

/// The mount points in `mountinfo` text whose device is one of `devs`
/// (`major:minor`).
pub fn mounts_of(mountinfo: &str, devs: &[String]) -> Vec<String> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let dev = f.nth(2)?;
            let _root = f.next()?;
            let point = f.next()?;
            devs.iter().any(|d| d == dev).then(|| unescape(point))
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The whole disk and its partitions as `(name, major:minor)`, from sysfs.
fn disk_and_parts(name: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let base = Path::new("/sys/class/block").join(name);
    if let Ok(d) = fs::read_to_string(base.join("dev")) {
        out.push((name.to_owned(), d.trim().to_owned()));
    }
    if let Ok(rd) = fs::read_dir(&base) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(name)
                && let Ok(d) = fs::read_to_string(e.path().join("dev"))
            {
                out.push((n, d.trim().to_owned()));
            }
        }
    }
    out
}

/// Who uses the block device at `path` once short-lived openers are done, as
/// one line for an error message, or `None` if nobody does (as far as this
/// process can see). udev probes a disk after every change (a close after
/// writing, say), so an opener gone within `settle` is not counted; a mount or
/// a holder is reported at once.
pub fn settled_users(path: &Path, settle: Duration) -> Option<String> {
    let deadline = Instant::now() + settle;
    loop {
        let now = users(path);
        if now.is_empty() {
            return None;
        }
        if now.iter().any(Use::lasting) || Instant::now() >= deadline {
            let what: Vec<String> = now.iter().map(Use::to_string).collect();
            return Some(what.join(", "));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Who uses the block device at `path` now (empty: nobody, as far as this
/// process can see).
pub fn users(path: &Path) -> Vec<Use> {
    let Ok(meta) = fs::metadata(path) else {
        return Vec::new();
    };
    let rdev = meta.rdev();
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Vec::new();
    };
    let disks = disk_and_parts(&name);
    let mut devs: Vec<String> = disks.iter().map(|(_, d)| d.clone()).collect();
    if devs.is_empty() {
        devs.push(majmin(rdev));
    }
    let mut what = Vec::new();
    let own_ns = fs::read_link("/proc/self/ns/mnt").ok();
    if let Ok(mi) = fs::read_to_string("/proc/self/mountinfo") {
        for m in mounts_of(&mi, &devs) {
            what.push(Use::Mounted(m));
        }
    }
    what.extend(mounts_elsewhere(own_ns.as_deref(), &devs));
    for (n, _) in &disks {
        let holders = Path::new("/sys/class/block").join(n).join("holders");
        if let Ok(rd) = fs::read_dir(holders) {
            for h in rd.flatten() {
                what.push(Use::Held(h.file_name().to_string_lossy().into_owned()));
            }
        }
    }
    let rdevs: Vec<u64> = disks
        .iter()
        .filter_map(|(n, _)| {
            fs::metadata(Path::new("/dev").join(n))
                .ok()
                .map(|m| m.rdev())
        })
        .chain(std::iter::once(rdev))
        .collect();
    what.extend(loops_on_top(&rdevs));
    if let Ok(swaps) = fs::read_to_string("/proc/swaps") {
        for p in swap_paths(&swaps) {
            if is_one_of(Path::new(&p), &rdevs) {
                what.push(Use::Swap(p));
            }
        }
    }
    what.extend(openers(&rdevs));
    what
}

/// Whether process `pid` exists (a process of another user counts; 0 and
/// negative numbers, which name process groups to `kill`, are no process).
pub fn process_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    let Some(p) = rustix::process::Pid::from_raw(pid) else {
        return false;
    };
    match rustix::process::test_kill_process(p) {
        Ok(()) => true,
        Err(e) => e != rustix::io::Errno::SRCH,
    }
}

/// Every process now, as its pid and `/proc/PID` (those that end meanwhile
/// fail their reads and are passed over by the callers).
fn processes() -> impl Iterator<Item = (u32, std::path::PathBuf)> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|p| {
            let pid = p.file_name().to_string_lossy().parse::<u32>().ok()?;
            Some((pid, p.path()))
        })
}

/// Mounts of `devs` in mount namespaces other than this process's (`own`): a
/// container's or a `unshare -m`'s, which `/proc/self/mountinfo` does not
/// list; each namespace read once, through the first process found in it.
fn mounts_elsewhere(own: Option<&Path>, devs: &[String]) -> Vec<Use> {
    let mut seen: Vec<std::path::PathBuf> = own.map(Path::to_path_buf).into_iter().collect();
    let mut out = Vec::new();
    for (pid, dir) in processes() {
        let Ok(ns) = fs::read_link(dir.join("ns/mnt")) else {
            continue;
        };
        if seen.contains(&ns) {
            continue;
        }
        seen.push(ns);
        let Ok(mi) = fs::read_to_string(dir.join("mountinfo")) else {
            continue;
        };
        let comm = fs::read_to_string(dir.join("comm")).unwrap_or_default();
        for m in mounts_of(&mi, devs) {
            out.push(Use::Mounted(format!(
                "{m} in the mount namespace of {:?} (pid {pid})",
                comm.trim()
            )));
        }
    }
    out
}

/// Whether `path` is a block device with one of the numbers `rdevs`.
fn is_one_of(path: &Path, rdevs: &[u64]) -> bool {
    fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device() && rdevs.contains(&m.rdev()))
}

/// The kernel loop devices whose backing file is one of the block devices
/// `rdevs` (a loop device holds its backing disk open from the kernel: no
/// process, mount or holder link shows it).
fn loops_on_top(rdevs: &[u64]) -> Vec<Use> {
    let Ok(rd) = fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut out: Vec<Use> = rd
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("loop") {
                return None;
            }
            // Only a bound loop device has a backing file.
            let backing = fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            let backing = backing.strip_suffix('\n').unwrap_or(&backing);
            is_one_of(Path::new(backing), rdevs).then(|| Use::LoopOnTop(format!("/dev/{name}")))
        })
        .collect();
    out.sort_by_key(Use::to_string);
    out
}

/// The swap areas `/proc/swaps` lists (its first column, unescaped: the
/// kernel writes space, tab, newline and backslash as `\ooo`).
pub fn swap_paths(swaps: &str) -> Vec<String> {
    swaps
        .lines()
        .skip(1)
        .filter_map(|l| l.split([' ', '\t']).next())
        .filter(|p| !p.is_empty())
        .map(unescape)
        .collect()
}

/// Processes (other than this one) with one of the device numbers `rdevs` open.
fn openers(rdevs: &[u64]) -> Vec<Use> {
    let me = std::process::id();
    let mut out = Vec::new();
    for (pid, dir) in processes() {
        if pid == me {
            continue;
        }
        let Ok(fds) = fs::read_dir(dir.join("fd")) else {
            continue;
        };
        let open = fds.flatten().any(|fd| is_one_of(&fd.path(), rdevs));
        if open {
            let comm = fs::read_to_string(dir.join("comm")).unwrap_or_default();
            out.push(Use::Open {
                comm: comm.trim().to_owned(),
                pid,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_are_matched_by_device_and_unescaped() {
        let mi = "22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw\n\
                  40 22 252:0 / /mnt/my\\040disk rw - ext4 /dev/ublkb0 rw\n\
                  41 22 252:1 /sub /srv rw - xfs /dev/ublkb0p1 rw\n";
        let got = mounts_of(mi, &["252:0".into(), "252:1".into()]);
        assert_eq!(got, vec!["/mnt/my disk".to_string(), "/srv".to_string()]);
        assert!(mounts_of(mi, &["7:0".into()]).is_empty());
        assert!(mounts_of("garbage\n\n1 2\n", &["252:0".into()]).is_empty());
    }

    #[test]
    fn swap_areas_are_read_from_the_first_column_and_unescaped() {
        let swaps = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n\
                     /dev/ublkb0p1                           partition\t1048572\t\t0\t\t-2\n\
                     /srv/my\\040swap                         file\t\t65532\t\t0\t\t-3\n";
        assert_eq!(swap_paths(swaps), vec!["/dev/ublkb0p1", "/srv/my swap"]);
        assert!(swap_paths("Filename Type Size Used Priority\n").is_empty());
        assert!(swap_paths("").is_empty());
    }

    #[test]
    fn loops_and_swap_are_lasting_uses_that_say_what_they_are() {
        let l = Use::LoopOnTop("/dev/loop3".into());
        let s = Use::Swap("/dev/ublkb0p1".into());
        assert!(l.lasting() && s.lasting());
        assert_eq!(l.to_string(), "the backing file of loop device /dev/loop3");
        assert_eq!(s.to_string(), "in use as swap (/dev/ublkb0p1)");
    }
}
