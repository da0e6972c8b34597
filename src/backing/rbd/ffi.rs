//! A thin binding of our own over the C API of librados and librbd (Ceph's
//! `librados.h`, `librbd.h`), loaded at run time with `dlopen(3)`.
//!
//! Why loaded at run time: loopd is built and run on machines without Ceph;
//! linking `-lrbd` would make every loopd need `librbd1` installed. Only an
//! `rbd:` image loads the libraries (once per process, never unloaded), and on
//! a machine without them it fails with [`LoadError`], which names the
//! library file and the Debian package that provides it.
//!
//! Why libc's `dlopen` and not the `libloading` crate: about twenty symbols,
//! looked up once, kept for the life of the process — the three calls
//! (`dlopen`, `dlsym`, `dlerror`) are already in `libc`, and a crate would add
//! a dependency for no less `unsafe` at the call sites.
//!
//! Why not an existing crate: `ceph-rbd` 0.3.2 and `librbd-sys` 0.1.0 are
//! stale and link at build time; `ceph` covers librados only.
//!
//! Contract: [`Lib`] holds plain C function pointers with the headers'
//! signatures (Ceph 16 "Pacific", the API is older than that and stable).
//! Everything here is `unsafe` to call; the safe wrappers are in `cluster`
//! and `image`, which own every handle and never let a pointer escape.

#![allow(non_camel_case_types)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;
use thiserror::Error;

pub type rados_t = *mut c_void;
pub type rados_ioctx_t = *mut c_void;
pub type rbd_image_t = *mut c_void;
pub type rbd_completion_t = *mut c_void;
pub type rbd_callback_t = unsafe extern "C" fn(cb: rbd_completion_t, arg: *mut c_void);
/// `rbd_update_callback_t`: an image's header changed (size, snapshots, ...).
pub type rbd_update_callback_t = unsafe extern "C" fn(arg: *mut c_void);
pub type diff_cb_t =
    unsafe extern "C" fn(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int;

/// `RBD_LOCK_MODE_EXCLUSIVE` (`rbd_lock_mode_t`).
pub const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;
/// `RBD_FEATURE_EXCLUSIVE_LOCK`.
pub const RBD_FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;

/// The libraries, as loaded: the file names and their Debian packages.
pub const LIBRBD: (&str, &str) = ("librbd.so.1", "librbd1");
pub const LIBRADOS: (&str, &str) = ("librados.so.2", "librados2");

/// Why the Ceph libraries could not be used.
#[derive(Debug, Clone, Error)]
pub enum LoadError {
    #[error(
        "cannot load {file} (Ceph's client library; on Debian and Ubuntu install the package \
         {package}): {why}"
    )]
    Library {
        file: String,
        package: &'static str,
        why: String,
    },
    #[error("{file} has no symbol {symbol} (Ceph 12 \"Luminous\" or later is needed)")]
    Symbol { file: String, symbol: &'static str },
}

macro_rules! lib {
    (@pick rados, $r:ident, $b:ident) => { $r };
    (@pick rbd, $r:ident, $b:ident) => { $b };
    ($($lib:ident: $name:ident: fn($($a:ty),*) $(-> $r:ty)?;)*) => {
        /// The functions loopd calls, from the loaded libraries.
        #[allow(clippy::type_complexity)]
        #[derive(Debug, Clone, Copy)]
        pub struct Lib {
            $(pub $name: unsafe extern "C" fn($($a),*) $(-> $r)?,)*
        }

        impl Lib {
            fn resolve(rados: &Handle, rbd: &Handle) -> Result<Lib, LoadError> {
                Ok(Lib {
                    $($name: {
                        let h = lib!(@pick $lib, rados, rbd);
                        let p = h.symbol(concat!(stringify!($name), "\0"))?;
                        // SAFETY: `p` is the non-null address of the C function
                        // of this name, whose prototype in Ceph's headers is the
                        // type this field has.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($a),*) $(-> $r)?>(p) }
                    },)*
                })
            }
        }
    };
}

