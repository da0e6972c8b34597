//! Image-format probe: is this backing file a container format (qcow2, vmdk, ...)
//! rather than a raw disk?
//!
//! Contract: [`probe`] is a pure function of the file's first bytes (give it up to
//! [`PROBE_LEN`]; fewer is fine, a short file simply matches less). It never
//! panics and never allocates. It recognises the formats QEMU's own probes
//! recognise by a magic at a fixed place: qcow and qcow2 (`QFI\xfb` + version),
//! vmdk (`KDMV`, `COWD`, or a text descriptor), vhdx (`vhdxfile`), vdi (signature
//! at 0x40), vpc (a dynamic VHD's `conectix` header), qed (`QED\0`) and luks
//! (`LUKS\xba\xbe`). A *fixed* VHD has its `conectix` footer in its last 512
//! bytes only; like QEMU, it is not probed: its data is a raw disk.
//!
//! The caller refuses a probed image unless the user declared the format
//! ([`ImageFormat::Raw`]); [`check_raw`] reads the head of an open file and
//! refuses with the message both the daemon and `loopd kernel attach` give.

use crate::text::quoted_path;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// How many leading bytes [`probe`] looks at.
pub const PROBE_LEN: usize = 512;

/// The format a user declares for an image (`--format`, spec field `format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    /// Serve the file's bytes as they are, whatever they look like.
    Raw,
}

/// A container format found by [`probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    Qcow,
    Qcow2,
    Vmdk,
    Vhdx,
    Vdi,
    Vpc,
    Qed,
    Luks,
}

impl Detected {
    /// The name QEMU gives the format (`qemu-img info`'s "file format").
    pub fn name(self) -> &'static str {
        match self {
            Detected::Qcow => "qcow",
            Detected::Qcow2 => "qcow2",
            Detected::Vmdk => "vmdk",
            Detected::Vhdx => "vhdx",
            Detected::Vdi => "vdi",
            Detected::Vpc => "vpc",
            Detected::Qed => "qed",
            Detected::Luks => "luks",
        }
    }
}

impl std::fmt::Display for Detected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

const QCOW_MAGIC: &[u8] = b"QFI\xfb";
const VDI_SIGNATURE_AT: usize = 0x40;
const VDI_SIGNATURE: u32 = 0xbeda_107f;

fn be32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// The container format `head` (the file's first bytes) starts with, if any.
pub fn probe(head: &[u8]) -> Option<Detected> {
    if head.starts_with(QCOW_MAGIC) {
        // Version 1 is the old qcow; 2 and 3 are qcow2. Another version is not an
        // image QEMU would open, but it is certainly not a raw disk either.
        return Some(match be32(head, 4) {
            Some(1) => Detected::Qcow,
            _ => Detected::Qcow2,
        });
    }
    let magics: [(&[u8], Detected); 7] = [
        (b"KDMV", Detected::Vmdk),
        (b"COWD", Detected::Vmdk),
        (b"# Disk DescriptorFile", Detected::Vmdk),
        (b"vhdxfile", Detected::Vhdx),
        (b"conectix", Detected::Vpc),
        (b"QED\0", Detected::Qed),
        (b"LUKS\xba\xbe", Detected::Luks),
    ];
    if let Some((_, d)) = magics.iter().find(|(m, _)| head.starts_with(m)) {
        return Some(*d);
    }
    if le32(head, VDI_SIGNATURE_AT) == Some(VDI_SIGNATURE) {
        return Some(Detected::Vdi);
    }
    None
}

