//! Recorded devices coming back: at start ([`Daemon::restore`]), and every
//! [`RETRY_INTERVAL`] while one is missing ([`Daemon::run_retrier`]). Devices
//! of `--config` that cannot be attached ([`Daemon::attach_config`], at start
//! and by a reload) are kept missing and retried the same way, without a
//! state record (the config file is theirs).
//!
//! Contract: a device of the state file that cannot be attached at start stays
//! recorded and is listed as *missing* with the reason; its name stays taken.
//! It is retried on a thread of its own until the daemon stops, and by an
//! attach of the same name ([`super::attach`]). A device both in the state
//! file and in `--config` (or the `serve IMAGE` argument) is the latter's; its
//! record is dropped.
//!
//! Threads: at start the images are opened on a small pool ([`super::pool`],
//! [`RESTORE_THREADS`]) that [`Daemon::restore`] waits for; each device is
//! published on its own, under the usual locks (see [`super::registry`]).
//!
//! Descriptors: neither the restore nor a retry opens more devices than the
//! open-file limit has room for beside the descriptors open and
//! [`reserved_fds`] (the daemon's own, its connections' and reactors'); the
//! devices past that stay missing, saying so ([`no_room`]), and come back
//! once the limit leaves room (a retry counts the room again). So a state
//! file larger than the limit allows never leaves the daemon without the
//! descriptors it needs to start and to answer its control socket.

use super::attach::Source;
use super::error::CtlError;
use super::info::DeviceInfo;
use super::params::{Tuning, name_of};
use super::pool;
use super::registry::{Daemon, Missing};
use crate::control::proto::DeviceSpec;
use crate::text::quoted_path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How often a missing device's image is looked for again.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(2);

/// Threads that open the state file's images at start (one per 16 devices,
/// up to this many): opening mostly waits for the filesystem.
pub const RESTORE_THREADS: usize = 8;

/// Descriptors a device holds: its pinned `O_PATH` file, a read-write one,
/// an `O_DIRECT` one, and its image lock.
const FDS_PER_DEVICE: u64 = 4;

/// Descriptors kept for everything but NBD connections: the control plane,
/// images, the state file, and per reactor its ring, eventfd and splice pipes.
/// The server caps `--max-connections` by it; a restore or a retry leaves it
/// to the rest of the daemon beside the recorded devices' own descriptors.
pub fn reserved_fds(reactors: usize) -> u64 {
    256 + 96 * reactors as u64
}

/// [`reserved_fds`] for the default number of reactors (one per CPU).
fn reserved_fds_default() -> u64 {
    reserved_fds(std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
}

/// How many more devices the open-file limit has room for beside the
/// descriptors open now and [`reserved_fds`], and the limit; `None` when it
/// cannot be told (no /proc: no cap).
fn device_room() -> Option<(usize, u64)> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current?;
    let open = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    let room = limit.saturating_sub(open + reserved_fds_default()) / FDS_PER_DEVICE;
    Some((usize::try_from(room).unwrap_or(usize::MAX), limit))
}

/// Why a recorded device is missing, as shown beside its image (`list`'s
/// row, `status`, the JSON's `image`): what went wrong with the file, each
/// cause once, without naming the image again — not "cannot attach IMAGE:
/// cannot open IMAGE: …" but "cannot open: No such file or directory".
pub(super) fn missing_reason(e: &CtlError, image: &std::path::Path) -> String {
    // The attach is a restore's: what failed is the device's open.
    let first: &(dyn std::error::Error + 'static) = match e {
        CtlError::Device { source, .. } => source,
        other => other,
    };
    let q = format!(" {}", quoted_path(image));
    let plain = format!(" {}", image.display());
    // A cause that ends naming the image ("cannot open IMAGE") says it
    // without; a sentence that needs it (what to attach again) keeps it.
    let causes = std::iter::successors(Some(first), |c| c.source()).map(|c| {
        let t = c.to_string();
        match t.strip_suffix(&q).or_else(|| t.strip_suffix(&plain)) {
            Some(short) => short.to_owned(),
            None => t,
        }
    });
    crate::text::join_causes(causes)
}

