//! Connections to Ceph clusters, one per (configuration file, client id,
//! cache choice, timeout), shared by every image opened through it
//! ([`Cluster::get`]) and shut down when the last image using it closes.
//!
//! A connection is made with RADOS' timeouts set (`rados_osd_op_timeout`,
//! `rados_mon_op_timeout`, `client_mount_timeout`: [`Options::timeout`]), so
//! that no operation of a stalled cluster waits for ever: by default
//! [`DEFAULT_TIMEOUT`], below the NBD frontend's reply timeout (10 s), so a
//! stalled OSD fails a request with `ETIMEDOUT` before the frontend gives up
//! on the connection. librbd's cache (`rbd_cache`) is a client-wide setting,
//! hence part of the key.
//!
//! Threads: connecting blocks (a monitor round trip, up to the timeout): it is
//! done by the device's open, on a control thread, never on a reactor. Each
//! key has a lock of its own, held while connecting: two attaches of the same
//! cluster make one connection (the second waits for the first), while
//! attaches of other keys go on in parallel — an unreachable monitor holds up
//! only the attaches that want it. The table's own lock is held for lookups
//! only, never across a connect. A connection the cluster has fenced
//! (blocklisted) is not handed out again: the next open connects anew.

use super::error::RbdError;
use super::ffi::{self, Lib, rados_ioctx_t, rados_t};
use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Default RADOS operation, monitor and mount timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(8);

/// Default Ceph configuration file and client id, as `rbd` has them.
pub const DEFAULT_CONF: &str = "/etc/ceph/ceph.conf";
pub const DEFAULT_ID: &str = "admin";

/// librbd's cache, per the device's `--cache`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RbdCache {
    /// Whatever the configuration says (librbd's default: on, write-through
    /// until the client's first flush).
    Default,
    /// On: writes acknowledged from memory, durable at the next flush.
    On,
    /// Off: every acknowledged write is on the OSDs.
    Off,
}

/// How to reach a cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Options {
    pub conf: PathBuf,
    /// The client id, without `client.`.
    pub id: String,
    pub cache: RbdCache,
    pub timeout: Duration,
}

/// One connection (`rados_t`), connected.
pub struct Cluster {
    lib: &'static Lib,
    handle: rados_t,
    opts: Options,
    /// The cluster has blocklisted this client (see `super::lock`): no
    /// new open uses it.
    fenced: AtomicBool,
}

// SAFETY: a connected `rados_t` is used by librados from any thread (its API
// is thread-safe); this type only hands it to librados calls.
unsafe impl Send for Cluster {}
// SAFETY: as for Send: every use is a librados call, which locks internally.
unsafe impl Sync for Cluster {}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("opts", &self.opts).finish()
    }
}

/// One key's connection: its lock is held while connecting.
type Slot = Arc<Mutex<Weak<Cluster>>>;
type Table = Mutex<HashMap<Options, Slot>>;

fn table() -> &'static Table {
    static T: std::sync::OnceLock<Table> = std::sync::OnceLock::new();
    T.get_or_init(Table::default)
}

fn cstr(s: &str) -> Result<CString, RbdError> {
    CString::new(s).map_err(|_| RbdError::Nul(s.replace('\0', "\\0")))
}

fn path_cstr(p: &Path) -> Result<CString, RbdError> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| RbdError::Nul(p.display().to_string().replace('\0', "\\0")))
}

impl Cluster {
    /// The connection for `opts`: the live one, or a new one (blocks while
    /// it connects).
    pub fn get(opts: &Options) -> Result<Arc<Cluster>, RbdError> {
        let lib = ffi::lib()?;
        let slot = {
            let mut t = table().lock().unwrap_or_else(|p| p.into_inner());
            // Forget the keys nobody uses: no connection, nobody connecting
            // (a slot being connected is locked, or held by a waiter).
            t.retain(|_, s| {
                Arc::strong_count(s) > 1 || s.try_lock().map_or(true, |w| w.strong_count() > 0)
            });
            Arc::clone(t.entry(opts.clone()).or_default())
        };
        // Only this key's attaches wait here (one connect per key at a time).
        let mut w = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = w.upgrade().filter(|c| !c.is_fenced()) {
            return Ok(c);
        }
        let c = Arc::new(Cluster::connect(lib, opts)?);
        *w = Arc::downgrade(&c);
        Ok(c)
    }

