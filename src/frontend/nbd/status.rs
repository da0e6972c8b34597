//! BLOCK_STATUS (`base:allocation`): asked of the backing file off the reactor
//! ([`crate::engine::offload`]), answered as one structured reply chunk
//! (`NBD_REPLY_TYPE_BLOCK_STATUS_EXT`, 64-bit lengths, with extended headers).

use super::conn::Conn;
use super::slots::SlotState;
use crate::block::Extent;
use crate::device::status;
use crate::engine::offload;
use crate::frontend::nbd::proto::*;
use crate::frontend::nbd::wire::{self, Replies};
use crate::ring::Io;
use std::sync::Arc;

impl Conn {
    /// Answer a block-status request off the reactor (its `lseek`s can wait on
    /// the backing file's server): counted in flight like a file operation until
    /// [`Conn::on_status`].
    pub(super) fn block_status(
        &mut self,
        io: &mut Io,
        ci: u32,
        si: u16,
        off: u64,
        len: u32,
        one: bool,
    ) {
        let out = vec![Extent::default(); status::MAX_DESCRIPTORS];
        self.slots.get_mut(si).set_state(SlotState::Io);
        self.file_ops += 1;
        offload::submit(offload::StatusJob {
            dev: Arc::clone(&self.dev),
            off,
            len,
            one,
            out,
            conn: ci,
            slot: si,
            inbox: Arc::clone(&io.inbox),
            gone: Arc::clone(&self.gone),
        });
    }

    /// A block-status request came back from the workers.
    pub(crate) fn on_status(&mut self, io: &mut Io, ci: u32, d: offload::StatusDone) {
        self.file_ops = self.file_ops.saturating_sub(1);
        let si = d.slot;
        if self.dead {
            self.release_slot(io, si);
            return;
        }
        match d.res {
            Ok(n) => {
                self.settle(si);
                let slot = self.slots.get_mut(si);
                let (cookie, offset) = (slot.cookie(), slot.offset());
                let extents = &d.out[..n.min(d.out.len())];
                // Extended headers get 64-bit descriptors (BLOCK_STATUS_EXT).
                if self.replies == Replies::Extended {
                    let mut out = io.pool.get(16 * status::MAX_DESCRIPTORS);
                    let n = wire::encode_extents_ext(out.as_mut_slice(), extents);
                    let count = u32::try_from(n).unwrap_or(0);
                    slot.set_reply(
                        |hdr| {
                            wire::block_status_ext_header(
                                hdr,
                                cookie,
                                offset,
                                BASE_ALLOCATION_ID,
                                count,
                            )
                        },
                        16 * n,
                        Some(out),
                    );
                } else {
                    let mut out = io.pool.get(8 * status::MAX_DESCRIPTORS);
                    let n = wire::encode_extents(out.as_mut_slice(), extents);
                    let count = u32::try_from(n).unwrap_or(0);
                    slot.set_reply(
                        |hdr| wire::block_status_header(hdr, cookie, BASE_ALLOCATION_ID, count),
                        8 * n,
                        Some(out),
                    );
                }
                self.queue(io, si);
            }
            Err(e) => {
                self.finish(io, ci, si, false, Err(e));
            }
        }
    }
}
