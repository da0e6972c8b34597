//! The daemon-wide memory budget for request and reply buffers, and the shares
//! of it that keep one client, or one device's clients, from holding it all.
//!
//! Contract:
//! - One budget per process ([`global`]), shared by every reactor. Every
//!   [`super::buffer::AlignedBuf`] is charged for its capacity while it exists —
//!   in use by a request, or idle in a reactor's pool — and released when it is
//!   freed, so what is charged is what the buffers occupy in memory.
//! - The limit is enforced where a connection takes a new request: it reserves the
//!   request's data buffer ([`super::buffer::Pool::reserve`]) before it parses the
//!   request, and when the reservation fails it stops reading (backpressure)
//!   instead of allocating; a BLOCK_STATUS reserves its reply descriptors the
//!   same way. Small buffers taken elsewhere (read-modify-write edges, the
//!   zero-fill of a write-zeroes the filesystem cannot allocate) are charged
//!   without asking: they are bounded by connections × slots, not by clients'
//!   lengths. A connection's receive buffer is not charged: an idle one holds
//!   a small buffer of its own, a busy one the 64 KiB one its reactor lends
//!   it ([`super::buffer::Lender`]) until it is idle again (bounded by the
//!   connection limit; charging it would let busy connections eat the
//!   reserve).
//! - Shares, so that the holder is refused and not everyone. One connection
//!   stops reading past [`Budget::per_connection`] bytes of requests. Each
//!   device's export counts the buffers its requests hold (by capacity; a
//!   spliced read holds none once its data goes through pipes), and a device
//!   that already holds some may take more only while its own total and the
//!   daemon's stay within [`Budget::device_share`]: the limit less [`RESERVE`],
//!   the buffer of the largest request (a 32 MiB request bounced with its
//!   alignment blocks, in the pool's 64 MiB size class). A request refused by
//!   its *device's* share waits for that device's own requests to give theirs
//!   back (`Export::unhold` wakes it), and does not put the daemon in the
//!   starved mode below.
//! - The reserve, the rest: only devices that hold nothing may take from it,
//!   one request each (their later requests are held to the share), and in
//!   turn: while nobody waits, such a request takes what is left of the
//!   reserve if it fits; a device whose request fits neither in the share nor
//!   there takes a place in line ([`Budget::reserve_turn`]), and the device
//!   at the head of the line takes the next room that frees, before any
//!   device behind it (and before newcomers). A place not asked for again within
//!   [`LINE_STALE`] lapses (its client is gone; waiting connections ask at
//!   every release and every second).
//! - The progress deadline ([`Budget::reply_timeout`], `--reply-timeout`):
//!   while some request waits for budget (the daemon's or a device's share),
//!   each reply must be taken by its client within the deadline of being
//!   queued, and each write's payload must arrive within it of its header;
//!   a connection holding budget that is late is disconnected by its reactor,
//!   which frees what it held, and its device is kept out of the reserve for
//!   as long again (see [`crate::device::export::Export::shun`]). A client
//!   that reads slowly but steadily is not late as long as it reads what it
//!   has outstanding within the deadline: one 32 MiB read at a time needs
//!   3.2 MiB/s with the default 10 s, the most a connection may have
//!   outstanding ([`Budget::per_connection`], 64 MiB by default) 6.4 MiB/s.
//!   So however many devices' clients hold budget without reading, each
//!   request in the reserve is answered or cut off within about the deadline
//!   of its reply being queued, and a client of a device that holds nothing
//!   waits for budget at worst about the deadline (plus a second) for each
//!   turn ahead of it in the reserve's line. The kernel's own NBD client
//!   (`--blockdev nbd`) reads every reply it is sent: its socket pairs get
//!   [`KERNEL_REPLY_TIMEOUT`] at least, four times the kernel's own request
//!   timeout, so only one truly stuck is cut. ublk queues use buffers
//!   outside the budget. Cost per request with data: one compare-and-swap on
//!   its export's counter and, for a device that held nothing, one load of
//!   the line's length when taken; one subtraction and one load when freed;
//!   a plain store of the reactor's tick count when its reply is queued.
//! - A reactor whose connection was refused by the daemon's budget (not a
//!   device's share) marks itself starved ([`Budget::starve`]) and tries once
//!   more; any release while a reactor is starved wakes every registered
//!   reactor ([`Budget::register`]), so budget freed by one reactor resumes
//!   connections waiting on another. While one is starved, pools give back
//!   their idle buffers. Releasing costs one atomic subtraction and one load
//!   when nobody waits. Every reactor with a connection waiting also retries
//!   it every second, as a backstop.
//! - Orderings: a waiter publishes that it waits (`starved`, an export's
//!   share waiters), then reads the counter again; a releaser changes the
//!   counter, then reads whether anyone waits. All four are `SeqCst`, so in
//!   their single order either the waiter's second read sees the release or
//!   the releaser sees the waiter (the store-buffer pattern, which weaker
//!   orderings allow both to miss). On x86 a `SeqCst` read-modify-write is
//!   the same locked instruction as a relaxed one and a `SeqCst` load a
//!   plain load, so the data path pays nothing for it there.
//! - The limit must hold the largest request twice over ([`MIN_LIMIT`]): once in
//!   the share, so a device alone gets any request in, and once in the
//!   reserve, so another device gets any request in beside it.

