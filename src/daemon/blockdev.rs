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
//! disk lets go; the daemon does not wait for that).
//!
//! NBD: socket pairs, one end handed to a reactor as an already negotiated
//! connection (no handshake round trip), the other to the kernel over netlink
//! (NBD_CMD_CONNECT) with the export's size, block size and transmission flags
//! and a backend identifier; a dead-connection timeout keeps I/O waiting when the
//! daemon dies, and a restarted daemon finds the device by its identifier and
//! hands it new connections (NBD_CMD_RECONFIGURE). Removal: NBD_CMD_DISCONNECT.
//!
//! Everything here runs on control threads and may block (control commands,
//! the char device's appearance, START_DEV); the reactors never wait for it.
//! Every kernel request is bounded by `--kernel-timeout` (ublk commands by
//! their handle's deadline, netlink answers by the socket's): past it the
//! attach fails, and a ublk attach is undone on a new control handle (the
//! old one may still hold a command the kernel has not answered). A
//! reconnect of `/dev/nbdN` checks that the kernel kept every new socket
//! (it silently drops one while the old connection lives) and gives dropped
//! ones again until the deadline ([`reconnect_nbd`]).
//! A failure part-way removes what was made: no half-made device is left.

use crate::blockdev::partitions::{self, PartitionError, Rescan};
use crate::device::Device;
use crate::device::export::Export;
use crate::device::spec::DeviceSpec;
use crate::engine::admit::Admission;
use crate::engine::task::zero_copy_fits;
use crate::frontend::nbd::affinity::Peer;
use crate::frontend::nbd::conn::{Conn, NewConn};
use crate::frontend::nbd::handshake::transmission_flags;
use crate::frontend::ublk::chardev::{CharError, UblkChar};
use crate::frontend::ublk::ctrl::{AddDev, CtrlError, DeviceParams, UblkCtrl};
use crate::frontend::ublk::sys::{
    UBLK_F_AUTO_BUF_REG, UBLK_F_NO_AUTO_PART_SCAN, UBLK_F_UPDATE_SIZE, UBLK_S_DEV_FAIL_IO,
    UBLK_S_DEV_QUIESCED, UblksrvCtrlDevInfo, feature_names,
};
use crate::kernel_nbd::{ConnectParams, KernelNbd, KernelNbdError, ReconfigureParams};
use crate::reactor::handle::{NO_FIXED_SLOTS, UblkQueueSetup};
use crate::reactor::{ReactorHandle, Session};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Requests in flight per queue unless `--queue-depth` says otherwise.
pub const DEFAULT_DEPTH: u16 = 128;
/// The largest request the kernel sends (and each tag's buffer).
pub const MAX_IO: u32 = 512 << 10;
/// The largest discard or write-zeroes request.
const MAX_ZEROES: u32 = 1 << 30;
/// How long to wait for the char device, the queues, or their end.
const WAIT: Duration = Duration::from_secs(10);

