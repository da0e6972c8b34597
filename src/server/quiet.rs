//! Rate limits for the log lines clients can cause: a refusal, a timeout, an
//! eviction, a failed or refused handshake, an export list. Each kind of line
//! is a [`Burst`], limited per peer (the [`PeerKey`] the connection limits
//! count under: an IPv4 address, an IPv6 /64, a Unix-socket user): in a
//! [`WINDOW`], the first [`FIRST`] lines of each peer are logged as they come,
//! for the first [`PEERS`] peers to cause one; the rest are counted, and when
//! the window ends one line says how many more there were, from which peers
//! and how many each (the [`NAMED`] peers with the most by name, the others
//! summed). So a few peers repeating a refusal cannot keep another peer's
//! first refusal out of the log, and whatever any number of peers do, loopd
//! writes at most `PEERS × FIRST + 1` lines of each kind per window, each of
//! bounded length (client-supplied strings in them are cut by
//! [`crate::text::clip`]).
//!
//! Owned by the accept loop's thread; no locking. Ticked once per loop turn.
//! Memory: at most [`TRACKED`] peers per kind are counted one by one in a
//! window (the rest are summed), so a flood from many addresses costs a
//! bounded table.

use crate::engine::admit::PeerKey;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Lines of one kind logged one by one per peer and window.
pub const FIRST: u32 = 3;
/// Peers whose lines of one kind are logged one by one per window.
pub const PEERS: usize = 16;
/// How long a window lasts.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Peers named, with their counts, in a summary line.
pub const NAMED: usize = 8;
/// Peers counted one by one per kind and window.
pub const TRACKED: usize = 256;

/// How a kind of line is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// `warn`: the daemon is at a limit.
    Warn,
    /// `info` with the `audit: ` prefix: what a client was refused.
    Audit,
}

/// One peer's lines of one kind in the current window.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    logged: u32,
    more: u64,
}

/// One kind of line; see the module documentation.
pub struct Burst {
    /// What the summary counts, e.g. "NBD clients refused an export".
    what: &'static str,
    level: Level,
    since: Option<Instant>,
    peers: HashMap<PeerKey, Seen>,
    /// Peers whose lines were logged this window.
    logging: usize,
    /// Lines not logged this window (all peers).
    more: u64,
    /// Of those, lines of peers past [`TRACKED`] (not counted one by one).
    untracked: u64,
}

impl Burst {
    pub fn new(what: &'static str, level: Level) -> Burst {
        Burst {
            what,
            level,
            since: None,
            peers: HashMap::new(),
            logging: 0,
            more: 0,
            untracked: 0,
        }
    }

    /// One more event from `peer`: `line` (made only if it is logged) is
    /// logged if the peer's lines are still logged one by one this window,
    /// else counted.
    pub fn hit(&mut self, now: Instant, peer: PeerKey, line: impl FnOnce() -> String) {
        self.tick(now);
        if self.since.is_none() {
            self.since = Some(now);
        }
        let full = self.peers.len() >= TRACKED;
        let Some(seen) = (match self.peers.get_mut(&peer) {
            Some(s) => Some(s),
            None if full => None,
            None => Some(self.peers.entry(peer).or_default()),
        }) else {
            self.more += 1;
            self.untracked += 1;
            return;
        };
        let may = if seen.logged > 0 {
            seen.logged < FIRST
        } else {
            self.logging < PEERS
        };
        if !may {
            seen.more += 1;
            self.more += 1;
            return;
        }
        if seen.logged == 0 {
            self.logging += 1;
        }
        seen.logged += 1;
        let mut tail = String::new();
        if seen.logged == FIRST {
            tail.push_str("; its further ones are counted");
        }
        if seen.logged == 1 && self.logging == PEERS {
            tail.push_str("; those of further peers are counted");
        }
        self.emit(&format!("{}{tail}", line()));
    }

    /// End the window once it has passed, with a count of what was not
    /// logged.
    pub fn tick(&mut self, now: Instant) {
        let Some(t) = self.since else {
            return;
        };
        if now.duration_since(t) < WINDOW {
            return;
        }
        if self.more > 0 {
            let line = self.summary();
            self.emit(&line);
        }
        self.since = None;
        self.peers.clear();
        self.logging = 0;
        self.more = 0;
        self.untracked = 0;
    }

    /// The line counting what was not logged this window: how many, and from
    /// whom (the [`NAMED`] peers with most, then the rest summed).
    fn summary(&self) -> String {
        let mut counted: Vec<(PeerKey, u64)> = self
            .peers
            .iter()
            .filter(|(_, s)| s.more > 0)
            .map(|(k, s)| (*k, s.more))
            .collect();
        counted.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut from: Vec<String> = counted
            .iter()
            .take(NAMED)
            .map(|(k, n)| format!("{k} ({n})"))
            .collect();
        let rest = counted.get(NAMED..).unwrap_or_default();
        let rest_lines = rest.iter().map(|(_, n)| n).sum::<u64>() + self.untracked;
        if rest_lines > 0 {
            let others = if self.untracked > 0 {
                format!("more than {} other peers", rest.len())
            } else {
                format!("{} other peers", rest.len())
            };
            from.push(format!("{rest_lines} from {others}"));
        }
        format!(
            "{} more {} in the last {} s, from {}",
            self.more,
            self.what,
            WINDOW.as_secs(),
            from.join(", ")
        )
    }

    /// When [`Burst::tick`] has a count to write (the end of a window in
    /// which lines were not logged), if it has.
    pub fn due(&self) -> Option<Instant> {
        self.since.filter(|_| self.more > 0).map(|t| t + WINDOW)
    }

