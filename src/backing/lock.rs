//! Image locking, compatible with QEMU's (`block/file-posix.c`): one writer per
//! image unless the user shares it on purpose.
//!
//! The protocol: open file description (OFD) byte locks, all of them shared
//! (`F_RDLCK`), one byte per permission. Byte `100 + i` held means "I use
//! permission bit i"; byte `200 + i` held means "I do not let others use it".
//! The bits are QEMU's `BLK_PERM_*`: consistent read (0), write (1), write
//! unchanged (2), resize (3). Before taking its bytes an opener tests (with
//! `F_OFD_GETLK`) that nobody else holds `200 + i` for a permission i it wants,
//! nor `100 + i` for a permission i it does not share.
//!
//! What loopd takes (the QEMU 10 measurements are in the README):
//! - a writable device uses consistent read + write and shares neither write nor
//!   resize, so a second writer (QEMU or loopd) and every QEMU user that does not
//!   share write (`qemu-nbd`) are refused, both ways;
//! - a read-only device uses consistent read and shares neither write nor resize:
//!   it refuses writers like a QEMU guest disk does; read-only devices coexist;
//! - `shared` is QEMU's force-share: the device still takes the bytes of what it
//!   uses (so others see it), shares everything, and skips the test.
//!
//! Where the lock lives: OFD locks of one open file description never conflict
//! with each other, while two descriptions conflict even in one process. So this
//! process keeps ONE lock fd per image (keyed by device and inode) in a registry,
//! held by every [`ImageLock`] on that image; the bytes on it are the union of
//! the holders'. Conflicts between holders inside this process are decided by the
//! registry with the same rules. Holders with the same owner (an export's name)
//! never conflict: that is a reconfiguration (`set`, `resize`), which opens the
//! new device while the old one still serves; until the old one is dropped the
//! fd holds the union of both, as QEMU does during a permission change. When the
//! last holder of an image drops, the fd is closed and the kernel releases the
//! bytes. Block devices are locked the same way (QEMU's host_device does too).
//! The lock fd is a duplicate of the first holder's own descriptor (the same
//! open file description: no open, no path). That description may outlive the
//! registry's entry for a moment (the device closes its descriptor after its
//! lock), so an entry unlocks its bytes itself when its last holder goes rather
//! than relying on the close. Lock calls cover runs of adjacent bytes at once
//! (a writable device: 3 tests and 3 locks, not 4 and 4); a test that finds a
//! conflict in a run looks at its bytes one by one, to name the permission.
//!
//! Kernel loop devices take no lock, so they are looked for in sysfs: a new
//! device (not `shared`) is refused while a kernel loop device backs its image
//! read-write ([`kernel_loop_writer`]). `loopd kernel attach`, which leaves no
//! process behind to hold bytes, checks the image once with
//! [`check_kernel_attach`]: a read-write loop device is refused by anyone who
//! uses or forbids writing (like a writable device); a read-only one only by a
//! writer that does not share writing (bytes 101 and 201, e.g. a writable loopd
//! device), as QEMU readers that share writing are let through.
//!
//! Locks: the registry mutex, held only by [`ImageLock::acquire`] and `Drop`
//! (control plane; never on the data path), over the registry and the lock
//! system calls on its descriptors; the sysfs look-up of kernel loop devices
//! is done before it is taken, so concurrent opens (a batch) do not queue
//! behind it. `acquire` waits up to
//! [`LOCAL_GRACE`] (without the mutex) for a conflicting *detached* device of
//! this process ([`ImageLock::retire`]) to be dropped, because a connection's
//! last reference to a detached device goes a moment after `detach` has
//! answered; a conflict with a live device is refused at once.

use crate::text::quoted_path;
use std::collections::{BTreeMap, btree_map};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use thiserror::Error;

/// Byte of permission bit i: `PERM_BASE + i`.
pub const PERM_BASE: i64 = 100;
/// Byte of "does not share permission bit i": `SHARED_BASE + i`.
pub const SHARED_BASE: i64 = 200;

