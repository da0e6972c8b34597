//! ublk descriptor decoding on arbitrary descriptors and geometries: 24 bytes of
//! descriptor, then 8 bytes of device size, 1 of block shift, 1 of buffer shift.
//! It may not panic, and what it accepts lies inside the device and the buffer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::frontend::ublk::iod::{Geometry, UblkOp, decode, desc_from_bytes};

fuzz_target!(|data: &[u8]| {
    if data.len() < 34 {
        return;
    }
    let mut d = [0u8; 24];
    d.copy_from_slice(&data[..24]);
    let mut size = [0u8; 8];
    size.copy_from_slice(&data[24..32]);
    let geo = Geometry {
        dev_bytes: u64::from_le_bytes(size),
        logical_block: 1 << (9 + u32::from(data[32] % 4)),
        max_io_bytes: 1 << (12 + u32::from(data[33] % 14)),
    };
    match decode(&desc_from_bytes(&d), geo) {
        Ok(UblkOp::Read { offset, len }) | Ok(UblkOp::Write { offset, len, .. }) => {
            assert!(len > 0 && len <= geo.max_io_bytes);
            assert!(offset.checked_add(u64::from(len)).is_some_and(|e| e <= geo.dev_bytes));
        }
        Ok(UblkOp::Discard { offset, len }) | Ok(UblkOp::WriteZeroes { offset, len, .. }) => {
            assert!(len > 0);
            assert!(offset.checked_add(len).is_some_and(|e| e <= geo.dev_bytes));
        }
        Ok(UblkOp::Flush) => {}
        Err(e) => assert!(e.commit_result() < 0),
    }
});
