//! The data path: reactors (one io_uring each) that run connections' requests
//! against backing files, plus the plain-syscall engine used as fallback and
//! test oracle, and the direct-I/O alignment probe.

pub mod admit;
pub mod affinity;
pub mod align;
pub mod buffer;
pub mod conn;
pub mod ops;
pub mod poll;
pub mod reactor;
pub mod splice;
pub mod sync;
pub mod task;
