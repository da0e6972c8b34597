//! Decoding one ublk request descriptor into loopd's own request.
//!
//! Pure: [`decode`] reads a copied [`UblksrvIoDesc`] and the device geometry and
//! returns a [`UblkOp`] with byte offsets and lengths, or the [`IodError`] whose
//! [`IodError::commit_result`] completes the tag. The kernel is the only writer of
//! descriptors and is trusted to stay inside the limits it was given, but this is
//! still a parser: every multiplication and addition is checked, lengths are capped
//! by the per-tag buffer, and nothing here panics or allocates.

use super::sys::{
    UBLK_IO_F_FUA, UBLK_IO_F_NOUNMAP, UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ,
    UBLK_IO_OP_REPORT_ZONES, UBLK_IO_OP_WRITE, UBLK_IO_OP_WRITE_SAME, UBLK_IO_OP_WRITE_ZEROES,
    UBLK_IO_OP_ZONE_APPEND, UBLK_IO_OP_ZONE_CLOSE, UBLK_IO_OP_ZONE_FINISH, UBLK_IO_OP_ZONE_OPEN,
    UBLK_IO_OP_ZONE_RESET, UBLK_IO_OP_ZONE_RESET_ALL, UblksrvIoDesc,
};
use thiserror::Error;

/// ublk counts in 512-byte sectors whatever the logical block size.
pub const SECTOR: u64 = 512;

/// What [`decode`] checks a descriptor against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Device size in bytes.
    pub dev_bytes: u64,
    /// Logical block size: a power of two, 512..=4096. Offsets and lengths of
    /// data requests must be multiples of it.
    pub logical_block: u32,
    /// The per-tag buffer (`max_io_buf_bytes`): the longest READ/WRITE.
    pub max_io_bytes: u32,
}

/// One request, in bytes, ready for the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UblkOp {
    /// Fill `len` bytes of the tag's buffer from `offset`; commit `len` on success.
    Read {
        offset: u64,
        len: u32,
    },
    /// Write `len` bytes of the tag's buffer at `offset`; durable before the
    /// commit if `fua`.
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    /// Make every write completed before it durable.
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    /// Zero the range; `may_unmap` is false when the kernel asked for allocated
    /// zeroes (`REQ_NOUNMAP`).
    WriteZeroes {
        offset: u64,
        len: u64,
        may_unmap: bool,
    },
}

/// Why a descriptor was refused; each maps to the errno the tag is completed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum IodError {
    #[error("unknown ublk op {0}")]
    UnknownOp(u8),
    #[error("ublk op {0} is not supported by loopd")]
    Unsupported(u8),
    #[error("sector {start_sector} + {nr_sectors} overflows")]
    Overflow { start_sector: u64, nr_sectors: u32 },
    #[error("bytes {offset}..{end} lie past the device end {dev_bytes}")]
    OutOfRange {
        offset: u64,
        end: u64,
        dev_bytes: u64,
    },
    #[error("offset {offset} or length {len} is not a multiple of the block size {block}")]
    Misaligned { offset: u64, len: u64, block: u32 },
    #[error("a data request of {len} bytes exceeds the {max} byte buffer")]
    TooLong { len: u64, max: u32 },
    #[error("empty data request")]
    Empty,
}

impl IodError {
    /// The positive errno for this refusal (one place, no catch-all).
    pub fn errno(&self) -> i32 {
        match self {
            IodError::UnknownOp(_) => libc::EINVAL,
            IodError::Unsupported(_) => libc::EOPNOTSUPP,
            IodError::Overflow { .. } => libc::EINVAL,
            IodError::OutOfRange { .. } => libc::EINVAL,
            IodError::Misaligned { .. } => libc::EINVAL,
            IodError::TooLong { .. } => libc::EINVAL,
            IodError::Empty => libc::EINVAL,
        }
    }

    /// The `ublksrv_io_cmd.result` to COMMIT_AND_FETCH with: `-errno`.
    pub fn commit_result(&self) -> i32 {
        -self.errno()
    }
}

