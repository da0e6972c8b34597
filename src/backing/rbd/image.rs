//! An open RBD image as a [`Storage`]: every operation is one of librbd's
//! asynchronous calls, whose completion callback — on a librbd thread —
//! delivers the result to the reactor's [`Completions`] (its eventfd wakes
//! the reactor's ring). Nothing here runs on the ring (`sqe` is `None`).
//!
//! Mapping: read → `rbd_aio_read` (the byte count), write → `rbd_aio_write`
//! (the length on success; with `dsync` and librbd's cache possibly on, a
//! `rbd_aio_flush` issued from the write's callback, the write's result
//! delivered after it), flush → `rbd_aio_flush`, `Allocate` with
//! `FALLOC_FL_PUNCH_HOLE` → `rbd_aio_discard` (the connection is made with
//! `rbd_skip_partial_discard = false`, so a discarded range reads as zeros,
//! as the engine's write-zeroes over a punch needs), `FALLOC_FL_ZERO_RANGE`
//! → `rbd_aio_write_zeroes`, size → `rbd_get_size`, prefetch → nothing.
//! The allocation map (`seek_data` / `seek_hole`) is `rbd_diff_iterate2`
//! over the image itself (whole objects: the object map when the image has
//! `fast-diff`); those calls block for a cluster round trip and run off the
//! reactors (block status is offloaded).
//!
//! Ownership: an [`RbdImage`] owns its librbd image and RADOS I/O context and
//! holds its [`Cluster`]; it is shared (`Arc`) by the device's configurations.
//! Each posted operation carries a boxed `Pending` (the request's tag, the
//! reactor's `Completions`) through librbd as the completion's argument; the
//! callback takes it back exactly once, releases the completion and
//! delivers. The request's buffers stay the request's (the `post` contract)
//! until that delivery. Closing (`rbd_close`, on drop) waits for librbd's
//! in-flight operations, so no callback runs after the image is gone.
//!
//! Why a callback and not `rbd_set_image_notification` + `rbd_poll_io_events`:
//! an image's notification eventfd is the image's, one for all its
//! completions, while a completion belongs to the reactor whose request
//! posted it — and one image serves connections on several reactors at once
//! (NBD multi-conn, a ublk device's queues). With the image's eventfd, one
//! reactor would poll every completion and forward others' to them. The
//! callback (librbd calls it with no lock of ours held) pushes the result to
//! the posting reactor's own [`Completions`], whose eventfd read is kept
//! armed on that reactor's io_uring: the same one read per burst, straight
//! to the right ring.
//!
//! Size changes: an image (not a snapshot, whose size never changes) keeps
//! an update watch ([`super::watch`]) from its open until just before
//! `rbd_close`; a higher layer hears through [`RbdImage::on_update`] that
//! the header changed and re-reads the size on a thread of its own.
//!
//! Locking: with `exclusive`, the open takes the image's exclusive lock
//! (`rbd_lock_acquire`): librbd then refuses to hand it to another client
//! until this image closes; a second opener is refused naming the holder.

use super::cluster::{Cluster, RbdCache};
use super::error::RbdError;
use super::ffi::{self, Lib, rados_ioctx_t, rbd_completion_t, rbd_image_t};
use super::spec::RbdSpec;
use super::watch::{Notify, UpdateWatch};
use crate::backing::storage::{Caps, Completions, IoOp, Storage};
use std::ffi::{CString, c_int, c_void};
use std::sync::Arc;

/// What an RBD image can do: no alignment, no page cache of ours, an
/// allocation map.
pub const CAPS: Caps = Caps {
    direct: false,
    inline_cached: false,
    splice: false,
    allocation_map: true,
};

