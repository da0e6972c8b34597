//! Extended headers (`NBD_OPT_EXTENDED_HEADERS`): 32-byte request and reply
//! headers and 64-bit effect lengths, with qemu 10 (which negotiates them), an
//! older libnbd (1.14, which does not: compact headers must keep working) and
//! a hand-written client that checks the reply bytes.

mod common;

use common::*;
use std::os::unix::fs::MetadataExt;

const GIB: u64 = 1 << 30;
/// Large enough that single requests cross and pass the 32-bit boundary.
const SIZE: u64 = 6 * GIB;

/// qemu-io with `--trace` events on, panicking unless every command succeeded.
fn qemu_io_traced(uri: &str, traces: &[&str], cmds: &[&str]) -> Out {
    let mut args: Vec<String> = Vec::new();
    for t in traces {
        args.push("--trace".into());
        args.push((*t).into());
    }
    args.extend(["-f".into(), "raw".into(), uri.into()]);
    for c in cmds {
        args.push("-c".into());
        args.push((*c).into());
    }
    let out = run_status("qemu-io", &args);
    let all = format!("{}\n{}", out.stdout, out.stderr);
    if !out.success()
        || all.contains("Pattern verification failed")
        || all.contains("failed:")
        || all.contains("cannot exceed")
    {
        panic!("qemu-io reported a failure:\n{out}");
    }
    out
}

/// Bytes the file has allocated on disk.
fn allocated(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).expect("stat image").blocks() * 512
}

fn debug_server(img: &std::path::Path) -> Server {
    Server::builder(img).env("LOOPD_LOG", "debug").start()
}

/// qemu 10 negotiates extended headers: its write-zeroes of 5 GiB goes out as
/// one request with a 64-bit length, every reply it reads is an extended one,
/// and the bytes and the image's allocation are right afterwards.
#[test]
fn qemu_zeroes_5g_in_one_extended_request() {
    let dir = tempdir();
    let img = dir.path().join("big.img");
    create_sparse_image(&img, SIZE);
    let mut srv = debug_server(&img);
    let uri = srv.uri();
    // Data below, across and above 4 GiB.
    qemu_io(
        &uri,
        &[
            "write -P 0x11 1M 1M",
            "write -P 0x22 4194240k 128k",
            "write -P 0x33 5243904k 1M",
            "read -P 0x11 1M 1M",
            "read -P 0x22 4194240k 128k",
            "read -P 0x33 5243904k 1M",
        ],
    );
    assert!(
        allocated(&img) >= 2 * MIB,
        "the writes did not reach the file"
    );
    // -n: no slow fallback (qemu-io allows more than 2 GiB only so); -u: may
    // punch holes.
    let out = qemu_io_traced(
        &uri,
        &[
            "nbd_send_request",
            "nbd_receive_reply_chunk_header",
            "nbd_receive_simple_reply",
        ],
        &[
            "write -z -n -u 0 5G",
            "read -P 0 1M 1M",
            "read -P 0 4194240k 128k",
            "read -P 0x33 5243904k 1M",
            // A trim and a read at offsets past 4 GiB, extended too.
            "discard 4G 1G",
            "read -P 0 4G 64k",
        ],
    );
    let trace = &out.stderr;
    assert!(
        trace
            .lines()
            .any(|l| l.contains(".len = 5368709120") && l.contains("write zeroes")),
        "qemu did not send one 64-bit write-zeroes:\n{trace}"
    );
    assert!(
        trace.contains("type = 1 (data)") && trace.contains("type = 0 (none)"),
        "no extended data/none replies in qemu's trace:\n{trace}"
    );
    assert!(
        !trace.contains("nbd_receive_simple_reply"),
        "a simple reply came back on an extended-headers connection:\n{trace}"
    );
    assert!(
        srv.stderr_text().contains("Extended replies"),
        "loopd did not log an extended-headers connection:\n{}",
        srv.stderr_text()
    );
    srv.stop_ok();

    assert_eq!(file_len(&img), SIZE, "image size changed");
    assert_file_filled(&img, MIB, MIB, 0, "1M after zeroing");
    assert_file_filled(
        &img,
        4 * GIB - 64 * KIB,
        128 * KIB,
        0,
        "4G-64k after zeroing",
    );
    assert_file_filled(&img, 5 * GIB + MIB, MIB, 0x33, "5G+1M kept");
    // Zeroing with unmap allowed punched the holes: only the last MiB is left.
    let a = allocated(&img);
    assert!(a <= 2 * MIB, "{a} bytes still allocated after zeroing 5G");
}

