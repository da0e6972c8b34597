//! Issue 22, point 6: what a control client or a device's name holds cannot
//! forge a log line or reach the administrator's terminal raw. An image path
//! with a newline and a complete fake audit line stays one escaped line in
//! the daemon's log; device names with a newline, ESC, CR and a bidi override
//! give one row each in `loopd list` and `loopd status`, with no control or
//! bidi character in the output, while `--json` still gives the exact names;
//! and the same for `rbd:` specs (refusals, listings, the lock take-back line).

mod common;

use common::*;

const FAKE: &str = "audit: detach \"prod\" by uid=1000 pid=4242: ok";

/// Characters that must never reach a terminal or a log line raw.
fn raw_controls(s: &str) -> Vec<char> {
    s.chars()
        .filter(|&c| {
            (c.is_control() && c != '\n')
                || matches!(u32::from(c), 0x202A..=0x202E | 0x2066..=0x2069 | 0x200B..=0x200F)
        })
        .collect()
}

/// Waits (10 s at most) for the daemon's log to catch up.
fn wait_for(mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "the log line never came"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn an_image_path_cannot_forge_an_audit_line() {
    let dir = tempdir();
    let d = Server::daemon().start();
    let evil = format!("{}/x.img\n{FAKE}", dir.path().display());
    let out = d.ctl(&["attach", &evil]);
    assert!(!out.success(), "{out}");
    // The client's own report is one line too.
    let report: Vec<&str> = out.stderr.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(report.len(), 1, "{out}");
    assert!(raw_controls(&out.stderr).is_empty(), "{out}");

    wait_for(|| d.stderr_text().contains("pid=4242"));
    let log = d.stderr_text();
    let mentions: Vec<&str> = log.lines().filter(|l| l.contains("pid=4242")).collect();
    assert_eq!(
        mentions.len(),
        1,
        "the forged line is not exactly one line of the log:\n{log}"
    );
    let line = mentions[0];
    assert!(
        line.contains("audit: attach ") && line.contains("refused:"),
        "{line}"
    );
    assert!(line.contains(r#"x.img\naudit: detach \"prod\""#), "{line}");
    for l in log.lines() {
        // After the timestamp and level, no line may begin as an audit line
        // that loopd did not write.
        let msg = l.split_once(" INFO ").map_or(l, |(_, m)| m).trim_start();
        assert!(
            !msg.starts_with("audit: detach \"prod\""),
            "a forged audit line: {l}"
        );
    }
    assert!(raw_controls(&log).is_empty(), "{log:?}");
}

#[test]
fn hostile_device_names_give_one_clean_row_each() {
    let dir = tempdir();
    let d = Server::daemon().start();
    let names = [
        "nl\nfake 1 2 3 4 5".to_string(),
        "esc\u{1b}[2J\u{1b}[31mred".to_string(),
        "cr\rover".to_string(),
        "bidi\u{202e}gpj.exe".to_string(),
        "iso\u{2066}x\u{2069}zw\u{200b}".to_string(),
    ];
    for (i, n) in names.iter().enumerate() {
        let img = dir.path().join(format!("{i}.img"));
        create_sparse_image(&img, MIB);
        d.ctl_ok(&["attach", path_str(&img), "--name", n]);
    }

    let list = d.ctl_ok(&["list"]);
    assert!(raw_controls(&list.stdout).is_empty(), "{:?}", list.stdout);
    assert_eq!(
        list.stdout.lines().count(),
        1 + names.len(),
        "list:\n{}",
        list.stdout
    );
    assert!(
        list.stdout.contains(r"nl\nfake 1 2 3 4 5"),
        "{}",
        list.stdout
    );
    assert!(
        list.stdout.contains(r"bidi\u{202e}gpj.exe"),
        "{}",
        list.stdout
    );
    let status = d.ctl_ok(&["status"]);
    assert!(
        raw_controls(&status.stdout).is_empty(),
        "{:?}",
        status.stdout
    );
    assert_eq!(status.stdout.lines().count(), 1 + names.len());
    for n in &names {
        let one = d.ctl_ok(&["status", n]);
        assert!(raw_controls(&one.stdout).is_empty(), "{:?}", one.stdout);
        assert!(
            one.stdout
                .lines()
                .next()
                .unwrap_or("")
                .starts_with("name: "),
            "{}",
            one.stdout
        );
        assert_eq!(
            one.stdout
                .lines()
                .filter(|l| l.starts_with("name: "))
                .count(),
            1
        );
    }

    // Scripts get the exact bytes.
    let json = d.ctl_ok(&["list", "--json"]);
    let mut got: Vec<String> = Json::parse(&json.stdout)
        .arr()
        .iter()
        .map(|x| x.at("name").str().to_owned())
        .collect();
    got.sort();
    let mut want = names.to_vec();
    want.sort();
    assert_eq!(got, want);
    let st = d.ctl_ok(&["status", &names[3], "--json"]);
    assert_eq!(Json::parse(&st.stdout).at("name").str(), names[3]);
    // And the daemon's own log of these attaches is clean.
    wait_for(|| d.stderr_text().matches("audit: attach").count() == names.len());
    assert!(raw_controls(&d.stderr_text()).is_empty());
}

/// `rbd:` specs are the client's text too: the parser refuses control
/// characters (the refusal quotes them escaped), and names of pools, images
/// and snapshots with bidi overrides or invisible characters reach no
/// terminal and no log line raw — in refusals (missing pool, image,
/// snapshot), `list`, `status`, the audit lines, and the line of a restart
/// that takes the image's lock back from its dead self — while `--json`
/// still gives the exact spec.
#[test]
fn rbd_specs_cannot_forge_a_line() {
    let img = CephImage::new("ev\u{202e}lif\u{200b}", 4 * MIB);
    let dir = tempdir();
    let sock = dir.path().join("ctl.sock");
    let conf = path_str(&ceph().conf).to_owned();
    let with_ceph = |spec: &str, more: &[&str]| {
        let mut a = vec!["attach", spec, "--ceph-conf", &conf, "--ceph-id", ceph().id];
        a.extend_from_slice(more);
        a.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let mut d = Server::daemon().socket_path(&sock).start();
    for bad in [
        "rbd:rbd/no\u{202e}such\u{2066}".to_string(),
        "rbd:po\u{2067}ol/x".to_string(),
        format!("{}@sn\u{202e}ap", img.spec()),
        "rbd:rbd/esc\u{1b}[2J\u{1b}[31mred".to_string(),
        format!("rbd:rbd/nl\n{FAKE}"),
    ] {
        let a = with_ceph(&bad, &[]);
        let out = d.ctl(&a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(!out.success(), "{out}");
        let report: Vec<&str> = out.stderr.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(report.len(), 1, "one line: {out}");
        assert!(raw_controls(&out.stderr).is_empty(), "{out}");
        eprintln!("refused: {}", out.stderr.trim_end());
    }
    let a = with_ceph(&img.spec(), &["--name", "r", "--cache", "direct"]);
    d.ctl_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    for args in [&["list"][..], &["status"], &["status", "r"]] {
        let out = d.ctl_ok(args);
        assert!(raw_controls(&out.stdout).is_empty(), "{:?}", out.stdout);
        assert!(
            out.stdout.contains(r"ev\u{202e}lif\u{200b}"),
            "{}",
            out.stdout
        );
    }
    let json = d.ctl_ok(&["list", "--json"]);
    let rows = Json::parse(&json.stdout);
    assert_eq!(rows.arr()[0].at("image").str(), img.spec());
    wait_for(|| d.stderr_text().matches("audit: attach").count() == 6);
    assert!(
        raw_controls(&d.stderr_text()).is_empty(),
        "{:?}",
        d.stderr_text()
    );
    // A restart after kill -9 takes the lock back, and says so on one clean
    // line naming the image.
    d.kill9();
    let d = Server::daemon().socket_path(&sock).start();
    wait_for(|| d.stderr_text().contains("took it back"));
    let log = d.stderr_text();
    let line = log
        .lines()
        .find(|l| l.contains("took it back"))
        .unwrap_or_default();
    assert!(line.contains(r"ev\u{202e}lif\u{200b}"), "{line}");
    assert!(raw_controls(&log).is_empty(), "{log:?}");
    d.ctl_ok(&["detach", "r"]);
    assert!(raw_controls(&d.stderr_text()).is_empty());
}

/// A batch attach (`loopd attach IMG…`) reports each failed image on a line
/// of its own: an image path with a newline, a fake audit line and a bidi
/// override reaches the terminal escaped, one line, beside the good image's
/// success.
#[test]
fn a_batch_attach_reports_a_hostile_image_path_escaped() {
    let dir = tempdir();
    let d = Server::daemon().start();
    let good = dir.path().join("good.img");
    create_sparse_image(&good, MIB);
    let evil = format!("{}/ev\u{202e}il\n{FAKE}.img", dir.path().display());
    let out = d.ctl(&["attach", path_str(&good), &evil]);
    assert!(!out.success(), "one image is missing: {out}");
    assert!(raw_controls(&out.stderr).is_empty(), "{out}");
    assert!(raw_controls(&out.stdout).is_empty(), "{out}");
    let errors: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("pid=4242"))
        .collect();
    assert_eq!(errors.len(), 1, "the hostile path is on one line: {out}");
    assert!(errors[0].contains(r"ev\u{202e}il\naudit"), "{}", errors[0]);
    assert!(
        !out.stderr
            .lines()
            .any(|l| l.trim_start().starts_with("audit:")),
        "{out}"
    );
    // The good one is attached.
    let list = d.ctl_ok(&["list", "--json"]);
    assert_eq!(Json::parse(&list.stdout).arr().len(), 1, "{}", list.stdout);
}
