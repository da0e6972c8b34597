//! Group commit and batches, end to end: the state file shares one write and
//! one sync between concurrent attaches, and nothing acknowledged is lost when
//! the daemon is killed in the middle of a storm of them; one `attach_batch`
//! request (and `loopd attach IMG…` / `--from FILE|-`) attaches many devices,
//! each succeeding or failing on its own, the good ones durable.

mod common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An image whose first bytes say which device it is.
fn tagged_image(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(format!("{name}.img"));
    create_sparse_image(&p, MIB);
    let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all(tag(name).as_bytes()).unwrap();
    p
}

fn tag(name: &str) -> String {
    format!("device {name}\n")
}

/// The device `name` serves its own image, whole: listed as live on
/// `image`, 1 MiB, and an NBD read returns the image's tag.
#[track_caller]
fn assert_whole(srv: &Server, listed: &BTreeMap<String, Json>, name: &str, image: &Path) {
    let d = listed
        .get(name)
        .unwrap_or_else(|| panic!("{name} not listed"));
    assert_eq!(d.at("state").str(), "live", "{name}: {d:?}");
    assert_eq!(d.at("image").str(), path_str(image), "{name}: {d:?}");
    assert_eq!(d.at("size").u64(), MIB, "{name}: {d:?}");
    let (mut c, size, _) = RawClient::handshake(srv.socket(), name);
    assert_eq!(size, MIB);
    let t = tag(name);
    let got = c.read(1, 0, u32::try_from(t.len()).unwrap());
    assert_eq!(
        String::from_utf8_lossy(&got),
        t,
        "{name} serves another file"
    );
}

fn listed(srv: &Server) -> BTreeMap<String, Json> {
    srv.list_json()
        .into_iter()
        .map(|d| (d.at("name").str().to_owned(), d))
        .collect()
}

