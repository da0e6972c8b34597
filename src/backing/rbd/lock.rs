//! An image's exclusive lock: who holds it ([`owners`]), and taking it back
//! from this daemon's own dead previous run ([`take_back`]).
//!
//! librbd names a lock's owner by the RADOS client address of its holder
//! (`IP:PORT/NONCE`, the nonce random per client instance), as
//! `rbd_lock_get_owners` returns it and `rbd_lock_break` expects it. A holder
//! that dies without letting the lock go (`kill -9`) keeps it until Ceph's
//! watch timeout (~30 s) has passed; only then may another client take it.
//!
//! Take back: the daemon records, per RBD device, the owner its open got
//! ([`owners`] right after taking the lock) in the device's state-file
//! record (devices of `--config` and `serve rbd:…`, which the state file
//! does not hold: in its sidecar, `crate::daemon::rbd_owners`). A restarted
//! daemon holds that state file (its lock: the run that wrote it is dead),
//! so when the image's owner is still *exactly* the recorded one, that owner
//! is our dead self: its lock is broken
//! (`rbd_lock_break`, which also blocklists the dead client's address, so
//! nothing it had in flight can land later) and taken at once. A lock held by
//! anyone else — another loopd, rbd-nbd, krbd, a VM — is never broken: its
//! address is not the recorded one.
//! Not covered: a run killed between taking the lock and recording its owner
//! (the record names the run before, or nobody), and a daemon without a state
//! file: their next open waits for Ceph's watch timeout as any other client
//! would.
//!
//! Fenced: a client whose lock was broken (or that an operator blocklisted,
//! `ceph osd blocklist add`) is refused by the OSDs from then on: its
//! operations fail with `ESHUTDOWN` (Ceph's `EBLOCKLISTED`). The first such
//! failure of an image says so in the log ([`Fence::note`]) and marks its
//! cluster connection fenced, so that the next open through that
//! configuration connects anew instead of reusing a dead client.
//!
//! Threads: every call here is a cluster round trip (bounded by the RADOS
//! timeouts) on the caller's thread: an open, never a reactor.

use super::cluster::Cluster;
use super::ffi::{self, Lib, rbd_image_t};
use super::spec::RbdSpec;
use crate::text::sanitize_line;
use std::ffi::{CStr, CString, c_char, c_int};
use std::sync::atomic::{AtomicBool, Ordering};

/// The owners of the image's lock, as librbd names them (raw: compare them,
/// escape them before they reach a terminal). `Err(-errno)`: `-ENOENT`
/// when nobody holds it.
///
/// # Safety
/// `image` is an open image of `lib`.
pub unsafe fn owners(lib: &Lib, image: rbd_image_t) -> Result<Vec<String>, c_int> {
    let mut mode: c_int = 0;
    let mut buf: [*mut c_char; 8] = [std::ptr::null_mut(); 8];
    let mut n: usize = buf.len();
    // SAFETY: an open image (the caller's); `buf` has room for `n` pointers,
    // which librbd fills with strings freed by the cleanup call below.
    let rc = unsafe { (lib.rbd_lock_get_owners)(image, &mut mode, buf.as_mut_ptr(), &mut n) };
    if rc < 0 {
        return Err(rc);
    }
    let n = n.min(buf.len());
    let names = buf[..n]
        .iter()
        .filter(|p| !p.is_null())
        // SAFETY: non-null NUL-terminated strings from librbd, valid until
        // the cleanup call below.
        .map(|p| unsafe { CStr::from_ptr(*p) }.to_string_lossy().into_owned())
        .collect();
    // SAFETY: the `n` strings librbd allocated above, freed once.
    unsafe { (lib.rbd_lock_get_owners_cleanup)(buf.as_mut_ptr(), n) };
    Ok(names)
}

/// What [`take_back`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum TakeBack {
    /// Nobody holds the lock, or someone other than `dead` does: nothing
    /// broken (the acquire that follows takes it or names the holder).
    NotOurs,
    /// `dead` held it: broken (and blocklisted).
    Broken,
}

