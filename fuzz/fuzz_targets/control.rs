//! The control protocol's parsers on arbitrary bytes (a control-socket client may
//! send anything). Neither may panic; an accepted request must re-encode to one
//! that parses back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::control::proto::{encode_request, parse_reply, parse_request};

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = parse_request(data) {
        assert_eq!(parse_request(encode_request(&r).as_bytes()), Ok(r));
    }
    let _ = parse_reply(data);
});
