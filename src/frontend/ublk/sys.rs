//! The ublk UAPI (`include/uapi/linux/ublk_cmd.h`) as of Linux 6.12, by hand.
//!
//! Plain `#[repr(C)]` structs and constants; nothing here does I/O. Every struct
//! has a size/offset assertion against the C layout, so a typo fails the build.
//! Names follow the header (lower-case struct names become CamelCase).
//!
//! What 6.12 has and later kernels added (so callers can probe with
//! `GET_FEATURES` instead of guessing): `UBLK_F_USER_RECOVERY_FAIL_IO` (bit 9)
//! is 6.13; `UBLK_F_UPDATE_SIZE` / `UBLK_U_CMD_UPDATE_SIZE` is 6.14;
//! `UBLK_U_CMD_QUIESCE_DEV`, the DMA-align and segment parameter types are
//! 6.15+; `UBLK_F_AUTO_BUF_REG`, `UBLK_F_QUIESCE`, `UBLK_F_PER_IO_DAEMON` are
//! 6.16+; batch I/O, safe stop and `UBLK_F_NO_AUTO_PART_SCAN` are 7.0. They are
//! defined here because the opcodes and bits are fixed numbers, but a 6.12
//! kernel rejects them (`EOPNOTSUPP`/`EINVAL`) and does not list them in
//! GET_FEATURES.

// ---- ioctl encoding (asm-generic/ioctl.h) ----

const IOC_NRBITS: u32 = 8;
const IOC_TYPEBITS: u32 = 8;
const IOC_SIZEBITS: u32 = 14;
const IOC_NRSHIFT: u32 = 0;
const IOC_TYPESHIFT: u32 = IOC_NRSHIFT + IOC_NRBITS;
const IOC_SIZESHIFT: u32 = IOC_TYPESHIFT + IOC_TYPEBITS;
const IOC_DIRSHIFT: u32 = IOC_SIZESHIFT + IOC_SIZEBITS;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

const fn ioc(dir: u32, ty: u8, nr: u8, size: usize) -> u32 {
    assert!(size < (1 << IOC_SIZEBITS));
    #[allow(clippy::cast_possible_truncation)] // checked by the assert above
    let size = size as u32;
    (dir << IOC_DIRSHIFT)
        | ((ty as u32) << IOC_TYPESHIFT)
        | ((nr as u32) << IOC_NRSHIFT)
        | (size << IOC_SIZESHIFT)
}
const fn ior(nr: u8, size: usize) -> u32 {
    ioc(IOC_READ, b'u', nr, size)
}
const fn iowr(nr: u8, size: usize) -> u32 {
    ioc(IOC_READ | IOC_WRITE, b'u', nr, size)
}

// ---- control commands (sent to /dev/ublk-control) ----

pub const UBLK_CMD_GET_QUEUE_AFFINITY: u8 = 0x01;
pub const UBLK_CMD_GET_DEV_INFO: u8 = 0x02;
pub const UBLK_CMD_ADD_DEV: u8 = 0x04;
pub const UBLK_CMD_DEL_DEV: u8 = 0x05;
pub const UBLK_CMD_START_DEV: u8 = 0x06;
pub const UBLK_CMD_STOP_DEV: u8 = 0x07;
pub const UBLK_CMD_SET_PARAMS: u8 = 0x08;
pub const UBLK_CMD_GET_PARAMS: u8 = 0x09;
pub const UBLK_CMD_START_USER_RECOVERY: u8 = 0x10;
pub const UBLK_CMD_END_USER_RECOVERY: u8 = 0x11;
pub const UBLK_CMD_GET_DEV_INFO2: u8 = 0x12;

