//! RBD devices follow their image's size: an `rbd resize` anywhere (the CLI,
//! another librbd client, the dashboard) reaches the device as if `loopd
//! resize NAME` had been run.
//!
//! Contract: an attach installs a listener on an RBD device's image
//! ([`crate::backing::rbd::RbdImage::on_update`]) that only sends the
//! device's name on `follow_tx` (from a librbd thread: a send never blocks).
//! One thread, started by the server ([`Daemon::run_follower`]), receives
//! the names, coalesces a burst ([`Burst`]: librbd calls back more than once
//! for one change, and for changes other than the size), then for each
//! device compares the image's size with the one the device last saw and,
//! if it differs, runs [`Daemon::resize`] — the same path as the command:
//! under the export's control lock, the window (`--offset`, `--size-limit`)
//! applied, the kernel block device told (ublk `UPDATE_SIZE`) or the change
//! refused when it cannot follow. One audit line says what happened
//! ([`super::audit::image_resize_line`]); a change that cannot be followed is
//! an error logged once per image size, and the device keeps its size. The
//! thread holds only a weak reference: it ends with the daemon.

use super::audit;
use super::registry::Daemon;
use crate::backing::Backend;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

/// A burst ends when no notification came for this long...
pub const QUIET: Duration = Duration::from_millis(200);
/// ...or this long after its first notification, whichever is sooner.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// Notifications coalesced: the devices named since the burst began, due
/// [`QUIET`] after the last one or [`MAX_WAIT`] after the first. Pure.
#[derive(Debug, Default)]
pub(super) struct Burst {
    names: BTreeSet<String>,
    /// When the burst's first and last notifications came.
    span: Option<(Instant, Instant)>,
}

impl Burst {
    /// Device `name`'s image changed, at `now`.
    pub(super) fn note(&mut self, name: String, now: Instant) {
        self.names.insert(name);
        let first = self.span.map_or(now, |(f, _)| f);
        self.span = Some((first, now));
    }

    /// How long until the burst is due (zero: it is); `None`: no burst.
    pub(super) fn wait(&self, now: Instant) -> Option<Duration> {
        let (first, last) = self.span?;
        let due = (last + QUIET).min(first + MAX_WAIT);
        Some(due.saturating_duration_since(now))
    }

    /// The burst's device names if it is due at `now` (then it is over),
    /// else nothing.
    pub(super) fn take_due(&mut self, now: Instant) -> Vec<String> {
        if self.wait(now) != Some(Duration::ZERO) {
            return Vec::new();
        }
        self.span = None;
        std::mem::take(&mut self.names).into_iter().collect()
    }
}

impl Daemon {
    /// Follow RBD images' sizes on a thread of its own (see the module
    /// documentation), until the daemon goes.
    pub fn run_follower(self: &Arc<Self>) {
        let Some(rx) = self.follow_rx.lock().ok().and_then(|mut r| r.take()) else {
            return;
        };
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("loopd-rbd-size".into())
            .spawn(move || {
                let mut burst = Burst::default();
                // The image size a refusal was logged for, by device.
                let mut told = BTreeMap::new();
                loop {
                    let got = match burst.wait(Instant::now()) {
                        None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                        Some(d) => rx.recv_timeout(d),
                    };
                    match got {
                        Ok(name) => burst.note(name, Instant::now()),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                    let due = burst.take_due(Instant::now());
                    if due.is_empty() {
                        continue;
                    }
                    let Some(d) = me.upgrade() else { return };
                    if d.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    for name in due {
                        d.follow_size(&name, &mut told);
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(
                "cannot start the thread that follows RBD images' sizes: {e}; run `loopd \
                 resize` after an `rbd resize`"
            );
        }
    }

    /// Give device `name` its image's size, if that changed (`told`: the
    /// image sizes a refusal was already logged for).
    fn follow_size(&self, name: &str, told: &mut BTreeMap<String, u64>) {
        let Some(e) = self.export(name) else {
            told.remove(name);
            return;
        };
        let (cur, _) = e.current();
        let Backend::Rbd(img) = cur.backend() else {
            return;
        };
        let spec = img.spec().to_string();
        let now = match img.size() {
            Ok(n) => n,
            Err(err) => {
                tracing::warn!("device {name:?}: the image changed, but: {err}");
                return;
            }
        };
        let (was, dev_was) = (cur.file_size(), cur.size());
        drop(cur);
        if now == was {
            told.remove(name);
            return;
        }
        let outcome = self.resize(name).map(|r| r.device.size);
        let line = audit::image_resize_line(
            name,
            &spec,
            (was, now),
            dev_was,
            outcome.as_ref().copied().map_err(|e| e.body().message),
        );
        match outcome {
            Ok(_) => {
                told.remove(name);
                tracing::info!("{line}");
            }
            Err(_) if told.insert(name.to_owned(), now) != Some(now) => {
                tracing::error!("{line}");
            }
            Err(_) => tracing::debug!("{line}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_one_resize_due_when_quiet_or_at_most_max_wait() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut b = Burst::default();
        assert_eq!(b.wait(t0), None, "nothing pending: wait for ever");
        assert!(b.take_due(ms(5000)).is_empty());
        // Three notifications 100 ms apart, two for the same device.
        b.note("a".into(), ms(0));
        b.note("b".into(), ms(100));
        b.note("a".into(), ms(200));
        assert_eq!(b.wait(ms(200)), Some(QUIET));
        assert!(b.take_due(ms(399)).is_empty(), "not quiet yet");
        assert_eq!(b.take_due(ms(400)), ["a", "b"], "each name once");
        assert_eq!(b.wait(ms(400)), None, "the burst is over");
        // A steady stream never goes quiet: due MAX_WAIT after its first.
        for i in 0..20 {
            b.note("c".into(), ms(1000 + i * 100));
            let now = ms(1000 + i * 100);
            let due = b.take_due(now);
            if now < ms(1000) + MAX_WAIT {
                assert!(due.is_empty(), "{i}");
            } else {
                assert_eq!(due, ["c"], "{i}");
                break;
            }
        }
    }

    #[test]
    fn a_late_wake_up_is_due_at_once() {
        let t0 = Instant::now();
        let mut b = Burst::default();
        b.note("x".into(), t0);
        assert_eq!(b.wait(t0 + Duration::from_secs(9)), Some(Duration::ZERO));
        assert_eq!(b.take_due(t0 + Duration::from_secs(9)), ["x"]);
    }
}
