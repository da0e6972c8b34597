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
    l.unlock(c);
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