/// Per-request timeout the kernel NBD client applies (a request in flight when
/// a connection dies is sent again after it).
const NBD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the kernel NBD client keeps I/O waiting for a restarted daemon.
const NBD_DEAD_CONN_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Error)]
pub enum BlockdevError {
    #[error(transparent)]
    Nbd(#[from] KernelNbdError),
    #[error("cannot make a socket pair for the kernel NBD connection")]
    SocketPair(#[source] std::io::Error),
    #[error("--connections must be 1..=64, not {0}")]
    Connections(u16),
    #[error("the partition devices did not appear")]
    Partitions(#[source] PartitionError),
    #[error(transparent)]
    Ctrl(#[from] CtrlError),
    #[error(transparent)]
    Char(#[from] CharError),
    #[error(
        "--queues {asked} is more than this daemon's {reactors} reactor(s): each ublk queue is \
         served by one reactor (raise --reactors)"
    )]
    TooManyQueues { asked: u16, reactors: usize },
    #[error("--queue-depth must be 1..=4096, not {0}")]
    Depth(u16),
    #[error("ublk queue {q_id} could not be started: {why}")]
    Queue { q_id: u16, why: String },
    #[error("the daemon's reactors are not running")]
    NoReactors,
    #[error("{0}")]
    Unfollowable(String),
    #[error(
        "/dev/nbd{index} (backend {backend:?}) still has live connections after {:.1}s: the \
         kernel took {taken} of {n} new connections (it replaces only dead ones), so another \
         server still serves it (another loopd with a device of this name?); detach it there, \
         or give this device another name",
        waited.as_secs_f64()
    )]
    NbdLive {
        index: u32,
        backend: String,
        taken: u16,
        n: u16,
        waited: Duration,
    },
}

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
    pub fn remove(&self) -> Result<(), BlockdevError> {
        let mut ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
        ctrl.stop_dev()?;
        wait_gone(&self.done.lock().unwrap_or_else(|p| p.into_inner()));
        // Not DEL_DEV: it waits for every opener of /dev/ublkbN, and a process
        // holding a force-detached disk may never close it.
        ctrl.del_dev_async()?;
        Ok(())
    }
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

/// The parameters the kernel gets for `dev`.
fn params_of(dev: &Device) -> DeviceParams {
    let block = dev.block_size;
    DeviceParams {
        // Whole blocks: the kernel cannot address a partial last block.
        dev_bytes: dev.size - dev.size % u64::from(block),
        logical_block: block,
        physical_block: block.max(dev.dio_align).clamp(block, 4096),
        io_opt: 0,
        max_io_bytes: MAX_IO,
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
    let uapi = params_of(&dev).to_uapi()?;
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
        auto_buf_reg: zero_copy_wanted(export, spec, &dev, kernel_features),
    };
    let (info, done_rx) = loop {
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
/// copy, 6.16+), `no_auto_part_scan` (no partition scan at
/// START_DEV, 7.0+).
fn fast_paths_of(flags: u64) -> Vec<&'static str> {
    let mut paths = Vec::new();
    if flags & UBLK_F_AUTO_BUF_REG != 0 {
        paths.push("auto_buf_reg");
    }
    if flags & UBLK_F_NO_AUTO_PART_SCAN != 0 {
        paths.push("no_auto_part_scan");
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
        ctrl: Mutex::new(ctrl),
        done: Mutex::new(done_rx),
    })
}

/// A device's kernel NBD client (`/dev/nbdN`) connected to its export.
pub struct NbdDevice {
    pub index: u32,
    kn: Mutex<KernelNbd>,
    export: Arc<Export>,
    /// Connections handed to the kernel.
    conns: u32,
}

impl NbdDevice {
    pub fn path(&self) -> PathBuf {
        crate::kernel_nbd::device_path(self.index)
    }