/// `kill -9` during concurrent attaches from 8 control clients: after a
/// restart every attach that was answered `ok` is back, whole; a device whose
/// attach was sent but not answered is either absent or back whole (never
/// missing, never on another file, never a name nobody asked for); the state
/// file holds nothing half-written that is taken for a device.
#[test]
fn kill9_during_an_attach_storm_keeps_every_acknowledged_attach() {
    let dir = tempdir();
    let state = dir.path().join("s.state");
    let sock = dir.path().join("s.sock");
    let (clients, per_client) = (8, 30);
    let mut images = BTreeMap::new();
    for c in 0..clients {
        for k in 0..per_client {
            let name = format!("c{c}k{k}");
            images.insert(name.clone(), tagged_image(dir.path(), &name));
        }
    }
    let images = Arc::new(images);
    let mut srv = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    let control = srv.control().to_path_buf();
    let acked = Arc::new(Mutex::new(BTreeSet::new()));
    let sent = Arc::new(Mutex::new(BTreeSet::new()));
    let n_acked = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (images, acked, sent) = (images.clone(), acked.clone(), sent.clone());
            let (n_acked, stop, control) = (n_acked.clone(), stop.clone(), control.clone());
            std::thread::spawn(move || {
                let s = UnixStream::connect(&control).expect("control socket");
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut w = s.try_clone().unwrap();
                let mut r = BufReader::new(s);
                for k in 0..per_client {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let name = format!("c{c}k{k}");
                    let req = format!(
                        "{{\"v\":1,\"op\":\"attach\",\"name\":\"{name}\",\"image\":\"{}\"}}\n",
                        path_str(&images[&name])
                    );
                    sent.lock().unwrap().insert(name.clone());
                    if w.write_all(req.as_bytes()).is_err() {
                        return; // killed
                    }
                    let mut line = String::new();
                    match r.read_line(&mut line) {
                        Ok(n) if n > 0 => {}
                        _ => return, // killed before the reply
                    }
                    let reply = Json::parse(line.trim_end());
                    assert_eq!(reply.at("ok"), &Json::Bool(true), "{name}: {line}");
                    acked.lock().unwrap().insert(name);
                    n_acked.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    // Kill once a good part of the storm is acknowledged (bounded in time).
    let t = Instant::now();
    while n_acked.load(Ordering::SeqCst) < clients * per_client / 3
        && t.elapsed() < Duration::from_secs(20)
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    srv.kill9();
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().expect("client thread");
    }
    let acked = acked.lock().unwrap().clone();
    let sent = sent.lock().unwrap().clone();
    assert!(
        acked.len() >= clients * per_client / 3,
        "the storm was acknowledged in part before the kill ({} of {})",
        acked.len(),
        clients * per_client
    );

    let srv2 = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    let back = listed(&srv2);
    for name in &acked {
        assert!(
            back.contains_key(name),
            "acknowledged attach {name} lost after kill -9"
        );
    }
    for name in back.keys() {
        assert!(sent.contains(name), "{name} was never asked for");
        // Acknowledged or not: whole (its own file, attached, serving).
        assert_whole(&srv2, &back, name, &images[name]);
    }
    let unanswered = back.keys().filter(|n| !acked.contains(*n)).count();
    eprintln!(
        "sent {}, acknowledged {}, back after kill -9 {} ({unanswered} of them unanswered)",
        sent.len(),
        acked.len(),
        back.len()
    );
    drop(srv2);
}

/// `loopd attach GOOD1 BAD GOOD2 --from -` (and GOOD3 from stdin): one
/// request; the good images are attached and printed, the bad one is
/// reported by name with its error, the exit status is the failure's; the
/// raw `attach_batch` reply lists each outcome in order. The good devices
/// come back after `kill -9`, the bad one nowhere.
#[test]
fn a_batch_with_one_bad_image_attaches_the_good_ones_durably() {
    let dir = tempdir();
    let state = dir.path().join("s.state");
    let sock = dir.path().join("s.sock");
    let mut srv = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    let (g1, g2, g3) = (
        tagged_image(dir.path(), "g1"),
        tagged_image(dir.path(), "g2"),
        tagged_image(dir.path(), "g3"),
    );
    let bad = dir.path().join("no-such.img");

    let mut c = Command::new(loopd_bin());
    c.args(["attach", path_str(&g1), path_str(&bad), path_str(&g2)])
        .args(["--from", "-", "--control"])
        .arg(srv.control())
        .env_remove("LOOPD_CONTROL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("loopd attach");
    let list = format!("# from stdin\n\n{}\n", path_str(&g3));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(list.as_bytes())
        .unwrap();
    let out = wait_output(child, Duration::from_secs(30));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(
        out.status.code(),
        Some(exit_status_for("io")),
        "exit status of the failure (io):\n{stdout}\n{stderr}"
    );
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("loopd: error:"))
        .collect();
    assert!(
        errors
            .iter()
            .any(|l| l.contains("no-such.img") && l.ends_with("(io)")),
        "the bad image is named with its error:\n{stderr}"
    );
    assert!(
        errors
            .iter()
            .any(|l| l.contains("1 of 4 image(s) not attached")),
        "{stderr}"
    );
    for name in ["g1", "g2", "g3"] {
        assert!(
            stdout.lines().any(|l| l == name),
            "{name} printed:\n{stdout}"
        );
    }
    let back = listed(&srv);
    assert_eq!(back.keys().cloned().collect::<Vec<_>>(), ["g1", "g2", "g3"]);

    // The protocol: outcomes in order, a taken name refused on its own.
    let g4 = tagged_image(dir.path(), "g4");
    let mut ctl = ControlConn::connect(srv.control());
    let r = ctl.ok(&format!(
        "{{\"v\":1,\"op\":\"attach_batch\",\"devices\":[{{\"image\":\"{}\",\"name\":\"g1\"}},{{\"image\":\"{}\"}}]}}",
        path_str(&g2),
        path_str(&g4)
    ));
    let items = r.at("devices").arr();
    assert_eq!(items.len(), 2, "{r:?}");
    assert_eq!(items[0].at("ok"), &Json::Bool(false), "{r:?}");
    assert_eq!(items[0].at("error").at("code").str(), "name_taken", "{r:?}");
    assert_eq!(items[1].at("ok"), &Json::Bool(true), "{r:?}");
    assert_eq!(items[1].at("result").at("name").str(), "g4");
    // --name with several images is a usage error, and nothing is attached.
    let out = srv.ctl(&["attach", path_str(&g1), path_str(&g2), "--name", "x"]);
    assert_ctl_error(&out, "usage");

    // A longer list from a file (opened on several threads): all attached.
    let many: Vec<(String, PathBuf)> = (0..40)
        .map(|i| {
            let n = format!("m{i:02}");
            let p = tagged_image(dir.path(), &n);
            (n, p)
        })
        .collect();
    let list = dir.path().join("list.txt");
    let text: String = many
        .iter()
        .map(|(_, p)| format!("{}\n", path_str(p)))
        .collect();
    std::fs::write(&list, text).unwrap();
    let out = srv.ctl_ok(&["attach", "--from", path_str(&list)]);
    let printed: Vec<&str> = out.stdout.lines().filter(|l| l.starts_with('m')).collect();
    let names: Vec<&str> = many.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(printed, names, "printed in the order of the list:\n{out}");

    srv.kill9();
    let srv2 = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    let back = listed(&srv2);
    let mut want = vec!["g1", "g2", "g3", "g4"];
    want.extend(&names);
    assert_eq!(
        back.keys().cloned().collect::<Vec<_>>(),
        want,
        "the good ones are back after kill -9, the bad one nowhere"
    );
    for (name, img) in [("g1", &g1), ("g2", &g2), ("g3", &g3), ("g4", &g4)] {
        assert_whole(&srv2, &back, name, img);
    }
    for (name, img) in &many {
        assert_whole(&srv2, &back, name, img);
    }
}

/// `child`'s output, killing it after `timeout`.
fn wait_output(mut child: std::process::Child, timeout: Duration) -> std::process::Output {
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > timeout {
            let _ = child.kill();
            panic!("loopd attach did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}
