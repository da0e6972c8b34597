//! The service-manager inputs on arbitrary text: socket activation's variables
//! (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`), `NOTIFY_SOCKET` and
//! `--listen`. None may panic; what they accept must be consistent.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::server::activation::{FIRST_FD, parse_env};
use loopd::server::listen::normalize_listen;
use loopd::server::notify::parse_address;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(4, '\n');
    let pid = parts.next();
    let fds = parts.next();
    let names = parts.next();
    if let Ok(v) = parse_env(pid, fds, names, 1234) {
        for (i, (fd, _)) in v.iter().enumerate() {
            assert_eq!(i64::from(*fd), i64::from(FIRST_FD) + i as i64);
        }
    }
    let _ = parse_address(&text);
    if let Ok(a) = normalize_listen(&text) {
        // Normal form is a fixed point.
        assert_eq!(normalize_listen(&a).ok().as_deref(), Some(a.as_str()));
    }
});
