//! The block-device text and netlink parsers (`loopd::blockdev`) on arbitrary
//! bytes: no panic, and what is accepted is consistent with the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::blockdev::{udev, uevent};

fuzz_target!(|data: &[u8]| {
    if let Some(ev) = udev::parse_kernel_uevent(data) {
        let head = format!("{}@{}", ev.action, ev.devpath);
        assert!(data.starts_with(head.as_bytes()));
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(u) = uevent::parse_uevent(text) {
            assert!(text.contains(&format!("DEVNAME={}", u.devname)));
            assert!(!u.devname.starts_with('/') && !u.devname.split('/').any(|c| c == ".."));
        }
        if let Ok((major, minor)) = uevent::parse_devnum(text) {
            assert_eq!(
                uevent::parse_devnum(&format!("{major}:{minor}\n")),
                Ok((major, minor))
            );
        }
        let _ = uevent::parse_counter("size", text);
    }
});
