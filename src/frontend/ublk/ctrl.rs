//! The control path of one ublk device: /dev/ublk-control and its commands.
//!
//! A [`UblkCtrl`] owns an open /dev/ublk-control and a small io_uring with
//! 128-byte SQEs of its own (control commands are `URING_CMD`s on that fd; they
//! never go through a reactor's ring). It runs ONE command at a time and waits
//! for its completion, so every method blocks the calling thread:
//!
//! - `START_DEV` and `END_USER_RECOVERY` wait in the kernel until every tag of
//!   every queue has been fetched, and START_DEV then runs add_disk and the
//!   partition scan, which READ through the queues. Issue them only while the
//!   queues are already being served by other threads (the reactors).
//! - `DEL_DEV` waits until /dev/ublkcN is released: every fd and every
//!   descriptor mapping of it dropped (the queues drained after STOP_DEV), and
//!   every opener of /dev/ublkbN gone. `DEL_DEV_ASYNC` (6.9+) does not wait.
//! - The others return promptly.
//!
//! A command's in/out buffer is heap-owned by the call; if the ring fails while
//! the kernel may still write it, the buffer is leaked, never freed under it.
//!
//! Deadlines ([`super::deadline`]): every command waits at most the handle's
//! deadline (the daemon's `--kernel-timeout`), then is cancelled and fails
//! with [`CtrlError::Deadline`], naming the command and the time waited. One
//! that does not end even when cancelled leaves this handle unusable (every
//! later command fails at once): its ring, fd and buffer go to a janitor
//! thread, which, once the kernel answers, deletes a device that a late
//! ADD_DEV or START_DEV made (the attach failed long before) and frees them.
//! Undo a timed-out attach on a new handle.
//!
//! Kernel versions: ublk is 6.0+, user recovery 6.1+, ioctl-encoded commands
//! (`UBLK_F_CMD_IOCTL_ENCODE`, used here) and GET_FEATURES 6.5+. `UPDATE_SIZE` is
//! 6.14+ (not in 6.12): on an older kernel [`UblkCtrl::update_size`] fails with
//! [`CtrlError::Unsupported`] and a resize must be refused (or done by stopping
//! and re-adding the device).

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use thiserror::Error;

mod cmd;
pub use cmd::Cmd;
use cmd::hint;

use super::deadline::{self, CmdBuf as Buf, CtrlRing, Undo};
use super::sys::{
    UBLK_ATTR_FUA, UBLK_ATTR_READ_ONLY, UBLK_ATTR_ROTATIONAL, UBLK_ATTR_VOLATILE_CACHE,
    UBLK_F_AUTO_BUF_REG, UBLK_F_CMD_IOCTL_ENCODE, UBLK_F_NO_AUTO_PART_SCAN, UBLK_F_QUIESCE,
    UBLK_F_SAFE_STOP_DEV, UBLK_F_UPDATE_SIZE, UBLK_F_USER_RECOVERY, UBLK_F_USER_RECOVERY_REISSUE,
    UBLK_MAX_NR_QUEUES, UBLK_MAX_QUEUE_DEPTH, UBLK_PARAM_TYPE_BASIC, UBLK_PARAM_TYPE_DISCARD,
    UblkParamBasic, UblkParamDiscard, UblkParams, UblksrvCtrlCmd, UblksrvCtrlDevInfo,
};

pub const DEFAULT_CONTROL_PATH: &str = "/dev/ublk-control";

