//! Server lifecycle: durability across kill -9, clean SIGTERM/SIGINT stop,
//! --create, --read-only, the --offset/--size-limit window, odd file sizes,
//! argument validation and --help.

mod common;

use common::*;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

matrix_tests!(
    durability_after_sigkill,
    window_offset_size_limit,
    unaligned_file_size_tail,
    cache_mode_open_flags,
);

/// Data written and flushed survives `kill -9` of the server.
fn durability_after_sigkill(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("durable.img");
    create_sparse_image(&img, 64 * MIB);
    let sock = dir.path().join("durable.sock");
    let mut srv = Server::builder(&img)
        .combo(c)
        .tcp()
        .socket_path(&sock)
        .start();
    qemu_io(
        &srv.uri(),
        &["write -P 0xc3 1M 256k", "write -f -P 0xd4 5M 4k", "flush"],
    );
    qemu_io(&srv.tcp_uri(), &["write -P 0xe5 63M 1M", "flush"]);
    let pid = srv.pid();
    srv.kill9();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "[{c}] loopd pid {pid} still exists after kill -9"
    );

    // Restart on the same image and the same socket path (the stale socket
    // file of the killed server is still there).
    assert!(sock.exists(), "[{c}] expected a stale socket after kill -9");
    let mut srv2 = Server::builder(&img).combo(c).socket_path(&sock).start();
    qemu_io(
        &srv2.uri(),
        &[
            "read -P 0xc3 1M 256k",
            "read -P 0xd4 5M 4k",
            "read -P 0xe5 63M 1M",
            "read -P 0 0 1M",
        ],
    );
    srv2.stop_ok();
    assert_file_filled(&img, MIB, 256 * KIB, 0xc3, &format!("[{c}] after restart"));
    assert_file_filled(&img, 5 * MIB, 4 * KIB, 0xd4, &format!("[{c}] FUA write"));
    assert_file_filled(&img, 63 * MIB, MIB, 0xe5, &format!("[{c}] tcp write"));
}

/// SIGTERM: exit status 0 and the socket file is removed.
#[test]
fn sigterm_clean_exit_removes_socket() {
    let dir = tempdir();
    let img = dir.path().join("t.img");
    create_sparse_image(&img, 8 * MIB);
    let mut srv = Server::builder(&img).tcp().start();
    let sock = srv.socket().to_path_buf();
    assert!(
        sock.exists(),
        "socket {} missing while running",
        sock.display()
    );
    qemu_io(&srv.uri(), &["write -P 0x12 0 64k"]);
    let st = srv.stop();
    assert_eq!(
        st.code(),
        Some(0),
        "exit status after SIGTERM: {st}\n{}",
        srv.stderr_text()
    );
    assert!(
        !sock.exists(),
        "socket file {} not removed on SIGTERM",
        sock.display()
    );
    assert_file_filled(&img, 0, 64 * KIB, 0x12, "data after SIGTERM");
}

/// SIGINT behaves like SIGTERM.
#[test]
fn sigint_clean_exit_removes_socket() {
    let dir = tempdir();
    let img = dir.path().join("t.img");
    create_sparse_image(&img, 8 * MIB);
    let mut srv = Server::builder(&img).start();
    let sock = srv.socket().to_path_buf();
    let st = srv.stop_with(libc::SIGINT);
    assert_eq!(st.code(), Some(0), "exit status after SIGINT: {st}");
    assert!(!sock.exists(), "socket file not removed on SIGINT");
}

