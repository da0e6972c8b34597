//! What the attach benchmarks (`attach_latency`, `scale`) share: a control
//! connection, an NBD client's `NBD_OPT_GO`, a timed command, an in-process
//! kernel loop setup, and µs of a duration. (A folder without `main.rs`:
//! Cargo does not take it for an example of its own.)

// Each example uses a part.
#![allow(dead_code)]

use loopd::control::proto::{Request, encode_request};
use loopd::kernel_loop::{self, DirectIo, KernelParams};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// One connection to a daemon's control socket.
pub struct Ctl {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Ctl {
    pub fn connect(p: &Path) -> Ctl {
        let w = UnixStream::connect(p).expect("control");
        Ctl {
            r: BufReader::new(w.try_clone().expect("clone")),
            w,
        }
    }

    /// One request, its reply line (panics on an error reply).
    pub fn call(&mut self, req: &Request) -> String {
        let mut line = encode_request(req);
        line.push('\n');
        self.w.write_all(line.as_bytes()).expect("send");
        let mut reply = String::new();
        self.r.read_line(&mut reply).expect("reply");
        assert!(reply.contains("\"ok\":true"), "control error: {reply}");
        reply
    }
}

/// A fixed-newstyle NBD handshake on `sock` up to an acknowledged
/// `NBD_OPT_GO` of export `name` (it is open for I/O then).
pub fn nbd_go(sock: &Path, name: &str) {
    let mut s = UnixStream::connect(sock).expect("connect nbd");
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).expect("hello");
    s.write_all(&3u32.to_be_bytes()).expect("flags");
    let mut opt = Vec::new();
    opt.extend_from_slice(&0x4948_4156_454F_5054u64.to_be_bytes());
    opt.extend_from_slice(&7u32.to_be_bytes());
    let n = u32::try_from(name.len()).expect("short name");
    opt.extend_from_slice(&(4 + n + 2).to_be_bytes());
    opt.extend_from_slice(&n.to_be_bytes());
    opt.extend_from_slice(name.as_bytes());
    opt.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&opt).expect("go");
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).expect("reply");
        let kind = u32::from_be_bytes([h[12], h[13], h[14], h[15]]);
        let len = u32::from_be_bytes([h[16], h[17], h[18], h[19]]) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).expect("body");
        if kind == 1 {
            return; // ACK: the export is open
        }
        assert!(kind & 0x8000_0000 == 0, "GO {name} failed: reply {kind:#x}");
    }
}

pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Run a command (it must succeed): its wall time and stdout.
pub fn run_timed(cmd: &mut Command) -> (Duration, String) {
    let t = Instant::now();
    let out = cmd.output().expect("spawn");
    let d = t.elapsed();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (d, String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// One in-process `LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE` of `image` (direct
/// I/O, 4 KiB blocks): µs to attach (the detach after it is not timed).
pub fn loop_configure_us(image: &Path) -> f64 {
    let (a, took) = loop_configure(image);
    kernel_loop::detach(&a.device).expect("kernel detach");
    took
}

/// One in-process `LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE` of `image` (direct
/// I/O, 4 KiB blocks), left attached: the device and µs to attach.
pub fn loop_configure(image: &Path) -> (kernel_loop::Attached, f64) {
    let p = KernelParams {
        image: image.to_path_buf(),
        block_size: Some(4096),
        direct_io: DirectIo::On,
        ..Default::default()
    };
    let t = Instant::now();
    let a = kernel_loop::attach(&p).expect("kernel attach");
    (a, us(t.elapsed()))
}
