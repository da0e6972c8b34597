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
//! fixed read into the same buffer ([`zero_tail`]).

use super::{FileOp, Next, Phase, Task, clamp_u32};
use crate::backing::IoOp;
use crate::block::{Errno, Op, ReqFlags};
use crate::device::Device;
use crate::device::stats::Path;

impl Task {
    /// Plan a read or write whose data is the ring's registered buffer
    /// `index` (see the module documentation); `None` if this request cannot
    /// go straight between that buffer and the file (not a read or write,
    /// buffered, bounced, or a backend the ring does not run), and must not
    /// be started with it.
    pub fn plan_fixed(
        dev: &Device,
        op: Op,
        flags: ReqFlags,
        offset: u64,
        len: u32,
        index: u16,
    ) -> Option<Task> {
        if !matches!(op, Op::Read | Op::Write) || !fixed_capable(dev) {
            return None;
        }
        let mut t = Task::plan_span(dev, op, flags, offset, len);
        if t.path != Path::Direct || t.data_at != 0 || t.span_len != len as usize {
            return None;
        }
        t.fixed = Some(index);
        Some(t)
    }

    /// Whether the task's data is a registered buffer (no bytes in memory:
    /// [`Task::read_data`] and [`Task::payload_mut`] are empty).
    pub fn is_fixed(&self) -> bool {
        self.fixed.is_some()
    }
}

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

/// The rest of the span into the registered buffer.
pub(super) fn read(t: &mut Task, index: u16) -> Next {
    Next::Submit(FileOp(IoOp::ReadFixed {
        index,
        at: t.done as u64,
        len: clamp_u32(t.span_len - t.done),
        off: t.span_start + t.done as u64,
    }))
}

/// The rest of the span from the registered buffer.
pub(super) fn write(t: &mut Task, index: u16) -> Next {
    Next::Submit(FileOp(IoOp::WriteFixed {
        index,
        at: t.done as u64,
        len: clamp_u32(t.span_len - t.done),
        off: t.span_start + t.done as u64,
        dsync: t.dsync(),
    }))
}

/// A read stopped at the end of the file after `t.done` bytes: the rest of
/// the buffer must read as zeros.
pub(super) fn zero_tail(t: &mut Task, index: u16) -> Next {
    t.phase = Phase::ZeroTail;
    Next::Submit(FileOp(IoOp::ZeroFixed {
        index,
        at: t.done as u64,
        len: clamp_u32(t.span_len - t.done),
    }))
}

/// The result of a [`zero_tail`] read.
pub(super) fn zeroed(t: &mut Task, res: i32) -> Next {
    if res < 0 {
        return t.fail(res);
    }
    let Some(index) = t.fixed else {
        return Next::Done(Err(Errno::Io));
    };
    // /dev/zero never ends: nothing read means something is wrong.
    let Ok(n) = usize::try_from(res) else {
        return Next::Done(Err(Errno::Io));
    };
    if n == 0 {
        return t.fail(-libc::EIO);
    }
    t.done = (t.done + n).min(t.span_len);
    if t.done < t.span_len {
        return zero_tail(t, index);
    }
    t.phase = Phase::Finished;
    Next::Done(Ok(t.len))
}
