//! The data-path parameter matrix: cache mode × logical block size, and
//! [`matrix_tests!`](crate::matrix_tests) to run one test body over all four.

use std::fmt;

/// One (cache mode, logical block size) combination of the data-path matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Combo {
    pub cache: &'static str,
    pub block_size: u32,
}

impl Combo {
    pub const DIRECT_512: Combo = Combo {
        cache: "direct",
        block_size: 512,
    };
    pub const DIRECT_4096: Combo = Combo {
        cache: "direct",
        block_size: 4096,
    };
    pub const BUFFERED_512: Combo = Combo {
        cache: "buffered",
        block_size: 512,
    };
    pub const BUFFERED_4096: Combo = Combo {
        cache: "buffered",
        block_size: 4096,
    };
    pub const ALL: [Combo; 4] = [
        Combo::DIRECT_512,
        Combo::DIRECT_4096,
        Combo::BUFFERED_512,
        Combo::BUFFERED_4096,
    ];

    /// The `loopd serve` arguments selecting this combination.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--cache".to_string(),
            self.cache.to_string(),
            "--block-size".to_string(),
            self.block_size.to_string(),
        ]
    }

    pub fn bs(&self) -> u64 {
        u64::from(self.block_size)
    }
}

impl fmt::Display for Combo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cache={},block-size={}", self.cache, self.block_size)
    }
}

/// Generates, for each listed function `fn name(combo: Combo)`, a module
/// `name` with four tests: `direct_512`, `direct_4096`, `buffered_512`,
/// `buffered_4096`.  A failure is therefore reported as e.g.
/// `pattern_write_read::direct_4096`.
#[macro_export]
macro_rules! matrix_tests {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                use $crate::common::Combo;
                #[test]
                fn direct_512() {
                    super::$name(Combo::DIRECT_512)
                }
                #[test]
                fn direct_4096() {
                    super::$name(Combo::DIRECT_4096)
                }
                #[test]
                fn buffered_512() {
                    super::$name(Combo::BUFFERED_512)
                }
                #[test]
                fn buffered_4096() {
                    super::$name(Combo::BUFFERED_4096)
                }
            }
        )*
    };
}