/// Translate one descriptor. Flags loopd does not act on (FAILFAST_*, META, SWAP)
/// are ignored; FUA is honoured on writes only (the block layer sets it nowhere else).
pub fn decode(desc: &UblksrvIoDesc, geo: Geometry) -> Result<UblkOp, IodError> {
    let op = desc.op();
    let flags = desc.flags();
    match op {
        UBLK_IO_OP_FLUSH => Ok(UblkOp::Flush),
        UBLK_IO_OP_READ => {
            let (offset, len) = data_range(desc, geo)?;
            Ok(UblkOp::Read { offset, len })
        }
        UBLK_IO_OP_WRITE => {
            let (offset, len) = data_range(desc, geo)?;
            let fua = flags & UBLK_IO_F_FUA != 0;
            Ok(UblkOp::Write { offset, len, fua })
        }
        UBLK_IO_OP_DISCARD => {
            let (offset, len) = range(desc, geo)?;
            Ok(UblkOp::Discard { offset, len })
        }
        UBLK_IO_OP_WRITE_ZEROES => {
            let (offset, len) = range(desc, geo)?;
            let may_unmap = flags & UBLK_IO_F_NOUNMAP == 0;
            Ok(UblkOp::WriteZeroes {
                offset,
                len,
                may_unmap,
            })
        }
        UBLK_IO_OP_WRITE_SAME
        | UBLK_IO_OP_ZONE_OPEN
        | UBLK_IO_OP_ZONE_CLOSE
        | UBLK_IO_OP_ZONE_FINISH
        | UBLK_IO_OP_ZONE_APPEND
        | UBLK_IO_OP_ZONE_RESET_ALL
        | UBLK_IO_OP_ZONE_RESET
        | UBLK_IO_OP_REPORT_ZONES => Err(IodError::Unsupported(op)),
        other => Err(IodError::UnknownOp(other)),
    }
}

/// Byte range of a non-empty, block-aligned request inside the device.
fn range(desc: &UblksrvIoDesc, geo: Geometry) -> Result<(u64, u64), IodError> {
    let overflow = IodError::Overflow {
        start_sector: desc.start_sector,
        nr_sectors: desc.nr_sectors,
    };
    let offset = desc.start_sector.checked_mul(SECTOR).ok_or(overflow)?;
    let len = u64::from(desc.nr_sectors) * SECTOR; // < 2^41, cannot overflow
    let end = offset.checked_add(len).ok_or(overflow)?;
    if len == 0 {
        return Err(IodError::Empty);
    }
    if end > geo.dev_bytes {
        return Err(IodError::OutOfRange {
            offset,
            end,
            dev_bytes: geo.dev_bytes,
        });
    }
    let block = u64::from(geo.logical_block.max(1));
    if offset % block != 0 || len % block != 0 {
        return Err(IodError::Misaligned {
            offset,
            len,
            block: geo.logical_block,
        });
    }
    Ok((offset, len))
}

/// [`range`], plus the cap of the tag's buffer.
fn data_range(desc: &UblksrvIoDesc, geo: Geometry) -> Result<(u64, u32), IodError> {
    let (offset, len) = range(desc, geo)?;
    match u32::try_from(len) {
        Ok(l) if l <= geo.max_io_bytes => Ok((offset, l)),
        _ => Err(IodError::TooLong {
            len,
            max: geo.max_io_bytes,
        }),
    }
}

