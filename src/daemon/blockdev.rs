//! Handing a device to the kernel as a block device: `/dev/ublkbN` (ublk) or
//! `/dev/nbdN` (the kernel's NBD client, connected in one step).
//!
//! ublk, in the driver's order: ADD_DEV → SET_PARAMS (from the device's geometry) →
//! every queue built on its reactor with all its tags fetched → START_DEV, which
//! returns once the disk exists (the kernel reads its partition table through
//! the queues meanwhile, except on kernels with `UBLK_F_NO_AUTO_PART_SCAN`,
//! 7.0+, where loopd asks for no scan and runs one, `BLKRRPART`, only for
//! `--partscan`, as `losetup -P` does). Removal: STOP_DEV (the disk goes away; the kernel
//! aborts the queues' commands) → wait until every queue is gone (they hold the
//! char device) → DEL_DEV_ASYNC (the id is freed once the last opener of the
//! disk lets go; the daemon does not wait for that). A detach without
//! `--force` stops with TRY_STOP_DEV where the kernel has it (7.0+), so a disk
//! opened after loopd looked for users is refused, not pulled away.
//! Leaving (`serve --keep-blockdevs`, a daemon stopping for a restart): the
//! disk stays for the next daemon on the same state file; where the device
//! was made with `UBLK_F_QUIESCE` (6.15+) QUIESCE_DEV first lets every request
//! in flight finish and holds new ones in the kernel; elsewhere the daemon
//! holds the device's export frozen until requests stop coming
//! ([`KernelDev::holds_for_exit`]: a 6.12 kernel can corrupt its memory when
//! a request arrives while the queues' commands are cancelled) and the
//! requests it took meanwhile are re-issued to the next daemon (user
//! recovery), as after `kill -9`. An nbd device is left with dead connections, which the next
//! daemon replaces (NBD_CMD_RECONFIGURE).
//!
//! NBD (`/dev/nbdN`, the kernel's client connected in one step): see
//! [`super::nbd_dev`]. The errors of both kinds: [`super::blockdev_error`].
//!
//! Everything here runs on control threads and may block (control commands,
//! the char device's appearance, START_DEV); the reactors never wait for it.
//! Every kernel request is bounded by `--kernel-timeout` (ublk commands by
//! their handle's deadline, netlink answers by the socket's): past it the
//! attach fails, and a ublk attach is undone on a new control handle (the
//! old one may still hold a command the kernel has not answered).
//! A failure part-way removes what was made: no half-made device is left.

pub use super::blockdev_error::BlockdevError;
use super::nbd_dev::{NbdDevice, start_nbd};
use crate::blockdev::partitions::{self, Rescan};
use crate::device::Device;
use crate::device::export::Export;
use crate::device::spec::DeviceSpec;
use crate::engine::task::zero_copy_fits;
use crate::frontend::ublk::chardev::UblkChar;
use crate::frontend::ublk::ctrl::{AddDev, DeviceParams, UblkCtrl};
use crate::frontend::ublk::sys::{
    UBLK_F_AUTO_BUF_REG, UBLK_F_NO_AUTO_PART_SCAN, UBLK_F_QUIESCE, UBLK_F_SAFE_STOP_DEV,
    UBLK_F_UPDATE_SIZE, UBLK_S_DEV_FAIL_IO, UBLK_S_DEV_LIVE, UBLK_S_DEV_QUIESCED,
    UblksrvCtrlDevInfo, feature_names,
};
use crate::reactor::ReactorHandle;
use crate::reactor::handle::{NO_FIXED_SLOTS, UblkQueueSetup};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a detach without `--force` keeps asking the kernel to stop a
/// disk that is open (TRY_STOP_DEV), and how often, before it refuses: udev
/// opens a disk for a moment to probe it after every partition scan.
const OPEN_GRACE: Duration = Duration::from_secs(3);
const OPEN_GRACE_POLL: Duration = Duration::from_millis(50);

