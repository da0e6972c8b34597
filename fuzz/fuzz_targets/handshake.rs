//! The whole handshake (`negotiate`) against a client that sends arbitrary bytes,
//! over an in-memory stream. Everything the server writes must be the hello
//! followed by well-formed option replies (and the reply to `EXPORT_NAME`).
//! The same bytes also drive the sans-I/O machine with TLS on and required (a
//! STARTTLS it acknowledges counts as a TLS handshake that proved an identity).
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::device::{CacheMode, Device, DeviceParams};
use loopd::frontend::nbd::handshake::{
    Exports, Handshake, HandshakeError, Negotiated, Policy, Step, TlsMode, negotiate,
};
use loopd::frontend::nbd::proto::*;
use std::io::{Cursor, Read, Write};
use std::sync::{Arc, OnceLock};

struct Fixed(Arc<Device>);

impl Exports for Fixed {
    type Client = ();
    type Export = Arc<Device>;
    fn find(&self, name: &str, _ids: &[String]) -> Option<Arc<Device>> {
        (name.is_empty() || name == "disk").then(|| Arc::clone(&self.0))
    }
    fn join(&self, name: &str, ids: &[String]) -> Option<(Arc<Device>, ())> {
        self.find(name, ids).map(|d| (d, ()))
    }
    fn names(&self, _ids: &[String]) -> Vec<String> {
        vec![String::new(), "disk".into()]
    }
}

/// One small device for the whole run. Its file is removed once opened (the
/// device keeps its descriptors), so no temporary file outlives the fuzzer.
fn exports() -> &'static Fixed {
    static EXPORTS: OnceLock<Fixed> = OnceLock::new();
    EXPORTS.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("loopd-fuzz-handshake-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let p = DeviceParams {
            path: path.clone(),
            name: String::new(),
            cache: CacheMode::Buffered,
            create: Some(1 << 20),
            ..DeviceParams::default()
        };
        let dev = Device::open(&p).expect("open the fuzz device");
        let _ = std::fs::remove_file(&path);
        Fixed(Arc::new(dev))
    })
}

struct Mem {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for Mem {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Mem {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// Drive the handshake sans-I/O over `data` with `tls`; a `STARTTLS` it
/// acknowledges is taken as a TLS handshake that proved one identity, and the
/// rest of `data` as what came over TLS.
fn drive(data: &[u8], tls: TlsMode) -> (Result<Option<Negotiated<(), Arc<Device>>>, HandshakeError>, Vec<u8>) {
    let ex = exports();
    let mut h = Handshake::new(Policy { list: true, tls });
    let mut out = std::mem::take(&mut h.out);
    let mut at = 0;
    let r = loop {
        if at == data.len() {
            break if h.at_boundary() {
                Ok(None)
            } else {
                Err(HandshakeError::Truncated)
            };
        }
        assert!(h.want() >= 1);
        let n = h.want().min(data.len() - at);
        let step = h.feed(&data[at..at + n], ex);
        at += n;
        out.append(&mut h.out);
        match step {
            Ok(Step::More) => {}
            Ok(Step::StartTls) => {
                assert!(tls != TlsMode::Off, "STARTTLS acknowledged with TLS off");
                h.tls_started(vec!["fuzz".into()]);
            }
            Ok(Step::Done(d)) => break Ok(d),
            Err(e) => break Err(e),
        }
    };
    (r, out)
}

/// What the server wrote: the hello, well-formed option replies, and only
/// after a successful EXPORT_NAME its 10 or 134 bytes.
fn check(r: &Result<Option<Negotiated<(), Arc<Device>>>, HandshakeError>, out: &[u8]) {
    let ex = exports();
    assert!(out.len() >= 18 && be64(out, 0) == NBDMAGIC);
    let mut at = 18;
    while out.len() - at >= 20 && be64(out, at) == OPT_REPLY_MAGIC {
        let len = be32(out, at + 16) as usize;
        assert!(out.len() - at - 20 >= len, "truncated option reply");
        at += 20 + len;
    }
    let rest = out.len() - at;
    if rest != 0 {
        assert!(
            matches!(r, Ok(Some(_))) && (rest == 10 || rest == 134),
            "{rest} stray bytes"
        );
    }
    if let Ok(Some(n)) = r {
        assert!(Arc::ptr_eq(&n.dev, &ex.0));
        assert!(n.structured || !n.meta_context);
        assert!(n.structured || !n.extended);
        assert_eq!(n.tls, !n.identities.is_empty());
    }
}

fuzz_target!(|data: &[u8]| {
    let ex = exports();
    let mut m = Mem {
        input: Cursor::new(data.to_vec()),
        output: Vec::new(),
    };
    let r = negotiate(&mut m, ex);
    check(&r, &m.output);
    // The sans-I/O machine with TLS off says the same as the blocking driver.
    let (r_off, out_off) = drive(data, TlsMode::Off);
    assert_eq!(r.is_ok(), r_off.is_ok());
    if r.is_ok() {
        assert_eq!(out_off, m.output);
    }
    for tls in [TlsMode::On, TlsMode::Require] {
        let (r, out) = drive(data, tls);
        check(&r, &out);
        if tls == TlsMode::Require
            && let Ok(Some(n)) = &r
        {
            assert!(
                n.tls,
                "entered transmission without TLS although it is required"
            );
        }
    }
});
