//! Admission of NBD connections: one count for the whole server, handshakes
//! included, against `--max-connections`.
//!
//! A [`Permit`] is taken when a connection is accepted and travels with it
//! (handshake, then reactor, across moves); dropping it, with the connection,
//! gives the place back. Lock-free: one atomic add and one subtract per
//! connection, never per request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

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
}