#[derive(Debug, Error)]
pub enum CtrlError {
    #[error(
        "ublk is not available: {path} does not exist; load the driver with `modprobe ublk_drv` \
         (Linux >= 6.0 with CONFIG_BLK_DEV_UBLK; loopd needs >= 6.5, user recovery >= 6.1)"
    )]
    NotAvailable { path: PathBuf },
    #[error(
        "no permission to open {path}: run loopd as root (ublk needs CAP_SYS_ADMIN), \
         or give this user read-write access to {path} (a udev rule)"
    )]
    NoAccess {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot set up the io_uring for ublk control commands (needs 128-byte SQEs, Linux >= 5.19)"
    )]
    Ring(#[source] std::io::Error),
    #[error("io_uring failed while running ublk {cmd}")]
    Submit {
        cmd: Cmd,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "ublk {cmd} of device {} failed: {}{hint}",
        dev_name(*.dev_id),
        std::io::Error::from_raw_os_error(*.errno)
    )]
    Command {
        cmd: Cmd,
        dev_id: u32,
        errno: i32,
        hint: &'static str,
    },
    #[error("ublk {cmd} is not supported by this kernel ({why})")]
    Unsupported { cmd: Cmd, why: &'static str },
    #[error(
        "ublk device {dev_id} did not reach state {want} within {waited:?} (last state {last})"
    )]
    StateTimeout {
        dev_id: u32,
        want: u16,
        last: u16,
        waited: std::time::Duration,
    },
    /// `state`: "cancelled", or still pending (left to a janitor).
    #[error("ublk {cmd} of device {}: the kernel did not answer within {:.1}s ({state})",
        dev_name(*.dev_id), waited.as_secs_f64())]
    Deadline {
        cmd: Cmd,
        dev_id: u32,
        waited: std::time::Duration,
        state: &'static str,
    },
    #[error("no device: call add_dev first")]
    NoDevice,
    #[error("invalid ublk parameters: {0}")]
    Params(&'static str),
}

impl CtrlError {
    /// The errno of a failed command, if that is what failed.
    pub fn errno(&self) -> Option<i32> {
        match self {
            CtrlError::Command { errno, .. } => Some(*errno),
            CtrlError::NotAvailable { .. }
            | CtrlError::NoAccess { .. }
            | CtrlError::Open { .. }
            | CtrlError::Ring(_)
            | CtrlError::Submit { .. }
            | CtrlError::Unsupported { .. }
            | CtrlError::StateTimeout { .. }
            | CtrlError::Deadline { .. }
            | CtrlError::NoDevice
            | CtrlError::Params(_) => None,
        }
    }
}

/// `u32::MAX` is ADD_DEV's "any id".
fn dev_name(dev_id: u32) -> String {
    match dev_id {
        u32::MAX => "(any id)".to_owned(),
        id => id.to_string(),
    }
}

/// ADD_DEV's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddDev {
    /// `None`: the kernel picks the id.
    pub dev_id: Option<u32>,
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    /// The largest request, and the per-tag buffer size (copy mode).
    pub max_io_buf_bytes: u32,
    /// Keep the disk when the server dies (I/O waits until recovery).
    pub user_recovery: bool,
    /// With `user_recovery`: re-issue requests that were in flight at the server
    /// when it died. loopd's writes are idempotent (positional), so this is right
    /// for it; without it those requests fail with EIO.
    pub reissue: bool,
    /// Allow UPDATE_SIZE (`UBLK_F_UPDATE_SIZE`, 6.14+): set it only when
    /// [`UblkCtrl::features`] has the bit.
    pub resizable: bool,
    /// START_DEV does not scan the partition table
    /// (`UBLK_F_NO_AUTO_PART_SCAN`, 7.0+): set it only when
    /// [`UblkCtrl::features`] has the bit.
    pub no_auto_part_scan: bool,
    /// QUIESCE_DEV allowed (`UBLK_F_QUIESCE`, 6.15+; needs `user_recovery`):
    /// set it only when [`UblkCtrl::features`] has the bit.
    pub quiesce: bool,
    /// TRY_STOP_DEV allowed (`UBLK_F_SAFE_STOP_DEV`, 7.0+): set it only when
    /// [`UblkCtrl::features`] has the bit.
    pub safe_stop: bool,
    /// Zero copy: each request's pages registered in the serving ring's
    /// fixed-buffer table (`UBLK_F_AUTO_BUF_REG`, 6.16+): set it only when
    /// [`UblkCtrl::features`] has the bit, and only for a device whose
    /// queues serve every read and write with fixed-buffer file I/O.
    pub auto_buf_reg: bool,
}

