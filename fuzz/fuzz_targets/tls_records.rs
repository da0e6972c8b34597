//! TLS record boundaries over arbitrary bytes cut arbitrarily: never panics,
//! never asks for 0 bytes, and the state depends only on the bytes, not on
//! how the socket cut them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::tls::RecordBoundary;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, data)) = data.split_first() else {
        return;
    };
    let cut = usize::from(cut.max(1));
    let mut whole = RecordBoundary::new();
    whole.consumed(data);
    let mut bounded = RecordBoundary::new();
    let mut at = 0;
    while at < data.len() {
        let n = bounded.max_read().min(cut).min(data.len() - at);
        assert!(n > 0);
        bounded.consumed(&data[at..at + n]);
        at += n;
    }
    assert_eq!(whole, bounded);
});