/// `qemu-img map` over NBD asks for block status and gets 64-bit extents
/// (`NBD_REPLY_TYPE_BLOCK_STATUS_EXT`): exactly the two data runs of a
/// sparse 6 GiB image, one of them past 4 GiB.
#[test]
fn qemu_img_map_of_a_sparse_image_past_4g() {
    let dir = tempdir();
    let img = dir.path().join("sparse.img");
    create_sparse_image(&img, SIZE);
    write_at(
        &img,
        MIB,
        &pattern_bytes(1, MIB, usize::try_from(MIB).unwrap()),
    );
    write_at(
        &img,
        5 * GIB,
        &pattern_bytes(2, 5 * GIB, usize::try_from(MIB).unwrap()),
    );
    let srv = debug_server(&img);
    let out = run_cmd_timeout(
        {
            let mut c = tool("qemu-img");
            c.args(["--trace", "nbd_receive_reply_chunk_header"]);
            c.args(["map", "--output=json", "-f", "raw", &srv.uri()]);
            c
        },
        TOOL_TIMEOUT,
    )
    .assert_success();
    assert!(
        out.stderr.contains("block status (64-bit)"),
        "qemu-img got no BLOCK_STATUS_EXT chunk:\n{}",
        out.stderr
    );
    let map = Json::parse(&out.stdout);
    let runs: Vec<(u64, u64, bool)> = map
        .arr()
        .iter()
        .map(|e| {
            (
                e.at("start").u64(),
                e.at("length").u64(),
                e.at("data").bool(),
            )
        })
        .collect();
    // Merge neighbours of the same kind (qemu reports at most what one
    // request covered).
    let mut merged: Vec<(u64, u64, bool)> = Vec::new();
    for (start, len, data) in runs {
        match merged.last_mut() {
            Some(last) if last.2 == data && last.0 + last.1 == start => last.1 += len,
            _ => merged.push((start, len, data)),
        }
    }
    assert_eq!(
        merged,
        [
            (0, MIB, false),
            (MIB, MIB, true),
            (2 * MIB, 5 * GIB - 2 * MIB, false),
            (5 * GIB, MIB, true),
            (5 * GIB + MIB, GIB - MIB, false),
        ],
        "qemu-img map:\n{}",
        out.stdout
    );
}

/// libnbd 1.14 knows nothing of extended headers: it negotiates structured
/// replies and compact headers, and reads, writes, zeroes, trims and block
/// status past 4 GiB still work.
#[test]
fn libnbd_without_extended_headers_still_works() {
    let dir = tempdir();
    let img = dir.path().join("old.img");
    create_sparse_image(&img, SIZE);
    let srv = debug_server(&img);
    let uri = py_str(&srv.uri());
    nbdsh(&format!(
        r#"
h = connect({uri})
assert h.get_structured_replies_negotiated()
assert not hasattr(h, "get_extended_headers_negotiated") or not h.get_extended_headers_negotiated()
off = 5 * 2**30
h.pwrite(b"\x5a" * 65536, off)
assert h.pread(65536, off) == b"\x5a" * 65536
seen = []
def cb(ctx, start, entries, err):
    seen.append((start, list(entries)))
h.block_status(2**30, off - 2**20, cb)
assert seen, "no block status"
start, entries = seen[0]
assert start == off - 2**20
# A hole up to the data, then data.
assert entries[0] == 2**20 and entries[1] & 1 == 1, entries
assert entries[2] >= 65536 and entries[3] & 1 == 0, entries
h.zero(65536, off)
assert h.pread(65536, off) == bytes(65536)
h.trim(2**30, 4 * 2**30)
h.shutdown()
print("ok")
"#
    ));
    let log = srv.stderr_text();
    assert!(
        log.contains("Structured replies") && !log.contains("Extended replies"),
        "loopd did not serve libnbd 1.14 with compact headers:\n{log}"
    );
}

