//! The kernel block devices of the daemon's devices (`--blockdev ublk|nbd`).
//!
//! Contract: a device's block device is made once the device is published and
//! the reactors run ([`Daemon::start_blockdev`], or
//! [`Daemon::start_pending_blockdevs`] for devices attached before them), told
//! of a size change it can follow ([`Daemon::kernel_follows`] decides before
//! the change, [`Daemon::kernel_resize`] after), and removed before its device
//! is detached and when the daemon stops. Making and removing one is
//! [`super::blockdev`]'s; this file keeps the table (`Daemon::blockdevs`, a
//! mutex held only to look up, insert or remove) and records a new ublk
//! device's id, so that a daemon restarted after a crash takes the same
//! device back. Calls [`super::registry`] and [`super::record`] only (and
//! the pure [`super::pool`]: at start, several block devices are made at
//! once, each on a thread of a small pool, none holding a table lock).

use super::blockdev::{self, BlockdevError, KernelDev, Left};
use super::error::CtlError;
use super::pool;
use super::registry::Daemon;
use crate::device::Device;
use crate::device::export::Export;
use crate::engine::task::zero_copy_fits;
use std::path::PathBuf;
use std::sync::Arc;

/// [`Daemon::hold_for_exit`]: how long no new request may arrive before the
/// held disks count as quiet, how often to look, and the most it waits.
const HOLD_QUIET: std::time::Duration = std::time::Duration::from_millis(200);
const HOLD_POLL: std::time::Duration = std::time::Duration::from_millis(10);
const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Block devices made at once at start.
pub const BLOCKDEV_THREADS: usize = 16;

impl Daemon {
    /// Give device `name` to the kernel as the block device its spec asks
    /// for (nothing if it asks for none, if it has one, or if the reactors do
    /// not run yet: [`Daemon::start_pending_blockdevs`] makes it then). On
    /// failure the device stays, served over NBD, and keeps its record: a
    /// driver not loaded yet at boot must not erase the configuration (a new
    /// attach undoes itself instead, see [`super::attach`]).
    pub(super) fn start_blockdev(&self, name: &str) -> Result<(), CtlError> {
        let Some(e) = self.export(name) else {
            return Err(CtlError::NotFound(name.to_owned()));
        };
        self.start_blockdev_of(&e)
    }

    /// [`Daemon::start_blockdev`] of export `e`; its only error is
    /// [`CtlError::Blockdev`].
    pub(super) fn start_blockdev_of(&self, e: &Arc<Export>) -> Result<(), CtlError> {
        let name = e.name.as_str();
        let spec = e.spec();
        let reactors = self.reactors();
        if reactors.is_empty() || self.blockdev(name).is_some() {
            // Made once the reactors run (start_pending_blockdevs), or made.
            return Ok(());
        }
        match blockdev::start(e, &spec, &reactors) {
            Ok(None) => Ok(()),
            Ok(Some(k)) => {
                tracing::info!("device {name:?}: {}", k.path().display());
                let ublk_id = match &k {
                    KernelDev::Ublk(u) => Some(u.dev_id),
                    KernelDev::Nbd(_) => None,
                };
                {
                    let mut g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
                    g.insert(name.to_owned(), Arc::new(k));
                }
                if let Some(id) = ublk_id
                    && spec.ublk_id != Some(id)
                {
                    // Recorded so that a daemon restarted after a crash takes the
                    // same device back (user recovery).
                    let mut spec = spec;
                    spec.ublk_id = Some(id);
                    e.set_spec(spec.clone());
                    if let Err(err) = self.record_put(e, &spec) {
                        tracing::warn!(
                            "device {name:?}: the ublk device id is not recorded ({err}); \
                             after a crash the device is made anew instead of recovered"
                        );
                    }
                }
                Ok(())
            }
            Err(source) => Err(CtlError::Blockdev {
                name: name.to_owned(),
                source,
            }),
        }
    }

    /// Make the block devices of devices attached before the reactors ran
    /// (`serve IMAGE --blockdev`, `--config`, the state file), several at
    /// once ([`BLOCKDEV_THREADS`]: making one mostly waits for the kernel).
    /// A device whose block device cannot be made stays, served over NBD
    /// (see [`Daemon::start_blockdev`]). The results in the devices' order.
    pub fn start_pending_blockdevs(&self) -> Vec<(String, Result<PathBuf, CtlError>)> {
        let todo: Vec<Arc<Export>> = self
            .all()
            .into_iter()
            .filter(|e| e.spec().blockdev.is_some() && self.blockdev(&e.name).is_none())
            .collect();
        let threads = pool::threads_for(todo.len(), 1, BLOCKDEV_THREADS);
        pool::each(&todo, threads, "loopd-blockdev", |_, e| {
            let r = self.start_blockdev_of(e).and_then(|()| {
                self.blockdev(&e.name)
                    .map(|b| b.path())
                    .ok_or(CtlError::NotFound(e.name.clone()))
            });
            (e.name.clone(), r)
        })
    }