/// SIGTERM while a client is connected (idle, and with a write in flight):
/// the server still stops promptly with status 0, and an acknowledged write
/// is in the file.
#[test]
fn sigterm_with_connected_client() {
    let dir = tempdir();
    let img = dir.path().join("t.img");
    create_sparse_image(&img, 16 * MIB);
    let mut srv = Server::builder(&img).combo(Combo::DIRECT_4096).start();
    let sock = srv.socket().to_path_buf();

    // An idle connected client.
    let (mut idle, _, _) = RawClient::handshake(&sock, srv.name());
    // A client with an 8 MiB write in flight when the signal arrives.
    let (mut busy, _, _) = RawClient::handshake(&sock, srv.name());
    let len = 8 * MIB;
    busy.send_request(0, NBD_CMD_WRITE, 77, 4 * MIB, u32::try_from(len).unwrap());
    busy.send(&vec![0x9a; usize::try_from(len).unwrap()]);
    srv.signal(libc::SIGTERM);

    // Reply to the in-flight write: success (then the data must be in the
    // file), an error, or a closed connection are all acceptable.
    let mut hdr = [0u8; 16];
    let acked = match std::io::Read::read_exact(&mut busy.s, &mut hdr) {
        Ok(()) => {
            assert_eq!(
                u32::from_be_bytes(hdr[0..4].try_into().unwrap()),
                SIMPLE_REPLY_MAGIC
            );
            assert_eq!(u64::from_be_bytes(hdr[8..16].try_into().unwrap()), 77);
            u32::from_be_bytes(hdr[4..8].try_into().unwrap()) == 0
        }
        Err(_) => false,
    };
    let st = srv
        .wait_timeout(Duration::from_secs(10))
        .unwrap_or_else(|| {
            panic!("loopd did not exit within 10 s of SIGTERM with clients connected")
        });
    assert_eq!(
        st.code(),
        Some(0),
        "exit status: {st}\n{}",
        srv.stderr_text()
    );
    assert!(!sock.exists(), "socket file not removed");
    idle.expect_closed("idle client after server shutdown");
    if acked {
        assert_file_filled(&img, 4 * MIB, len, 0x9a, "acknowledged in-flight write");
    }
}

/// --create makes a sparse image of the requested size; existing images are
/// left alone.
#[test]
fn create_sparse_image_option() {
    let dir = tempdir();
    let img = dir.path().join("new.img");
    assert!(!img.exists());
    let srv = Server::builder(&img).arg("--create").arg("64M").start();
    let meta = std::fs::metadata(&img).expect("--create did not create the image");
    assert_eq!(meta.len(), 64 * MIB, "created image size");
    assert!(
        meta.blocks() * 512 <= MIB,
        "created image is not sparse: {} bytes allocated",
        meta.blocks() * 512
    );
    let out = run("nbdinfo", ["--size", srv.uri().as_str()]);
    assert_eq!(out.stdout.trim(), (64 * MIB).to_string());
    qemu_io(&srv.uri(), &["read -P 0 0 1M", "read -P 0 63M 1M"]);
    drop(srv);

    // Size suffixes.
    for (arg, size) in [
        ("512K", 512 * KIB),
        ("3M", 3 * MIB),
        ("2G", 2 << 30),
        ("1T", 1 << 40),
    ] {
        let p = dir.path().join(format!("s{arg}.img"));
        let srv = Server::builder(&p).arg("--create").arg(arg).start();
        assert_eq!(file_len(&p), size, "--create {arg}");
        let out = run("nbdinfo", ["--size", srv.uri().as_str()]);
        assert_eq!(out.stdout.trim(), size.to_string(), "--create {arg}");
    }

    // An existing image is neither truncated nor overwritten.
    let existing = dir.path().join("existing.img");
    create_pattern_image(&existing, MIB, 21);
    let srv = Server::builder(&existing)
        .arg("--create")
        .arg("64M")
        .start();
    let out = run("nbdinfo", ["--size", srv.uri().as_str()]);
    assert_eq!(out.stdout.trim(), MIB.to_string(), "existing image resized");
    drop(srv);
    assert_eq!(file_len(&existing), MIB);
    assert_file_pattern(&existing, 0, MIB, 21, "existing image content");
}