/// The reason a device left out for want of descriptors is missing.
fn no_room(limit: u64) -> String {
    format!(
        "not attached: the open-file limit ({limit}) has no room for it ({FDS_PER_DEVICE} \
         descriptors per device, {} kept for connections and the daemon); raise it \
         (LimitNOFILE=, ulimit -n) and restart, or detach other devices",
        reserved_fds_default()
    )
}

impl Daemon {
    /// Bring back the devices of the state file (after those of the command line
    /// and `--config`, which win a name clash). A device that cannot be attached
    /// stays recorded and is kept as missing; then the file is compacted.
    ///
    /// Every recorded name is taken (listed as missing, "not attached yet")
    /// before any device comes back; then the images are opened on a small
    /// pool of threads ([`RESTORE_THREADS`]), each device published as soon as
    /// it is open. A device's file as found in this boot is recorded by the
    /// compaction that ends the restore (one write for all of them, not one
    /// `fdatasync` each).
    pub fn restore(&self) {
        let (specs, path) = match self.log.lock() {
            Ok(g) => match g.as_ref() {
                Some(l) => (l.table(), l.path().display().to_string()),
                None => return,
            },
            Err(_) => return,
        };
        let mut todo = Vec::with_capacity(specs.len());
        let mut dropped = Vec::new();
        for spec in specs {
            let name = name_of(&spec);
            if self.export(&name).is_some() || self.missing_config(&name) {
                tracing::warn!(
                    "device {name:?} is both in --config (or the serve IMAGE argument) and in the \
                     state file {path}: --config wins; its state record is dropped"
                );
                dropped.push(name);
                continue;
            }
            todo.push((name, spec));
        }
        if !dropped.is_empty() {
            if let Ok(mut g) = self.log.lock() {
                if let Some(l) = g.as_mut() {
                    for name in &dropped {
                        l.forget(name);
                    }
                }
            }
        }
        if let Ok(mut m) = self.missing.lock() {
            for (name, spec) in &todo {
                m.insert(
                    name.clone(),
                    Missing {
                        spec: spec.clone(),
                        reason: "not attached yet".into(),
                        from_config: false,
                    },
                );
            }
        }
        let recorded = todo.len();
        if let Some((room, limit)) = device_room().filter(|(room, _)| *room < todo.len()) {
            let over = todo.split_off(room);
            tracing::warn!(
                "state file {path}: {} of {recorded} device(s) not attached: {}",
                over.len(),
                no_room(limit)
            );
            for (name, _) in over {
                self.set_missing_reason(&name, no_room(limit));
            }
        }
        let threads = pool::threads_for(todo.len(), 16, RESTORE_THREADS);
        let back = pool::each(&todo, threads, "loopd-restore", |_, (name, spec)| {
            self.restore_one(name, spec.clone())
        });
        let restored = back.iter().filter(|b| **b).count();
        if recorded > 0 {
            tracing::info!(
                "state file {path}: {restored} device(s) restored, {} missing",
                recorded - restored
            );
        }
        self.write_state();
    }

    /// Attach one recorded device at start; `false`: it is missing (logged).
    fn restore_one(&self, name: &str, spec: DeviceSpec) -> bool {
        let image = spec.image.clone();
        match self.attach_inner(spec, Source::Restoring, Tuning::default(), false) {
            Ok(_) => {
                tracing::debug!("restored device {name:?}");
                true
            }
            Err(e) => {
                tracing::warn!(
                    "device {name:?} is missing: {}; it stays in the state file and is \
                     retried every {}s and on `loopd attach` of that name",
                    e.body().message,
                    RETRY_INTERVAL.as_secs()
                );
                self.set_missing_reason(name, missing_reason(&e, &image));
                false
            }
        }
    }