impl Default for AddDev {
    fn default() -> Self {
        AddDev {
            dev_id: None,
            nr_hw_queues: 1,
            queue_depth: 128,
            max_io_buf_bytes: 512 << 10,
            user_recovery: false,
            reissue: false,
            resizable: false,
            no_auto_part_scan: false,
            quiesce: false,
            safe_stop: false,
            auto_buf_reg: false,
        }
    }
}

impl AddDev {
    fn dev_info(&self) -> Result<UblksrvCtrlDevInfo, CtrlError> {
        if self.nr_hw_queues == 0 || self.nr_hw_queues > UBLK_MAX_NR_QUEUES {
            return Err(CtrlError::Params("nr_hw_queues must be 1..=4096"));
        }
        if self.queue_depth == 0 || self.queue_depth > UBLK_MAX_QUEUE_DEPTH {
            return Err(CtrlError::Params("queue_depth must be 1..=4096"));
        }
        if self.max_io_buf_bytes < 4096 || self.max_io_buf_bytes % 4096 != 0 {
            return Err(CtrlError::Params(
                "max_io_buf_bytes must be a multiple of 4096",
            ));
        }
        let mut flags = UBLK_F_CMD_IOCTL_ENCODE;
        if self.user_recovery {
            flags |= UBLK_F_USER_RECOVERY;
            if self.reissue {
                flags |= UBLK_F_USER_RECOVERY_REISSUE;
            }
            if self.quiesce {
                flags |= UBLK_F_QUIESCE;
            }
        }
        if self.safe_stop {
            flags |= UBLK_F_SAFE_STOP_DEV;
        }
        if self.resizable {
            flags |= UBLK_F_UPDATE_SIZE;
        }
        if self.no_auto_part_scan {
            flags |= UBLK_F_NO_AUTO_PART_SCAN;
        }
        if self.auto_buf_reg {
            flags |= UBLK_F_AUTO_BUF_REG;
        }
        Ok(UblksrvCtrlDevInfo {
            nr_hw_queues: self.nr_hw_queues,
            queue_depth: self.queue_depth,
            max_io_buf_bytes: self.max_io_buf_bytes,
            dev_id: self.dev_id.unwrap_or(u32::MAX),
            flags,
            ..Default::default()
        })
    }
}

/// The parameters loopd sets (SET_PARAMS), in bytes; [`DeviceParams::to_uapi`]
/// checks them the way the 6.12 driver would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceParams {
    pub dev_bytes: u64,
    /// Power of two, 512..=4096 (the driver caps it at the page size).
    pub logical_block: u32,
    /// Power of two, >= logical_block.
    pub physical_block: u32,
    /// Optimal I/O size: 0 or a power of two >= logical_block.
    pub io_opt: u32,
    /// Largest request: <= max_io_buf_bytes, a multiple of 512.
    pub max_io_bytes: u32,
    /// Largest DISCARD, 0 for none.
    pub max_discard_bytes: u32,
    /// Largest WRITE_ZEROES, 0 for none.
    pub max_write_zeroes_bytes: u32,
    pub read_only: bool,
    pub rotational: bool,
    /// The device has a volatile cache: the kernel sends FLUSH.
    pub volatile_cache: bool,
    /// The device honours FUA writes (needs `volatile_cache`).
    pub fua: bool,
}

fn shift_of(v: u32, what: &'static str) -> Result<u8, CtrlError> {
    if !v.is_power_of_two() {
        return Err(CtrlError::Params(what));
    }
    u8::try_from(v.trailing_zeros()).map_err(|_| CtrlError::Params(what))
}

