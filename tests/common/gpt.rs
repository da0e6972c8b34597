//! GPT disk images for the partition tests, written here (UEFI 2.x, 512-byte
//! sectors: protective MBR, primary header and entry array, backup array and
//! header, both CRC32s), so the tests need no partitioning tool.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub const SECTOR: u64 = 512;
const SECTOR_LEN: usize = 512;
const ENTRIES: u32 = 128;
const ENTRY_LEN: usize = 128;
const ARRAY_LEN: usize = 128 * ENTRY_LEN;
const ENTRY_SECTORS: u64 = 32; // ARRAY_LEN / SECTOR

/// "Linux filesystem data", 0FC63DAF-8483-4772-8E79-3D69D8477DE4, as GPT
/// stores it (first three fields little-endian).
const LINUX_FS: [u8; 16] = [
    0xaf, 0x3d, 0xc6, 0x0f, 0x83, 0x84, 0x72, 0x47, 0x8e, 0x79, 0x3d, 0x69, 0xd8, 0x47, 0x7d, 0xe4,
];

/// One partition: first and last sector (inclusive), and a name.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    pub first_lba: u64,
    pub last_lba: u64,
    pub name: &'static str,
}

impl Part {
    pub fn start_bytes(&self) -> u64 {
        self.first_lba * SECTOR
    }
    pub fn size_bytes(&self) -> u64 {
        (self.last_lba - self.first_lba + 1) * SECTOR
    }
}

pub fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xedb8_8320 & mask);
        }
    }
    !crc
}

fn put(buf: &mut [u8], at: usize, v: &[u8]) {
    buf[at..at + v.len()].copy_from_slice(v);
}

fn header(disk_sectors: u64, my: u64, alt: u64, entries_lba: u64, entries_crc: u32) -> Vec<u8> {
    let mut h = vec![0u8; SECTOR_LEN];
    put(&mut h, 0, b"EFI PART");
    put(&mut h, 8, &0x0001_0000u32.to_le_bytes());
    put(&mut h, 12, &92u32.to_le_bytes());
    put(&mut h, 24, &my.to_le_bytes());
    put(&mut h, 32, &alt.to_le_bytes());
    put(&mut h, 40, &(2 + ENTRY_SECTORS).to_le_bytes()); // first usable
    put(
        &mut h,
        48,
        &(disk_sectors - 2 - ENTRY_SECTORS).to_le_bytes(),
    ); // last usable
    put(&mut h, 56, &[0x6c; 16]); // disk GUID
    put(&mut h, 72, &entries_lba.to_le_bytes());
    put(&mut h, 80, &ENTRIES.to_le_bytes());
    put(&mut h, 84, &128u32.to_le_bytes());
    put(&mut h, 88, &entries_crc.to_le_bytes());
    let crc = crc32(&h[..92]);
    put(&mut h, 16, &crc.to_le_bytes());
    h
}

/// Writes a GPT with `parts` into the (existing) image at `path`, whose size
/// must be a whole number of sectors; other bytes are left as they are.
pub fn write_gpt(path: &Path, parts: &[Part]) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let len = f.metadata().expect("stat image").len();
    assert_eq!(
        len % SECTOR,
        0,
        "image size is not a whole number of sectors"
    );
    let n = len / SECTOR;
    let last_usable = n - 2 - ENTRY_SECTORS;
    for p in parts {
        assert!(
            p.first_lba >= 2 + ENTRY_SECTORS
                && p.first_lba <= p.last_lba
                && p.last_lba <= last_usable,
            "partition {p:?} outside the usable sectors 34..={last_usable}"
        );
    }

    // Protective MBR: one partition of type 0xEE covering the disk.
    let mut mbr = vec![0u8; SECTOR_LEN];
    let e = 446;
    put(
        &mut mbr,
        e,
        &[0x00, 0x00, 0x02, 0x00, 0xee, 0xff, 0xff, 0xff],
    );
    put(&mut mbr, e + 8, &1u32.to_le_bytes());
    put(
        &mut mbr,
        e + 12,
        &u32::try_from(n - 1).unwrap_or(u32::MAX).to_le_bytes(),
    );
    put(&mut mbr, 510, &[0x55, 0xaa]);

    let mut entries = vec![0u8; ARRAY_LEN];
    for (i, p) in parts.iter().enumerate() {
        let at = i * ENTRY_LEN;
        put(&mut entries, at, &LINUX_FS);
        let mut uniq = [0u8; 16];
        uniq[0] = u8::try_from(i + 1).expect("at most 255 partitions");
        uniq[15] = 0x5a;
        put(&mut entries, at + 16, &uniq);
        put(&mut entries, at + 32, &p.first_lba.to_le_bytes());
        put(&mut entries, at + 40, &p.last_lba.to_le_bytes());
        for (k, u) in p.name.encode_utf16().take(36).enumerate() {
            put(&mut entries, at + 56 + 2 * k, &u.to_le_bytes());
        }
    }
    let ecrc = crc32(&entries);
    let backup_entries = n - 1 - ENTRY_SECTORS;

    f.write_all_at(&mbr, 0).expect("write MBR");
    f.write_all_at(&header(n, 1, n - 1, 2, ecrc), SECTOR)
        .expect("write GPT header");
    f.write_all_at(&entries, 2 * SECTOR)
        .expect("write GPT entries");
    f.write_all_at(&entries, backup_entries * SECTOR)
        .expect("write backup GPT entries");
    f.write_all_at(&header(n, n - 1, 1, backup_entries, ecrc), (n - 1) * SECTOR)
        .expect("write backup GPT header");
    f.sync_all().expect("fsync image");
}

/// The two partitions of [`two_partition_image`]: 16 MiB from 1 MiB, then
/// 14 MiB.
pub const TWO_PARTS: [Part; 2] = [
    Part {
        first_lba: 2048,
        last_lba: 34815,
        name: "one",
    },
    Part {
        first_lba: 34816,
        last_lba: 63487,
        name: "two",
    },
];

/// A 32 MiB image with a GPT holding [`TWO_PARTS`]; partition 2 is filled
/// with pattern `seed`, everything else is zero.
pub fn two_partition_image(path: &Path, seed: u8) {
    super::create_sparse_image(path, 32 * super::MIB);
    let p2 = TWO_PARTS[1];
    let len = usize::try_from(p2.size_bytes()).expect("partition size");
    super::write_at(
        path,
        p2.start_bytes(),
        &super::pattern_bytes(seed, p2.start_bytes(), len),
    );
    write_gpt(path, &TWO_PARTS);
}