/// QEMU's `BLK_PERM_*` bits.
pub mod perm {
    pub const CONSISTENT_READ: u8 = 0x01;
    pub const WRITE: u8 = 0x02;
    pub const WRITE_UNCHANGED: u8 = 0x04;
    pub const RESIZE: u8 = 0x08;
    pub const ALL: u8 = 0x0f;
    /// The bits in order, with the names QEMU prints.
    pub const NAMES: [(u8, &str); 4] = [
        (CONSISTENT_READ, "consistent read"),
        (WRITE, "write"),
        (WRITE_UNCHANGED, "write unchanged"),
        (RESIZE, "resize"),
    ];
}

/// How a device uses its image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mode {
    pub read_only: bool,
    /// Force-share: share everything, test nothing.
    pub shared: bool,
}

impl Mode {
    /// The permissions this mode uses.
    pub fn perm(self) -> u8 {
        if self.read_only {
            perm::CONSISTENT_READ
        } else {
            perm::CONSISTENT_READ | perm::WRITE
        }
    }

    /// The permissions this mode lets others use.
    pub fn shared_perm(self) -> u8 {
        if self.shared {
            perm::ALL
        } else {
            perm::ALL & !(perm::WRITE | perm::RESIZE)
        }
    }
}

/// Why an opener with `want` cannot join holders that use `held` and do not
/// share `unshared` (pure; the rule of QEMU's `raw_check_lock_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    /// Someone uses a permission we do not share (e.g. they write).
    TheyUse(u8),
    /// Someone does not share a permission we need.
    TheyForbid(u8),
}

pub fn conflict(want: Mode, held: u8, unshared: u8) -> Option<Conflict> {
    if want.shared {
        return None;
    }
    let forbid = want.perm() & unshared;
    if let Some(&(bit, _)) = perm::NAMES.iter().find(|(b, _)| forbid & b != 0) {
        return Some(Conflict::TheyForbid(bit));
    }
    let used = held & !want.shared_perm();
    perm::NAMES
        .iter()
        .find(|(b, _)| used & b != 0)
        .map(|&(bit, _)| Conflict::TheyUse(bit))
}

fn perm_name(bit: u8) -> &'static str {
    perm::NAMES
        .iter()
        .find(|(b, _)| *b == bit)
        .map_or("unknown", |(_, n)| n)
}

fn describe(c: Conflict, who: &str) -> String {
    match c {
        Conflict::TheyUse(perm::WRITE) => format!("{who} has the image open for writing"),
        Conflict::TheyUse(b) => format!("{who} has the image open for {}", perm_name(b)),
        Conflict::TheyForbid(b) => format!(
            "{who} has the image open and does not share \"{}\" access",
            perm_name(b)
        ),
    }
}

#[derive(Debug, Error)]
pub enum LockError {
    #[error("{} is in use: {why}; pass --shared to serve it anyway", quoted_path(.path))]
    InUse { path: PathBuf, why: String },
    #[error("cannot open {} to lock it", quoted_path(.path))]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} changed while it was being opened", quoted_path(.path))]
    Replaced { path: PathBuf },
    #[error("cannot lock {} (byte {byte})", quoted_path(.path))]
    Fcntl {
        path: PathBuf,
        byte: i64,
        #[source]
        source: io::Error,
    },
}

type Key = (u64, u64);

struct Holder {
    id: u64,
    owner: String,
    mode: Mode,
    /// Its device is detached and goes as soon as its last connection does
    /// ([`ImageLock::retire`]): a conflict with it is waited out.
    retiring: bool,
}

struct Entry {
    path: PathBuf,
    /// The one lock fd of this image in this process.
    fd: File,
    holders: Vec<Holder>,
    /// Bytes currently locked: (perm bits, unshared bits).
    applied: (u8, u8),
}

impl Entry {
    fn union(&self) -> (u8, u8) {
        self.holders.iter().fold((0, 0), |(p, u), h| {
            (p | h.mode.perm(), u | (perm::ALL & !h.mode.shared_perm()))
        })
    }

