//! The whole handshake (`negotiate`) against a client that sends arbitrary bytes,
//! over an in-memory stream. Everything the server writes must be the hello
//! followed by well-formed option replies (and the reply to `EXPORT_NAME`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use loopd::device::{CacheMode, Device, DeviceParams};
use loopd::frontend::nbd::handshake::{Exports, negotiate};
use loopd::frontend::nbd::proto::*;
use std::io::{Cursor, Read, Write};
use std::sync::{Arc, OnceLock};

struct Fixed(Arc<Device>);

impl Exports for Fixed {
    type Client = ();
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

fuzz_target!(|data: &[u8]| {
    let ex = exports();
    let mut m = Mem {
        input: Cursor::new(data.to_vec()),
        output: Vec::new(),
    };
    let r = negotiate(&mut m, ex);
    let out = &m.output;
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
    }
});
