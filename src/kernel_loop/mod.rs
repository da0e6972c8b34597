//! Kernel loop devices in one step: `LOOP_CTL_GET_FREE`, then one `LOOP_CONFIGURE`
//! carrying everything (backing fd, block size, offset, size limit, flags), so the
//! device is configured completely before it goes live and no queue is frozen.
//!
//! The block size defaults to the backing file's direct-I/O alignment (statx), so
//! that direct I/O is really on; the result is checked in sysfs
//! (`loop/dio`, `queue/logical_block_size`). Another process may take the free
//! device between the two calls (`EBUSY`): then ask for another, a few times.
//!
//! Partitions without races (`partscan`): `LOOP_CONFIGURE` with
//! `LO_FLAGS_PARTSCAN` sends its change uevent before it scans, so udev's open
//! can run a first scan that the loop driver's own scan then drops and redoes —
//! partition devices appear, vanish and reappear (systemd/systemd#41425; fixed
//! in the kernel by "loop: fix partition scan race between udev and
//! loop_reread_partitions()", in 6.12.90 among others). As systemd now does, the
//! device is configured without the flag, which keeps scanning suppressed, and
//! the flag is then turned on with `LOOP_SET_STATUS64`, whose one scan runs
//! before the ioctl returns. Everything runs under an exclusive BSD `flock`
//! on a second, read-only descriptor of the device — the lock udev takes
//! before it probes or re-reads a table — so udev never probes a
//! half-configured device. udev also re-reads a disk's partition table when a
//! writer closes it (inotify `IN_CLOSE_WRITE`) and it can take the lock,
//! which would drop and re-add the partitions after `attach` returned; so the
//! writable descriptor needed for `LOOP_CONFIGURE` is opened only once the
//! lock is held and the device is seen unbound (so a device someone else set
//! up meanwhile is never closed-after-write by loopd), closed right after it,
//! lock held and scanning still off, and with `partscan` loopd waits (bounded
//! by [`UDEV_WAIT`]) for udev's answer to that close before it goes on through
//! the read-only descriptor ([`crate::blockdev::udev`]). `attach` returns, and
//! releases the lock, only when every partition the kernel found
//! has its `/dev` node ([`crate::blockdev::partitions::settle`], bounded by [`PARTITION_WAIT`]);
//! when anything in these steps fails the device is cleared again.
//!
//! The daemon's rules for an image apply (see [`crate::backing`]): the image is
//! opened through a pinned `O_PATH` descriptor (a FIFO at the path blocks
//! nothing), checked against QEMU-compatible image locks and other kernel loop
//! devices ([`crate::backing::lock::check_kernel_attach`]; `shared` skips it)
//! and probed for a container format ([`crate::backing::format::check_raw`];
//! `format: raw` skips it), with the daemon's messages. The kernel loop device
//! itself holds no lock once `attach` has returned: the daemon looks for it in
//! sysfs instead.
//!
//! Blocking: `attach` may wait up to [`LOCK_WAIT`] per candidate device for
//! the lock, and with `partscan` up to [`UDEV_WAIT`] for udev and
//! [`PARTITION_WAIT`] for partition nodes.

use crate::backing::align;
use crate::backing::format::{ImageFormat, RawError};
use crate::backing::identity::{IdentityError, Pinned};
use crate::backing::lock::LockError;
use crate::blockdev::partitions::{self, Partition, PartitionError, Rescan};
use crate::blockdev::udev;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;