    /// Disconnect the kernel client (the device goes back to size 0) and wait
    /// until its connections are gone from the reactors.
    pub fn remove(&self) -> Result<(), BlockdevError> {
        let goal = self.export.clients().saturating_sub(self.conns);
        let mut kn = self.kn.lock().unwrap_or_else(|p| p.into_inner());
        kn.disconnect(self.index)?;
        let deadline = Instant::now() + WAIT;
        // The kernel shuts its sockets; their reactor connections see EOF.
        while self.export.clients() > goal && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

/// The identifier the kernel keeps in `/sys/block/nbdN/backend`, by which a
/// restarted daemon finds its device again.
fn nbd_backend(export: &Export) -> String {
    format!("loopd:{}", export.name)
}

/// Connect the kernel's NBD client to `export` over `n` socket pairs, the
/// loopd ends served by `reactors` as negotiated connections; or, where a
/// device with this export's backend identifier waits for its dead connections
/// (the daemon died), hand it new ones.
pub fn start_nbd(
    export: &Arc<Export>,
    spec: &DeviceSpec,
    reactors: &[Arc<ReactorHandle>],
) -> Result<NbdDevice, BlockdevError> {
    if reactors.is_empty() {
        return Err(BlockdevError::NoReactors);
    }
    let n = spec.connections.unwrap_or(1);
    if !(1..=64).contains(&n) {
        return Err(BlockdevError::Connections(n));
    }
    let mut kn = KernelNbd::open()?;
    let backend = nbd_backend(export);
    let existing = kn.find_backend(&backend)?;
    let (dev, _) = export.current();
    let index = match existing {
        Some(index) => {
            reconnect_nbd(&mut kn, export, reactors, index, n, &backend)?;
            tracing::info!(
                "device {:?}: reconnected /dev/nbd{index} left by the previous server",
                export.name
            );
            index
        }
        None => {
            let (kernel_ends, _) = nbd_pairs(export, reactors, n)?;
            let fds: Vec<_> = kernel_ends.iter().map(|f| f.as_fd()).collect();
            // The kernel holds its own references to the sockets once this returns.
            kn.connect(
                &ConnectParams {
                    index: None,
                    size_bytes: dev.size - dev.size % u64::from(dev.block_size),
                    block_size: dev.block_size,
                    server_flags: transmission_flags(&dev, false),
                    timeout: Some(NBD_TIMEOUT),
                    dead_conn_timeout: Some(NBD_DEAD_CONN_TIMEOUT),
                    destroy_on_disconnect: false,
                    backend: Some(backend),
                },
                &fds,
            )?
        }
    };
    Ok(NbdDevice {
        index,
        kn: Mutex::new(kn),
        export: Arc::clone(export),
        conns: u32::from(n),
    })
}

/// `n` socket pairs: each loopd end adopted by a reactor as a negotiated
/// connection. Returns the kernel ends, and a duplicate of each loopd end by
/// which to see whether the kernel kept its end ([`hung_up`]).
fn nbd_pairs(
    export: &Arc<Export>,
    reactors: &[Arc<ReactorHandle>],
    n: u16,
) -> Result<(Vec<OwnedFd>, Vec<OwnedFd>), BlockdevError> {
    let mut kernel_ends = Vec::new();
    let mut watch = Vec::new();
    // Kernel connections are the daemon's own: outside --max-connections.
    let admission = Admission::new(usize::MAX);
    for i in 0..usize::from(n) {
        let (k, u) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| BlockdevError::SocketPair(e.into()))?;
        watch.push(u.try_clone().map_err(BlockdevError::SocketPair)?);
        let (Some(client), Some(permit)) = (export.join(), admission.try_admit()) else {
            return Err(BlockdevError::NoReactors);
        };
        reactors[i % reactors.len()].adopt(Session::nbd(Conn::new(NewConn {
            sock: u,
            client,
            permit,
            structured: false,
            extended: false,
            meta_context: false,
            peer: Peer::Unknown,
            tls: None,
            encrypted: false,
        })));
        kernel_ends.push(k);
    }
    Ok((kernel_ends, watch))
}

/// Whether the other end of the socket `fd` is closed: after a netlink call
/// returned and loopd closed its copy of the kernel end, the kernel did not
/// keep it.
fn hung_up(fd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut p = [PollFd::new(fd, PollFlags::RDHUP)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut p, Some(&now)), Ok(1))
        && p[0].revents().intersects(PollFlags::HUP | PollFlags::RDHUP)
}

/// How often a reconnect retries sockets the kernel dropped.
const RECONNECT_RETRY: Duration = Duration::from_millis(50);

/// Hand device `index` (found by its backend identifier: the previous server
/// died) `n` new connections. The kernel replaces only connections it has
/// marked dead and silently drops a socket given while none is (nbd.c turns
/// `ENOSPC` into success): a daemon restarted before the kernel saw the old
/// one's EOF, or a second daemon with a device of the same name while the
/// first one lives, would be told "reconnected" while the device stayed with
/// the old connections. So each socket's loopd end is watched: a socket the
/// kernel dropped is given again (a new pair) every [`RECONNECT_RETRY`] until
/// all are taken, for at most the kernel deadline (`--kernel-timeout`); then
/// the attach fails, naming the device.
fn reconnect_nbd(
    kn: &mut KernelNbd,
    export: &Arc<Export>,
    reactors: &[Arc<ReactorHandle>],
    index: u32,
    n: u16,
    backend: &str,
) -> Result<(), BlockdevError> {
    let start = Instant::now();
    let limit = crate::kernel_nbd::socket::reply_timeout();
    let mut left = n;
    loop {
        let (kernel_ends, watch) = nbd_pairs(export, reactors, left)?;
        let fds: Vec<_> = kernel_ends.iter().map(|f| f.as_fd()).collect();
        kn.reconfigure(
            index,
            &ReconfigureParams {
                timeout: Some(NBD_TIMEOUT),
                dead_conn_timeout: Some(NBD_DEAD_CONN_TIMEOUT),
                backend: Some(backend.to_owned()),
            },
            &fds,
        )?;
        drop(fds);
        drop(kernel_ends);
        let dropped = watch.iter().filter(|w| hung_up(w)).count();
        if dropped == 0 {
            return Ok(());
        }
        left = u16::try_from(dropped).unwrap_or(n);
        if start.elapsed() >= limit {
            return Err(BlockdevError::NbdLive {
                index,
                backend: backend.to_owned(),
                taken: n - left,
                n,
                waited: limit,
            });
        }
        tracing::debug!(
            "/dev/nbd{index}: the kernel dropped {dropped} new connection(s); retrying"
        );
        std::thread::sleep(RECONNECT_RETRY);
    }
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

    pub fn remove(&self) -> Result<(), BlockdevError> {
        match self {
            KernelDev::Ublk(u) => u.remove(),
            KernelDev::Nbd(n) => n.remove(),
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
        let _ = k.remove();
        return Err(BlockdevError::Partitions(e));
    }
    Ok(Some(k))
}