    /// Lock the bytes of `want`, then unlock those no longer needed. `applied`
    /// follows every run of bytes as it changes, so a failure part-way leaves
    /// it true.
    fn apply(&mut self, want: (u8, u8)) -> Result<(), LockError> {
        for unlock in [false, true] {
            for shared_half in [false, true] {
                let base = if shared_half { SHARED_BASE } else { PERM_BASE };
                let (need, have) = if shared_half {
                    (want.1, self.applied.1)
                } else {
                    (want.0, self.applied.0)
                };
                let (todo, ty) = if unlock {
                    (have & !need, libc::F_UNLCK)
                } else {
                    (need & !have, libc::F_RDLCK)
                };
                for (first, len) in runs(todo) {
                    let byte = base + i64::from(first);
                    ofd(&self.fd, libc::F_OFD_SETLK, ty, byte, i64::from(len)).map_err(
                        |source| LockError::Fcntl {
                            path: self.path.clone(),
                            byte,
                            source,
                        },
                    )?;
                    let bits = run_bits(first, len);
                    let slot = if shared_half {
                        &mut self.applied.1
                    } else {
                        &mut self.applied.0
                    };
                    *slot ^= bits;
                }
            }
        }
        Ok(())
    }

    /// What other processes hold that conflicts with `want` (`F_OFD_GETLK`
    /// ignores this fd's own locks, which the registry checks itself).
    fn test_others(&self, want: Mode) -> Result<Option<Conflict>, LockError> {
        if want.shared {
            return Ok(None);
        }
        // Bytes "does not share i" for each permission i we use, and "uses i"
        // for each permission i we do not share.
        let unshared = self.locked_by_others(SHARED_BASE, want.perm())?;
        let held = self.locked_by_others(PERM_BASE, perm::ALL & !want.shared_perm())?;
        Ok(conflict(want, held, unshared))
    }

    /// Which of the bytes `base + i` (bit i of `bits`) another description
    /// holds: one test per run of adjacent bytes; byte by byte within a run
    /// only where the run has a conflict.
    fn locked_by_others(&self, base: i64, bits: u8) -> Result<u8, LockError> {
        let mut found = 0u8;
        for (first, len) in runs(bits) {
            if !self.any_locked(base + i64::from(first), i64::from(len))? {
                continue;
            }
            if len == 1 {
                found |= run_bits(first, 1);
                continue;
            }
            for i in first..first + len {
                if self.any_locked(base + i64::from(i), 1)? {
                    found |= 1 << i;
                }
            }
        }
        Ok(found)
    }

    fn any_locked(&self, byte: i64, len: i64) -> Result<bool, LockError> {
        let fl = ofd(&self.fd, libc::F_OFD_GETLK, libc::F_WRLCK, byte, len).map_err(|source| {
            LockError::Fcntl {
                path: self.path.clone(),
                byte,
                source,
            }
        })?;
        Ok(i32::from(fl.l_type) != libc::F_UNLCK)
    }
}

impl Drop for Entry {
    /// Unlock every byte: the description may live on for a moment in the
    /// device's own descriptor (see the module documentation).
    fn drop(&mut self) {
        let _ = self.apply((0, 0));
    }
}

/// The runs of adjacent set bits of `bits` (permission bits 0..4): (first
/// bit, length).
fn runs(bits: u8) -> impl Iterator<Item = (u8, u8)> {
    let mut i = 0u8;
    std::iter::from_fn(move || {
        while i < 8 && bits & (1 << i) == 0 {
            i += 1;
        }
        if i >= 8 {
            return None;
        }
        let first = i;
        while i < 8 && bits & (1 << i) != 0 {
            i += 1;
        }
        Some((first, i - first))
    })
}

/// The bits of the run `first..first + len`.
fn run_bits(first: u8, len: u8) -> u8 {
    let ones = (1u16 << len) - 1;
    u8::try_from((ones << first) & 0xff).unwrap_or(0)
}