    /// Whether the kernel block device of `e` (if any) can follow the change
    /// from `cur` to `new`; refused with the reason if not. `Some(bytes)`: the
    /// kernel must be told the new size once the change is made.
    pub(super) fn kernel_follows(
        &self,
        e: &Export,
        cur: &Device,
        new: &Device,
    ) -> Result<Option<u64>, CtlError> {
        let Some(b) = self.blockdev(&e.name) else {
            return Ok(None);
        };
        let refuse = |why: &str| CtlError::Blockdev {
            name: e.name.clone(),
            source: BlockdevError::Unfollowable(format!(
                "{} cannot follow {why}: detach and attach the device to change it",
                b.path().display()
            )),
        };
        if new.block_size != cur.block_size {
            return Err(refuse("a change of block size"));
        }
        if let KernelDev::Ublk(u) = &*b
            && u.zero_copy()
            && let Err(why) = zero_copy_fits(new)
        {
            // Its queues have no buffer of their own to copy through.
            return Err(refuse(&format!(
                "this change: it uses zero copy (made with UBLK_F_AUTO_BUF_REG), which needs \
                 every read and write direct and aligned, and with it {why}; attach with \
                 --no-zero-copy for a ublk device whose cache mode can change"
            )));
        }
        if new.read_only != cur.read_only {
            return Err(refuse("a change of read-only (set when the disk is made)"));
        }
        if new.offset != cur.offset {
            return Err(refuse("a change of offset under its data"));
        }
        if new.size == cur.size {
            return Ok(None);
        }
        b.can_resize().map_err(|source| CtlError::Blockdev {
            name: e.name.clone(),
            source,
        })?;
        Ok(Some(new.size))
    }

    /// Tell the kernel about a size change [`Daemon::kernel_follows`] allowed.
    pub(super) fn kernel_resize(&self, e: &Export, bytes: Option<u64>) {
        if let (Some(bytes), Some(b)) = (bytes, self.blockdev(&e.name))
            && let Err(err) = b.resize(bytes)
        {
            tracing::error!(
                "device {:?}: {} was not resized: {err}",
                e.name,
                b.path().display()
            );
        }
    }

    /// Remove device `name`'s block device, if it has one; `unless_open`:
    /// not if it is open, where the kernel can tell ([`KernelDev::remove`]).
    pub(super) fn remove_blockdev(&self, name: &str, unless_open: bool) -> Result<(), CtlError> {
        let Some(u) = self.blockdev(name) else {
            return Ok(());
        };
        u.remove(unless_open).map_err(|source| CtlError::Blockdev {
            name: name.to_owned(),
            source,
        })?;
        let mut g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
        g.remove(name);
        Ok(())
    }

    /// Remove every block device (the daemon is stopping: the reactors serving
    /// them are about to exit).
    pub fn remove_blockdevs(&self) {
        let names: Vec<String> = {
            let g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
            g.keys().cloned().collect()
        };
        for n in names {
            if let Err(e) = self.remove_blockdev(&n, false) {
                tracing::warn!("{e}");
            }
        }
    }

    /// Leave every block device to the next daemon on this state file (the
    /// daemon is stopping with `--keep-blockdevs`; its reactors still run):
    /// each is quiesced where the kernel can ([`KernelDev::leave`]) and taken
    /// out of the table without being removed. The next daemon takes them
    /// back as after `kill -9`.
    pub fn leave_blockdevs(&self) {
        let all: Vec<(String, Arc<KernelDev>)> = {
            let mut g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
            std::mem::take(&mut *g).into_iter().collect()
        };
        self.hold_for_exit(&all);
        for (name, k) in all {
            let held = k
                .holds_for_exit()
                .then(|| self.export(&name).map(|e| e.held()))
                .flatten();
            let how = match (k.leave(), held) {
                (Left::Quiesced, _) => {
                    "quiesced: nothing in flight, new I/O waits in the kernel".to_owned()
                }
                (Left::InFlight, Some(n)) => format!(
                    "held: this kernel cannot quiesce the disk, so loopd stopped serving \
                     it once its requests stopped coming; the {n} taken since wait for \
                     the next daemon"
                ),
                (Left::InFlight, None) => {
                    "I/O waits for it; requests in flight are given to it again".to_owned()
                }
            };
            tracing::info!(
                "device {name:?}: {} left for the next daemon on this state file ({how})",
                k.path().display()
            );
            // Dropped without a removal: nothing of it stops the disk.
            drop(k);
        }
    }

    /// Before leaving disks the kernel cannot quiesce
    /// ([`KernelDev::holds_for_exit`]): freeze their exports for good, wait
    /// until the requests running on them are done and no new one has
    /// arrived for [`HOLD_QUIET`] (writers block on the held ones, so they
    /// stop), at most [`HOLD_LIMIT`] in all. All at once, so a thousand
    /// idle disks cost one quiet period, not a thousand. The reactors keep
    /// serving meanwhile (a request the kernel hands over is taken and
    /// parked, never left half-delivered when the queues' threads exit).
    /// Each held export counts its requests ([`Export::held`]).
    fn hold_for_exit(&self, all: &[(String, Arc<KernelDev>)]) {
        let exports: Vec<Arc<Export>> = all
            .iter()
            .filter(|(_, k)| k.holds_for_exit())
            .filter_map(|(n, _)| self.export(n))
            .collect();
        if exports.is_empty() {
            return;
        }
        for e in &exports {
            e.freeze_for_exit();
        }
        let start = std::time::Instant::now();
        let held = || exports.iter().map(|e| e.held()).sum::<u64>();
        let mut last = held();
        let mut quiet_since = start;
        loop {
            std::thread::sleep(HOLD_POLL);
            let now = held();
            let drained = exports.iter().all(|e| e.in_flight() == 0);
            if now != last || !drained {
                last = now;
                quiet_since = std::time::Instant::now();
            } else if quiet_since.elapsed() >= HOLD_QUIET {
                break;
            }
            if start.elapsed() >= HOLD_LIMIT {
                tracing::warn!(
                    "{} block device(s) still had requests coming or running after {:?}; \
                     left as they are",
                    exports.len(),
                    HOLD_LIMIT
                );
                break;
            }
        }
    }
}