/// If the image's lock is held by exactly `dead` — the owner this daemon's
/// previous run recorded — break it (see the module documentation).
/// `Err(-errno)`: the owner could not be read or the break failed (the
/// acquire that follows then refuses, naming the holder).
///
/// # Safety
/// `image` is an open image of `lib`.
pub unsafe fn take_back(lib: &Lib, image: rbd_image_t, dead: &str) -> Result<TakeBack, c_int> {
    // SAFETY: the caller's contract.
    let now = match unsafe { owners(lib, image) } {
        Ok(o) => o,
        Err(rc) if rc == -libc::ENOENT => return Ok(TakeBack::NotOurs),
        Err(rc) => return Err(rc),
    };
    if !is_only(&now, dead) {
        return Ok(TakeBack::NotOurs);
    }
    let Ok(owner) = CString::new(dead) else {
        return Ok(TakeBack::NotOurs);
    };
    // SAFETY: an open image (the caller's contract); a C string that lives
    // for the call. librbd
    // compares the owner again and breaks only if it is still `dead`.
    let rc = unsafe { (lib.rbd_lock_break)(image, ffi::RBD_LOCK_MODE_EXCLUSIVE, owner.as_ptr()) };
    match rc {
        0 => Ok(TakeBack::Broken),
        // Gone meanwhile, or someone else's now: not ours to break.
        _ if rc == -libc::ENOENT || rc == -libc::EBUSY => Ok(TakeBack::NotOurs),
        _ => Err(rc),
    }
}

/// [`take_back`] from `dead` on the image `spec` names, saying what
/// happened in the log (escaped: the owner is librbd's text).
///
/// # Safety
/// `image` is an open image of `lib`.
pub unsafe fn log_take_back(spec: &RbdSpec, dead: &str, lib: &Lib, image: rbd_image_t) {
    let who = sanitize_line(dead);
    // The spec is a client's text too (no control character, but bidi and
    // invisible ones pass the parser): escaped as the fence line does.
    let spec = spec.to_string();
    let spec = sanitize_line(&spec);
    // SAFETY: the caller's contract.
    match unsafe { take_back(lib, image, dead) } {
        Ok(TakeBack::Broken) => tracing::warn!(
            "{spec}: this daemon's previous run ({who}) died holding the exclusive lock: broke it \
             (that client is blocklisted) and took it back"
        ),
        Ok(TakeBack::NotOurs) => {}
        Err(rc) => tracing::warn!(
            "{spec}: cannot take the exclusive lock back from this daemon's previous run \
             ({who}): {}",
            ffi::os_error(rc)
        ),
    }
}

/// Whether an image's client was fenced, said once (see the module doc).
#[derive(Debug, Default)]
pub struct Fence {
    said: AtomicBool,
}

impl Fence {
    /// An operation of the image `spec` failed with `ESHUTDOWN`: log it
    /// (once per image) and mark `cluster` fenced. Called on a librbd thread:
    /// it never blocks.
    pub fn note(&self, spec: &RbdSpec, cluster: &Cluster) {
        cluster.set_fenced();
        if !self.said.swap(true, Ordering::Relaxed) {
            tracing::error!(
                "{}: the Ceph cluster has fenced this client (blocklisted: its exclusive lock \
                 was broken, or an operator blocklisted it; the image may be gone): every request \
                 of the device fails now; detach it",
                sanitize_line(&spec.to_string())
            );
        }
    }
}

/// Whether `owners` is exactly the one owner `dead` (never an empty record).
fn is_only(owners: &[String], dead: &str) -> bool {
    !dead.is_empty() && owners.len() == 1 && owners[0] == dead
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_recorded_owner_is_ours() {
        let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let dead = "127.0.0.1:0/123456";
        assert!(is_only(&own(&[dead]), dead));
        for other in [
            own(&[]),
            own(&["127.0.0.1:0/1234567"]),
            own(&["127.0.0.1:0/12345"]),
            own(&[dead, "127.0.0.1:0/9"]),
            own(&["127.0.0.1:0/123456 "]),
        ] {
            assert!(!is_only(&other, dead), "{other:?}");
        }
        assert!(!is_only(&own(&[""]), ""), "an empty record is nobody");
    }
}