/// An open image. See the module documentation.
pub struct RbdImage {
    lib: &'static Lib,
    image: rbd_image_t,
    io: rados_ioctx_t,
    spec: RbdSpec,
    read_only: bool,
    /// A write with `dsync` needs a flush after it (librbd's cache may be on).
    flush_dsync: bool,
    /// This open took the exclusive lock (and has not let it go).
    locked: std::sync::atomic::AtomicBool,
    /// The update watch (none on a snapshot, or if librbd refused it).
    watch: Option<UpdateWatch>,
    /// The lock's owner as librbd named it once taken (see `super::lock`).
    owner: Option<String>,
    /// Whether the cluster has fenced this client (said once).
    fence: super::lock::Fence,
    /// Last: dropped after the image and the I/O context.
    cluster: Arc<Cluster>,
}

// SAFETY: librbd's image handle is thread-safe for the calls used here (I/O,
// size, diff, flush; the C API serialises internally); the I/O context is only
// destroyed on drop. Nothing here is tied to the opening thread.
unsafe impl Send for RbdImage {}
// SAFETY: as for Send.
unsafe impl Sync for RbdImage {}

impl std::fmt::Debug for RbdImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdImage")
            .field("spec", &self.spec.to_string())
            .field("read_only", &self.read_only)
            .finish()
    }
}

/// How to open an image.
#[derive(Debug, Clone)]
pub struct OpenParams {
    pub read_only: bool,
    /// Take the exclusive lock (not with `--shared`, nor read-only).
    pub exclusive: bool,
    /// The owner this daemon's dead previous run recorded: its lock is
    /// broken and taken (see `super::lock`). Only ever the daemon's own
    /// record, never a client's word.
    pub take_back_from: Option<String>,
}

/// What an operation's callback needs: where to deliver, and how.
struct Pending {
    lib: &'static Lib,
    user_data: u64,
    done: Arc<Completions>,
    kind: Kind,
    /// The image (alive until every callback has run: see `Drop`).
    img: *const RbdImage,
}

#[derive(Clone, Copy)]
enum Kind {
    /// The result is a byte count.
    Read,
    /// Success is `len`; then a flush first when `flush` names the image.
    Write { len: u32, flush: Option<ImagePtr> },
    /// Success is 0.
    Other,
}

/// The image handle, carried into a write's callback for its flush.
#[derive(Clone, Copy)]
struct ImagePtr(rbd_image_t);

fn res_of(n: isize) -> i32 {
    i32::try_from(n).unwrap_or(if n < 0 { -libc::EIO } else { i32::MAX })
}

