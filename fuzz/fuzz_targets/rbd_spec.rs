//! The `rbd:` image spec parser on arbitrary text: never panics; what it
//! accepts prints back as given and parses again to the same spec.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::backing::rbd::RbdSpec;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(spec) = RbdSpec::parse(s) {
        let shown = spec.to_string();
        assert_eq!(shown, s);
        assert_eq!(RbdSpec::parse(&shown), Ok(spec));
    }
});
