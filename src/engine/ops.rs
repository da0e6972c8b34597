//! Translation of a [`FileOp`] into an io_uring submission entry.

use super::task::{FileOp, Kind};
use io_uring::{opcode, squeue, types};

/// Build the SQE for `op` (the caller tags it with its `user_data`). Building
/// is safe; submitting it is not: the caller keeps the task that yielded `op`
/// alive and its buffers untouched until the completion.
pub fn sqe(op: FileOp) -> squeue::Entry {
    match op.0 {
        Kind::Read { fd, buf, len, off } => opcode::Read::new(types::Fd(fd), buf, len)
            .offset(off)
            .build(),
        Kind::Write {
            fd,
            buf,
            len,
            off,
            dsync,
        } => {
            let flags = if dsync { libc::RWF_DSYNC } else { 0 };
            opcode::Write::new(types::Fd(fd), buf, len)
                .offset(off)
                .rw_flags(flags)
                .build()
        }
        Kind::Fdatasync { fd } => opcode::Fsync::new(types::Fd(fd))
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
        Kind::Fallocate { fd, mode, off, len } => opcode::Fallocate::new(types::Fd(fd), len)
            .offset(off)
            .mode(mode)
            .build(),
        Kind::Statx { fd, buf } => opcode::Statx::new(types::Fd(fd), c"".as_ptr(), buf.cast())
            .flags(libc::AT_EMPTY_PATH | libc::AT_STATX_FORCE_SYNC)
            .mask(libc::STATX_SIZE)
            .build(),
        Kind::WillNeed { fd, off, len } => {
            opcode::Fadvise::new(types::Fd(fd), len_i64(len), libc::POSIX_FADV_WILLNEED)
                .offset(off)
                .build()
        }
    }
}

fn len_i64(len: u64) -> libc::off_t {
    libc::off_t::try_from(len).unwrap_or(libc::off_t::MAX)
}
