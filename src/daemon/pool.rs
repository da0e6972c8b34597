//! Work spread over a few threads for the time it takes: at start, the
//! devices of the state file are opened, and their block devices made, on a
//! small pool instead of one after another (opening an image and making a
//! block device mostly wait: for the filesystem, for the kernel).
//!
//! Contract: [`each`] runs `f` once per item, on the caller's thread and up to
//! `threads - 1` scoped threads of its own, taking items in order from a shared
//! cursor, and returns once every item is done (the threads are gone). A
//! thread that cannot be started leaves its share to the others (the caller's
//! thread always works), so a shortage of threads slows this down and never
//! fails it. `f` must not panic (the daemon's code never does on input).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Threads for `items` pieces of work: one per `per_thread` items, from 1 to
/// `max`.
pub(super) fn threads_for(items: usize, per_thread: usize, max: usize) -> usize {
    items.div_ceil(per_thread.max(1)).clamp(1, max.max(1))
}

/// Run `f(i, item)` for every item on up to `threads` threads; the results in
/// the items' order.
pub(super) fn each<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    name: &str,
    f: impl Fn(usize, &T) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let work = || {
        let mut out = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else {
                return out;
            };
            out.push((i, f(i, item)));
        }
    };
    let mut done: Vec<(usize, R)> = std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads.min(items.len()))
            .map_while(|_| {
                std::thread::Builder::new()
                    .name(name.to_owned())
                    .spawn_scoped(s, work)
                    .ok()
            })
            .collect();
        let mut all = work();
        for h in helpers {
            // A helper that panicked lost its items' results: `f` must not
            // panic (see the contract); those items are left out.
            if let Ok(v) = h.join() {
                all.extend(v);
            }
        }
        all
    });
    done.sort_unstable_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Mutex;

    #[test]
    fn every_item_once_in_order_on_several_threads() {
        let items: Vec<usize> = (0..500).collect();
        let seen = Mutex::new(HashSet::new());
        let out = each(&items, 4, "test-pool", |i, x| {
            seen.lock().unwrap().insert(std::thread::current().id());
            assert_eq!(i, *x);
            x * 2
        });
        assert_eq!(out, items.iter().map(|x| x * 2).collect::<Vec<_>>());
        assert!(!seen.lock().unwrap().is_empty());
    }

    #[test]
    fn nothing_to_do_and_one_thread_work() {
        let none: Vec<u8> = Vec::new();
        assert!(each(&none, 8, "test-pool", |_, x| *x).is_empty());
        assert_eq!(each(&[1, 2, 3], 1, "test-pool", |_, x| x + 1), [2, 3, 4]);
    }

    #[test]
    fn thread_counts() {
        assert_eq!(threads_for(0, 16, 8), 1);
        assert_eq!(threads_for(10, 16, 8), 1);
        assert_eq!(threads_for(17, 16, 8), 2);
        assert_eq!(threads_for(10_000, 16, 8), 8);
        assert_eq!(threads_for(5, 0, 0), 1);
    }
}
