//! Group commit: the records of many threads made durable by one write and one
//! sync.
//!
//! Contract: [`GroupCommit::stage`] queues a record and returns its [`Ticket`];
//! records are committed in the order they were staged. [`GroupCommit::wait`]
//! blocks until the batch holding the ticket's record has been committed and
//! returns that batch's outcome. The first waiter that finds no commit running
//! becomes the *leader*: it takes every record queued so far (its batch) and
//! the state, releases the mutex, runs the commit function (a write and a
//! sync), then, holding the mutex again, puts the state back, records the
//! batch's outcome and wakes every waiter. Records staged while a commit runs
//! form the next batch, led by the first of their waiters to run. A failed
//! commit fails every ticket of its batch and no other; the commit function
//! itself leaves the state as it was.
//!
//! Threads and locks: one mutex and one condition variable. The mutex is held
//! only to queue, to hand over a batch and to collect an outcome, never across
//! a commit. The state is touched by one commit at a time, or under the mutex
//! while no commit runs ([`GroupCommit::with`], which waits for a running
//! commit). A caller may hold its own locks across `stage` (that is how it
//! orders records with its own checks) but must hold none across `wait` that a
//! commit function or another stager needs. Every ticket is waited for once.
//! Blocks: `wait` for as long as up to two commits (one running, then its own);
//! `with` for one.

use std::sync::{Condvar, Mutex, MutexGuard};

/// A staged record's place in the queue (see [`GroupCommit::wait`]).
#[derive(Debug)]
#[must_use = "a staged record is acknowledged only once waited for"]
pub struct Ticket(u64);

/// A failed batch: tickets `from..to`, the error, and how many have not yet
/// collected it.
struct Failed<E> {
    from: u64,
    to: u64,
    error: E,
    left: u64,
}

struct Queue<S, R, E> {
    /// `None` while a leader commits.
    state: Option<S>,
    /// The records of tickets `done..next` not yet taken by a leader.
    staged: Vec<R>,
    next: u64,
    /// Tickets below this are committed (or failed).
    done: u64,
    failed: Vec<Failed<E>>,
    /// Batches committed (successful or not).
    commits: u64,
}

/// See the module documentation.
pub struct GroupCommit<S, R, E> {
    q: Mutex<Queue<S, R, E>>,
    cv: Condvar,
}

