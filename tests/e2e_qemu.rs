//! End-to-end tests driving loopd with qemu-io and qemu-img.

mod common;

use common::*;

matrix_tests!(
    pattern_write_read,
    unaligned_write_across_sector,
    zeroes_discard_flush_fua,
    last_block_of_export,
    large_8m_request_tcp,
    qemu_img_convert_roundtrip,
    qemu_img_map_sparse,
);

const SIZE: u64 = 64 * MIB;

/// Pattern writes and reads over the Unix socket, then the image file itself
/// is checked after the server stopped.
fn pattern_write_read(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, SIZE);
    let mut srv = Server::start(&img, c);
    let uri = srv.uri();
    qemu_io(
        &uri,
        &[
            "write -P 0xab 0 64k",
            "read -P 0xab 0 64k",
            "write -P 0xcd 1M 128k",
            "read -P 0xcd 1M 128k",
            "read -P 0 64k 64k",
            "read -P 0 2M 1M",
        ],
    );
    // A second, independent connection sees the same data.
    qemu_io(&uri, &["read -P 0xab 0 64k", "read -P 0xcd 1M 128k"]);
    srv.stop_ok();

    assert_eq!(file_len(&img), SIZE, "[{c}] image size changed");
    assert_file_filled(&img, 0, 64 * KIB, 0xab, &format!("[{c}] 0..64k"));
    assert_file_filled(&img, 64 * KIB, MIB - 64 * KIB, 0, &format!("[{c}] 64k..1M"));
    assert_file_filled(&img, MIB, 128 * KIB, 0xcd, &format!("[{c}] 1M..1M+128k"));
    assert_file_filled(
        &img,
        MIB + 128 * KIB,
        MIB,
        0,
        &format!("[{c}] after 1M+128k"),
    );
}

/// A 3-byte write straddling a sector boundary (and a 2-byte write straddling
/// a 4 KiB boundary) must modify exactly those bytes.
fn unaligned_write_across_sector(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_pattern_image(&img, 8 * MIB, 7);
    let mut srv = Server::start(&img, c);
    let uri = srv.uri();
    qemu_io(
        &uri,
        &[
            "write -P 0x5a 510 3",
            "read -P 0x5a 510 3",
            "write -P 0x6b 4095 2",
            "read -P 0x6b 4095 2",
            "write -P 0x7c 1048575 1",
            "read -P 0x7c 1048575 1",
        ],
    );
    srv.stop_ok();

    let mut expected = pattern_bytes(7, 0, usize::try_from(2 * MIB).unwrap());
    expected[510..513].fill(0x5a);
    expected[4095..4097].fill(0x6b);
    expected[1_048_575] = 0x7c;
    let got = read_range(&img, 0, 2 * MIB);
    assert_bytes_eq(
        &got,
        &expected,
        0,
        &format!("[{c}] image after unaligned writes"),
    );
    assert_file_pattern(&img, 2 * MIB, 6 * MIB, 7, &format!("[{c}] untouched tail"));
    assert_eq!(file_len(&img), 8 * MIB, "[{c}] image size changed");
}

