//! The image-format probe on arbitrary file heads (an image is anything a user
//! points loopd at). It may not panic, and it reads only the first PROBE_LEN bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::backing::format::{PROBE_LEN, probe};

fuzz_target!(|data: &[u8]| {
    let found = probe(data);
    assert_eq!(found, probe(&data[..data.len().min(PROBE_LEN)]));
    if let Some(f) = found {
        assert!(!f.name().is_empty());
    }
});
