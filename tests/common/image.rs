//! Image files: deterministic patterns, creating, reading and writing images
//! outside loopd, and byte comparisons that report the first difference.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::MIB;

/// Deterministic pseudo-random byte for file offset `off` (distinct per
/// `seed`); misplaced data (wrong offset) is detected.
pub fn pattern_byte(seed: u8, off: u64) -> u8 {
    let x = off
        .wrapping_add(u64::from(seed) << 40)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x.to_be_bytes()[0] ^ x.to_be_bytes()[3]
}

pub fn pattern_bytes(seed: u8, off: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| pattern_byte(seed, off + i))
        .collect()
}

/// Creates (or truncates) a sparse image of `size` bytes.
pub fn create_sparse_image(path: &Path, size: u64) {
    let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(size).expect("set_len");
}

/// Creates an image of `size` bytes filled with [`pattern_byte`]`(seed, _)`.
pub fn create_pattern_image(path: &Path, size: u64, seed: u8) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let chunk = MIB;
    let mut off = 0;
    while off < size {
        let n = chunk.min(size - off);
        f.write_all(&pattern_bytes(seed, off, usize::try_from(n).unwrap()))
            .expect("write image");
        off += n;
    }
    f.sync_all().expect("sync");
}

/// Creates an image of `size` bytes where every byte is `byte`.
pub fn create_filled_image(path: &Path, size: u64, byte: u8) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let buf = vec![byte; usize::try_from(MIB).unwrap()];
    let mut off = 0;
    while off < size {
        let n = MIB.min(size - off);
        f.write_all(&buf[..usize::try_from(n).unwrap()])
            .expect("write image");
        off += n;
    }
    f.sync_all().expect("sync");
}

/// Writes `data` at `off` into an existing file.
pub fn write_at(path: &Path, off: u64, data: &[u8]) {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    f.write_all_at(data, off).expect("write_all_at");
    f.sync_all().expect("sync");
}

pub fn read_file(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

pub fn read_range(path: &Path, off: u64, len: u64) -> Vec<u8> {
    let f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = vec![0u8; usize::try_from(len).unwrap()];
    f.read_exact_at(&mut buf, off)
        .unwrap_or_else(|e| panic!("read {} at {off}+{len}: {e}", path.display()));
    buf
}

pub fn file_len(path: &Path) -> u64 {
    fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .len()
}

/// Asserts two byte slices are equal, reporting the first differing offset
/// (relative to `base`) instead of dumping megabytes.
#[track_caller]
pub fn assert_bytes_eq(actual: &[u8], expected: &[u8], base: u64, ctx: &str) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "{ctx}: length differs (actual {} vs expected {})",
        actual.len(),
        expected.len()
    );
    if let Some(i) = actual.iter().zip(expected).position(|(a, b)| a != b) {
        let end = (i + 16).min(actual.len());
        panic!(
            "{ctx}: bytes differ at offset {} (0x{:x}): actual {:02x?} expected {:02x?}",
            base + i as u64,
            base + i as u64,
            &actual[i..end],
            &expected[i..end]
        );
    }
}

/// Asserts every byte of `file[off..off+len]` equals `byte`.
#[track_caller]
pub fn assert_file_filled(path: &Path, off: u64, len: u64, byte: u8, ctx: &str) {
    let got = read_range(path, off, len);
    let want = vec![byte; got.len()];
    assert_bytes_eq(&got, &want, off, ctx);
}

/// Asserts `file[off..off+len]` equals the pattern `seed` at the same offsets.
#[track_caller]
pub fn assert_file_pattern(path: &Path, off: u64, len: u64, seed: u8, ctx: &str) {
    let got = read_range(path, off, len);
    let want = pattern_bytes(seed, off, got.len());
    assert_bytes_eq(&got, &want, off, ctx);
}
