//! `parse_request` + `validate` on arbitrary bytes, against an arbitrary export.
//!
//! Input: 8 bytes of export size, 1 byte of export flags, then the request header
//! bytes (the magic is forced when the flags' bit 3 is set, so that most inputs
//! reach `validate`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::frontend::nbd::proto::*;
use loopd::frontend::nbd::wire::{self, Command, ExportView};

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let size = u64::from_be_bytes(data[0..8].try_into().unwrap());
    let bits = data[8];
    let exp = ExportView {
        size,
        read_only: bits & 1 != 0,
        structured: bits & 2 != 0,
        meta_context: bits & 4 != 0,
    };
    let mut hdr = data[9..].to_vec();
    if bits & 8 != 0 && hdr.len() >= 4 {
        hdr[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    }
    let Ok(req) = wire::parse_request(&hdr) else {
        assert!(hdr.len() < REQUEST_LEN || hdr[0..4] != REQUEST_MAGIC.to_be_bytes());
        return;
    };
    assert_eq!(&wire::encode_request(&req)[..], &hdr[..REQUEST_LEN]);
    match wire::validate(&req, &exp) {
        Err(rej) => assert_eq!(rej.payload, if req.kind == CMD_WRITE { req.len } else { 0 }),
        Ok(cmd) => {
            let writes = matches!(cmd, Command::Write | Command::Trim | Command::WriteZeroes);
            assert!(!(writes && exp.read_only));
            if !matches!(cmd, Command::Disc | Command::Flush) {
                assert!(req.len > 0);
                let end = req
                    .offset
                    .checked_add(u64::from(req.len))
                    .expect("accepted request overflows");
                assert!(end <= exp.size, "accepted request ends past the export");
            }
            if matches!(cmd, Command::Read | Command::Write) {
                assert!(req.len <= MAX_PAYLOAD);
            }
            if cmd == Command::BlockStatus {
                assert!(exp.meta_context);
            }
        }
    }
});
