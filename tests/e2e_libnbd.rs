//! End-to-end tests driving loopd with libnbd tools (nbdinfo, nbdcopy,
//! nbdsh) and with a hand-rolled raw NBD client.

mod common;

use common::*;

matrix_tests!(
    nbdinfo_json,
    nbdcopy_multi_conn,
    nbdsh_errors_keep_connection,
    nbdsh_commands_and_flags,
);

const SIZE: u64 = 64 * MIB;

fn nbdinfo_json_for(uri: &str) -> Json {
    let out = run("nbdinfo", ["--json", "--no-content", uri]);
    let doc = Json::parse(&out.stdout);
    let exports = doc.at("exports").arr();
    assert_eq!(exports.len(), 1, "expected one export:\n{}", out.stdout);
    exports[0].clone()
}

/// nbdinfo reports the size, the block-size constraints, base:allocation
/// and the transmission flags loopd implements.
fn nbdinfo_json(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, SIZE);
    let srv = Server::builder(&img).combo(c).name("vol0").tcp().start();

    for uri in [srv.uri(), srv.tcp_uri()] {
        let e = nbdinfo_json_for(&uri);
        let ctx = format!("[{c}] {uri}: {e:?}");
        assert_eq!(e.at("export-name").str(), "vol0", "{ctx}");
        assert_eq!(e.at("export-size").u64(), SIZE, "{ctx}");
        assert_eq!(
            e.at("block_size_minimum").u64(),
            1,
            "minimum block size (unaligned requests are served) {ctx}"
        );
        assert_eq!(
            e.at("block_size_preferred").u64(),
            c.bs().max(4096),
            "preferred block size {ctx}"
        );
        assert_eq!(
            e.at("block_size_maximum").u64(),
            32 * MIB,
            "maximum block size {ctx}"
        );
        let contexts: Vec<&str> = e.at("contexts").arr().iter().map(Json::str).collect();
        assert!(
            contexts.contains(&"base:allocation"),
            "base:allocation missing {ctx}"
        );
        assert!(!e.at("is_read_only").bool(), "{ctx}");
        for flag in [
            "can_flush",
            "can_fua",
            "can_trim",
            "can_zero",
            "can_fast_zero",
            "can_multi_conn",
            "can_cache",
            "can_df",
        ] {
            assert!(e.at(flag).bool(), "{flag} should be true {ctx}");
        }
    }

    let list = run("nbdinfo", ["--list", srv.uri().as_str()]);
    assert!(
        list.stdout.contains("export=\"vol0\""),
        "[{c}] nbdinfo --list does not show the export name:\n{list}"
    );
    let size = run("nbdinfo", ["--size", srv.tcp_uri().as_str()]);
    assert_eq!(size.stdout.trim(), SIZE.to_string(), "[{c}] nbdinfo --size");
}

/// Default export name is the file stem; the empty export name also works.
#[test]
fn export_names() {
    let dir = tempdir();
    let img = dir.path().join("my-disk.img");
    create_pattern_image(&img, 2 * MIB, 9);
    let srv = Server::builder(&img).tcp().start();
    assert_eq!(srv.name(), "my-disk");
    let list = run("nbdinfo", ["--list", srv.uri().as_str()]);
    assert!(
        list.stdout.contains("export=\"my-disk\""),
        "default export name should be the file stem:\n{list}"
    );
    for uri in [
        srv.uri(),
        srv.uri_for_name(""),
        srv.tcp_uri(),
        format!("nbd://127.0.0.1:{}", srv.port()),
    ] {
        let out = run("nbdinfo", ["--size", uri.as_str()]);
        assert_eq!(out.stdout.trim(), (2 * MIB).to_string(), "size via {uri}");
    }
    // Reading through the empty name returns the image data.
    let out_img = dir.path().join("copy.img");
    run(
        "nbdcopy",
        [srv.uri_for_name("").as_str(), out_img.to_str().unwrap()],
    );
    assert_bytes_eq(
        &read_file(&out_img),
        &read_file(&img),
        0,
        "copy via empty export name",
    );

    // An explicit empty --name.
    let img2 = dir.path().join("other.img");
    create_sparse_image(&img2, MIB);
    let srv2 = Server::builder(&img2).name("").start();
    assert_eq!(srv2.uri(), srv2.uri_for_name(""));
    let out = run("nbdinfo", ["--size", srv2.uri().as_str()]);
    assert_eq!(out.stdout.trim(), MIB.to_string());
}

