//! Which live changes connected clients cannot follow: a client keeps the size,
//! block size and read-only flag it was told at its handshake, and addresses
//! bytes relative to the window's start. Moving the window (offset), changing
//! the block size, shrinking the device or making it read-only breaks it, so
//! such a change needs `force` while clients are connected; growing, cache
//! mode and read-only off are safe.
//!
//! Contract: [`breaking`] is pure; it lists the reasons in a fixed order
//! (empty: the change is safe for connected clients).

/// The parts of a device's live geometry the rules look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub offset: u64,
    pub size: u64,
    pub block_size: u32,
    pub read_only: bool,
}

/// What in going from `cur` to `new` connected clients cannot follow.
pub fn breaking(cur: Geometry, new: Geometry) -> Vec<&'static str> {
    let mut v = Vec::new();
    if new.offset != cur.offset {
        v.push("a change of offset");
    }
    if new.block_size != cur.block_size {
        v.push("a change of block size");
    }
    if new.size < cur.size {
        v.push("a smaller size");
    }
    if new.read_only && !cur.read_only {
        v.push("read-only on");
    }
    v
}

/// The refusal's message for device `name` with `clients` connected.
pub fn busy_message(name: &str, clients: u32, reasons: &[&str]) -> String {
    format!(
        "device {name:?} has {clients} connected client(s), which cannot follow {}; \
         disconnect them or use --force",
        reasons.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const G: Geometry = Geometry {
        offset: 0,
        size: 8 << 20,
        block_size: 512,
        read_only: false,
    };

    #[test]
    fn safe_and_breaking_changes() {
        assert!(breaking(G, G).is_empty());
        assert!(
            breaking(G, Geometry { size: 9 << 20, ..G }).is_empty(),
            "grow"
        );
        let ro = Geometry {
            read_only: true,
            ..G
        };
        assert!(breaking(ro, G).is_empty(), "read-only off");
        assert_eq!(breaking(G, ro), vec!["read-only on"]);
        assert_eq!(
            breaking(G, Geometry { size: 4 << 20, ..G }),
            vec!["a smaller size"]
        );
        assert_eq!(
            breaking(
                G,
                Geometry {
                    offset: 4096,
                    block_size: 4096,
                    ..G
                }
            ),
            vec!["a change of offset", "a change of block size"]
        );
        assert!(busy_message("d", 2, &["read-only on"]).contains("read-only on; disconnect"));
    }

    proptest! {
        #[test]
        fn growing_a_writable_device_is_always_safe(size in 0u64..1 << 40, more in 0u64..1 << 40) {
            let cur = Geometry { size, ..G };
            let grown = Geometry { size: size + more, ..G };
            prop_assert!(breaking(cur, grown).is_empty());
        }
    }
}
