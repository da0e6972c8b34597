//! The RBD backend: images on a Ceph cluster, served through librbd.
//!
//! - [`error`]: what opening an image can fail on;
//! - [`spec`]: the pure parser of `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]`;
//! - [`ffi`]: our binding of librados' and librbd's C API, loaded at run time
//!   (a machine without Ceph runs everything else; `rbd:` there fails naming
//!   the library and its package);
//! - [`cluster`]: one connection per configuration, id, cache mode and
//!   timeout, shared by the images opened through it, with RADOS timeouts set
//!   so that nothing waits for ever on a stalled cluster;
//! - [`lock`]: an image's exclusive lock: its owners, and taking it back
//!   from this daemon's own dead previous run;
//! - [`image`]: an open image as a [`crate::backing::Storage`] whose
//!   operations complete on librbd's threads into the reactor's
//!   `Completions`;
//! - [`watch`]: librbd's update watch, by which an open image hears that its
//!   header changed (an `rbd resize` anywhere) and tells a listener above.
//!
//! Threads: [`open`] blocks (connecting, opening, taking the lock: cluster
//! round trips bounded by the timeout) and runs on the thread of the
//! device's open — a control thread, never a reactor. I/O never blocks a
//! reactor: it is posted to librbd.

pub mod cluster;
pub mod error;
pub mod ffi;
pub mod image;
pub mod lock;
pub mod spec;
pub mod watch;

pub use cluster::{Cluster, Options, RbdCache};
pub use error::{ErrorClass, RbdError};
pub use image::{OpenParams, RbdImage};
pub use spec::{RbdSpec, SpecError};
pub use watch::Notify;

use std::sync::Arc;

/// Open the image `spec` names through the cluster `opts` describes
/// (connecting if no other image has). A shared connection the cluster turns
/// out to have fenced (blocklisted) is marked so and the open made once more
/// on a new one. Blocks; never call it on a reactor.
pub fn open(spec: &RbdSpec, opts: &Options, p: &OpenParams) -> Result<Arc<RbdImage>, RbdError> {
    let cluster = Cluster::get(opts)?;
    match RbdImage::open(Arc::clone(&cluster), spec, p) {
        Err(e) if e.fenced() => {
            cluster.set_fenced();
            drop(cluster);
            Ok(Arc::new(RbdImage::open(Cluster::get(opts)?, spec, p)?))
        }
        r => Ok(Arc::new(r?)),
    }
}
