//! The Prometheus endpoint (`loopd serve --metrics`): scraped with curl while fio
//! runs (values grow, histogram buckets are cumulative, `_count` matches the
//! requests), checked by `promtool check metrics`, over TCP and a Unix socket; a
//! stalled scraper does not block another; bad requests get 400, 404 and 405.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// `loopd serve IMAGE --metrics 127.0.0.1:PORT EXTRA…`; the server and the
/// metrics URL.
fn serve_with_metrics(img: &std::path::Path, extra: &[&str]) -> (Server, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let url = format!("http://{addr}/metrics");
    let srv = Server::builder(img)
        .args(["--metrics", addr.as_str()])
        .args(extra)
        .start();
    (srv, url)
}

/// `curl` a URL (with extra args); (HTTP status, body).
fn curl(args: &[&str]) -> (u16, String) {
    let mut c = tool("curl");
    c.args(["-sS", "--max-time", "5", "-w", "\n%{http_code}"])
        .args(args);
    let out = run_cmd_timeout(c, Duration::from_secs(30));
    assert!(out.success(), "curl {args:?} failed:\n{out}");
    let (body, code) = out.stdout.rsplit_once('\n').unwrap_or(("", ""));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// Samples of a scrape: `name{labels}` → value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse::<f64>().ok()?))
        })
        .collect()
}

fn get(s: &BTreeMap<String, f64>, key: &str) -> f64 {
    *s.get(key)
        .unwrap_or_else(|| panic!("no sample {key} in the scrape:\n{s:#?}"))
}

/// `le` buckets of the device's histogram, in order.
fn buckets(s: &BTreeMap<String, f64>, dev: &str) -> Vec<f64> {
    let prefix = format!("loopd_request_duration_seconds_bucket{{device=\"{dev}\",le=\"");
    let mut v: Vec<(f64, f64)> = s
        .iter()
        .filter_map(|(k, n)| {
            let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, *n))
        })
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert!(v.len() > 10, "histogram buckets for {dev}: {v:?}");
    v.into_iter().map(|(_, n)| n).collect()
}

fn requests(s: &BTreeMap<String, f64>, dev: &str, op: &str) -> f64 {
    get(
        s,
        &format!("loopd_requests_total{{device=\"{dev}\",op=\"{op}\"}}"),
    )
}

