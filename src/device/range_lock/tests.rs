use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Default)]
struct Count(AtomicUsize);
impl Wake for Count {
    fn wake(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn waker() -> (Arc<Count>, Arc<dyn Wake>) {
    let c = Arc::new(Count::default());
    let w: Arc<dyn Wake> = c.clone();
    (c, w)
}

#[test]
fn shared_ranges_coexist() {
    let l = RangeLock::default();
    let (_, w) = waker();
    let a = l
        .try_lock(0, 100, Mode::Shared, &mut Place::default(), &w)
        .unwrap();
    let b = l
        .try_lock(50, 150, Mode::Shared, &mut Place::default(), &w)
        .unwrap();
    assert_eq!(l.held(), 2);
    l.unlock(a);
    l.unlock(b);
    assert_eq!(l.held(), 0);
}

#[test]
fn exclusive_waits_for_overlapping_shared_and_is_woken() {
    let l = RangeLock::default();
    let (count, w) = waker();
    let a = l
        .try_lock(0, 4096, Mode::Shared, &mut Place::default(), &w)
        .unwrap();
    let mut place = Place::default();
    assert!(
        l.try_lock(1000, 5000, Mode::Exclusive, &mut place, &w)
            .is_none()
    );
    // Disjoint ranges are not held up.
    let c = l
        .try_lock(8192, 9000, Mode::Exclusive, &mut Place::default(), &w)
        .unwrap();
    // Any unlock wakes every waiter (the waker list is then empty); per the
    // contract a woken waiter retries, which records its waker again.
    let before = count.0.load(Ordering::SeqCst);
    l.unlock(c);
    assert!(count.0.load(Ordering::SeqCst) > before);
    assert!(
        l.try_lock(1000, 5000, Mode::Exclusive, &mut place, &w)
            .is_none()
    );
    let before = count.0.load(Ordering::SeqCst);
    l.unlock(a);
    assert!(count.0.load(Ordering::SeqCst) > before);
    let t = l
        .try_lock(1000, 5000, Mode::Exclusive, &mut place, &w)
        .unwrap();
    l.unlock(t);
}

#[test]
fn pending_exclusive_holds_back_new_shared() {
    let l = RangeLock::default();
    let (_, w) = waker();
    let a = l
        .try_lock(0, 10, Mode::Shared, &mut Place::default(), &w)
        .unwrap();
    let mut place = Place::default();
    assert!(l.try_lock(0, 10, Mode::Exclusive, &mut place, &w).is_none());
    // A new reader of the same range queues behind the waiting writer.
    assert!(
        l.try_lock(5, 6, Mode::Shared, &mut Place::default(), &w)
            .is_none()
    );
    l.unlock(a);
    let x = l.try_lock(0, 10, Mode::Exclusive, &mut place, &w).unwrap();
    assert!(
        l.try_lock(5, 6, Mode::Shared, &mut Place::default(), &w)
            .is_none()
    );
    l.unlock(x);
    let r = l
        .try_lock(5, 6, Mode::Shared, &mut Place::default(), &w)
        .unwrap();
    l.unlock(r);
}

#[test]
fn abandoned_waiter_releases_its_place() {
    let l = RangeLock::default();
    let (_, w) = waker();
    let a = l
        .try_lock(0, 10, Mode::Shared, &mut Place::default(), &w)
        .unwrap();
    let mut place = Place::default();
    assert!(l.try_lock(0, 10, Mode::Exclusive, &mut place, &w).is_none());
    l.abandon(&mut place);
    let b = l
        .try_lock(0, 10, Mode::Shared, &mut Place::default(), &w)
        .unwrap();
    l.unlock(a);
    l.unlock(b);
}

#[test]
fn whole_device_mode_serialises_disjoint_exclusive_ranges() {
    let l = RangeLock::whole_device();
    let (_, w) = waker();
    let a = l
        .try_lock(0, 10, Mode::Exclusive, &mut Place::default(), &w)
        .unwrap();
    assert!(
        l.try_lock(100, 110, Mode::Exclusive, &mut Place::default(), &w)
            .is_none()
    );
    l.unlock(a);
}

// ---------------------------------------------------------------------------
// Property: random requesters taking and releasing ranges.

use proptest::prelude::*;

/// One simulated request.
enum Req {
    Idle,
    /// Tried and failed; `seen` is its waker's count at that moment.
    Waiting {
        start: u64,
        end: u64,
        mode: Mode,
        place: Place,
        seen: usize,
    },
    Holding {
        start: u64,
        end: u64,
        mode: Mode,
        ticket: Ticket,
    },
}

/// Requesters share wakers the way a reactor's requests do: 0 and 1 share one.
const REQUESTERS: usize = 5;
const WAKER_OF: [usize; REQUESTERS] = [0, 0, 1, 2, 3];

#[derive(Debug, Clone)]
enum Action {
    /// Requester `who` acts: an idle one tries `[start, start+len)` in `mode`; a
    /// woken waiter retries; a holder releases.
    Step {
        who: usize,
        start: u64,
        len: u64,
        exclusive: bool,
    },
    /// A waiter gives up its place.
    Abandon { who: usize },
}

fn arb_action() -> impl Strategy<Value = Action> {
    prop_oneof![
        8 => (0..REQUESTERS, 0u64..48, 1u64..24, any::<bool>())
            .prop_map(|(who, start, len, exclusive)| Action::Step { who, start, len, exclusive }),
        1 => (0..REQUESTERS).prop_map(|who| Action::Abandon { who }),
    ]
}

struct Sim {
    l: RangeLock,
    counts: Vec<Arc<Count>>,
    wakers: Vec<Arc<dyn Wake>>,
    reqs: Vec<Req>,
}

impl Sim {
    fn new(whole_device: bool) -> Sim {
        let (counts, wakers) = (0..4).map(|_| waker()).unzip();
        Sim {
            l: if whole_device {
                RangeLock::whole_device()
            } else {
                RangeLock::default()
            },
            counts,
            wakers,
            reqs: (0..REQUESTERS).map(|_| Req::Idle).collect(),
        }
    }

    fn count(&self, who: usize) -> usize {
        self.counts[WAKER_OF[who]].0.load(Ordering::SeqCst)
    }

    fn woken(&self, who: usize) -> bool {
        matches!(self.reqs[who], Req::Waiting { seen, .. } if self.count(who) > seen)
    }

    /// Try (or retry) to lock for `who`; updates its state.
    fn attempt(&mut self, who: usize, start: u64, end: u64, mode: Mode, mut place: Place) -> bool {
        let w = Arc::clone(&self.wakers[WAKER_OF[who]]);
        let seen = self.count(who);
        match self.l.try_lock(start, end, mode, &mut place, &w) {
            Some(ticket) => {
                assert_eq!(
                    place,
                    Place::default(),
                    "a granted request keeps no place in line"
                );
                self.reqs[who] = Req::Holding {
                    start,
                    end,
                    mode,
                    ticket,
                };
                true
            }
            None => {
                self.reqs[who] = Req::Waiting {
                    start,
                    end,
                    mode,
                    place,
                    seen,
                };
                false
            }
        }
    }

    /// Release `who`'s range (or abandon its wait). After an unlock, every requester
    /// that failed since its waker last fired must have been woken. (Abandoning a
    /// wait frees nothing anyone waits for unless it held a place in line, so it
    /// need not wake; the final drain checks that nobody is left behind.)
    fn release(&mut self, who: usize) {
        let registered: Vec<usize> = (0..REQUESTERS)
            .filter(|&r| matches!(self.reqs[r], Req::Waiting { .. }) && !self.woken(r))
            .collect();
        let before: Vec<usize> = registered.iter().map(|&r| self.count(r)).collect();
        match std::mem::replace(&mut self.reqs[who], Req::Idle) {
            Req::Holding { ticket, .. } => self.l.unlock(ticket),
            Req::Waiting { mut place, .. } => {
                self.l.abandon(&mut place);
                assert_eq!(place, Place::default());
                return;
            }
            Req::Idle => return,
        }
        for (&r, b) in registered.iter().zip(before) {
            assert!(
                r == who || self.count(r) > b,
                "requester {r} waited but was not woken"
            );
        }
    }

    fn step(&mut self, who: usize, start: u64, len: u64, exclusive: bool) {
        match self.reqs[who] {
            Req::Idle => {
                let mode = if exclusive {
                    Mode::Exclusive
                } else {
                    Mode::Shared
                };
                self.attempt(who, start, start + len, mode, Place::default());
            }
            Req::Waiting {
                start,
                end,
                mode,
                place,
                ..
            } => {
                // Like a reactor, a waiter retries only once it has been woken.
                if self.woken(who) {
                    self.attempt(who, start, end, mode, place);
                }
            }
            Req::Holding { .. } => self.release(who),
        }
    }

    /// No two held ranges overlap unless both are shared; the lock agrees on the count.
    fn check_held(&self, whole_device: bool) {
        let held: Vec<(u64, u64, Mode)> = self
            .reqs
            .iter()
            .filter_map(|r| match *r {
                Req::Holding {
                    start, end, mode, ..
                } => Some((start, end, mode)),
                _ => None,
            })
            .collect();
        assert_eq!(self.l.held(), held.len());
        for (i, a) in held.iter().enumerate() {
            for b in &held[i + 1..] {
                let overlap = whole_device || (a.0 < b.1 && b.0 < a.1);
                assert!(
                    !overlap || (a.2 == Mode::Shared && b.2 == Mode::Shared),
                    "{a:?} and {b:?} both held"
                );
            }
        }
    }

    /// Release everything; woken waiters retry. Every waiter must get its range.
    fn drain(&mut self, whole_device: bool) {
        for _round in 0..4 * REQUESTERS * REQUESTERS {
            let mut progress = false;
            for who in 0..REQUESTERS {
                match self.reqs[who] {
                    Req::Holding { .. } => {
                        self.release(who);
                        progress = true;
                    }
                    Req::Waiting {
                        start,
                        end,
                        mode,
                        place,
                        ..
                    } if self.woken(who) => {
                        self.attempt(who, start, end, mode, place);
                        progress = true;
                    }
                    _ => {}
                }
                self.check_held(whole_device);
            }
            if self.reqs.iter().all(|r| matches!(r, Req::Idle)) {
                return;
            }
            assert!(
                progress,
                "lost wakeup: waiters remain, none woken, nothing held"
            );
        }
        panic!("waiters did not all get their ranges");
    }
}

fn run_sim(actions: &[Action], whole_device: bool) {
    let mut sim = Sim::new(whole_device);
    for a in actions {
        match *a {
            Action::Step {
                who,
                start,
                len,
                exclusive,
            } => sim.step(who, start, len, exclusive),
            Action::Abandon { who } => {
                if matches!(sim.reqs[who], Req::Waiting { .. }) {
                    sim.release(who);
                }
            }
        }
        sim.check_held(whole_device);
    }
    sim.drain(whole_device);
    assert_eq!(sim.l.held(), 0);
}

proptest! {
    #[test]
    fn random_lock_sequences_never_overlap_exclusive_and_never_lose_a_wakeup(
        actions in proptest::collection::vec(arb_action(), 0..80),
        whole_device in prop::bool::weighted(0.2),
    ) {
        run_sim(&actions, whole_device);
    }
}