const CTRL: usize = size_of::<UblksrvCtrlCmd>();
pub const UBLK_U_CMD_GET_QUEUE_AFFINITY: u32 = ior(UBLK_CMD_GET_QUEUE_AFFINITY, CTRL);
pub const UBLK_U_CMD_GET_DEV_INFO: u32 = ior(UBLK_CMD_GET_DEV_INFO, CTRL);
pub const UBLK_U_CMD_ADD_DEV: u32 = iowr(UBLK_CMD_ADD_DEV, CTRL);
pub const UBLK_U_CMD_DEL_DEV: u32 = iowr(UBLK_CMD_DEL_DEV, CTRL);
pub const UBLK_U_CMD_START_DEV: u32 = iowr(UBLK_CMD_START_DEV, CTRL);
pub const UBLK_U_CMD_STOP_DEV: u32 = iowr(UBLK_CMD_STOP_DEV, CTRL);
pub const UBLK_U_CMD_SET_PARAMS: u32 = iowr(UBLK_CMD_SET_PARAMS, CTRL);
pub const UBLK_U_CMD_GET_PARAMS: u32 = ior(UBLK_CMD_GET_PARAMS, CTRL);
pub const UBLK_U_CMD_START_USER_RECOVERY: u32 = iowr(UBLK_CMD_START_USER_RECOVERY, CTRL);
pub const UBLK_U_CMD_END_USER_RECOVERY: u32 = iowr(UBLK_CMD_END_USER_RECOVERY, CTRL);
pub const UBLK_U_CMD_GET_DEV_INFO2: u32 = ior(UBLK_CMD_GET_DEV_INFO2, CTRL);
/// Since 6.5: `data[0]`-sized u64 bitmask of the `UBLK_F_*` the driver knows.
pub const UBLK_U_CMD_GET_FEATURES: u32 = ior(0x13, CTRL);
/// Since 6.7: DEL_DEV without waiting for the char device to be released.
pub const UBLK_U_CMD_DEL_DEV_ASYNC: u32 = ior(0x14, CTRL);
/// Since 6.14 (with `UBLK_F_UPDATE_SIZE`): new size in sectors in `data[0]`.
pub const UBLK_U_CMD_UPDATE_SIZE: u32 = iowr(0x15, CTRL);
/// Since 6.15 (with `UBLK_F_QUIESCE`).
pub const UBLK_U_CMD_QUIESCE_DEV: u32 = iowr(0x16, CTRL);
/// Since 7.0 (with `UBLK_F_SAFE_STOP_DEV`): STOP_DEV only while nobody has
/// /dev/ublkbN open (`EBUSY` otherwise).
pub const UBLK_U_CMD_TRY_STOP_DEV: u32 = iowr(0x17, CTRL);

/// Length of the GET_FEATURES reply.
pub const UBLK_FEATURES_LEN: usize = 8;

// ---- I/O commands (sent to /dev/ublkcN, one per tag) ----

pub const UBLK_IO_FETCH_REQ: u8 = 0x20;
pub const UBLK_IO_COMMIT_AND_FETCH_REQ: u8 = 0x21;
pub const UBLK_IO_NEED_GET_DATA: u8 = 0x22;

const IOCMD: usize = size_of::<UblksrvIoCmd>();
pub const UBLK_U_IO_FETCH_REQ: u32 = iowr(UBLK_IO_FETCH_REQ, IOCMD);
pub const UBLK_U_IO_COMMIT_AND_FETCH_REQ: u32 = iowr(UBLK_IO_COMMIT_AND_FETCH_REQ, IOCMD);
pub const UBLK_U_IO_NEED_GET_DATA: u32 = iowr(UBLK_IO_NEED_GET_DATA, IOCMD);

/// CQE result of an I/O command: a request is ready in the tag's descriptor.
pub const UBLK_IO_RES_OK: i32 = 0;
/// CQE result with `UBLK_F_NEED_GET_DATA`: issue NEED_GET_DATA for the write's data.
pub const UBLK_IO_RES_NEED_GET_DATA: i32 = 1;
/// CQE result when the device is stopping (or the queue dying): do not re-fetch.
pub const UBLK_IO_RES_ABORT: i32 = -libc::ENODEV;

/// mmap offset of queue 0's descriptor array on /dev/ublkcN.
pub const UBLKSRV_CMD_BUF_OFFSET: u64 = 0;
pub const UBLKSRV_IO_BUF_OFFSET: u64 = 0x8000_0000;
pub const UBLK_MAX_QUEUE_DEPTH: u16 = 4096;
/// 6.12 caps `nr_hw_queues` at this (and at the number of possible CPUs).
pub const UBLK_MAX_NR_QUEUES: u16 = 4096;

