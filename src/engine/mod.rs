//! The engine: the request state machine ([`task`]) over owned buffers, the
//! execution step every frontend shares ([`exec`]: range lock, inline
//! page-cache paths), a task's operations on their way to the device's backend
//! ([`ops`]: an io_uring entry, or posted to a threaded backend; see
//! [`crate::backing`] for the seam), the synchronous engine used as fallback
//! and test oracle ([`sync`]), and the shared resources of the data path:
//! buffers and the daemon-wide memory budget, the connection admission limit,
//! splice pipes and the offload workers for calls io_uring has no opcode for.
//!
//! The engine never imports a frontend, the reactor, the daemon or the control
//! plane.

pub mod admit;
pub mod budget;
pub mod buffer;
pub mod clip;
pub mod exec;
pub mod offload;
pub mod ops;
pub mod splice;
pub mod sync;
pub mod task;