    fn emit(&self, line: &str) {
        match self.level {
            Level::Warn => tracing::warn!("{line}"),
            Level::Audit => tracing::info!("audit: {line}"),
        }
    }
}

/// Every kind of line the accept loop writes about clients.
pub struct Lines {
    /// A new client refused at a connection limit.
    pub refused: Burst,
    /// A new client refused: out of descriptors and no handshake to close.
    pub no_fds: Burst,
    /// A stalled handshake closed to make room.
    pub evicted: Burst,
    /// A connection past its handshake closed to make room for another
    /// peer's newcomer.
    pub given_up: Burst,
    /// A handshake past `--handshake-timeout`.
    pub timed_out: Burst,
    /// Refused for TLS: an option in the clear under `--tls require`, or a
    /// TLS handshake that failed (no or a bad client certificate).
    pub tls: Burst,
    /// Refused an export: unknown, or not visible to the client.
    pub unknown: Burst,
    /// Refused for a handshake that breaks the protocol.
    pub protocol: Burst,
    /// `NBD_OPT_LIST`, answered or refused.
    pub listed: Burst,
}

impl Lines {
    pub fn new() -> Lines {
        Lines {
            refused: Burst::new("NBD clients refused at a limit", Level::Warn),
            no_fds: Burst::new(
                "NBD clients refused for want of file descriptors",
                Level::Warn,
            ),
            evicted: Burst::new("stalled NBD handshakes closed to make room", Level::Warn),
            given_up: Burst::new(
                "NBD connections closed to make room for another peer",
                Level::Warn,
            ),
            timed_out: Burst::new("NBD clients dropped at the handshake deadline", Level::Warn),
            tls: Burst::new("NBD clients refused for TLS", Level::Audit),
            unknown: Burst::new("NBD clients refused an export", Level::Audit),
            protocol: Burst::new("NBD clients refused for a bad handshake", Level::Audit),
            listed: Burst::new("NBD export listings (given or refused)", Level::Audit),
        }
    }

    fn all(&mut self) -> [&mut Burst; 9] {
        [
            &mut self.refused,
            &mut self.no_fds,
            &mut self.evicted,
            &mut self.given_up,
            &mut self.timed_out,
            &mut self.tls,
            &mut self.unknown,
            &mut self.protocol,
            &mut self.listed,
        ]
    }

    /// End the windows that have passed.
    pub fn tick(&mut self, now: Instant) {
        for b in self.all() {
            b.tick(now);
        }
    }

    /// The next time [`Lines::tick`] has a count to write.
    pub fn due(&mut self) -> Option<Instant> {
        self.all().iter().filter_map(|b| b.due()).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn v4(d: u8) -> PeerKey {
        PeerKey::V4(Ipv4Addr::new(127, 0, 0, d))
    }

    /// Hits `peer` once; whether the line was made (logged).
    fn logged(b: &mut Burst, now: Instant, peer: PeerKey) -> bool {
        let mut made = false;
        b.hit(now, peer, || {
            made = true;
            String::from("x")
        });
        made
    }

    #[test]
    fn the_first_lines_of_each_peer_are_logged_then_counted_per_window() {
        let mut b = Burst::new("things", Level::Warn);
        let t0 = Instant::now();
        let made = (0..100u32)
            .filter(|i| logged(&mut b, t0, PeerKey::Uid(i % 5)))
            .count();
        assert_eq!(made, 5 * FIRST as usize);
        assert_eq!(b.more, 100 - 5 * u64::from(FIRST));
        let s = b.summary();
        assert!(
            s.starts_with("85 more things in the last 10 s, from uid 0 (17), uid 1 (17)"),
            "{s}"
        );
        b.tick(t0 + WINDOW);
        assert_eq!((b.more, b.logging, b.since), (0, 0, None));
        assert!(b.peers.is_empty());
        assert!(
            logged(&mut b, t0 + WINDOW, PeerKey::Uid(0)),
            "a new window logs again"
        );
    }

    /// F5: three decoy peers repeating a refusal do not keep a fourth
    /// peer's one refusal out of the log.
    #[test]
    fn decoys_cannot_crowd_out_another_peers_line() {
        let mut b = Burst::new("NBD clients refused for TLS", Level::Audit);
        let t0 = Instant::now();
        for round in 0..50 {
            for d in 2..=4 {
                logged(&mut b, t0, v4(d));
            }
            if round == 40 {
                assert!(
                    logged(&mut b, t0, v4(5)),
                    "the fourth peer's line is logged"
                );
            }
        }
        let s = b.summary();
        assert!(
            s.starts_with("141 more NBD clients refused for TLS in the last 10 s, from "),
            "{s}"
        );
        for d in 2..=4 {
            assert!(s.contains(&format!("127.0.0.{d} (47)")), "{s}");
        }
        assert!(!s.contains("127.0.0.5"), "{s}");
    }

    /// Many addresses: at most PEERS × FIRST lines a window, a summary of
    /// bounded length, and a bounded table.
    #[test]
    fn a_flood_from_many_peers_stays_bounded() {
        let mut b = Burst::new("things", Level::Warn);
        let t0 = Instant::now();
        let made = (0..100_000u32)
            .filter(|i| logged(&mut b, t0, PeerKey::Uid(i % 20_000)))
            .count();
        assert_eq!(made, PEERS * FIRST as usize);
        assert!(b.peers.len() <= TRACKED);
        let s = b.summary();
        assert!(s.len() < 600, "{} bytes: {s}", s.len());
        assert!(s.contains("from more than"), "{s}");
        let n: u64 = s.split(' ').next().unwrap().parse().unwrap();
        assert_eq!(n, 100_000 - made as u64);
    }
}