/// A client asking for an export name the server does not have is refused
/// (NBD_REP_ERR_UNKNOWN), and the server keeps serving.
#[test]
fn unknown_export_name_rejected() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, MIB);
    let mut srv = Server::builder(&img).name("right").start();
    let bad = run_status("nbdinfo", ["--size", srv.uri_for_name("wrong").as_str()]);
    assert!(
        !bad.success(),
        "connecting to export 'wrong' should fail:\n{bad}"
    );
    // Raw NBD_OPT_EXPORT_NAME with a wrong name: the server must close.
    let mut c = RawClient::connect(srv.socket());
    let hflags = c.greeting();
    c.send(&(if hflags & 2 != 0 { 3u32 } else { 1u32 }).to_be_bytes());
    c.send_option(NBD_OPT_EXPORT_NAME, b"wrong");
    c.expect_closed("NBD_OPT_EXPORT_NAME with an unknown name");
    srv.assert_running();
    let ok = run("nbdinfo", ["--size", srv.uri().as_str()]);
    assert_eq!(ok.stdout.trim(), MIB.to_string());
}

/// nbdcopy with 4 connections, into and out of the export.
fn nbdcopy_multi_conn(c: Combo) {
    let dir = tempdir();
    let src = dir.path().join("src.img");
    let size = 32 * MIB;
    create_pattern_image(&src, size, 11);
    write_at(
        &src,
        10 * MIB,
        &vec![0u8; usize::try_from(3 * MIB).unwrap()],
    );
    let target = dir.path().join("target.img");
    create_filled_image(&target, size, 0xee);
    let mut srv = Server::builder(&target).combo(c).tcp().start();

    // nbdcopy silently falls back to one connection without multi-conn.
    let can = run_status("nbdinfo", ["--can", "multi-conn", srv.uri().as_str()]);
    assert!(
        can.success(),
        "[{c}] server does not advertise CAN_MULTI_CONN:\n{can}"
    );

    run(
        "nbdcopy",
        [
            "--connections=4",
            "--requests=16",
            "--request-size=1048576",
            src.to_str().unwrap(),
            srv.uri().as_str(),
        ],
    );
    let out = dir.path().join("out.img");
    run(
        "nbdcopy",
        [
            "-C",
            "4",
            "--request-size=262144",
            srv.tcp_uri().as_str(),
            out.to_str().unwrap(),
        ],
    );
    let want = read_file(&src);
    assert_bytes_eq(&read_file(&out), &want, 0, &format!("[{c}] copied out"));
    srv.stop_ok();
    assert_bytes_eq(
        &read_file(&target),
        &want,
        0,
        &format!("[{c}] target image"),
    );
}