#[test]
fn metrics_while_fio_runs() {
    require_tool("fio");
    require_tool("promtool");
    let dir = tempdir();
    let img = dir.path().join("m.img");
    create_sparse_image(&img, 64 * MIB);
    let (srv, url) = serve_with_metrics(&img, &[]);
    let dev = srv.name().to_string();
    let dev = dev.as_str();

    let mut fio = tool("fio");
    fio.args([
        "--name=metrics",
        "--ioengine=nbd",
        &format!("--uri={}", srv.uri()),
        "--rw=randrw",
        "--bs=4k",
        "--iodepth=8",
        "--size=32M",
        "--time_based",
        "--runtime=4",
        "--output-format=json",
    ])
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    let mut child = Reaped(fio.spawn().expect("start fio"));

    // Scrape while it runs: the request counters only grow.
    let mut last = 0.0;
    let mut grew = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.0.try_wait().expect("try_wait fio").is_none() {
        assert!(Instant::now() < deadline, "fio did not finish in 30 s");
        let (code, body) = curl(&[&url]);
        assert_eq!(code, 200, "{body}");
        let s = samples(&body);
        let n = requests(&s, dev, "read") + requests(&s, dev, "write");
        assert!(n >= last, "requests went down: {last} -> {n}");
        if n > last {
            grew += 1;
        }
        last = n;
        let b = buckets(&s, dev);
        assert!(
            b.windows(2).all(|w| w[0] <= w[1]),
            "buckets cumulative: {b:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        grew >= 2,
        "the counters grew between scrapes ({grew} times)"
    );

    // Idle now: the histogram's count is the data requests served.
    let (_, body) = curl(&[&url]);
    let s = samples(&body);
    let served: f64 = ["read", "write", "flush", "trim", "write_zeroes", "cache"]
        .iter()
        .map(|op| requests(&s, dev, op))
        .sum();
    let count = get(
        &s,
        &format!("loopd_request_duration_seconds_count{{device=\"{dev}\"}}"),
    );
    assert!(served > 1000.0, "fio was served: {served}");
    assert_eq!(count, served, "histogram _count = requests");
    let b = buckets(&s, dev);
    assert_eq!(b.last().copied(), Some(count), "+Inf bucket = _count");
    let sum = get(
        &s,
        &format!("loopd_request_duration_seconds_sum{{device=\"{dev}\"}}"),
    );
    assert!(sum > 0.0 && sum < count * 10.0, "_sum {sum} s");
    assert!(
        get(
            &s,
            &format!("loopd_bytes_total{{device=\"{dev}\",op=\"read\"}}")
        ) > 0.0
    );
    assert_eq!(
        get(&s, &format!("loopd_in_flight_requests{{device=\"{dev}\"}}")),
        0.0
    );
    assert_eq!(
        get(
            &s,
            &format!("loopd_device_frontend{{device=\"{dev}\",frontend=\"nbd\"}}")
        ),
        1.0
    );
    assert!(get(&s, "loopd_start_time_seconds") > 1.6e9);
    assert!(get(&s, "loopd_reactors") >= 1.0);
    assert!(get(&s, "loopd_memory_budget_limit_bytes") > 0.0);
    let info = format!(
        "loopd_build_info{{version=\"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(get(&s, &info), 1.0);

    // promtool agrees it is well-formed exposition text.
    let f = dir.path().join("scrape.txt");
    std::fs::write(&f, &body).expect("write scrape");
    let mut p = tool("promtool");
    p.args(["check", "metrics"])
        .stdin(std::fs::File::open(&f).expect("open scrape"));
    let out = run_cmd_timeout(p, Duration::from_secs(30));
    assert!(out.success(), "promtool check metrics:\n{out}\n{body}");
}

#[test]
fn metrics_on_a_unix_socket_and_bad_requests() {
    let dir = tempdir();
    let img = dir.path().join("u.img");
    create_sparse_image(&img, 8 * MIB);
    let sock = dir.path().join("metrics.sock");
    let sock_s = path_str(&sock).to_string();
    let srv = Server::builder(&img)
        .args(["--metrics", sock_s.as_str(), "--metrics-mode", "600"])
        .start();
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&sock)
            .expect("metrics socket")
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "--metrics-mode");
    qemu_io(&srv.uri(), &["read 0 64k"]);
    let (code, body) = curl(&["--unix-socket", &sock_s, "http://localhost/metrics"]);
    assert_eq!(code, 200, "{body}");
    let s = samples(&body);
    assert!(requests(&s, srv.name(), "read") >= 1.0, "{body}");
    let (code, _) = curl(&["--unix-socket", &sock_s, "http://localhost/nope"]);
    assert_eq!(code, 404);
    let (code, _) = curl(&[
        "--unix-socket",
        &sock_s,
        "-X",
        "POST",
        "http://localhost/metrics",
    ]);
    assert_eq!(code, 405);

    // A scraper that sends half a request and stalls holds no one up.
    let mut stalled = std::os::unix::net::UnixStream::connect(&sock).expect("connect");
    stalled.write_all(b"GET /metr").expect("send half");
    let t = Instant::now();
    let (code, _) = curl(&["--unix-socket", &sock_s, "http://localhost/metrics"]);
    assert_eq!(code, 200);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "scrape took {:?}",
        t.elapsed()
    );

    // Malformed requests: 400, and the connection closes.
    for bad in [
        &b"garbage\r\n\r\n"[..],
        b"GET /metrics HTTP/9\r\n\r\n",
        b"\x16\x03\x01\0\x05hello\n",
    ] {
        let mut c = std::os::unix::net::UnixStream::connect(&sock).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        c.write_all(bad).expect("send");
        let mut reply = String::new();
        let _ = c.read_to_string(&mut reply);
        assert!(reply.starts_with("HTTP/1.1 400 "), "{bad:?} -> {reply:?}");
    }
    drop(stalled);
    drop(srv);
    assert!(!sock.exists(), "the metrics socket is removed at exit");
}

#[test]
fn a_bad_metrics_address_fails_the_start() {
    let dir = tempdir();
    let img = dir.path().join("b.img");
    create_sparse_image(&img, MIB);
    let out = run_cmd_timeout(
        {
            let mut c = std::process::Command::new(loopd_bin());
            c.args(["serve", path_str(&img), "--metrics", "256.0.0.1:1"])
                .arg("--socket")
                .arg(dir.path().join("b.sock"))
                .arg("--state")
                .arg(dir.path().join("b.state"));
            c
        },
        Duration::from_secs(30),
    );
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("--metrics 256.0.0.1:1"), "{out}");
}