/// The completion callback: on a librbd thread, once per completion.
unsafe extern "C" fn on_complete(c: rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<Pending>` leaked by `submit` for this
    // completion, which completes once: taken back exactly once, here.
    let p = unsafe { Box::from_raw(arg.cast::<Pending>()) };
    // SAFETY: `c` is the completion this callback is for; it is released
    // here (as QEMU's rbd driver does) and never used again.
    let rv = unsafe { (p.lib.rbd_aio_get_return_value)(c) };
    // SAFETY: as above.
    unsafe { (p.lib.rbd_aio_release)(c) };
    let res = match p.kind {
        Kind::Read => res_of(rv),
        Kind::Write { len, flush } if rv >= 0 => {
            if let Some(img) = flush {
                // Durable before it is acknowledged: flush, then deliver the
                // write's length (the flush's callback does).
                let next = Box::new(Pending {
                    lib: p.lib,
                    user_data: p.user_data,
                    done: Arc::clone(&p.done),
                    kind: Kind::Write { len, flush: None },
                    img: p.img,
                });
                // SAFETY: the image is open: closing it waits for this
                // write's completion, inside which the flush is issued.
                unsafe { submit_flush(img.0, next) };
                return;
            }
            i32::try_from(len).unwrap_or(i32::MAX)
        }
        Kind::Write { .. } => res_of(rv),
        Kind::Other => res_of(rv.min(0)),
    };
    if res == -libc::ESHUTDOWN {
        // SAFETY: the image outlives its callbacks (closing waits for them).
        let img = unsafe { &*p.img };
        img.fence.note(&img.spec, &img.cluster);
    }
    p.done.complete(p.user_data, res);
}

/// Create a completion for `p` and hand it to `start`; if either fails, the
/// result is delivered at once.
///
/// # Safety
/// `start` is a librbd aio call on a live image whose memory arguments stay
/// valid until the completion's callback has run.
unsafe fn submit(p: Box<Pending>, start: impl FnOnce(rbd_completion_t) -> c_int) {
    let lib = p.lib;
    let raw = Box::into_raw(p);
    let mut c: rbd_completion_t = std::ptr::null_mut();
    // SAFETY: `raw` is handed to librbd as the callback's argument; `c` is
    // written on success.
    let rc = unsafe { (lib.rbd_aio_create_completion)(raw.cast(), on_complete, &mut c) };
    if rc < 0 {
        // SAFETY: not handed to librbd: still ours.
        let p = unsafe { Box::from_raw(raw) };
        p.done.complete(p.user_data, rc);
        return;
    }
    let rc = start(c);
    if rc < 0 {
        // Not queued: the callback will not run.
        // SAFETY: `c` is ours, never queued; `raw` is still ours.
        unsafe { (lib.rbd_aio_release)(c) };
        // SAFETY: as above.
        let p = unsafe { Box::from_raw(raw) };
        p.done.complete(p.user_data, rc);
    }
}

/// # Safety
/// `img` is an open image.
unsafe fn submit_flush(img: rbd_image_t, p: Box<Pending>) {
    let lib = p.lib;
    // SAFETY: a flush names no memory; the image is open (the caller's
    // contract).
    unsafe { submit(p, |c| (lib.rbd_aio_flush)(img, c)) }
}

/// The owners of the image's lock, escaped for a message.
fn lock_owners(lib: &Lib, image: rbd_image_t) -> Option<String> {
    // SAFETY: an open image (every caller has one).
    let names: Vec<String> = unsafe { super::lock::owners(lib, image) }
        .ok()?
        .iter()
        .map(|s| crate::text::sanitize_line(s).into_owned())
        .collect();
    (!names.is_empty()).then(|| names.join(", "))
}

impl RbdImage {
    /// Open `spec` through `cluster` (blocks: cluster round trips; never on a
    /// reactor).
    pub fn open(
        cluster: Arc<Cluster>,
        spec: &RbdSpec,
        p: &OpenParams,
    ) -> Result<RbdImage, RbdError> {
        let lib = cluster.lib();
        let read_only = p.read_only || spec.snap.is_some();
        let name =
            CString::new(spec.image.as_str()).map_err(|_| RbdError::Nul(spec.image.clone()))?;
        let snap = match &spec.snap {
            Some(s) => Some(CString::new(s.as_str()).map_err(|_| RbdError::Nul(s.clone()))?),
            None => None,
        };
        let io = cluster.ioctx(&spec.pool, spec.namespace.as_deref())?;
        let snap_ptr = snap.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        let mut image: rbd_image_t = std::ptr::null_mut();
        // SAFETY: a live I/O context, C strings that live for the call;
        // `image` is written on success.
        let rc = unsafe {
            if read_only {
                (lib.rbd_open_read_only)(io, name.as_ptr(), &mut image, snap_ptr)
            } else {
                (lib.rbd_open)(io, name.as_ptr(), &mut image, snap_ptr)
            }
        };
        if rc < 0 {
            // SAFETY: created above, no image uses it.
            unsafe { (lib.rados_ioctx_destroy)(io) };
            return Err(if rc == -libc::ENOENT {
                RbdError::NoImage {
                    spec: spec.to_string(),
                }
            } else {
                RbdError::Open {
                    spec: spec.to_string(),
                    source: ffi::os_error(rc),
                }
            });
        }
        let flush_dsync = cluster.options().cache != RbdCache::Off;
        // From here `me` owns both handles: an error closes them.
        let mut me = RbdImage {
            lib,
            image,
            io,
            spec: spec.clone(),
            read_only,
            flush_dsync,
            locked: std::sync::atomic::AtomicBool::new(false),
            watch: None,
            owner: None,
            fence: super::lock::Fence::default(),
            cluster,
        };
        if p.exclusive && !read_only {
            me.lock(p.take_back_from.as_deref())?;
            me.locked.store(true, std::sync::atomic::Ordering::Relaxed);
            // SAFETY: the image is open (ours).
            me.owner = unsafe { super::lock::owners(lib, me.image) }
                .ok()
                .and_then(|o| o.into_iter().next());
        }
        me.watch = me.watch_updates();
        Ok(me)
    }

    /// Take the exclusive lock (back from `dead`, our previous run, if it
    /// still holds it), or say who holds it.
    fn lock(&self, dead: Option<&str>) -> Result<(), RbdError> {
        let mut features = 0u64;
        // SAFETY: an open image; `features` is written.
        let rc = unsafe { (self.lib.rbd_get_features)(self.image, &mut features) };
        if rc == 0 && features & ffi::RBD_FEATURE_EXCLUSIVE_LOCK == 0 {
            return Err(RbdError::NoLockFeature {
                spec: self.spec.to_string(),
            });
        }
        if let Some(dead) = dead {
            // SAFETY: an open image.
            unsafe { super::lock::log_take_back(&self.spec, dead, self.lib, self.image) };
        }
        // SAFETY: an open image.
        let rc = unsafe { (self.lib.rbd_lock_acquire)(self.image, ffi::RBD_LOCK_MODE_EXCLUSIVE) };
        if rc == 0 {
            return Ok(());
        }
        match lock_owners(self.lib, self.image) {
            Some(holder) if matches!(-rc, libc::EROFS | libc::EBUSY | libc::EAGAIN) => {
                Err(RbdError::Locked {
                    spec: self.spec.to_string(),
                    holder,
                })
            }
            _ => Err(RbdError::Lock {
                spec: self.spec.to_string(),
                source: ffi::os_error(rc),
            }),
        }
    }

    /// Let the exclusive lock go now (a stopping daemon, whose images are
    /// never closed: without this the next opener would wait for Ceph's
    /// watch timeout, ~30 s, to break the lock of a gone client). Call it
    /// only once no more I/O comes.
    pub fn release_lock(&self) {
        if self
            .locked
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            // SAFETY: an open image.
            let rc = unsafe { (self.lib.rbd_lock_release)(self.image) };
            if rc < 0 {
                tracing::warn!(
                    "{}: cannot release the exclusive lock: {}",
                    self.spec,
                    ffi::os_error(rc)
                );
            }
        }
    }

    /// Register the update watch of an image that can change size (not a
    /// snapshot). Without one the device only learns a new size from `loopd
    /// resize`: said, not fatal.
    fn watch_updates(&self) -> Option<UpdateWatch> {
        if self.spec.snap.is_some() {
            return None;
        }
        // SAFETY: an open image; the watch is unregistered in `drop`, before
        // `rbd_close`.
        match unsafe { UpdateWatch::register(self.lib, self.image) } {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(
                    "{}: cannot watch the image for size changes ({e}); after an `rbd resize`, \
                     run `loopd resize` to give the device the new size",
                    self.spec
                );
                None
            }
        }
    }

    /// Have `notify` called (on a librbd thread: it must only signal, never
    /// block or call librbd) whenever the image's header changes — after a
    /// resize, among other things. Replaces any listener before; `None`
    /// removes it. Returns whether the image is watched at all.
    pub fn on_update(&self, notify: Option<Notify>) -> bool {
        match &self.watch {
            Some(w) => {
                w.set(notify);
                true
            }
            None => false,
        }
    }

    pub fn spec(&self) -> &RbdSpec {
        &self.spec
    }

    /// The exclusive lock's owner this open took it as (`None`: not taken).
    pub fn lock_owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// The image's size now.
    pub fn size(&self) -> Result<u64, RbdError> {
        let mut n = 0u64;
        // SAFETY: an open image; `n` is written.
        let rc = unsafe { (self.lib.rbd_get_size)(self.image, &mut n) };
        if rc < 0 {
            return Err(RbdError::Open {
                spec: self.spec.to_string(),
                source: ffi::os_error(rc),
            });
        }
        Ok(n)
    }

    /// The first allocated extent at or after `off` (`Some(start)`), with
    /// `hole`: the first offset at or after `off` not allocated instead.
    fn scan(&self, off: u64, hole: bool) -> Result<Option<u64>, rustix::io::Errno> {
        struct Scan {
            hole: bool,
            pos: u64,
            found: Option<u64>,
        }
        unsafe extern "C" fn cb(o: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
            // SAFETY: `arg` is the `Scan` below, alive for the iteration,
            // used by this callback only (librbd calls it on the caller's
            // thread or while the caller waits).
            let s = unsafe { &mut *arg.cast::<Scan>() };
            if exists == 0 {
                return 0;
            }
            let end = o.saturating_add(len as u64);
            if !s.hole {
                s.found = Some(o.max(s.pos));
                return -libc::ECANCELED;
            }
            if o > s.pos {
                s.found = Some(s.pos);
                return -libc::ECANCELED;
            }
            s.pos = s.pos.max(end);
            0
        }
        let size = self.current_len();
        if off >= size {
            return Ok(None);
        }
        let mut s = Scan {
            hole,
            pos: off,
            found: None,
        };
        // SAFETY: an open image; `s` outlives the call, which invokes `cb`
        // only before it returns.
        let rc = unsafe {
            (self.lib.rbd_diff_iterate2)(
                self.image,
                std::ptr::null(),
                off,
                size - off,
                1,
                1,
                cb,
                (&mut s as *mut Scan).cast(),
            )
        };
        if rc < 0 && !(rc == -libc::ECANCELED && s.found.is_some()) {
            return Err(rustix::io::Errno::from_raw_os_error(-rc));
        }
        Ok(if hole {
            Some(s.found.unwrap_or(s.pos).min(size))
        } else {
            s.found
        })
    }
}

