//! What the RBD fault tests share: a writer killed mid-way whose every
//! acknowledged round is known ([`kill9_under_writes`]) and the check of
//! those rounds in the image ([`assert_acked_rounds`]), waiting until a URI
//! serves again, and the clients watching an image.

use super::ceph::ceph;
use super::image::assert_bytes_eq;
use super::nbd_tools::qemu_io_status;
use super::server::Server;
use std::time::{Duration, Instant};

/// A `u64` offset or length as an index into memory.
pub fn us(n: u64) -> usize {
    usize::try_from(n).expect("fits in memory")
}

/// The byte round `i` writes.
fn round_byte(i: u64) -> u8 {
    1 + u8::try_from(i % 250).expect("below 250")
}

/// The rounds a writer had acknowledged when its server was killed.
pub struct Killed {
    pub acked: Vec<u64>,
    pub at: Instant,
}

/// A writer on `uri` — one `qemu-io` per round `i` (`region` bytes of
/// [`round_byte`] at `i × region`, then a flush), so a round whose qemu-io
/// succeeded is acknowledged — and, 1.5 s in, `kill -9` of `srv`. Asserts
/// that the kill landed while the writes went on (at least 3 rounds done,
/// not all `rounds`).
pub fn kill9_under_writes(srv: &mut Server, uri: &str, rounds: u64, region: u64) -> Killed {
    let writer = {
        let uri = uri.to_owned();
        std::thread::spawn(move || {
            let mut acked = Vec::new();
            for i in 0..rounds {
                let w = format!("write -P {} {} {region}", round_byte(i), i * region);
                if !qemu_io_status(&uri, &[w.as_str(), "flush"]).success() {
                    break;
                }
                acked.push(i);
            }
            acked
        })
    };
    std::thread::sleep(Duration::from_millis(1500));
    srv.kill9();
    let at = Instant::now();
    let acked = writer.join().expect("the writer thread");
    assert!(
        acked.len() >= 3 && acked.len() < us(rounds),
        "the kill landed while writes went on ({} rounds acknowledged)",
        acked.len()
    );
    Killed { acked, at }
}

/// Every acknowledged round of [`kill9_under_writes`] is in `image` (its
/// bytes, as `rbd export` read them) — but the first `skip` bytes, which a
/// later write changed.
pub fn assert_acked_rounds(image: &[u8], acked: &[u64], region: u64, skip: usize) {
    for &i in acked {
        let byte = round_byte(i);
        let (a, b) = (us(i * region), us((i + 1) * region));
        let mut have = image[a..b].to_vec();
        let later = skip.saturating_sub(a).min(b - a);
        have[..later].fill(byte);
        assert_bytes_eq(
            &have,
            &vec![byte; b - a],
            i * region,
            "an acknowledged write",
        );
    }
}

/// Polls until `uri` answers a read of its first 4 KiB (panics after
/// `limit`); returns how long it took.
pub fn wait_serving(uri: &str, limit: Duration) -> Duration {
    let t = Instant::now();
    loop {
        if qemu_io_status(uri, &["read 0 4096"]).success() {
            return t.elapsed();
        }
        assert!(t.elapsed() < limit, "{uri} did not serve within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The RADOS client addresses watching image `name` (`rbd status`; a
/// lock's owner is named the same way).
pub fn watchers(name: &str) -> Vec<String> {
    let out = ceph().rbd(&["status", "--format", "json", &ceph().image_spec(name)]);
    assert!(
        out.status.success(),
        "rbd status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("rbd status JSON");
    v["watchers"]
        .as_array()
        .map(|w| {
            w.iter()
                .filter_map(|x| x["address"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}
