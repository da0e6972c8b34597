//! A device: a window of a backing file, with a logical block size, a cache mode and
//! a read-only bit, plus the range lock and counters its requests share.
//!
//! Ownership: a `Device` is created complete by [`Device::open`] (file opened,
//! alignment probed, sizes checked) and only then shared (`Arc<Device>`) with the
//! reactors, so nothing ever sees a half-configured device. Its fields are
//! immutable after open except the atomics (`file_size`, stats) and the range lock.
//!
//! Opening also guards the image (see [`crate::backing`]): the device takes the
//! QEMU-compatible image lock for its export name (held until the `Device` is
//! dropped, i.e. until the last connection lets go of it) and refuses an image
//! that probes as a container format (qcow2, vmdk, ...) unless the user declared
//! `format: raw`. An image this open creates is raw by construction, and a
//! reconfiguration of a live export (`set`, `resize`: the same name already holds
//! the image) is not probed again: a guest may have written anything at byte 0
//! since the image was checked.
//!
//! Which file: every descriptor of a device is opened through its
//! [`Pinned`] image file (see [`crate::backing::identity`]), found by path
//! only by the first open ([`Opening::First`]) or, for a recorded device, only
//! if the path still names the recorded file ([`Opening::Recorded`]); a
//! reconfiguration reuses the device's own ([`Opening::Same`]) and never looks
//! at the path.
//!
//! An image named `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]` is on a Ceph cluster
//! instead ([`rbd`], [`crate::backing::rbd`]): no file, no identity, no
//! image lock or format probe; librbd's exclusive lock keeps other writers
//! out.

pub mod export;
pub mod live;
pub mod params;
pub mod range_lock;
pub mod rbd;
pub mod spec;
pub mod stats;
pub mod status;

pub use live::Device;
pub use params::{CacheMode, DeviceError, DeviceParams, Opening};
