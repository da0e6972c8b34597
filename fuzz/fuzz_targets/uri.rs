//! NBD URI percent-decoding on arbitrary text: never panics, and what it
//! accepts re-encodes to a string that decodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::daemon::uri::{decode, encode};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(b) = decode(s) {
        assert_eq!(decode(&encode(&b)), Ok(b));
    }
});