/// Protocol errors get the right errno and the connection survives them.
fn nbdsh_errors_keep_connection(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_pattern_image(&img, SIZE, 5);
    let mut srv = Server::start(&img, c);
    let tail_before = read_range(&img, SIZE - 8192, 8192);
    let script = format!(
        r#"
uri = {uri}
SIZE = {size}
h = connect(uri, strict=0)
assert h.get_size() == SIZE, h.get_size()
orig = h.pread(4096, 0)

def alive(what):
    assert h.pread(4096, 0) == orig, "data changed / connection broken after " + what

expect_err("read past end", lambda: h.pread(4096, SIZE), [errno.EINVAL])
alive("read past end")
expect_err("read straddling end", lambda: h.pread(8192, SIZE - 4096), [errno.EINVAL])
alive("read straddling end")
expect_err("read far past end", lambda: h.pread(4096, 1 << 50), [errno.EINVAL])
alive("read far past end")
expect_err("write past end", lambda: h.pwrite(b"\x01" * 4096, SIZE), [errno.ENOSPC, errno.EINVAL])
alive("write past end")
expect_err("write straddling end", lambda: h.pwrite(b"\x02" * 8192, SIZE - 4096), [errno.ENOSPC, errno.EINVAL])
alive("write straddling end")
expect_err("zero past end", lambda: h.zero(4096, SIZE), [errno.ENOSPC, errno.EINVAL])
alive("zero past end")
expect_err("trim past end", lambda: h.trim(4096, SIZE), [errno.EINVAL, errno.ENOSPC])
alive("trim past end")
expect_err("64 MiB read (over the 32 MiB maximum)", lambda: h.pread(64 * 1024 * 1024, 0),
           [errno.EINVAL, errno.EOVERFLOW])
alive("oversize read")
expect_err("33 MiB read (over the 32 MiB maximum)", lambda: h.pread(33 * 1024 * 1024, 0),
           [errno.EINVAL, errno.EOVERFLOW])
alive("oversize read")

# A request of exactly the maximum size works.
big = h.pread(32 * 1024 * 1024, 0)
assert len(big) == 32 * 1024 * 1024
assert big[:4096] == orig

expect_err("cache past end", lambda: h.cache(4096, SIZE), [errno.EINVAL])
alive("cache past end")
expect_err("block status past end", lambda: h.block_status(4096, SIZE, lambda *a: 0), [errno.EINVAL])
alive("block status past end")

# Zero-length requests: success or EINVAL, never a dropped connection.
for (what, fn) in [("zero-length read", lambda: h.pread(0, 0)),
                   ("zero-length write", lambda: h.pwrite(b"", 4096)),
                   ("zero-length trim", lambda: h.trim(0, 4096)),
                   ("zero-length write zeroes", lambda: h.zero(0, 4096)),
                   ("zero-length cache", lambda: h.cache(0, 0))]:
    try:
        fn()
    except nbd.Error as e:
        assert e.errnum == errno.EINVAL, "%s: expected success or EINVAL, got %s" % (what, e.errno)
    alive(what)

# A write of exactly the maximum size works.
h.pwrite(b"\x77" * (32 * 1024 * 1024), 16 * 1024 * 1024)
assert h.pread(32 * 1024 * 1024, 16 * 1024 * 1024) == b"\x77" * (32 * 1024 * 1024)

# Writes still work on this connection and are visible.
h.pwrite(b"\xab" * 4096, 8192)
assert h.pread(4096, 8192) == b"\xab" * 4096
h.flush()
print("OK")
"#,
        uri = py_str(&srv.uri()),
        size = SIZE,
    );
    let out = nbdsh(&script);
    assert!(out.stdout.contains("OK"), "[{c}] {out}");
    srv.assert_running();
    srv.stop_ok();

    // Failed requests did not touch (or grow) the file.
    assert_eq!(file_len(&img), SIZE, "[{c}] image size changed");
    assert_bytes_eq(
        &read_range(&img, SIZE - 8192, 8192),
        &tail_before,
        SIZE - 8192,
        &format!("[{c}] tail after rejected writes"),
    );
    assert_file_filled(&img, 8192, 4096, 0xab, &format!("[{c}] write after errors"));
    assert_file_filled(
        &img,
        16 * MIB,
        32 * MIB,
        0x77,
        &format!("[{c}] 32 MiB write"),
    );
    assert_file_pattern(
        &img,
        48 * MIB,
        16 * MIB - 8192,
        5,
        &format!("[{c}] after 32 MiB write"),
    );
    assert_file_pattern(&img, 0, 8192, 5, &format!("[{c}] head"));
}

