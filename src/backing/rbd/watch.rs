//! Hearing that an open image changed: librbd's update watch
//! (`rbd_update_watch`), which calls back whenever the image's header
//! changes — a resize by any client (`rbd resize`, another librbd), a
//! snapshot made, a feature or lock change.
//!
//! Contract: an [`UpdateWatch`] is registered on an open image and
//! unregistered before it closes (by [`super::image::RbdImage`]). Its
//! callback runs on a librbd thread; it only calls the [`Notify`] a higher
//! layer installed ([`UpdateWatch::set`]), which must only signal (send on a
//! channel, write an eventfd): never block, never call back into librbd —
//! whoever acts on the signal (re-reads the size) does so on a thread of its
//! own. The callback says nothing about *what* changed, and librbd may call
//! it several times for one change: the listener re-reads what it cares
//! about and coalesces bursts.
//!
//! Ownership: the callback's argument is the [`Slot`] of an `Arc` the watch
//! keeps; `rbd_update_unwatch` returns only once no callback runs any more
//! (librbd defers its completion past one in flight), after which the `Arc`
//! may go.

use super::ffi::{self, Lib, rbd_image_t};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// What the image's listener is told: "the header changed" (no details).
pub type Notify = Box<dyn Fn() + Send + Sync>;

/// Where the callback finds the listener.
#[derive(Default)]
struct Slot {
    notify: Mutex<Option<Notify>>,
}

/// A registered update watch (see the module documentation).
pub struct UpdateWatch {
    handle: u64,
    slot: Arc<Slot>,
}

/// librbd's callback, on a librbd thread.
unsafe extern "C" fn on_update(arg: *mut c_void) {
    // SAFETY: `arg` is `Arc::as_ptr` of the watch's slot, which the watch
    // keeps alive until `rbd_update_unwatch` has returned, and unwatch waits
    // for a callback in flight.
    let slot = unsafe { &*arg.cast::<Slot>() };
    // Held only to swap the listener (never across a call into librbd).
    let g = slot.notify.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(f) = g.as_ref() {
        f();
    }
}

impl UpdateWatch {
    /// Register a watch on `image`.
    ///
    /// # Safety
    /// `image` is an open image of `lib`, and stays open until
    /// [`UpdateWatch::unregister`] of the result.
    pub unsafe fn register(lib: &Lib, image: rbd_image_t) -> std::io::Result<UpdateWatch> {
        let slot = Arc::new(Slot::default());
        let mut handle = 0u64;
        let arg = Arc::as_ptr(&slot).cast_mut().cast::<c_void>();
        // SAFETY: an open image (the caller's contract); `handle` is written;
        // `arg` stays valid while registered (the watch holds the `Arc`).
        let rc = unsafe { (lib.rbd_update_watch)(image, &mut handle, on_update, arg) };
        if rc < 0 {
            return Err(ffi::os_error(rc));
        }
        Ok(UpdateWatch { handle, slot })
    }

    /// Install (or, with `None`, remove) the listener; replaces any before.
    pub fn set(&self, notify: Option<Notify>) {
        let mut g = self.slot.notify.lock().unwrap_or_else(|p| p.into_inner());
        *g = notify;
    }

    /// Unregister: when this returns, the callback no longer runs.
    ///
    /// # Safety
    /// `image` is the open image this watch was registered on; never call
    /// it from the callback (librbd would wait for itself).
    pub unsafe fn unregister(self, lib: &Lib, image: rbd_image_t) -> std::io::Result<()> {
        // SAFETY: as the caller's contract says.
        let rc = unsafe { (lib.rbd_update_unwatch)(image, self.handle) };
        if rc < 0 {
            // librbd may still know the handle: keep the slot for the life
            // of the process (a few bytes) rather than risk a callback into
            // freed memory.
            std::mem::forget(self.slot);
            return Err(ffi::os_error(rc));
        }
        Ok(())
    }
}