const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_PARTSCAN: u32 = 8;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// `struct loop_info64` (linux/loop.h).
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` (linux/loop.h, Linux 5.8).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

impl LoopInfo64 {
    fn zeroed() -> LoopInfo64 {
        LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; 64],
            lo_crypt_name: [0; 64],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        }
    }
}

/// How long `attach` waits for the partition nodes of a `partscan` device.
pub const PARTITION_WAIT: Duration = Duration::from_secs(10);
/// How long `attach --partscan` waits, lock held, for udev's answer to the
/// close of its writable descriptor (see [`crate::blockdev::udev`]).
pub const UDEV_WAIT: Duration = Duration::from_secs(2);
/// How long `attach` waits for the BSD lock on a free device before it asks
/// for another (someone else, e.g. systemd, is setting that one up).
pub const LOCK_WAIT: Duration = Duration::from_secs(1);

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// Whether to ask the kernel for direct I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// On where the backing file allows it; say so when it does not.
    #[default]
    Auto,
    /// On, or fail (and leave no device behind).
    On,
    Off,
}

#[derive(Debug, Clone, Default)]
pub struct KernelParams {
    pub image: PathBuf,
    pub offset: u64,
    pub size_limit: u64,
    pub block_size: Option<u32>,
    pub direct_io: DirectIo,
    pub read_only: bool,
    pub autoclear: bool,
    pub partscan: bool,
    /// Skip the image-lock test (QEMU's force-share).
    pub shared: bool,
    /// The declared format; `None`: probe and refuse a container format.
    pub format: Option<ImageFormat>,
}

#[derive(Debug, Error)]
pub enum KernelLoopError {
    #[error("block size {0} is not a power of two between 512 and 4096")]
    BadBlockSize(u32),
    #[error(
        "{0}: a kernel loop device needs a file; serve an RBD image with `loopd attach IMAGE \
         --blockdev ublk` (or `--blockdev nbd`) instead"
    )]
    NotAFileRbd(String),
    #[error("cannot open {0}")]
    Open(PathBuf, #[source] std::io::Error),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(transparent)]
    ImageLock(#[from] LockError),
    #[error(transparent)]
    Raw(#[from] RawError),
    #[error("cannot open /dev/loop-control (is the loop module loaded? are you root?)")]
    Control(#[source] std::io::Error),
    #[error("LOOP_CTL_GET_FREE failed")]
    GetFree(#[source] std::io::Error),
    #[error("LOOP_CONFIGURE on {0} failed")]
    Configure(PathBuf, #[source] std::io::Error),
    #[error("cannot take the BSD lock (flock) on {0}")]
    Lock(PathBuf, #[source] std::io::Error),
    #[error("turning on partition scanning (LOOP_SET_STATUS64) on {0} failed; device removed")]
    PartScan(PathBuf, #[source] std::io::Error),
    #[error("the partitions of {0} are not ready; device removed")]
    Partitions(PathBuf, #[source] PartitionError),
    #[error("every free loop device was taken by someone else {0} times in a row")]
    Contended(u32),
    #[error(
        "the kernel refused direct I/O on {dev} (block size {block_size}, file alignment {align}); device removed"
    )]
    DirectRefused {
        dev: PathBuf,
        block_size: u32,
        align: u32,
    },
    #[error("{0} is not a loop device")]
    NotLoop(PathBuf),
    #[error("LOOP_CLR_FD on {0} failed")]
    Clear(PathBuf, #[source] std::io::Error),
    #[error(
        "{0} was removed as soon as loopd closed it: the kernel clears an autoclear device at its last \
         close, and nothing else had it open; attach without --autoclear and detach it when done, or \
         let the program that will hold the device set it up"
    )]
    AutoclearedAtOnce(PathBuf),
}

/// What was set up.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Attached {
    pub device: PathBuf,
    pub block_size: u32,
    /// Direct I/O as the kernel reports it in sysfs.
    pub direct_io: bool,
    /// Attempts it took (more than 1 when another process raced us).
    pub attempts: u32,
    /// Set up read-only because the image cannot be opened for writing.
    pub write_protected: bool,
    /// With `partscan`: the partitions the kernel found, each with its `/dev`
    /// node in place (empty without `partscan`).
    pub partitions: Vec<Partition>,
}

fn sysfs(dev: u32, rel: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/block/loop{dev}/{rel}"))
        .ok()
        .map(|s| s.trim().to_owned())
}

fn ioctl_int(fd: &File, req: libc::c_ulong, arg: libc::c_ulong) -> std::io::Result<libc::c_int> {
    // SAFETY: `req` is a loop ioctl that takes an integer argument (or none);
    // fd is an open file for the duration of the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req, arg) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Set up a kernel loop device for `p` in one `LOOP_CONFIGURE`.
pub fn attach(p: &KernelParams) -> Result<Attached, KernelLoopError> {
    if let Some(bs) = p.block_size {
        if !bs.is_power_of_two() || !(512..=4096).contains(&bs) {
            return Err(KernelLoopError::BadBlockSize(bs));
        }
    }
    if let Some(s) = p
        .image
        .to_str()
        .filter(|s| crate::backing::rbd::spec::is_rbd(s))
    {
        return Err(KernelLoopError::NotAFileRbd(
            crate::text::sanitize_line(s).into_owned(),
        ));
    }
    let pinned = Pinned::first(&p.image)?;
    let open = |direct: bool, read_only: bool| pinned.open(read_only, direct);
    // A write-protected image (read-only mount, mode 0444) is set up
    // read-only, as losetup does; `write_protected` says so.
    let (plain, read_only) = match open(false, p.read_only) {
        Ok(f) => (f, p.read_only),
        Err(e) if !p.read_only && crate::backing::write_protected(&e) => {
            let f = open(false, true).map_err(|_| KernelLoopError::Open(p.image.clone(), e))?;
            (f, true)
        }
        Err(e) => return Err(KernelLoopError::Open(p.image.clone(), e)),
    };
    crate::backing::lock::check_kernel_attach(&p.image, &plain, read_only, p.shared)?;
    if p.format.is_none() {
        crate::backing::format::check_raw(&p.image, &plain)?;
    }
    let a = align::probe(&plain);
    let want_dio = p.direct_io != DirectIo::Off && a.supported;
    let backing = if want_dio {
        match open(true, read_only) {
            Ok(f) => f,
            Err(e) if p.direct_io == DirectIo::On => {
                return Err(KernelLoopError::Open(p.image.clone(), e));
            }
            Err(_) => plain,
        }
    } else {
        plain
    };
    let block_size = p.block_size.unwrap_or(a.offset.clamp(512, 4096));
    let mut flags = 0;
    if want_dio {
        flags |= LO_FLAGS_DIRECT_IO;
    }
    if read_only {
        flags |= LO_FLAGS_READ_ONLY;
    }
    if p.autoclear {
        flags |= LO_FLAGS_AUTOCLEAR;
    }
    // LO_FLAGS_PARTSCAN is turned on after LOOP_CONFIGURE (see the module doc).
    let mut info = LoopInfo64 {
        lo_device: 0,
        lo_inode: 0,
        lo_rdevice: 0,
        lo_offset: p.offset,
        lo_sizelimit: p.size_limit,
        lo_number: 0,
        lo_encrypt_type: 0,
        lo_encrypt_key_size: 0,
        lo_flags: flags,
        lo_file_name: [0; 64],
        lo_crypt_name: [0; 64],
        lo_encrypt_key: [0; 32],
        lo_init: [0; 2],
    };
    let name = p.image.as_os_str().as_encoded_bytes();
    let n = name.len().min(63);
    info.lo_file_name[..n].copy_from_slice(&name[..n]);
    let fd = u32::try_from(backing.as_raw_fd()).map_err(|_| {
        KernelLoopError::Open(
            p.image.clone(),
            std::io::Error::from_raw_os_error(libc::EBADF),
        )
    })?;
    let cfg = LoopConfig {
        fd,
        block_size,
        info,
        reserved: [0; 8],
    };

    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map_err(KernelLoopError::Control)?;
    const TRIES: u32 = 16;
    for attempt in 1..=TRIES {
        let n = ioctl_int(&ctl, LOOP_CTL_GET_FREE, 0).map_err(KernelLoopError::GetFree)?;
        let n = u32::try_from(n).unwrap_or(0);
        let dev = PathBuf::from(format!("/dev/loop{n}"));
        let Some(lock) = lock_exclusive(&dev)? else {
            continue; // gone, or someone else holds it for longer than LOCK_WAIT
        };
        // Only an unbound device is opened for writing: closing a writable
        // descriptor makes udev re-read the disk's partition table, which must
        // never happen to a device someone else just set up.
        if is_bound(&lock) {
            continue;
        }
        let loopf = match OpenOptions::new().read(true).write(true).open(&dev) {
            Ok(f) => f,
            // The node may be gone already (another process removed it): next.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(KernelLoopError::Open(dev, e)),
        };
        // Listening before the close, so udev's answer cannot be missed.
        let udev_listener = if p.partscan && udev::running() {
            udev::UeventListener::open().ok()
        } else {
            None
        };
        // SAFETY: LOOP_CONFIGURE reads a `struct loop_config`, which `cfg` is
        // (layout checked at compile time); both fds are open during the call.
        let r =
            unsafe { libc::ioctl(loopf.as_raw_fd(), LOOP_CONFIGURE, &cfg as *const LoopConfig) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EBUSY) {
                // Someone configured it first without the lock: `loopf` is
                // closed before `lock`, so udev cannot re-read their table.
                continue;
            }
            return Err(KernelLoopError::Configure(dev, e));
        }
        // The writable descriptor is closed now, while the lock is held and
        // scanning still off: udev re-reads a disk's table when a writer
        // closes it (inotify IN_CLOSE_WRITE), but only if it can take the lock;
        // with partscan, wait (bounded) for udev's answer to that close, so the
        // re-read cannot come after we return. From here on only the
        // read-only lock descriptor is used.
        drop(loopf);
        if p.partscan {
            // Kernels without "loop: fix partition scan race…" leave the disk
            // marked for a scan at its next open (GD_NEED_PART_SCAN). Open it
            // once now, read-only, while scanning is still suppressed: that
            // clears the mark without a scan, so no open (udev's) can start a
            // second scan racing the one LOOP_SET_STATUS64 runs.
            drop(OpenOptions::new().read(true).open(&dev));
        }
        if let Some(l) = &udev_listener {
            let t = Instant::now();
            let answered = l.wait_synthetic_change(&format!("loop{n}"), UDEV_WAIT);
            tracing::debug!(?answered, waited = ?t.elapsed(), "udev's answer to closing /dev/loop{n}");
        }
        let clear = || {
            let _ = ioctl_int(&lock, LOOP_CLR_FD, 0);
        };
        if p.partscan {
            if let Err(e) = enable_partscan(&lock, n) {
                clear();
                return Err(KernelLoopError::PartScan(dev, e));
            }
        }
        let direct_io = sysfs(n, "loop/dio").as_deref() == Some("1");
        let lbs = sysfs(n, "queue/logical_block_size")
            .and_then(|s| s.parse().ok())
            .unwrap_or(block_size);
        if p.direct_io == DirectIo::On && !direct_io {
            clear();
            return Err(KernelLoopError::DirectRefused {
                dev,
                block_size: lbs,
                align: a.offset,
            });
        }
        let partitions = if p.partscan {
            match partitions::settle(&dev, Rescan::AlreadyDone, PARTITION_WAIT) {
                Ok(v) => v,
                Err(e) => {
                    clear();
                    return Err(KernelLoopError::Partitions(dev, e));
                }
            }
        } else {
            Vec::new()
        };
        drop(lock);
        if p.autoclear && sysfs(n, "loop/backing_file").is_none() {
            return Err(KernelLoopError::AutoclearedAtOnce(dev));
        }
        return Ok(Attached {
            device: dev,
            block_size: lbs,
            direct_io,
            attempts: attempt,
            write_protected: read_only && !p.read_only,
            partitions,
        });
    }
    Err(KernelLoopError::Contended(TRIES))
}

/// An exclusive BSD lock on `dev`, taken on a read-only descriptor of its own
/// (closing it releases the lock; being read-only, its close does not make
/// udev re-read the partition table). `None` when another holder keeps the
/// lock for longer than [`LOCK_WAIT`], or when the device node is gone.
fn lock_exclusive(dev: &Path) -> Result<Option<File>, KernelLoopError> {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(dev)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(KernelLoopError::Open(dev.to_path_buf(), e)),
    };
    let start = Instant::now();
    loop {
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(Some(f)),
            Err(e) if e == rustix::io::Errno::WOULDBLOCK || e == rustix::io::Errno::INTR => {
                if start.elapsed() >= LOCK_WAIT {
                    return Ok(None);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(KernelLoopError::Lock(dev.to_path_buf(), e.into())),
        }
    }
}

/// Whether the loop device has a backing file (`LOOP_GET_STATUS64` answers
/// `ENXIO` when it has none); any other failure counts as "not for us".
fn is_bound(f: &File) -> bool {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 writes one `struct loop_info64`, which `info`
    // is (layout checked at compile time), exclusively borrowed for the call.
    let r = unsafe {
        libc::ioctl(
            f.as_raw_fd(),
            LOOP_GET_STATUS64,
            &mut info as *mut LoopInfo64,
        )
    };
    !(r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO))
}

/// Turns on `LO_FLAGS_PARTSCAN` on a configured device with
/// `LOOP_SET_STATUS64` (everything else as `LOOP_GET_STATUS64` reports it);
/// the kernel scans the partition table before the call returns. Root may do
/// this through a read-only descriptor.
fn enable_partscan(loopf: &File, n: u32) -> std::io::Result<()> {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 writes one `struct loop_info64`, which `info`
    // is (layout checked at compile time), exclusively borrowed for the call.
    let r = unsafe {
        libc::ioctl(
            loopf.as_raw_fd(),
            LOOP_GET_STATUS64,
            &mut info as *mut LoopInfo64,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    info.lo_flags |= LO_FLAGS_PARTSCAN;
    // Kernels before 5.x could answer EAGAIN while someone else had the
    // device open; retry a few times like systemd does.
    let mut tries = 0;
    loop {
        // SAFETY: LOOP_SET_STATUS64 reads one `struct loop_info64` (`info`);
        // `loopf` is open during the call.
        let r = unsafe {
            libc::ioctl(
                loopf.as_raw_fd(),
                LOOP_SET_STATUS64,
                &info as *const LoopInfo64,
            )
        };
        if r == 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        tries += 1;
        if e.raw_os_error() != Some(libc::EAGAIN) || tries >= 20 {
            return Err(e);
        }
        std::thread::sleep(Duration::from_millis(10 * tries));
    }
    if sysfs(n, "loop/partscan").as_deref() != Some("1") {
        return Err(std::io::Error::other(
            "the kernel did not turn partition scanning on (sysfs loop/partscan is not 1)",
        ));
    }
    Ok(())
}

fn loop_number(dev: &Path) -> Option<u32> {
    let name = dev.file_name()?.to_str()?;
    name.strip_prefix("loop")?.parse().ok()
}

/// Detach a kernel loop device (`LOOP_CLR_FD`: it goes away at last close).
pub fn detach(dev: &Path) -> Result<(), KernelLoopError> {
    if loop_number(dev).is_none() {
        return Err(KernelLoopError::NotLoop(dev.to_path_buf()));
    }
    let f = OpenOptions::new()
        .read(true)
        .open(dev)
        .map_err(|e| KernelLoopError::Open(dev.to_path_buf(), e))?;
    ioctl_int(&f, LOOP_CLR_FD, 0).map_err(|e| KernelLoopError::Clear(dev.to_path_buf(), e))?;
    Ok(())
}

/// A configured kernel loop device, from sysfs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoopEntry {
    pub device: PathBuf,
    pub backing_file: String,
    pub offset: u64,
    pub size_limit: u64,
    pub block_size: u32,
    pub direct_io: bool,
    pub read_only: bool,
    pub autoclear: bool,
    pub partscan: bool,
}

/// Every loop device with a backing file.
pub fn list() -> Vec<LoopEntry> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(n) = name
            .strip_prefix("loop")
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(backing) = sysfs(n, "loop/backing_file") else {
            continue;
        };
        let num = |rel| sysfs(n, rel).and_then(|s| s.parse().ok()).unwrap_or(0);
        let flag = |rel| sysfs(n, rel).as_deref() == Some("1");
        out.push(LoopEntry {
            device: PathBuf::from(format!("/dev/loop{n}")),
            backing_file: backing,
            offset: num("loop/offset"),
            size_limit: num("loop/sizelimit"),
            block_size: u32::try_from(num("queue/logical_block_size")).unwrap_or(0),
            direct_io: flag("loop/dio"),
            read_only: flag("ro"),
            autoclear: flag("loop/autoclear"),
            partscan: flag("loop/partscan"),
        });
    }
    out.sort_by_key(|e| loop_number(&e.device).unwrap_or(u32::MAX));
    out
}