/// The descriptor the kernel would write for `op` (tests, fuzzing, tools). Byte
/// values are truncated to sectors, as the kernel would never send them otherwise.
pub fn encode(op: &UblkOp) -> UblksrvIoDesc {
    let (code, flags, offset, len) = match *op {
        UblkOp::Read { offset, len } => (UBLK_IO_OP_READ, 0, offset, u64::from(len)),
        UblkOp::Write { offset, len, fua } => (
            UBLK_IO_OP_WRITE,
            if fua { UBLK_IO_F_FUA } else { 0 },
            offset,
            u64::from(len),
        ),
        UblkOp::Flush => (UBLK_IO_OP_FLUSH, 0, 0, 0),
        UblkOp::Discard { offset, len } => (UBLK_IO_OP_DISCARD, 0, offset, len),
        UblkOp::WriteZeroes {
            offset,
            len,
            may_unmap,
        } => (
            UBLK_IO_OP_WRITE_ZEROES,
            if may_unmap { 0 } else { UBLK_IO_F_NOUNMAP },
            offset,
            len,
        ),
    };
    UblksrvIoDesc {
        op_flags: u32::from(code) | flags,
        nr_sectors: u32::try_from(len / SECTOR).unwrap_or(u32::MAX),
        start_sector: offset / SECTOR,
        addr: 0,
    }
}