/// Requests smaller than / not aligned to the block size are performed
/// correctly (read-modify-write) -- never refused (the NBD minimum is 1), never
/// corrupting neighbouring bytes.
#[test]
fn nbdsh_unaligned_requests() {
    for c in Combo::ALL {
        let dir = tempdir();
        let img = dir.path().join("disk.img");
        create_pattern_image(&img, 4 * MIB, 8);
        let mut srv = Server::start(&img, c);
        let script = format!(
            r#"
h = connect({uri}, strict=0)
res = []
for (what, fn) in [
        ("write 3 bytes at 510", lambda: h.pwrite(b"\x5a" * 3, 510)),
        ("write 100 bytes at 8190", lambda: h.pwrite(b"\x6b" * 100, 8190)),
        ("zero 3 bytes at 20000", lambda: h.zero(3, 20000)),
        ("read 3 bytes at 70001", lambda: h.pread(3, 70001))]:
    try:
        r = fn()
        res.append("%s=ok" % what)
        if what.startswith("read"):
            assert len(r) == 3
            res.append("readdata=" + r.hex())
    except nbd.Error as e:
        assert e.errnum == errno.EINVAL, "%s: expected success or EINVAL, got %s" % (what, e.errno)
        res.append("%s=EINVAL" % what)
assert len(h.pread(4096, 0)) == 4096
h.flush()
print(";".join(res))
"#,
            uri = py_str(&srv.uri())
        );
        let out = nbdsh(&script);
        srv.stop_ok();
        assert!(
            !out.stdout.contains("EINVAL"),
            "[{c}] an unaligned request was refused:\n{out}"
        );
        let mut want = pattern_bytes(8, 0, usize::try_from(4 * MIB).unwrap());
        if out.stdout.contains("write 3 bytes at 510=ok") {
            want[510..513].fill(0x5a);
        }
        if out.stdout.contains("write 100 bytes at 8190=ok") {
            want[8190..8290].fill(0x6b);
        }
        if out.stdout.contains("zero 3 bytes at 20000=ok") {
            want[20000..20003].fill(0);
        }
        if out.stdout.contains("read 3 bytes at 70001=ok") {
            let hex: String = want[70001..70004]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert!(
                out.stdout.contains(&format!("readdata={hex}")),
                "[{c}] unaligned read returned wrong data (want {hex}):\n{out}"
            );
        }
        assert_bytes_eq(
            &read_file(&img),
            &want,
            0,
            &format!(
                "[{c}] image after unaligned requests ({})",
                out.stdout.trim()
            ),
        );
    }
}

/// Writes on a --read-only export fail with EPERM; reads keep working and
/// the file is untouched.
#[test]
fn read_only_eperm() {
    let dir = tempdir();
    let img = dir.path().join("ro.img");
    create_pattern_image(&img, 4 * MIB, 6);
    let before = read_file(&img);
    let mut srv = Server::builder(&img).arg("--read-only").start();
    let script = format!(
        r#"
h = connect({uri}, strict=0)
assert h.is_read_only(), "export not advertised read-only"
orig = h.pread(4096, 0)
expect_err("write on read-only", lambda: h.pwrite(b"\x01" * 4096, 0), [errno.EPERM])
assert h.pread(4096, 0) == orig
expect_err("write zeroes on read-only", lambda: h.zero(4096, 0), [errno.EPERM])
assert h.pread(4096, 0) == orig
expect_err("trim on read-only", lambda: h.trim(4096, 0), [errno.EPERM])
assert h.pread(4096, 0) == orig
print("OK")
"#,
        uri = py_str(&srv.uri())
    );
    let out = nbdsh(&script);
    assert!(out.stdout.contains("OK"), "{out}");
    srv.stop_ok();
    assert_bytes_eq(&read_file(&img), &before, 0, "read-only image changed");
}