    /// Attach a device of `--config` (at start, by a reload, or a retry). One
    /// that cannot be attached is kept as missing, as a device of the state
    /// file is: listed with the reason, its name taken, retried every
    /// [`RETRY_INTERVAL`] and by each reload; it is not written to the state
    /// file (the config file is its record). The error is returned for the
    /// caller to report.
    pub fn attach_config(&self, spec: DeviceSpec) -> Result<DeviceInfo, CtlError> {
        let name = name_of(&spec);
        let kept = spec.clone();
        let e = match self.attach(spec, false) {
            Ok(i) => return Ok(i),
            Err(e) => e,
        };
        if matches!(e, CtlError::NameTaken(_)) || self.export(&name).is_some() {
            return Err(e);
        }
        let reason = missing_reason(&e, &kept.image);
        if let Ok(mut m) = self.missing.lock() {
            match m.get_mut(&name) {
                Some(x) if x.from_config => {
                    x.reason = reason;
                    x.spec = kept;
                }
                // A device of the state file keeps its name and record.
                Some(_) => {}
                None => {
                    m.insert(
                        name,
                        Missing {
                            spec: kept,
                            reason,
                            from_config: true,
                        },
                    );
                }
            }
        }
        Err(e)
    }

    /// One retry of a device of `--config` kept as missing.
    fn retry_config(&self, name: &str, x: &Missing) {
        // Detached (forgotten) since the round began.
        if !self.missing_config(name) {
            return;
        }
        match self.attach_config(x.spec.clone()) {
            Ok(_) => tracing::info!(
                "device {name:?} of --config is back: {} can be opened again",
                quoted_path(&x.spec.image)
            ),
            Err(CtlError::NameTaken(_)) => {}
            Err(e) => {
                if missing_reason(&e, &x.spec.image) != x.reason {
                    tracing::warn!(
                        "device {name:?} of --config is still missing: {}",
                        e.body().message
                    );
                }
            }
        }
    }

    /// Retry missing devices every [`RETRY_INTERVAL`] on a thread of their own,
    /// until the daemon stops.
    pub fn run_retrier(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("loopd-retry".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(RETRY_INTERVAL);
                    let Some(d) = me.upgrade() else { return };
                    if d.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    d.retry_missing();
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the retry thread: {e}");
        }
    }

    /// One attempt at every missing device.
    pub(super) fn retry_missing(&self) {
        let all: Vec<(String, Missing)> = match self.missing.lock() {
            Ok(m) => m.iter().map(|(n, x)| (n.clone(), x.clone())).collect(),
            Err(_) => return,
        };
        if all.is_empty() {
            return;
        }
        // As many as the open-file limit has room for; the others wait for
        // the next round, keeping their reason.
        let room = device_room().map_or(usize::MAX, |(room, _)| room);
        for (name, x) in all.into_iter().take(room) {
            if x.from_config {
                self.retry_config(&name, &x);
                continue;
            }
            match self.attach_inner(x.spec.clone(), Source::Restored, Tuning::default(), false) {
                Ok(_) => {
                    tracing::info!(
                        "device {name:?} is back: {} can be opened again",
                        quoted_path(&x.spec.image)
                    );
                    if let Err(e) = self.start_blockdev(&name) {
                        tracing::error!("{}", e.body().message);
                    }
                }
                Err(CtlError::NameTaken(_)) => {}
                Err(e) => {
                    let reason = missing_reason(&e, &x.spec.image);
                    if reason != x.reason {
                        tracing::warn!("device {name:?} is still missing: {}", e.body().message);
                        self.set_missing_reason(&name, reason);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceError;
    use std::path::{Path, PathBuf};

    #[test]
    fn a_missing_reason_names_its_image_not_at_all() {
        let image = Path::new("/images/gone disk.img");
        let e = CtlError::Device {
            msg: format!("cannot attach {}", quoted_path(image)),
            source: DeviceError::Open {
                path: PathBuf::from(image),
                source: std::io::Error::from_raw_os_error(libc::ENOENT),
            },
        };
        let r = missing_reason(&e, image);
        assert!(
            r.starts_with("cannot open: No such file or directory"),
            "{r}"
        );
        assert!(!r.contains("gone disk"), "{r}");
        let other = CtlError::Busy("the name is taken".into());
        assert_eq!(missing_reason(&other, image), "the name is taken");
    }
}