/// One `fcntl` OFD lock call on the `len` bytes from `byte`.
fn ofd(
    fd: &File,
    cmd: libc::c_int,
    ty: libc::c_int,
    byte: i64,
    len: i64,
) -> io::Result<libc::flock> {
    // SAFETY: `flock` is a plain C struct for which all-zero bytes is a valid value
    // (and l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    let short = |v: libc::c_int| {
        libc::c_short::try_from(v).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
    };
    fl.l_type = short(ty)?;
    fl.l_whence = short(libc::SEEK_SET)?;
    fl.l_start = byte;
    fl.l_len = len;
    // SAFETY: the fd is open for the duration of the call (borrowed from `fd`), and
    // `fl` is a valid, exclusively borrowed `flock` the kernel reads and may write.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), cmd, &mut fl as *mut libc::flock) };
    if r == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl)
}

/// How long a conflict with another device of this process may take to clear.
pub const LOCAL_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// The lock fds of this process, by image (a map: an attach among 50,000
/// devices finds its image's entry in O(log n), not by a scan).
static REGISTRY: Mutex<BTreeMap<Key, Entry>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> std::sync::MutexGuard<'static, BTreeMap<Key, Entry>> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// A device's hold on its image's lock. See the module documentation.
#[derive(Debug)]
pub struct ImageLock {
    key: Key,
    id: u64,
    mode: Mode,
    reconfiguration: bool,
}