// ---------------------------------------------------------------------------
// A client written from the spec, checking the bytes on the wire.

const OPT_GO: u32 = 7;
const OPT_SET_META_CONTEXT: u32 = 10;
const OPT_EXTENDED_HEADERS: u32 = 11;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_EXT_HEADER_REQD: u32 = (1 << 31) | 10;
const EXT_REQUEST_MAGIC: u32 = 0x21e4_1c71;
const EXT_REPLY_MAGIC: u32 = 0x6e8a_278c;
const CMD_TRIM: u16 = 4;
const CMD_BLOCK_STATUS: u16 = 7;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
const REPLY_FLAG_DONE: u16 = 1;

/// An extended reply header: (flags, type, cookie, offset, length).
type ExtReply = (u16, u16, u64, u64, u64);

fn expect_opt_reply(c: &mut RawClient, opt: u32) -> (u32, Vec<u8>) {
    assert_eq!(c.read_u64(), 0x0003_e889_0455_65a9, "option reply magic");
    assert_eq!(c.read_u32(), opt, "option reply to the wrong option");
    let kind = c.read_u32();
    let len = c.read_u32();
    (kind, c.read_exact(len as usize))
}

fn ext_request(c: &mut RawClient, flags: u16, kind: u16, cookie: u64, off: u64, len: u64) {
    c.send(&ext_header(flags, kind, cookie, off, len));
}

/// The 32 bytes of an extended request header.
fn ext_header(flags: u16, kind: u16, cookie: u64, off: u64, len: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(32);
    b.extend_from_slice(&EXT_REQUEST_MAGIC.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&off.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b
}

fn ext_reply(c: &mut RawClient) -> ExtReply {
    let m = c.read_u32();
    assert_eq!(m, EXT_REPLY_MAGIC, "not an extended reply: magic {m:#x}");
    (
        c.read_u16(),
        c.read_u16(),
        c.read_u64(),
        c.read_u64(),
        c.read_u64(),
    )
}

/// Negotiates extended headers and `base:allocation`, then GO.
fn extended_client(srv: &Server) -> RawClient {
    let mut c = RawClient::connect(srv.socket());
    c.greeting();
    c.send(&3u32.to_be_bytes());
    c.send_option(OPT_EXTENDED_HEADERS, &[]);
    assert_eq!(expect_opt_reply(&mut c, OPT_EXTENDED_HEADERS).0, REP_ACK);
    // Structured replies after extended headers: refused, extended stays.
    c.send_option(OPT_STRUCTURED_REPLY, &[]);
    let (k, _) = expect_opt_reply(&mut c, OPT_STRUCTURED_REPLY);
    assert_eq!(k, REP_ERR_EXT_HEADER_REQD);
    let mut meta = Vec::new();
    meta.extend_from_slice(&0u32.to_be_bytes());
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&15u32.to_be_bytes());
    meta.extend_from_slice(b"base:allocation");
    c.send_option(OPT_SET_META_CONTEXT, &meta);
    let (k, p) = expect_opt_reply(&mut c, OPT_SET_META_CONTEXT);
    assert_eq!((k, &p[4..]), (REP_META_CONTEXT, &b"base:allocation"[..]));
    assert_eq!(expect_opt_reply(&mut c, OPT_SET_META_CONTEXT).0, REP_ACK);
    c.send_option(OPT_GO, &[0, 0, 0, 0, 0, 0]);
    loop {
        let (k, p) = expect_opt_reply(&mut c, OPT_GO);
        match k {
            REP_INFO => {}
            REP_ACK => break,
            _ => panic!("GO answered {k:#x} {p:?}"),
        }
    }
    c
}