impl Storage for RbdImage {
    fn caps(&self) -> Caps {
        CAPS
    }

    /// Start `op` in librbd; its callback delivers the result to `done`.
    ///
    /// # Safety
    /// As [`Storage::post`].
    unsafe fn post(&self, op: IoOp, user_data: u64, done: &Arc<Completions>) {
        let lib = self.lib;
        let img = self.image;
        let pending = |kind| {
            Box::new(Pending {
                lib,
                user_data,
                done: Arc::clone(done),
                kind,
                img: self,
            })
        };
        match op {
            IoOp::Read { buf, len, off } => {
                // SAFETY: `buf` holds `len` bytes ours until delivery (the
                // caller's contract), which is after librbd is done with it.
                unsafe {
                    submit(pending(Kind::Read), |c| {
                        (lib.rbd_aio_read)(img, off, len as usize, buf.cast(), c)
                    })
                }
            }
            IoOp::Write { .. } | IoOp::Allocate { .. } if self.read_only => {
                done.complete(user_data, -libc::EROFS);
            }
            IoOp::Write {
                buf,
                len,
                off,
                dsync,
                ..
            } => {
                let flush = (dsync && self.flush_dsync).then_some(ImagePtr(img));
                // SAFETY: as for Read; the buffer is only read.
                unsafe {
                    submit(pending(Kind::Write { len, flush }), |c| {
                        (lib.rbd_aio_write)(img, off, len as usize, buf.cast(), c)
                    })
                }
            }
            IoOp::Flush => {
                // SAFETY: an open image.
                unsafe { submit_flush(img, pending(Kind::Other)) }
            }
            IoOp::Allocate { mode, off, len } => {
                let zero = mode & libc::FALLOC_FL_ZERO_RANGE != 0;
                let Ok(n) = usize::try_from(len) else {
                    done.complete(user_data, -libc::EINVAL);
                    return;
                };
                // SAFETY: no memory named; an open image.
                unsafe {
                    submit(pending(Kind::Other), |c| {
                        if zero {
                            (lib.rbd_aio_write_zeroes)(img, off, n, c, 0, 0)
                        } else {
                            (lib.rbd_aio_discard)(img, off, len, c)
                        }
                    })
                }
            }
            IoOp::WillNeed { .. }
            | IoOp::Size { .. }
            | IoOp::ReadFixed { .. }
            | IoOp::WriteFixed { .. }
            | IoOp::ZeroFixed { .. } => {
                // SAFETY: as for Storage::run (the caller's contract); both
                // are answered at once, without librbd's threads.
                let res = unsafe { self.run(op) };
                done.complete(user_data, res);
            }
        }
    }

