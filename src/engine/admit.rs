//! Admission of connections: one count for the whole server, handshakes
//! included, against `--max-connections` (and, if set, per peer against
//! `--max-connections-per-peer`); when the limit is reached, which peer gives
//! up a place ([`Admission::richest`], [`Admission::give_up_newest`]); and
//! which waiting client gives up its place ([`victim`]).
//!
//! A [`Permit`] is taken when a connection is accepted and travels with it
//! (handshake, then reactor, across moves); dropping it, with the connection,
//! gives the place back. Each permit has a [`Ticket`]: who holds the place,
//! whether it is past its handshake, whether it was given up.
//!
//! Locking: one mutex over the per-peer counts, taken once when a connection
//! is admitted, once when it is handed to a reactor and once when it closes —
//! never per request — and held for a few map operations; only
//! [`Admission::richest`] and [`Admission::places`] (called by the accept loop
//! at the limit, once per decision) walk every peer. [`Admission::open`] reads
//! an atomic copy of the count without the lock.
//!
//! Fairness at the limit: a peer may use every place while nobody else wants
//! one. When the limit is reached and a newcomer's peer holds at least two
//! places fewer than the peer holding the most, that peer gives one up — the
//! accept loop first closes one of its handshakes, else
//! [`Admission::give_up_newest`] hands its newest connection's place to the
//! newcomer at once (the ticket is marked, and the reactor holding the
//! connection closes it). So one peer holding every place cannot keep another
//! out, and the holder — not everyone — is refused once places are shared
//! evenly.
//!
//! [`victim`] is pure: the accept loop (NBD handshakes) and the metrics server
//! (scrapers that have not sent their request) call it with what they know of
//! the clients that hold a place without having been served yet. The policy: a
//! newcomer is never turned away while such a client can be closed instead;
//! the client closed is the one that shows least sign of life (silent longest;
//! a client blocked on a reply of ours that it does not take counts as silent
//! since it stopped taking it), from the peer (an IPv4 address, an IPv6 /64, a
//! local uid) holding the most places, so one peer's flood takes places from
//! itself, not from others. [`victim_checked`] looks once, with one probe for
//! all, whether bytes arrived unread: a choice costs O(n), whatever clients do.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The server's connection count, its limits, and who holds the places.
#[derive(Debug)]
pub struct Admission {
    max: usize,
    per_peer: usize,
    /// A copy of `places.open`, for reads without the lock.
    open: AtomicUsize,
    places: Mutex<Places>,
}

#[derive(Debug, Default)]
struct Places {
    /// Places held (tickets given up are not counted: their place went on).
    open: usize,
    peers: HashMap<PeerKey, Held>,
    next_id: u64,
}

/// What one peer holds.
#[derive(Debug, Default)]
struct Held {
    places: usize,
    /// Its connections past their handshake, by ticket id: oldest first.
    established: BTreeMap<u64, Arc<Ticket>>,
}

/// Who holds one place; shared by the [`Permit`] and, for a connection past
/// its handshake, the admission's table (so the place can be given up).
#[derive(Debug)]
pub struct Ticket {
    id: u64,
    peer: PeerKey,
    /// The client as log lines name it (`ADDR:PORT`, `unix uid=U pid=P`).
    who: String,
    /// Given up for a newcomer: the connection must be closed; its place is
    /// already the newcomer's.
    given_up: AtomicBool,
}

impl Ticket {
    pub fn peer(&self) -> PeerKey {
        self.peer
    }

    pub fn who(&self) -> &str {
        &self.who
    }

    /// Whether this connection's place was given to a newcomer (it must close).
    pub fn given_up(&self) -> bool {
        self.given_up.load(SeqCst)
    }
}

/// One admitted connection; see the module documentation.
#[derive(Debug)]
pub struct Permit {
    adm: Arc<Admission>,
    ticket: Arc<Ticket>,
}

