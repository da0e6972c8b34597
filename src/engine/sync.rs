//! The synchronous engine: runs a task's operations on the calling thread
//! through its device's backend ([`crate::backing::Backend::run`]: `pread`,
//! `pwrite`, `fallocate` for a file) and feeds back what io_uring would
//! return (bytes or `-errno`).
//!
//! It is the fallback and the test oracle for the ring: the same [`Task`]
//! state machine driven by either must leave the same bytes.

use super::buffer::Pool;
use super::task::{Next, Task};
use crate::block::Errno;
use crate::device::Device;

/// Drive a planned task to completion synchronously against `dev`'s backend.
///
/// Safe: the operations a task yields name only the task's own buffers, for
/// lengths inside them, and the task stays borrowed here until each has run.
pub fn drive(dev: &Device, task: &mut Task, pool: &mut Pool) -> Result<u32, Errno> {
    let mut next = task.start();
    loop {
        match next {
            Next::Done(r) => return r,
            Next::Submit(op) => {
                // SAFETY: `op` comes from `task`, which we hold borrowed (alive,
                // untouched by anyone else) until it has been completed below.
                let res = unsafe { dev.backend().run(op.0) };
                next = task.complete(res, pool);
            }
        }
    }
}
