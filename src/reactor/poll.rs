//! Adaptive busy-polling before a reactor goes to sleep.
//!
//! Waking a thread that sleeps on another CPU costs an inter-processor interrupt,
//! and on a virtual machine whose idle vCPUs halt (no guest halt-polling) it costs
//! a round trip through the hypervisor: ~30 µs per wake-up on the machines loopd is
//! benchmarked on, against ~2 µs for a request served from the page cache. A client
//! at queue depth 1 pays that twice per request. So before blocking in the ring, a
//! reactor that recently found work soon after going idle spins for a short window,
//! watching the ring for completions or pending task work without a system call.
//!
//! The window adapts per reactor, like QEMU's `poll-max-ns`: it grows (doubling
//! from [`START`] up to the configured maximum) while blocking waits turn out short
//! — the event would have been caught by polling — and halves, down to zero, when
//! waits are long, so an idle or slow-client reactor never spins. With a maximum of
//! zero it is off. This type is pure bookkeeping; the reactor does the spinning.

use std::time::Duration;

/// First non-zero window.
pub const START: Duration = Duration::from_micros(4);

/// The default maximum window (`loopd serve --poll-us`).
pub const DEFAULT_MAX_US: u64 = 50;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptivePoll {
    /// How long to spin before the next blocking wait (zero: don't).
    pub window: Duration,
    max: Duration,
}

impl AdaptivePoll {
    pub fn new(max: Duration) -> AdaptivePoll {
        AdaptivePoll {
            window: Duration::ZERO,
            max,
        }
    }

    /// Polling gave the CPU to another runnable task: the CPU is busy, so
    /// wake-ups are cheap and spinning only slows the others. Close the window.
    pub fn contended(&mut self) {
        self.window = Duration::ZERO;
    }

    /// A blocking wait lasted `waited` (polling, if any, had found nothing).
    ///
    /// `waited` includes the wake-up itself, which is what polling saves, so a wait
    /// up to twice the maximum counts as one a longer window would have caught.
    pub fn blocked(&mut self, waited: Duration) {
        if self.max.is_zero() {
            return;
        }
        if waited <= self.max * 2 {
            // Not `clamp`: a maximum below START is allowed (it then is the window).
            self.window = (self.window * 2).max(START).min(self.max);
        } else {
            self.window /= 2;
            if self.window < START {
                self.window = Duration::ZERO;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(50);

    #[test]
    fn off_when_max_is_zero() {
        let mut p = AdaptivePoll::new(Duration::ZERO);
        for _ in 0..10 {
            p.blocked(Duration::from_micros(1));
        }
        assert_eq!(p.window, Duration::ZERO);
    }

    #[test]
    fn short_waits_grow_the_window_to_the_maximum() {
        let mut p = AdaptivePoll::new(MAX);
        assert_eq!(p.window, Duration::ZERO);
        p.blocked(Duration::from_micros(60));
        assert_eq!(p.window, START);
        for _ in 0..10 {
            p.blocked(Duration::from_micros(60));
        }
        assert_eq!(p.window, MAX);
    }

    #[test]
    fn long_waits_shrink_the_window_to_zero() {
        let mut p = AdaptivePoll::new(MAX);
        for _ in 0..10 {
            p.blocked(Duration::from_micros(10));
        }
        assert_eq!(p.window, MAX);
        p.blocked(Duration::from_millis(5));
        assert_eq!(p.window, MAX / 2);
        for _ in 0..10 {
            p.blocked(Duration::from_millis(5));
        }
        assert_eq!(p.window, Duration::ZERO);
    }

    #[test]
    fn a_maximum_below_the_start_window_is_the_window() {
        for us in 1..=4 {
            let max = Duration::from_micros(us);
            let mut p = AdaptivePoll::new(max);
            p.blocked(Duration::ZERO);
            assert_eq!(p.window, max);
            p.blocked(Duration::ZERO);
            assert_eq!(p.window, max);
        }
    }

    #[test]
    fn window_never_exceeds_the_maximum() {
        let mut p = AdaptivePoll::new(Duration::from_micros(5));
        for _ in 0..10 {
            p.blocked(Duration::ZERO);
            assert!(p.window <= Duration::from_micros(5));
        }
    }
}
