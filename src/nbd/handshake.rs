//! The fixed-newstyle handshake, driven over a blocking socket.
//!
//! Runs on a short-lived thread per connection (with a socket timeout set by the
//! caller), so a slow or hostile client costs one thread for at most the timeout
//! and never stalls the reactors or the acceptor. It reads exactly the bytes each
//! message declares (after capping them), so nothing of the transmission phase is
//! consumed here. Parsing is in [`super::wire`].

use super::proto::*;
use super::wire::{self, WireError};
use crate::device::Device;
use std::io::{Read, Write};
use std::sync::Arc;
use thiserror::Error;

/// Where the handshake finds exports by name.
pub trait Exports: Send + Sync {
    /// The device exported as `name` (`""` is the default export).
    fn find(&self, name: &str) -> Option<Arc<Device>>;
    /// Every export's name, for `NBD_OPT_LIST`.
    fn names(&self) -> Vec<String>;
}

#[derive(Debug, Error)]
pub enum HandshakeError {
    #[error("socket error during handshake")]
    Io(#[from] std::io::Error),
    #[error("client sent unknown flags {0:#x}")]
    ClientFlags(u32),
    #[error("bad option from client: {0}")]
    Wire(#[from] WireError),
    #[error("client asked for unknown export {0:?} with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    #[error("client sent more than {0} options")]
    TooManyOptions(usize),
}

/// The outcome of a successful handshake.
pub struct Negotiated {
    pub dev: Arc<Device>,
    pub structured: bool,
    pub meta_context: bool,
}

const MAX_OPTIONS: usize = 4096;

/// Transmission flags for a device.
pub fn transmission_flags(dev: &Device, structured: bool) -> u16 {
    let mut f = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_CACHE
        | TFLAG_CAN_MULTI_CONN;
    if dev.read_only {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
    }
    if structured {
        f |= TFLAG_SEND_DF;
    }
    f
}

/// Block sizes advertised for a device: (minimum, preferred, maximum).
pub fn block_sizes(dev: &Device) -> (u32, u32, u32) {
    (dev.block_size, dev.block_size.max(4096), MAX_PAYLOAD)
}

struct Session<'a, S> {
    s: &'a mut S,
    exports: &'a dyn Exports,
    no_zeroes: bool,
    structured: bool,
    meta_context: bool,
    out: Vec<u8>,
}

/// Run the handshake. `Ok(None)` means the client ended it cleanly (ABORT, or
/// closed the socket between options).
pub fn negotiate<S: Read + Write>(
    s: &mut S,
    exports: &dyn Exports,
) -> Result<Option<Negotiated>, HandshakeError> {
    let mut hello = [0u8; 18];
    hello[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    hello[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    hello[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&hello)?;
    let mut cf = [0u8; 4];
    s.read_exact(&mut cf)?;
    let client_flags = u32::from_be_bytes(cf);
    if client_flags & !(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES) != 0 {
        return Err(HandshakeError::ClientFlags(client_flags));
    }
    let mut sess = Session {
        s,
        exports,
        no_zeroes: client_flags & CLIENT_FLAG_NO_ZEROES != 0,
        structured: false,
        meta_context: false,
        out: Vec::with_capacity(256),
    };
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; 16];
        match sess.s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let opt = wire::parse_option_header(&h)?;
        if opt.len > MAX_OPTION_LEN {
            sess.discard(u64::from(opt.len))?;
            sess.reply(opt.option, REP_ERR_TOO_BIG, b"option too long")?;
            continue;
        }
        let mut data = vec![0u8; opt.len as usize];
        sess.s.read_exact(&mut data)?;
        if let Some(done) = sess.option(opt.option, &data)? {
            return Ok(done);
        }
    }
    Err(HandshakeError::TooManyOptions(MAX_OPTIONS))
}

impl<S: Read + Write> Session<'_, S> {
    fn discard(&mut self, mut n: u64) -> std::io::Result<()> {
        let mut buf = [0u8; 4096];
        while n > 0 {
            let k = usize::try_from(n).map_or(buf.len(), |n| n.min(buf.len()));
            self.s.read_exact(&mut buf[..k])?;
            n -= k as u64;
        }
        Ok(())
    }

    fn reply(&mut self, option: u32, kind: u32, payload: &[u8]) -> std::io::Result<()> {
        self.out.clear();
        wire::option_reply(&mut self.out, option, kind, payload);
        self.s.write_all(&self.out)
    }

