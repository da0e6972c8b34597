//! Every client's requests are served: loopd advertises an NBD minimum block
//! size of 1 (the block size only preferred), so byte-granular clients work
//! against a `--block-size 4096` export in direct and buffered mode:
//!
//! - `fsx` (fsx-rs) over `nbdfuse`: buffered and mmap reads and writes, hole
//!   punches (NBD trims) and syncs at any offset and length, every read checked;
//!   with `--strict-block-size` libnbd refuses the unaligned writes and fsx fails,
//!   so the test can fail;
//! - a loop device with 512-byte sectors on the `nbdfuse` file, ext4 with
//!   1 KiB blocks on it: a file written, read back after a remount and from the
//!   image itself, `e2fsck` clean;
//! - `nbdsh` against a model: reads, writes, trims and write-zeroes (with and
//!   without FUA and NO_HOLE) at random byte offsets and lengths, crossing blocks;
//! - the `unaligned` and `paths.bounced` counters of `loopd status` show them.
//!
//! Every FUSE mount, loop device and mount is a guard released on drop (by the
//! PID this test started, the device it attached, the directory it mounted),
//! also when a test panics.

mod common;

use common::*;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const NAME: &str = "u";
/// How long an external command of these tests may take.
const CMD_TIMEOUT: Duration = Duration::from_secs(120);

/// `loopd serve IMAGE --block-size 4096 --cache CACHE` (with control), the
/// image a fresh sparse file of `size` bytes.
fn serve(dir: &Path, cache: &str, size: u64, strict: bool) -> (Server, PathBuf) {
    let img = dir.join("disk.img");
    create_sparse_image(&img, size);
    let mut b = Server::builder(&img).name(NAME).with_control().args([
        "--block-size",
        "4096",
        "--cache",
        cache,
    ]);
    if strict {
        b = b.arg("--strict-block-size");
    }
    (b.start(), img)
}

/// `loopd status --json` of the device.
fn status(srv: &Server) -> Json {
    srv.ctl_json(&["status", NAME])
}

/// The NBD minimum block size the export advertises (nbdinfo).
fn advertised_minimum(uri: &str) -> u64 {
    let out = run("nbdinfo", ["--json", uri]);
    let doc = Json::parse(&out.stdout);
    doc.at("exports").arr()[0].at("block_size_minimum").u64()
}

/// An `nbdfuse` process serving the export as the file `DIR/nbd`. Dropping it
/// unmounts (`fusermount3 -u`, retried while busy), then waits for the process
/// and kills it by its PID if it is still there.
struct NbdFuse {
    dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
}

impl NbdFuse {
    fn mount(uri: &str, dir: &Path) -> NbdFuse {
        require_tool("fusermount3");
        fs::create_dir_all(dir).expect("mkdir mountpoint");
        let pidfile = dir.with_extension("pid");
        let log = dir.with_extension("log");
        let logf = fs::File::create(&log).expect("nbdfuse log");
        let mut c = tool("nbdfuse");
        c.arg("-P")
            .arg(&pidfile)
            .arg(dir)
            .arg(uri)
            .stdout(Stdio::null())
            .stderr(logf);
        let child = c.spawn().expect("cannot start nbdfuse");
        let mut f = NbdFuse {
            dir: dir.to_path_buf(),
            child: Some(child),
            log,
        };
        // Ready once it wrote its PID file (after the mount is made).
        let start = Instant::now();
        while !pidfile.exists() {
            if let Some(Some(st)) = f.child.as_mut().map(|c| c.try_wait().ok().flatten()) {
                f.child = None;
                panic!("nbdfuse exited early ({st}):\n{}", f.log_text());
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "nbdfuse did not come up in 20 s:\n{}",
                f.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(f.file().exists(), "no {}", f.file().display());
        f
    }

    fn file(&self) -> PathBuf {
        self.dir.join("nbd")
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Unmount and reap nbdfuse; the first problem met, if any.
    fn stop(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let mut err = None;
        let mut unmounted = false;
        for _ in 0..40 {
            let out = sh_status("fusermount3", [os("-u"), self.dir.as_os_str()]);
            if out.success() {
                unmounted = true;
                break;
            }
            err.get_or_insert_with(|| out.to_string());
            std::thread::sleep(Duration::from_millis(250));
        }
        let start = Instant::now();
        let exited = loop {
            match child.try_wait() {
                Ok(Some(_)) => break true,
                Ok(None) if start.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => break false,
            }
        };
        if !exited {
            // By its PID: the process this guard started.
            let _ = child.kill();
            let _ = child.wait();
        }
        if !unmounted {
            // The server is gone: drop the dead mount lazily.
            let _ = sh_status("fusermount3", [os("-u"), os("-z"), self.dir.as_os_str()]);
            return Err(format!(
                "cannot unmount {}: {}",
                self.dir.display(),
                err.unwrap_or_default()
            ));
        }
        if !exited {
            return Err(format!(
                "nbdfuse did not exit after unmount:\n{}",
                self.log_text()
            ));
        }
        Ok(())
    }
}

impl Drop for NbdFuse {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("cleanup: {e}");
            if !std::thread::panicking() {
                panic!("{e}");
            }
        }
    }
}

/// Runs `name args` and panics with its output unless it exits 0.
#[track_caller]
fn sh<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(name: &str, args: I) -> Out {
    run_status_timeout(CMD_TIMEOUT, name, args).assert_success()
}

/// Runs `name args`, whatever its exit status.
fn sh_status<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(name: &str, args: I) -> Out {
    run_status_timeout(CMD_TIMEOUT, name, args)
}

/// A mounted filesystem; dropping it unmounts (retrying while busy).
struct Mount {
    dir: PathBuf,
}

impl Mount {
    fn new(dev: &Path, dir: &Path, opts: &str) -> Mount {
        fs::create_dir_all(dir).expect("mkdir mountpoint");
        sh(
            "mount",
            [os("-o"), os(opts), dev.as_os_str(), dir.as_os_str()],
        );
        Mount {
            dir: dir.to_path_buf(),
        }
    }

