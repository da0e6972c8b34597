//! The metrics endpoint's HTTP request-head parser on arbitrary bytes: never
//! panics; a complete head is one no prefix of which was already complete or bad.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::metrics::request::{MAX_HEAD, Parsed, parse};

fuzz_target!(|data: &[u8]| {
    match parse(data) {
        Parsed::Done(h) => {
            assert!(h.path.starts_with('/'));
            assert!(!h.method.is_empty());
        }
        Parsed::Partial => assert!(data.len() < MAX_HEAD),
        Parsed::Bad(why) => assert!(!why.is_empty()),
    }
});
