//! How many lines a connected NBD client can make loopd write about its own
//! connections: the `connected`, `disconnected` and `closing` audit lines.
//!
//! A client allowed to an export can connect and hang up as fast as it likes,
//! and each connection is two audit lines. So these lines are rate-limited per
//! peer (the [`PeerKey`] the handshake limits use: an IPv4 address, an IPv6
//! /64, a Unix-socket user), with a token bucket of [`PEER_BURST`] lines
//! refilled at [`PEER_RATE`] a second, and overall by a second bucket
//! ([`ALL_BURST`], [`ALL_RATE`]), so that no number of peers writes more. A
//! line that is not written is counted, and the next line written for that
//! peer says how many of its lines were left out. A peer's quiet ordinary use
//! (a few connections a minute) never reaches the limit.
//!
//! Contract: one process-wide table behind a mutex, taken once per connect and
//! once per disconnect (never per request); at most [`MAX_PEERS`] peers are
//! remembered (peers whose bucket is full again are forgotten first, then all).

use crate::engine::admit::PeerKey;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Lines a peer may write at once.
pub const PEER_BURST: f64 = 40.0;
/// Lines a second a peer may write once its burst is spent.
pub const PEER_RATE: f64 = 2.0;
/// Lines all peers together may write at once.
pub const ALL_BURST: f64 = 400.0;
/// Lines a second all peers together may write once that burst is spent.
pub const ALL_RATE: f64 = 50.0;
/// Peers remembered.
pub const MAX_PEERS: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
    /// Lines left out since the last one written.
    skipped: u64,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Bucket {
        Bucket {
            tokens: burst,
            at: now,
            skipped: 0,
        }
    }

    fn refill(&mut self, burst: f64, rate: f64, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * rate).min(burst);
        self.at = now;
    }
}

/// The per-peer and overall buckets. See the module documentation.
pub struct Lines {
    peers: HashMap<PeerKey, Bucket>,
    all: Bucket,
}

impl Lines {
    pub fn new(now: Instant) -> Lines {
        Lines {
            peers: HashMap::new(),
            all: Bucket::full(ALL_BURST, now),
        }
    }

    /// Whether a line of `peer`'s may be written at `now`: `Some(n)` with
    /// the number of its lines left out since its last one, or `None` (the
    /// line is counted instead).
    pub fn admit(&mut self, peer: PeerKey, now: Instant) -> Option<u64> {
        if !self.peers.contains_key(&peer) && self.peers.len() >= MAX_PEERS {
            self.forget(now);
        }
        self.all.refill(ALL_BURST, ALL_RATE, now);
        let b = self
            .peers
            .entry(peer)
            .or_insert_with(|| Bucket::full(PEER_BURST, now));
        b.refill(PEER_BURST, PEER_RATE, now);
        if b.tokens < 1.0 || self.all.tokens < 1.0 {
            b.skipped = b.skipped.saturating_add(1);
            return None;
        }
        b.tokens -= 1.0;
        self.all.tokens -= 1.0;
        Some(std::mem::take(&mut b.skipped))
    }

    /// Make room: forget peers whose bucket is full again and who have
    /// nothing left out (they are as if new); if that frees nothing, forget
    /// every peer (so making room costs O(1) per admitted line, amortised,
    /// even against more peers than the table holds: they start afresh, still
    /// under the overall bucket).
    fn forget(&mut self, now: Instant) {
        self.peers.retain(|_, b| {
            b.refill(PEER_BURST, PEER_RATE, now);
            b.tokens < PEER_BURST || b.skipped > 0
        });
        if self.peers.len() >= MAX_PEERS / 2 {
            self.peers.clear();
        }
    }
}

/// The process's table.
fn global() -> &'static Mutex<Lines> {
    static L: OnceLock<Mutex<Lines>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(Lines::new(Instant::now())))
}

/// [`Lines::admit`] on the process's table.
pub fn admit(peer: PeerKey) -> Option<u64> {
    let mut l = global().lock().unwrap_or_else(|p| p.into_inner());
    l.admit(peer, Instant::now())
}

/// What a written line adds when some of its peer's were left out.
pub fn left_out(n: u64) -> String {
    match n {
        0 => String::new(),
        n => format!(" ({n} earlier lines of this peer's connections not logged: rate limit)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_peer_gets_its_burst_then_its_rate_and_hears_what_was_left_out() {
        let t0 = Instant::now();
        let mut l = Lines::new(t0);
        let p = PeerKey::Uid(1000);
        for _ in 0..40 {
            assert_eq!(l.admit(p, t0), Some(0));
        }
        for _ in 0..7 {
            assert_eq!(l.admit(p, t0), None);
        }
        // Half a second later, one more token: the line says what was left out.
        assert_eq!(l.admit(p, t0 + Duration::from_millis(500)), Some(7));
        assert_eq!(l.admit(p, t0 + Duration::from_millis(500)), None);
    }

    #[test]
    fn one_peers_flood_leaves_another_peer_its_lines() {
        let t0 = Instant::now();
        let mut l = Lines::new(t0);
        let flood = PeerKey::Uid(6);
        let written = (0..10_000).filter(|_| l.admit(flood, t0).is_some()).count();
        assert_eq!(written, 40);
        assert_eq!(l.admit(PeerKey::Uid(7), t0), Some(0));
    }

    #[test]
    fn many_peers_together_write_at_most_the_overall_burst() {
        let t0 = Instant::now();
        let mut l = Lines::new(t0);
        let written = (0..100_000u32)
            .filter(|i| l.admit(PeerKey::Uid(i % 20_000), t0).is_some())
            .count();
        assert_eq!(written, 400);
        // The table stays bounded.
        assert!(l.peers.len() <= MAX_PEERS);
    }

    #[test]
    fn over_a_minute_a_flooding_peer_writes_its_burst_plus_its_rate() {
        let t0 = Instant::now();
        let mut l = Lines::new(t0);
        let p = PeerKey::V4(std::net::Ipv4Addr::LOCALHOST);
        let written = (0..60_000u64)
            .filter(|ms| l.admit(p, t0 + Duration::from_millis(*ms)).is_some())
            .count();
        // 40 at once, then 2 a second for 60 s (give or take the last one).
        assert!((159..=161).contains(&written), "{written}");
    }
}