lib! {
    rados: rados_create2: fn(*mut rados_t, *const c_char, *const c_char, u64) -> c_int;
    rados: rados_conf_read_file: fn(rados_t, *const c_char) -> c_int;
    rados: rados_conf_set: fn(rados_t, *const c_char, *const c_char) -> c_int;
    rados: rados_connect: fn(rados_t) -> c_int;
    rados: rados_shutdown: fn(rados_t);
    rados: rados_ioctx_create: fn(rados_t, *const c_char, *mut rados_ioctx_t) -> c_int;
    rados: rados_ioctx_set_namespace: fn(rados_ioctx_t, *const c_char);
    rados: rados_ioctx_destroy: fn(rados_ioctx_t);
    rbd: rbd_open: fn(rados_ioctx_t, *const c_char, *mut rbd_image_t, *const c_char) -> c_int;
    rbd: rbd_open_read_only: fn(rados_ioctx_t, *const c_char, *mut rbd_image_t, *const c_char) -> c_int;
    rbd: rbd_close: fn(rbd_image_t) -> c_int;
    rbd: rbd_get_size: fn(rbd_image_t, *mut u64) -> c_int;
    rbd: rbd_get_features: fn(rbd_image_t, *mut u64) -> c_int;
    rbd: rbd_aio_create_completion: fn(*mut c_void, rbd_callback_t, *mut rbd_completion_t) -> c_int;
    rbd: rbd_aio_get_return_value: fn(rbd_completion_t) -> isize;
    rbd: rbd_aio_release: fn(rbd_completion_t);
    rbd: rbd_aio_read: fn(rbd_image_t, u64, usize, *mut c_char, rbd_completion_t) -> c_int;
    rbd: rbd_aio_write: fn(rbd_image_t, u64, usize, *const c_char, rbd_completion_t) -> c_int;
    rbd: rbd_aio_flush: fn(rbd_image_t, rbd_completion_t) -> c_int;
    rbd: rbd_aio_discard: fn(rbd_image_t, u64, u64, rbd_completion_t) -> c_int;
    rbd: rbd_aio_write_zeroes: fn(rbd_image_t, u64, usize, rbd_completion_t, c_int, c_int) -> c_int;
    rbd: rbd_diff_iterate2: fn(rbd_image_t, *const c_char, u64, u64, u8, u8, diff_cb_t, *mut c_void) -> c_int;
    rbd: rbd_lock_acquire: fn(rbd_image_t, c_int) -> c_int;
    rbd: rbd_lock_release: fn(rbd_image_t) -> c_int;
    rbd: rbd_lock_get_owners: fn(rbd_image_t, *mut c_int, *mut *mut c_char, *mut usize) -> c_int;
    rbd: rbd_lock_get_owners_cleanup: fn(*mut *mut c_char, usize);
    rbd: rbd_flush: fn(rbd_image_t) -> c_int;
    rbd: rbd_update_watch: fn(rbd_image_t, *mut u64, rbd_update_callback_t, *mut c_void) -> c_int;
    rbd: rbd_update_unwatch: fn(rbd_image_t, u64) -> c_int;
    rbd: rbd_lock_break: fn(rbd_image_t, c_int, *const c_char) -> c_int;
}

/// A library opened with `dlopen`, never closed (its functions stay callable
/// for the life of the process, as librbd's own threads need).
struct Handle {
    file: String,
    ptr: *mut c_void,
}

/// The last `dlerror()` message, or `fallback`.
fn dl_error(fallback: &str) -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the
    // next dl* call on this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        return fallback.to_owned();
    }
    // SAFETY: non-null, NUL-terminated (above).
    unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
}

impl Handle {
    fn open(file: &str, package: &'static str) -> Result<Handle, LoadError> {
        let err = |why: String| LoadError::Library {
            file: file.to_owned(),
            package,
            why,
        };
        let c = CString::new(file).map_err(|_| err("a NUL in the file name".into()))?;
        // SAFETY: `c` is a valid C string; RTLD_NOW resolves everything now
        // (a broken install fails here, not in the middle of an I/O).
        let ptr = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if ptr.is_null() {
            return Err(err(dl_error("dlopen failed")));
        }
        Ok(Handle {
            file: file.to_owned(),
            ptr,
        })
    }

    /// The address of `name` (NUL-terminated), non-null.
    fn symbol(&self, name: &'static str) -> Result<*mut c_void, LoadError> {
        let symbol = name.trim_end_matches('\0');
        // SAFETY: `ptr` is a live dlopen handle (never closed); `name` ends
        // with a NUL (the macro adds it).
        let p = unsafe { libc::dlsym(self.ptr, name.as_ptr().cast()) };
        if p.is_null() {
            return Err(LoadError::Symbol {
                file: self.file.clone(),
                symbol,
            });
        }
        Ok(p)
    }
}

/// Load the libraries by these file names (the test hook: a name that does
/// not exist shows the error a machine without Ceph gets).
pub fn load_named(
    rados: (&str, &'static str),
    rbd: (&str, &'static str),
) -> Result<Lib, LoadError> {
    let r = Handle::open(rados.0, rados.1)?;
    let b = Handle::open(rbd.0, rbd.1)?;
    Lib::resolve(&r, &b)
}

/// The libraries, loaded the first time an `rbd:` image is opened.
pub fn lib() -> Result<&'static Lib, LoadError> {
    static LIB: OnceLock<Result<Lib, LoadError>> = OnceLock::new();
    LIB.get_or_init(|| load_named(LIBRADOS, LIBRBD))
        .as_ref()
        .map_err(Clone::clone)
}

/// A Ceph error code (`-errno`) as an I/O error.
pub fn os_error(rc: c_int) -> std::io::Error {
    std::io::Error::from_raw_os_error(rc.saturating_neg())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named_with_its_package() {
        let e = load_named(("librados-nope.so.2", "librados2"), LIBRBD)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("cannot load librados-nope.so.2"), "{e}");
        assert!(e.contains("install the package librados2"), "{e}");
        let e = load_named(LIBRADOS, ("librbd-nope.so.1", "librbd1"))
            .unwrap_err()
            .to_string();
        // On a machine without Ceph librados is the one missing: named as well.
        let (file, package) = if e.contains(LIBRADOS.0) {
            LIBRADOS
        } else {
            ("librbd-nope.so.1", "librbd1")
        };
        assert!(e.starts_with(&format!("cannot load {file}")), "{e}");
        assert!(e.contains(&format!("install the package {package}")), "{e}");
    }
}
