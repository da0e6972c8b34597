//! Admission of connections: one count for the whole server, handshakes
//! included, against `--max-connections`; and, when a limit is reached, which
//! waiting client gives up its place ([`victim`]).
//!
//! A [`Permit`] is taken when a connection is accepted and travels with it
//! (handshake, then reactor, across moves); dropping it, with the connection,
//! gives the place back. Lock-free: one atomic add and one subtract per
//! connection, never per request.
//!
//! [`victim`] is pure: the accept loop (NBD handshakes) and the metrics server
//! (scrapers that have not sent their request) call it with what they know of
//! the clients that hold a place without having been served yet. The policy: a
//! newcomer is never turned away while such a client can be closed instead;
//! the client closed is the one that shows least sign of life (silent longest),
//! from the peer (an IPv4 address, an IPv6 /64, a local uid) holding the most
//! places, so one peer's flood takes places from itself, not from others.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// The server's connection count and its limit.
#[derive(Debug)]
pub struct Admission {
    max: usize,
    open: AtomicUsize,
}

/// One admitted connection; see the module documentation.
#[derive(Debug)]
pub struct Permit(Arc<Admission>);

impl Admission {
    pub fn new(max: usize) -> Arc<Admission> {
        Arc::new(Admission {
            max,
            open: AtomicUsize::new(0),
        })
    }

    /// Admit one more connection, unless `max` are open.
    pub fn try_admit(self: &Arc<Self>) -> Option<Permit> {
        let mut cur = self.open.load(SeqCst);
        loop {
            if cur >= self.max {
                return None;
            }
            match self
                .open
                .compare_exchange_weak(cur, cur + 1, SeqCst, SeqCst)
            {
                Ok(_) => return Some(Permit(Arc::clone(self))),
                Err(now) => cur = now,
            }
        }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(SeqCst)
    }

    pub fn max(&self) -> usize {
        self.max
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, SeqCst);
    }
}

/// A client's peer as limits count peers: TCP clients by address (IPv6 by
/// /64, which one host or one customer usually holds whole), Unix-socket
/// clients by user (`SO_PEERCRED`; a process id would cost an attacker only a
/// `fork` to change, and the socket's mode grants access by user and group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    /// When it connected.
    pub opened: Instant,
    /// When its last bytes arrived; `None`: it has sent nothing.
    pub heard: Option<Instant>,
}

impl Standing {
    /// How long it has been quiet.
    fn quiet(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.heard.unwrap_or(self.opened))
    }

    /// Its class, lowest first out: silent past `stall`; spoke, then quiet
    /// past `stall`; silent, younger than `stall`; spoke within `stall`.
    fn class(&self, now: Instant, stall: Duration) -> u8 {
        let stalled = self.quiet(now) > stall;
        match (self.heard.is_some(), stalled) {
            (false, true) => 0,
            (true, true) => 1,
            (false, false) => 2,
            (true, false) => 3,
        }
    }
}

/// Which of `all` gives up its place for a newcomer (or to free memory): the
/// first by class (see [`Standing::class`]: a client that has been silent
/// since it connected, for longer than `stall`, goes first; one that is
/// talking goes last), then from the peer holding the most places in `all`,
/// then the one quiet the longest. `None` if `all` is empty.
///
/// So clients that never send a byte are closed before clients that do; a
/// newcomer is safe once its first bytes arrive, and before that only newer
/// silent sockets go after it; and one peer's flood, once it holds more places
/// than anyone else, loses its own places first.
pub fn victim(all: &[Standing], now: Instant, stall: Duration) -> Option<usize> {
    let mut held: HashMap<PeerKey, usize> = HashMap::new();
    for s in all {
        *held.entry(s.peer).or_default() += 1;
    }
    all.iter()
        .enumerate()
        .min_by_key(|(_, s)| {
            let n = held.get(&s.peer).copied().unwrap_or(0);
            (
                s.class(now, stall),
                std::cmp::Reverse(n),
                std::cmp::Reverse(s.quiet(now)),
            )
        })
        .map(|(i, _)| i)
}

