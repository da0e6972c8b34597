//! Many recorded devices come back at start: a state file of 200 devices
//! (opened on a pool of threads) brings every device whose image is there
//! back with its own bytes, keeps the others as missing, records each
//! device's file in one compaction, and says what it did in one line.

mod common;

use common::*;
use std::path::Path;

const DEVICES: usize = 200;
const SIZE: u64 = 64 * 1024;

/// A `put` record of an older loopd (no file identity) for `name` on `image`.
fn put_line(name: &str, image: &Path) -> String {
    format!(
        "{{\"put\":{{\"image\":\"{}\",\"name\":\"{name}\",\"offset\":0,\"cache\":\"auto\",\"read_only\":false,\"autoclear\":false}}}}\n",
        image.display()
    )
}

/// The state file's records, by device name (the last put of each).
fn records(state: &Path) -> std::collections::BTreeMap<String, Json> {
    let text = std::fs::read_to_string(state).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for l in text.lines().skip(1) {
        let r = Json::parse(l);
        if let Some(p) = r.get("put") {
            out.insert(p.at("name").str().to_owned(), p.clone());
        } else {
            out.remove(r.at("del").str());
        }
    }
    out
}

/// Device `i`'s pattern (DEVICES < 256: each its own).
fn seed(i: usize) -> u8 {
    u8::try_from(i).unwrap()
}

fn gone(i: usize) -> bool {
    i % 20 == 7
}

/// Every device that is there serves its own bytes; every other is missing.
fn check_devices(srv: &Server, ctx: &str) {
    let list = srv.list_json();
    assert_eq!(list.len(), DEVICES, "{ctx}: devices listed");
    for i in 0..DEVICES {
        let name = format!("d{i}");
        let d = list
            .iter()
            .find(|d| d.at("name").str() == name)
            .unwrap_or_else(|| panic!("{ctx}: {name} not listed"));
        if gone(i) {
            assert_eq!(d.at("state").str(), "missing", "{ctx}: {name}: {d:?}");
            assert!(
                d.at("reason").str().contains("No such file or directory"),
                "{ctx}: {name}: {d:?}"
            );
            continue;
        }
        assert_eq!(d.at("state").str(), "live", "{ctx}: {name}: {d:?}");
        let (mut c, size, _) = RawClient::handshake(srv.socket(), &name);
        assert_eq!(size, SIZE, "{ctx}: {name} size");
        let got = c.read(1, 0, 4096);
        let want = pattern_bytes(seed(i), 0, 4096);
        assert_bytes_eq(&got, &want, 0, &format!("{ctx}: {name}"));
    }
}

#[test]
fn two_hundred_recorded_devices_come_back_with_their_bytes() {
    let dir = tempdir();
    let imgs = dir.path().join("imgs");
    std::fs::create_dir(&imgs).unwrap();
    let state = dir.path().join("r.state");
    let mut text = String::from("{\"loopd_state\":1}\n");
    for i in 0..DEVICES {
        let img = imgs.join(format!("d{i}.img"));
        if !gone(i) {
            create_pattern_image(&img, SIZE, seed(i));
        }
        text.push_str(&put_line(&format!("d{i}"), &img));
    }
    std::fs::write(&state, &text).unwrap();
    let missing = (0..DEVICES).filter(|i| gone(*i)).count();

    let mut srv = Server::daemon().arg("--state").arg(&state).start();
    check_devices(&srv, "first start");
    // One line for the whole restore, not one per device.
    let log = srv.stderr_text();
    let summary = format!(
        "{} device(s) restored, {missing} missing",
        DEVICES - missing
    );
    assert!(log.contains(&summary), "no {summary:?} in:\n{log}");
    assert!(
        !log.contains("restored device"),
        "a line per device:\n{log}"
    );
    // Each device's file as found is recorded (by the compaction that ends
    // the restore); the missing ones keep their records as they were.
    let recs = records(&state);
    assert_eq!(recs.len(), DEVICES, "records kept");
    for i in 0..DEVICES {
        let r = &recs[&format!("d{i}")];
        assert_eq!(r.get("file").is_some(), !gone(i), "d{i}: {r:?}");
    }
    let order: Vec<String> = std::fs::read_to_string(&state)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| Json::parse(l).at("put").at("name").str().to_owned())
        .collect();
    let want: Vec<String> = (0..DEVICES).map(|i| format!("d{i}")).collect();
    assert_eq!(order, want, "the state file keeps the attach order");
    srv.stop_ok();

    // Again, now on the recorded files: the same devices, the same bytes.
    let srv = Server::daemon().arg("--state").arg(&state).start();
    check_devices(&srv, "second start");
    assert_eq!(records(&state), recs, "nothing changed in the records");
}

/// A state file with more devices than the open-file limit has room for
/// (300 devices, 4 descriptors each, under a limit of 800): the daemon
/// starts anyway (it used to open devices until the descriptors ran out,
/// then fail to set up its signal handling and exit), the devices that fit
/// come back with their bytes, the others are listed as missing with a
/// reason naming the limit, the control socket answers (a detach of one of
/// them), and under the usual limit every device comes back.
#[test]
fn more_recorded_devices_than_the_open_file_limit_has_room_for() {
    const N: usize = 300;
    let dir = tempdir();
    let imgs = dir.path().join("imgs");
    std::fs::create_dir(&imgs).unwrap();
    let state = dir.path().join("r.state");
    let mut text = String::from("{\"loopd_state\":1}\n");
    for i in 0..N {
        let img = imgs.join(format!("d{i}.img"));
        create_pattern_image(&img, SIZE, seed(i % DEVICES));
        text.push_str(&put_line(&format!("d{i}"), &img));
    }
    std::fs::write(&state, &text).unwrap();

    let mut srv = Server::daemon()
        .nofile(800)
        .arg("--state")
        .arg(&state)
        .start();
    let list = srv.list_json();
    assert_eq!(list.len(), N, "devices listed");
    let live: Vec<&Json> = list.iter().filter(|d| d.at("state") == "live").collect();
    let left: Vec<&Json> = list.iter().filter(|d| d.at("state") == "missing").collect();
    assert_eq!(live.len() + left.len(), N, "{list:?}");
    assert!(!live.is_empty() && !left.is_empty(), "{list:?}");
    for d in &left {
        assert!(
            d.at("reason").str().contains("open-file limit (800)"),
            "{d:?}"
        );
    }
    for d in &live {
        let name = d.at("name").str();
        let i: usize = name[1..].parse().unwrap();
        let (mut c, _, _) = RawClient::handshake(srv.socket(), name);
        let got = c.read(1, 0, 4096);
        assert_bytes_eq(&got, &pattern_bytes(seed(i % DEVICES), 0, 4096), 0, name);
    }
    let dropped = left[0].at("name").str().to_owned();
    srv.ctl_ok(&["detach", &dropped]);
    let log = srv.stderr_text();
    assert!(
        log.contains("not attached: the open-file limit (800)"),
        "{log}"
    );
    srv.stop_ok();

    let srv = Server::daemon().arg("--state").arg(&state).start();
    let list = srv.list_json();
    assert_eq!(list.len(), N - 1, "the detached device stays gone");
    assert!(
        list.iter().all(|d| d.at("state") == "live"),
        "{:?}",
        list.iter().find(|d| d.at("state") != "live")
    );
}
