//! Zero-copy reads and writes: the request's data lives in a buffer the
//! kernel registered in the reactor ring's fixed-buffer table (a ublk request
//! with `UBLK_F_AUTO_BUF_REG`), not in memory of loopd's. The task names the
//! buffer by its index and offset (`at`, from the request's first byte), and
//! the backend runs `IORING_OP_READ_FIXED` / `WRITE_FIXED` against the file.
//!
//! Only a request that goes straight to the file can be planned so: direct
//! I/O, aligned to the file's direct-I/O alignment (nothing to bounce, so
//! nothing for loopd to copy), on a ring-native backend. Everything loopd
//! would otherwise do to the bytes in memory is an operation here too: the
//! part of a read past the end of the file is filled from `/dev/zero` by a
//! fixed read into the same buffer ([`zero`]). The task (`Task::plan_fixed`)
//! keeps the state; this module checks whether a device can have it and
//! builds the operations.

use crate::backing::IoOp;
use crate::device::Device;

/// Whether `dev`'s backend runs fixed-buffer operations: a local file, with
/// direct I/O, on the reactor's ring.
pub fn fixed_capable(dev: &Device) -> bool {
    dev.direct && dev.backend.caps().direct && dev.backend.as_file().is_some()
}

/// The memory alignment a block device's request pages are guaranteed
/// (the block layer's default DMA alignment, 512 bytes, which ublk keeps).
const REQUEST_MEM_ALIGN: u32 = 512;

/// Whether every read and write the kernel can send a block device of
/// `dev`'s geometry goes straight between the request's pages and the file
/// (so [`Task::plan_fixed`] always succeeds): a local file with direct I/O,
/// the block size and the image offset multiples of the file's direct-I/O
/// offset alignment, and the file's memory alignment no stricter than the
/// pages' (512). `Err`: why not, for the log.
pub fn zero_copy_fits(dev: &Device) -> Result<(), String> {
    if !fixed_capable(dev) {
        return Err("the image is not a local file opened with direct I/O (--cache direct)".into());
    }
    let align = dev.dio_align.max(1);
    if dev.block_size % align != 0 || dev.offset % u64::from(align) != 0 {
        return Err(format!(
            "the block size {} or the offset {} is not a multiple of the file's direct-I/O \
             alignment {align}",
            dev.block_size, dev.offset
        ));
    }
    let mem = dev.backend.as_file().map_or(u32::MAX, |f| f.align().mem);
    if mem > REQUEST_MEM_ALIGN {
        return Err(format!(
            "the file needs {mem}-byte aligned memory for direct I/O (request pages are \
             {REQUEST_MEM_ALIGN}-byte aligned)"
        ));
    }
    Ok(())
}

/// An op length: spans are at most a request plus two alignment blocks.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(0xffff_f000)
}

/// Read the span's bytes from `done` on (of `span_len`, at file offset
/// `span_start`) into registered buffer `index`, at the same place in it.
pub fn read(index: u16, span_start: u64, span_len: usize, done: usize) -> IoOp {
    IoOp::ReadFixed {
        index,
        at: done as u64,
        len: len32(span_len - done),
        off: span_start + done as u64,
    }
}

/// Write the span's bytes from `done` on from registered buffer `index`.
pub fn write(index: u16, span_start: u64, span_len: usize, done: usize, dsync: bool) -> IoOp {
    IoOp::WriteFixed {
        index,
        at: done as u64,
        len: len32(span_len - done),
        off: span_start + done as u64,
        dsync,
    }
}

/// Zeros into registered buffer `index` from `done` to `span_len` (the
/// part of a read past the end of the file).
pub fn zero(index: u16, span_len: usize, done: usize) -> IoOp {
    IoOp::ZeroFixed {
        index,
        at: done as u64,
        len: len32(span_len - done),
    }
}