/// Requests in flight per queue unless `--queue-depth` says otherwise.
pub const DEFAULT_DEPTH: u16 = 128;
/// The largest request the kernel sends (and each tag's buffer) in copy mode.
pub const MAX_IO: u32 = 512 << 10;
/// The largest request with zero copy, where a tag has no buffer of its own
/// and a bigger request costs nothing: 1 MiB, so a 1 MiB write (`dd bs=1M`,
/// a filesystem's large write-back) is one request, as it is to the kernel's
/// own loop device, not two.
pub const MAX_IO_ZERO_COPY: u32 = 1 << 20;
/// The largest discard or write-zeroes request.
const MAX_ZEROES: u32 = 1 << 30;
/// How long to wait for the char device, the queues, or their end.
const WAIT: Duration = Duration::from_secs(10);

/// A live ublk device of one export.
pub struct UblkDevice {
    pub dev_id: u32,
    /// Made with UPDATE_SIZE allowed (the kernel had it, 6.14+).
    resizable: bool,
    /// The kernel read the partition table when it added the disk (not when
    /// made with `UBLK_F_NO_AUTO_PART_SCAN`, 7.0+; a device taken back after
    /// a restart keeps the partitions it had).
    pub kernel_scanned: bool,
    /// The `UBLK_F_*` bits the kernel offers (GET_FEATURES, asked once when
    /// the device was made or recovered; 0 if the kernel did not answer).
    kernel_features: u64,
    /// The optional fast paths this device uses (names, see
    /// [`UblkDevice::fast_paths`]).
    fast_paths: Vec<&'static str>,
    /// The `UBLK_F_*` flags the device was made with.
    flags: u64,
    ctrl: Mutex<UblkCtrl>,
    /// Disconnected once every queue of the device is gone.
    done: Mutex<Receiver<()>>,
}

