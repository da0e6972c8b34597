//! Option surfaces that agree (issue 27, point 6): `-J` wherever `--json`
//! is, `detach` of several names, one reading of `--size-limit` (`none` and
//! `0`: no limit) on every command and in config files, `-f` as `--format`
//! on `serve`/`attach` with a hint for losetup's `-f`, and qemu-nbd's
//! `-k`, `-p`, `-t`, `--cache=none|writeback`, `--aio` on `serve`.

mod common;

use common::*;
use std::time::Duration;

/// A daemon with images `NAME.img` of 1 MiB attached under their names.
fn daemon_with(dir: &std::path::Path, names: &[&str]) -> Server {
    let srv = Server::daemon().start();
    for n in names {
        let img = dir.join(format!("{n}.img"));
        create_sparse_image(&img, MIB);
        srv.ctl_ok(&["attach", path_str(&img)]);
    }
    srv
}

/// Every client command that takes `--json` takes `-J` (as `list -J`,
/// losetup's spelling), and a usage error under `-J` is JSON too.
#[test]
fn every_json_command_takes_short_j() {
    let dir = tempdir();
    let srv = daemon_with(dir.path(), &["a", "b"]);
    let one = |args: &[&str]| {
        let out = srv.ctl_ok(args);
        Json::parse(&out.stdout)
    };
    assert_eq!(one(&["status", "a", "-J"]).at("name").str(), "a");
    assert_eq!(one(&["status", "-J"]).arr().len(), 2);
    assert_eq!(one(&["list", "-J"]).arr().len(), 2);
    assert!(one(&["set", "a", "-r", "-J"]).at("changed").bool());
    assert_eq!(one(&["resize", "a", "-J"]).at("name").str(), "a");
    one(&["reload", "-J"]);
    let img = dir.path().join("c.img");
    create_sparse_image(&img, MIB);
    assert_eq!(one(&["attach", path_str(&img), "-J"]).at("name").str(), "c");
    one(&["detach", "c", "-J"]);
    // A failure under -J: the error object on stdout, as with --json.
    let out = srv.ctl(&["status", "nosuch", "-J"]);
    assert_ctl_error(&out, "not_found");
    assert_eq!(
        Json::parse(&out.stdout).at("error").at("code").str(),
        "not_found"
    );
    let out = srv.ctl(&["status", "-J", "--no-such-option"]);
    assert_eq!(out.status.code(), Some(2), "{out}");
    assert_eq!(
        Json::parse(&out.stdout).at("error").at("code").str(),
        "usage"
    );
    // `kernel` commands without a kernel: the command line is what counts.
    for k in [
        &["kernel", "detach", "-J", "--help"][..],
        &["kernel", "attach", "-J", "--help"],
    ] {
        let out = loopd_run(k);
        assert!(out.success(), "{out}");
    }
}

/// `detach NAME...`: each name on its own, in order; the exit status is the
/// first failure's; `--json` gives one entry per name; one name is a plain
/// detach as before.
#[test]
fn detach_takes_several_names() {
    let dir = tempdir();
    let srv = daemon_with(dir.path(), &["a", "b", "c", "d", "e"]);
    let out = srv.ctl(&["detach", "a", "nosuch", "b"]);
    assert_ctl_error(&out, "not_found");
    assert_eq!(out.stdout, "detached a\ndetached b\n", "{out}");
    assert!(
        out.stderr
            .lines()
            .any(|l| l.starts_with("loopd: error: nosuch: ") && l.ends_with("(not_found)")),
        "{out}"
    );
    assert!(
        out.stderr.contains("1 of 3 device(s) not detached"),
        "{out}"
    );
    assert_eq!(srv.device_names(), ["c", "d", "e"]);

    // A client keeps `c` busy: the first failure (busy) sets the status.
    let (client, _, _) = RawClient::handshake(srv.socket(), "c");
    srv.wait_clients("c", 1, Duration::from_secs(10));
    let out = srv.ctl(&["detach", "--json", "c", "d", "gone"]);
    assert_ctl_error(&out, "busy");
    let j = Json::parse(&out.stdout);
    let items = j.arr();
    assert_eq!(items.len(), 3, "{j:?}");
    let names: Vec<&str> = items.iter().map(|i| i.at("name").str()).collect();
    assert_eq!(names, ["c", "d", "gone"]);
    let oks: Vec<bool> = items.iter().map(|i| i.at("ok").bool()).collect();
    assert_eq!(oks, [false, true, false]);
    assert_eq!(items[0].at("error").at("code").str(), "busy");
    assert_eq!(items[2].at("error").at("code").str(), "not_found");
    assert_eq!(srv.device_names(), ["c", "e"]);
    drop(client);

    // All good: exit 0, every name detached (--force as for one).
    let out = srv.ctl_ok(&["detach", "c", "e", "--force"]);
    assert_eq!(out.stdout, "detached c\ndetached e\n", "{out}");
    assert!(srv.device_names().is_empty());
    let out = srv.ctl(&["detach"]);
    assert_eq!(out.status.code(), Some(2), "a name is required:\n{out}");
}