    /// Run `op` and wait for it (a posted operation on a private
    /// `Completions`, read back here).
    ///
    /// # Safety
    /// As [`Storage::run`].
    unsafe fn run(&self, op: IoOp) -> i32 {
        match op {
            IoOp::WillNeed { .. } => 0,
            IoOp::Size { buf } => match self.size() {
                Ok(n) => {
                    // SAFETY: `buf` points at a `libc::statx` the caller owns
                    // (its contract); two plain integer fields are written.
                    unsafe {
                        (*buf).stx_size = n;
                        (*buf).stx_mask |= libc::STATX_SIZE;
                    }
                    0
                }
                Err(_) => -libc::EIO,
            },
            // A ring's registered buffers mean nothing to librbd.
            IoOp::ReadFixed { .. } | IoOp::WriteFixed { .. } | IoOp::ZeroFixed { .. } => {
                -libc::EOPNOTSUPP
            }
            _ => {
                let done = match Completions::new() {
                    Ok(d) => Arc::new(d),
                    Err(e) => return -e.raw_os_error().unwrap_or(libc::EIO),
                };
                // SAFETY: the caller's contract covers the op until we return,
                // which is after its result is delivered below.
                unsafe { self.post(op, 0, &done) };
                let mut res = None;
                // Bounded: librbd completes every op (with ETIMEDOUT at the
                // RADOS timeouts at the latest); each read waits for a signal.
                while res.is_none() {
                    let mut b = [0u8; 8];
                    if let Err(e) = rustix::io::read(done.event_fd(), &mut b) {
                        if e != rustix::io::Errno::INTR {
                            // Cannot wait: the op still owns the memory, so
                            // spin on the list instead.
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                    }
                    done.drain(|_, r| res = Some(r));
                }
                res.unwrap_or(-libc::EIO)
            }
        }
    }

    fn current_len(&self) -> u64 {
        self.size().unwrap_or(0)
    }

    fn seek_data(&self, off: u64) -> Result<u64, rustix::io::Errno> {
        self.scan(off, false)?.ok_or(rustix::io::Errno::NXIO)
    }

    fn seek_hole(&self, off: u64) -> Result<u64, rustix::io::Errno> {
        Ok(self
            .scan(off, true)?
            .unwrap_or_else(|| off.max(self.current_len())))
    }

    fn sync_data(&self) -> std::io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        // SAFETY: an open image; blocks until every write so far is durable.
        let rc = unsafe { (self.lib.rbd_flush)(self.image) };
        if rc < 0 {
            return Err(ffi::os_error(rc));
        }
        Ok(())
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        if let Some(w) = self.watch.take() {
            // SAFETY: the image this watch was registered on, still open;
            // not on librbd's callback thread (a drop is the owner's).
            if let Err(e) = unsafe { w.unregister(self.lib, self.image) } {
                tracing::debug!("{}: update watch: {e}", self.spec);
            }
        }
        // SAFETY: the handles are ours; rbd_close waits for librbd's
        // in-flight operations (and releases the exclusive lock), then the
        // I/O context goes; the cluster (last field) after both.
        unsafe {
            (self.lib.rbd_close)(self.image);
            (self.lib.rados_ioctx_destroy)(self.io);
        }
    }
}
