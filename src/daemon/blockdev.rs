//! Handing a device to the kernel as a block device: `/dev/ublkbN`.
//!
//! Order (the driver's): ADD_DEV → SET_PARAMS (from the device's geometry) →
//! every queue built on its reactor with all its tags fetched → START_DEV, which
//! returns once the disk exists (the kernel reads its partition table through
//! the queues meanwhile). Removal: STOP_DEV (the disk goes away; the kernel
//! aborts the queues' commands) → wait until every queue is gone (they hold the
//! char device) → DEL_DEV.
//!
//! Everything here runs on control threads and may block (control commands,
//! the char device's appearance, START_DEV); the reactors never wait for it.
//! A failure part-way removes what was made: no half-made device is left.

use crate::device::Device;
use crate::device::export::Export;
use crate::device::spec::DeviceSpec;
use crate::frontend::ublk::chardev::{CharError, UblkChar};
use crate::frontend::ublk::ctrl::{AddDev, CtrlError, DeviceParams, UblkCtrl};
use crate::frontend::ublk::sys::{
    UBLK_F_UPDATE_SIZE, UBLK_S_DEV_FAIL_IO, UBLK_S_DEV_QUIESCED, UblksrvCtrlDevInfo,
};
use crate::reactor::ReactorHandle;
use crate::reactor::handle::UblkQueueSetup;
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

#[derive(Debug, Error)]
pub enum BlockdevError {
    #[error("{0}")]
    Ctrl(#[from] CtrlError),
    #[error("{0}")]
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
}

/// A live ublk device of one export.
pub struct UblkDevice {
    pub dev_id: u32,
    ctrl: Mutex<UblkCtrl>,
    /// Disconnected once every queue of the device is gone.
    done: Mutex<Receiver<()>>,
}

impl UblkDevice {
    /// The block device node.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/ublkb{}", self.dev_id))
    }

    /// Whether the kernel can change this device's size (UPDATE_SIZE, 6.14+).
    pub fn can_resize(&self) -> Result<(), BlockdevError> {
        let mut ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
        if ctrl.features()? & UBLK_F_UPDATE_SIZE == 0 {
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

    /// Remove the block device: STOP_DEV, wait for the queues, DEL_DEV.
    pub fn remove(&self) -> Result<(), BlockdevError> {
        let mut ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
        ctrl.stop_dev()?;
        wait_gone(&self.done.lock().unwrap_or_else(|p| p.into_inner()));
        ctrl.del_dev()?;
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
    let resizable = ctrl.features().is_ok_and(|f| f & UBLK_F_UPDATE_SIZE != 0);
    let mut add = AddDev {
        dev_id: spec.ublk_id,
        nr_hw_queues: queues,
        queue_depth: depth,
        max_io_buf_bytes: MAX_IO,
        user_recovery: true,
        reissue: true,
        resizable,
    };
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
    if let Err(e) = made {
        // Undo: stopping aborts the queues' fetches, and they end.
        let _ = ctrl.stop_dev();
        wait_gone(&done_rx);
        let _ = ctrl.del_dev();
        return Err(e);
    }
    Ok(UblkDevice {
        dev_id: info.dev_id,
        ctrl: Mutex::new(ctrl),
        done: Mutex::new(done_rx),
    })
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
    tracing::info!(
        "device {:?}: recovered /dev/ublkb{} from the previous server",
        export.name,
        info.dev_id
    );
    Ok(UblkDevice {
        dev_id: info.dev_id,
        ctrl: Mutex::new(ctrl),
        done: Mutex::new(done_rx),
    })
}