/// WRITE_ZEROES (with and without unmap), TRIM, FLUSH and FUA writes.
fn zeroes_discard_flush_fua(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_filled_image(&img, 4 * MIB, 0x77);
    let mut srv = Server::start(&img, c);
    let uri = srv.uri();
    qemu_io(
        &uri,
        &[
            "write -z 64k 64k",
            "read -P 0 64k 64k",
            "read -P 0x77 0 64k",
            "read -P 0x77 128k 64k",
            "write -z -u 256k 128k",
            "read -P 0 256k 128k",
            "read -P 0x77 384k 64k",
            "discard 1M 64k",
            "read -P 0x77 960k 64k",
            "read -P 0x77 1088k 64k",
            "flush",
            "write -f -P 0x99 2M 4k",
            "read -P 0x99 2M 4k",
            "write -f -z 3M 4k",
            "read -P 0 3M 4k",
            "flush",
        ],
    );
    srv.stop_ok();

    let ctx = |s: &str| format!("[{c}] {s}");
    assert_file_filled(&img, 0, 64 * KIB, 0x77, &ctx("before zeroed range"));
    assert_file_filled(&img, 64 * KIB, 64 * KIB, 0, &ctx("write -z range"));
    assert_file_filled(
        &img,
        128 * KIB,
        128 * KIB,
        0x77,
        &ctx("between zero ranges"),
    );
    assert_file_filled(&img, 256 * KIB, 128 * KIB, 0, &ctx("write -z -u range"));
    assert_file_filled(&img, 384 * KIB, 640 * KIB, 0x77, &ctx("before discard"));
    // Discarded content is unspecified by NBD, but must be either the old
    // data or zeroes -- never garbage -- and must not spill outside the range.
    let trimmed = read_range(&img, MIB, 64 * KIB);
    assert!(
        trimmed.iter().all(|&b| b == 0) || trimmed.iter().all(|&b| b == 0x77),
        "[{c}] discarded range contains neither zeroes nor the old data"
    );
    assert_file_filled(
        &img,
        MIB + 64 * KIB,
        MIB - 64 * KIB,
        0x77,
        &ctx("after discard"),
    );
    assert_file_filled(&img, 2 * MIB, 4 * KIB, 0x99, &ctx("FUA write"));
    assert_file_filled(
        &img,
        2 * MIB + 4 * KIB,
        MIB - 4 * KIB,
        0x77,
        &ctx("after FUA write"),
    );
    assert_file_filled(&img, 3 * MIB, 4 * KIB, 0, &ctx("FUA write -z"));
    assert_file_filled(&img, 3 * MIB + 4 * KIB, MIB - 4 * KIB, 0x77, &ctx("tail"));
    assert_eq!(file_len(&img), 4 * MIB, "[{c}] image size changed");
}

/// The last block of the export is readable and writable; the byte after it
/// is not.
fn last_block_of_export(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    let size = 8 * MIB;
    create_pattern_image(&img, size, 3);
    let mut srv = Server::start(&img, c);
    let uri = srv.uri();
    let bs = c.bs();
    let last = size - bs;
    qemu_io(
        &uri,
        &[
            &format!("write -P 0xee {last} {bs}"),
            &format!("read -P 0xee {last} {bs}"),
            &format!("write -P 0xef {} 1", size - 1),
            &format!("read -P 0xef {} 1", size - 1),
        ],
    );
    // qemu-io itself refuses requests beyond the end; make sure it fails.
    let beyond = qemu_io_status(&uri, &[&format!("read {size} {bs}")]);
    let all = format!("{}{}", beyond.stdout, beyond.stderr);
    assert!(
        !beyond.success() || all.contains("failed") || all.contains("error"),
        "[{c}] read past the end unexpectedly succeeded:\n{beyond}"
    );
    srv.stop_ok();

    assert_eq!(file_len(&img), size, "[{c}] image size changed");
    let mut want = vec![0xee; usize::try_from(bs).unwrap()];
    *want.last_mut().unwrap() = 0xef;
    assert_bytes_eq(
        &read_range(&img, last, bs),
        &want,
        last,
        &format!("[{c}] last block"),
    );
    assert_file_pattern(&img, 0, last, 3, &format!("[{c}] rest of image"));
}

/// A single 8 MiB write and read, over TCP.
fn large_8m_request_tcp(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("big.img");
    create_sparse_image(&img, 16 * MIB);
    let mut srv = Server::builder(&img).combo(c).tcp().start();
    let tcp = srv.tcp_uri();
    qemu_io(
        &tcp,
        &[
            "write -P 0x11 0 8M",
            "read -P 0x11 0 8M",
            "write -P 0x22 8M 8M",
            "read -P 0x22 8M 8M",
            "read -P 0x11 0 8M",
        ],
    );
    // Same data via the Unix socket of the same server.
    qemu_io(&srv.uri(), &["read -P 0x11 0 8M", "read -P 0x22 8M 8M"]);
    srv.stop_ok();
    assert_file_filled(&img, 0, 8 * MIB, 0x11, &format!("[{c}] first 8M"));
    assert_file_filled(&img, 8 * MIB, 8 * MIB, 0x22, &format!("[{c}] second 8M"));
}