    fn connect(lib: &'static Lib, opts: &Options) -> Result<Cluster, RbdError> {
        let name = cstr(&format!("client.{}", opts.id))?;
        let mut handle: rados_t = std::ptr::null_mut();
        // SAFETY: `handle` is written by rados_create2; the strings live
        // for the call.
        let rc = unsafe { (lib.rados_create2)(&mut handle, c"ceph".as_ptr(), name.as_ptr(), 0) };
        if rc < 0 {
            return Err(RbdError::Create(ffi::os_error(rc)));
        }
        // From here `c` owns the handle: dropped, it is shut down.
        let c = Cluster {
            lib,
            handle,
            opts: opts.clone(),
            fenced: AtomicBool::new(false),
        };
        let conf = path_cstr(&opts.conf)?;
        // SAFETY: a created handle, a C string that lives for the call.
        let rc = unsafe { (lib.rados_conf_read_file)(c.handle, conf.as_ptr()) };
        if rc < 0 {
            return Err(RbdError::Conf {
                conf: opts.conf.clone(),
                source: ffi::os_error(rc),
            });
        }
        let secs = opts.timeout.as_secs().max(1).to_string();
        let mut set = vec![
            ("rados_osd_op_timeout", secs.as_str()),
            ("rados_mon_op_timeout", secs.as_str()),
            ("client_mount_timeout", secs.as_str()),
            // A discard zeroes what it cannot deallocate (the engine's
            // write-zeroes may be a punch; see the `image` module); librbd
            // then ignores its discard granularity.
            ("rbd_skip_partial_discard", "false"),
        ];
        match opts.cache {
            RbdCache::Default => {}
            RbdCache::On => {
                set.push(("rbd_cache", "true"));
                // Asked for: writes are cached from the first (loopd honours
                // every flush and FUA), not written through until the
                // client's first flush.
                set.push(("rbd_cache_writethrough_until_flush", "false"));
            }
            RbdCache::Off => set.push(("rbd_cache", "false")),
        }
        for (k, v) in set {
            let (ck, cv) = (cstr(k)?, cstr(v)?);
            // SAFETY: as above.
            let rc = unsafe { (lib.rados_conf_set)(c.handle, ck.as_ptr(), cv.as_ptr()) };
            if rc < 0 {
                return Err(RbdError::ConfSet {
                    option: k,
                    source: ffi::os_error(rc),
                });
            }
        }
        // SAFETY: a configured handle; blocks until connected or timed out.
        let rc = unsafe { (lib.rados_connect)(c.handle) };
        if rc < 0 {
            let source = ffi::os_error(rc);
            return Err(match -rc {
                libc::EACCES | libc::EPERM | libc::ENOENT => RbdError::Auth {
                    id: opts.id.clone(),
                    conf: opts.conf.clone(),
                    source,
                },
                _ => RbdError::Connect {
                    conf: opts.conf.clone(),
                    id: opts.id.clone(),
                    source,
                },
            });
        }
        Ok(c)
    }

    /// The cluster refused this client (`ESHUTDOWN`): the images using it
    /// keep it until they close; opens connect anew ([`Cluster::get`]).
    pub fn set_fenced(&self) {
        self.fenced.store(true, Ordering::Relaxed);
    }

    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Relaxed)
    }

    pub fn lib(&self) -> &'static Lib {
        self.lib
    }

    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// An I/O context on `pool` (and `namespace`); the caller destroys it.
    pub fn ioctx(&self, pool: &str, namespace: Option<&str>) -> Result<rados_ioctx_t, RbdError> {
        let p = cstr(pool)?;
        let mut io: rados_ioctx_t = std::ptr::null_mut();
        // SAFETY: a connected handle; `io` is written on success.
        let rc = unsafe { (self.lib.rados_ioctx_create)(self.handle, p.as_ptr(), &mut io) };
        if rc < 0 {
            return Err(if rc == -libc::ENOENT {
                RbdError::NoPool {
                    pool: pool.to_owned(),
                }
            } else {
                RbdError::Pool {
                    pool: pool.to_owned(),
                    source: ffi::os_error(rc),
                }
            });
        }
        if let Some(ns) = namespace {
            let n = match cstr(ns) {
                Ok(n) => n,
                Err(e) => {
                    // SAFETY: created above, used by nobody else.
                    unsafe { (self.lib.rados_ioctx_destroy)(io) };
                    return Err(e);
                }
            };
            // SAFETY: a live ioctx; librados copies the string.
            unsafe { (self.lib.rados_ioctx_set_namespace)(io, n.as_ptr()) };
        }
        Ok(io)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle was created by rados_create2 and every image and
        // I/O context made from it is gone (they hold an `Arc<Cluster>`).
        unsafe { (self.lib.rados_shutdown)(self.handle) };
    }
}
