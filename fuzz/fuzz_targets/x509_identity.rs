//! Client identities from arbitrary bytes: `identities_of_der` and
//! `cert_info` never panic, and what they accept is consistent — the first
//! identity is the subject's `dn:`, and every identity, given as an allow
//! list entry, admits the certificate.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::tls::identity::cert_info;
use loopd::tls::{allowed, identities_of_der};

fuzz_target!(|data: &[u8]| {
    let info = cert_info(data);
    if let Ok(ids) = identities_of_der(data) {
        let info = info.expect("cert_info reads what identities_of_der reads");
        assert_eq!(ids.first(), Some(&format!("dn:{}", info.subject)));
        for id in &ids {
            assert!(
                allowed(std::slice::from_ref(id), &ids),
                "{id} does not admit itself"
            );
        }
    }
});