/// qemu-img convert file -> NBD (-n) and NBD -> file, plus qemu-img compare.
fn qemu_img_convert_roundtrip(c: Combo) {
    let dir = tempdir();
    let src = dir.path().join("src.img");
    let size = 16 * MIB;
    create_pattern_image(&src, size, 42);
    // Leave a zero hole in the source, so zero detection paths are used too.
    write_at(&src, 4 * MIB, &vec![0u8; usize::try_from(2 * MIB).unwrap()]);
    let target = dir.path().join("target.img");
    create_filled_image(&target, size, 0xff);

    let mut srv = Server::builder(&target).combo(c).tcp().start();
    let uri = srv.uri();
    run(
        "qemu-img",
        [
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            src.to_str().unwrap(),
            uri.as_str(),
        ],
    );
    run(
        "qemu-img",
        [
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            src.to_str().unwrap(),
            uri.as_str(),
        ],
    );
    let out = dir.path().join("out.img");
    let tcp = srv.tcp_uri();
    run(
        "qemu-img",
        [
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            tcp.as_str(),
            out.to_str().unwrap(),
        ],
    );
    run(
        "qemu-img",
        [
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            out.to_str().unwrap(),
            tcp.as_str(),
        ],
    );
    // A compare that must fail: proves `qemu-img compare` really compares.
    write_at(&out, 5 * MIB + 17, &[0xaa]);
    let diff = run_status(
        "qemu-img",
        [
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            out.to_str().unwrap(),
            uri.as_str(),
        ],
    );
    assert_eq!(
        diff.status.code(),
        Some(1),
        "[{c}] qemu-img compare should report a difference:\n{diff}"
    );
    srv.stop_ok();

    let want = read_file(&src);
    assert_bytes_eq(
        &read_file(&target),
        &want,
        0,
        &format!("[{c}] target image"),
    );
    let mut got_out = read_file(&out);
    got_out[usize::try_from(5 * MIB + 17).unwrap()] = 0;
    assert_bytes_eq(&got_out, &want, 0, &format!("[{c}] converted-out image"));
}

/// Block status: `qemu-img map` of a sparse image reports data where the
/// file has data and zero/hole elsewhere.
fn qemu_img_map_sparse(c: Combo) {
    let dir = tempdir();
    let img = dir.path().join("sparse.img");
    create_sparse_image(&img, SIZE);
    write_at(
        &img,
        MIB,
        &pattern_bytes(1, 0, usize::try_from(MIB).unwrap()),
    );
    write_at(
        &img,
        8 * MIB,
        &vec![0x5b; usize::try_from(64 * KIB).unwrap()],
    );
    write_at(
        &img,
        SIZE - 64 * KIB,
        &vec![0x6c; usize::try_from(64 * KIB).unwrap()],
    );

    let srv = Server::start(&img, c);
    let out = run(
        "qemu-img",
        ["map", "--output=json", "-f", "raw", srv.uri().as_str()],
    );
    let map = Json::parse(&out.stdout);
    let entries: Vec<(u64, u64, bool, bool)> = map
        .arr()
        .iter()
        .map(|e| {
            (
                e.at("start").u64(),
                e.at("length").u64(),
                e.at("data").bool(),
                e.at("zero").bool(),
            )
        })
        .collect();
    // The map covers the whole export contiguously.
    let mut pos = 0;
    for &(start, len, _, _) in &entries {
        assert_eq!(start, pos, "[{c}] map not contiguous:\n{}", out.stdout);
        pos += len;
    }
    assert_eq!(
        pos, SIZE,
        "[{c}] map does not cover the export:\n{}",
        out.stdout
    );

    // Classify a byte range: every entry overlapping it.
    let overlapping = |a: u64, b: u64| {
        entries
            .iter()
            .filter(move |&&(s, l, _, _)| s < b && s + l > a)
            .copied()
            .collect::<Vec<_>>()
    };
    for (a, len) in [(MIB, MIB), (8 * MIB, 64 * KIB), (SIZE - 64 * KIB, 64 * KIB)] {
        for (s, l, data, zero) in overlapping(a, a + len) {
            assert!(
                data && !zero,
                "[{c}] written range {a}+{len} reported as data={data} zero={zero} (entry {s}+{l}):\n{}",
                out.stdout
            );
        }
    }
    // Holes well away from the written data must be reported as zero, not data.
    for (a, len) in [(16 * MIB, 32 * MIB), (3 * MIB, 4 * MIB)] {
        for (s, l, data, zero) in overlapping(a, a + len) {
            assert!(
                !data && zero,
                "[{c}] hole {a}+{len} reported as data={data} zero={zero} (entry {s}+{l}):\n{}",
                out.stdout
            );
        }
    }
    // The data itself is right.
    qemu_io(&srv.uri(), &["read -P 0x5b 8M 64k", "read -P 0 16M 1M"]);
}