/// A descriptor from its 24 bytes as they sit in the shared array (native endian).
pub fn desc_from_bytes(b: &[u8; 24]) -> UblksrvIoDesc {
    let u32_at = |i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u64_at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[i..i + 8]);
        u64::from_ne_bytes(a)
    };
    UblksrvIoDesc {
        op_flags: u32_at(0),
        nr_sectors: u32_at(4),
        start_sector: u64_at(8),
        addr: u64_at(16),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GEO: Geometry = Geometry {
        dev_bytes: 1 << 30,
        logical_block: 4096,
        max_io_bytes: 1 << 20,
    };

    fn desc(op: u8, flags: u32, start_sector: u64, nr_sectors: u32) -> UblksrvIoDesc {
        UblksrvIoDesc {
            op_flags: u32::from(op) | flags,
            nr_sectors,
            start_sector,
            addr: 0x1000,
        }
    }

    #[test]
    fn read_and_write_become_byte_ranges() {
        assert_eq!(
            decode(&desc(UBLK_IO_OP_READ, 0, 8, 16), GEO),
            Ok(UblkOp::Read {
                offset: 4096,
                len: 8192
            })
        );
        assert_eq!(
            decode(&desc(UBLK_IO_OP_WRITE, UBLK_IO_F_FUA, 0, 8), GEO),
            Ok(UblkOp::Write {
                offset: 0,
                len: 4096,
                fua: true
            })
        );
    }

    #[test]
    fn write_zeroes_with_nounmap_may_not_unmap() {
        assert_eq!(
            decode(&desc(UBLK_IO_OP_WRITE_ZEROES, UBLK_IO_F_NOUNMAP, 0, 8), GEO),
            Ok(UblkOp::WriteZeroes {
                offset: 0,
                len: 4096,
                may_unmap: false
            })
        );
    }

    #[test]
    fn flush_ignores_its_sector_fields() {
        assert_eq!(
            decode(&desc(UBLK_IO_OP_FLUSH, 0, u64::MAX, u32::MAX), GEO),
            Ok(UblkOp::Flush)
        );
    }

    #[test]
    fn request_past_the_device_end_is_rejected_with_einval() {
        let e = decode(&desc(UBLK_IO_OP_READ, 0, (1 << 30) / 512, 8), GEO).unwrap_err();
        assert!(matches!(e, IodError::OutOfRange { .. }));
        assert_eq!(e.commit_result(), -libc::EINVAL);
    }

    #[test]
    fn sector_overflow_is_rejected() {
        let e = decode(&desc(UBLK_IO_OP_READ, 0, u64::MAX / 256, 8), GEO).unwrap_err();
        assert!(matches!(e, IodError::Overflow { .. }));
    }

    #[test]
    fn read_longer_than_the_tag_buffer_is_rejected() {
        let e = decode(&desc(UBLK_IO_OP_READ, 0, 0, (2 << 20) / 512), GEO).unwrap_err();
        assert!(matches!(e, IodError::TooLong { .. }));
    }

    #[test]
    fn discard_may_exceed_the_tag_buffer() {
        assert_eq!(
            decode(&desc(UBLK_IO_OP_DISCARD, 0, 0, (64 << 20) / 512), GEO),
            Ok(UblkOp::Discard {
                offset: 0,
                len: 64 << 20
            })
        );
    }

    #[test]
    fn misaligned_request_is_rejected() {
        let e = decode(&desc(UBLK_IO_OP_WRITE, 0, 1, 8), GEO).unwrap_err();
        assert!(matches!(e, IodError::Misaligned { .. }));
    }

    #[test]
    fn zoned_and_write_same_are_unsupported_unknown_is_invalid() {
        for op in [
            UBLK_IO_OP_WRITE_SAME,
            UBLK_IO_OP_ZONE_APPEND,
            UBLK_IO_OP_REPORT_ZONES,
        ] {
            assert_eq!(
                decode(&desc(op, 0, 0, 8), GEO).unwrap_err().errno(),
                libc::EOPNOTSUPP
            );
        }
        assert_eq!(
            decode(&desc(99, 0, 0, 8), GEO),
            Err(IodError::UnknownOp(99))
        );
    }

    fn geometry() -> impl Strategy<Value = Geometry> {
        (0u64..(1 << 44), 9u32..=12, 12u32..=25).prop_map(|(dev, shift, buf)| Geometry {
            dev_bytes: dev,
            logical_block: 1 << shift,
            max_io_bytes: 1 << buf,
        })
    }

    fn op_in(geo: Geometry) -> impl Strategy<Value = UblkOp> {
        let block = u64::from(geo.logical_block);
        let blocks = geo.dev_bytes / block;
        let max_data = u64::from(geo.max_io_bytes) / block;
        (0..blocks.max(1), any::<u64>(), any::<bool>(), 0u8..5).prop_filter_map(
            "device too small",
            move |(start, n, flag, kind)| {
                let room = blocks.checked_sub(start)?;
                if room == 0 {
                    return None;
                }
                let offset = start * block;
                let data = (n % room.min(max_data).max(1)).max(1) * block;
                let any_len = (n % room).max(1) * block;
                let len32 = u32::try_from(data).ok()?;
                let max_range = u64::from(u32::MAX) * SECTOR / block * block;
                Some(match kind {
                    0 => UblkOp::Read { offset, len: len32 },
                    1 => UblkOp::Write {
                        offset,
                        len: len32,
                        fua: flag,
                    },
                    2 => UblkOp::Flush,
                    3 => UblkOp::Discard {
                        offset,
                        len: any_len.min(max_range),
                    },
                    _ => UblkOp::WriteZeroes {
                        offset,
                        len: any_len.min(max_range),
                        may_unmap: flag,
                    },
                })
            },
        )
    }

    proptest! {
        #[test]
        fn decode_never_panics(b in any::<[u8; 24]>(), geo in geometry()) {
            let _ = decode(&desc_from_bytes(&b), geo);
        }

        #[test]
        fn accepted_requests_lie_inside_the_device_and_the_buffer(b in any::<[u8; 24]>(), geo in geometry()) {
            match decode(&desc_from_bytes(&b), geo) {
                Ok(UblkOp::Read { offset, len }) | Ok(UblkOp::Write { offset, len, .. }) => {
                    prop_assert!(len > 0 && len <= geo.max_io_bytes);
                    prop_assert!(offset + u64::from(len) <= geo.dev_bytes);
                    prop_assert_eq!(offset % u64::from(geo.logical_block), 0);
                }
                Ok(UblkOp::Discard { offset, len }) | Ok(UblkOp::WriteZeroes { offset, len, .. }) => {
                    prop_assert!(len > 0);
                    prop_assert!(offset + len <= geo.dev_bytes);
                    prop_assert_eq!(len % u64::from(geo.logical_block), 0);
                }
                Ok(UblkOp::Flush) => {}
                Err(e) => prop_assert!(e.commit_result() < 0),
            }
        }

        #[test]
        fn encode_then_decode_round_trips(
            (geo, op) in geometry().prop_filter("has a block", |g| g.dev_bytes >= 4096)
                .prop_flat_map(|g| (Just(g), op_in(g)))
        ) {
            prop_assert_eq!(decode(&encode(&op), geo), Ok(op));
        }
    }
}