/// FUA, NO_HOLE, FAST_ZERO, CACHE, DF, REQ_ONE, BLOCK_STATUS through libnbd.
fn nbdsh_commands_and_flags(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, 16 * MIB);
    write_at(&img, MIB, &vec![0x42; usize::try_from(MIB).unwrap()]);
    let mut srv = Server::start(&img, c);
    let script = format!(
        r#"
h = connect({uri})
for f in ["can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero",
          "can_multi_conn", "can_cache", "can_df"]:
    assert getattr(h, f)(), f + " is false"
assert h.can_meta_context("base:allocation"), "base:allocation not negotiated"
assert not h.is_read_only()

def extents(count, off, flags=0):
    got = []
    def cb(ctx, o, entries, err):
        assert ctx == "base:allocation", ctx
        pos = o
        for i in range(0, len(entries), 2):
            got.append((pos, entries[i], entries[i + 1]))
            pos += entries[i]
    h.block_status(count, off, cb, flags)
    return got

# Data region: no HOLE/ZERO bits.  Hole region: HOLE|ZERO.
ext = extents(1024 * 1024, 1024 * 1024)
assert ext and ext[0][0] == 1024 * 1024, ext
for (o, l, fl) in ext:
    assert fl & 3 == 0, "data region reported with flags %d: %s" % (fl, ext)
ext = extents(4 * 1024 * 1024, 8 * 1024 * 1024)
for (o, l, fl) in ext:
    assert fl & 3 == 3, "hole reported with flags %d: %s" % (fl, ext)
# REQ_ONE: exactly one extent.
ext = extents(8 * 1024 * 1024, 0, nbd.CMD_FLAG_REQ_ONE)
assert len(ext) == 1 and ext[0][0] == 0 and ext[0][1] <= 8 * 1024 * 1024, ext
assert ext[0][1] <= 1024 * 1024 and ext[0][2] & 3 == 3, ext

def chunk_ok(buf, off, status, err):
    assert status in (nbd.READ_DATA, nbd.READ_HOLE), status
    return 0

h.pwrite(b"\x31" * 65536, 4 * 1024 * 1024, nbd.CMD_FLAG_FUA)
assert h.pread_structured(65536, 4 * 1024 * 1024, chunk_ok, nbd.CMD_FLAG_DF) == b"\x31" * 65536
h.zero(65536, 1024 * 1024, nbd.CMD_FLAG_NO_HOLE)
assert h.pread(65536, 1024 * 1024) == bytes(65536)
h.zero(65536, 1024 * 1024 + 65536, nbd.CMD_FLAG_FUA)
assert h.pread(65536, 1024 * 1024 + 65536) == bytes(65536)
try:
    h.zero(65536, 1024 * 1024 + 131072, nbd.CMD_FLAG_FAST_ZERO)
    assert h.pread(65536, 1024 * 1024 + 131072) == bytes(65536)
    print("fast zero: ok")
except nbd.Error as e:
    assert e.errnum == errno.ENOTSUP, "FAST_ZERO may only fail with ENOTSUP, got %s" % e.errno
    assert h.pread(65536, 1024 * 1024 + 131072) == b"\x42" * 65536
    print("fast zero: ENOTSUP")
h.cache(1024 * 1024, 0)
h.trim(65536, 1024 * 1024 + 512 * 1024)
h.flush()
# Data outside the modified ranges is intact.
assert h.pread(65536, 1024 * 1024 + 256 * 1024) == b"\x42" * 65536
assert h.pread(4096, 1024 * 1024 - 4096) == bytes(4096)
# Structured read with DF over a hole and data.
assert h.pread(2 * 1024 * 1024, 3 * 1024 * 1024) == \
    bytes(1024 * 1024) + b"\x31" * 65536 + bytes(1024 * 1024 - 65536)
assert h.pread_structured(2 * 1024 * 1024, 3 * 1024 * 1024, chunk_ok, nbd.CMD_FLAG_DF) == \
    bytes(1024 * 1024) + b"\x31" * 65536 + bytes(1024 * 1024 - 65536)
h.shutdown()
print("OK")
"#,
        uri = py_str(&srv.uri())
    );
    let out = nbdsh(&script);
    assert!(out.stdout.contains("OK"), "[{c}] {out}");
    srv.stop_ok();
    let ctx = |s: &str| format!("[{c}] {s}");
    assert_file_filled(&img, 0, MIB, 0, &ctx("head"));
    assert_file_filled(&img, MIB, 128 * KIB, 0, &ctx("zeroed"));
    if out.stdout.contains("fast zero: ok") {
        assert_file_filled(&img, MIB + 128 * KIB, 64 * KIB, 0, &ctx("fast-zeroed"));
    } else {
        assert_file_filled(
            &img,
            MIB + 128 * KIB,
            64 * KIB,
            0x42,
            &ctx("fast zero refused"),
        );
    }
    assert_file_filled(&img, MIB + 192 * KIB, 320 * KIB, 0x42, &ctx("data"));
    let trimmed = read_range(&img, MIB + 512 * KIB, 64 * KIB);
    assert!(
        trimmed.iter().all(|&b| b == 0) || trimmed.iter().all(|&b| b == 0x42),
        "[{c}] trimmed range is neither zero nor the old data"
    );
    assert_file_filled(&img, MIB + 576 * KIB, 448 * KIB, 0x42, &ctx("data tail"));
    assert_file_filled(&img, 4 * MIB, 64 * KIB, 0x31, &ctx("FUA write"));
    assert_eq!(file_len(&img), 16 * MIB);
}

