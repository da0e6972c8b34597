//! The per-tag state machine of one ublk queue (pure; no I/O).
//!
//! Every tag of a queue is one slot the kernel can hand a request through. The
//! queue's owner (one thread: the kernel accepts a queue's commands only from the
//! task that fetched first) drives it:
//!
//! ```text
//!   Idle ──fetch()──▶ Fetching ──CQE 0──▶ Owned ──commit()──▶ Committing ──CQE 0──▶ Owned …
//!                        │                                       │
//!                        └──CQE ABORT / error──▶ Aborted ◀───────┘
//! ```
//!
//! - `fetch` submits `UBLK_U_IO_FETCH_REQ`; legal once per tag, before START_DEV
//!   (or END_USER_RECOVERY), which waits until every tag is fetched.
//! - A CQE with result 0 means the tag's descriptor holds a new request: the tag
//!   is `Owned` and its buffer belongs to the server until `commit`.
//! - `commit` submits `UBLK_U_IO_COMMIT_AND_FETCH_REQ` with the request's result;
//!   the kernel completes the request and keeps the command as the next fetch.
//! - While a tag is `Fetching` or `Committing` the kernel owns its buffer (it
//!   copies a write's data in before the CQE, and a read's data out when the
//!   commit is submitted) and may write its descriptor: the server touches neither.
//! - `UBLK_IO_RES_ABORT` (-ENODEV) ends a tag: the device is stopping or the
//!   queue is being torn down. Nothing is re-fetched after it; a new queue
//!   (after START_USER_RECOVERY) starts with a new table.
//!
//! Stopping: after STOP_DEV the kernel aborts every `Fetching` command and, once
//! the owned requests are committed, the piggy-backed fetches too. So a queue
//! drains by committing every `Owned` tag (with an error if its I/O cannot
//! finish) and reaping CQEs until [`TagTable::is_drained`]. [`TagTable::stop`]
//! refuses new fetches from then on; it never drops an owned request.

use thiserror::Error;

use super::sys::{UBLK_IO_RES_ABORT, UBLK_IO_RES_OK};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagState {
    /// Never fetched.
    Idle,
    /// FETCH_REQ submitted, no CQE yet.
    Fetching,
    /// A request arrived; the server works on it.
    Owned,
    /// COMMIT_AND_FETCH_REQ submitted, no CQE yet.
    Committing,
    /// Aborted by the kernel, or its command failed: no command in flight, never
    /// used again.
    Aborted,
}

