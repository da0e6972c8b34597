//! Translation of a [`FileOp`] into an io_uring submission entry.

use super::task::FileOp;
use io_uring::{opcode, squeue, types};

/// Build the SQE for `op` (the caller tags it with its `user_data`).
pub fn sqe(op: FileOp) -> squeue::Entry {
    match op {
        FileOp::Read { fd, buf, len, off } => opcode::Read::new(types::Fd(fd), buf, len)
            .offset(off)
            .build(),
        FileOp::Write {
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
        FileOp::Fdatasync { fd } => opcode::Fsync::new(types::Fd(fd))
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
        FileOp::Fallocate { fd, mode, off, len } => opcode::Fallocate::new(types::Fd(fd), len)
            .offset(off)
            .mode(mode)
            .build(),
        FileOp::WillNeed { fd, off, len } => {
            opcode::Fadvise::new(types::Fd(fd), len_i64(len), libc::POSIX_FADV_WILLNEED)
                .offset(off)
                .build()
        }
    }
}

fn len_i64(len: u64) -> libc::off_t {
    libc::off_t::try_from(len).unwrap_or(libc::off_t::MAX)
}