/// `--size-limit none` and `--size-limit 0` mean "to the end of the file" on
/// `attach`, `serve IMAGE`, `set` and in a config file (`0` used to be
/// refused there while `kernel attach` took it so, and `none` was `set`'s
/// alone).
#[test]
fn size_limit_none_and_zero_mean_no_limit_everywhere() {
    let dir = tempdir();
    let img = |n: &str| {
        let p = dir.path().join(format!("{n}.img"));
        create_sparse_image(&p, 3 * MIB);
        p
    };
    let (a, b, s, c0, cn) = (img("a"), img("b"), img("s"), img("c0"), img("cn"));
    let config = dir.path().join("devices.toml");
    std::fs::write(
        &config,
        format!(
            "[[device]]\nimage = {:?}\nsize_limit = 0\n\n[[device]]\nimage = {:?}\nsize_limit = \"none\"\n",
            path_str(&c0),
            path_str(&cn)
        ),
    )
    .expect("write config");
    let srv = Server::daemon()
        .arg(&s)
        .args(["--size-limit", "none", "--config"])
        .arg(&config)
        .start();
    for n in ["s", "c0", "cn"] {
        assert_eq!(nbd_size(&srv.uri_for_name(n)), 3 * MIB, "{n}");
    }
    let j = srv.ctl_json(&["attach", path_str(&a), "--size-limit", "none"]);
    assert_eq!(j.at("size").u64(), 3 * MIB, "{j:?}");
    assert!(j.at("size_limit").is_null(), "{j:?}");
    let j = srv.ctl_json(&["attach", path_str(&b), "--sizelimit", "0"]);
    assert_eq!(j.at("size").u64(), 3 * MIB, "{j:?}");
    assert!(j.at("size_limit").is_null(), "{j:?}");
    srv.ctl_ok(&["set", "a", "--size-limit", "1M"]);
    assert_eq!(nbd_size(&srv.uri_for_name("a")), MIB);
    let j = srv.ctl_json(&["set", "a", "--size-limit", "0"]);
    assert!(j.at("size_limit").is_null(), "{j:?}");
    assert_eq!(nbd_size(&srv.uri_for_name("a")), 3 * MIB);
    // Anything else is still a size, or an error that names it.
    let out = srv.ctl(&["attach", path_str(&a), "--size-limit", "nothing"]);
    assert_eq!(out.status.code(), Some(2), "{out}");
    assert!(out.stderr.contains("nothing"), "{out}");
}

/// `-f` is `--format` on `serve` and `attach` (qemu-nbd's); a losetup user's
/// `attach -f IMAGE` is told where losetup's `-f` is.
#[test]
fn f_is_format_with_a_hint_for_losetup_users() {
    let dir = tempdir();
    let srv = Server::daemon().start();
    let img = dir.path().join("f.img");
    create_sparse_image(&img, MIB);
    let out = srv.ctl(&["attach", "-f", path_str(&img)]);
    assert_eq!(out.status.code(), Some(2), "{out}");
    assert!(out.stderr.contains("-f is --format here"), "{out}");
    assert!(out.stderr.contains("loopd kernel attach -f"), "{out}");
    assert!(srv.device_names().is_empty());
    let j = srv.ctl_json(&["attach", "-f", "raw", path_str(&img)]);
    assert_eq!(j.at("name").str(), "f");
}

/// qemu-nbd's most-typed spellings on `serve`: `-k SOCKET -p PORT -t
/// --cache=none --aio=io_uring -f raw -x NAME`, read back with qemu-io over
/// both endpoints; `--cache=writeback` is buffered; `--aio threads` says
/// what loopd does instead.
#[test]
fn serve_takes_qemu_nbd_spellings() {
    let dir = tempdir();
    let img = dir.path().join("q.img");
    create_pattern_image(&img, 4 * MIB, 9);
    let sock = dir.path().join("q.sock");
    let port = free_port();
    let srv = Server::daemon()
        .no_socket()
        .arg(&img)
        .arg("-k")
        .arg(&sock)
        .args([
            "-p",
            &port.to_string(),
            "-t",
            "--cache=none",
            "--aio=io_uring",
        ])
        .args(["-f", "raw", "-x", "q"])
        .start();
    let unix = format!("nbd+unix:///q?socket={}", pct(path_str(&sock)));
    let tcp = format!("nbd://127.0.0.1:{port}/q");
    qemu_io(&unix, &["write -P 0x5a 0 64k"]);
    qemu_io(&tcp, &["read -P 0x5a 0 64k", "write -P 0x6b 1M 4k"]);
    qemu_io(&unix, &["read -P 0x6b 1M 4k"]);
    let st = srv.ctl_json(&["status", "q"]);
    assert_eq!(st.at("cache").str(), "direct", "{st:?}");
    assert!(
        !srv.stderr_text().contains("--aio"),
        "{}",
        srv.stderr_text()
    );
    drop(srv);

    let srv = Server::daemon()
        .arg(&img)
        .args(["--cache=writeback", "--aio", "threads", "-x", "w"])
        .start();
    let st = srv.ctl_json(&["status", "w"]);
    assert_eq!(st.at("cache").str(), "buffered", "{st:?}");
    assert!(
        srv.stderr_text()
            .contains("--aio threads: loopd does its file I/O through io_uring"),
        "{}",
        srv.stderr_text()
    );
    qemu_io(&srv.uri_for_name("w"), &["read -P 0x6b 1M 4k"]);
    // `attach` takes qemu's cache names too.
    let other = dir.path().join("o.img");
    create_sparse_image(&other, MIB);
    let j = srv.ctl_json(&["attach", path_str(&other), "--cache", "writeback"]);
    assert_eq!(j.at("cache").str(), "buffered", "{j:?}");
}
