//! Block status (`base:allocation`) of a device's window, from its backend's
//! allocation map (`SEEK_DATA` / `SEEK_HOLE` on a file; a backend without one
//! describes everything as data). Synchronous: these are metadata lookups that
//! do not wait for data I/O (run off the reactors, see `engine::offload`).

use super::live::Device;
use crate::block::{Errno, Extent};
use std::sync::atomic::Ordering;

/// Most descriptors in one reply; the client asks again for the rest.
pub const MAX_DESCRIPTORS: usize = 256;

/// Describe `[off, off+len)` of the export into `out` (at most
/// [`MAX_DESCRIPTORS`] extents; with `one`, only the first), returning how many.
/// Covers at least the first byte.
pub fn describe(
    dev: &Device,
    off: u64,
    len: u32,
    one: bool,
    out: &mut [Extent],
) -> Result<usize, Errno> {
    let end = off + u64::from(len);
    let file_size = dev.file_size.load(Ordering::Relaxed).max(current_size(dev));
    let mut pos = off;
    let mut n = 0;
    let max = out.len().min(MAX_DESCRIPTORS);
    while pos < end && n < max {
        let foff = dev.file_offset(pos);
        let (run_end, hole) = if foff >= file_size {
            (end, true)
        } else {
            match dev.backend.seek_data(foff) {
                Ok(d) if d > foff => (export_pos(dev, d), true),
                Ok(_) => match dev.backend.seek_hole(foff) {
                    Ok(h) => (export_pos(dev, h), false),
                    Err(e) => return Err(Errno::from_os(e.raw_os_error())),
                },
                // ENXIO: no data after foff: a hole to the end of the file.
                Err(e) if e == rustix::io::Errno::NXIO => (export_pos(dev, file_size), true),
                Err(e) => return Err(Errno::from_os(e.raw_os_error())),
            }
        };
        // Keep descriptors whole blocks: a hole shrinks to block boundaries and
        // data grows to them (calling zeros "data" is always safe).
        let bs = u64::from(dev.block_size);
        let (run_end, hole) = if hole {
            let down = run_end - run_end % bs;
            if down > pos {
                (down, true)
            } else {
                (pos + bs, false)
            }
        } else {
            (run_end.div_ceil(bs) * bs, false)
        };
        let run_end = run_end.clamp(pos + 1, end);
        let run = u32::try_from(run_end - pos).unwrap_or(u32::MAX);
        out[n] = Extent {
            len: run,
            hole,
            zero: hole,
        };
        n += 1;
        pos += u64::from(run);
        if one {
            break;
        }
    }
    Ok(n)
}

fn export_pos(dev: &Device, file_off: u64) -> u64 {
    file_off.saturating_sub(dev.offset)
}

fn current_size(dev: &Device) -> u64 {
    dev.backend.current_len()
}
