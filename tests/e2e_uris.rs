//! Issue 27, point 2: every URI and path loopd prints works from any
//! directory. A server started in one directory with relative `--socket`,
//! `--control` and `--metrics` paths prints absolute ones — at start (the
//! URI lines, `metrics:`, `control:`), in `attach`, and in `list`/`status
//! --json` — and a client in another directory reads the device through the
//! printed URI. A TCP metrics endpoint prints its URL with the others.

mod common;

use common::*;
use std::io::{Read, Write};
use std::path::Path;

/// The `socket=` paths of every `nbd+unix` URI in `text`.
fn socket_paths(text: &str) -> Vec<String> {
    text.split(|c: char| c.is_whitespace() || c == '"')
        .filter(|w| w.starts_with("nbd+unix://") || w.starts_with("nbds+unix://"))
        .map(|u| {
            u.split_once("?socket=")
                .map(|(_, p)| p.to_owned())
                .unwrap_or_else(|| panic!("a Unix URI without socket=: {u}"))
        })
        .collect()
}

fn assert_absolute(what: &str, text: &str, want: &Path) {
    let paths = socket_paths(text);
    assert!(!paths.is_empty(), "{what}: no Unix URI in:\n{text}");
    for p in paths {
        assert_eq!(
            Path::new(&p),
            want,
            "{what}: the URI names the socket by its absolute path:\n{text}"
        );
    }
}

#[test]
fn relative_socket_paths_are_printed_absolute_everywhere() {
    let t = tempfile::tempdir().expect("tempdir");
    let run = t.path().join("run");
    std::fs::create_dir(&run).expect("mkdir run");
    let img = t.path().join("d.img");
    create_filled_image(&img, 1 << 20, 0x42);
    let srv = Server::daemon()
        .current_dir(t.path())
        .socket_path(Path::new("run/d.sock"))
        .args(["--control", "run/d.ctl", "--metrics", "run/m.sock"])
        .start();
    let sock = run.join("d.sock");
    let start = srv.stdout_text();
    assert!(
        start
            .lines()
            .any(|l| l == format!("control: {}", run.join("d.ctl").display())),
        "control: is absolute:\n{start}"
    );
    assert!(
        start.lines().any(|l| l
            == format!(
                "metrics: http://localhost/metrics --unix-socket {}",
                run.join("m.sock").display()
            )),
        "the metrics endpoint is printed, absolute:\n{start}"
    );

    // The client commands run in another directory (the test's own).
    let out = srv.ctl_ok(&["attach", img.to_str().expect("utf-8")]);
    assert_absolute("attach", &out.stdout, &sock);
    let list = srv.ctl_ok(&["list", "--json"]);
    assert_absolute("list --json", &list.stdout, &sock);
    let status = srv.ctl_ok(&["status", "d", "--json"]);
    assert_absolute("status --json", &status.stdout, &sock);
    let uri = out
        .stdout
        .lines()
        .find(|l| l.starts_with("nbd+unix://"))
        .expect("a Unix URI");
    let read = qemu_io(uri, &["read -P 0x42 0 4k"]);
    assert!(
        read.stdout.contains("read 4096/4096"),
        "the printed URI works from another directory: {read}"
    );

    // The metrics socket answers at the printed path.
    let mut m = std::os::unix::net::UnixStream::connect(run.join("m.sock")).expect("connect");
    m.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    m.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .expect("send");
    let mut body = String::new();
    m.read_to_string(&mut body).expect("read");
    assert!(body.starts_with("HTTP/1."), "{body}");
}

#[test]
fn a_tcp_metrics_endpoint_prints_its_url() {
    let srv = Server::daemon().args(["--metrics", "127.0.0.1:0"]).start();
    let start = srv.stdout_text();
    let url = start
        .lines()
        .find_map(|l| l.strip_prefix("metrics: http://"))
        .unwrap_or_else(|| panic!("no metrics: line:\n{start}"));
    let hostport = url
        .strip_suffix("/metrics")
        .unwrap_or_else(|| panic!("not a /metrics URL: {url}"));
    assert!(
        hostport.starts_with("127.0.0.1:") && !hostport.ends_with(":0"),
        "the URL names the bound port: {url}"
    );
    let mut c = std::net::TcpStream::connect(hostport).expect("connect");
    c.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").expect("send");
    let mut body = String::new();
    c.read_to_string(&mut body).expect("read");
    assert!(
        body.contains("loopd_"),
        "metrics at the printed URL:\n{body}"
    );
    assert!(
        !srv.stderr_text().contains("--metrics on"),
        "no exposure warning on loopback:\n{}",
        srv.stderr_text()
    );
}
