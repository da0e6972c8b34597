//! Rate limits for the log lines clients can cause: a refusal, a timeout, an
//! eviction, a failed or refused handshake, an export list. Each kind of line
//! is a [`Burst`]: the first [`FIRST`] of a [`WINDOW`] are logged as they
//! come, the rest counted, and when the window ends one line says how many
//! more there were and from which peers. So whatever clients do, loopd writes
//! at most `FIRST + 1` lines of each kind per window, each of bounded length
//! (client-supplied strings in them are cut by [`crate::text::clip`]).
//!
//! Owned by the accept loop's thread; no locking. Ticked once per loop turn.

use crate::engine::admit::PeerKey;
use std::time::{Duration, Instant};

/// Lines of one kind logged one by one per window.
pub const FIRST: u32 = 3;
/// How long a window lasts.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Peers named in a summary line.
const PEERS_NAMED: usize = 3;

/// How a kind of line is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// `warn`: the daemon is at a limit.
    Warn,
    /// `info` with the `audit: ` prefix: what a client was refused.
    Audit,
}

/// One kind of line; see the module documentation.
pub struct Burst {
    /// What the summary counts, e.g. "NBD clients refused: unknown export".
    what: &'static str,
    level: Level,
    since: Option<Instant>,
    logged: u32,
    more: u64,
    /// Peers of the lines not logged, the first few.
    peers: Vec<PeerKey>,
    other_peers: bool,
}

impl Burst {
    pub fn new(what: &'static str, level: Level) -> Burst {
        Burst {
            what,
            level,
            since: None,
            logged: 0,
            more: 0,
            peers: Vec::new(),
            other_peers: false,
        }
    }

    /// One more event from `peer`: `line` (made only if it is logged) is
    /// logged if fewer than [`FIRST`] were in this window, else counted.
    pub fn hit(&mut self, now: Instant, peer: PeerKey, line: impl FnOnce() -> String) {
        self.tick(now);
        if self.since.is_none() {
            self.since = Some(now);
        }
        if self.logged < FIRST {
            self.logged += 1;
            let last = if self.logged == FIRST {
                "; further ones are counted"
            } else {
                ""
            };
            self.emit(&format!("{}{last}", line()));
            return;
        }
        self.more += 1;
        if !self.peers.contains(&peer) {
            if self.peers.len() < PEERS_NAMED {
                self.peers.push(peer);
            } else {
                self.other_peers = true;
            }
        }
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
            let mut from: Vec<String> = self.peers.iter().map(ToString::to_string).collect();
            if self.other_peers {
                from.push("others".into());
            }
            self.emit(&format!(
                "{} more {} in the last {} s, from {}",
                self.more,
                self.what,
                WINDOW.as_secs(),
                from.join(", ")
            ));
        }
        self.since = None;
        self.logged = 0;
        self.more = 0;
        self.peers.clear();
        self.other_peers = false;
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
    /// A new client refused: `--max-connections` are all past their handshake.
    pub refused: Burst,
    /// A new client refused: out of descriptors and no handshake to close.
    pub no_fds: Burst,
    /// A stalled handshake closed to make room.
    pub evicted: Burst,
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
            timed_out: Burst::new("NBD clients dropped at the handshake deadline", Level::Warn),
            tls: Burst::new("NBD clients refused for TLS", Level::Audit),
            unknown: Burst::new("NBD clients refused an export", Level::Audit),
            protocol: Burst::new("NBD clients refused for a bad handshake", Level::Audit),
            listed: Burst::new("NBD export listings (given or refused)", Level::Audit),
        }
    }

    fn all(&mut self) -> [&mut Burst; 8] {
        [
            &mut self.refused,
            &mut self.no_fds,
            &mut self.evicted,
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

    #[test]
    fn the_first_lines_are_logged_then_counted_per_window() {
        let mut b = Burst::new("things", Level::Warn);
        let t0 = Instant::now();
        let mut made = 0;
        for i in 0..100u32 {
            b.hit(t0, PeerKey::Uid(i % 5), || {
                made += 1;
                String::from("x")
            });
        }
        assert_eq!(made, FIRST);
        assert_eq!(b.more, 100 - u64::from(FIRST));
        assert_eq!(b.peers.len(), PEERS_NAMED);
        assert!(b.other_peers);
        b.tick(t0 + WINDOW);
        assert_eq!((b.more, b.logged, b.since), (0, 0, None));
        b.hit(t0 + WINDOW, PeerKey::Unknown, || {
            made += 1;
            String::new()
        });
        assert_eq!(made, FIRST + 1, "a new window logs again");
    }
}
