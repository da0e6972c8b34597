//! The kernel-nbd netlink reply parser against arbitrary bytes: a datagram
//! fed to a request's `Transaction`, each reply it keeps decoded as CONNECT,
//! STATUS and GETFAMILY replies (family id, multicast group), and the
//! datagram read as LINK_DEAD announcements. Nothing may panic, and what comes out must
//! lie within the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::kernel_nbd::msg::{Message, Transaction, parse_attrs, parse_datagram};
use loopd::kernel_nbd::proto::{
    NBD_GENL_MCAST_GROUP_NAME, parse_connect_reply, parse_family_id, parse_link_dead,
    parse_mcast_group, parse_status_reply,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(msgs) = parse_datagram(data) {
        for m in &msgs {
            if let Message::Genl { attrs, .. } = m {
                assert!(attrs.len() <= data.len());
                if let Ok(list) = parse_attrs(attrs) {
                    for a in list {
                        assert!(a.payload.len() <= attrs.len());
                    }
                }
            }
        }
    }
    // Sequence number and family from the first bytes, so that the fuzzer
    // can reach the paths that keep replies.
    let seq = data.get(8..12).map_or(0, |b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    let family = data.get(4..6).map_or(0, |b| u16::from_ne_bytes([b[0], b[1]]));
    let mut t = Transaction::new(family, seq);
    if t.feed(data).is_ok() {
        for (_, attrs) in &t.replies {
            if let Ok(devs) = parse_status_reply(attrs) {
                assert!(devs.len() <= attrs.len() / 12 + 1);
            }
            let _ = parse_connect_reply(attrs);
            let _ = parse_family_id(attrs);
            let _ = parse_mcast_group(attrs, NBD_GENL_MCAST_GROUP_NAME);
        }
    }
    if let Ok(dead) = parse_link_dead(data, family) {
        assert!(dead.len() <= data.len() / 28);
    }
});
