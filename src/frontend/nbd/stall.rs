//! The progress deadline of a connection that holds memory budget others wait
//! for (see [`crate::engine::budget`]): a client that sends requests and does
//! not take its replies in time (or stops in the middle of a write's payload)
//! must not hold the budget for long — whether it reads nothing or trickles.
//!
//! While some request waits for budget (the daemon's, or a device's share),
//! each reactor's stall timer ticks every [`TICK`] ([`crate::ring::Io::ticks`])
//! and looks at its connections ([`Conn::stall_tick`]). A reply records the
//! tick when it was queued, and a write whose payload is still arriving the
//! tick when its header was read (`Slot::since`). A connection that holds
//! request bytes and whose oldest queued reply (the front of its send queue:
//! replies go out in order) or arriving payload is older than the deadline
//! ([`crate::engine::budget::Budget::reply_timeout`]; the kernel's own client
//! gets at least [`KERNEL_REPLY_TIMEOUT`]) is cut off: its socket is shut
//! down, its file I/O cancelled where the kernel can, and what it held freed
//! as its operations complete; its device is kept out of the budget's reserve
//! for as long again, so what the cut freed goes to others first. Bytes taken
//! now and then do not reset anything: a reply must be *complete* in time, so
//! a client must read what it has outstanding within the deadline (see the
//! budget's module documentation for the rates this means). Ages are counted
//! only in ticks while requests wait, so a reply that had been waiting while
//! nobody needed the budget gets the whole deadline from then on.
//!
//! The cut is logged as an `audit:` line naming the peer and the device,
//! rate-limited per peer with its connect and disconnect lines
//! ([`super::lines`]; every cut is counted in the device's
//! `stalled_clients`). Cost on the data path: one plain store per queued
//! reply (and per write whose payload is received on its own).

use super::conn::Conn;
use super::framing::RecvState;
use crate::engine::budget::{self, KERNEL_REPLY_TIMEOUT};
use crate::ring::Io;
use std::time::Duration;

/// How often a reactor looks at its connections while budget is short.
pub const TICK: Duration = Duration::from_secs(1);

/// Ticks a reply may wait for `limit`: a reply is cut off once older than
/// this many (so it has at least `limit`, and at most one tick more).
fn ticks_for(limit: Duration) -> u32 {
    let tick = TICK.as_millis().max(1);
    u32::try_from(limit.as_millis().div_ceil(tick)).unwrap_or(u32::MAX)
}

/// The oldest of a connection's queued reply and arriving payload, in ticks
/// since it was queued (or its header read) at `reply` / `payload`, at tick
/// `now`; and whether it is a reply. Pure.
fn oldest(now: u32, reply: Option<u32>, payload: Option<u32>) -> Option<(u32, bool)> {
    let r = reply.map(|t| (now.wrapping_sub(t), true));
    let p = payload.map(|t| (now.wrapping_sub(t), false));
    match (r, p) {
        (Some(a), Some(b)) => Some(if a.0 >= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

impl Conn {
    /// One look, at tick `io.ticks`, while requests wait for budget. True: the
    /// connection was cut off (the caller services it).
    pub(crate) fn stall_tick(&mut self, io: &mut Io, ci: u32) -> bool {
        let Some(limit) = budget::global().reply_timeout() else {
            return false;
        };
        if self.dead || self.slots.bytes_held() == 0 {
            return false;
        }
        let reply = self.sendq.front().map(|si| self.slots.get(si).since());
        let payload = match self.framing.state() {
            RecvState::Payload { slot, .. } => Some(self.slots.get(slot).since()),
            _ => None,
        };
        let Some((age, sending)) = oldest(io.ticks, reply, payload) else {
            return false;
        };
        let limit = if self.kernel {
            limit.max(KERNEL_REPLY_TIMEOUT)
        } else {
            limit
        };
        if age <= ticks_for(limit) {
            return false;
        }
        self.cut_stalled(io, ci, sending, limit);
        true
    }

    fn cut_stalled(&mut self, io: &mut Io, ci: u32, sending: bool, limit: Duration) {
        self.dev.stats.stalled_client();
        self.export.shun(limit);
        let what = if sending {
            "a reply was not taken"
        } else {
            "the payload of its write did not arrive"
        };
        if let Some(skipped) = super::lines::admit(self.audit.key) {
            tracing::warn!(
                "audit: closing NBD client {} of {}: {what} within {} s while it held {} bytes \
                 of the memory budget that other requests waited for{}",
                self.audit.who,
                crate::text::quoted(&self.export.name),
                limit.as_secs_f64(),
                self.slots.bytes_held(),
                super::lines::left_out(skipped)
            );
        }
        self.audit.reason = if sending {
            "a reply not taken in time while others waited for memory budget"
        } else {
            "a write payload late while others waited for memory budget"
        };
        // Shutting the socket down fails the send stuck on a client that does
        // not read.
        let _ = rustix::net::shutdown(&self.sock, rustix::net::Shutdown::Both);
        self.cancel_file_ops(io, ci);
        self.kill(io, ci);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_whole_ticks_rounded_up() {
        assert_eq!(ticks_for(Duration::from_secs(10)), 10);
        assert_eq!(ticks_for(Duration::from_millis(2500)), 3);
        assert_eq!(ticks_for(Duration::from_millis(1)), 1);
        assert_eq!(ticks_for(Duration::MAX), u32::MAX);
    }

    #[test]
    fn the_oldest_of_the_reply_and_the_payload_counts() {
        assert_eq!(oldest(10, None, None), None);
        assert_eq!(oldest(10, Some(4), None), Some((6, true)));
        assert_eq!(oldest(10, Some(8), Some(3)), Some((7, false)));
        assert_eq!(oldest(10, Some(3), Some(3)), Some((7, true)));
        // The tick count wraps after 136 years of watching; ages do not care.
        assert_eq!(oldest(2, Some(u32::MAX), None), Some((3, true)));
    }
}
