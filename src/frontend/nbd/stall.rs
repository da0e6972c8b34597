//! The progress deadline of a connection that holds memory budget others wait
//! for (see [`crate::engine::budget`]): a client that sends requests and never
//! reads the replies (or stops in the middle of a write's payload) must not
//! hold the budget for ever.
//!
//! While some reactor waits for budget, each reactor looks at its connections
//! every [`TICK`] ([`Conn::stall_tick`]). A connection that holds request bytes
//! and has replies queued whose sending made no progress since the last look
//! (no bytes taken by the peer), or is receiving a write's payload that made
//! none, counts one more tick; any progress resets the count. At the deadline
//! ([`crate::engine::budget::Budget::reply_timeout`]; the kernel's own client
//! gets at least [`KERNEL_REPLY_TIMEOUT`]) it is cut off: its socket is shut
//! down, its file I/O cancelled where the kernel can, and what it held freed
//! as its operations complete; its device is kept out of the budget's reserve
//! for as long again, so what the cut freed goes to others first. The cut is logged as an `audit:` line naming
//! the peer and the device, rate-limited per peer with its connect and
//! disconnect lines ([`super::lines`]; every cut is counted in the device's
//! `stalled_clients`). Cost on the data path: one counter
//! increment per send and receive completion.

use super::conn::{Conn, RecvState};
use crate::engine::budget::{self, KERNEL_REPLY_TIMEOUT};
use crate::ring::Io;
use std::time::Duration;

/// How often a reactor looks at its connections while budget is short.
pub const TICK: Duration = Duration::from_secs(1);

/// What the last look at a connection saw.
#[derive(Debug, Default)]
pub struct Stall {
    sent: u64,
    received: u64,
    /// Looks in a row that found it holding budget with no progress.
    ticks: u32,
}

impl Conn {
    /// One look, while some reactor waits for budget. True: the connection was
    /// cut off (the caller services it).
    pub fn stall_tick(&mut self, io: &mut Io, ci: u32) -> bool {
        let sending = !self.sendq.is_empty();
        let receiving = matches!(self.recv, RecvState::Payload { .. });
        let progressed = if sending {
            self.sent != self.stall.sent
        } else {
            self.received != self.stall.received
        };
        self.stall.sent = self.sent;
        self.stall.received = self.received;
        let Some(limit) = budget::global().reply_timeout() else {
            return false;
        };
        if self.dead || self.bytes_held == 0 || !(sending || receiving) || progressed {
            self.stall.ticks = 0;
            return false;
        }
        self.stall.ticks = self.stall.ticks.saturating_add(1);
        let limit = if self.kernel {
            limit.max(KERNEL_REPLY_TIMEOUT)
        } else {
            limit
        };
        if TICK * self.stall.ticks < limit {
            return false;
        }
        self.cut_stalled(io, ci, sending, limit);
        true
    }

    fn cut_stalled(&mut self, io: &mut Io, ci: u32, sending: bool, limit: Duration) {
        self.dev.stats.stalled_client();
        self.export.shun(limit);
        let what = if sending {
            "its replies went unread"
        } else {
            "the payload of its write stopped"
        };
        if let Some(skipped) = super::lines::admit(self.audit.key) {
            tracing::warn!(
                "audit: closing NBD client {} of {}: {what} for {} s while it held {} bytes \
                 of the memory budget that other requests waited for{}",
                self.audit.who,
                crate::text::quoted(&self.export.name),
                limit.as_secs(),
                self.bytes_held,
                super::lines::left_out(skipped)
            );
        }
        self.audit.reason = if sending {
            "replies unread while others waited for memory budget"
        } else {
            "write payload stalled while others waited for memory budget"
        };
        // Shutting the socket down fails the send stuck on a client that does
        // not read.
        let _ = rustix::net::shutdown(&self.sock, rustix::net::Shutdown::Both);
        self.cancel_file_ops(io, ci);
        self.kill(io, ci);
    }
}