/// `--create SIZE --preallocate` makes an image with every block allocated
/// (`fallocate`) that reads as zeros and serves its size; `preallocate` without
/// `create` is refused (the CLI, and the control socket with `invalid`); a
/// preallocation the filesystem cannot do fails the attach with `io`, naming
/// the way out, and leaves no file (not even its temporary name).
#[test]
fn create_preallocate_allocates_every_block_or_leaves_nothing() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("full.img");
    srv.ctl_ok(&[
        "attach",
        path_str(&img),
        "--create",
        "8M",
        "--preallocate",
        "--name",
        "full",
    ]);
    let meta = std::fs::metadata(&img).expect("--create --preallocate made no image");
    assert_eq!(meta.len(), 8 * MIB, "created image size");
    assert!(
        meta.blocks() * 512 >= 8 * MIB,
        "not preallocated: {} bytes allocated of {}",
        meta.blocks() * 512,
        8 * MIB
    );
    qemu_io(
        &srv.uri_for_name("full"),
        &[
            "read -P 0 0 8M",
            "write -P 0x5a 4M 64k",
            "read -P 0x5a 4M 64k",
        ],
    );
    assert_eq!(
        std::fs::metadata(&img).expect("stat").blocks(),
        meta.blocks(),
        "a write into the preallocated image allocated more"
    );
    let plain = dir.path().join("plain.img");
    let out = srv.ctl(&["attach", path_str(&plain), "--preallocate"]);
    assert!(
        !out.success() && out.stderr.contains("--create"),
        "--preallocate without --create is refused, naming --create: {out}"
    );
    let mut c = ControlConn::connect(srv.control());
    let e = c.err(
        &format!(
            r#"{{"v":1,"op":"attach","image":"{}","preallocate":true}}"#,
            path_str(&plain)
        ),
        "invalid",
    );
    assert!(e.contains("give create"), "{e}");
    assert!(!plain.exists(), "nothing created");

    // 4 EiB (2^62): past any free space and past ext4's largest file.
    let huge = dir.path().join("huge.img");
    let out = srv.ctl_err(
        &[
            "attach",
            path_str(&huge),
            "--create",
            "4194304T",
            "--preallocate",
        ],
        "io",
    );
    assert!(
        out.stderr.contains("cannot allocate") && out.stderr.contains("leave out preallocate"),
        "the error says what failed and the way out: {out}"
    );
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("huge"))
        .collect();
    assert!(left.is_empty(), "a failed preallocation left {left:?}");
    assert!(srv.device("huge").is_none());
}

/// `--create` of a size that is not a whole number of blocks is refused
/// (`invalid`, naming the sizes that would do) and creates nothing; `--create`
/// of an image that exists says it kept that file and serves its size.
#[test]
fn create_refuses_part_blocks_and_says_when_it_kept_a_file() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("tiny.img");
    let out = srv.ctl_err(
        &["attach", img.to_str().unwrap(), "--create", "100"],
        "invalid",
    );
    assert!(
        out.stderr.contains("not a whole number of 512-byte blocks")
            && out.stderr.contains("give 512"),
        "the refusal says why and what to give: {out}"
    );
    assert!(!img.exists(), "nothing created: {out}");
    // `serve` says the same, with the same class.
    let sock = dir.path().join("s.sock");
    let served = loopd_run([
        "serve",
        img.to_str().unwrap(),
        "--create",
        "100",
        "--socket",
        sock.to_str().unwrap(),
        "--state",
        dir.path().join("st").to_str().unwrap(),
    ]);
    assert_eq!(served.status.code(), Some(7), "invalid (7): {served}");
    assert!(served.stderr.contains("512-byte blocks"), "{served}");
    assert!(!img.exists(), "nothing created: {served}");

    let existing = dir.path().join("old.img");
    create_pattern_image(&existing, MIB, 7);
    let out = srv.ctl_ok(&["attach", existing.to_str().unwrap(), "--create", "1G"]);
    assert!(
        out.stderr.contains("exists: kept as it is")
            && out.stderr.contains(&format!("serves its {MIB} bytes")),
        "the attach says it kept the file and serves its size: {out}"
    );
    assert_eq!(file_len(&existing), MIB, "the file is as it was");
    let j = srv.ctl_json(&["status", "old"]);
    assert_eq!(j.at("size").u64(), MIB, "{j:?}");
}

/// Without --create a missing image is an error (and nothing is created).
#[test]
fn missing_image_without_create_fails() {
    let dir = tempdir();
    let img = dir.path().join("absent.img");
    let sock = dir.path().join("s.sock");
    let state = dir.path().join("s.state");
    let out = loopd_run([
        "serve",
        img.to_str().unwrap(),
        "--socket",
        sock.to_str().unwrap(),
        "--state",
        state.to_str().unwrap(),
    ]);
    assert!(
        !out.success(),
        "serving a missing image should fail:\n{out}"
    );
    assert!(!out.stderr.trim().is_empty(), "no error message:\n{out}");
    assert!(!img.exists(), "image was created without --create");
}

