//! Deadlines on ublk control commands: waiting for one command's completion
//! at most so long, cancelling it, and keeping what a command the kernel never
//! answered still uses alive until it does.
//!
//! Contract:
//! - The driver runs every control command on an io-wq worker of the
//!   submitting ring (it refuses non-blocking issue), so the submitter waits in
//!   `io_uring_enter` for the completion, an interruptible wait that
//!   [`wait_for`] bounds with the ring's own timeout (`IORING_ENTER_EXT_ARG`).
//! - A command past its deadline is cancelled ([`cancel`]:
//!   `IORING_OP_ASYNC_CANCEL`): io_uring interrupts the worker, and a command
//!   waiting interruptibly in the kernel (START_DEV and END_USER_RECOVERY
//!   wait for the queues' fetches so) ends with `-EINTR` or `-ECANCELED`.
//! - A command that does not end even then (the worker waits uninterruptibly,
//!   e.g. on a lock held by another stuck command) is *pending*: the kernel may
//!   still write its buffer and will post its completion on that ring. The ring
//!   is then never used for another command; its owner hands ring, control fd
//!   and buffer to [`adopt`], whose thread (one per stuck command; they are
//!   rare) waits for the completion, bounded by [`JANITOR_WAIT`], then runs the
//!   caller's `then` (undo what a late success made) and frees everything. If
//!   the kernel never answers in that time, ring and buffer are leaked, never
//!   freed under the kernel.
//! - Nothing here blocks longer than the deadline given, except the janitor's
//!   own thread.

use super::sys::{
    UBLK_U_CMD_ADD_DEV, UBLK_U_CMD_DEL_DEV, UBLK_U_CMD_START_DEV, UBLK_U_CMD_STOP_DEV, UblkParams,
    UblksrvCtrlDevInfo,
};
use io_uring::{IoUring, cqueue, opcode, squeue, types};
use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// The deadline new control handles get: the daemon's `--kernel-timeout`.
pub fn default_deadline() -> Duration {
    crate::blockdev::kernel_timeout::get()
}

/// How long a janitor waits for a stuck command's completion before it gives
/// up (and leaks the ring and buffer rather than free them under the kernel).
pub const JANITOR_WAIT: Duration = Duration::from_secs(24 * 3600);

/// How long [`cancel`] waits for a cancelled command to end.
pub const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// The ring control commands run on.
pub type CtrlRing = IoUring<squeue::Entry128, cqueue::Entry>;

/// User data of the cancel request itself (commands use 1.. upwards).
const CANCEL_UD: u64 = u64::MAX;