use crate::device::range_lock::Wake;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Default budget: fits a small machine (a 1 GiB VM keeps most of its memory),
/// and holds a deep queue of large requests on a few connections.
pub const DEFAULT_LIMIT: usize = 256 << 20;
/// Smallest budget: the largest request's buffer (a 32 MiB request bounced
/// with its alignment blocks: the pool's 64 MiB size class) fits in the share
/// and again in the reserve. Below this, one device holding its share would
/// leave no room for another device's largest request.
pub const MIN_LIMIT: usize = 2 * RESERVE;
/// Budget kept from devices that hold some for those that hold none: the
/// buffer of the largest request (32 MiB of data bounced with its alignment
/// blocks, in the pool's 64 MiB size class).
pub const RESERVE: usize = 64 << 20;
/// Default progress deadline of a connection holding budget others wait for.
pub const DEFAULT_REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Least progress deadline of the kernel's NBD client (`--blockdev nbd`):
/// four times the request timeout loopd gives the kernel.
pub const KERNEL_REPLY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a device keeps its place in the reserve's line without asking
/// again (a waiting connection asks at every release and every second).
pub const LINE_STALE: Duration = Duration::from_secs(3);
/// How long after the last refusal by a device's share reactors keep
/// watching for late replies.
const SHARE_WAIT_FRESH_MS: u64 = 2000;

/// A byte budget shared by every reactor. See the module documentation.
pub struct Budget {
    limit: AtomicUsize,
    used: AtomicUsize,
    /// Reactors that were refused and wait for a release.
    starved: AtomicUsize,
    /// The progress deadline in milliseconds (0: none).
    reply_timeout_ms: AtomicU64,
    /// When a request was last refused by its device's share ([`now_ms`]; 0:
    /// never).
    share_refused_ms: AtomicU64,
    /// Devices waiting for the reserve, in turn: (key, when it last asked).
    line: Mutex<VecDeque<(usize, u64)>>,
    /// `line.len()`, read without the lock.
    line_len: AtomicUsize,
    wakers: Mutex<Vec<Weak<dyn Wake>>>,
}

/// The process's budget.
pub fn global() -> &'static Budget {
    static B: OnceLock<Budget> = OnceLock::new();
    B.get_or_init(|| Budget::new(DEFAULT_LIMIT))
}

