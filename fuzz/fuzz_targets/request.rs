//! `parse_header` + `validate` on arbitrary bytes, against an arbitrary export,
//! with compact or extended headers.
//!
//! Input: 8 bytes of export size, 1 byte of export flags, then the request header
//! bytes (the magic is forced when the flags' bit 3 is set, so that most inputs
//! reach `validate`; bit 4 selects extended headers).
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
    let extended = bits & 16 != 0;
    let exp = ExportView {
        size,
        read_only: bits & 1 != 0,
        structured: bits & 2 != 0 || extended,
        extended,
        meta_context: bits & 4 != 0,
    };
    let (magic, hlen) = if extended {
        (EXTENDED_REQUEST_MAGIC, EXTENDED_REQUEST_LEN)
    } else {
        (REQUEST_MAGIC, REQUEST_LEN)
    };
    assert_eq!(wire::request_len(extended), hlen);
    let mut hdr = data[9..].to_vec();
    if bits & 8 != 0 && hdr.len() >= 4 {
        hdr[0..4].copy_from_slice(&magic.to_be_bytes());
    }
    let Ok(req) = wire::parse_header(&hdr, extended) else {
        let payload_too_long = extended
            && hdr.len() >= hlen
            && (u16::from_be_bytes([hdr[6], hdr[7]]) == CMD_WRITE
                || u16::from_be_bytes([hdr[4], hdr[5]]) & CMD_FLAG_PAYLOAD_LEN != 0)
            && u64::from_be_bytes(hdr[24..32].try_into().unwrap()) > u64::from(u32::MAX);
        assert!(hdr.len() < hlen || hdr[0..4] != magic.to_be_bytes() || payload_too_long);
        return;
    };
    let encoded = if extended {
        wire::encode_request_ext(&req).to_vec()
    } else {
        wire::encode_request(&req).to_vec()
    };
    assert_eq!(&encoded[..], &hdr[..hlen]);
    let payload = wire::payload_len(&req, &exp);
    assert!(payload <= u64::from(u32::MAX));
    match wire::validate(&req, &exp) {
        Err(rej) => assert_eq!(rej.payload, payload),
        Ok(cmd) => {
            let writes = matches!(cmd, Command::Write | Command::Trim | Command::WriteZeroes);
            assert!(!(writes && exp.read_only));
            if !matches!(cmd, Command::Disc | Command::Flush) {
                assert!(req.len > 0);
                let end = req
                    .offset
                    .checked_add(req.len)
                    .expect("accepted request overflows");
                assert!(end <= exp.size, "accepted request ends past the export");
            }
            if matches!(cmd, Command::Read | Command::Write) {
                assert!(req.len <= u64::from(MAX_PAYLOAD));
            }
            if cmd == Command::Write {
                assert_eq!(payload, req.len);
            }
            if cmd == Command::BlockStatus {
                assert!(exp.meta_context);
            }
        }
    }
});