/// Submit what is queued and wait until the completion with user data `seq`
/// arrives, at most `limit`. `Ok(Some(res))`: its result; `Ok(None)`: the
/// deadline passed (the command is still in the kernel).
pub fn wait_for(ring: &mut CtrlRing, seq: u64, limit: Duration) -> std::io::Result<Option<i32>> {
    let start = Instant::now();
    loop {
        if let Some(res) = ring
            .completion()
            .find(|c| c.user_data() == seq)
            .map(|c| c.result())
        {
            return Ok(Some(res));
        }
        let left = limit.saturating_sub(start.elapsed());
        if left.is_zero() {
            // Submit anything still queued (a cancel) without waiting.
            ring.submit()?;
            return Ok(ring
                .completion()
                .find(|c| c.user_data() == seq)
                .map(|c| c.result()));
        }
        let ts = types::Timespec::new()
            .sec(left.as_secs())
            .nsec(left.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&ts);
        match ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::ETIME)
                    || e.raw_os_error() == Some(libc::EINTR)
                    || e.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Cancel the command with user data `seq` and wait up to `grace` for it to
/// end. `Ok(Some(res))`: it ended (with `res`, which may still be a success
/// that raced the cancel); `Ok(None)`: it is still pending.
pub fn cancel(ring: &mut CtrlRing, seq: u64, grace: Duration) -> std::io::Result<Option<i32>> {
    let sqe: squeue::Entry128 = opcode::AsyncCancel::new(seq)
        .build()
        .user_data(CANCEL_UD)
        .into();
    // SAFETY: a cancel request refers to no memory of ours.
    if unsafe { ring.submission().push(&sqe) }.is_err() {
        return Err(std::io::Error::other("submission queue full"));
    }
    wait_for(ring, seq, grace)
}

/// A control command's in/out buffer, owned until its CQE (heap-boxed: the
/// kernel has its address).
pub enum CmdBuf {
    None,
    Info(Box<UblksrvCtrlDevInfo>),
    Params(Box<UblkParams>),
    U64(Box<u64>),
}

impl CmdBuf {
    pub fn addr_len(&mut self) -> (u64, u16) {
        fn of<T>(b: &mut T) -> (u64, u16) {
            (
                std::ptr::from_mut(b) as u64,
                u16::try_from(size_of::<T>()).unwrap_or(u16::MAX),
            )
        }
        match self {
            CmdBuf::None => (0, 0),
            CmdBuf::Info(b) => of(&mut **b),
            CmdBuf::Params(b) => of(&mut **b),
            CmdBuf::U64(b) => of(&mut **b),
        }
    }
}

/// Which device a late success of a command made that must go (the attach it
/// was for failed long before): a late ADD_DEV's new device, a late
/// START_DEV's device. Other commands leave nothing to undo.
#[derive(Debug, Clone, Copy)]
pub enum Undo {
    AddDev,
    StartDev(u32),
    Nothing,
}

impl Undo {
    /// What a late completion of command `op` on `dev_id` leaves to undo.
    pub fn of(op: u32, dev_id: u32) -> Undo {
        match op {
            UBLK_U_CMD_ADD_DEV => Undo::AddDev,
            UBLK_U_CMD_START_DEV => Undo::StartDev(dev_id),
            _ => Undo::Nothing,
        }
    }

    fn device(self, buf: &CmdBuf, res: i32) -> Option<u32> {
        match (self, buf) {
            _ if res < 0 => None,
            (Undo::AddDev, CmdBuf::Info(i)) => Some(i.dev_id),
            (Undo::StartDev(id), _) => Some(id),
            _ => None,
        }
    }
}

/// Hand a ring with a pending command `seq` (and the buffer the command may
/// still write, `keep`) to a janitor thread that waits for the completion.
/// Then `undo` says, from the buffer and the result, which device a late
/// success made that must go: the janitor
/// sends it STOP_DEV and DEL_DEV through `ctrl_fd` on the same ring, each
/// bounded by [`default_deadline`], and frees everything. If the thread cannot
/// be started, or the kernel never answers within [`JANITOR_WAIT`], ring and
/// `keep` are leaked.
pub fn adopt(
    ring: Option<CtrlRing>,
    seq: u64,
    keep: CmdBuf,
    ctrl_fd: Option<File>,
    what: String,
    undo: Undo,
) {
    let start = Instant::now();
    // Leaked unless the janitor saw the completion: even a failed spawn
    // (which drops the closure) must not free them under the kernel.
    let mut held = ManuallyDrop::new((ring, keep));
    let spawned = std::thread::Builder::new()
        .name("loopd-ublk-janitor".into())
        .spawn(move || {
            let Some(ring) = held.0.as_mut() else { return };
            match wait_for(ring, seq, JANITOR_WAIT) {
                Ok(Some(res)) => {
                    tracing::warn!(
                        "ublk {what}: the kernel answered {res} after {:.1}s",
                        start.elapsed().as_secs_f64()
                    );
                    let (ring, keep) = ManuallyDrop::into_inner(held);
                    if let (Some(ring), Some(dev), Some(fd)) =
                        (ring, undo.device(&keep, res), ctrl_fd)
                    {
                        delete_late(ring, &fd, dev);
                    }
                }
                Ok(None) | Err(_) => tracing::error!(
                    "ublk {what}: the kernel never answered; its ring and buffer stay allocated"
                ),
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start a ublk janitor thread ({e}): the command stays pending");
    }
}

/// STOP_DEV then DEL_DEV of `dev_id`, each waited for at most the default
/// deadline; a ring whose command is still pending then is leaked.
fn delete_late(mut ring: CtrlRing, fd: &File, dev_id: u32) {
    for (seq, op) in [(1, UBLK_U_CMD_STOP_DEV), (2, UBLK_U_CMD_DEL_DEV)] {
        let mut bytes = [0u8; 80];
        bytes[0..4].copy_from_slice(&dev_id.to_ne_bytes());
        bytes[4..6].copy_from_slice(&u16::MAX.to_ne_bytes());
        let sqe = opcode::UringCmd80::new(types::Fd(fd.as_raw_fd()), op)
            .cmd(bytes)
            .build()
            .user_data(seq);
        // SAFETY: the command names the control fd, alive for this call,
        // and no buffer (len 0).
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            return;
        }
        match wait_for(&mut ring, seq, default_deadline()) {
            Ok(Some(res)) => tracing::info!("ublk device {dev_id}: late undo, op {op:#x}: {res}"),
            Ok(None) | Err(_) => {
                tracing::error!("ublk device {dev_id}: the late undo is stuck too; left as is");
                std::mem::forget(ring);
                return;
            }
        }
    }
}
