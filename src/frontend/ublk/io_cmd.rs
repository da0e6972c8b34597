//! SQEs for a queue's I/O commands on /dev/ublkcN (`IORING_OP_URING_CMD`).
//!
//! Building an SQE is safe; pushing it is not: the caller's ring must be created
//! with 128-byte SQEs, and the tag's buffer at `buf_addr` (`max_io_buf_bytes`
//! long) must stay allocated and untouched by the server from the push until
//! the command's CQE (see [`super::tags`]). `user_data` is the caller's keyspace.

use io_uring::{opcode, squeue, types};
use std::os::fd::RawFd;

use super::sys::{UBLK_U_IO_COMMIT_AND_FETCH_REQ, UBLK_U_IO_FETCH_REQ, UblksrvIoCmd};

fn cmd_bytes(cmd: &UblksrvIoCmd) -> [u8; 80] {
    let mut b = [0u8; 80];
    b[0..2].copy_from_slice(&cmd.q_id.to_ne_bytes());
    b[2..4].copy_from_slice(&cmd.tag.to_ne_bytes());
    b[4..8].copy_from_slice(&cmd.result.to_ne_bytes());
    b[8..16].copy_from_slice(&cmd.addr.to_ne_bytes());
    b
}

/// `UBLK_U_IO_FETCH_REQ` for (`q_id`, `tag`) with the tag's buffer.
pub fn fetch(char_fd: RawFd, q_id: u16, tag: u16, buf_addr: u64) -> squeue::Entry128 {
    let cmd = UblksrvIoCmd {
        q_id,
        tag,
        result: 0,
        addr: buf_addr,
    };
    opcode::UringCmd80::new(types::Fd(char_fd), UBLK_U_IO_FETCH_REQ)
        .cmd(cmd_bytes(&cmd))
        .build()
}

/// `UBLK_U_IO_COMMIT_AND_FETCH_REQ`: complete the tag's request with `result`
/// (bytes done, or `-errno`) and fetch the next one into the same buffer.
pub fn commit_and_fetch(
    char_fd: RawFd,
    q_id: u16,
    tag: u16,
    result: i32,
    buf_addr: u64,
) -> squeue::Entry128 {
    let cmd = UblksrvIoCmd {
        q_id,
        tag,
        result,
        addr: buf_addr,
    };
    opcode::UringCmd80::new(types::Fd(char_fd), UBLK_U_IO_COMMIT_AND_FETCH_REQ)
        .cmd(cmd_bytes(&cmd))
        .build()
}
