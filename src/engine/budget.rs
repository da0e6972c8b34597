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
//!   lengths. A connection's receive buffer is not charged (bounded by the
//!   connection limit; charging it would let idle connections eat the reserve).
//! - Shares, so that the holder is refused and not everyone. One connection
//!   stops reading past [`Budget::per_connection`] bytes of requests. Each
//!   device's export counts the buffers its requests hold (by capacity), and
//!   a device that already holds some may take more only while its own total
//!   and the daemon's stay within [`Budget::device_share`] (the limit less
//!   [`RESERVE`], or less half of it below twice [`RESERVE`]). The rest, the
//!   reserve, is for devices that hold nothing: each may take one request
//!   there. So however many devices' clients stop reading, a client of
//!   another device gets one request at a time through the reserve.
//! - The progress deadline ([`Budget::reply_timeout`], `--reply-timeout`): the
//!   reserve can still be held, by the first request of a device whose
//!   clients do not read. While any reactor waits for budget, a connection
//!   that holds some and whose pending replies (or the payload of the write
//!   it is receiving) made no progress for that long is disconnected by its
//!   reactor, which frees what it held, and its device is kept out of the
//!   reserve for as long again (so what the cut freed goes to others first). So a client that reads
//!   its replies waits at worst about the deadline for each device whose
//!   clients do not, and not at all when one device is attacked alone. The
//!   kernel's own NBD client (`--blockdev nbd`) reads every reply it is sent:
//!   its socket pairs get [`KERNEL_REPLY_TIMEOUT`] at least, four times the
//!   kernel's own request timeout, so only one truly stuck is cut. ublk
//!   queues use buffers outside the budget. Cost per request with data: one
//!   compare-and-swap on its export's counter when taken, one subtraction
//!   when freed.
//! - A reactor whose connection was refused marks itself starved ([`Budget::starve`])
//!   and tries once more; any release while a reactor is starved wakes every
//!   registered reactor ([`Budget::register`]), so budget freed by one reactor
//!   resumes connections waiting on another. Releasing costs one atomic
//!   subtraction and one load when nobody waits.
//! - The limit must hold the largest request ([`MIN_LIMIT`]), so a connection that
//!   holds nothing always gets its request in once others release theirs.

use crate::device::range_lock::Wake;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, Weak};
use std::time::Duration;

/// Default budget: fits a small machine (a 1 GiB VM keeps most of its memory),
/// and holds a deep queue of large requests on a few connections.
pub const DEFAULT_LIMIT: usize = 256 << 20;
/// Smallest budget: the largest request (32 MiB of data, plus alignment blocks on
/// both sides when bounced) must fit with room to spare.
pub const MIN_LIMIT: usize = 64 << 20;
/// Budget kept from one device's clients for the others: the buffer of the
/// largest request (32 MiB of data bounced with its alignment blocks, in the
/// pool's 64 MiB size class).
pub const RESERVE: usize = 64 << 20;
/// Default progress deadline of a connection holding budget others wait for.
pub const DEFAULT_REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Least progress deadline of the kernel's NBD client (`--blockdev nbd`):
/// four times the request timeout loopd gives the kernel.
pub const KERNEL_REPLY_TIMEOUT: Duration = Duration::from_secs(120);

/// A byte budget shared by every reactor. See the module documentation.
pub struct Budget {
    limit: AtomicUsize,
    used: AtomicUsize,
    /// Reactors that were refused and wait for a release.
    starved: AtomicUsize,
    /// The progress deadline in milliseconds (0: none).
    reply_timeout_ms: AtomicU64,
    wakers: Mutex<Vec<Weak<dyn Wake>>>,
}

/// The process's budget.
pub fn global() -> &'static Budget {
    static B: OnceLock<Budget> = OnceLock::new();
    B.get_or_init(|| Budget::new(DEFAULT_LIMIT))
}

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget {
            limit: AtomicUsize::new(limit.max(MIN_LIMIT)),
            used: AtomicUsize::new(0),
            starved: AtomicUsize::new(0),
            reply_timeout_ms: AtomicU64::new(DEFAULT_REPLY_TIMEOUT.as_secs() * 1000),
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
    /// quarter of the budget (at least one largest request), so a few clients
    /// cannot take it all.
    pub fn per_connection(&self) -> usize {
        (self.limit() / 4).max(MIN_LIMIT / 2)
    }

    /// Bytes of request buffers the clients of one device may hold together:
    /// the limit less [`RESERVE`] (less half the limit when it is below twice
    /// [`RESERVE`]), so another device always finds room.
    pub fn device_share(&self) -> usize {
        let l = self.limit();
        l - RESERVE.min(l / 2)
    }

    /// Set the progress deadline (zero: connections are never cut off).
    pub fn set_reply_timeout(&self, t: Duration) {
        let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX);
        self.reply_timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// How long a connection holding budget others wait for may make no
    /// progress before it is disconnected (`None`: never).
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
    /// device that already holds budget charges up to [`Budget::device_share`],
    /// leaving the rest to devices that hold none.
    pub fn try_charge_upto(&self, n: usize, upto: usize) -> bool {
        let limit = self.limit().min(upto);
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
        self.used.fetch_sub(n, Ordering::SeqCst);
        if self.starved.load(Ordering::SeqCst) > 0 {
            self.wake_all(None);
        }
    }

    /// Whether some reactor waits for budget (pools then free what they release).
    pub fn anyone_starved(&self) -> bool {
        self.starved.load(Ordering::Relaxed) > 0
    }

    /// A reactor was refused: it is woken by the next release. Call before the
    /// last try, so a release between the two cannot be missed. `me` (the
    /// reactor's registration) is not woken by the reclaim call-out to the others,
    /// which free their idle pooled buffers.
    pub fn starve(&self, me: usize) {
        self.starved.fetch_add(1, Ordering::SeqCst);
        self.wake_all(Some(me));
    }

    /// A starved reactor was woken (it marks itself starved again if still refused).
    pub fn fed(&self) {
        let _ = self
            .starved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| s.checked_sub(1));
    }

    /// Register a reactor's waker; returns its registration number.
    pub fn register(&self, w: Weak<dyn Wake>) -> usize {
        let mut ws = match self.wakers.lock() {
            Ok(ws) => ws,
            Err(p) => p.into_inner(),
        };
        if let Some(i) = ws.iter().position(|x| x.strong_count() == 0) {
            ws[i] = w;
            return i;
        }
        ws.push(w);
        ws.len() - 1
    }

    fn wake_all(&self, except: Option<usize>) {
        let ws = match self.wakers.lock() {
            Ok(ws) => ws,
            Err(p) => p.into_inner(),
        };
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

    #[test]
    fn a_device_share_leaves_room_for_the_largest_request() {
        for limit in [MIN_LIMIT, 100 << 20, 2 * RESERVE, DEFAULT_LIMIT, 4 << 30] {
            let b = Budget::new(limit);
            let share = b.device_share();
            let left = limit - share;
            assert!(share >= limit / 2, "{limit}: share {share}");
            if limit >= 2 * RESERVE {
                assert_eq!(left, RESERVE, "{limit}: the rest holds a 64 MiB buffer");
            } else {
                assert!(
                    left >= (32 << 20),
                    "{limit}: a 32 MiB request fits the rest"
                );
            }
        }
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
}