/// Raw bytes of a READ, a WRITE, a 64-bit TRIM and a BLOCK_STATUS_EXT over
/// an extended-headers connection; a compact header on it is a framing error.
#[test]
fn raw_client_sees_extended_replies_byte_for_byte() {
    let dir = tempdir();
    let img = dir.path().join("raw.img");
    create_sparse_image(&img, SIZE);
    let data = pattern_bytes(9, 4 * GIB + 4096, 8192);
    write_at(&img, 4 * GIB + 4096, &data);
    write_at(&img, 5 * GIB + 512 * KIB, &data);
    let mut srv = debug_server(&img);
    let mut c = extended_client(&srv);

    // READ past 4 GiB: an offset-data chunk, the request's offset in the
    // header and again in the payload.
    let off = 4 * GIB + 4096;
    ext_request(&mut c, 0, NBD_CMD_READ, 11, off, 8192);
    assert_eq!(
        ext_reply(&mut c),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 11, off, 8192 + 8)
    );
    assert_eq!(c.read_u64(), off);
    assert_eq!(c.read_exact(8192), data);

    // WRITE (no PAYLOAD_LEN flag needed): a "none" chunk.
    let w = pattern_bytes(3, 0, 4096);
    ext_request(&mut c, 0, NBD_CMD_WRITE, 12, 8192, 4096);
    c.send(&w);
    assert_eq!(
        ext_reply(&mut c),
        (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 12, 8192, 0)
    );
    ext_request(&mut c, 0, NBD_CMD_READ, 120, 8192, 4096);
    assert_eq!(
        ext_reply(&mut c),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 120, 8192, 4096 + 8)
    );
    assert_eq!(c.read_u64(), 8192);
    assert_eq!(c.read_exact(4096), w, "written block read back");

    // A READ too large for the payload cap: an error chunk (EOVERFLOW).
    ext_request(&mut c, 0, NBD_CMD_READ, 13, 0, 5 * GIB);
    assert_eq!(
        ext_reply(&mut c),
        (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 13, 0, 6)
    );
    assert_eq!(c.read_u32(), 75, "EOVERFLOW");
    assert_eq!(c.read_u16(), 0);

    // BLOCK_STATUS of 6 GiB in one request: 64-bit descriptors, data where
    // the file has it.
    ext_request(&mut c, 0, CMD_BLOCK_STATUS, 14, 0, SIZE);
    let (flags, kind, cookie, o, len) = ext_reply(&mut c);
    assert_eq!(
        (flags, kind, cookie, o),
        (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS_EXT, 14, 0)
    );
    assert_eq!(c.read_u32(), 1, "context id");
    let n = c.read_u32();
    assert!(n >= 1);
    assert_eq!(len, 8 + 16 * u64::from(n));
    let mut at = 0u64;
    let mut extents = Vec::new();
    for _ in 0..n {
        let l = c.read_u64();
        assert_eq!(c.read_u32(), 0, "descriptor padding");
        let f = c.read_u32();
        assert!(l > 0);
        extents.push((at, l, f));
        at += l;
    }
    assert!(
        at <= SIZE,
        "status covers {at} bytes of a {SIZE}-byte export"
    );
    // First the written 4 KiB at 8 KiB, after a hole.
    assert_eq!(extents[0], (0, 8192, 3), "{extents:?}");
    assert_eq!(extents[1], (8192, 4096, 0), "{extents:?}");

    // TRIM of 5 GiB in one request (run as pieces inside loopd), answered once.
    ext_request(&mut c, 0, CMD_TRIM, 15, 0, 5 * GIB);
    assert_eq!(
        ext_reply(&mut c),
        (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 15, 0, 0)
    );
    ext_request(&mut c, 0, NBD_CMD_READ, 16, off, 8192);
    assert_eq!(
        ext_reply(&mut c),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 16, off, 8192 + 8)
    );
    assert_eq!(c.read_u64(), off);
    assert_eq!(
        c.read_exact(8192),
        vec![0u8; 8192],
        "trimmed data still there"
    );

    // A compact header on an extended connection: the connection is closed.
    // (Padded to the 32 bytes loopd waits for.)
    let mut compact = RawClient::request_bytes(REQUEST_MAGIC, 0, NBD_CMD_READ, 17, 0, 512);
    compact.extend_from_slice(&[0; 4]);
    c.send(&compact);
    let got = c.expect_closed("compact header on an extended connection");
    assert!(got.is_empty(), "got a reply to a compact header: {got:?}");
    srv.assert_running();
    srv.stop_ok();

    // The trim reached the file: what was written below 5 GiB is gone.
    assert_file_filled(&img, 0, 64 * KIB, 0, "trimmed start");
    assert_file_filled(&img, 4 * GIB, 64 * KIB, 0, "trimmed past 4 GiB");
    assert_bytes_eq(
        &read_range(&img, 5 * GIB + 512 * KIB, 8192),
        &data,
        5 * GIB + 512 * KIB,
        "data past the trim",
    );
    let a = allocated(&img);
    assert!(a <= 64 * KIB, "{a} bytes allocated after trimming 5 GiB");
}