/// What the queue must do after a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqeAction {
    /// Read the tag's descriptor and serve the request, then `commit`.
    Serve,
    /// The device is stopping: the tag is retired.
    Retired,
    /// The command failed (negative errno, or a result loopd never asked for,
    /// such as NEED_GET_DATA). The tag is retired; the queue should stop the device.
    Failed(i32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum TagError {
    #[error("tag {tag} is outside the queue depth {depth}")]
    NoSuchTag { tag: u16, depth: u16 },
    #[error("tag {tag}: {action} is not legal in state {state:?}")]
    Illegal {
        tag: u16,
        action: &'static str,
        state: TagState,
    },
    #[error("tag {0}: the queue is stopping, no new fetch")]
    Stopping(u16),
}

/// The states of all tags of one queue, with counters kept in step.
#[derive(Debug, Clone)]
pub struct TagTable {
    states: Vec<TagState>,
    /// Tags with a command in the kernel (Fetching + Committing).
    in_kernel: usize,
    /// Tags the server holds (Owned).
    owned: usize,
    /// Tags ever fetched (not Idle).
    fetched: usize,
    stopping: bool,
}

impl TagTable {
    pub fn new(depth: u16) -> Self {
        TagTable {
            states: vec![TagState::Idle; usize::from(depth)],
            in_kernel: 0,
            owned: 0,
            fetched: 0,
            stopping: false,
        }
    }

    pub fn depth(&self) -> u16 {
        u16::try_from(self.states.len()).unwrap_or(u16::MAX)
    }

    pub fn state(&self, tag: u16) -> Option<TagState> {
        self.states.get(usize::from(tag)).copied()
    }

    fn slot(&mut self, tag: u16) -> Result<&mut TagState, TagError> {
        let depth = self.depth();
        self.states
            .get_mut(usize::from(tag))
            .ok_or(TagError::NoSuchTag { tag, depth })
    }

    /// Idle → Fetching. The caller then submits FETCH_REQ for `tag`; if it
    /// cannot, it must not call this (the table would wait for a CQE forever).
    pub fn fetch(&mut self, tag: u16) -> Result<(), TagError> {
        let stopping = self.stopping;
        let s = self.slot(tag)?;
        match *s {
            TagState::Idle if stopping => Err(TagError::Stopping(tag)),
            TagState::Idle => {
                *s = TagState::Fetching;
                self.in_kernel += 1;
                self.fetched += 1;
                Ok(())
            }
            state => Err(TagError::Illegal {
                tag,
                action: "fetch",
                state,
            }),
        }
    }

    /// Owned → Committing. The caller then submits COMMIT_AND_FETCH_REQ. Legal
    /// while stopping too: an owned request must always be answered.
    pub fn commit(&mut self, tag: u16) -> Result<(), TagError> {
        let s = self.slot(tag)?;
        match *s {
            TagState::Owned => {
                *s = TagState::Committing;
                self.owned -= 1;
                self.in_kernel += 1;
                Ok(())
            }
            state => Err(TagError::Illegal {
                tag,
                action: "commit",
                state,
            }),
        }
    }

    /// A CQE for `tag` with result `res` arrived.
    pub fn complete(&mut self, tag: u16, res: i32) -> Result<CqeAction, TagError> {
        let s = self.slot(tag)?;
        match *s {
            TagState::Fetching | TagState::Committing => {}
            state => {
                return Err(TagError::Illegal {
                    tag,
                    action: "completion",
                    state,
                });
            }
        }
        let action = match res {
            UBLK_IO_RES_OK => CqeAction::Serve,
            UBLK_IO_RES_ABORT => CqeAction::Retired,
            other => CqeAction::Failed(other),
        };
        *s = match action {
            CqeAction::Serve => TagState::Owned,
            CqeAction::Retired | CqeAction::Failed(_) => TagState::Aborted,
        };
        self.in_kernel -= 1;
        if action == CqeAction::Serve {
            self.owned += 1;
        }
        Ok(action)
    }

    /// No new fetches from now on; owned tags must still be committed.
    pub fn stop(&mut self) {
        self.stopping = true;
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping
    }

    /// Every tag has been fetched at least once: START_DEV / END_USER_RECOVERY
    /// can complete.
    pub fn all_fetched(&self) -> bool {
        self.fetched == self.states.len()
    }

    /// Commands the kernel holds (each will produce exactly one CQE).
    pub fn in_kernel(&self) -> usize {
        self.in_kernel
    }

    /// Requests the server holds and must commit.
    pub fn owned(&self) -> usize {
        self.owned
    }

    /// Nothing in the kernel and nothing owned: the queue's ring and buffers
    /// may be released.
    pub fn is_drained(&self) -> bool {
        self.in_kernel == 0 && self.owned == 0
    }

    /// Tags the server holds, for committing them all on a stop.
    pub fn owned_tags(&self) -> impl Iterator<Item = u16> + '_ {
        self.states
            .iter()
            .enumerate()
            .filter(|(_, s)| **s == TagState::Owned)
            .filter_map(|(i, _)| u16::try_from(i).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_tag_goes_round_and_is_retired_by_abort() {
        let mut t = TagTable::new(2);
        t.fetch(0).unwrap();
        assert!(!t.all_fetched());
        t.fetch(1).unwrap();
        assert!(t.all_fetched());
        assert_eq!(t.complete(0, 0), Ok(CqeAction::Serve));
        assert_eq!(t.state(0), Some(TagState::Owned));
        t.commit(0).unwrap();
        assert_eq!(t.complete(0, 0), Ok(CqeAction::Serve));
        t.commit(0).unwrap();
        assert_eq!(t.complete(0, UBLK_IO_RES_ABORT), Ok(CqeAction::Retired));
        assert_eq!(t.complete(1, UBLK_IO_RES_ABORT), Ok(CqeAction::Retired));
        assert!(t.is_drained());
    }

    #[test]
    fn commit_of_a_fetching_tag_is_illegal_and_changes_nothing() {
        let mut t = TagTable::new(1);
        t.fetch(0).unwrap();
        assert!(matches!(t.commit(0), Err(TagError::Illegal { .. })));
        assert_eq!(t.state(0), Some(TagState::Fetching));
        assert!(matches!(t.fetch(0), Err(TagError::Illegal { .. })));
        assert_eq!(t.in_kernel(), 1);
    }

    #[test]
    fn unexpected_completion_and_tag_out_of_range_are_errors() {
        let mut t = TagTable::new(4);
        assert!(matches!(t.complete(0, 0), Err(TagError::Illegal { .. })));
        assert_eq!(t.fetch(4), Err(TagError::NoSuchTag { tag: 4, depth: 4 }));
    }

    #[test]
    fn stopping_refuses_fetches_but_not_commits() {
        let mut t = TagTable::new(2);
        t.fetch(0).unwrap();
        t.complete(0, 0).unwrap();
        t.stop();
        assert_eq!(t.fetch(1), Err(TagError::Stopping(1)));
        t.commit(0).unwrap();
        assert_eq!(
            t.complete(0, -libc::EINVAL),
            Ok(CqeAction::Failed(-libc::EINVAL))
        );
        assert!(t.is_drained());
    }

    /// Events a property test throws at the table, legal or not.
    #[derive(Debug, Clone)]
    enum Ev {
        Fetch(u16),
        Commit(u16),
        Cqe(u16, i32),
        Stop,
    }

    fn ev(depth: u16) -> impl Strategy<Value = Ev> {
        let tag = 0..depth + 1; // one past the end on purpose
        prop_oneof![
            tag.clone().prop_map(Ev::Fetch),
            tag.clone().prop_map(Ev::Commit),
            (
                tag,
                prop_oneof![Just(0), Just(UBLK_IO_RES_ABORT), Just(1), -200i32..0]
            )
                .prop_map(|(t, r)| Ev::Cqe(t, r)),
            Just(Ev::Stop),
        ]
    }

    fn check_counts(t: &TagTable) -> Result<(), TestCaseError> {
        let n = |s: TagState| t.states.iter().filter(|x| **x == s).count();
        prop_assert_eq!(
            t.in_kernel(),
            n(TagState::Fetching) + n(TagState::Committing)
        );
        prop_assert_eq!(t.owned(), n(TagState::Owned));
        prop_assert_eq!(t.fetched, t.states.len() - n(TagState::Idle));
        Ok(())
    }

    proptest! {
        /// Any sequence, legal or not: refused events change nothing, counters
        /// always match the states, nothing panics.
        #[test]
        fn random_events_never_reach_an_inconsistent_state(
            depth in 1u16..8,
            evs in proptest::collection::vec(ev(8), 0..200),
        ) {
            let mut t = TagTable::new(depth);
            for e in evs {
                let before = t.states.clone();
                let r = match e {
                    Ev::Fetch(tag) => t.fetch(tag).map(|_| ()),
                    Ev::Commit(tag) => t.commit(tag).map(|_| ()),
                    Ev::Cqe(tag, res) => t.complete(tag, res).map(|_| ()),
                    Ev::Stop => { t.stop(); Ok(()) }
                };
                if r.is_err() {
                    prop_assert_eq!(&before, &t.states);
                }
                check_counts(&t)?;
            }
        }

        /// A model kernel that answers only commands in flight, and a server
        /// that commits what it owns: after STOP (the kernel aborts what it
        /// holds) every fetched tag ends Aborted and the queue is drained.
        #[test]
        fn every_fetched_tag_is_committed_or_aborted(
            depth in 1u16..16,
            steps in proptest::collection::vec((any::<u16>(), any::<bool>()), 0..300),
        ) {
            let mut t = TagTable::new(depth);
            for tag in 0..depth { t.fetch(tag).unwrap(); }
            for (pick, deliver) in steps {
                let tag = pick % depth;
                match t.state(tag).unwrap() {
                    TagState::Fetching | TagState::Committing if deliver => {
                        prop_assert_eq!(t.complete(tag, 0), Ok(CqeAction::Serve));
                    }
                    TagState::Owned => t.commit(tag).unwrap(),
                    _ => {}
                }
                check_counts(&t)?;
            }
            // STOP_DEV: the server stops fetching and commits what it owns; the
            // kernel aborts every command it holds.
            t.stop();
            let owned: Vec<u16> = t.owned_tags().collect();
            for tag in owned { t.commit(tag).unwrap(); }
            prop_assert_eq!(t.owned(), 0);
            for tag in 0..depth {
                prop_assert_eq!(t.complete(tag, UBLK_IO_RES_ABORT), Ok(CqeAction::Retired));
            }
            prop_assert!(t.is_drained());
            prop_assert!((0..depth).all(|g| t.state(g) == Some(TagState::Aborted)));
        }
    }
}
