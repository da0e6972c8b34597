//! A byte-range lock with shared and exclusive ranges.
//!
//! Contract: reads and aligned overwrites take a shared range; read-modify-write,
//! `fallocate` and anything that changes the file's size take an exclusive range.
//! The lock never blocks a thread: [`RangeLock::try_lock`] either grants a
//! [`Ticket`] or records the caller's [`Wake`] handle and returns `None`; the
//! caller retries after it is woken. The inner mutex is held only to decide (a scan
//! of the held ranges, at most the number of requests in flight), never across I/O.
//!
//! Fairness: an exclusive request that had to wait is recorded as *pending*; new
//! shared ranges that overlap a pending exclusive wait behind it, so a stream of
//! reads cannot starve a read-modify-write.

use std::sync::{Arc, Mutex, MutexGuard};

/// Whether a range may be shared with other shared holders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Shared,
    Exclusive,
}

/// Something to poke when a range is released; implemented by each reactor.
pub trait Wake: Send + Sync {
    fn wake(&self);
}

/// Proof of a held range; give it back with [`RangeLock::unlock`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a held range must be unlocked"]
pub struct Ticket(u64);

#[derive(Debug, Clone, Copy)]
struct Span {
    id: u64,
    start: u64,
    end: u64,
    mode: Mode,
}

impl Span {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start < end && start < self.end
    }
}

#[derive(Default)]
struct State {
    next_id: u64,
    held: Vec<Span>,
    /// Exclusive requests that tried and had to wait, oldest first.
    pending: Vec<Span>,
    waiters: Vec<Arc<dyn Wake>>,
}

/// The per-device range lock. See the module documentation.
#[derive(Default)]
pub struct RangeLock {
    state: Mutex<State>,
    /// When set, every range is the whole device (the benchmark's "one big lock").
    whole_device: bool,
}

/// A waiting request's place in line (for exclusive requests) between retries.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Place(Option<u64>);

impl RangeLock {
    /// A lock where every range is widened to the whole device: for the
    /// benchmark that shows what range locking buys.
    pub fn whole_device() -> Self {
        RangeLock {
            state: Mutex::default(),
            whole_device: true,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding this mutex cannot leave State inconsistent in a
        // way that matters more than stopping, so recover the guard.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Try to take `[start, end)` in `mode`. On failure the waker is recorded and
    /// will be called when a range is released; call again with the same `place`.
    pub fn try_lock(
        &self,
        start: u64,
        end: u64,
        mode: Mode,
        place: &mut Place,
        waker: &Arc<dyn Wake>,
    ) -> Option<Ticket> {
        let (start, end) = if self.whole_device {
            (0, u64::MAX)
        } else {
            (start, end)
        };
        let mut st = self.state();
        let blocked_by_held = st.held.iter().any(|h| {
            h.overlaps(start, end) && (mode == Mode::Exclusive || h.mode == Mode::Exclusive)
        });
        let my_id = place.0;
        let blocked_by_pending = st
            .pending
            .iter()
            .take_while(|p| Some(p.id) != my_id)
            .any(|p| p.overlaps(start, end));
        if blocked_by_held || blocked_by_pending {
            if mode == Mode::Exclusive && my_id.is_none() {
                let id = st.next_id;
                st.next_id += 1;
                st.pending.push(Span {
                    id,
                    start,
                    end,
                    mode,
                });
                place.0 = Some(id);
            }
            if !st.waiters.iter().any(|w| Arc::ptr_eq(w, waker)) {
                st.waiters.push(Arc::clone(waker));
            }
            return None;
        }
        let id = match my_id {
            Some(id) => {
                st.pending.retain(|p| p.id != id);
                *place = Place(None);
                id
            }
            None => {
                let id = st.next_id;
                st.next_id += 1;
                id
            }
        };
        st.held.push(Span {
            id,
            start,
            end,
            mode,
        });
        Some(Ticket(id))
    }

    /// Release a range and wake everyone who waited.
    pub fn unlock(&self, ticket: Ticket) {
        let waiters = {
            let mut st = self.state();
            if let Some(i) = st.held.iter().position(|h| h.id == ticket.0) {
                st.held.swap_remove(i);
            }
            if st.waiters.is_empty() {
                return;
            }
            std::mem::take(&mut st.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }

    /// Give up waiting (the request was cancelled): drop its place in line.
    pub fn abandon(&self, place: &mut Place) {
        let Some(id) = place.0.take() else { return };
        let waiters = {
            let mut st = self.state();
            st.pending.retain(|p| p.id != id);
            std::mem::take(&mut st.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }

    /// Whether this is the benchmark's one-lock-per-device variant.
    pub fn is_whole_device(&self) -> bool {
        self.whole_device
    }

    /// Number of ranges held now (for stats and tests).
    pub fn held(&self) -> usize {
        self.state().held.len()
    }
}

#[cfg(test)]
mod tests;
