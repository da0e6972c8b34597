//! Who makes room when a limit is reached, and who is refused.
//!
//! At `--max-connections`, for a newcomer from peer P (see [`PeerKey`]):
//! 1. a handshake that is stalled — silent, or blocked on a reply it does not
//!    take, or quiet past the stall time — is closed, whoever's it is;
//! 2. else, if some peer Q holds at least two places more than P
//!    ([`Admission::richest`]), Q gives one up: one of its handshakes, else
//!    its newest connection past its handshake, whose place goes to the
//!    newcomer at once ([`Admission::give_up_newest`]; every reactor is told,
//!    and the one holding it shuts its socket down);
//! 3. else a handshake of a peer holding no fewer places than P is closed;
//! 4. else the newcomer is refused: its peer holds as many places as anyone
//!    (within one), so the holder, not everyone, is refused.
//!
//! At `--max-connections-per-peer`, one of P's own handshakes makes room, else
//! the newcomer is refused. Out of descriptors or past the handshakes'
//! memory, the handshake with least sign of life goes, whoever's it is.
//!
//! A choice costs one pass over the handshakes and one `poll` over those
//! waiting for the client's bytes ([`victim_checked`]); the per-peer counts are
//! read once per choice.

use crate::engine::admit::{Admission, PeerKey, Permit, Refused, Standing, Ticket, victim_checked};
use crate::reactor::ReactorHandle;
use crate::server::pending::{Pending, Who};
use crate::server::quiet::Lines;
use rustix::event::{PollFd, PollFlags, poll};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which limit made room necessary.
#[derive(Debug, Clone, Copy)]
pub(super) enum Limit {
    Connections(usize),
    PerPeer(usize),
    Descriptors,
    /// The handshakes' buffers reached this many bytes.
    Memory(usize),
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Connections(max) => write!(f, "--max-connections {max} reached"),
            Limit::PerPeer(max) => write!(f, "--max-connections-per-peer {max} reached"),
            Limit::Descriptors => f.write_str("out of file descriptors"),
            Limit::Memory(bytes) => write!(f, "handshakes hold {} MiB of buffers", bytes >> 20),
        }
    }
}

/// Which handshakes may be closed.
#[derive(Debug, Clone, Copy)]
pub(super) enum Which {
    Any,
    /// Only stalled ones ([`Standing::stalled`]).
    Stalled,
    /// Only this peer's.
    Of(PeerKey),
    /// Only those of peers holding at least this many places.
    HoldingAtLeast(usize),
}

/// What the choice needs of the accept loop, borrowed for one choice: the
/// pending handshakes and the memory they hold (kept equal to the sum of their
/// `counted`), the admission, the reactors (told of a given-up place) and the
/// rate-limited log lines.
pub(super) struct Room<'r> {
    pub admission: &'r Arc<Admission>,
    pub reactors: &'r [Arc<ReactorHandle>],
    pub pending: &'r mut Vec<Pending>,
    pub held: &'r mut usize,
    pub lines: &'r mut Lines,
    /// How long a client may be silent before it is the first to go.
    pub stall: Duration,
}