impl Permit {
    pub fn ticket(&self) -> &Arc<Ticket> {
        &self.ticket
    }
}

/// Why [`Admission::admit`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// `--max-connections` places are held.
    Full,
    /// The peer holds `--max-connections-per-peer` places.
    PeerFull,
}

impl Admission {
    /// A limit of `max` connections, with no limit per peer but `max`.
    pub fn new(max: usize) -> Arc<Admission> {
        Admission::with_per_peer(max, max)
    }

    /// A limit of `max` connections, `per_peer` of them at most per peer.
    pub fn with_per_peer(max: usize, per_peer: usize) -> Arc<Admission> {
        Arc::new(Admission {
            max,
            per_peer: per_peer.min(max),
            open: AtomicUsize::new(0),
            places: Mutex::new(Places::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Places> {
        // The table stays consistent at every unlock: a panic elsewhere while
        // it was held leaves nothing half done.
        self.places.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admit one more connection of an unnamed peer (the daemon's own
    /// connections), unless the limit is reached.
    pub fn try_admit(self: &Arc<Self>) -> Option<Permit> {
        self.admit(PeerKey::Unknown, String::new()).ok()
    }

    /// Admit one more connection from `peer` (`who` names the client in log
    /// lines), unless `max` places are held or `peer` holds `per_peer`.
    pub fn admit(self: &Arc<Self>, peer: PeerKey, who: String) -> Result<Permit, Refused> {
        let mut p = self.lock();
        if p.open >= self.max {
            return Err(Refused::Full);
        }
        let held = p.peers.get(&peer).map_or(0, |h| h.places);
        if held >= self.per_peer {
            return Err(Refused::PeerFull);
        }
        p.open += 1;
        p.peers.entry(peer).or_default().places += 1;
        self.open.store(p.open, SeqCst);
        let ticket = new_ticket(&mut p, peer, who);
        Ok(Permit {
            adm: Arc::clone(self),
            ticket,
        })
    }

    /// The connection of `permit` is past its handshake: from now on its
    /// place may be given up for a newcomer ([`Admission::give_up_newest`]).
    pub fn established(&self, permit: &Permit) {
        let t = &permit.ticket;
        let mut p = self.lock();
        // `given_up` changes only under the lock.
        if t.given_up() {
            return;
        }
        if let Some(h) = p.peers.get_mut(&t.peer) {
            h.established.insert(t.id, Arc::clone(t));
        }
    }

    /// Places `peer` holds.
    pub fn held(&self, peer: PeerKey) -> usize {
        self.lock().peers.get(&peer).map_or(0, |h| h.places)
    }

    /// Places each peer holds.
    pub fn places(&self) -> HashMap<PeerKey, usize> {
        self.lock()
            .peers
            .iter()
            .map(|(k, h)| (*k, h.places))
            .collect()
    }

    /// The peer holding the most places and how many, if it holds at least
    /// two more than `than` does (so that one place moving from it to `than`
    /// leaves it holding no fewer than `than`: places never go back and
    /// forth). Unnamed peers are never asked to give up places: they may be
    /// many clients.
    pub fn richest(&self, than: PeerKey) -> Option<(PeerKey, usize)> {
        let p = self.lock();
        let mine = p.peers.get(&than).map_or(0, |h| h.places);
        p.peers
            .iter()
            .filter(|(k, _)| **k != than && **k != PeerKey::Unknown)
            .map(|(k, h)| (*k, h.places))
            .max_by_key(|&(k, n)| (n, std::cmp::Reverse(k)))
            .filter(|&(_, n)| n >= mine + 2)
    }

    /// Give the place of `from`'s newest connection past its handshake to a
    /// newcomer from `to` (named `who`): the newcomer's permit, and the
    /// ticket of the connection that must now be closed. `None` if `from`
    /// holds no such connection. The count of open places does not change.
    pub fn give_up_newest(
        self: &Arc<Self>,
        from: PeerKey,
        to: PeerKey,
        who: String,
    ) -> Option<(Permit, Arc<Ticket>)> {
        let mut p = self.lock();
        let held = p.peers.get_mut(&from)?;
        let (_, victim) = held.established.pop_last()?;
        victim.given_up.store(true, SeqCst);
        held.places -= 1;
        if held.places == 0 {
            p.peers.remove(&from);
        }
        p.peers.entry(to).or_default().places += 1;
        let ticket = new_ticket(&mut p, to, who);
        Some((
            Permit {
                adm: Arc::clone(self),
                ticket,
            },
            victim,
        ))
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(SeqCst)
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// `--max-connections-per-peer` (equal to `max` when not set).
    pub fn per_peer(&self) -> usize {
        self.per_peer
    }
}

fn new_ticket(p: &mut Places, peer: PeerKey, who: String) -> Arc<Ticket> {
    p.next_id += 1;
    Arc::new(Ticket {
        id: p.next_id,
        peer,
        who,
        given_up: AtomicBool::new(false),
    })
}

impl Drop for Permit {
    fn drop(&mut self) {
        let t = &self.ticket;
        let mut p = self.adm.lock();
        // `given_up` changes only under the lock.
        if t.given_up() {
            // Its place went to a newcomer when it was given up.
            return;
        }
        p.open = p.open.saturating_sub(1);
        self.adm.open.store(p.open, SeqCst);
        if let Some(h) = p.peers.get_mut(&t.peer) {
            h.established.remove(&t.id);
            h.places = h.places.saturating_sub(1);
            if h.places == 0 {
                p.peers.remove(&t.peer);
            }
        }
    }
}

/// A client's peer as limits count peers: TCP clients by address (IPv6 by
/// /64, which one host or one customer usually holds whole), Unix-socket
/// clients by user (`SO_PEERCRED`; a process id would cost an attacker only a
/// `fork` to change, and the socket's mode grants access by user and group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeerKey {
    V4(Ipv4Addr),
    /// The first 64 bits of an IPv6 address.
    V6([u8; 8]),
    Uid(u32),
    /// The kernel would not say.
    Unknown,
}

impl PeerKey {
    /// The key of a TCP client's address (an IPv4-mapped IPv6 address counts
    /// as the IPv4 one).
    pub fn of_ip(ip: IpAddr) -> PeerKey {
        match ip {
            IpAddr::V4(a) => PeerKey::V4(a),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => PeerKey::V4(v4),
                None => {
                    let mut p = [0u8; 8];
                    p.copy_from_slice(&a.octets()[..8]);
                    PeerKey::V6(p)
                }
            },
        }
    }
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerKey::V4(a) => write!(f, "{a}"),
            PeerKey::V6(p) => {
                let mut o = [0u8; 16];
                o[..8].copy_from_slice(p);
                write!(f, "{}/64", std::net::Ipv6Addr::from(o))
            }
            PeerKey::Uid(u) => write!(f, "uid {u}"),
            PeerKey::Unknown => f.write_str("unnamed peers"),
        }
    }
}

/// What [`victim`] knows of one client holding a place it has not been
/// served in yet (a handshake, a scrape whose request has not arrived).
#[derive(Debug, Clone, Copy)]
pub struct Standing {
    pub peer: PeerKey,
    /// Places its peer holds (the caller counts them once per choice).
    pub held: usize,
    /// When it connected.
    pub opened: Instant,
    /// When its last bytes arrived (or, once it has spoken, when it last took
    /// bytes of a reply); `None`: it has sent nothing.
    pub heard: Option<Instant>,
    /// Since when a reply of ours has waited for it to take more of it, with
    /// no progress (`None`: it is not blocked on a reply). Such a client
    /// counts as silent from then on, whatever bytes it sends meanwhile: the
    /// server reads nothing while a reply waits.
    pub stuck: Option<Instant>,
}

impl Standing {
    /// Whether it counts as having spoken.
    fn spoke(&self) -> bool {
        self.heard.is_some() && self.stuck.is_none()
    }

    /// How long it has been quiet.
    fn quiet(&self, now: Instant) -> Duration {
        let since = self.stuck.or(self.heard).unwrap_or(self.opened);
        now.saturating_duration_since(since)
    }

    /// Its class, lowest first out: silent past `stall`; spoke, then quiet
    /// past `stall`; silent, younger than `stall`; spoke within `stall`.
    fn class(&self, now: Instant, stall: Duration) -> u8 {
        let stalled = self.quiet(now) > stall;
        match (self.spoke(), stalled) {
            (false, true) => 0,
            (true, true) => 1,
            (false, false) => 2,
            (true, false) => 3,
        }
    }

    /// Whether it is silent or quiet past `stall` (the first two classes):
    /// such a client may make room for anyone.
    pub fn stalled(&self, now: Instant, stall: Duration) -> bool {
        self.class(now, stall) <= 1
    }

    /// Whether its bytes, if any arrived unread, would count: it is waiting
    /// for them (not blocked on a reply) and not already heard at `now`.
    fn worth_probing(&self, now: Instant) -> bool {
        self.stuck.is_none() && self.heard.is_none_or(|h| h < now)
    }
}

/// Which of `all` gives up its place for a newcomer (or to free memory): the
/// first by class (see [`Standing::class`]: a client that has been silent
/// since it connected, or blocked on a reply it does not take, for longer
/// than `stall`, goes first; one that is talking goes last), then from the
/// peer holding the most places ([`Standing::held`]), then the one quiet the
/// longest. `None` if `all` is empty. One pass: O(n).
///
/// So clients that never send a byte are closed before clients that do; a
/// newcomer is safe once its first bytes arrive, and before that only newer
/// silent sockets go after it; and one peer's flood, once it holds more places
/// than anyone else, loses its own places first.
pub fn victim(all: &[Standing], now: Instant, stall: Duration) -> Option<usize> {
    victim_among(all, now, stall, |_| true)
}

/// [`victim`] among the clients for which `eligible` holds.
pub fn victim_among(
    all: &[Standing],
    now: Instant,
    stall: Duration,
    eligible: impl Fn(&Standing) -> bool,
) -> Option<usize> {
    all.iter()
        .enumerate()
        .filter(|(_, s)| eligible(s))
        .min_by_key(|(_, s)| {
            (
                s.class(now, stall),
                std::cmp::Reverse(s.held),
                std::cmp::Reverse(s.quiet(now)),
            )
        })
        .map(|(i, _)| i)
}

/// [`victim_among`], except that a client whose bytes have arrived but not
/// been read yet has spoken: it is marked heard at `now` in `all` before the
/// choice. `probe` is asked once, with the indices of the eligible clients
/// that wait for the client's bytes (never one blocked on a reply of ours:
/// its unread bytes are not talk, see [`Standing::stuck`]), and answers
/// those of them whose bytes wait (the caller's one zero-timeout `poll` over
/// them all). A client that talked while the caller was busy accepting is
/// thus not taken for a silent one. One probe and two passes: O(n).
pub fn victim_checked(
    all: &mut [Standing],
    now: Instant,
    stall: Duration,
    eligible: impl Fn(&Standing) -> bool,
    probe: impl FnOnce(&[usize]) -> Vec<usize>,
) -> Option<usize> {
    let ask: Vec<usize> = all
        .iter()
        .enumerate()
        .filter(|(_, s)| eligible(s) && s.worth_probing(now))
        .map(|(i, _)| i)
        .collect();
    if !ask.is_empty() {
        for i in probe(&ask) {
            if let Some(s) = all.get_mut(i)
                && s.stuck.is_none()
            {
                s.heard = Some(now);
            }
        }
    }
    victim_among(all, now, stall, eligible)
}

#[cfg(test)]
mod tests;
