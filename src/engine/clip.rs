//! Where a trim, write-zeroes or cache has work to do: the part of its range
//! that lies inside the backing file. Pure arithmetic (property-tested below).
//!
//! Past the end of the backing file a device's window reads as zeros (a window
//! larger than the file, a ragged tail rounded up to a block), so a trim or a
//! write-zeroes there has nothing to change and a cache nothing to read ahead.
//! A request is clipped at the file's end twice:
//! - each piece of it, when it runs (under its range lock, so a write that grew
//!   the file into that range before it is seen): only the bytes before the
//!   end are punched, zeroed or read ahead ([`in_file`]);
//! - the pieces of a request longer than a task (an extended header's 64-bit
//!   length, run 2 GiB at a time) stop at the end: a trim or cache at the
//!   first piece that starts past it ([`more_in_file`]), a write-zeroes after
//!   the first piece clipped there; so a 2^62-byte trim past the end of a
//!   small file is one or two pieces, not 2^31.
//!
//! Which end: a trim and a cache are advisory (NBD lets a server keep data a
//! trim names), so they use the file size loopd knows — the one it saw at
//! open, grown by its own writes and by `resize` — and may leave bytes another
//! process wrote past it behind loopd's back (the image lock keeps such
//! writers out unless the device is `--shared`). A write-zeroes must leave
//! zeros: a piece reaching past the size loopd knows first asks the file
//! (`statx` through the engine, which a network filesystem answers off the
//! reactor; see `Task::start_sized`), is clipped where the file says it ends,
//! and only such a piece stops the ones after it.

/// Bytes of a range of `len` bytes at file offset `foff` that lie before
/// `file_size` (0 when it starts at or past the end). Never more than `len`,
/// and `foff + in_file(..)` never passes `max(foff, file_size)`.
pub fn in_file(foff: u64, len: u64, file_size: u64) -> u64 {
    file_size.saturating_sub(foff).min(len)
}

/// Whether a piece that starts at export offset `next` of a window starting
/// at file offset `window` starts before the end of a file of `file_size`
/// bytes (an offset past `u64::MAX` is past every end).
pub fn more_in_file(window: u64, next: u64, file_size: u64) -> bool {
    window.checked_add(next).is_some_and(|f| f < file_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Offsets and sizes near the edges: 0, small, 2^31/2^32/2^62 boundaries,
    /// i64::MAX (the largest file) and u64::MAX.
    fn edgy() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0u64),
            Just(1u64),
            Just(1u64 << 31),
            Just(1u64 << 32),
            Just(1u64 << 62),
            Just(i64::MAX as u64),
            Just(u64::MAX - 1),
            Just(u64::MAX),
            0u64..(1 << 20),
            any::<u64>(),
        ]
    }

    #[test]
    fn a_trim_past_the_end_of_a_small_file_has_nothing_to_do() {
        // The case: 2^62 bytes from 1 GiB into a window over a 1 MiB file.
        assert_eq!(in_file(1 << 30, 1 << 62, 1 << 20), 0);
        assert!(!more_in_file(0, 1 << 30, 1 << 20));
        // Straddling the end: only what is inside.
        assert_eq!(in_file(4096, 1 << 62, 1 << 20), (1 << 20) - 4096);
        assert!(more_in_file(0, 4096, 1 << 20));
        // A window starting inside the file.
        assert!(more_in_file(1 << 19, 4096, 1 << 20));
        assert!(!more_in_file(1 << 20, 0, 1 << 20));
        assert!(!more_in_file(u64::MAX, 1, u64::MAX));
    }

    proptest! {
        #[test]
        fn in_file_is_the_overlap_with_the_file(foff in edgy(), len in edgy(), size in edgy()) {
            let got = in_file(foff, len, size);
            // The overlap of [foff, foff+len) with [0, size), in wide arithmetic.
            let (f, l, s) = (u128::from(foff), u128::from(len), u128::from(size));
            let want = (f + l).min(s).saturating_sub(f);
            prop_assert_eq!(u128::from(got), want);
            prop_assert!(got <= len);
            prop_assert!(u128::from(foff) + u128::from(got) <= f.max(s));
            prop_assert_eq!(got == 0, len == 0 || foff >= size);
        }

        #[test]
        fn more_in_file_never_overflows(window in edgy(), next in edgy(), size in edgy()) {
            let want = u128::from(window) + u128::from(next) < u128::from(size);
            prop_assert_eq!(more_in_file(window, next, size), want);
        }

        /// Pieces of at most `piece` bytes over `[off, off+len)` of a window at
        /// `window`, stopped at the first that starts past the end: they cover
        /// every byte inside the file, and at most one starts past the end.
        #[test]
        fn pieces_cover_the_file_and_stop_past_its_end(
            window in 0u64..(1 << 40),
            off in 0u64..(1 << 40),
            len in 1u64..(1 << 44),
            size in 0u64..(1 << 42),
            shift in 12u32..32,
        ) {
            let piece = 1u64 << shift;
            // At most 2^12 pieces per case: the loop is what is tested, not
            // how long it can run (the case above covers the huge length).
            let len = (len - 1) % (piece << 12) + 1;
            let mut at = off;
            let mut rest = len;
            let mut done_in_file = 0u64;
            let mut past = 0;
            let mut pieces = 0u64;
            loop {
                let n = rest.min(piece);
                rest -= n;
                pieces += 1;
                let inside = in_file(window + at, n, size);
                if inside == 0 {
                    past += 1;
                }
                done_in_file += inside;
                at += n;
                if rest == 0 || !more_in_file(window, at, size) {
                    break;
                }
            }
            let want = in_file(window + off, len, size);
            prop_assert_eq!(done_in_file, want);
            prop_assert!(past <= 1, "{} pieces past the end", past);
            prop_assert!(pieces <= want.div_ceil(piece) + 1);
        }
    }
}
