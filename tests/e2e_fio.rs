//! fio (nbd engine) against loopd: random writes verified with crc32c, two
//! jobs on two connections over non-overlapping ranges.

mod common;

use common::*;

matrix_tests!(fio_randwrite_verify);

/// Runs fio and returns the parsed JSON report, asserting exit 0 and no job
/// errors.
fn fio(ctx: &str, args: &[String]) -> Json {
    let out = run_status("fio", args);
    assert!(out.success(), "{ctx}: fio failed:\n{out}");
    let doc = Json::parse_first_object(&out.stdout);
    let jobs = doc.at("jobs").arr();
    assert!(!jobs.is_empty(), "{ctx}: fio reported no jobs:\n{out}");
    for j in jobs {
        assert_eq!(
            j.at("error").i64(),
            0,
            "{ctx}: fio job {:?} reported an error:\n{out}",
            j.at("jobname")
        );
    }
    doc
}

fn total_bytes(doc: &Json, dir: &str) -> u64 {
    doc.at("jobs")
        .arr()
        .iter()
        .map(|j| j.at(dir).at("io_bytes").u64())
        .sum()
}

fn fio_randwrite_verify(c: Combo) {
    require_tool("fio");
    let dir = tempdir();
    let img = dir.path().join("fio.img");
    create_sparse_image(&img, 64 * MIB);
    let mut srv = Server::builder(&img).combo(c).tcp().start();

    for (label, uri, rw, bs) in [
        ("unix randwrite", srv.uri(), "randwrite", "4k-4k"),
        (
            "tcp randwrite, 4k-64k blocks",
            srv.tcp_uri(),
            "randwrite",
            "4k-64k",
        ),
    ] {
        let ctx = format!("[{c}] {label}");
        let args: Vec<String> = [
            "--name=loopd".to_string(),
            "--ioengine=nbd".to_string(),
            format!("--uri={uri}"),
            format!("--rw={rw}"),
            format!("--bsrange={bs}"),
            "--blockalign=4k".to_string(),
            "--size=16M".to_string(),
            "--numjobs=2".to_string(),
            "--offset_increment=16M".to_string(),
            "--iodepth=8".to_string(),
            "--verify=crc32c".to_string(),
            "--verify_fatal=1".to_string(),
            "--do_verify=1".to_string(),
            "--group_reporting=0".to_string(),
            "--output-format=json".to_string(),
        ]
        .into();
        let doc = fio(&ctx, &args);
        let written = total_bytes(&doc, "write");
        let read = total_bytes(&doc, "read");
        assert_eq!(
            written,
            32 * MIB,
            "{ctx}: fio should have written 2 x 16 MiB"
        );
        assert!(
            read >= 32 * MIB,
            "{ctx}: fio verify phase read only {read} bytes"
        );
    }
    srv.assert_running();
    srv.stop_ok();

    // fio's verify headers start every block with the verify magic; the data
    // went to the image itself: the region each job covered is non-zero.
    for job in 0..2u64 {
        let data = read_range(&img, job * 16 * MIB, 16 * MIB);
        let zero_blocks = data
            .chunks(4096)
            .filter(|b| b.iter().all(|&x| x == 0))
            .count();
        assert_eq!(
            zero_blocks, 0,
            "[{c}] job {job}: {zero_blocks} blocks of its range are still zero in the image"
        );
    }
    assert_eq!(file_len(&img), 64 * MIB);
}