// ---------------------------------------------------------------------------
// 64-bit effect lengths that reach past the end of the file, and clients that
// hang up in the middle of one (issue 22, point 13).

const CMD_CACHE: u16 = 5;
const CMD_WRITE_ZEROES: u16 = 6;
const FLAG_FUA: u16 = 1;
const FLAG_NO_HOLE: u16 = 2;
const E62: u64 = 1 << 62;
/// Longest a request with nothing to do (past the end of the file) may take.
const PROMPT: std::time::Duration = std::time::Duration::from_secs(5);

/// Wait up to [`PROMPT`] for `c` to have a reply to read.
#[track_caller]
fn reply_within(c: &RawClient, what: &str) {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: c.s.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(PROMPT.as_millis()).expect("fits");
    // SAFETY: one pollfd of a socket the client owns.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    assert!(n > 0, "{what}: no reply within {PROMPT:?}");
}

/// A temporary directory on tmpfs, whose files may be as large as 2^63 - 1
/// bytes (ext4 stops at 16 TiB: a trim passing that fails with EFBIG early).
fn tmpfs_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-e2e")
        .tempdir_in("/dev/shm")
        .expect("tempdir on tmpfs (/dev/shm)")
}

/// The issue's case: a window of 2^62 + 1 GiB over a 1 MiB file, and a TRIM of
/// 2^62 bytes from 1 GiB (past the end of the file, inside the export), which
/// ran as 2^31 pieces for hours. Past the end of the file there is nothing to
/// trim, zero or cache (it reads as zeros already): each such request is
/// answered at once, with FUA too; one straddling the end zeroes what is
/// inside; one past the export's size is refused with the spec's error.
#[test]
fn huge_ranges_past_the_end_of_the_file_are_answered_at_once() {
    let dir = tmpfs_dir();
    let img = dir.path().join("small.img");
    create_pattern_image(&img, MIB, 3);
    let size = E62 + GIB;
    let mut srv = Server::builder(&img)
        .args(["--size-limit", &size.to_string()])
        .start();
    let mut c = extended_client(&srv);
    let cases = [
        (CMD_TRIM, 0, "TRIM"),
        (CMD_TRIM, FLAG_FUA, "TRIM with FUA"),
        (CMD_WRITE_ZEROES, 0, "WRITE_ZEROES"),
        (
            CMD_WRITE_ZEROES,
            FLAG_NO_HOLE | FLAG_FUA,
            "WRITE_ZEROES NO_HOLE FUA",
        ),
        (CMD_CACHE, 0, "CACHE"),
    ];
    for (cookie, (kind, flags, what)) in (1u64..).zip(cases) {
        ext_request(&mut c, flags, kind, cookie, GIB, E62);
        reply_within(
            &c,
            &format!("{what} of 2^62 bytes past the end of the file"),
        );
        assert_eq!(
            ext_reply(&mut c),
            (REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, GIB, 0),
            "{what}"
        );
    }
    // Straddling the end of the file: the half inside is zeroed.
    ext_request(&mut c, FLAG_NO_HOLE, CMD_WRITE_ZEROES, 20, MIB / 2, E62);
    reply_within(&c, "WRITE_ZEROES from inside the file to 2^62");
    assert_eq!(
        ext_reply(&mut c),
        (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 20, MIB / 2, 0)
    );
    // Past the export's size: ENOSPC for a write-zeroes, EINVAL for a trim.
    for (cookie, kind, errno) in [(21, CMD_WRITE_ZEROES, 28), (22, CMD_TRIM, 22)] {
        ext_request(&mut c, 0, kind, cookie, GIB, size);
        reply_within(&c, "a request past the export's size");
        assert_eq!(
            ext_reply(&mut c),
            (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, GIB, 6)
        );
        assert_eq!(c.read_u32(), errno);
        assert_eq!(c.read_u16(), 0);
    }
    srv.assert_running();
    srv.stop_ok();
    assert_eq!(file_len(&img), MIB, "the file's size changed");
    assert_bytes_eq(
        &read_range(&img, 0, MIB / 2),
        &pattern_bytes(3, 0, (MIB / 2) as usize),
        0,
        "before the zeroed half",
    );
    assert_file_filled(&img, MIB / 2, MIB / 2, 0, "the zeroed half");
}