// ---- device flags (ublksrv_ctrl_dev_info.flags) ----

pub const UBLK_F_SUPPORT_ZERO_COPY: u64 = 1 << 0;
pub const UBLK_F_URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
pub const UBLK_F_NEED_GET_DATA: u64 = 1 << 2;
/// The device survives its server: I/O is queued until a new server recovers it.
pub const UBLK_F_USER_RECOVERY: u64 = 1 << 3;
/// With USER_RECOVERY: requests in flight when the server died are re-issued.
pub const UBLK_F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
pub const UBLK_F_UNPRIVILEGED_DEV: u64 = 1 << 5;
/// I/O and control opcodes are ioctl-encoded (`UBLK_U_*`).
pub const UBLK_F_CMD_IOCTL_ENCODE: u64 = 1 << 6;
pub const UBLK_F_USER_COPY: u64 = 1 << 7;
pub const UBLK_F_ZONED: u64 = 1 << 8;
/// 6.13+.
pub const UBLK_F_USER_RECOVERY_FAIL_IO: u64 = 1 << 9;
/// 6.14+.
pub const UBLK_F_UPDATE_SIZE: u64 = 1 << 10;
/// 6.16+: each request's pages are registered in the fetching ring's
/// fixed-buffer table (zero copy for the server's own io_uring file I/O).
pub const UBLK_F_AUTO_BUF_REG: u64 = 1 << 11;
/// 6.16+: `UBLK_U_CMD_QUIESCE_DEV`.
pub const UBLK_F_QUIESCE: u64 = 1 << 12;
/// 6.16+: any task may serve any tag.
pub const UBLK_F_PER_IO_DAEMON: u64 = 1 << 13;
/// 6.16+: buffer registration from a task other than the tag's daemon.
pub const UBLK_F_BUF_REG_OFF_DAEMON: u64 = 1 << 14;
/// 7.0+: batched fetch/commit commands.
pub const UBLK_F_BATCH_IO: u64 = 1 << 15;
/// 6.19+: integrity (metadata) buffers.
pub const UBLK_F_INTEGRITY: u64 = 1 << 16;
/// 7.0+: `TRY_STOP_DEV` (stop only without openers).
pub const UBLK_F_SAFE_STOP_DEV: u64 = 1 << 17;
/// 7.0+: no partition scan at START_DEV.
pub const UBLK_F_NO_AUTO_PART_SCAN: u64 = 1 << 18;

/// The names loopd reports for the `UBLK_F_*` bits it knows (lower-case, the
/// header's name without `UBLK_F_`), in bit order.
pub const FEATURE_NAMES: [(u64, &str); 19] = [
    (UBLK_F_SUPPORT_ZERO_COPY, "support_zero_copy"),
    (UBLK_F_URING_CMD_COMP_IN_TASK, "uring_cmd_comp_in_task"),
    (UBLK_F_NEED_GET_DATA, "need_get_data"),
    (UBLK_F_USER_RECOVERY, "user_recovery"),
    (UBLK_F_USER_RECOVERY_REISSUE, "user_recovery_reissue"),
    (UBLK_F_UNPRIVILEGED_DEV, "unprivileged_dev"),
    (UBLK_F_CMD_IOCTL_ENCODE, "cmd_ioctl_encode"),
    (UBLK_F_USER_COPY, "user_copy"),
    (UBLK_F_ZONED, "zoned"),
    (UBLK_F_USER_RECOVERY_FAIL_IO, "user_recovery_fail_io"),
    (UBLK_F_UPDATE_SIZE, "update_size"),
    (UBLK_F_AUTO_BUF_REG, "auto_buf_reg"),
    (UBLK_F_QUIESCE, "quiesce"),
    (UBLK_F_PER_IO_DAEMON, "per_io_daemon"),
    (UBLK_F_BUF_REG_OFF_DAEMON, "buf_reg_off_daemon"),
    (UBLK_F_BATCH_IO, "batch_io"),
    (UBLK_F_INTEGRITY, "integrity"),
    (UBLK_F_SAFE_STOP_DEV, "safe_stop_dev"),
    (UBLK_F_NO_AUTO_PART_SCAN, "no_auto_part_scan"),
];

