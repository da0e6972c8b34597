//! The handshake's option parsers on arbitrary bytes. Anything accepted must
//! re-encode to exactly the input (the parsers consume every byte, nothing more).
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::frontend::nbd::proto::*;
use loopd::frontend::nbd::wire;

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = wire::parse_option_header(data) {
        assert_eq!(&data[0..8], &IHAVEOPT.to_be_bytes());
        assert_eq!(&data[8..12], &h.option.to_be_bytes());
        assert_eq!(&data[12..16], &h.len.to_be_bytes());
    }
    if let Ok(r) = wire::parse_info_request(data) {
        assert!(r.name.len() <= MAX_NAME_LEN);
        let mut b = Vec::new();
        string(&mut b, &r.name);
        b.extend_from_slice(&(r.requests.len() as u16).to_be_bytes());
        for q in &r.requests {
            b.extend_from_slice(&q.to_be_bytes());
        }
        assert_eq!(b, data);
    }
    if let Ok(r) = wire::parse_meta_context_request(data) {
        assert!(r.name.len() <= MAX_NAME_LEN);
        assert!(r.queries.len() <= data.len() / 4);
        let mut b = Vec::new();
        string(&mut b, &r.name);
        b.extend_from_slice(&(r.queries.len() as u32).to_be_bytes());
        for q in &r.queries {
            assert!(q.len() <= MAX_NAME_LEN);
            string(&mut b, q);
        }
        assert_eq!(b, data);
    }
});