impl DeviceParams {
    pub fn to_uapi(&self) -> Result<UblkParams, CtrlError> {
        let lbs = shift_of(
            self.logical_block,
            "logical block size must be a power of two",
        )?;
        if !(9..=12).contains(&lbs) {
            return Err(CtrlError::Params("logical block size must be 512..=4096"));
        }
        let pbs = shift_of(
            self.physical_block,
            "physical block size must be a power of two",
        )?;
        if pbs < lbs {
            return Err(CtrlError::Params(
                "physical block size is below the logical one",
            ));
        }
        let io_opt = match self.io_opt {
            0 => 0,
            v => shift_of(v, "io_opt must be a power of two")?,
        };
        if self.dev_bytes % u64::from(self.logical_block) != 0 {
            return Err(CtrlError::Params(
                "device size is not a multiple of the logical block",
            ));
        }
        if self.max_io_bytes < self.logical_block || self.max_io_bytes % 512 != 0 {
            return Err(CtrlError::Params(
                "max_io_bytes must be a multiple of 512, >= the block",
            ));
        }
        if self.fua && !self.volatile_cache {
            return Err(CtrlError::Params("FUA needs a volatile cache"));
        }
        let mut attrs = 0;
        for (on, bit) in [
            (self.read_only, UBLK_ATTR_READ_ONLY),
            (self.rotational, UBLK_ATTR_ROTATIONAL),
            (self.volatile_cache, UBLK_ATTR_VOLATILE_CACHE),
            (self.fua, UBLK_ATTR_FUA),
        ] {
            if on {
                attrs |= bit;
            }
        }
        let mut p = UblkParams {
            len: u32::try_from(size_of::<UblkParams>()).unwrap_or(u32::MAX),
            types: UBLK_PARAM_TYPE_BASIC,
            basic: UblkParamBasic {
                attrs,
                logical_bs_shift: lbs,
                physical_bs_shift: pbs,
                io_opt_shift: io_opt,
                io_min_shift: pbs,
                max_sectors: self.max_io_bytes / 512,
                chunk_sectors: 0,
                dev_sectors: self.dev_bytes / 512,
                virt_boundary_mask: 0,
            },
            ..Default::default()
        };
        if self.max_discard_bytes != 0 || self.max_write_zeroes_bytes != 0 {
            p.types |= UBLK_PARAM_TYPE_DISCARD;
            p.discard = UblkParamDiscard {
                discard_alignment: 0,
                discard_granularity: self.physical_block,
                max_discard_sectors: self.max_discard_bytes / 512,
                max_write_zeroes_sectors: self.max_write_zeroes_bytes / 512,
                // The driver supports single-segment discards only.
                max_discard_segments: 1,
                reserved0: 0,
            };
        }
        Ok(p)
    }
}

/// /dev/ublk-control with its ring, bound to at most one device.
pub struct UblkCtrl {
    file: File,
    /// `None` once a command outlived its deadline and cancel (a janitor has it).
    ring: Option<CtrlRing>,
    dev_id: Option<u32>,
    seq: u64,
    deadline: std::time::Duration,
}

impl std::fmt::Debug for UblkCtrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UblkCtrl")
            .field("dev_id", &self.dev_id)
            .finish()
    }
}

impl UblkCtrl {
    /// Open [`DEFAULT_CONTROL_PATH`].
    pub fn open() -> Result<Self, CtrlError> {
        Self::open_at(Path::new(DEFAULT_CONTROL_PATH))
    }