impl Room<'_> {
    /// A place for newcomer `who`, made if a limit is reached (see the module
    /// documentation); `None` if it is refused (the refusal is logged).
    pub(super) fn place_for(&mut self, who: &Who) -> Option<Permit> {
        let adm = Arc::clone(self.admission);
        // Each round that goes on closed a handshake: at most one per handshake.
        loop {
            match adm.admit(who.key, who.name.clone()) {
                Ok(p) => return Some(p),
                Err(Refused::PeerFull) => {
                    let limit = Limit::PerPeer(adm.per_peer());
                    if self.evict(limit, Which::Of(who.key)) {
                        continue;
                    }
                    let n = adm.per_peer();
                    self.lines.refused.hit(Instant::now(), who.key, || {
                        format!(
                            "refusing NBD client {}: its peer {} holds {n} connections \
                             (--max-connections-per-peer {n})",
                            who.name, who.key
                        )
                    });
                    return None;
                }
                Err(Refused::Full) => {
                    let limit = Limit::Connections(adm.max());
                    if self.evict(limit, Which::Stalled) {
                        continue;
                    }
                    if let Some((rich, n)) = adm.richest(who.key) {
                        if self.evict(limit, Which::Of(rich)) {
                            continue;
                        }
                        if let Some((p, victim)) =
                            adm.give_up_newest(rich, who.key, who.name.clone())
                        {
                            self.close_given_up(&victim, n, who, limit);
                            return Some(p);
                        }
                    }
                    let mine = adm.held(who.key);
                    if self.evict(limit, Which::HoldingAtLeast(mine)) {
                        continue;
                    }
                    self.refuse(who, mine);
                    return None;
                }
            }
        }
    }

    /// `victim`'s place went to `who`: every reactor is told to close it.
    fn close_given_up(&mut self, victim: &Arc<Ticket>, held: usize, who: &Who, limit: Limit) {
        for r in self.reactors.iter() {
            r.close_given_up(Arc::clone(victim));
        }
        self.lines.given_up.hit(Instant::now(), victim.peer(), || {
            format!(
                "closing the NBD connection of {}, the newest of the {held} places its peer \
                 {} holds (the most), to make room for {}: {limit}",
                victim.who(),
                victim.peer(),
                who.name
            )
        });
    }

    /// Log the refusal of `who`, whose peer holds `mine` places, at
    /// `--max-connections`.
    fn refuse(&mut self, who: &Who, mine: usize) {
        let max = self.admission.max();
        let open = self.admission.open();
        let waiting = match self.pending.len() {
            0 => "none in its handshake".to_string(),
            n => format!("{n} in their handshake, all of peers holding fewer places"),
        };
        self.lines.refused.hit(Instant::now(), who.key, || {
            format!(
                "refusing new NBD clients: --max-connections {max} reached, {open} \
                 connections open and {waiting}; {} closed (its peer {} holds {mine}, \
                 no other peer two more)",
                who.name, who.key
            )
        });
    }

    /// Close the handshake that shows least sign of life among `which`,
    /// because `limit` is reached; false if there is none.
    pub(super) fn evict(&mut self, limit: Limit, which: Which) -> bool {
        let now = Instant::now();
        let stall = self.stall;
        let places = self.admission.places();
        let mut standings: Vec<Standing> = self
            .pending
            .iter()
            .map(|p| p.standing(places.get(&p.who.key).copied().unwrap_or(0)))
            .collect();
        let eligible = |s: &Standing| match which {
            Which::Any => true,
            Which::Stalled => s.stalled(now, stall),
            Which::Of(k) => s.peer == k,
            Which::HoldingAtLeast(n) => s.held >= n,
        };
        let pending = &mut *self.pending;
        let found = victim_checked(&mut standings, now, stall, eligible, |ask| {
            let waiting = has_input(ask.iter().map(|&i| &pending[i].sock));
            let talked: Vec<usize> = waiting.into_iter().map(|j| ask[j]).collect();
            for &i in &talked {
                // Its bytes arrived while the loop was accepting: it spoke.
                pending[i].heard = Some(now);
            }
            talked
        });
        let Some(i) = found else {
            return false;
        };
        let s = standings[i];
        let p = self.pending.swap_remove(i);
        *self.held -= p.counted;
        let how = if p.stuck.is_some() {
            "not taking its replies"
        } else if p.heard.is_some() {
            "quiet"
        } else {
            "silent since it connected"
        };
        let quiet = now.saturating_duration_since(p.stuck.or(p.heard).unwrap_or(p.opened));
        self.lines.evicted.hit(now, s.peer, || {
            format!(
                "closing the NBD handshake of {}, {how} for {:.1} s, to make room: {limit}",
                p.who.name,
                quiet.as_secs_f64()
            )
        });
        true
    }
}

/// Which of `socks` have bytes (or the end of the stream) waiting to be read:
/// their positions, from one zero-timeout `poll`.
fn has_input<'a>(socks: impl Iterator<Item = &'a std::os::fd::OwnedFd>) -> Vec<usize> {
    let mut fds: Vec<PollFd<'_>> = socks.map(|s| PollFd::new(s, PollFlags::IN)).collect();
    if fds.is_empty() {
        return Vec::new();
    }
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&zero)) {
        Ok(n) if n > 0 => fds
            .iter()
            .enumerate()
            .filter(|(_, f)| !f.revents().is_empty())
            .map(|(i, _)| i)
            .collect(),
        _ => Vec::new(),
    }
}
