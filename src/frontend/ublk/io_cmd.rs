//! SQEs for a queue's I/O commands on /dev/ublkcN (`IORING_OP_URING_CMD`).
//!
//! Building an SQE is safe; pushing it is not: the caller's ring must be created
//! with 128-byte SQEs, and in copy mode the tag's buffer ([`TagBuf::Copy`],
//! `max_io_buf_bytes` long) must stay allocated and untouched by the server
//! from the push until the command's CQE (see [`super::tags`]). With automatic
//! buffer registration ([`TagBuf::AutoReg`]) no memory of the server is named:
//! the kernel registers the request's pages in the pushing ring's fixed-buffer
//! table at that index before the CQE, and unregisters them at the commit.
//! `user_data` is the caller's keyspace.

use io_uring::{opcode, squeue, types};
use std::os::fd::RawFd;

use super::sys::{
    UBLK_AUTO_BUF_REG_FALLBACK, UBLK_U_IO_COMMIT_AND_FETCH_REQ, UBLK_U_IO_FETCH_REQ, UblksrvIoCmd,
    auto_buf_reg_sqe_addr,
};

/// Where a tag's request data lives while the server owns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagBuf {
    /// Copy mode: the tag's buffer in this process, at this address.
    Copy(u64),
    /// `UBLK_F_AUTO_BUF_REG`: registered by the kernel in the ring's
    /// fixed-buffer table at this index (with `UBLK_AUTO_BUF_REG_FALLBACK`).
    AutoReg(u16),
}

fn cmd_bytes(cmd: &UblksrvIoCmd) -> [u8; 80] {
    let mut b = [0u8; 80];
    b[0..2].copy_from_slice(&cmd.q_id.to_ne_bytes());
    b[2..4].copy_from_slice(&cmd.tag.to_ne_bytes());
    b[4..8].copy_from_slice(&cmd.result.to_ne_bytes());
    b[8..16].copy_from_slice(&cmd.addr.to_ne_bytes());
    b
}

fn io_cmd(
    char_fd: RawFd,
    op: u32,
    q_id: u16,
    tag: u16,
    result: i32,
    buf: TagBuf,
) -> squeue::Entry128 {
    let (addr, sqe_addr) = match buf {
        TagBuf::Copy(a) => (a, None),
        TagBuf::AutoReg(index) => (
            0,
            Some(auto_buf_reg_sqe_addr(index, UBLK_AUTO_BUF_REG_FALLBACK)),
        ),
    };
    let cmd = UblksrvIoCmd {
        q_id,
        tag,
        result,
        addr,
    };
    opcode::UringCmd80::new(types::Fd(char_fd), op)
        .cmd(cmd_bytes(&cmd))
        .addr(sqe_addr)
        .build()
}

/// `UBLK_U_IO_FETCH_REQ` for (`q_id`, `tag`) with the tag's buffer.
pub fn fetch(char_fd: RawFd, q_id: u16, tag: u16, buf: TagBuf) -> squeue::Entry128 {
    io_cmd(char_fd, UBLK_U_IO_FETCH_REQ, q_id, tag, 0, buf)
}

/// `UBLK_U_IO_COMMIT_AND_FETCH_REQ`: complete the tag's request with `result`
/// (bytes done, or `-errno`) and fetch the next one into the same buffer.
pub fn commit_and_fetch(
    char_fd: RawFd,
    q_id: u16,
    tag: u16,
    result: i32,
    buf: TagBuf,
) -> squeue::Entry128 {
    io_cmd(
        char_fd,
        UBLK_U_IO_COMMIT_AND_FETCH_REQ,
        q_id,
        tag,
        result,
        buf,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_reg_goes_in_the_sqe_addr_and_the_command_addr_is_zero() {
        let e = fetch(3, 1, 7, TagBuf::AutoReg(0x1234));
        // SAFETY: Entry128 is two plain-data halves (64-byte SQE + 64 bytes of
        // command); reading its bytes is reading initialised memory.
        let b: [u8; 128] = unsafe { std::mem::transmute(e) };
        let sqe_addr = u64::from_ne_bytes(b[16..24].try_into().unwrap());
        assert_eq!(
            sqe_addr,
            0x1234 | (u64::from(UBLK_AUTO_BUF_REG_FALLBACK) << 16)
        );
        // sqe->cmd starts at byte 48: q_id, tag, result, addr.
        assert_eq!(u16::from_ne_bytes([b[48], b[49]]), 1);
        assert_eq!(u16::from_ne_bytes([b[50], b[51]]), 7);
        assert_eq!(u64::from_ne_bytes(b[56..64].try_into().unwrap()), 0);
        let c = commit_and_fetch(3, 0, 2, 4096, TagBuf::Copy(0xdead_0000));
        // SAFETY: as above.
        let b: [u8; 128] = unsafe { std::mem::transmute(c) };
        assert_eq!(u64::from_ne_bytes(b[16..24].try_into().unwrap()), 0);
        assert_eq!(
            u64::from_ne_bytes(b[56..64].try_into().unwrap()),
            0xdead_0000
        );
    }
}