/// A child process killed (by its pid) and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The page-cache footprint of a buffered device's image: little of a fresh
/// sparse image (the format probe's first pages), then at least what a client
/// wrote through loopd (the writes land in the page cache), never more than the
/// device's size.
#[test]
fn page_cache_footprint_follows_buffered_writes() {
    let dir = tempdir();
    let img = dir.path().join("pc.img");
    create_sparse_image(&img, 16 * MIB);
    let (srv, url) = serve_with_metrics(&img, &["--cache", "buffered"]);
    let dev = srv.name().to_string();
    let key = |state: &str| format!("loopd_page_cache_bytes{{device=\"{dev}\",state=\"{state}\"}}");

    let (code, body) = curl(&[&url]);
    assert_eq!(code, 200, "{body}");
    let before = get(&samples(&body), &key("cached"));

    qemu_io(&srv.uri(), &["write -P 0x3c 0 4M"]);
    let (_, body) = curl(&[&url]);
    let s = samples(&body);
    let cached = get(&s, &key("cached"));
    assert!(
        cached >= (4 * MIB) as f64 && cached > before,
        "4 MiB written through the page cache: cached {before} -> {cached}\n{body}"
    );
    assert!(cached <= (16 * MIB) as f64, "cached {cached} > the device");
    assert!(get(&s, &key("dirty")) <= cached);
    assert!(get(&s, &key("writeback")) <= cached);
}

/// Issue 22, point 12: slow and silent connections cannot silence the
/// endpoint. 300 connections sending a request head one byte every 500 ms
/// and 2,000 that send nothing, each reconnected as soon as loopd closes it,
/// while a scraper (curl) scrapes every second for 12 s: every scrape is
/// answered, 200, within 5 s (Prometheus' default timeout is 10 s). This
/// process holds 2,300 sockets and loopd as many again: the test raises its
/// own open-file limit to the hard limit and needs 5,000 (loopd raises its
/// own at start).
#[test]
fn slow_and_silent_connections_do_not_silence_the_endpoint() {
    use common::flood::{Behaviour, Flood, Target, raise_nofile};
    const BOUND: Duration = Duration::from_secs(5);
    raise_nofile(5_000);
    let dir = tempdir();
    let img = dir.path().join("s.img");
    create_sparse_image(&img, MIB);
    let (srv, url) = serve_with_metrics(&img, &[]);
    let addr: std::net::SocketAddr = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .parse()
        .expect("metrics address");
    let attack = Duration::from_secs(15);
    let slow = Flood::start(
        Target::Tcp(addr),
        300,
        Behaviour::Trickle {
            bytes: b"GET /metrics HTTP/1.1\r\nHost: loopd\r\nUser-Agent: slow\r\n\r\n".to_vec(),
            every: Duration::from_millis(500),
        },
        attack,
    );
    let silent = Flood::start(Target::Tcp(addr), 2_000, Behaviour::Silent, attack);
    std::thread::sleep(Duration::from_secs(2));
    let mut took = Vec::new();
    let mut failed = Vec::new();
    let end = Instant::now() + Duration::from_secs(12);
    while Instant::now() < end {
        let t = Instant::now();
        let mut c = tool("curl");
        c.args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "5",
            &url,
        ]);
        let out = run_cmd_timeout(c, Duration::from_secs(30));
        let d = t.elapsed();
        if out.success() && out.stdout.trim() == "200" && d < BOUND {
            took.push(d);
        } else {
            failed.push(format!(
                "after {d:.1?}: {} {}",
                out.stdout,
                out.stderr.trim()
            ));
        }
        std::thread::sleep(Duration::from_secs(1).saturating_sub(t.elapsed()));
    }
    let (slow, silent) = (slow.finish(), silent.finish());
    took.sort();
    let worst = took.last().copied().unwrap_or_default();
    eprintln!(
        "{} of {} scrapes answered within {BOUND:?}, worst {worst:.1?}; slow: {slow:?}; \
         silent: {silent:?}",
        took.len(),
        took.len() + failed.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {} scrapes failed or took {BOUND:?} or more: {failed:?}",
        failed.len(),
        took.len() + failed.len()
    );
    assert!(took.len() >= 8, "only {} scrapes in 12 s", took.len());
    assert!(
        silent.connects >= 2_000 && slow.connects >= 300,
        "the attack never got going: {slow:?} {silent:?}"
    );
    drop(srv);
}
