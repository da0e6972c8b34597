//! Block status (`base:allocation`) of a device's window, from `SEEK_DATA` /
//! `SEEK_HOLE` on the backing file. Synchronous: these are metadata lookups that
//! do not wait for data I/O.

use super::Device;
use crate::nbd::proto::{STATE_HOLE, STATE_ZERO};
use crate::nbd::wire::{NbdErrno, block_descriptor};
use rustix::fs::{SeekFrom, seek};
use std::sync::atomic::Ordering;

/// Most descriptors in one reply; the client asks again for the rest.
pub const MAX_DESCRIPTORS: usize = 256;

/// Describe `[off, off+len)` of the export into `out` (8 bytes per descriptor),
/// returning the number of descriptors. Covers at least the first byte.
pub fn describe(
    dev: &Device,
    off: u64,
    len: u32,
    one: bool,
    out: &mut [u8],
) -> Result<usize, NbdErrno> {
    let end = off + u64::from(len);
    let file_size = dev.file_size.load(Ordering::Relaxed).max(current_size(dev));
    let mut pos = off;
    let mut n = 0;
    let max = (out.len() / 8).min(MAX_DESCRIPTORS);
    while pos < end && n < max {
        let foff = dev.file_offset(pos);
        let (run_end, flags) = if foff >= file_size {
            (end, STATE_HOLE | STATE_ZERO)
        } else {
            match seek(&dev.plain, SeekFrom::Data(foff)) {
                Ok(d) if d > foff => (export_pos(dev, d), STATE_HOLE | STATE_ZERO),
                Ok(_) => match seek(&dev.plain, SeekFrom::Hole(foff)) {
                    Ok(h) => (export_pos(dev, h), 0),
                    Err(e) => return Err(NbdErrno::from_os(e.raw_os_error())),
                },
                // ENXIO: no data after foff: a hole to the end of the file.
                Err(e) if e == rustix::io::Errno::NXIO => {
                    (export_pos(dev, file_size), STATE_HOLE | STATE_ZERO)
                }
                Err(e) => return Err(NbdErrno::from_os(e.raw_os_error())),
            }
        };
        // Keep descriptors whole blocks: a hole shrinks to block boundaries and
        // data grows to them (calling zeros "data" is always safe).
        let bs = u64::from(dev.block_size);
        let (run_end, flags) = if flags != 0 {
            let down = run_end - run_end % bs;
            if down > pos {
                (down, flags)
            } else {
                (pos + bs, 0)
            }
        } else {
            (run_end.div_ceil(bs) * bs, flags)
        };
        let run_end = run_end.clamp(pos + 1, end);
        let run = u32::try_from(run_end - pos).unwrap_or(u32::MAX);
        block_descriptor(&mut out[n * 8..n * 8 + 8], run, flags);
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
    dev.plain.metadata().map(|m| m.len()).unwrap_or(0)
}