    /// Unmount now, panicking if it fails.
    fn unmount(mut self) {
        let r = self.try_unmount();
        self.dir = PathBuf::new();
        if let Err(e) = r {
            panic!("{e}");
        }
    }

    fn try_unmount(&mut self) -> Result<(), String> {
        let mut last = String::new();
        for _ in 0..20 {
            let out = sh_status("umount", [self.dir.as_os_str()]);
            if out.success() {
                return Ok(());
            }
            last = out.to_string();
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(format!("cannot unmount {}: {last}", self.dir.display()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.dir.as_os_str().is_empty() {
            return;
        }
        if let Err(e) = self.try_unmount() {
            eprintln!("cleanup: {e}");
            if !std::thread::panicking() {
                panic!("{e}");
            }
        }
    }
}

/// `&str` as the `&OsStr` the command helpers take.
fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// A loop device with 512-byte sectors on a file; dropping it detaches it.
struct LoopDev {
    dev: PathBuf,
}

impl LoopDev {
    fn attach(file: &Path) -> LoopDev {
        let out = sh(
            "losetup",
            [
                os("--sector-size"),
                os("512"),
                os("--show"),
                os("-f"),
                file.as_os_str(),
            ],
        );
        // The guard first, so a device is detached whatever follows.
        let lo = LoopDev {
            dev: PathBuf::from(out.stdout.trim()),
        };
        assert!(
            path_str(&lo.dev).starts_with("/dev/loop"),
            "losetup printed no device:\n{out}"
        );
        lo
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let mut last = None;
        for _ in 0..20 {
            let out = sh_status("losetup", [os("-d"), self.dev.as_os_str()]);
            if out.success() {
                return;
            }
            last = Some(out.to_string());
            std::thread::sleep(Duration::from_millis(250));
        }
        let e = format!(
            "cannot detach {}: {}",
            self.dev.display(),
            last.unwrap_or_default()
        );
        eprintln!("cleanup: {e}");
        if !std::thread::panicking() {
            panic!("{e}");
        }
    }
}

/// The fsx-rs configuration: a fixed-size file (an nbdfuse file cannot change
/// size), operations at any byte offset and length.
const FSX_TOML: &str = r#"
blockmode = true
flen = 2097152
nomsyncafterwrite = false

[opsize]
min = 1
max = 65536
align = 1

[weights]
close_open = 0
read = 10
write = 10
mapread = 10
mapwrite = 10
invalidate = 1
truncate = 0
fsync = 1
fdatasync = 1
posix_fallocate = 0
punch_hole = 3
sendfile = 2
posix_fadvise = 1
copy_file_range = 0
"#;
/// fsx's seed and operation count: fixed, and a few seconds' work.
const FSX_SEED: &str = "20261123";
const FSX_OPS: &str = "6000";

/// Runs fsx on `file` (its config and artifacts in `dir`).
fn fsx(dir: &Path, file: &Path) -> Out {
    let cfg = dir.join("fsx.toml");
    fs::write(&cfg, FSX_TOML).expect("write fsx.toml");
    let art = dir.join("fsx-artifacts");
    fs::create_dir_all(&art).expect("mkdir artifacts");
    let mut c = tool("fsx");
    c.arg("-f")
        .arg(&cfg)
        .args(["-S", FSX_SEED, "-N", FSX_OPS, "-P"])
        .arg(&art)
        .arg(file);
    run_cmd_timeout(c, CMD_TIMEOUT)
}

/// fsx passes over nbdfuse against the default (minimum 1) export, and the
/// counters show the unaligned requests it made (bounced in direct mode).
fn fsx_passes(cache: &str) {
    require_tool("fsx");
    let dir = tempdir();
    let (srv, _img) = serve(dir.path(), cache, 4 * MIB, false);
    assert_eq!(advertised_minimum(&srv.uri()), 1, "[{cache}] NBD minimum");
    let fuse = NbdFuse::mount(&srv.uri(), &dir.path().join("mnt"));
    let out = fsx(dir.path(), &fuse.file());
    assert!(
        out.success(),
        "[{cache}] fsx failed over nbdfuse:\n{out}\n--- nbdfuse ---\n{}",
        fuse.log_text()
    );
    drop(fuse);
    let st = status(&srv);
    let unaligned = st.at("unaligned").u64();
    let bounced = st.at("paths").at("bounced").u64();
    let req = st.at("requests");
    eprintln!(
        "[{cache}] unaligned={unaligned} bounced={bounced} writes={} trims={} write_zeroes={}",
        req.at("write").u64(),
        req.at("trim").u64(),
        req.at("write_zeroes").u64()
    );
    assert!(unaligned > 0, "[{cache}] no unaligned request seen: {st:?}");
    assert!(req.at("write").u64() > 0, "[{cache}] {st:?}");
    assert!(
        req.at("trim").u64() + req.at("write_zeroes").u64() > 0,
        "[{cache}] fsx's hole punches reached loopd: {st:?}"
    );
    if cache == "direct" {
        assert!(bounced > 0, "[{cache}] no bounced request: {st:?}");
    } else {
        assert_eq!(bounced, 0, "[{cache}] buffered mode bounces nothing");
    }
    assert_no_errors(&st, cache);
}

/// No error of any kind was sent to a client.
#[track_caller]
fn assert_no_errors(st: &Json, cache: &str) {
    let Json::Object(errors) = st.at("errors") else {
        panic!("[{cache}] no errors object: {st:?}");
    };
    assert!(!errors.is_empty(), "[{cache}] {st:?}");
    for (name, n) in errors {
        assert_eq!(n.u64(), 0, "[{cache}] {name} sent to a client: {st:?}");
    }
}

#[test]
fn fsx_over_nbdfuse_direct() {
    fsx_passes("direct");
}

#[test]
fn fsx_over_nbdfuse_buffered() {
    fsx_passes("buffered");
}

/// With `--strict-block-size` the export advertises 4096 as the minimum, libnbd
/// (in nbdfuse) refuses the unaligned writes with EINVAL, and fsx fails: what
/// the default minimum of 1 fixes.
#[test]
fn strict_block_size_makes_fsx_fail() {
    require_tool("fsx");
    let dir = tempdir();
    let (srv, _img) = serve(dir.path(), "direct", 4 * MIB, true);
    assert_eq!(advertised_minimum(&srv.uri()), 4096, "strict NBD minimum");
    let st = status(&srv);
    assert!(st.at("strict_block_size").bool(), "status shows it: {st:?}");
    let text = srv.ctl_ok(&["status", NAME]).stdout;
    assert!(
        text.contains("strict_block_size: yes"),
        "status text shows it:\n{text}"
    );
    let fuse = NbdFuse::mount(&srv.uri(), &dir.path().join("mnt"));
    let out = fsx(dir.path(), &fuse.file());
    let log = fuse.log_text();
    drop(fuse);
    assert!(
        !out.success(),
        "fsx passed although libnbd must refuse unaligned requests:\n{out}"
    );
    assert!(
        out.stderr.contains("Invalid argument") && log.contains("unaligned"),
        "fsx failed, but not because libnbd refused an unaligned request:\n{out}\n\
         --- nbdfuse ---\n{log}"
    );
    assert_eq!(
        status(&srv).at("unaligned").u64(),
        0,
        "the client refused them: none reached loopd"
    );
}

/// ext4 with 1 KiB blocks on a 512-byte-sector loop device on the nbdfuse file:
/// every request is a 512-byte multiple at 512-byte offsets, so against a
/// 4096-byte block size most are unaligned.
fn ext4_on_loop(cache: &str) {
    require_tool("losetup");
    require_tool("debugfs");
    let dir = tempdir();
    let (mut srv, img) = serve(dir.path(), cache, 64 * MIB, false);
    // A file of an odd length, from the pattern.
    let len = 3 * MIB + 777;
    let data = pattern_bytes(42, 0, usize::try_from(len).expect("len"));
    let src = dir.path().join("src.bin");
    fs::write(&src, &data).expect("write source");
    let want = sha256(&src);
    {
        let fuse = NbdFuse::mount(&srv.uri(), &dir.path().join("mnt"));
        let lo = LoopDev::attach(&fuse.file());
        sh(
            "mkfs.ext4",
            [
                os("-q"),
                os("-F"),
                os("-b"),
                os("1024"),
                os("-E"),
                os("lazy_itable_init=0,lazy_journal_init=0"),
                lo.dev.as_os_str(),
            ],
        );
        let fsdir = dir.path().join("fs");
        {
            let m = Mount::new(&lo.dev, &fsdir, "rw");
            sh("cp", [src.as_os_str(), m.dir.join("f.bin").as_os_str()]);
            sh("sync", [m.dir.as_os_str()]);
            m.unmount();
        }
        {
            // Read back from a fresh mount (nothing of the file cached).
            let m = Mount::new(&lo.dev, &fsdir, "ro");
            assert_eq!(sha256(&m.dir.join("f.bin")), want, "[{cache}] read back");
            m.unmount();
        }
        let fsck = sh_status("e2fsck", [os("-f"), os("-n"), lo.dev.as_os_str()]);
        assert!(fsck.success(), "[{cache}] e2fsck not clean:\n{fsck}");
        drop(lo);
        drop(fuse);
    }
    let st = status(&srv);
    srv.stop_ok();
    // The image itself holds the filesystem (the export is the whole file).
    let dumped = dir.path().join("dumped.bin");
    let cmd = format!("dump /f.bin {}", path_str(&dumped));
    sh("debugfs", [os("-R"), os(&cmd), img.as_os_str()]);
    assert_eq!(sha256(&dumped), want, "[{cache}] the image holds the file");
    let fsck = sh_status("e2fsck", [os("-f"), os("-n"), img.as_os_str()]);
    assert!(fsck.success(), "[{cache}] e2fsck of the image:\n{fsck}");
    // The loop device's writes reach loopd as they are (FUSE without a
    // writeback cache): 1 KiB blocks at 1 KiB offsets. Direct mode bounces only
    // what the file's direct-I/O alignment refuses (512 on most filesystems,
    // so often nothing here; fsx and the model test prove the bounces).
    let unaligned = st.at("unaligned").u64();
    let bounced = st.at("paths").at("bounced").u64();
    eprintln!("[{cache}] unaligned={unaligned} bounced={bounced}");
    assert!(unaligned > 0, "[{cache}] no unaligned request: {st:?}");
    assert_no_errors(&st, cache);
}

fn sha256(path: &Path) -> String {
    let out = sh("sha256sum", [path.as_os_str()]);
    out.stdout
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn ext4_on_512_sector_loop_over_nbdfuse_direct() {
    ext4_on_loop("direct");
}

#[test]
fn ext4_on_512_sector_loop_over_nbdfuse_buffered() {
    ext4_on_loop("buffered");
}

/// Random reads, writes, trims and write-zeroes at any byte offset and length
/// against a model of the disk; every read and the final image must match it.
fn nbdsh_model(cache: &str) {
    let dir = tempdir();
    let size = MIB;
    let (mut srv, img) = serve(dir.path(), cache, size, false);
    let script = format!(
        r#"
import random
h = connect({uri})
assert h.get_block_size(nbd.SIZE_MINIMUM) == 1
size = {size}
model = bytearray(size)
rng = random.Random(1123)
for i in range(400):
    kind = rng.choice(["write", "write", "read", "bigread", "trim", "zero", "zero_nohole"])
    off = rng.randrange(size - 1)
    # Big reads (spliced in buffered mode) start and end anywhere too.
    most = 300000 if kind == "bigread" else 20000
    n = rng.randrange(1, min(size - off, most) + 1)
    fua = nbd.CMD_FLAG_FUA if rng.random() < 0.2 else 0
    if kind == "write":
        b = rng.randbytes(n)
        h.pwrite(b, off, fua)
        model[off:off + n] = b
    elif kind in ("read", "bigread"):
        got = h.pread(n, off)
        assert got == bytes(model[off:off + n]), "read %d@%d differs" % (n, off)
    elif kind == "trim":
        h.trim(n, off, fua)
        model[off:off + n] = bytes(n)
    else:
        flags = fua | (nbd.CMD_FLAG_NO_HOLE if kind == "zero_nohole" else 0)
        h.zero(n, off, flags)
        model[off:off + n] = bytes(n)
h.flush()
assert h.pread(size, 0) == bytes(model), "whole device differs"
open({model_path}, "wb").write(model)
print("ok")
"#,
        uri = py_str(&srv.uri()),
        model_path = py_str(path_str(&dir.path().join("model.bin"))),
    );
    let out = nbdsh(&script);
    assert!(out.stdout.contains("ok"), "[{cache}] {out}");
    let st = status(&srv);
    srv.stop_ok();
    let model = fs::read(dir.path().join("model.bin")).expect("model");
    assert_bytes_eq(&read_file(&img), &model, 0, &format!("[{cache}] image"));
    let req = st.at("requests");
    for k in ["write", "read", "trim", "write_zeroes"] {
        assert!(req.at(k).u64() > 0, "[{cache}] no {k}: {st:?}");
    }
    assert!(st.at("unaligned").u64() > 300, "[{cache}] {st:?}");
    assert_no_errors(&st, cache);
    if cache == "direct" {
        assert!(st.at("paths").at("bounced").u64() > 0, "[{cache}] {st:?}");
    } else {
        assert!(st.at("paths").at("spliced").u64() > 0, "[{cache}] {st:?}");
    }
}

#[test]
fn nbdsh_unaligned_ops_match_a_model_direct() {
    nbdsh_model("direct");
}

#[test]
fn nbdsh_unaligned_ops_match_a_model_buffered() {
    nbdsh_model("buffered");
}

/// `strict_block_size = true` in a config file makes that export strict (a
/// device without it advertises a minimum of 1); `attach --strict-block-size`
/// is kept in the state file over a restart; `status` shows both.
#[test]
fn strict_block_size_from_config_and_state_file() {
    let dir = tempdir();
    let imgs = ["s", "l", "a"].map(|n| dir.path().join(format!("{n}.img")));
    for i in &imgs {
        create_sparse_image(i, MIB);
    }
    let cfg = dir.path().join("devices.toml");
    fs::write(
        &cfg,
        format!(
            "[[device]]\nimage = \"{}\"\nblock_size = 4096\nstrict_block_size = true\n\n\
             [[device]]\nimage = \"{}\"\nblock_size = 4096\n",
            path_str(&imgs[0]),
            path_str(&imgs[1])
        ),
    )
    .expect("write config");
    let (sock, state) = (dir.path().join("d.sock"), dir.path().join("d.state"));
    let mut srv = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .arg("--config")
        .arg(&cfg)
        .start();
    assert_eq!(advertised_minimum(&srv.uri_for_name("s")), 4096);
    assert_eq!(advertised_minimum(&srv.uri_for_name("l")), 1);
    assert!(
        srv.ctl_json(&["status", "s"])
            .at("strict_block_size")
            .bool()
    );
    assert!(
        !srv.ctl_json(&["status", "l"])
            .at("strict_block_size")
            .bool()
    );
    srv.ctl_ok(&[
        "attach",
        path_str(&imgs[2]),
        "--block-size",
        "4096",
        "--strict-block-size",
    ]);
    assert_eq!(advertised_minimum(&srv.uri_for_name("a")), 4096);
    srv.kill9();
    let srv = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    assert_eq!(
        advertised_minimum(&srv.uri_for_name("a")),
        4096,
        "strict again from the state file"
    );
    let st = srv.ctl_json(&["status", "a"]);
    assert!(st.at("strict_block_size").bool(), "{st:?}");
}
