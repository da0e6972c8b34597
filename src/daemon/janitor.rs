//! The janitor: autoclear devices removed once their last client leaves.
//!
//! Contract: an export whose spec has `autoclear` sends its name on the idle
//! channel when its client count drops to zero; the janitor's thread (one,
//! started by the server) detaches it, without force, if it is still idle
//! and had a client. It holds only a weak reference: it ends with the daemon.

use super::registry::Daemon;
use std::sync::Arc;

impl Daemon {
    /// Remove autoclear exports whose last client left. Runs on its own thread.
    pub fn run_janitor(self: &Arc<Self>) {
        let Some(rx) = self.idle_rx.lock().ok().and_then(|mut r| r.take()) else {
            return;
        };
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("loopd-autoclear".into())
            .spawn(move || {
                for name in rx {
                    let Some(d) = me.upgrade() else { return };
                    if let Some(e) = d.export(&name) {
                        if e.spec().autoclear && e.clients() == 0 && e.had_client() {
                            match d.detach(&name, false) {
                                Ok(()) => tracing::info!("autoclear: removed device {name:?}"),
                                Err(err) => tracing::debug!("autoclear of {name:?} skipped: {err}"),
                            }
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the autoclear thread: {e}");
        }
    }
}