/// --read-only is advertised to clients.
#[test]
fn read_only_advertised() {
    let dir = tempdir();
    let img = dir.path().join("ro.img");
    create_pattern_image(&img, 4 * MIB, 2);
    let srv = Server::builder(&img).arg("--read-only").tcp().start();
    for uri in [srv.uri(), srv.tcp_uri()] {
        let out = run("nbdinfo", ["--json", "--no-content", uri.as_str()]);
        let doc = Json::parse(&out.stdout);
        let e = &doc.at("exports").arr()[0];
        assert!(e.at("is_read_only").bool(), "{uri} not read-only:\n{out}");
        let can = run_status("nbdinfo", ["--is", "read-only", uri.as_str()]);
        assert!(can.success(), "nbdinfo --is read-only: {can}");
    }
    // Reads work; a qemu-io write fails.
    let out_img = dir.path().join("copy.img");
    run("nbdcopy", [srv.uri().as_str(), out_img.to_str().unwrap()]);
    assert_bytes_eq(&read_file(&out_img), &read_file(&img), 0, "read-only copy");
    let w = qemu_io_status(&srv.uri(), &["write -P 1 0 4k"]);
    let all = format!("{}{}", w.stdout, w.stderr);
    assert!(
        !w.success() || all.contains("failed"),
        "write to read-only export succeeded:\n{w}"
    );
    drop(srv);
    assert_file_pattern(&img, 0, 4 * MIB, 2, "read-only image");
}

/// --offset/--size-limit expose a window of the file, like losetup -o/--sizelimit.
fn window_offset_size_limit(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("win.img");
    let fsize = 8 * MIB;
    create_pattern_image(&img, fsize, 31);
    let mut srv = Server::builder(&img)
        .combo(c)
        .args(["--offset", "1048576", "--size-limit", "4194304"])
        .start();
    let uri = srv.uri();
    let out = run("nbdinfo", ["--size", uri.as_str()]);
    assert_eq!(
        out.stdout.trim(),
        (4 * MIB).to_string(),
        "[{c}] window size"
    );

    // Export offset 0 is file offset 1 MiB.
    let copy = dir.path().join("copy.img");
    run("nbdcopy", [uri.as_str(), copy.to_str().unwrap()]);
    assert_bytes_eq(
        &read_file(&copy),
        &pattern_bytes(31, MIB, usize::try_from(4 * MIB).unwrap()),
        0,
        &format!("[{c}] window content"),
    );
    // Writes land at 1 MiB + x; the window end is enforced.
    let script = format!(
        r#"
h = connect({uri}, strict=0)
assert h.get_size() == 4 * 1024 * 1024
h.pwrite(b"\x3c" * 4096, 4096)
h.pwrite(b"\x4d" * 4096, 4 * 1024 * 1024 - 4096)
h.flush()
expect_err("read past window", lambda: h.pread(4096, 4 * 1024 * 1024), [errno.EINVAL])
expect_err("write past window", lambda: h.pwrite(b"\x01" * 4096, 4 * 1024 * 1024), [errno.ENOSPC, errno.EINVAL])
expect_err("zero past window", lambda: h.zero(4096, 4 * 1024 * 1024), [errno.ENOSPC, errno.EINVAL])
expect_err("trim past window", lambda: h.trim(4096, 4 * 1024 * 1024), [errno.EINVAL, errno.ENOSPC])
assert h.pread(4096, 4096) == b"\x3c" * 4096
print("OK")
"#,
        uri = py_str(&uri)
    );
    nbdsh(&script);
    srv.stop_ok();

    let mut want = pattern_bytes(31, 0, usize::try_from(fsize).unwrap());
    let m = usize::try_from(MIB).unwrap();
    want[m + 4096..m + 8192].fill(0x3c);
    want[5 * m - 4096..5 * m].fill(0x4d);
    assert_bytes_eq(
        &read_file(&img),
        &want,
        0,
        &format!("[{c}] file after window writes"),
    );

    // --offset alone: the export runs to the end of the file.
    let srv = Server::builder(&img)
        .combo(c)
        .args(["--offset", "2097152"])
        .start();
    let out = run("nbdinfo", ["--size", srv.uri().as_str()]);
    assert_eq!(
        out.stdout.trim(),
        (6 * MIB).to_string(),
        "[{c}] --offset 2M size"
    );
    let copy2 = dir.path().join("copy2.img");
    run("nbdcopy", [srv.uri().as_str(), copy2.to_str().unwrap()]);
    assert_bytes_eq(
        &read_file(&copy2),
        &want[2 * m..],
        0,
        &format!("[{c}] --offset 2M content"),
    );
}