    /// Open the control device at `path` (tests point it elsewhere).
    pub fn open_at(path: &Path) -> Result<Self, CtrlError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| match source.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENXIO) | Some(libc::ENODEV) => {
                    CtrlError::NotAvailable {
                        path: path.to_owned(),
                    }
                }
                Some(libc::EACCES) | Some(libc::EPERM) => CtrlError::NoAccess {
                    path: path.to_owned(),
                    source,
                },
                _ => CtrlError::Open {
                    path: path.to_owned(),
                    source,
                },
            })?;
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .build(4)
            .map_err(CtrlError::Ring)?;
        Ok(UblkCtrl {
            file,
            ring: Some(ring),
            dev_id: None,
            seq: 0,
            deadline: deadline::default_deadline(),
        })
    }

    /// Bind to an existing device (recovery after a restart, or cleanup).
    pub fn for_device(mut self, dev_id: u32) -> Self {
        self.dev_id = Some(dev_id);
        self
    }

    pub fn dev_id(&self) -> Option<u32> {
        self.dev_id
    }

    fn dev(&self) -> Result<u32, CtrlError> {
        self.dev_id.ok_or(CtrlError::NoDevice)
    }

    /// Run one command to completion; returns its CQE result (>= 0) and buffer.
    fn run(
        &mut self,
        cmd: Cmd,
        dev_id: u32,
        data: u64,
        mut buf: Buf,
    ) -> Result<(i32, Buf), CtrlError> {
        let (addr, len) = buf.addr_len();
        let header = UblksrvCtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            len,
            addr,
            data: [data],
            ..Default::default()
        };
        let mut bytes = [0u8; 80];
        bytes[0..4].copy_from_slice(&header.dev_id.to_ne_bytes());
        bytes[4..6].copy_from_slice(&header.queue_id.to_ne_bytes());
        bytes[6..8].copy_from_slice(&header.len.to_ne_bytes());
        bytes[8..16].copy_from_slice(&header.addr.to_ne_bytes());
        bytes[16..24].copy_from_slice(&header.data[0].to_ne_bytes());
        self.seq = self.seq.wrapping_add(1);
        let sqe = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), cmd.op())
            .cmd(bytes)
            .build()
            .user_data(self.seq);
        let (seq, limit) = (self.seq, self.deadline);
        let stuck = "an earlier command is still pending in the kernel";
        let source = || std::io::Error::other(stuck);
        let ring = (self.ring.as_mut()).ok_or_else(|| CtrlError::Submit {
            cmd,
            source: source(),
        })?;
        // SAFETY: the SQE names the control fd (alive as long as self) and the
        // buffer in `buf`, which this function keeps until the CQE arrives, or
        // leaks (or hands to a janitor) while the kernel may still use it.
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            return Err(CtrlError::Submit {
                cmd,
                source: std::io::Error::other("submission queue full"),
            });
        }
        let (late, ended) = match deadline::wait_for(ring, seq, limit) {
            Ok(None) => (true, deadline::cancel(ring, seq, deadline::CANCEL_GRACE)),
            r => (false, r),
        };
        let res = match ended {
            Err(source) => {
                // The kernel may hold the buffer still: never free it.
                std::mem::forget(buf);
                return Err(CtrlError::Submit { cmd, source });
            }
            Ok(Some(res)) if res >= 0 || !late => res,
            Ok(r) => {
                if r.is_none() {
                    let (ring, file) = (self.ring.take(), self.file.try_clone().ok());
                    let undo = Undo::of(cmd.op(), dev_id);
                    deadline::adopt(ring, seq, buf, file, format!("{cmd}"), undo);
                }
                let state = if r.is_none() {
                    "still pending: left to a janitor"
                } else {
                    "cancelled"
                };
                return Err(CtrlError::Deadline {
                    cmd,
                    dev_id,
                    waited: limit,
                    state,
                });
            }
        };
        if res < 0 {
            let errno = -res;
            if cmd == Cmd::UpdateSize && (errno == libc::EOPNOTSUPP || errno == libc::EINVAL) {
                return Err(CtrlError::Unsupported {
                    cmd,
                    why: "UPDATE_SIZE needs Linux >= 6.14",
                });
            }
            return Err(CtrlError::Command {
                cmd,
                dev_id,
                errno,
                hint: hint(cmd, errno),
            });
        }
        Ok((res, buf))
    }

    /// The `UBLK_F_*` bits the driver supports (GET_FEATURES, 6.5+).
    pub fn features(&mut self) -> Result<u64, CtrlError> {
        let dev = self.dev_id.unwrap_or(u32::MAX);
        match self.run(Cmd::GetFeatures, dev, 0, Buf::U64(Box::new(0)))? {
            (_, Buf::U64(b)) => Ok(*b),
            _ => Err(CtrlError::NoDevice),
        }
    }

    /// ADD_DEV; binds this handle to the new device. Returns the driver's view
    /// (id, queues clamped to the CPU count, effective flags).
    pub fn add_dev(&mut self, req: &AddDev) -> Result<UblksrvCtrlDevInfo, CtrlError> {
        let info = req.dev_info()?;
        let dev_id = info.dev_id;
        match self.run(Cmd::AddDev, dev_id, 0, Buf::Info(Box::new(info)))? {
            (_, Buf::Info(b)) => {
                self.dev_id = Some(b.dev_id);
                Ok(*b)
            }
            _ => Err(CtrlError::NoDevice),
        }
    }

    pub fn dev_info(&mut self) -> Result<UblksrvCtrlDevInfo, CtrlError> {
        let dev = self.dev()?;
        match self.run(Cmd::GetDevInfo, dev, 0, Buf::Info(Box::default()))? {
            (_, Buf::Info(b)) => Ok(*b),
            _ => Err(CtrlError::NoDevice),
        }
    }

    /// SET_PARAMS: before START_DEV (the driver refuses it on a live device).
    pub fn set_params(&mut self, params: &UblkParams) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        self.run(Cmd::SetParams, dev, 0, Buf::Params(Box::new(*params)))?;
        Ok(())
    }

    /// GET_PARAMS: everything the driver has, including the disk's devt once started.
    pub fn params(&mut self) -> Result<UblkParams, CtrlError> {
        let dev = self.dev()?;
        let p = UblkParams {
            len: u32::try_from(size_of::<UblkParams>()).unwrap_or(u32::MAX),
            ..Default::default()
        };
        match self.run(Cmd::GetParams, dev, 0, Buf::Params(Box::new(p)))? {
            (_, Buf::Params(b)) => Ok(*b),
            _ => Err(CtrlError::NoDevice),
        }
    }

    /// START_DEV. Blocks until every tag is fetched and the disk is added
    /// (including its partition scan): the queues must be served meanwhile.
    pub fn start_dev(&mut self, server_pid: i32) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        let pid = u64::try_from(server_pid).map_err(|_| CtrlError::Params("pid must be > 0"))?;
        self.run(Cmd::StartDev, dev, pid, Buf::None)?;
        Ok(())
    }

    /// STOP_DEV: removes /dev/ublkbN; in-flight requests still need commits, and
    /// every queue then sees `UBLK_IO_RES_ABORT` on its commands.
    pub fn stop_dev(&mut self) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        self.run(Cmd::StopDev, dev, 0, Buf::None)?;
        Ok(())
    }

    /// DEL_DEV: blocks until /dev/ublkcN is released (fd and mappings dropped).
    pub fn del_dev(&mut self) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        self.run(Cmd::DelDev, dev, 0, Buf::None)?;
        self.dev_id = None;
        Ok(())
    }

    /// DEL_DEV_ASYNC (6.9+): deletes the device and returns at once; the
    /// kernel frees its id once the last opener of /dev/ublkbN (a process
    /// holding a force-detached disk) and of /dev/ublkcN lets go. DEL_DEV
    /// would wait for that opener, which may never close. On a kernel without
    /// it (refused with `EINVAL`/`EOPNOTSUPP`), falls back to DEL_DEV.
    pub fn del_dev_async(&mut self) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        match self.run(Cmd::DelDevAsync, dev, 0, Buf::None) {
            Ok(_) => {
                self.dev_id = None;
                Ok(())
            }
            Err(CtrlError::Command { errno, .. })
                if errno == libc::EINVAL || errno == libc::EOPNOTSUPP =>
            {
                self.del_dev()
            }
            Err(e) => Err(e),
        }
    }

    /// Poll GET_DEV_INFO every 10 ms until the device is in `state` (a
    /// `UBLK_S_DEV_*`), e.g. QUIESCED before START_USER_RECOVERY: after the old
    /// server's rings close, the driver quiesces the device asynchronously.
    /// Blocks for at most `timeout`.
    pub fn wait_for_state(
        &mut self,
        state: u16,
        timeout: std::time::Duration,
    ) -> Result<UblksrvCtrlDevInfo, CtrlError> {
        let start = std::time::Instant::now();
        loop {
            let info = self.dev_info()?;
            if info.state == state {
                return Ok(info);
            }
            if start.elapsed() >= timeout {
                return Err(CtrlError::StateTimeout {
                    dev_id: info.dev_id,
                    want: state,
                    last: info.state,
                    waited: timeout,
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// START_USER_RECOVERY: legal once the old server's char fd, mappings and
    /// rings are gone and the device is QUIESCED (poll [`Self::dev_info`]).
    pub fn start_user_recovery(&mut self) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        self.run(Cmd::StartUserRecovery, dev, 0, Buf::None)?;
        Ok(())
    }

    /// END_USER_RECOVERY: like START_DEV, blocks until every tag is re-fetched.
    pub fn end_user_recovery(&mut self, server_pid: i32) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        let pid = u64::try_from(server_pid).map_err(|_| CtrlError::Params("pid must be > 0"))?;
        self.run(Cmd::EndUserRecovery, dev, pid, Buf::None)?;
        Ok(())
    }

    /// QUIESCE_DEV: new requests wait in the kernel; returns once each queue
    /// has finished what it was given (its fetches then end with
    /// `UBLK_IO_RES_ABORT`, so the queues must still be served meanwhile).
    /// The kernel gives up after the control deadline less a second (`EBUSY`),
    /// so it answers before that deadline cancels the command. The device
    /// must have been added with `UBLK_F_QUIESCE` and user recovery; once its
    /// server lets go of /dev/ublkcN it is QUIESCED, ready for
    /// START_USER_RECOVERY.
    pub fn quiesce_dev(&mut self) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        let kernel_wait = self
            .deadline
            .saturating_sub(std::time::Duration::from_secs(1))
            .max(std::time::Duration::from_secs(1));
        let ms = u64::try_from(kernel_wait.as_millis()).unwrap_or(u64::MAX);
        self.run(Cmd::QuiesceDev, dev, ms, Buf::None)?;
        Ok(())
    }

    /// TRY_STOP_DEV: STOP_DEV, unless /dev/ublkbN is open (mounted, held, or
    /// opened by a process): then `EBUSY` and the device goes on serving.
    /// Decided by the kernel under the disk's open lock, so nothing can open
    /// the disk between the check and the stop.
    pub fn try_stop_dev(&mut self) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        self.run(Cmd::TryStopDev, dev, 0, Buf::None)?;
        Ok(())
    }

    /// UPDATE_SIZE (6.14+, device added with `UBLK_F_UPDATE_SIZE`): checks the
    /// driver's feature bits first, so a 6.12 kernel yields `Unsupported`.
    pub fn update_size(&mut self, dev_bytes: u64) -> Result<(), CtrlError> {
        let dev = self.dev()?;
        if self.features()? & UBLK_F_UPDATE_SIZE == 0 {
            return Err(CtrlError::Unsupported {
                cmd: Cmd::UpdateSize,
                why: "UPDATE_SIZE needs Linux >= 6.14",
            });
        }
        self.run(Cmd::UpdateSize, dev, dev_bytes / 512, Buf::None)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
