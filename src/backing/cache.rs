//! How much of a backing file sits in the page cache: `cachestat(2)` (Linux
//! 6.5+) over a byte range of the file.
//!
//! Asked by the metrics scrape, never by the data path. The call walks the
//! file's page-cache tree for the range without touching the pages (no reads, no
//! faults); it may take a few milliseconds on a large, well-cached image. On
//! kernels without the system call the answer is `None` and nothing is shown.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Bytes of one range of a file in the page cache, by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStat {
    /// Bytes cached (clean, dirty and under writeback alike).
    pub cached: u64,
    /// Bytes written but not yet on their way to the disk.
    pub dirty: u64,
    /// Bytes being written back now.
    pub writeback: u64,
}

/// The kernel's `struct cachestat_range`.
#[repr(C)]
struct Range {
    off: u64,
    len: u64,
}

/// The kernel's `struct cachestat`: counts of pages (the eviction counts are
/// not shown, but the kernel writes the whole struct).
#[repr(C)]
#[derive(Default)]
struct Raw {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// `__NR_cachestat`: the same number on every architecture (new system calls
/// are numbered together since 5.x).
const SYS_CACHESTAT: libc::c_long = 451;

/// Page-cache state of `len` bytes of `file` from `off` (`len` 0: to the end
/// of the file). `Ok(None)` when the kernel has no `cachestat`.
pub fn stat(file: &File, off: u64, len: u64) -> std::io::Result<Option<CacheStat>> {
    let range = Range { off, len };
    let mut raw = Raw::default();
    // SAFETY: cachestat(fd, range, cstat, flags) reads one `struct
    // cachestat_range` and writes one `struct cachestat`; both are local,
    // `repr(C)` with the kernel's layout, and live for the call. The fd is
    // borrowed from `file`, open for the call's duration.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut raw as *mut Raw,
            0u32,
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ENOSYS) => Ok(None),
            _ => Err(err),
        };
    }
    let page = rustix::param::page_size() as u64;
    Ok(Some(CacheStat {
        cached: raw.nr_cache.saturating_mul(page),
        dirty: raw.nr_dirty.saturating_mul(page),
        writeback: raw.nr_writeback.saturating_mul(page),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn written_pages_are_cached_and_a_range_counts_only_itself() {
        let mut f = tempfile::tempfile().unwrap();
        let page = rustix::param::page_size();
        f.write_all(&vec![7u8; page * 4]).unwrap();
        let Some(all) = stat(&f, 0, 0).unwrap() else {
            panic!("this kernel has no cachestat (Linux 6.5+ needed for the page-cache metric)");
        };
        assert_eq!(all.cached, (page * 4) as u64, "{all:?}");
        let one = stat(&f, page as u64, page as u64).unwrap().unwrap();
        assert_eq!(one.cached, page as u64, "{one:?}");
        assert!(one.dirty <= one.cached);
    }

    #[test]
    fn a_range_past_the_end_is_empty() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"x").unwrap();
        let s = stat(&f, 1 << 30, 4096).unwrap().unwrap();
        assert_eq!(s, CacheStat::default());
    }
}
