//! A [`FileOp`] on its way to a backend: as an io_uring entry for a
//! ring-native backend, or posted to a threaded one (see [`crate::backing`]).
//! The reactor's ring (`Io::submit_file` in the ring module) is the one caller on
//! the data path.

use super::task::FileOp;
use crate::backing::{Backend, Completions};
use io_uring::squeue;
use std::sync::Arc;

/// The entry that runs `op` on `backend`, if it runs on the ring (the caller
/// tags it with its `user_data`); `None`: [`post`] it. Building is safe;
/// pushing it is not: the caller keeps the task that yielded `op` alive and
/// its buffers untouched until the completion.
#[inline]
pub fn sqe(backend: &Backend, op: FileOp) -> Option<squeue::Entry> {
    backend.sqe(op.0)
}

/// Hand `op` to `backend`'s own threads; its result arrives in `done`.
///
/// # Safety
/// The task that yielded `op` stays alive, its buffers untouched, until the
/// result has been taken from `done`.
pub unsafe fn post(backend: &Backend, op: FileOp, user_data: u64, done: &Arc<Completions>) {
    // SAFETY: by this function's contract.
    unsafe { backend.post(op.0, user_data, done) }
}