/// An image [`check_raw`] refuses, or could not read.
#[derive(Debug, Error)]
pub enum RawError {
    #[error(
        "{} is a {format} image; loopd serves raw images only: convert it with \
         'qemu-img convert -f {format} -O raw {} {}', or pass --format raw to serve \
         its bytes as they are",
        quoted_path(.path), quoted_path(.path), quoted_path(.raw)
    )]
    NotRaw {
        path: PathBuf,
        format: Detected,
        raw: PathBuf,
    },
    #[error("cannot read the first bytes of {} to probe its format", quoted_path(.path))]
    Probe {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Refuse the image `f` (at `path`) if its first bytes name a container format.
pub fn check_raw(path: &Path, f: &File) -> Result<(), RawError> {
    use std::os::unix::fs::FileExt;
    let mut head = [0u8; PROBE_LEN];
    let mut got = 0;
    while got < head.len() {
        match f.read_at(&mut head[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(RawError::Probe {
                    path: path.to_path_buf(),
                    source,
                });
            }
        }
    }
    verdict(path, &head[..got])
}

/// One block that `O_DIRECT` may read into (memory alignment up to 4 KiB).
#[repr(C, align(4096))]
struct Block([u8; 4096]);

/// As [`check_raw`], reading the head through `direct`, a descriptor of the
/// same file opened with `O_DIRECT` whose offsets align to `offset_align`:
/// the page cache is neither filled nor read ahead (a buffered read of the
/// first 512 bytes of a fresh image makes the kernel read ahead and keep
/// several pages of it; an attach of a thousand images kept megabytes).
/// Falls back to [`check_raw`] on `plain` where the direct read cannot be
/// done (an alignment above 4 KiB, a refusal).
pub fn check_raw_direct(
    path: &Path,
    direct: &File,
    offset_align: u32,
    plain: &File,
) -> Result<(), RawError> {
    use std::os::unix::fs::FileExt;
    let len = (offset_align as usize).max(PROBE_LEN);
    if len > 4096 || !len.is_power_of_two() {
        return check_raw(path, plain);
    }
    let mut block = Block([0; 4096]);
    loop {
        match direct.read_at(&mut block.0[..len], 0) {
            // A short read is the end of the file.
            Ok(n) => return verdict(path, &block.0[..n.min(PROBE_LEN)]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return check_raw(path, plain),
        }
    }
}

/// [`check_raw`]'s answer for the image's first bytes `head`.
fn verdict(path: &Path, head: &[u8]) -> Result<(), RawError> {
    match probe(head) {
        None => Ok(()),
        Some(format) => {
            let mut raw = path.with_extension("raw");
            if raw == path {
                raw = path.with_extension("converted.raw");
            }
            Err(RawError::NotRaw {
                path: path.to_path_buf(),
                format,
                raw,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn with_prefix(prefix: &[u8], len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len.max(prefix.len())];
        v[..prefix.len()].copy_from_slice(prefix);
        v
    }

    #[test]
    fn each_known_magic_is_named() {
        let cases: [(&[u8], Detected); 10] = [
            (b"QFI\xfb\0\0\0\x01", Detected::Qcow),
            (b"QFI\xfb\0\0\0\x02", Detected::Qcow2),
            (b"QFI\xfb\0\0\0\x03", Detected::Qcow2),
            (b"KDMV\x01\0\0\0", Detected::Vmdk),
            (b"# Disk DescriptorFile\nversion=1\n", Detected::Vmdk),
            (b"vhdxfile", Detected::Vhdx),
            (b"conectix", Detected::Vpc),
            (b"QED\0", Detected::Qed),
            (b"LUKS\xba\xbe\0\x02", Detected::Luks),
            (b"COWD", Detected::Vmdk),
        ];
        for (head, want) in cases {
            assert_eq!(probe(&with_prefix(head, PROBE_LEN)), Some(want), "{head:?}");
            // Exactly the magic and nothing more still matches.
            assert!(probe(head).is_some(), "{head:?}");
        }
        let mut vdi = b"<<< Oracle VM VirtualBox Disk Image >>>\n".to_vec();
        vdi.resize(PROBE_LEN, 0);
        vdi[VDI_SIGNATURE_AT..VDI_SIGNATURE_AT + 4].copy_from_slice(&VDI_SIGNATURE.to_le_bytes());
        assert_eq!(probe(&vdi), Some(Detected::Vdi));
    }

    #[test]
    fn zeros_an_mbr_and_short_files_are_raw() {
        assert_eq!(probe(&[]), None);
        assert_eq!(probe(&[0; PROBE_LEN]), None);
        assert_eq!(probe(b"QFI"), None);
        assert_eq!(probe(b"LUKS\xba"), None);
        let mut mbr = vec![0u8; PROBE_LEN];
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        assert_eq!(probe(&mbr), None);
        // A VDI signature cut short by the end of the file does not match.
        let mut vdi = vec![0u8; VDI_SIGNATURE_AT + 3];
        vdi[VDI_SIGNATURE_AT..].copy_from_slice(&VDI_SIGNATURE.to_le_bytes()[..3]);
        assert_eq!(probe(&vdi), None);
    }

    #[test]
    fn a_magic_not_at_the_start_is_not_a_format() {
        assert_eq!(probe(&with_prefix(b"\0QFI\xfb\0\0\0\x03", PROBE_LEN)), None);
        assert_eq!(probe(&with_prefix(b" vhdxfile", PROBE_LEN)), None);
    }

    proptest! {
        /// Any bytes: no panic, and the answer depends only on the first
        /// PROBE_LEN bytes.
        #[test]
        fn probe_is_total_and_reads_only_the_head(
            head in proptest::collection::vec(any::<u8>(), 0..2 * PROBE_LEN),
        ) {
            let short = &head[..head.len().min(PROBE_LEN)];
            prop_assert_eq!(probe(&head), probe(short));
        }

        /// Whatever follows a magic, the format is still found.
        #[test]
        fn a_magic_followed_by_anything_is_found(
            which in 0usize..4,
            tail in proptest::collection::vec(any::<u8>(), 0..PROBE_LEN),
        ) {
            let (magic, want): (&[u8], Detected) = [
                (&b"vhdxfile"[..], Detected::Vhdx),
                (&b"QED\0"[..], Detected::Qed),
                (&b"LUKS\xba\xbe"[..], Detected::Luks),
                (&b"KDMV"[..], Detected::Vmdk),
            ][which];
            let mut v = magic.to_vec();
            v.extend_from_slice(&tail);
            prop_assert_eq!(probe(&v), Some(want));
        }

        /// A head whose first byte is none of the magics' first bytes, and with
        /// no VDI signature, is raw.
        #[test]
        fn bytes_without_a_magic_are_raw(
            mut head in proptest::collection::vec(any::<u8>(), 0..PROBE_LEN),
        ) {
            if let Some(b) = head.first_mut() {
                if b"QKC#vcL".contains(b) {
                    *b = 0;
                }
            }
            if head.len() >= VDI_SIGNATURE_AT + 4 {
                head[VDI_SIGNATURE_AT] = 0;
            }
            prop_assert_eq!(probe(&head), None);
        }
    }
}
