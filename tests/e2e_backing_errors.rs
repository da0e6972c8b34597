//! Backing-file errors: a full disk gives the client ENOSPC on that request, the
//! server keeps serving, and it logs the error once with context.
//!
//! Needs root (it builds a tiny ext4 filesystem on a kernel loop device and mounts
//! it); every mount and loop device it makes is removed again, also on failure.

mod common;

use common::*;
use std::path::{Path, PathBuf};

/// A small mounted ext4 filesystem, unmounted and detached on drop.
struct TinyFs {
    mnt: PathBuf,
    dev: String,
    _dir: tempfile::TempDir,
}

impl TinyFs {
    fn new(size_mib: u64) -> TinyFs {
        for t in ["mkfs.ext4", "mount", "umount", "losetup"] {
            require_tool(t);
        }
        let dir = tempfile::Builder::new()
            .prefix("loopd-tinyfs")
            .tempdir()
            .expect("tempdir");
        let img = dir.path().join("fs.img");
        create_sparse_image(&img, size_mib << 20);
        let dev = run("losetup", ["-f", "--show", img.to_str().unwrap()])
            .assert_success()
            .stdout
            .trim()
            .to_owned();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).expect("mkdir");
        let fs = TinyFs {
            mnt,
            dev,
            _dir: dir,
        };
        run("mkfs.ext4", ["-q", "-F", "-m", "0", fs.dev.as_str()]).assert_success();
        run("mount", [fs.dev.as_str(), fs.mnt.to_str().unwrap()]).assert_success();
        fs
    }

    fn path(&self, name: &str) -> PathBuf {
        self.mnt.join(name)
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = run_status("umount", [self.mnt.to_str().unwrap()]);
        let _ = run_status("losetup", ["-d", self.dev.as_str()]);
    }
}

/// Writes of `chunk` bytes until the disk is full. In buffered mode 64 KiB writes
/// take the inline path (copied into the page cache on the reactor thread), 1 MiB
/// writes the ring.
fn full_disk(cache: &str, chunk: u64) {
    let fs = TinyFs::new(8);
    let image: &Path = &fs.path("big.img");
    // 64 MiB sparse image on an 8 MiB filesystem: writes run out of space.
    create_sparse_image(image, 64 << 20);
    let mut srv = Server::builder(image).args(["--cache", cache]).start();
    let out = nbdsh(&format!(
        r#"
h = connect({uri})
chunk = {chunk}
buf = b"\x5a" * chunk
got = None
for i in range((48 << 20) // chunk):
    try:
        h.pwrite(buf, i * chunk)
    except nbd.Error as e:
        got = e.errnum
        break
assert got == errno.ENOSPC, "expected ENOSPC from a full disk, got %r" % (got,)
# The connection and the data written before the failure are still fine.
assert h.pread(4096, 0) == b"\x5a" * 4096
h.flush()
print("ENOSPC after", i, "writes")
"#,
        uri = py_str(&srv.uri())
    ));
    assert!(out.stdout.contains("ENOSPC after"), "{out}");
    srv.assert_running();
    // A second client still works.
    qemu_io(&srv.uri(), &["read -P 0x5a 0 64k"]);
    srv.stop_ok();
    let log = srv.stderr_text();
    let warnings = log.matches("backing file error ENOSPC").count();
    assert_eq!(
        warnings, 1,
        "the error is logged once, with context:\n{log}"
    );
    assert!(
        log.contains("ENOSPC="),
        "the exit summary counts the errors:\n{log}"
    );
    if cache == "buffered" && chunk <= 64 << 10 {
        assert!(
            log.contains("inline_written=") && !log.contains("inline_written=0 "),
            "the writes took the inline path:\n{log}"
        );
    }
}

#[test]
fn full_disk_gives_enospc_and_the_server_goes_on_direct() {
    full_disk("direct", 1 << 20);
}

#[test]
fn full_disk_gives_enospc_and_the_server_goes_on_buffered() {
    full_disk("buffered", 1 << 20);
}

#[test]
fn full_disk_gives_enospc_and_the_server_goes_on_buffered_inline_writes() {
    full_disk("buffered", 64 << 10);
}

/// A file truncated under the server: reads past the new end are zeros, writes
/// still work, and nothing panics.
#[test]
fn file_truncated_under_the_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("t.img");
    create_filled_image(&image, 4 << 20, 0x33);
    let mut srv = Server::builder(&image).args(["--cache", "direct"]).start();
    qemu_io(&srv.uri(), &["read -P 0x33 3M 64k"]);
    std::fs::File::options()
        .write(true)
        .open(&image)
        .and_then(|f| f.set_len(1 << 20))
        .expect("truncate");
    qemu_io(
        &srv.uri(),
        &[
            "read -P 0x33 0 64k",
            "read -P 0 3M 64k",
            "write -P 0x44 2M 4k",
            "read -P 0x44 2M 4k",
        ],
    );
    srv.assert_running();
    srv.stop_ok();
}
