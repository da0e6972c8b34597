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
use crate::reactor::ReactorHandle;
use crate::reactor::handle::UblkQueueSetup;
use crate::frontend::ublk::chardev::{CharError, UblkChar};
use crate::frontend::ublk::ctrl::{AddDev, CtrlError, DeviceParams, UblkCtrl};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
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

/// Create and start a ublk device for `export`, its queues on `reactors`.
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
    let (dev, _) = export.current();
    let uapi = params_of(&dev).to_uapi()?;
    let mut ctrl = UblkCtrl::open()?;
    let info = ctrl.add_dev(&AddDev {
        dev_id: None,
        nr_hw_queues: queues,
        queue_depth: depth,
        max_io_buf_bytes: MAX_IO,
        user_recovery: true,
        reissue: true,
        resizable: false,
    })?;
    let dev_id = info.dev_id;
    let (done_tx, done_rx) = channel();
    let made = (|| -> Result<(), BlockdevError> {
        ctrl.set_params(&uapi)?;
        let char = Arc::new(UblkChar::open(dev_id, WAIT)?);
        let (ready_tx, ready_rx) = channel();
        for q_id in 0..info.nr_hw_queues {
            let r = &reactors[usize::from(q_id) % reactors.len()];
            let setup = UblkQueueSetup {
                export: Arc::clone(export),
                char: Arc::clone(&char),
                q_id,
                depth: info.queue_depth,
                max_io: MAX_IO,
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
        let pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        ctrl.start_dev(pid)?;
        Ok(())
    })();
    drop(done_tx);
    if let Err(e) = made {
        // Undo: a device that never started has no disk; stopping it aborts
        // the fetches, and the queues end.
        let _ = ctrl.stop_dev();
        wait_gone(&done_rx);
        let _ = ctrl.del_dev();
        return Err(e);
    }
    Ok(UblkDevice {
        dev_id,
        ctrl: Mutex::new(ctrl),
        done: Mutex::new(done_rx),
    })
}
