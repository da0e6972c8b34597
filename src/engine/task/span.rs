//! Span arithmetic of a task: the page size, alignment, the data buffer a
//! request needs, and the casts of span lengths (no state; [`super`]'s
//! `Task` is the state machine).

use crate::block::Op;
use crate::device::Device;

/// The system's page size (for "whole pages": on 16K/64K-page kernels a 4 KiB write
/// is a partial page, which may need a read first).
pub(super) fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

pub(super) fn align_down(x: u64, a: u64) -> u64 {
    x - x % a
}

pub(super) fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Bytes of data buffer `Task::plan` takes for `op` at export `offset`,
/// `len` (0 for operations without data): the request's bytes, widened to
/// direct-I/O blocks when they are bounced.
pub fn buffer_len(dev: &Device, op: Op, offset: u64, len: u32) -> usize {
    if !op.has_data() {
        return 0;
    }
    let foff = dev.file_offset(offset);
    let fend = foff.saturating_add(u64::from(len));
    let align = u64::from(dev.dio_align.max(1));
    if dev.direct && (foff % align != 0 || fend % align != 0) {
        to_len(align_up(fend, align) - align_down(foff, align))
    } else {
        len as usize
    }
}

/// A span length or offset inside a request buffer as `usize`: bounded by the
/// largest request plus two alignment blocks, so it always fits.
pub(super) fn to_len(x: u64) -> usize {
    usize::try_from(x).unwrap_or(usize::MAX)
}

pub(super) fn clamp_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(0xffff_f000)
}
