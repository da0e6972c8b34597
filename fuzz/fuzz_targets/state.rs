//! The state file's replay on arbitrary bytes (a damaged or foreign file):
//! never panics, and never yields more devices than `put` records.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::daemon::state::parse;

fuzz_target!(|data: &[u8]| {
    let p = parse(data);
    let lines = data.split(|&b| b == b'\n').count();
    assert!(p.table.len() + p.damaged.len() <= lines);
});