    /// Handle one option. `Some(outcome)` ends the handshake.
    fn option(
        &mut self,
        option: u32,
        data: &[u8],
    ) -> Result<Option<Option<Negotiated>>, HandshakeError> {
        match option {
            OPT_EXPORT_NAME => {
                let name = std::str::from_utf8(data)
                    .map_err(|_| WireError::Malformed("export name is not UTF-8"))?;
                let Some(dev) = self.exports.find(name) else {
                    return Err(HandshakeError::UnknownExport(name.to_owned()));
                };
                let mut b = Vec::with_capacity(134);
                b.extend_from_slice(&dev.size.to_be_bytes());
                b.extend_from_slice(&transmission_flags(&dev, self.structured).to_be_bytes());
                if !self.no_zeroes {
                    b.extend_from_slice(&[0u8; 124]);
                }
                self.s.write_all(&b)?;
                Ok(Some(Some(self.done(dev))))
            }
            OPT_ABORT => {
                // The client may already have closed; an error here changes nothing.
                let _ = self.reply(option, REP_ACK, &[]);
                Ok(Some(None))
            }
            OPT_LIST => {
                if !data.is_empty() {
                    self.reply(option, REP_ERR_INVALID, b"LIST takes no data")?;
                    return Ok(None);
                }
                for name in self.exports.names() {
                    self.reply(option, REP_SERVER, &wire::rep_server(&name))?;
                }
                self.reply(option, REP_ACK, &[])?;
                Ok(None)
            }
            OPT_INFO | OPT_GO => self.info_or_go(option, data),
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.reply(option, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data")?;
                } else {
                    self.structured = true;
                    self.reply(option, REP_ACK, &[])?;
                }
                Ok(None)
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta(option, data)?;
                Ok(None)
            }
            _ => {
                self.reply(option, REP_ERR_UNSUP, b"option not supported by loopd")?;
                Ok(None)
            }
        }
    }

    fn done(&mut self, dev: Arc<Device>) -> Negotiated {
        Negotiated {
            dev,
            structured: self.structured,
            meta_context: self.meta_context,
        }
    }

    fn info_or_go(
        &mut self,
        option: u32,
        data: &[u8],
    ) -> Result<Option<Option<Negotiated>>, HandshakeError> {
        let req = match wire::parse_info_request(data) {
            Ok(r) => r,
            Err(e) => {
                self.reply(option, REP_ERR_INVALID, e.to_string().as_bytes())?;
                return Ok(None);
            }
        };
        let Some(dev) = self.exports.find(&req.name) else {
            let msg = format!("no export named {:?}", req.name);
            self.reply(option, REP_ERR_UNKNOWN, msg.as_bytes())?;
            return Ok(None);
        };
        let flags = transmission_flags(&dev, self.structured);
        self.reply(option, REP_INFO, &wire::info_export(dev.size, flags))?;
        for &kind in &req.requests {
            match kind {
                INFO_NAME => {
                    self.reply(option, REP_INFO, &wire::info_string(INFO_NAME, &dev.name))?
                }
                INFO_DESCRIPTION => {
                    let desc = format!("loopd: {}", dev.path.display());
                    self.reply(
                        option,
                        REP_INFO,
                        &wire::info_string(INFO_DESCRIPTION, &desc),
                    )?
                }
                INFO_BLOCK_SIZE => {
                    let (min, pref, max) = block_sizes(&dev);
                    self.reply(option, REP_INFO, &wire::info_block_size(min, pref, max))?
                }
                _ => {} // unknown info requests are ignored, as the spec allows
            }
        }
        self.reply(option, REP_ACK, &[])?;
        if option == OPT_GO {
            return Ok(Some(Some(self.done(dev))));
        }
        Ok(None)
    }

    fn meta(&mut self, option: u32, data: &[u8]) -> Result<(), HandshakeError> {
        let listing = option == OPT_LIST_META_CONTEXT;
        if !self.structured {
            self.reply(
                option,
                REP_ERR_INVALID,
                b"negotiate structured replies first",
            )?;
            return Ok(());
        }
        let req = match wire::parse_meta_context_request(data) {
            Ok(r) => r,
            Err(e) => {
                self.reply(option, REP_ERR_INVALID, e.to_string().as_bytes())?;
                return Ok(());
            }
        };
        if self.exports.find(&req.name).is_none() {
            let msg = format!("no export named {:?}", req.name);
            self.reply(option, REP_ERR_UNKNOWN, msg.as_bytes())?;
            return Ok(());
        }
        let selected = if listing && req.queries.is_empty() {
            true
        } else {
            req.queries
                .iter()
                .any(|q| wire::query_selects_base_allocation(q, listing))
        };
        if selected {
            self.reply(
                option,
                REP_META_CONTEXT,
                &wire::rep_meta_context(BASE_ALLOCATION_ID, BASE_ALLOCATION),
            )?;
        }
        if !listing {
            self.meta_context = selected;
        }
        self.reply(option, REP_ACK, &[])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