/// Milliseconds since the first call, never 0 (a monotonic clock for the
/// slow paths: refusals, the line, the stall timer).
pub fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let ms = START.get_or_init(Instant::now).elapsed().as_millis();
    u64::try_from(ms).unwrap_or(u64::MAX).saturating_add(1)
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget {
            limit: AtomicUsize::new(limit.max(MIN_LIMIT)),
            used: AtomicUsize::new(0),
            starved: AtomicUsize::new(0),
            reply_timeout_ms: AtomicU64::new(DEFAULT_REPLY_TIMEOUT.as_secs() * 1000),
            share_refused_ms: AtomicU64::new(0),
            line: Mutex::new(VecDeque::new()),
            line_len: AtomicUsize::new(0),
            wakers: Mutex::new(Vec::new()),
        }
    }

    /// Set the limit (raised to [`MIN_LIMIT`]); buffers already charged stay.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit.max(MIN_LIMIT), Ordering::Relaxed);
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Bytes of requests one connection may hold before it stops reading: a
    /// quarter of the budget, and at least one largest request's buffer, so
    /// a few clients cannot take it all.
    pub fn per_connection(&self) -> usize {
        (self.limit() / 4).max(RESERVE)
    }

    /// Bytes of request buffers the devices that hold some may hold together
    /// (and each device alone): the limit less [`RESERVE`], so a device that
    /// holds none always finds room for its largest request.
    pub fn device_share(&self) -> usize {
        self.limit().saturating_sub(RESERVE)
    }

    /// Set the progress deadline (zero: connections are never cut off).
    pub fn set_reply_timeout(&self, t: Duration) {
        let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX);
        self.reply_timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// How long a reply (or a write's payload) may take while requests wait
    /// for budget before its connection is disconnected (`None`: never).
    pub fn reply_timeout(&self) -> Option<Duration> {
        match self.reply_timeout_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Charge `n` bytes if they fit under the limit.
    pub fn try_charge(&self, n: usize) -> bool {
        self.try_charge_upto(n, self.limit())
    }

    /// Charge `n` bytes if they fit under `upto` (at most the limit): a
    /// device's request charges up to [`Budget::device_share`], and only a
    /// device's turn at the reserve up to the limit.
    pub fn try_charge_upto(&self, n: usize, upto: usize) -> bool {
        let limit = self.limit().min(upto);
        // SeqCst: the second read of a starving reactor (see the module doc).
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                u.checked_add(n).filter(|&t| t <= limit)
            })
            .is_ok()
    }

    /// Charge `n` bytes whatever the limit (buffers bounded elsewhere).
    pub fn charge(&self, n: usize) {
        self.used.fetch_add(n, Ordering::SeqCst);
    }

    /// Give back `n` charged bytes; wakes the reactors if one is starved.
    pub fn release(&self, n: usize) {
        // SeqCst both: against `starve` then `try_charge_upto` (module doc).
        self.used.fetch_sub(n, Ordering::SeqCst);
        if self.starved.load(Ordering::SeqCst) > 0 {
            self.wake_all(None);
        }
    }

    /// Whether some reactor waits for the daemon's budget (pools then free
    /// what they release). A hint for caching: wake-ups never depend on it.
    pub fn anyone_starved(&self) -> bool {
        self.starved.load(Ordering::Relaxed) > 0
    }

    /// Whether a request waits for budget — the daemon's, or a device's
    /// share lately — so reactors watch for late replies.
    pub fn anyone_waiting(&self) -> bool {
        if self.anyone_starved() {
            return true;
        }
        let t = self.share_refused_ms.load(Ordering::Relaxed);
        t != 0 && now_ms().saturating_sub(t) < SHARE_WAIT_FRESH_MS
    }

    /// A reactor was refused: it is woken by the next release. Call before the
    /// last try, so a release between the two cannot be missed. The first to
    /// starve calls the others out to free their idle pooled buffers (and
    /// watch for late replies); `me` (the reactor's registration) is not
    /// woken by it. Later ones do not: waking a reactor that then retries a
    /// refused connection of its own, starves and wakes the first, and so
    /// on, would keep two reactors spinning while budget is short.
    pub fn starve(&self, me: usize) {
        if self.starved.fetch_add(1, Ordering::SeqCst) == 0 {
            self.wake_all(Some(me));
        }
    }

    /// A starved reactor was woken (it marks itself starved again if still refused).
    pub fn fed(&self) {
        let _ = self
            .starved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| s.checked_sub(1));
    }

    /// A request of reactor `me` was refused by its device's share: it waits
    /// for that device (not starved). The other reactors are told (at most
    /// once a second), so that they watch their connections for late replies.
    pub fn share_refused(&self, me: usize) {
        let now = now_ms();
        let before = self.share_refused_ms.swap(now, Ordering::Relaxed);
        if before == 0 || now.saturating_sub(before) >= 1000 {
            self.wake_all(Some(me));
        }
    }

    /// Device `key`, which holds no budget, needs the reserve for a request:
    /// whether it is its turn (the line is empty, or it is at its head). If
    /// not, it keeps (or takes) its place in line. The caller charges its
    /// request only on its turn, and then calls [`Budget::turn_taken`]. Only
    /// on this slow path (a request the share refused) is the lock taken.
    pub fn reserve_turn(&self, key: usize) -> bool {
        self.reserve_turn_at(key, now_ms())
    }

    fn reserve_turn_at(&self, key: usize, now: u64) -> bool {
        let stale = u64::try_from(LINE_STALE.as_millis()).unwrap_or(u64::MAX);
        let mut line = lock(&self.line);
        line.retain(|&(k, t)| k == key || now.saturating_sub(t) <= stale);
        let turn = match line.iter().position(|&(k, _)| k == key) {
            Some(i) => {
                line[i].1 = now;
                i == 0
            }
            None => {
                line.push_back((key, now));
                line.len() == 1
            }
        };
        self.line_len.store(line.len(), Ordering::Relaxed);
        turn
    }

    /// Whether no device waits for the reserve (one load): a device that
    /// holds nothing may then take from it without a turn.
    pub fn line_empty(&self) -> bool {
        self.line_len.load(Ordering::Relaxed) == 0
    }

    /// Device `key` got its request in (from the reserve, or from the share
    /// after all): it leaves the line. One load when the line is empty.
    pub fn turn_taken(&self, key: usize) {
        if self.line_len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut line = lock(&self.line);
        line.retain(|&(k, _)| k != key);
        self.line_len.store(line.len(), Ordering::Relaxed);
    }

    /// Register a reactor's waker; returns its registration number.
    pub fn register(&self, w: Weak<dyn Wake>) -> usize {
        let mut ws = lock(&self.wakers);
        if let Some(i) = ws.iter().position(|x| x.strong_count() == 0) {
            ws[i] = w;
            return i;
        }
        ws.push(w);
        ws.len() - 1
    }

    fn wake_all(&self, except: Option<usize>) {
        let ws = lock(&self.wakers);
        for (i, w) in ws.iter().enumerate() {
            if Some(i) == except {
                continue;
            }
            if let Some(w) = w.upgrade() {
                w.wake();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn charges_stop_at_the_limit_and_releases_make_room() {
        let b = Budget::new(MIN_LIMIT);
        assert!(b.try_charge(MIN_LIMIT - 10));
        assert!(!b.try_charge(11));
        assert_eq!(b.used(), MIN_LIMIT - 10);
        b.release(MIN_LIMIT - 10);
        assert!(b.try_charge(MIN_LIMIT));
    }

    /// The largest bounced request's buffer (64 MiB class: 32 MiB of data and
    /// its alignment blocks) fits in the share and again in the reserve, at
    /// every budget the command line accepts.
    #[test]
    fn the_share_and_the_reserve_each_hold_the_largest_bounced_request() {
        let largest = crate::engine::buffer::capacity_for((32 << 20) + 2 * 4096);
        assert_eq!(largest, 64 << 20);
        for limit in [MIN_LIMIT, 200 << 20, DEFAULT_LIMIT, 4 << 30] {
            let b = Budget::new(limit);
            let share = b.device_share();
            assert!(share >= largest, "{limit}: share {share}");
            assert!(
                limit - share >= largest,
                "{limit}: reserve {}",
                limit - share
            );
            assert!(b.per_connection() >= largest);
        }
        assert_eq!(Budget::new(64 << 20).limit(), MIN_LIMIT, "raised");
        assert_eq!(Budget::new(DEFAULT_LIMIT).device_share(), 192 << 20);
    }

    #[test]
    fn a_release_wakes_starved_reactors_only_while_one_is_starved() {
        let b = Budget::new(MIN_LIMIT);
        let c = Arc::new(Count(AtomicUsize::new(0)));
        let a: Arc<dyn Wake> = c.clone();
        let me = b.register(Arc::downgrade(&a));
        b.charge(4096);
        b.release(4096);
        let woken = || c.0.load(Ordering::SeqCst);
        assert_eq!(woken(), 0, "nobody starved: no wake-up");
        b.starve(me);
        assert_eq!(woken(), 0, "the starving reactor is not woken by itself");
        b.charge(4096);
        b.release(4096);
        assert_eq!(woken(), 1);
        b.fed();
        b.release(0);
        assert_eq!(woken(), 1);
    }

    #[test]
    fn devices_take_the_reserve_in_turn() {
        let b = Budget::new(MIN_LIMIT);
        assert!(b.reserve_turn(1), "an empty line: device 1's turn");
        assert!(!b.reserve_turn(2), "2 waits behind 1");
        assert!(!b.reserve_turn(3));
        assert!(!b.reserve_turn(2), "asking again keeps its place");
        assert!(b.reserve_turn(1), "1 is still at the head");
        b.turn_taken(1);
        assert!(!b.reserve_turn(3), "3 does not pass 2");
        assert!(b.reserve_turn(2));
        b.turn_taken(2);
        assert!(b.reserve_turn(3));
        b.turn_taken(3);
        assert_eq!(b.line_len.load(Ordering::Relaxed), 0);
        b.turn_taken(4); // not in line: nothing happens
    }

    #[test]
    fn a_place_in_line_not_asked_for_lapses() {
        let b = Budget::new(MIN_LIMIT);
        let stale = u64::try_from(LINE_STALE.as_millis()).unwrap();
        assert!(b.reserve_turn_at(1, 1000));
        assert!(!b.reserve_turn_at(2, 1000));
        assert!(!b.reserve_turn_at(2, 1000 + stale), "1 asked just in time");
        // Device 1's client went away: its place lapses, 2 moves up.
        assert!(b.reserve_turn_at(2, 1001 + stale));
        assert!(!b.reserve_turn_at(1, 1001 + stale), "1 is back, behind 2");
    }

    #[test]
    fn a_refusal_by_a_share_is_told_to_the_others_at_most_once_a_second() {
        let b = Budget::new(MIN_LIMIT);
        let c = Arc::new(Count(AtomicUsize::new(0)));
        let a: Arc<dyn Wake> = c.clone();
        b.register(Arc::downgrade(&a));
        assert!(!b.anyone_waiting());
        b.share_refused(usize::MAX);
        b.share_refused(usize::MAX);
        assert_eq!(c.0.load(Ordering::SeqCst), 1);
        assert!(b.anyone_waiting());
        assert!(!b.anyone_starved(), "a share refusal starves nobody");
    }
}