/// Garbage during the handshake closes that connection only.
#[test]
fn raw_garbage_handshake() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_pattern_image(&img, MIB, 4);
    let mut srv = Server::start(&img, Combo::BUFFERED_512);

    // 1. Garbage instead of the client flags + option.
    let mut c = RawClient::connect(srv.socket());
    c.greeting();
    c.send(&[0xde, 0xad, 0xbe, 0xef]);
    c.send_lossy(b"this is definitely not an NBD option header!!!!!!!!!!!!!!!!!!!");
    c.expect_closed("garbage client flags");
    srv.assert_running();

    // 2. Valid client flags, then an option with a bad magic.
    let mut c = RawClient::connect(srv.socket());
    c.greeting();
    c.send(&3u32.to_be_bytes());
    c.send_lossy(&[0x55; 64]);
    c.expect_closed("bad option magic");
    srv.assert_running();

    // 3. Garbage sent immediately, without reading the greeting.
    let mut c = RawClient::connect(srv.socket());
    c.send_lossy(&[0xff; 256]);
    c.expect_closed("garbage without reading greeting");
    srv.assert_running();

    // 4. Connect and hang up straight away.
    drop(RawClient::connect(srv.socket()));

    // 5. Huge option length (must not make the server allocate/hang).
    let mut c = RawClient::connect(srv.socket());
    c.greeting();
    c.send(&3u32.to_be_bytes());
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&1u32.to_be_bytes()); // NBD_OPT_EXPORT_NAME
    b.extend_from_slice(&0xffff_fff0u32.to_be_bytes());
    b.extend_from_slice(b"abc");
    c.send_lossy(&b);
    drop(c);

    // A well-behaved client still works, and sees the right data.
    srv.assert_running();
    let (mut c, size, _) = RawClient::handshake(srv.socket(), srv.name());
    assert_eq!(size, MIB);
    let data = c.read(1, 4096, 4096);
    assert_bytes_eq(&data, &pattern_bytes(4, 4096, 4096), 4096, "raw read");
    let out = run("nbdinfo", ["--size", srv.uri().as_str()]);
    assert_eq!(out.stdout.trim(), MIB.to_string());
}