/// The names of the bits of `features` loopd knows, in bit order; an unknown
/// bit N as `bitN`.
pub fn feature_names(features: u64) -> Vec<String> {
    (0..64)
        .map(|b| 1u64 << b)
        .filter(|bit| features & bit != 0)
        .map(|bit| {
            FEATURE_NAMES.iter().find(|(f, _)| *f == bit).map_or_else(
                || format!("bit{}", bit.trailing_zeros()),
                |(_, n)| (*n).to_owned(),
            )
        })
        .collect()
}

// ---- device state (ublksrv_ctrl_dev_info.state) ----

pub const UBLK_S_DEV_DEAD: u16 = 0;
pub const UBLK_S_DEV_LIVE: u16 = 1;
pub const UBLK_S_DEV_QUIESCED: u16 = 2;
/// 6.13+.
pub const UBLK_S_DEV_FAIL_IO: u16 = 3;

// ---- request ops and flags (ublksrv_io_desc.op_flags) ----

pub const UBLK_IO_OP_READ: u8 = 0;
pub const UBLK_IO_OP_WRITE: u8 = 1;
pub const UBLK_IO_OP_FLUSH: u8 = 2;
pub const UBLK_IO_OP_DISCARD: u8 = 3;
pub const UBLK_IO_OP_WRITE_SAME: u8 = 4;
pub const UBLK_IO_OP_WRITE_ZEROES: u8 = 5;
pub const UBLK_IO_OP_ZONE_OPEN: u8 = 10;
pub const UBLK_IO_OP_ZONE_CLOSE: u8 = 11;
pub const UBLK_IO_OP_ZONE_FINISH: u8 = 12;
pub const UBLK_IO_OP_ZONE_APPEND: u8 = 13;
pub const UBLK_IO_OP_ZONE_RESET_ALL: u8 = 14;
pub const UBLK_IO_OP_ZONE_RESET: u8 = 15;
pub const UBLK_IO_OP_REPORT_ZONES: u8 = 18;

pub const UBLK_IO_F_FAILFAST_DEV: u32 = 1 << 8;
pub const UBLK_IO_F_FAILFAST_TRANSPORT: u32 = 1 << 9;
pub const UBLK_IO_F_FAILFAST_DRIVER: u32 = 1 << 10;
pub const UBLK_IO_F_META: u32 = 1 << 11;
pub const UBLK_IO_F_FUA: u32 = 1 << 13;
pub const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;
pub const UBLK_IO_F_SWAP: u32 = 1 << 16;
/// 6.16+, with `UBLK_F_AUTO_BUF_REG` and `UBLK_AUTO_BUF_REG_FALLBACK`: the
/// automatic registration of this request's buffer failed; the server must
/// register it itself or fail the request.
pub const UBLK_IO_F_NEED_REG_BUF: u32 = 1 << 17;

// ---- automatic buffer registration (6.16+, `UBLK_F_AUTO_BUF_REG`) ----

/// `ublk_auto_buf_reg.flags`: a failed registration completes the fetch
/// normally with `UBLK_IO_F_NEED_REG_BUF` in the descriptor, instead of
/// failing the request.
pub const UBLK_AUTO_BUF_REG_FALLBACK: u8 = 1 << 0;

/// `struct ublk_auto_buf_reg` as the driver reads it from the FETCH /
/// COMMIT_AND_FETCH SQE's own `addr` field (`sqe->addr`, not the command's
/// `ublksrv_io_cmd.addr`): `index` in bits 0-15, `flags` in bits 16-23, the
/// reserved bits 24-63 zero (`ublk_auto_buf_reg_to_sqe_addr` in the header).
pub const fn auto_buf_reg_sqe_addr(index: u16, flags: u8) -> u64 {
    (index as u64) | ((flags as u64) << 16)
}

