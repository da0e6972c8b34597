//! The plain-syscall engine: runs a [`FileOp`] with `pread`/`pwrite`/`fallocate`
//! on the calling thread and returns what io_uring would (bytes or `-errno`).
//!
//! It is the fallback and the test oracle for the io_uring engine: the same
//! [`Task`] state machine driven by either must leave the same bytes.

use super::buffer::Pool;
use super::task::{FileOp, Kind, Next, Task};
use crate::block::Errno;
use std::os::fd::BorrowedFd;

fn errno_of(e: rustix::io::Errno) -> i32 {
    -e.raw_os_error()
}

/// A byte count as an io_uring-style result (ops never exceed `u32` lengths,
/// well under `i32::MAX` for every request loopd issues).
fn res_of(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Run one operation synchronously.
///
/// # Safety
/// `op` was yielded by a [`Task`] that is still alive, whose buffers nobody else
/// touches during the call, and whose device (its file descriptors) is open.
pub(crate) unsafe fn run_op(op: FileOp) -> i32 {
    match op.0 {
        Kind::Read { fd, buf, len, off } => {
            // SAFETY: by the caller's contract the task that yielded `op` owns `len`
            // bytes at `buf`, alive and untouched until we return.
            let slice = unsafe { std::slice::from_raw_parts_mut(buf, len as usize) };
            // SAFETY: fd is the device's open file, alive for the task's lifetime.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            match rustix::io::pread(fd, slice, off) {
                Ok(n) => res_of(n),
                Err(e) => errno_of(e),
            }
        }
        Kind::Write {
            fd,
            buf,
            len,
            off,
            dsync,
        } => {
            // SAFETY: as for Read; the buffer is only read.
            let slice = unsafe { std::slice::from_raw_parts(buf, len as usize) };
            // SAFETY: fd is the device's open file, alive for the task's lifetime.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let flags = if dsync {
                rustix::io::ReadWriteFlags::DSYNC
            } else {
                rustix::io::ReadWriteFlags::empty()
            };
            match rustix::io::pwritev2(fd, &[std::io::IoSlice::new(slice)], off, flags) {
                Ok(n) => res_of(n),
                Err(e) => errno_of(e),
            }
        }
        Kind::Fdatasync { fd } => {
            // SAFETY: fd is the device's open file, alive for the task's lifetime.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            rustix::fs::fdatasync(fd).map_or_else(errno_of, |()| 0)
        }
        Kind::Fallocate { fd, mode, off, len } => {
            // SAFETY: fd is the device's open file, alive for the task's lifetime.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let mode = rustix::fs::FallocateFlags::from_bits_retain(mode as u32);
            rustix::fs::fallocate(fd, mode, off, len).map_or_else(errno_of, |()| 0)
        }
        Kind::Statx { fd, buf } => {
            // SAFETY: fd is the device's open file; `buf` points at a
            // `libc::statx` in the task's edge buffer, alive and untouched
            // until we return (the caller's contract).
            let r = unsafe {
                libc::statx(
                    fd,
                    c"".as_ptr(),
                    libc::AT_EMPTY_PATH | libc::AT_STATX_FORCE_SYNC,
                    libc::STATX_SIZE,
                    buf,
                )
            };
            if r == 0 {
                0
            } else {
                -std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO)
            }
        }
        Kind::WillNeed { fd, off, len } => {
            // SAFETY: fd is the device's open file, alive for the task's lifetime.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let len = std::num::NonZeroU64::new(len);
            rustix::fs::fadvise(fd, off, len, rustix::fs::Advice::WillNeed)
                .map_or_else(errno_of, |()| 0)
        }
    }
}

/// Drive a started task to completion synchronously.
pub fn drive(task: &mut Task, pool: &mut Pool) -> Result<u32, Errno> {
    let mut next = task.start();
    loop {
        match next {
            Next::Done(r) => return r,
            Next::Submit(op) => {
                // SAFETY: `op` comes from `task`, which we hold borrowed (alive,
                // untouched by anyone else) until it has been completed below.
                let res = unsafe { run_op(op) };
                next = task.complete(res, pool);
            }
        }
    }
}
