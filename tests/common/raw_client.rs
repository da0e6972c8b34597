//! A hand-rolled NBD client over a Unix socket, for tests that send what no
//! real client would (malformed or hostile traffic).

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054; // "IHAVEOPT"
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;

/// A hand-rolled NBD client over a Unix socket.
pub struct RawClient {
    pub s: UnixStream,
}

impl RawClient {
    /// Connects with 10 s read/write timeouts.
    pub fn connect(socket: &Path) -> RawClient {
        let s = UnixStream::connect(socket)
            .unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        RawClient { s }
    }

    pub fn read_exact(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s
            .read_exact(&mut b)
            .unwrap_or_else(|e| panic!("reading {n} bytes from loopd: {e}"));
        b
    }

    pub fn read_u16(&mut self) -> u16 {
        u16::from_be_bytes(self.read_exact(2).try_into().unwrap())
    }

    pub fn read_u32(&mut self) -> u32 {
        u32::from_be_bytes(self.read_exact(4).try_into().unwrap())
    }

    pub fn read_u64(&mut self) -> u64 {
        u64::from_be_bytes(self.read_exact(8).try_into().unwrap())
    }

    pub fn send(&mut self, data: &[u8]) {
        self.s
            .write_all(data)
            .unwrap_or_else(|e| panic!("writing {} bytes to loopd: {e}", data.len()));
    }

    /// Sends bytes the server may legitimately refuse to read (it may already
    /// have closed the connection): EPIPE/ECONNRESET are ignored.
    pub fn send_lossy(&mut self, data: &[u8]) {
        match self.s.write_all(data) {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {}
            Err(e) => panic!("writing {} bytes to loopd: {e}", data.len()),
        }
    }

    /// Reads and checks the server greeting; returns the handshake flags.
    pub fn greeting(&mut self) -> u16 {
        let m = self.read_u64();
        assert_eq!(m, NBDMAGIC, "bad server magic 0x{m:x}");
        let o = self.read_u64();
        assert_eq!(o, IHAVEOPT, "server is not newstyle (got 0x{o:x})");
        let flags = self.read_u16();
        assert!(
            flags & 1 != 0,
            "server does not advertise NBD_FLAG_FIXED_NEWSTYLE (flags 0x{flags:x})"
        );
        flags
    }

    /// Full handshake with NBD_OPT_EXPORT_NAME; returns (client, size, transmission flags).
    pub fn handshake(socket: &Path, name: &str) -> (RawClient, u64, u16) {
        let mut c = RawClient::connect(socket);
        let hflags = c.greeting();
        // FIXED_NEWSTYLE | NO_ZEROES (only if the server offers NO_ZEROES).
        let no_zeroes = hflags & 2 != 0;
        let cflags: u32 = if no_zeroes { 3 } else { 1 };
        c.send(&cflags.to_be_bytes());
        c.send_option(NBD_OPT_EXPORT_NAME, name.as_bytes());
        let size = c.read_u64();
        let tflags = c.read_u16();
        if !no_zeroes {
            c.read_exact(124);
        }
        assert!(
            tflags & 1 != 0,
            "NBD_FLAG_HAS_FLAGS not set (flags 0x{tflags:x})"
        );
        (c, size, tflags)
    }

    pub fn send_option(&mut self, opt: u32, data: &[u8]) {
        let mut b = Vec::new();
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    pub fn request_bytes(
        magic: u32,
        flags: u16,
        typ: u16,
        handle: u64,
        off: u64,
        len: u32,
    ) -> Vec<u8> {
        let mut b = Vec::with_capacity(28);
        b.extend_from_slice(&magic.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&typ.to_be_bytes());
        b.extend_from_slice(&handle.to_be_bytes());
        b.extend_from_slice(&off.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    }

    pub fn send_request(&mut self, flags: u16, typ: u16, handle: u64, off: u64, len: u32) {
        let b = Self::request_bytes(REQUEST_MAGIC, flags, typ, handle, off, len);
        self.send(&b);
    }

    /// Reads a simple reply header; returns (error, handle).
    pub fn read_simple_reply(&mut self) -> (u32, u64) {
        let m = self.read_u32();
        assert_eq!(m, SIMPLE_REPLY_MAGIC, "bad simple reply magic 0x{m:x}");
        let err = self.read_u32();
        let handle = self.read_u64();
        (err, handle)
    }

    /// NBD_CMD_READ; asserts success and returns the data.
    pub fn read(&mut self, handle: u64, off: u64, len: u32) -> Vec<u8> {
        self.send_request(0, NBD_CMD_READ, handle, off, len);
        let (err, h) = self.read_simple_reply();
        assert_eq!(h, handle, "reply handle mismatch");
        assert_eq!(err, 0, "read {off}+{len} failed with NBD error {err}");
        self.read_exact(usize::try_from(len).unwrap())
    }

    /// NBD_CMD_WRITE; returns the NBD error value (0 = success).
    pub fn write(&mut self, handle: u64, off: u64, data: &[u8]) -> u32 {
        self.write_flags(0, handle, off, data)
    }

    /// NBD_CMD_WRITE with command flags (e.g. FUA); returns the NBD error value.
    pub fn write_flags(&mut self, flags: u16, handle: u64, off: u64, data: &[u8]) -> u32 {
        self.send_request(
            flags,
            NBD_CMD_WRITE,
            handle,
            off,
            u32::try_from(data.len()).unwrap(),
        );
        self.send(data);
        let (err, h) = self.read_simple_reply();
        assert_eq!(h, handle, "reply handle mismatch");
        err
    }

    /// Waits (up to the read timeout) for the server to close the connection.
    /// Any bytes the server sends before closing are returned.
    #[track_caller]
    pub fn expect_closed(&mut self, ctx: &str) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match self.s.read(&mut buf) {
                Ok(0) => return got,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    assert!(
                        got.len() < 1 << 20,
                        "{ctx}: server keeps sending data instead of closing"
                    );
                }
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return got,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    panic!("{ctx}: server did not close the connection within 10 s")
                }
                Err(e) => panic!("{ctx}: unexpected read error {e}"),
            }
        }
    }
}