/// Bad request magic during transmission closes the connection; unknown
/// commands get EINVAL and the connection survives.
#[test]
fn raw_bad_request_magic() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_pattern_image(&img, MIB, 12);
    let mut srv = Server::start(&img, Combo::DIRECT_512);

    let (mut c, size, tflags) = RawClient::handshake(srv.socket(), srv.name());
    assert_eq!(size, MIB);
    assert_eq!(
        tflags & NBD_FLAG_READ_ONLY,
        0,
        "export unexpectedly read-only"
    );
    let data = c.read(7, 0, 512);
    assert_bytes_eq(&data, &pattern_bytes(12, 0, 512), 0, "raw read");

    // Unknown command type -> EINVAL, connection survives.
    c.send_request(0, 0x42, 8, 0, 512);
    let (err, handle) = c.read_simple_reply();
    assert_eq!(handle, 8);
    assert_eq!(err, 22, "unknown command should fail with EINVAL (22)");
    // Write with a payload, then read back.
    assert_eq!(c.write(9, 4096, &[0x3c; 512]), 0, "raw write failed");
    assert_eq!(c.read(10, 4096, 512), vec![0x3c; 512]);

    // 16 pipelined reads: every reply carries its request's handle and data.
    for i in 0..16u64 {
        c.send_request(0, NBD_CMD_READ, 100 + i, i * 8192, 1024);
    }
    let mut seen = Vec::new();
    for _ in 0..16 {
        let (err, handle) = c.read_simple_reply();
        assert_eq!(err, 0, "pipelined read {handle} failed");
        assert!((100..116).contains(&handle), "unexpected handle {handle}");
        assert!(
            !seen.contains(&handle),
            "duplicate reply for handle {handle}"
        );
        seen.push(handle);
        let off = (handle - 100) * 8192;
        let data = c.read_exact(1024);
        let want = pattern_bytes(12, off, 1024);
        assert_bytes_eq(&data, &want, off, "pipelined read");
    }

    // A command flag loopd does not know: EINVAL (spec: SHOULD) or ignored,
    // but the connection survives.
    c.send_request(0x4000, NBD_CMD_READ, 200, 0, 512);
    let (err, handle) = c.read_simple_reply();
    assert_eq!(handle, 200);
    if err == 0 {
        c.read_exact(512);
    } else {
        assert_eq!(err, 22, "unknown command flag: expected EINVAL, got {err}");
    }
    assert_eq!(c.read(201, 4096, 512), vec![0x3c; 512]);

    // Bad magic: connection closed.
    let bad = RawClient::request_bytes(0x1234_5678, 0, NBD_CMD_READ, 11, 0, 512);
    c.send(&bad);
    c.expect_closed("bad request magic");
    srv.assert_running();

    // A new client still works and sees the earlier write.
    let (mut c2, _, _) = RawClient::handshake(srv.socket(), srv.name());
    assert_eq!(c2.read(1, 4096, 512), vec![0x3c; 512]);
    // Clean NBD_CMD_DISC.
    c2.send_request(0, NBD_CMD_DISC, 2, 0, 0);
    c2.expect_closed("NBD_CMD_DISC");
    srv.assert_running();
    srv.stop_ok();
    assert_file_filled(&img, 4096, 512, 0x3c, "raw write in image");
}

/// Clients vanishing mid-request (with reads in flight, or halfway through
/// a write payload) and many simultaneous connections do not disturb the
/// server.
#[test]
fn abrupt_disconnects_and_many_connections() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_pattern_image(&img, 4 * MIB, 13);
    let mut srv = Server::start(&img, Combo::DIRECT_512);

    for round in 0..5u64 {
        // Reads in flight, then hang up without reading the replies.
        let (mut c, _, _) = RawClient::handshake(srv.socket(), srv.name());
        for i in 0..8u64 {
            c.send_request(0, NBD_CMD_READ, i, i * 65536, 65536);
        }
        drop(c);
        // Half a write payload, then hang up.
        let (mut c, _, _) = RawClient::handshake(srv.socket(), srv.name());
        c.send_request(0, NBD_CMD_WRITE, 1, round * 65536, 65536);
        c.send(&[0xa1; 1000]);
        drop(c);
        // Hang up in the middle of a request header.
        let (mut c, _, _) = RawClient::handshake(srv.socket(), srv.name());
        let req = RawClient::request_bytes(REQUEST_MAGIC, 0, NBD_CMD_READ, 3, 0, 512);
        c.send(&req[..13]);
        drop(c);
        srv.assert_running();
    }

    // 32 simultaneous connections, each reading its own range.
    let mut clients: Vec<RawClient> = (0..32)
        .map(|_| RawClient::handshake(srv.socket(), srv.name()).0)
        .collect();
    for (i, c) in clients.iter_mut().enumerate() {
        let off = u64::try_from(i).unwrap() * 65536 + 512 * 1024;
        c.send_request(0, NBD_CMD_READ, 7, off, 4096);
    }
    for (i, c) in clients.iter_mut().enumerate() {
        let off = u64::try_from(i).unwrap() * 65536 + 512 * 1024;
        let (err, h) = c.read_simple_reply();
        assert_eq!((err, h), (0, 7), "connection {i}");
        assert_bytes_eq(
            &c.read_exact(4096),
            &pattern_bytes(13, off, 4096),
            off,
            "read",
        );
    }
    drop(clients);
    srv.assert_running();
    srv.stop_ok();
    // The half-sent writes never reached the image.
    assert_file_pattern(&img, 0, 4 * MIB, 13, "image after aborted writes");
}
