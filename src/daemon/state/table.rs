//! The state log's table: the recorded devices in first-attached order,
//! indexed by name, so that replaying a record or recording an attach costs
//! the same with 50,000 devices as with one.
//!
//! Contract: pure data, no I/O. [`Table::put`] and lookups are O(1) (a hash
//! of the name); [`Table::del`] is O(n) (the order is kept). [`replay`]
//! applies a whole log's records in O(records): a deleted device leaves a
//! hole until the end rather than shifting the rest.

use crate::control::proto::DeviceSpec;
use crate::daemon::params::name_of;
use std::collections::HashMap;

/// The devices, in first-attached order, and where each name is.
#[derive(Debug, Default, Clone)]
pub(super) struct Table {
    specs: Vec<DeviceSpec>,
    index: HashMap<String, usize>,
}

impl Table {
    pub(super) fn specs(&self) -> &[DeviceSpec] {
        &self.specs
    }

    pub(super) fn len(&self) -> usize {
        self.specs.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// Replace the device of `spec`'s name, or add it at the end.
    pub(super) fn put(&mut self, spec: DeviceSpec) {
        let name = name_of(&spec);
        match self.index.get(&name) {
            Some(&i) => self.specs[i] = spec,
            None => {
                self.index.insert(name, self.specs.len());
                self.specs.push(spec);
            }
        }
    }

    /// Remove the device `name` (if recorded), keeping the others' order.
    pub(super) fn del(&mut self, name: &str) {
        let Some(i) = self.index.remove(name) else {
            return;
        };
        self.specs.remove(i);
        for at in self.index.values_mut() {
            if *at > i {
                *at -= 1;
            }
        }
    }
}

/// Replays a log's records in order, in O(records).
#[derive(Default)]
pub(super) struct Replay {
    slots: Vec<Option<DeviceSpec>>,
    index: HashMap<String, usize>,
}

impl Replay {
    /// A put record: replace the device of `spec`'s name, or add it.
    pub(super) fn put(&mut self, spec: DeviceSpec) {
        let name = name_of(&spec);
        match self.index.get(&name) {
            Some(&i) => self.slots[i] = Some(spec),
            None => {
                self.index.insert(name, self.slots.len());
                self.slots.push(Some(spec));
            }
        }
    }

    /// A del record: the device `name` is gone (its place stays a hole).
    pub(super) fn del(&mut self, name: &str) {
        if let Some(i) = self.index.remove(name) {
            self.slots[i] = None;
        }
    }

    /// The devices the records left, in first-attached order.
    pub(super) fn finish(self) -> Vec<DeviceSpec> {
        self.slots.into_iter().flatten().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(name: &str, offset: u64) -> DeviceSpec {
        DeviceSpec {
            image: format!("/img/{name}.img").into(),
            name: Some(name.into()),
            offset,
            ..Default::default()
        }
    }

    /// The table as the plain list the records describe (the reference).
    fn reference(rs: &[(bool, u8, u64)]) -> Vec<DeviceSpec> {
        let mut v: Vec<DeviceSpec> = Vec::new();
        for &(put, n, off) in rs {
            let name = format!("d{n}");
            if put {
                match v.iter_mut().find(|s| s.name.as_deref() == Some(&name)) {
                    Some(s) => *s = spec(&name, off),
                    None => v.push(spec(&name, off)),
                }
            } else {
                v.retain(|s| s.name.as_deref() != Some(&name));
            }
        }
        v
    }

    proptest! {
        /// A table kept record by record, and one replayed from the whole
        /// log, both equal the plain list; and every name is found where it is.
        #[test]
        fn table_and_replay_match_the_plain_list(
            rs in proptest::collection::vec((any::<bool>(), 0u8..6, 0u64..4), 0..60)
        ) {
            let want = reference(&rs);
            let mut t = Table::default();
            let mut replay = Replay::default();
            for &(put, n, off) in &rs {
                let name = format!("d{n}");
                if put {
                    t.put(spec(&name, off));
                    replay.put(spec(&name, off));
                } else {
                    t.del(&name);
                    replay.del(&name);
                }
            }
            prop_assert_eq!(t.specs(), &want[..]);
            prop_assert_eq!(replay.finish(), want.clone());
            prop_assert_eq!(t.index.len(), want.len());
            for (i, s) in want.iter().enumerate() {
                prop_assert_eq!(t.index.get(&name_of(s)), Some(&i));
            }
        }
    }
}