/// [`victim`], except that a client whose bytes have arrived but not been
/// read yet (`waiting(i)`: a caller's zero-timeout poll) has spoken: it is
/// marked heard at `now` in `all` and the choice made again. A client that
/// talked while the caller was busy accepting is thus not taken for a silent
/// one. If every client has bytes waiting, the choice among them stands.
pub fn victim_checked(
    all: &mut [Standing],
    now: Instant,
    stall: Duration,
    mut waiting: impl FnMut(usize) -> bool,
) -> Option<usize> {
    for _ in 0..all.len() {
        let i = victim(all, now, stall)?;
        if all[i].heard.is_some_and(|h| h >= now) || !waiting(i) {
            return Some(i);
        }
        all[i].heard = Some(now);
    }
    victim(all, now, stall)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_max_and_again_after_a_permit_is_dropped() {
        let a = Admission::new(2);
        let p1 = a.try_admit().expect("first");
        let _p2 = a.try_admit().expect("second");
        assert!(a.try_admit().is_none(), "third is refused");
        assert_eq!(a.open(), 2);
        drop(p1);
        assert_eq!(a.open(), 1);
        assert!(a.try_admit().is_some());
    }

    fn at(peer: PeerKey, now: Instant, opened_ago: u64, heard_ago: Option<u64>) -> Standing {
        let ms = Duration::from_millis;
        Standing {
            peer,
            opened: now - ms(opened_ago),
            heard: heard_ago.map(|h| now - ms(h)),
        }
    }

    const A: PeerKey = PeerKey::V4(Ipv4Addr::new(192, 0, 2, 1));
    const B: PeerKey = PeerKey::V4(Ipv4Addr::new(192, 0, 2, 2));
    const STALL: Duration = Duration::from_secs(2);

    #[test]
    fn a_silent_socket_goes_before_a_talking_client() {
        let now = Instant::now() + Duration::from_secs(60);
        // A client mid-handshake (spoke 1 ms ago) and silent sockets, older
        // and younger than the stall time.
        let all = [
            at(B, now, 3_000, Some(1)),
            at(A, now, 500, None),
            at(A, now, 2_500, None),
            at(A, now, 100, None),
        ];
        assert_eq!(victim(&all, now, STALL), Some(2));
        // With only young silent sockets, the oldest of them, still not the
        // talking client.
        let all = [
            at(B, now, 3_000, Some(1)),
            at(A, now, 5, None),
            at(A, now, 9, None),
        ];
        assert_eq!(victim(&all, now, STALL), Some(2));
        // A client that spoke and then stalled goes before young silent ones.
        let all = [at(A, now, 9, None), at(B, now, 9_000, Some(5_000))];
        assert_eq!(victim(&all, now, STALL), Some(1));
    }

    #[test]
    fn the_peer_holding_most_places_gives_one_up() {
        let now = Instant::now() + Duration::from_secs(60);
        // B's socket is older, but A holds three places.
        let all = [
            at(B, now, 1_000, None),
            at(A, now, 10, None),
            at(A, now, 20, None),
            at(A, now, 30, None),
        ];
        assert_eq!(victim(&all, now, STALL), Some(3));
        assert_eq!(victim(&[], now, STALL), None);
    }

    #[test]
    fn a_client_whose_bytes_wait_unread_is_not_taken_for_silent() {
        let now = Instant::now() + Duration::from_secs(60);
        let mut all = [
            at(A, now, 3_000, None),
            at(A, now, 2_000, None),
            at(B, now, 10, Some(5)),
        ];
        // The oldest silent one has sent its first bytes meanwhile.
        assert_eq!(victim_checked(&mut all, now, STALL, |i| i == 0), Some(1));
        assert_eq!(all[0].heard, Some(now));
        // Everyone has: the choice among them stands, and ends.
        let mut all = [at(A, now, 3_000, None), at(B, now, 2_000, None)];
        assert!(victim_checked(&mut all, now, STALL, |_| true).is_some());
    }

    #[test]
    fn peers_are_addresses_ipv6_prefixes_and_users() {
        let v6 = |s: &str| PeerKey::of_ip(s.parse().unwrap());
        assert_eq!(v6("2001:db8::1"), v6("2001:db8::ffff:2"));
        assert_ne!(v6("2001:db8::1"), v6("2001:db8:0:1::1"));
        assert_eq!(v6("::ffff:192.0.2.1"), A);
        assert_eq!(v6("2001:db8::1").to_string(), "2001:db8::/64");
        assert_eq!(A.to_string(), "192.0.2.1");
        assert_eq!(PeerKey::Uid(1000).to_string(), "uid 1000");
    }
}