impl ImageLock {
    /// Take the lock for `owner` (an export name) on the image `file` (an open fd
    /// of `path`) in `mode`, or say who is in the way.
    ///
    /// A conflict with a detached device of this process ([`ImageLock::retire`])
    /// is retried for up to [`LOCAL_GRACE`]: it is dropped by the reactor that
    /// served its last connection a moment after `detach` returns. A conflict
    /// with a live device is refused at once.
    pub fn acquire(
        path: &Path,
        file: &File,
        owner: &str,
        mode: Mode,
    ) -> Result<ImageLock, LockError> {
        let meta = file.metadata().map_err(|source| LockError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Self::acquire_on(path, file, (meta.dev(), meta.ino()), owner, mode)
    }

    /// As [`ImageLock::acquire`], for a `file` whose device and inode the
    /// caller has already checked (`key`, e.g. a pinned file's identity).
    pub fn acquire_on(
        path: &Path,
        file: &File,
        key: (u64, u64),
        owner: &str,
        mode: Mode,
    ) -> Result<ImageLock, LockError> {
        let start = std::time::Instant::now();
        loop {
            match Self::try_acquire(path, file, key, owner, mode) {
                Err((e, true)) if start.elapsed() < LOCAL_GRACE => {
                    drop(e);
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                r => return r.map_err(|(e, _)| e),
            }
        }
    }

    /// One attempt; the error says whether the conflict was with a detached
    /// device of this process (worth waiting for).
    fn try_acquire(
        path: &Path,
        file: &File,
        key: Key,
        owner: &str,
        mode: Mode,
    ) -> Result<ImageLock, (LockError, bool)> {
        // Looked up before the registry's mutex is taken (sysfs reads that
        // other opens need not wait for); used unless this is a
        // reconfiguration, which only the registry can tell.
        let kernel_writer = if mode.shared {
            None
        } else {
            kernel_loop_writer(file)
        };
        let mut reg = registry();
        if let btree_map::Entry::Vacant(slot) = reg.entry(key) {
            // The device's own open file description, duplicated (see the
            // module documentation): no open, no path lookup.
            let fd = file.try_clone().map_err(|source| {
                (
                    LockError::Open {
                        path: path.to_path_buf(),
                        source,
                    },
                    false,
                )
            })?;
            slot.insert(Entry {
                path: path.to_path_buf(),
                fd,
                holders: Vec::new(),
                applied: (0, 0),
            });
        }
        let Some(entry) = reg.get_mut(&key) else {
            return Err((
                LockError::Replaced {
                    path: path.to_path_buf(),
                },
                false,
            ));
        };
        let result = Self::join(entry, path, owner, mode, kernel_writer);
        if entry.holders.is_empty() {
            reg.remove(&key);
        }
        result.map(|(id, reconfiguration)| ImageLock {
            key,
            id,
            mode,
            reconfiguration,
        })
    }

    fn join(
        e: &mut Entry,
        path: &Path,
        owner: &str,
        mode: Mode,
        kernel_writer: Option<String>,
    ) -> Result<(u64, bool), (LockError, bool)> {
        let in_use = |why| LockError::InUse {
            path: path.to_path_buf(),
            why,
        };
        for h in e.holders.iter().filter(|h| h.owner != owner) {
            let theirs = (h.mode.perm(), perm::ALL & !h.mode.shared_perm());
            if let Some(c) = conflict(mode, theirs.0, theirs.1) {
                let who = format!("device {:?}", h.owner);
                return Err((in_use(describe(c, &who)), h.retiring));
            }
        }
        if let Some(c) = e.test_others(mode).map_err(|err| (err, false))? {
            return Err((in_use(describe(c, "another process")), false));
        }
        let reconfiguration = e.holders.iter().any(|h| h.owner == owner);
        if !mode.shared && !reconfiguration {
            if let Some(dev) = kernel_writer {
                let who = format!("kernel loop device {dev}");
                return Err((
                    in_use(describe(Conflict::TheyUse(perm::WRITE), &who)),
                    false,
                ));
            }
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        e.holders.push(Holder {
            id,
            owner: owner.to_owned(),
            mode,
            retiring: false,
        });
        let want = e.union();
        if let Err(err) = e.apply(want) {
            e.holders.retain(|h| h.id != id);
            let back = e.union();
            let _ = e.apply(back);
            return Err((err, false));
        }
        Ok((id, reconfiguration))
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The device is detached: it (and any older device of the same owner
    /// still draining on this image) goes as soon as its last connection
    /// does. An opener in its way waits up to [`LOCAL_GRACE`] for that;
    /// one in the way of a live device is refused at once.
    pub fn retire(&self) {
        let mut reg = registry();
        let Some(e) = reg.get_mut(&self.key) else {
            return;
        };
        let Some(owner) = e
            .holders
            .iter()
            .find(|h| h.id == self.id)
            .map(|h| h.owner.clone())
        else {
            return;
        };
        for h in e.holders.iter_mut().filter(|h| h.owner == owner) {
            h.retiring = true;
        }
    }

    /// Whether the same owner already held this image when this lock was taken:
    /// a reconfiguration of a live export rather than a new one.
    pub fn is_reconfiguration(&self) -> bool {
        self.reconfiguration
    }
}

/// The kernel loop device (`/dev/loopN`) that backs the file `f` read-write,
/// if any: sysfs `loop/backing_file` names the same file (the kernel's name
/// for it, as `/proc/self/fd` gives ours; confirmed by device and inode) and
/// `ro` is 0. Such a device writes and holds no lock.
pub fn kernel_loop_writer(f: &File) -> Option<String> {
    // Only looked up once a loop device has a backing file.
    let mut ours = None;
    for name in bound_loops() {
        let base = Path::new("/sys/block").join(&name);
        let Ok(backing) = std::fs::read_to_string(base.join("loop/backing_file")) else {
            continue;
        };
        let backing = backing.strip_suffix('\n').unwrap_or(&backing);
        if ours.is_none() {
            ours = std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd())).ok();
        }
        if ours.as_deref() != Some(Path::new(backing)) {
            continue;
        }
        let ro = std::fs::read_to_string(base.join("ro")).unwrap_or_default();
        if ro.trim() == "1" {
            continue;
        }
        let meta = f.metadata().ok()?;
        if std::fs::metadata(backing).is_ok_and(|m| (m.dev(), m.ino()) == (meta.dev(), meta.ino()))
        {
            return Some(format!("/dev/{name}"));
        }
    }
    None
}

/// The names (`loopN`) of the loop devices that may have a backing file: those
/// `/proc/partitions` lists (it leaves out disks of size 0, which every unbound
/// loop device is), so an attach reads one file, not one per loop device; every
/// `loop*` of `/sys/block` if it cannot be read.
fn bound_loops() -> Vec<String> {
    let is_loop = |n: &str| {
        n.strip_prefix("loop")
            .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
    };
    if let Some(t) = proc_partitions() {
        return t
            .lines()
            .filter_map(|l| l.split_whitespace().nth(3))
            .filter(|n| is_loop(n))
            .map(str::to_owned)
            .collect();
    }
    std::fs::read_dir("/sys/block")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| is_loop(n))
                .collect()
        })
        .unwrap_or_default()
}