impl UblkDevice {
    /// The block device node.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/ublkb{}", self.dev_id))
    }

    /// The names of the `UBLK_F_*` features the kernel offers.
    pub fn kernel_features(&self) -> Vec<String> {
        feature_names(self.kernel_features)
    }

    /// The kernel fast paths this device uses, by their feature's name
    /// (`no_auto_part_scan`: nothing read at START_DEV); empty when it uses
    /// none.
    pub fn fast_paths(&self) -> Vec<String> {
        self.fast_paths.iter().map(|p| (*p).to_owned()).collect()
    }

    /// Whether the device was made with zero copy (`UBLK_F_AUTO_BUF_REG`):
    /// its queues have no buffer to copy through, so every configuration it
    /// is given must keep reads and writes direct and aligned.
    pub fn zero_copy(&self) -> bool {
        self.fast_paths.contains(&"auto_buf_reg")
    }

    /// Whether the kernel can change this device's size: it was made with
    /// UPDATE_SIZE, which needs 6.14+ (asked once, at ADD_DEV).
    pub fn can_resize(&self) -> Result<(), BlockdevError> {
        if !self.resizable {
            return Err(BlockdevError::Unfollowable(
                "this kernel cannot change a ublk device's size (UPDATE_SIZE needs Linux 6.14 or \
                 later); detach and attach the device to give it the new size"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Tell the kernel the device's new size.
    pub fn resize(&self, dev_bytes: u64) -> Result<(), BlockdevError> {
        let mut ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
        Ok(ctrl.update_size(dev_bytes)?)
    }

    /// Remove the block device: STOP_DEV, wait for the queues, DEL_DEV_ASYNC.
    /// `unless_open`: refuse ([`BlockdevError::Open`]) if the disk is open
    /// (still after [`OPEN_GRACE`]), decided by the kernel (TRY_STOP_DEV)
    /// where it can (the device was made with `UBLK_F_SAFE_STOP_DEV`, 7.0+);
    /// elsewhere the caller's check of the disk's users is all there is.
    pub fn remove(&self, unless_open: bool) -> Result<(), BlockdevError> {
        let mut ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
        if unless_open && self.flags & UBLK_F_SAFE_STOP_DEV != 0 {
            // An opener for a moment (udev probing the partitions a scan just
            // announced) is waited out; one that stays is refused.
            let start = Instant::now();
            loop {
                match ctrl.try_stop_dev() {
                    Err(e) if e.errno() == Some(libc::EBUSY) => {
                        if start.elapsed() >= OPEN_GRACE {
                            return Err(BlockdevError::Open(self.path()));
                        }
                        std::thread::sleep(OPEN_GRACE_POLL);
                    }
                    r => break r?,
                }
            }
        } else {
            ctrl.stop_dev()?;
        }
        wait_gone(&self.done.lock().unwrap_or_else(|p| p.into_inner()));
        // Not DEL_DEV: it waits for every opener of /dev/ublkbN, and a process
        // holding a force-detached disk may never close it.
        ctrl.del_dev_async()?;
        Ok(())
    }

    /// Whether [`UblkDevice::leave`] can quiesce the disk (made with
    /// `UBLK_F_QUIESCE`).
    pub fn quiesces(&self) -> bool {
        self.flags & UBLK_F_QUIESCE != 0
    }

    /// Leave the disk to the next daemon (see the module documentation):
    /// QUIESCE_DEV and wait for the queues to end where the device allows it
    /// (then `Left::Quiesced`), else nothing (`Left::InFlight`: the queues'
    /// commands end when their reactor's ring closes, and whatever was in
    /// flight is re-issued to the next daemon). The queues must still be
    /// served while this runs.
    pub fn leave(&self) -> Left {
        if self.flags & UBLK_F_QUIESCE == 0 {
            return Left::InFlight;
        }
        let mut ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
        match ctrl.quiesce_dev() {
            Ok(()) => {
                wait_gone(&self.done.lock().unwrap_or_else(|p| p.into_inner()));
                Left::Quiesced
            }
            Err(e) => {
                tracing::warn!(
                    "{}: {e}; requests in flight go to the next daemon again",
                    self.path().display()
                );
                Left::InFlight
            }
        }
    }
}

/// How a block device was left to the next daemon ([`UblkDevice::leave`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Left {
    /// Nothing in flight; new requests wait in the kernel.
    Quiesced,
    /// Requests in flight (if any) are re-issued to the next daemon; new ones
    /// wait in the kernel (ublk) or for new connections (nbd).
    InFlight,
}

/// Wait (bounded) until every sender of `done` is dropped.
fn wait_gone(done: &Receiver<()>) {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match done.recv_timeout(left) {
            Ok(()) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {
                tracing::warn!("ublk queues did not finish within {}s", WAIT.as_secs());
                return;
            }
        }
    }
}

/// The parameters the kernel gets for `dev`, whose requests are at most
/// `max_io` bytes.
fn params_of(dev: &Device, max_io: u32) -> DeviceParams {
    let block = dev.block_size;
    DeviceParams {
        // Whole blocks: the kernel cannot address a partial last block.
        dev_bytes: dev.size - dev.size % u64::from(block),
        logical_block: block,
        physical_block: block.max(dev.dio_align).clamp(block, 4096),
        io_opt: 0,
        max_io_bytes: max_io,
        max_discard_bytes: if dev.read_only { 0 } else { MAX_ZEROES },
        max_write_zeroes_bytes: if dev.read_only { 0 } else { MAX_ZEROES },
        read_only: dev.read_only,
        rotational: false,
        // Writes are durable only after a flush (fdatasync of the file).
        volatile_cache: true,
        fua: true,
    }
}

/// How long a restarted daemon waits for the old one's hold on a device to go
/// (the kernel releases a killed server's rings and char device shortly after).
const RECOVER_WAIT: Duration = Duration::from_secs(10);

/// Create and start a ublk device for `export`, its queues on `reactors`. A
/// spec that records a device id (`ublk_id`) takes that device back if it still
/// exists (user recovery after the daemon died: the disk stayed, I/O waited),
/// else makes a new one with that id where it is free.
pub fn start_ublk(
    export: &Arc<Export>,
    spec: &DeviceSpec,
    reactors: &[Arc<ReactorHandle>],
) -> Result<UblkDevice, BlockdevError> {
    if reactors.is_empty() {
        return Err(BlockdevError::NoReactors);
    }
    let queues = spec
        .queues
        .unwrap_or(u16::try_from(reactors.len()).unwrap_or(u16::MAX))
        .max(1);
    if usize::from(queues) > reactors.len() {
        return Err(BlockdevError::TooManyQueues {
            asked: queues,
            reactors: reactors.len(),
        });
    }
    let depth = spec.queue_depth.unwrap_or(DEFAULT_DEPTH);
    if depth == 0 || depth > 4096 {
        return Err(BlockdevError::Depth(depth));
    }
    if let Some(id) = spec.ublk_id {
        let mut ctrl = UblkCtrl::open()?.for_device(id);
        match ctrl.dev_info() {
            Ok(info) if info.state == UBLK_S_DEV_QUIESCED || info.state == UBLK_S_DEV_FAIL_IO => {
                return recover(export, ctrl, &info, reactors);
            }
            // Its server is gone but the kernel has not noticed yet: 6.12
            // looks every 5 s (later kernels as the server's ring closes).
            Ok(info)
                if info.state == UBLK_S_DEV_LIVE
                    && !crate::blockdev::users::process_alive(info.ublksrv_pid) =>
            {
                match ctrl.wait_for_state(UBLK_S_DEV_QUIESCED, RECOVER_WAIT) {
                    Ok(info) => return recover(export, ctrl, &info, reactors),
                    Err(e) => tracing::warn!(
                        "ublk device {id}: its server (pid {}) is gone, but the device did                          not wait for recovery ({e}); making a new device",
                        info.ublksrv_pid
                    ),
                }
            }
            Ok(info) => {
                tracing::warn!(
                    "ublk device {id} exists in state {} (not waiting for recovery); \
                     making a new device",
                    info.state
                );
            }
            Err(e) if e.errno() == Some(libc::ENODEV) || e.errno() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let (dev, _) = export.current();
    let mut ctrl = UblkCtrl::open()?;
    let kernel_features = ctrl.features().unwrap_or(0);
    let resizable = kernel_features & UBLK_F_UPDATE_SIZE != 0;
    let mut add = AddDev {
        dev_id: spec.ublk_id,
        nr_hw_queues: queues,
        queue_depth: depth,
        max_io_buf_bytes: MAX_IO,
        user_recovery: true,
        reissue: true,
        resizable,
        // Where the kernel can leave the table alone, it does: no reads
        // through the queues while START_DEV waits, and partition devices
        // only when asked (`--partscan`, as losetup -P), by BLKRRPART.
        no_auto_part_scan: kernel_features & UBLK_F_NO_AUTO_PART_SCAN != 0,
        // A restart can hand the disk over with nothing in flight, and a
        // detach can stop it only if nobody opened it meanwhile.
        quiesce: kernel_features & UBLK_F_QUIESCE != 0,
        safe_stop: kernel_features & UBLK_F_SAFE_STOP_DEV != 0,
        auto_buf_reg: zero_copy_wanted(export, spec, &dev, kernel_features),
    };
    let (info, done_rx) = loop {
        add.max_io_buf_bytes = if add.auto_buf_reg {
            MAX_IO_ZERO_COPY
        } else {
            MAX_IO
        };
        let uapi = params_of(&dev, add.max_io_buf_bytes).to_uapi()?;
        let info = match ctrl.add_dev(&add) {
            Err(e) if add.dev_id.is_some() && e.errno() == Some(libc::EEXIST) => {
                add.dev_id = None;
                ctrl.add_dev(&add)?
            }
            r => r?,
        };
        let (done_tx, done_rx) = channel();
        let made = (|| -> Result<(), BlockdevError> {
            ctrl.set_params(&uapi)?;
            serve_queues(export, &info, reactors, &done_tx)?;
            ctrl.start_dev(my_pid())?;
            Ok(())
        })();
        drop(done_tx);
        let Err(e) = made else {
            break (info, done_rx);
        };
        // Undo: stopping aborts the queues' fetches, and they end. On a new
        // handle: a command past its deadline may still hold this one's ring.
        let mut undo = UblkCtrl::open().map_or(ctrl, |c| c.for_device(info.dev_id));
        let _ = undo.stop_dev();
        wait_gone(&done_rx);
        let _ = undo.del_dev();
        if !(add.auto_buf_reg && no_fixed_slots(&e)) {
            return Err(e);
        }
        // Zero copy is a speed-up, not a need: a reactor whose fixed-buffer
        // table is taken by other devices' queues serves this one in copy mode.
        tracing::info!("device {:?}: {e}; made without zero copy", export.name);
        add.auto_buf_reg = false;
        ctrl = UblkCtrl::open()?;
    };
    Ok(UblkDevice {
        dev_id: info.dev_id,
        resizable: info.flags & UBLK_F_UPDATE_SIZE != 0,
        kernel_scanned: info.flags & UBLK_F_NO_AUTO_PART_SCAN == 0,
        kernel_features,
        fast_paths: fast_paths_of(info.flags),
        flags: info.flags,
        ctrl: Mutex::new(ctrl),
        done: Mutex::new(done_rx),
    })
}

/// Whether a queue could not be built for want of fixed-buffer slots on its
/// reactor (zero copy only).
fn no_fixed_slots(e: &BlockdevError) -> bool {
    matches!(e, BlockdevError::Queue { why, .. } if why.starts_with(NO_FIXED_SLOTS))
}

/// Whether a new ublk device for `dev` gets zero copy
/// (`UBLK_F_AUTO_BUF_REG`): the kernel offers it, `--no-zero-copy` was not
/// given, and every read and write of the device can go straight between
/// the request's pages and the file ([`zero_copy_fits`]). Decided once, when
/// the device is made; a `set` that would take it away is refused.
fn zero_copy_wanted(export: &Export, spec: &DeviceSpec, dev: &Device, features: u64) -> bool {
    if spec.no_zero_copy || features & UBLK_F_AUTO_BUF_REG == 0 {
        return false;
    }
    match zero_copy_fits(dev) {
        Ok(()) => true,
        Err(why) => {
            tracing::debug!("device {:?}: ublk without zero copy: {why}", export.name);
            false
        }
    }
}

/// The optional kernel paths a device made with `flags` uses, by feature
/// name: `auto_buf_reg` (zero copy: request pages go to the file without a
/// copy, 6.16+), `no_auto_part_scan` (no partition scan at START_DEV, 7.0+),
/// `quiesce` (a restart hands the disk over with nothing in flight, 6.15+),
/// `safe_stop_dev` (a detach stops it only if nobody has it open, 7.0+).
fn fast_paths_of(flags: u64) -> Vec<&'static str> {
    let mut paths = Vec::new();
    if flags & UBLK_F_AUTO_BUF_REG != 0 {
        paths.push("auto_buf_reg");
    }
    if flags & UBLK_F_NO_AUTO_PART_SCAN != 0 {
        paths.push("no_auto_part_scan");
    }
    if flags & UBLK_F_QUIESCE != 0 {
        paths.push("quiesce");
    }
    if flags & UBLK_F_SAFE_STOP_DEV != 0 {
        paths.push("safe_stop_dev");
    }
    paths
}

fn my_pid() -> i32 {
    i32::try_from(std::process::id()).unwrap_or(i32::MAX)
}

/// Build every queue of the device `info` describes on `reactors` and wait
/// until each has fetched all its tags.
fn serve_queues(
    export: &Arc<Export>,
    info: &UblksrvCtrlDevInfo,
    reactors: &[Arc<ReactorHandle>],
    done_tx: &Sender<()>,
) -> Result<(), BlockdevError> {
    let char = Arc::new(UblkChar::open(info.dev_id, WAIT)?);
    let (ready_tx, ready_rx) = channel();
    for q_id in 0..info.nr_hw_queues {
        let r = &reactors[usize::from(q_id) % reactors.len()];
        let setup = UblkQueueSetup {
            export: Arc::clone(export),
            char: Arc::clone(&char),
            q_id,
            depth: info.queue_depth,
            max_io: info.max_io_buf_bytes,
            zero_copy: info.flags & UBLK_F_AUTO_BUF_REG != 0,
            ready: ready_tx.clone(),
            done: done_tx.clone(),
        };
        if !r.add_ublk_queue(setup) {
            return Err(BlockdevError::NoReactors);
        }
    }
    drop(char);
    for q_id in 0..info.nr_hw_queues {
        match ready_rx.recv_timeout(WAIT) {
            Ok(Ok(())) => {}
            Ok(Err(why)) => return Err(BlockdevError::Queue { q_id, why }),
            Err(_) => {
                return Err(BlockdevError::Queue {
                    q_id,
                    why: "its reactor did not answer".into(),
                });
            }
        }
    }
    Ok(())
}

/// Take back a device whose server died: START_USER_RECOVERY (retried while
/// the old server's hold is being released), queues, END_USER_RECOVERY. The
/// disk never went away; I/O waited and now resumes.
fn recover(
    export: &Arc<Export>,
    mut ctrl: UblkCtrl,
    info: &UblksrvCtrlDevInfo,
    reactors: &[Arc<ReactorHandle>],
) -> Result<UblkDevice, BlockdevError> {
    if usize::from(info.nr_hw_queues) > reactors.len() {
        return Err(BlockdevError::TooManyQueues {
            asked: info.nr_hw_queues,
            reactors: reactors.len(),
        });
    }
    if info.flags & UBLK_F_AUTO_BUF_REG != 0 {
        let (dev, _) = export.current();
        if let Err(why) = zero_copy_fits(&dev) {
            // The device keeps the mode it was made with: requests that
            // cannot go straight to the file fail (EIO) rather than guess.
            tracing::error!(
                "device {:?}: /dev/ublkb{} was made with zero copy, but {why}: its reads and \
                 writes will fail; detach it and attach again",
                export.name,
                info.dev_id
            );
        }
    }
    let deadline = Instant::now() + RECOVER_WAIT;
    loop {
        match ctrl.start_user_recovery() {
            Ok(()) => break,
            Err(e) if e.errno() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let (done_tx, done_rx) = channel();
    let served = serve_queues(export, info, reactors, &done_tx);
    drop(done_tx);
    served?;
    ctrl.end_user_recovery(my_pid())?;
    let kernel_features = ctrl.features().unwrap_or(0);
    tracing::info!(
        "device {:?}: recovered /dev/ublkb{} from the previous server",
        export.name,
        info.dev_id
    );
    Ok(UblkDevice {
        dev_id: info.dev_id,
        resizable: info.flags & UBLK_F_UPDATE_SIZE != 0,
        kernel_scanned: true,
        kernel_features,
        fast_paths: fast_paths_of(info.flags),
        flags: info.flags,
        ctrl: Mutex::new(ctrl),
        done: Mutex::new(done_rx),
    })
}

/// A device's kernel block device, of either kind.
pub enum KernelDev {
    Ublk(Box<UblkDevice>),
    Nbd(NbdDevice),
}

impl KernelDev {
    pub fn path(&self) -> PathBuf {
        match self {
            KernelDev::Ublk(u) => u.path(),
            KernelDev::Nbd(n) => n.path(),
        }
    }

    /// The export's clients that are this block device's own connections.
    pub fn own_clients(&self) -> u32 {
        match self {
            KernelDev::Ublk(_) => 0,
            KernelDev::Nbd(n) => n.conns,
        }
    }

    /// Remove the block device; `unless_open`: see [`UblkDevice::remove`]
    /// (an nbd device has no such check in the kernel).
    pub fn remove(&self, unless_open: bool) -> Result<(), BlockdevError> {
        match self {
            KernelDev::Ublk(u) => u.remove(unless_open),
            KernelDev::Nbd(n) => n.remove(),
        }
    }

    /// Leave the block device to the next daemon (see the module
    /// documentation).
    pub fn leave(&self) -> Left {
        match self {
            KernelDev::Ublk(u) => u.leave(),
            KernelDev::Nbd(_) => Left::InFlight,
        }
    }

    /// Whether leaving this disk to the next daemon should hold its export
    /// first ([`crate::device::export::Export::freeze_for_exit`]): a ublk disk
    /// the kernel cannot quiesce. There the ublk driver cancels the queues'
    /// commands when their threads exit, and on kernels before 6.15 (6.12
    /// among them) a request the kernel is handing to a command at that
    /// moment can be completed twice, which corrupts the kernel's memory
    /// (fixed upstream by "ublk: fix race between
    /// io_uring_cmd_complete_in_task and ublk_cancel_cmd"). Holding new
    /// requests until they stop coming closes that window for a planned
    /// stop; `kill -9` cannot.
    pub fn holds_for_exit(&self) -> bool {
        match self {
            KernelDev::Ublk(u) => !u.quiesces(),
            KernelDev::Nbd(_) => false,
        }
    }

    /// Whether the kernel can follow a size change.
    pub fn can_resize(&self) -> Result<(), BlockdevError> {
        match self {
            KernelDev::Ublk(u) => u.can_resize(),
            KernelDev::Nbd(_) => Err(BlockdevError::Unfollowable(
                "the kernel NBD client cannot change a connected device's size (netlink \
                 reconfigure carries no size); detach and attach the device to give it the new size"
                    .into(),
            )),
        }
    }

    pub fn resize(&self, bytes: u64) -> Result<(), BlockdevError> {
        match self {
            KernelDev::Ublk(u) => u.resize(bytes),
            KernelDev::Nbd(_) => self.can_resize(),
        }
    }
}

/// How long `--partscan` waits for the partition devices.
const PARTSCAN_WAIT: Duration = Duration::from_secs(10);

/// Make the kernel block device `spec` asks for. With `partscan`, it returns
/// only once the partition devices exist (the kernel's scan is run where the
/// driver defers it), so nothing races udev for them afterwards.
pub fn start(
    export: &Arc<Export>,
    spec: &DeviceSpec,
    reactors: &[Arc<ReactorHandle>],
) -> Result<Option<KernelDev>, BlockdevError> {
    let (k, rescan) = match spec.blockdev {
        None => return Ok(None),
        Some(crate::device::spec::Blockdev::Ublk) => {
            let u = start_ublk(export, spec, reactors)?;
            // START_DEV returns after add_disk, which scans the table unless
            // the device was made not to (then BLKRRPART does, now).
            let rescan = if u.kernel_scanned {
                Rescan::AlreadyDone
            } else {
                Rescan::Reread
            };
            (KernelDev::Ublk(Box::new(u)), rescan)
        }
        Some(crate::device::spec::Blockdev::Nbd) => (
            KernelDev::Nbd(start_nbd(export, spec, reactors)?),
            // nbd marks the disk for a scan at its next open.
            Rescan::FirstOpen,
        ),
    };
    if spec.partscan
        && let Err(e) = partitions::settle(&k.path(), rescan, PARTSCAN_WAIT)
    {
        let _ = k.remove(false);
        return Err(BlockdevError::Partitions(e));
    }
    Ok(Some(k))
}