/// A file whose size is not a multiple of the block size: the tail is
/// readable, followed by zeroes up to the export size.
fn unaligned_file_size_tail(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("odd.img");
    let fsize = MIB + 100;
    create_pattern_image(&img, fsize, 17);
    let srv = Server::start(&img, c);
    let out = run("nbdinfo", ["--size", srv.uri().as_str()]);
    let size: u64 = out.stdout.trim().parse().expect("nbdinfo --size output");
    let bs = c.bs();
    assert!(
        size >= fsize && size <= fsize.div_ceil(bs) * bs,
        "[{c}] export size {size} for a {fsize}-byte file (expected between {fsize} and the next multiple of {bs})"
    );
    // Read everything with libnbd (strict mode off: the tail may not be a
    // whole block) and compare.
    let script = format!(
        r#"
h = connect({uri}, strict=0)
size = h.get_size()
data = b""
while len(data) < size:
    n = min(65536, size - len(data))
    data += h.pread(n, len(data))
sys.stdout.write(data.hex())
"#,
        uri = py_str(&srv.uri())
    );
    let out = nbdsh(&script);
    let got: Vec<u8> = (0..out.stdout.trim().len() / 2)
        .map(|i| u8::from_str_radix(&out.stdout.trim()[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    assert_eq!(got.len() as u64, size, "[{c}] bytes read");
    let mut want = pattern_bytes(17, 0, usize::try_from(fsize).unwrap());
    want.resize(usize::try_from(size).unwrap(), 0);
    assert_bytes_eq(&got, &want, 0, &format!("[{c}] content incl. tail"));
}

/// Invalid --block-size values are rejected with a clear message.
#[test]
fn bad_block_size_rejected() {
    let dir = tempdir();
    let img = dir.path().join("b.img");
    create_sparse_image(&img, MIB);
    for bad in ["1000", "8192", "0", "256", "abc"] {
        let sock = dir.path().join(format!("{bad}.sock"));
        let state = dir.path().join(format!("{bad}.state"));
        let out = loopd_run([
            "serve",
            img.to_str().unwrap(),
            "--socket",
            sock.to_str().unwrap(),
            "--state",
            state.to_str().unwrap(),
            "--block-size",
            bad,
        ]);
        assert!(!out.success(), "--block-size {bad} accepted:\n{out}");
        let err = out.stderr.to_lowercase();
        assert!(
            err.contains("block size") || err.contains("block-size"),
            "--block-size {bad}: stderr does not mention the block size:\n{out}"
        );
        assert!(!sock.exists(), "--block-size {bad}: socket left behind");
    }
}

/// `loopd --help` and `loopd serve --help` exit 0 and document every option.
#[test]
fn help_mentions_every_option() {
    let top = loopd_run(["--help"]).assert_success();
    assert!(top.stdout.contains("serve"), "loopd --help:\n{top}");
    let serve = loopd_run(["serve", "--help"]).assert_success();
    for opt in [
        "--socket",
        "--listen",
        "--name",
        "--create",
        "--offset",
        "--size-limit",
        "--block-size",
        "--cache",
        "--read-only",
        "IMAGE",
    ] {
        assert!(
            serve.stdout.contains(opt),
            "loopd serve --help does not mention {opt}:\n{serve}"
        );
    }
}

/// Open flags of every descriptor the server holds on `image`, from
/// /proc/PID/fdinfo.
fn image_fd_flags(pid: u32, image: &std::path::Path) -> Vec<u32> {
    let want = std::fs::canonicalize(image).expect("canonicalize image");
    let mut flags = Vec::new();
    for ent in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read /proc/PID/fd") {
        let ent = ent.expect("fd entry");
        let Ok(target) = std::fs::read_link(ent.path()) else {
            continue;
        };
        if target != want {
            continue;
        }
        let fd = ent.file_name().to_string_lossy().into_owned();
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap_or_default();
        if let Some(line) = info.lines().find(|l| l.starts_with("flags:")) {
            let v = u32::from_str_radix(line["flags:".len()..].trim(), 8).expect("octal flags");
            flags.push(v);
        }
    }
    flags
}

/// `--cache direct` opens the image with O_DIRECT, `--cache buffered`
/// without; `--read-only` opens it read-only.
fn cache_mode_open_flags(c: Combo) {
    let o_direct = u32::try_from(libc::O_DIRECT).unwrap();
    let o_accmode = u32::try_from(libc::O_ACCMODE).unwrap();
    let dir = tempdir();
    let img = dir.path().join("flags.img");
    create_sparse_image(&img, 8 * MIB);
    for read_only in [false, true] {
        let mut b = Server::builder(&img).combo(c);
        if read_only {
            b = b.arg("--read-only");
        }
        let srv = b.start();
        // Make sure the image has been used (lazy opens), and keep a client
        // connected while looking (per-connection opens).
        run("nbdcopy", [srv.uri().as_str(), "null:"]);
        let (mut held, _, _) = RawClient::handshake(srv.socket(), srv.name());
        held.read(1, 0, 4096);
        let flags = image_fd_flags(srv.pid(), &img);
        assert!(
            !flags.is_empty(),
            "[{c}] loopd has no open descriptor on the image"
        );
        let direct = flags.iter().filter(|&&f| f & o_direct != 0).count();
        match c.cache {
            "direct" => assert!(
                direct > 0,
                "[{c}] no image descriptor opened with O_DIRECT (flags {flags:?})"
            ),
            _ => assert_eq!(
                direct, 0,
                "[{c}] image descriptor opened with O_DIRECT in buffered mode (flags {flags:?})"
            ),
        }
        if read_only {
            for f in &flags {
                assert_eq!(
                    f & o_accmode,
                    u32::try_from(libc::O_RDONLY).unwrap(),
                    "[{c}] --read-only but the image is open for writing (flags {f:o})"
                );
            }
        }
    }
}

/// A TCP-only server (no --socket) serves data and stops cleanly.
#[test]
fn tcp_only_server() {
    let dir = tempdir();
    let img = dir.path().join("net.img");
    create_pattern_image(&img, 4 * MIB, 40);
    let mut srv = Server::builder(&img).tcp_only().start();
    let copy = dir.path().join("copy.img");
    run("nbdcopy", [srv.tcp_uri().as_str(), copy.to_str().unwrap()]);
    assert_bytes_eq(&read_file(&copy), &read_file(&img), 0, "tcp copy");
    let port = srv.port();
    srv.stop_ok();
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still accepts connections after loopd exited"
    );
}

/// SIGTERM while fio is hammering the export over two connections: loopd
/// exits 0 within 10 s, removes its socket, and the client terminates.
#[test]
fn sigterm_under_load() {
    let dir = tempdir();
    let img = dir.path().join("load.img");
    create_sparse_image(&img, 64 * MIB);
    let mut srv = Server::builder(&img).combo(Combo::DIRECT_4096).start();
    let mut fio = tool("fio");
    fio.args([
        "--name=load",
        "--ioengine=nbd",
        &format!("--uri={}", srv.uri()),
        "--rw=randrw",
        "--bs=4k",
        "--size=16M",
        "--numjobs=2",
        "--offset_increment=16M",
        "--iodepth=16",
        "--time_based",
        "--runtime=30",
    ]);
    fio.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = fio.spawn().expect("spawn fio");
    std::thread::sleep(Duration::from_millis(700));
    if let Ok(Some(st)) = child.try_wait() {
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err);
        panic!("fio exited ({st}) before the SIGTERM; no load was applied:\n{err}");
    }
    let st = srv.stop();
    let client_done = (0..1000).any(|_| {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
        false
    });
    if !client_done {
        let _ = child.kill();
    }
    let _ = child.wait();
    assert_eq!(
        st.code(),
        Some(0),
        "exit status under load: {st}\n{}",
        srv.stderr_text()
    );
    assert!(client_done, "fio still running 10 s after loopd exited");
    assert!(!srv.socket().exists(), "socket not removed");
}
