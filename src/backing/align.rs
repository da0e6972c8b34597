//! Direct-I/O alignment of a backing file.
//!
//! `statx(STATX_DIOALIGN)` tells the offset and memory alignment the filesystem
//! needs for `O_DIRECT` on this file (0 = direct I/O not supported). Where the
//! kernel or filesystem does not report it, fall back to the logical block size of
//! the filesystem's block device (sysfs), then 512.

use rustix::fs::{AtFlags, Statx, StatxFlags, statx};
use std::fs::File;
use std::path::Path;

/// What the filesystem told us about direct I/O on one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of file offsets and lengths for `O_DIRECT`.
    pub offset: u32,
    /// Required alignment of memory buffers.
    pub mem: u32,
    /// `false` when statx said direct I/O is not supported on this file.
    pub supported: bool,
    /// Where the numbers came from, for the start-up message.
    pub source: &'static str,
}

/// Probe a file's direct-I/O alignment.
pub fn probe(file: &File) -> DioAlign {
    match statx(
        file,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::DIOALIGN | StatxFlags::BASIC_STATS,
    ) {
        Ok(st) => of_statx(&st),
        Err(_) => DioAlign {
            offset: 512,
            mem: 512,
            supported: true,
            source: "default 512",
        },
    }
}

/// The direct-I/O alignment a `statx` asked for `STATX_DIOALIGN` tells (or
/// the fall-backs, where it does not).
pub fn of_statx(st: &Statx) -> DioAlign {
    if st.stx_mask & StatxFlags::DIOALIGN.bits() != 0 {
        if st.stx_dio_offset_align == 0 {
            DioAlign {
                offset: 512,
                mem: 512,
                supported: false,
                source: "statx (direct I/O unsupported)",
            }
        } else {
            DioAlign {
                offset: st.stx_dio_offset_align,
                mem: st.stx_dio_mem_align.max(1),
                supported: true,
                source: "statx STATX_DIOALIGN",
            }
        }
    } else {
        match device_logical_block_size(st.stx_dev_major, st.stx_dev_minor) {
            Some(lbs) => DioAlign {
                offset: lbs,
                mem: lbs,
                supported: true,
                source: "device logical block size",
            },
            None => DioAlign {
                offset: 512,
                mem: 512,
                supported: true,
                source: "default 512",
            },
        }
    }
}

/// The logical block size of a block device (or of the disk holding a partition).
fn device_logical_block_size(major: u32, minor: u32) -> Option<u32> {
    let base = format!("/sys/dev/block/{major}:{minor}");
    for rel in ["queue/logical_block_size", "../queue/logical_block_size"] {
        let p = Path::new(&base).join(rel);
        if let Ok(s) = std::fs::read_to_string(&p) {
            if let Ok(v) = s.trim().parse::<u32>() {
                if v.is_power_of_two() {
                    return Some(v);
                }
            }
        }
    }
    None
}
