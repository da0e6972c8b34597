//! The block vocabulary every layer shares: what a request asks of a device
//! ([`Op`], [`ReqFlags`]), how it can fail ([`Errno`]), and how a range of the
//! device is allocated ([`Extent`]).
//!
//! Frontends translate their wire requests (NBD commands, ublk descriptors) into
//! these and encode the results back; the engine and the device layer speak only
//! this. Nothing here imports another loopd module.

/// A data operation on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    /// Make every completed write durable.
    Flush,
    /// Discard a range (it may read back as zeros or as before).
    Trim,
    /// Make a range read as zeros.
    WriteZeroes,
    /// Prefetch a range into the page cache (a hint).
    Cache,
}

impl Op {
    /// Whether the operation carries data (a buffer the size of the range).
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write)
    }

    /// Whether the operation changes the device's contents.
    pub fn writes(self) -> bool {
        matches!(self, Op::Write | Op::Trim | Op::WriteZeroes)
    }
}

/// Modifiers of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReqFlags {
    /// Force unit access: durable before completion.
    pub fua: bool,
    /// Write-zeroes must leave the range allocated (no hole punched).
    pub no_hole: bool,
    /// Write-zeroes must fail fast (`NotSup`) rather than write zeros slowly.
    pub fast_zero: bool,
}

/// Why a request failed. Values follow Linux errno numbers, which both NBD's
/// wire errors and ublk's results use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Errno {
    Perm,
    Io,
    NoMem,
    Inval,
    NoSpc,
    Overflow,
    NotSup,
    Shutdown,
}

impl Errno {
    /// Every errno, in [`Errno::index`] order.
    pub const ALL: [Errno; 8] = [
        Errno::Perm,
        Errno::Io,
        Errno::NoMem,
        Errno::Inval,
        Errno::NoSpc,
        Errno::Overflow,
        Errno::NotSup,
        Errno::Shutdown,
    ];

    /// The Linux errno number.
    pub fn raw(self) -> i32 {
        match self {
            Errno::Perm => libc::EPERM,
            Errno::Io => libc::EIO,
            Errno::NoMem => libc::ENOMEM,
            Errno::Inval => libc::EINVAL,
            Errno::NoSpc => libc::ENOSPC,
            Errno::Overflow => libc::EOVERFLOW,
            Errno::NotSup => libc::EOPNOTSUPP,
            Errno::Shutdown => libc::ESHUTDOWN,
        }
    }

    /// Position in [`Errno::ALL`] (for per-errno counters).
    pub fn index(self) -> usize {
        match self {
            Errno::Perm => 0,
            Errno::Io => 1,
            Errno::NoMem => 2,
            Errno::Inval => 3,
            Errno::NoSpc => 4,
            Errno::Overflow => 5,
            Errno::NotSup => 6,
            Errno::Shutdown => 7,
        }
    }

    /// The conventional name (`EIO`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Errno::Perm => "EPERM",
            Errno::Io => "EIO",
            Errno::NoMem => "ENOMEM",
            Errno::Inval => "EINVAL",
            Errno::NoSpc => "ENOSPC",
            Errno::Overflow => "EOVERFLOW",
            Errno::NotSup => "ENOTSUP",
            Errno::Shutdown => "ESHUTDOWN",
        }
    }

    /// Map an OS errno from the backing file to what the requester is told.
    pub fn from_os(errno: i32) -> Errno {
        match errno {
            libc::EPERM | libc::EACCES | libc::EROFS => Errno::Perm,
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => Errno::NoSpc,
            libc::ENOMEM => Errno::NoMem,
            libc::EINVAL => Errno::Inval,
            libc::EOVERFLOW => Errno::Overflow,
            libc::EOPNOTSUPP => Errno::NotSup,
            libc::ESHUTDOWN => Errno::Shutdown,
            _ => Errno::Io,
        }
    }
}

/// A run of the device with one allocation state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Extent {
    pub len: u32,
    /// Not allocated in the backing file.
    pub hole: bool,
    /// Reads as zeros.
    pub zero: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_index_matches_all_and_os_round_trips() {
        for (i, e) in Errno::ALL.iter().enumerate() {
            assert_eq!(e.index(), i);
            assert_eq!(Errno::from_os(e.raw()), *e);
        }
        assert_eq!(Errno::from_os(libc::EACCES), Errno::Perm);
        assert_eq!(Errno::from_os(libc::EDQUOT), Errno::NoSpc);
        assert_eq!(Errno::from_os(libc::ENXIO), Errno::Io);
    }
}
