//! Escaping of untrusted strings (`loopd::text`) and the pid-file parser on
//! arbitrary bytes: never panics; a quoted string or path is one line with no
//! control, line-break or bidi character; the pid parser accepts only
//! `DIGITS\n`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::text::{quoted_bytes, sanitize_line};

fn clean(s: &str) -> bool {
    !s.chars().any(|c| {
        c.is_control()
            || matches!(u32::from(c), 0x2028 | 0x2029 | 0x202A..=0x202E | 0x2066..=0x2069)
    })
}

fuzz_target!(|data: &[u8]| {
    let q = quoted_bytes(data).to_string();
    assert!(clean(&q), "{q:?}");
    if let Ok(s) = std::str::from_utf8(data) {
        assert!(clean(&sanitize_line(s)));
    }
    if let Some(pid) = loopd::server::pidfile::parse_pid(data) {
        assert!(pid > 0);
        assert_eq!(data, format!("{pid}\n").as_bytes());
    }
});
