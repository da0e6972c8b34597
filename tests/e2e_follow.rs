//! Connections following their clients between reactors (frontend::nbd::affinity).
//!
//! The two reactors are pinned to CPUs 0 and 1 (with `taskset`, from outside) and
//! every fio job to CPU 1, so the connections that start on reactor 0 must move
//! to reactor 1 while their requests are in flight. `--follow-idle` lets them
//! move on a machine that is not busy. fio verifies every block it wrote, so a
//! request lost, repeated or answered out of turn during a move fails the test.

mod common;

use common::*;
use std::time::Duration;

/// Pin each reactor thread of `pid` to the CPU of its number.
fn pin_reactors(pid: u32) {
    require_tool("taskset");
    let mut pinned = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).expect("list loopd's threads") {
        let t = t.expect("thread entry").path();
        let comm = std::fs::read_to_string(t.join("comm")).unwrap_or_default();
        let Some(n) = comm.trim().strip_prefix("loopd-reactor-") else {
            continue;
        };
        let tid = t.file_name().and_then(|f| f.to_str()).expect("tid");
        run("taskset", ["-p", "-c", n, tid]).assert_success();
        pinned += 1;
    }
    assert_eq!(pinned, 2, "expected two reactor threads in loopd {pid}");
}

fn require_two_cpus() {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        n >= 2,
        "this test needs 2 CPUs to move connections between (this machine has {n})"
    );
}

/// 4 fio jobs pinned to CPU 1: 4 KiB random writes at depth 8, rate-limited so
/// the run lasts about two seconds, then every block read back and checked.
fn fio_on_cpu1(ctx: &str, uri: &str) {
    let args: Vec<String> = [
        "--name=follow".to_string(),
        "--ioengine=nbd".to_string(),
        format!("--uri={uri}"),
        "--rw=randwrite".to_string(),
        "--bs=4k".to_string(),
        "--size=16M".to_string(),
        "--numjobs=4".to_string(),
        "--offset_increment=16M".to_string(),
        "--iodepth=8".to_string(),
        "--rate=16m".to_string(),
        "--cpus_allowed=1".to_string(),
        "--verify=crc32c".to_string(),
        "--verify_fatal=1".to_string(),
        "--do_verify=1".to_string(),
        "--output-format=json".to_string(),
    ]
    .into();
    // A request lost in a move leaves fio waiting: give up long before the
    // suite's tool timeout, with a clear message.
    let mut cmd = tool("fio");
    cmd.args(&args);
    let out = run_cmd_timeout(cmd, Duration::from_secs(30));
    assert!(out.success(), "{ctx}: fio failed:\n{out}");
    let doc = Json::parse_first_object(&out.stdout);
    for j in doc.at("jobs").arr() {
        assert_eq!(j.at("error").i64(), 0, "{ctx}: fio job error:\n{out}");
        assert_eq!(
            j.at("write").at("io_bytes").u64(),
            16 * MIB,
            "{ctx}: each job writes 16 MiB"
        );
        assert_eq!(
            j.at("read").at("io_bytes").u64(),
            16 * MIB,
            "{ctx}: each job reads its 16 MiB back to verify"
        );
    }
}

fn moves(srv: &Server) -> u64 {
    srv.ctl_json(&["status", srv.name()]).at("moves").u64()
}

/// A buffered server on a fresh 64 MiB image with two reactors pinned to CPUs 0
/// and 1, after checking fio and a second CPU are there. Keep the directory alive.
fn serve(extra: &[&str]) -> (tempfile::TempDir, Server) {
    require_tool("fio");
    require_two_cpus();
    let dir = tempdir();
    let img = dir.path().join("follow.img");
    create_sparse_image(&img, 64 * MIB);
    let mut b =
        Server::builder(&img)
            .with_control()
            .tcp()
            .args(["--cache", "buffered", "--reactors", "2"]);
    for a in extra {
        b = b.arg(a);
    }
    let srv = b.start();
    pin_reactors(srv.pid());
    (dir, srv)
}

#[test]
fn connections_follow_clients_over_unix_and_tcp() {
    let (_dir, mut srv) = serve(&["--follow-idle"]);

    fio_on_cpu1("unix", &srv.uri());
    let after_unix = moves(&srv);
    // Half the connections start on reactor 0 (least loaded first).
    assert!(
        after_unix >= 2,
        "unix: expected the connections on reactor 0 to move to reactor 1, moves = {after_unix}"
    );

    fio_on_cpu1("tcp", &srv.tcp_uri());
    let after_tcp = moves(&srv) - after_unix;
    assert!(
        after_tcp >= 2,
        "tcp: expected the connections on reactor 0 to move to reactor 1, moves = {after_tcp}"
    );
    // The human `status` shows the same count.
    let text = srv.ctl_ok(&["status", srv.name()]).stdout;
    let total = format!("moves: {}", after_unix + after_tcp);
    assert!(
        text.lines().any(|l| l == total),
        "loopd status should print {total:?}:\n{text}"
    );
    srv.assert_running();
    srv.stop_ok();
}

#[test]
fn no_follow_keeps_connections_in_place() {
    let (_dir, mut srv) = serve(&["--follow-idle", "--no-follow"]);
    fio_on_cpu1("unix, --no-follow", &srv.uri());
    assert_eq!(moves(&srv), 0, "--no-follow: no connection may move");
    srv.stop_ok();
}
