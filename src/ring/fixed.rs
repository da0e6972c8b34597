//! The reactor ring's table of registered (fixed) buffers, and who uses
//! which of its slots.
//!
//! One sparse table per ring (`IORING_REGISTER_BUFFERS2` with
//! `IORING_RSRC_REGISTER_SPARSE`), registered by [`FixedTable::register`] on
//! the reactor thread when the ring is made, before any command is
//! submitted. loopd itself never puts a buffer in it: the ublk driver does,
//! with `UBLK_F_AUTO_BUF_REG` (each request's pages at the index its
//! FETCH / COMMIT_AND_FETCH named, before the command completes; taken out
//! again at the commit). Every ublk queue (and any other session) on the
//! reactor shares the table, so each takes a range of its own
//! ([`FixedTable::take`], one slot per tag) and gives it back when it is gone
//! ([`FixedTable::give_back`]). Used only by the reactor thread.

/// Slots in each ring's table (the kernel's cap is 16,384, `IORING_MAX_REG_BUFFERS`).
pub const FIXED_SLOTS: u32 = 16_384;

/// The ring's fixed-buffer table and its free slot ranges. See the module
/// documentation.
#[derive(Debug, Default)]
pub struct FixedTable {
    /// Registered: the kernel has the table.
    registered: bool,
    /// Free ranges (first slot, slots), sorted, never adjacent.
    free: Vec<(u32, u32)>,
}

impl FixedTable {
    /// Register a sparse table of [`FIXED_SLOTS`] on the ring of
    /// `submitter` (from the thread that submits on it). A kernel that
    /// cannot (before 5.19, or out of memory) leaves the table unregistered:
    /// nothing can be taken.
    pub fn register(submitter: io_uring::Submitter<'_>) -> FixedTable {
        match submitter.register_buffers_sparse(FIXED_SLOTS) {
            Ok(()) => FixedTable::with_slots(FIXED_SLOTS),
            Err(e) => {
                tracing::debug!("no fixed-buffer table on this reactor's ring: {e}");
                FixedTable::default()
            }
        }
    }

    /// A table the kernel has, of `n` slots (tests make one without a ring).
    pub fn with_slots(n: u32) -> FixedTable {
        FixedTable {
            registered: true,
            free: if n > 0 { vec![(0, n)] } else { Vec::new() },
        }
    }

    /// Whether the ring has a table.
    pub fn registered(&self) -> bool {
        self.registered
    }

    /// Take `n` consecutive slots; the first, or `None` if no free range
    /// is that long (or there is no table).
    pub fn take(&mut self, n: u16) -> Option<u16> {
        let n = u32::from(n);
        if n == 0 {
            return None;
        }
        let i = self.free.iter().position(|&(_, len)| len >= n)?;
        let (start, len) = self.free[i];
        if len == n {
            self.free.remove(i);
        } else {
            self.free[i] = (start + n, len - n);
        }
        u16::try_from(start).ok()
    }

    /// Give back `n` slots from `first` (taken with [`FixedTable::take`]).
    pub fn give_back(&mut self, first: u16, n: u16) {
        let (start, n) = (u32::from(first), u32::from(n));
        if n == 0 {
            return;
        }
        let i = self.free.partition_point(|&(s, _)| s < start);
        self.free.insert(i, (start, n));
        // Merge with the next, then with the previous range.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }

    /// Free slots in all.
    pub fn free_slots(&self) -> u32 {
        self.free.iter().map(|&(_, n)| n).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn queues_take_disjoint_ranges_and_give_them_back() {
        let mut t = FixedTable::with_slots(FIXED_SLOTS);
        assert_eq!(t.take(128), Some(0));
        assert_eq!(t.take(4096), Some(128));
        assert_eq!(t.take(128), Some(4224));
        t.give_back(128, 4096);
        assert_eq!(t.take(64), Some(128), "first fit reuses the gap");
        t.give_back(0, 128);
        t.give_back(128, 64);
        t.give_back(4224, 128);
        assert_eq!(t.free, vec![(0, FIXED_SLOTS)]);
    }

    #[test]
    fn no_table_or_no_room_takes_nothing() {
        let mut none = FixedTable::default();
        assert!(!none.registered());
        assert_eq!(none.take(1), None);
        let mut t = FixedTable::with_slots(100);
        assert_eq!(t.take(101), None);
        assert_eq!(t.take(0), None);
        assert_eq!(t.take(100), Some(0));
        assert_eq!(t.take(1), None);
    }

    proptest! {
        /// Any take/give-back sequence: taken ranges never overlap, and
        /// free + taken is always the whole table.
        #[test]
        fn taken_ranges_never_overlap(ops in proptest::collection::vec((any::<bool>(), 1u16..3000, any::<usize>()), 0..100)) {
            let mut t = FixedTable::with_slots(FIXED_SLOTS);
            let mut taken: Vec<(u16, u16)> = Vec::new();
            for (take, n, pick) in ops {
                if take || taken.is_empty() {
                    if let Some(s) = t.take(n) {
                        for &(a, m) in &taken {
                            let (a, m, s, n) = (u32::from(a), u32::from(m), u32::from(s), u32::from(n));
                            prop_assert!(s + n <= a || a + m <= s, "overlap");
                        }
                        prop_assert!(u32::from(s) + u32::from(n) <= FIXED_SLOTS);
                        taken.push((s, n));
                    }
                } else {
                    let (s, n) = taken.swap_remove(pick % taken.len());
                    t.give_back(s, n);
                }
                let used: u32 = taken.iter().map(|&(_, n)| u32::from(n)).sum();
                prop_assert_eq!(t.free_slots() + used, FIXED_SLOTS);
            }
        }
    }
}