// ---- parameter attributes and types ----

pub const UBLK_ATTR_READ_ONLY: u32 = 1 << 0;
pub const UBLK_ATTR_ROTATIONAL: u32 = 1 << 1;
pub const UBLK_ATTR_VOLATILE_CACHE: u32 = 1 << 2;
pub const UBLK_ATTR_FUA: u32 = 1 << 3;

pub const UBLK_PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const UBLK_PARAM_TYPE_DISCARD: u32 = 1 << 1;
/// Read-only (GET_PARAMS): char and disk major/minor.
pub const UBLK_PARAM_TYPE_DEVT: u32 = 1 << 2;
pub const UBLK_PARAM_TYPE_ZONED: u32 = 1 << 3;

/// `sqe->cmd` of every control command.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblksrvCtrlCmd {
    /// Target device; `u32::MAX` on ADD_DEV means "pick one".
    pub dev_id: u32,
    /// `u16::MAX` unless the command is for one queue.
    pub queue_id: u16,
    /// Length of the buffer at `addr`.
    pub len: u16,
    pub addr: u64,
    pub data: [u64; 1],
    /// For unprivileged devices and GET_DEV_INFO2 only.
    pub dev_path_len: u16,
    pub pad: u16,
    pub reserved: u32,
}

/// ADD_DEV's in/out buffer and GET_DEV_INFO's reply.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblksrvCtrlDevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub pad0: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub pad1: u32,
    pub flags: u64,
    /// The server's own; the driver stores it and hands it back.
    pub ublksrv_flags: u64,
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub reserved1: u64,
    pub reserved2: u64,
}

/// One request, written by the driver into the queue's shared descriptor array.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblksrvIoDesc {
    /// op in bits 0-7, `UBLK_IO_F_*` flags above.
    pub op_flags: u32,
    /// Sectors (or zones for REPORT_ZONES).
    pub nr_sectors: u32,
    pub start_sector: u64,
    /// The buffer address the server gave in FETCH/COMMIT.
    pub addr: u64,
}

impl UblksrvIoDesc {
    pub fn op(&self) -> u8 {
        self.op_flags.to_le_bytes()[0]
    }
    /// The `UBLK_IO_F_*` bits, in place (not shifted).
    pub fn flags(&self) -> u32 {
        self.op_flags & !0xff
    }
}