/// `/proc/partitions` now: read from offset 0 of a descriptor opened once
/// (the kernel writes the text afresh for each read from the start), so an
/// attach pays one or two `pread`s, not an open, a `statx` and a close.
fn proc_partitions() -> Option<String> {
    use std::os::unix::fs::FileExt;
    static FILE: std::sync::OnceLock<Option<File>> = std::sync::OnceLock::new();
    let f = FILE
        .get_or_init(|| File::open("/proc/partitions").ok())
        .as_ref()?;
    // Read in 4 KiB pieces on the stack (a zeroed heap buffer per attach
    // cost more than the read); bounded: 1 MiB of partitions is plenty.
    let mut text = Vec::new();
    let mut piece = [0u8; 4096];
    while text.len() < (1 << 20) {
        match f.read_at(&mut piece, text.len() as u64) {
            Ok(0) => return String::from_utf8(text).ok(),
            // A read that left room for several more lines is the end (the
            // kernel fills a read with whole lines while it has them): no
            // second read just to be told so (each one writes the text anew).
            Ok(n) if n <= piece.len() - 512 => {
                text.extend_from_slice(&piece[..n]);
                return String::from_utf8(text).ok();
            }
            Ok(n) => text.extend_from_slice(&piece[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    None
}

/// Whether a kernel loop device may use the image `file` (`read_only`, or
/// `shared`: skip the test), checked against the locks of every process and
/// against other kernel loop devices (see the module documentation).
pub fn check_kernel_attach(
    path: &Path,
    file: &File,
    read_only: bool,
    shared: bool,
) -> Result<(), LockError> {
    if shared {
        return Ok(());
    }
    let in_use = |why| LockError::InUse {
        path: path.to_path_buf(),
        why,
    };
    if let Some(dev) = kernel_loop_writer(file) {
        let who = format!("kernel loop device {dev}");
        return Err(in_use(describe(Conflict::TheyUse(perm::WRITE), &who)));
    }
    let held = |byte| -> Result<bool, LockError> {
        let fl = ofd(file, libc::F_OFD_GETLK, libc::F_WRLCK, byte, 1).map_err(|source| {
            LockError::Fcntl {
                path: path.to_path_buf(),
                byte,
                source,
            }
        })?;
        Ok(i32::from(fl.l_type) != libc::F_UNLCK)
    };
    let mut used = 0u8;
    let mut unshared = 0u8;
    for i in 0..4u8 {
        if held(PERM_BASE + i64::from(i))? {
            used |= 1 << i;
        }
        if held(SHARED_BASE + i64::from(i))? {
            unshared |= 1 << i;
        }
    }
    let c = if read_only {
        kernel_reader_conflict(used, unshared)
    } else {
        let rw = Mode {
            read_only: false,
            shared: false,
        };
        conflict(rw, used, unshared)
    };
    match c {
        Some(c) => Err(in_use(describe(c, "another process"))),
        None => Ok(()),
    }
}

/// A read-only kernel loop device conflicts only with a writer that does not
/// share writing (pure).
pub fn kernel_reader_conflict(used: u8, unshared: u8) -> Option<Conflict> {
    (used & perm::WRITE != 0 && unshared & perm::WRITE != 0)
        .then_some(Conflict::TheyUse(perm::WRITE))
}

impl Drop for ImageLock {
    fn drop(&mut self) {
        let mut reg = registry();
        let Some(e) = reg.get_mut(&self.key) else {
            return;
        };
        e.holders.retain(|h| h.id != self.id);
        if e.holders.is_empty() {
            // The entry unlocks its bytes as it goes (`Drop for Entry`).
            reg.remove(&self.key);
        } else {
            let want = e.union();
            let _ = e.apply(want);
        }
    }
}

#[cfg(test)]
mod tests;
