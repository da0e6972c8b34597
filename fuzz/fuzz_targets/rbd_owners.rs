//! The state file's sidecar of RBD lock owners on arbitrary bytes (a damaged
//! or foreign file): never panics, never yields more owners than lines, and
//! never an empty owner (one that could match "nobody").
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::daemon::rbd_owners::{encode, parse};

fuzz_target!(|data: &[u8]| {
    let p = parse(data);
    let lines = data.split(|&b| b == b'\n').count();
    assert!(p.owners.len() + p.damaged.len() <= lines);
    assert!(p.owners.values().all(|o| !o.owner.is_empty()));
    // What was read is written back whole and reads back the same.
    let again = parse(&encode(p.owners.values()));
    assert!(again.damaged.is_empty());
    assert_eq!(again.owners, p.owners);
});