/// CPU time (user + system, in clock ticks) of process `pid` so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // Fields after the command (which may hold spaces) start after ") ".
    let rest = &stat[stat.rfind(") ").expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15, i.e. 12 and 13 after the state.
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}

/// A client sends a TRIM of a whole 2^62-byte (sparse, tmpfs) image — 2^31
/// pieces of real work — and hangs up. The work stops: the daemon's CPU time
/// stops growing within a second or so, and a plain `detach` (no --force)
/// succeeds because the client no longer counts.
#[test]
fn the_work_of_a_client_that_hung_up_stops() {
    let dir = tmpfs_dir();
    let img = dir.path().join("huge.img");
    let f = std::fs::File::create(&img).expect("create image");
    f.set_len(E62).expect("a 2^62-byte sparse file on tmpfs");
    drop(f);
    let srv = Server::builder(&img).with_control().start();
    let pid = srv.pid();
    let mut c = extended_client(&srv);
    ext_request(&mut c, 0, CMD_TRIM, 1, 0, E62);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let t0 = cpu_ticks(pid);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let busy = cpu_ticks(pid) - t0;
    assert!(
        busy >= 10,
        "the trim is not under way ({busy} ticks in 1 s)"
    );
    drop(c);
    let gone = std::time::Instant::now();
    // The client stops counting as soon as its last operation comes back.
    srv.wait_clients("huge", 0, std::time::Duration::from_secs(5));
    eprintln!("no client left {:?} after it hung up", gone.elapsed());
    std::thread::sleep(std::time::Duration::from_secs(1));
    let t1 = cpu_ticks(pid);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let after = cpu_ticks(pid) - t1;
    eprintln!(
        "CPU: {busy} ticks in 1 s while the trim ran, {after} ticks in 2 s after the client left"
    );
    assert!(
        after <= 20,
        "loopd kept working for a client that hung up: {after} ticks of CPU in 2 s"
    );
    let t = std::time::Instant::now();
    srv.ctl_ok(&["detach", "huge"]);
    assert!(t.elapsed() < PROMPT, "detach took {:?}", t.elapsed());
}