impl<S, R, E: Clone> GroupCommit<S, R, E> {
    pub fn new(state: S) -> Self {
        GroupCommit {
            q: Mutex::new(Queue {
                state: Some(state),
                staged: Vec::new(),
                next: 0,
                done: 0,
                failed: Vec::new(),
                commits: 0,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue<S, R, E>> {
        // Every critical section leaves the queue consistent.
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue `r` for the next batch.
    pub fn stage(&self, r: R) -> Ticket {
        let mut q = self.lock();
        q.staged.push(r);
        q.next += 1;
        Ticket(q.next - 1)
    }

    /// Queue `rs` together, in order (one batch holds them all).
    pub fn stage_all(&self, rs: Vec<R>) -> Vec<Ticket> {
        let mut q = self.lock();
        let from = q.next;
        q.next += rs.len() as u64;
        q.staged.extend(rs);
        (from..q.next).map(Ticket).collect()
    }

    /// Wait until `t`'s batch is committed (leading it if no commit runs):
    /// `Ok` once its record is durable, or the error that failed its batch.
    /// `commit` writes a batch to the state; it must leave the state as it was
    /// when it fails.
    pub fn wait(
        &self,
        t: Ticket,
        mut commit: impl FnMut(&mut S, Vec<R>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut q = self.lock();
        loop {
            if t.0 < q.done {
                return collect(&mut q, t.0);
            }
            if let Some(mut s) = q.state.take() {
                // The leader: everything staged so far is this batch.
                let batch = std::mem::take(&mut q.staged);
                let (from, to) = (q.done, q.next);
                drop(q);
                let r = commit(&mut s, batch);
                q = self.lock();
                q.state = Some(s);
                q.done = to;
                q.commits += 1;
                if let Err(error) = r {
                    q.failed.push(Failed {
                        from,
                        to,
                        error,
                        left: to - from,
                    });
                }
                self.cv.notify_all();
                continue;
            }
            q = self.cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Run `f` on the state while no commit runs (waiting for one that does).
    pub fn with<T>(&self, f: impl FnOnce(&mut S) -> T) -> T {
        let mut q = self.lock();
        loop {
            if let Some(s) = q.state.as_mut() {
                return f(s);
            }
            q = self.cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// How many batches have been committed (successfully or not).
    #[cfg(test)]
    pub fn commits(&self) -> u64 {
        self.lock().commits
    }
}

/// The outcome of the committed ticket `t` (its batch's error, collected once).
fn collect<S, R, E: Clone>(q: &mut Queue<S, R, E>, t: u64) -> Result<(), E> {
    let Some(i) = q.failed.iter().position(|f| f.from <= t && t < f.to) else {
        return Ok(());
    };
    let f = &mut q.failed[i];
    f.left -= 1;
    let e = f.error.clone();
    if f.left == 0 {
        q.failed.swap_remove(i);
    }
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    /// Records written, in order; a commit sleeps like a sync.
    type Log = GroupCommit<Vec<u32>, u32, String>;

    fn write(s: &mut Vec<u32>, batch: Vec<u32>) -> Result<(), String> {
        std::thread::sleep(Duration::from_millis(5));
        if batch.contains(&13) {
            return Err("unlucky batch".into());
        }
        s.extend(batch);
        Ok(())
    }

    #[test]
    fn staged_together_commit_together() {
        let log = Arc::new(Log::new(Vec::new()));
        let n: u32 = 12;
        let staged = Arc::new(Barrier::new(n as usize));
        let threads: Vec<_> = (0..n)
            .map(|i| {
                let (log, staged) = (Arc::clone(&log), Arc::clone(&staged));
                std::thread::spawn(move || {
                    let t = log.stage(i);
                    staged.wait();
                    log.wait(t, write)
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), Ok(()));
        }
        assert_eq!(log.commits(), 1, "one commit for the whole group");
        log.with(|s| {
            s.sort();
            assert_eq!(*s, (0..n).collect::<Vec<_>>());
        });
    }

    #[test]
    fn staged_all_at_once_commit_in_one_batch_in_order() {
        let log = Log::new(Vec::new());
        let ts = log.stage_all(vec![5, 6, 7]);
        assert_eq!(ts.len(), 3);
        for t in ts {
            assert_eq!(log.wait(t, write), Ok(()));
        }
        assert_eq!(log.commits(), 1);
        log.with(|s| assert_eq!(*s, vec![5, 6, 7]));
    }

    #[test]
    fn a_failed_batch_fails_only_its_own_tickets() {
        let log = Log::new(Vec::new());
        let a = log.stage(1);
        let b = log.stage(13);
        assert_eq!(log.wait(a, write), Err("unlucky batch".into()));
        assert_eq!(log.wait(b, write), Err("unlucky batch".into()));
        let c = log.stage(2);
        assert_eq!(log.wait(c, write), Ok(()));
        log.with(|s| assert_eq!(*s, vec![2], "the failed batch left nothing"));
        assert_eq!(log.commits(), 2);
    }

    #[test]
    fn concurrent_waiters_all_get_their_own_outcome() {
        let log = Arc::new(Log::new(Vec::new()));
        let threads: Vec<_> = (0..16u32)
            .map(|i| {
                let log = Arc::clone(&log);
                std::thread::spawn(move || {
                    (0..20u32)
                        .map(|k| {
                            let v = i * 100 + k;
                            (v, log.wait(log.stage(v), write))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut ok = Vec::new();
        for t in threads {
            for (v, r) in t.join().unwrap() {
                if r.is_ok() {
                    ok.push(v);
                }
            }
        }
        ok.sort();
        let mut written = log.with(|s| s.clone());
        written.sort();
        assert_eq!(written, ok, "exactly the acknowledged records are written");
        assert!(log.commits() < 16 * 20, "some batches held several records");
    }
}