/// `sqe->cmd` of every I/O command.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblksrvIoCmd {
    pub q_id: u16,
    pub tag: u16,
    /// COMMIT only: bytes done (≥ 0) or a negative errno.
    pub result: i32,
    /// The tag's buffer in this process (copy mode); ZONE_APPEND's LBA otherwise.
    pub addr: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamBasic {
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamDiscard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamDevt {
    pub char_major: u32,
    pub char_minor: u32,
    pub disk_major: u32,
    pub disk_minor: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamZoned {
    pub max_open_zones: u32,
    pub max_active_zones: u32,
    pub max_zone_append_sectors: u32,
    pub reserved: [u8; 20],
}

/// SET_PARAMS / GET_PARAMS buffer (6.12 layout: basic, discard, devt, zoned).
/// `len` must be set on both; the driver copies `min(len, its size)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParams {
    pub len: u32,
    pub types: u32,
    pub basic: UblkParamBasic,
    pub discard: UblkParamDiscard,
    pub devt: UblkParamDevt,
    pub zoned: UblkParamZoned,
}

/// Bytes of one queue's descriptor array, as the driver sizes the mapping.
pub fn queue_desc_bytes(depth: u16, page_size: usize) -> usize {
    (usize::from(depth) * size_of::<UblksrvIoDesc>()).next_multiple_of(page_size)
}

/// mmap offset of queue `q_id`'s descriptor array: the driver strides by the
/// largest possible array, `UBLK_MAX_QUEUE_DEPTH` descriptors rounded to a page.
pub fn queue_desc_offset(q_id: u16, page_size: usize) -> u64 {
    let stride = queue_desc_bytes(UBLK_MAX_QUEUE_DEPTH, page_size) as u64;
    UBLKSRV_CMD_BUF_OFFSET + u64::from(q_id) * stride
}

const _: () = {
    use std::mem::offset_of;
    assert!(size_of::<UblksrvCtrlCmd>() == 32);
    assert!(offset_of!(UblksrvCtrlCmd, addr) == 8);
    assert!(offset_of!(UblksrvCtrlCmd, data) == 16);
    assert!(offset_of!(UblksrvCtrlCmd, dev_path_len) == 24);
    assert!(size_of::<UblksrvCtrlDevInfo>() == 64);
    assert!(offset_of!(UblksrvCtrlDevInfo, max_io_buf_bytes) == 8);
    assert!(offset_of!(UblksrvCtrlDevInfo, ublksrv_pid) == 16);
    assert!(offset_of!(UblksrvCtrlDevInfo, flags) == 24);
    assert!(offset_of!(UblksrvCtrlDevInfo, owner_uid) == 40);
    assert!(size_of::<UblksrvIoDesc>() == 24);
    assert!(offset_of!(UblksrvIoDesc, start_sector) == 8);
    assert!(offset_of!(UblksrvIoDesc, addr) == 16);
    assert!(size_of::<UblksrvIoCmd>() == 16);
    assert!(offset_of!(UblksrvIoCmd, result) == 4);
    assert!(offset_of!(UblksrvIoCmd, addr) == 8);
    assert!(size_of::<UblkParamBasic>() == 32);
    assert!(offset_of!(UblkParamBasic, max_sectors) == 8);
    assert!(offset_of!(UblkParamBasic, dev_sectors) == 16);
    assert!(size_of::<UblkParamDiscard>() == 20);
    assert!(size_of::<UblkParamDevt>() == 16);
    assert!(size_of::<UblkParamZoned>() == 32);
    assert!(offset_of!(UblkParams, basic) == 8);
    assert!(offset_of!(UblkParams, discard) == 40);
    assert!(offset_of!(UblkParams, devt) == 60);
    assert!(offset_of!(UblkParams, zoned) == 76);
    assert!(size_of::<UblkParams>() == 112);
    // The values the C macros produce (checked against the 6.12 header).
    assert!(UBLK_U_CMD_ADD_DEV == 0xc020_7504);
    assert!(UBLK_U_CMD_GET_DEV_INFO == 0x8020_7502);
    assert!(UBLK_U_IO_FETCH_REQ == 0xc010_7520);
    assert!(UBLK_U_IO_COMMIT_AND_FETCH_REQ == 0xc010_7521);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feature_names_in_bit_order_unknown_bits_by_number() {
        assert_eq!(feature_names(0), Vec::<String>::new());
        assert_eq!(
            feature_names(UBLK_F_AUTO_BUF_REG | UBLK_F_USER_RECOVERY | (1 << 40)),
            ["user_recovery", "auto_buf_reg", "bit40"]
        );
        for (i, (bit, _)) in FEATURE_NAMES.iter().enumerate() {
            assert_eq!(*bit, 1 << i, "FEATURE_NAMES[{i}]");
        }
    }

    #[test]
    fn queue_offsets_stride_by_the_largest_array() {
        // 4096 descriptors * 24 bytes = 96 KiB, already page-aligned.
        assert_eq!(queue_desc_offset(0, 4096), 0);
        assert_eq!(queue_desc_offset(1, 4096), 98_304);
        assert_eq!(queue_desc_bytes(128, 4096), 4096);
        assert_eq!(queue_desc_bytes(171, 4096), 8192);
    }

    #[test]
    fn op_and_flags_split_like_the_c_helpers() {
        let d = UblksrvIoDesc {
            op_flags: u32::from(UBLK_IO_OP_WRITE) | UBLK_IO_F_FUA,
            ..Default::default()
        };
        assert_eq!(d.op(), UBLK_IO_OP_WRITE);
        assert_eq!(d.flags(), UBLK_IO_F_FUA);
    }
}