/// The issue's second case of a client gone (review F3): a client pipelines
/// 128 TRIMs of 2^50 bytes inside a sparse 2^62-byte image on tmpfs (2^19
/// pieces of real work each), then one more request, which no free slot can
/// take, so loopd stops reading its socket, and hangs up. No receive is
/// posted, yet the hang-up is seen: within a few seconds the client no longer
/// counts, the daemon's CPU time stops growing, and a plain `detach` succeeds.
#[test]
fn a_client_that_hangs_up_while_its_reads_are_paused_is_noticed() {
    let dir = tmpfs_dir();
    let img = dir.path().join("huge.img");
    let f = std::fs::File::create(&img).expect("create image");
    f.set_len(E62).expect("a 2^62-byte sparse file on tmpfs");
    drop(f);
    let srv = Server::builder(&img).with_control().start();
    let pid = srv.pid();
    let mut c = extended_client(&srv);
    let mut all = Vec::new();
    for k in 0..128u64 {
        all.extend(ext_header(0, CMD_TRIM, k + 1, k << 52, 1 << 50));
    }
    // The 129th: every slot is busy for minutes, so it stays unread.
    all.extend(ext_header(0, CMD_TRIM, 129, 0, 4096));
    c.send(&all);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let t0 = cpu_ticks(pid);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let busy = cpu_ticks(pid) - t0;
    assert!(
        busy >= 10,
        "the trims are not under way ({busy} ticks in 1 s)"
    );
    drop(c);
    let gone = std::time::Instant::now();
    srv.wait_clients("huge", 0, std::time::Duration::from_secs(5));
    eprintln!("no client left {:?} after it hung up", gone.elapsed());
    std::thread::sleep(std::time::Duration::from_secs(1));
    let t1 = cpu_ticks(pid);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let after = cpu_ticks(pid) - t1;
    eprintln!("CPU: {busy} ticks in 1 s while the trims ran, {after} in 2 s after the client left");
    assert!(
        after <= 20,
        "loopd kept working for a client that hung up: {after} ticks of CPU in 2 s"
    );
    let t = std::time::Instant::now();
    srv.ctl_ok(&["detach", "huge"]);
    assert!(t.elapsed() < PROMPT, "detach took {:?}", t.elapsed());
}

/// Review F12: on a `--shared` image another writer grew the file behind
/// loopd's back, past the end loopd knows of, which falls on a piece's
/// boundary (2 GiB). A 64-bit WRITE_ZEROES over the window asks the file
/// where it ends before it stops: that writer's bytes are zeroed too, and
/// the file keeps its size.
#[test]
fn write_zeroes_pieces_stop_where_the_file_says_it_ends() {
    use std::os::unix::fs::FileExt;
    let dir = tempdir();
    let img = dir.path().join("grown.img");
    create_sparse_image(&img, 2 * GIB);
    let mut srv = Server::builder(&img)
        .args(["--shared", "--size-limit", &(4 * GIB).to_string()])
        .start();
    let mut c = extended_client(&srv);
    // Another writer (sharing the image on purpose) appends 1 MiB at 2.5 GiB.
    let theirs = pattern_bytes(9, 0, 1 << 20);
    let w = std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .expect("open the image as another writer");
    w.write_all_at(&theirs, 2 * GIB + GIB / 2)
        .expect("their write");
    w.sync_all().expect("sync");
    drop(w);
    let size = file_len(&img);
    assert_eq!(size, 2 * GIB + GIB / 2 + MIB);
    ext_request(&mut c, 0, CMD_WRITE_ZEROES, 1, 0, 4 * GIB);
    reply_within(&c, "WRITE_ZEROES of the whole 4 GiB window");
    assert_eq!(
        ext_reply(&mut c),
        (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 1, 0, 0),
        "write-zeroes answered"
    );
    assert_file_filled(
        &img,
        2 * GIB + GIB / 2,
        MIB,
        0,
        "the other writer's bytes past loopd's known end",
    );
    assert_eq!(file_len(&img), size, "the file's size changed");
    drop(c);
    srv.stop_ok();
}
