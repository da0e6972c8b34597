//! scripts/install.sh end to end: installs the built loopd into temporary
//! directories and checks what a user and an administrator check: the man
//! pages render with man-db's `man -l` and describe the options, bash completes
//! `loopd at<TAB>` from the installed completion script, `systemd-analyze
//! verify` accepts the installed units, the shipped devices.toml starts a
//! daemon with no devices, and an existing devices.toml is never overwritten.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The repository root (scripts/install.sh lives there).
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Run scripts/install.sh with the binary under test (no build) and `args`.
fn install(args: &[&str]) -> Out {
    let mut c = Command::new("bash");
    c.arg(repo().join("scripts/install.sh"))
        .arg("--no-build")
        .arg("--binary")
        .arg(loopd_bin())
        .args(args)
        .env("PATH", tool_path_env());
    run_cmd_timeout(c, Duration::from_secs(60)).assert_success()
}

/// A staged install (`--destdir`) with the default prefix /usr/local.
fn staged() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dir.path().join("dest");
    install(&["--destdir", dest.to_str().expect("utf-8 path")]);
    (dir, dest)
}

/// A manual page as text, rendered by man-db (`man -l`), in the C locale so
/// that hyphens stay ASCII; overstrike formatting removed.
fn render_man(page: &Path) -> String {
    require_tool("man");
    let mut c = tool("man");
    c.arg("-l")
        .arg(page)
        .env("LC_ALL", "C")
        .env("MANWIDTH", "200")
        .env("MANPAGER", "cat")
        .env("PAGER", "cat");
    let out = run_cmd_timeout(c, Duration::from_secs(60)).assert_success();
    let mut text = String::new();
    for ch in out.stdout.chars() {
        if ch == '\u{8}' {
            text.pop();
        } else {
            text.push(ch);
        }
    }
    text
}

#[test]
fn install_lays_out_binary_man_pages_completions_units_and_config() {
    let (_dir, dest) = staged();
    let prefix = dest.join("usr/local");
    for f in [
        "bin/loopd",
        "share/man/man1/loopd.1",
        "share/man/man1/loopd-serve.1",
        "share/man/man1/loopd-attach.1",
        "share/man/man1/loopd-kernel-attach.1",
        "share/bash-completion/completions/loopd",
        "share/zsh/site-functions/_loopd",
        "share/fish/vendor_completions.d/loopd.fish",
    ] {
        assert!(
            prefix.join(f).is_file(),
            "{f} not installed under {prefix:?}"
        );
    }
    for f in [
        "etc/systemd/system/loopd.service",
        "etc/systemd/system/loopd.socket",
        "etc/systemd/system/loopd-control.socket",
        "etc/loopd/devices.toml",
    ] {
        assert!(dest.join(f).is_file(), "{f} not installed under {dest:?}");
    }
    // The unit runs the binary where it ends up (not where it was staged).
    let unit = std::fs::read_to_string(dest.join("etc/systemd/system/loopd.service"))
        .expect("loopd.service");
    assert!(
        unit.contains(
            "ExecStart=/usr/local/bin/loopd serve --config /etc/loopd/devices.toml --state"
        ),
        "{unit}"
    );
    // No hidden test switches in the completions.
    let bash = std::fs::read_to_string(prefix.join("share/bash-completion/completions/loopd"))
        .expect("bash completion");
    for hidden in ["--follow-idle", "--control-idle-timeout", "--no-splice"] {
        assert!(!bash.contains(hidden), "{hidden} is hidden but completed");
    }
}

#[test]
fn man_pages_render_and_describe_the_options() {
    let (_dir, dest) = staged();
    let man1 = dest.join("usr/local/share/man/man1");
    let top = render_man(&man1.join("loopd.1"));
    for s in [
        "SUBCOMMANDS",
        "loopd-serve(1)",
        "EXIT STATUS",
        "ENVIRONMENT",
        "LOOPD_LOG",
        "LISTEN_FDNAMES",
        "NOTIFY_SOCKET",
        "JOURNAL_STREAM",
        "FILES",
        "/etc/loopd/devices.toml",
    ] {
        assert!(top.contains(s), "loopd.1 lacks {s:?}:\n{top}");
    }
    let serve = render_man(&man1.join("loopd-serve.1"));
    for s in [
        "--config",
        "--socket",
        "--state",
        "--listen",
        "--tls-certs",
        "--max-connections",
    ] {
        assert!(serve.contains(s), "loopd-serve.1 lacks {s:?}:\n{serve}");
    }
    assert!(
        !serve.contains("--follow-idle"),
        "hidden option in man page:\n{serve}"
    );
    let attach = render_man(&man1.join("loopd-attach.1"));
    for s in ["--read-only", "--size-limit", "--offset", "--control"] {
        assert!(attach.contains(s), "loopd-attach.1 lacks {s:?}:\n{attach}");
    }
}

/// Issue 27 point 7: `loopd man` is in `--help`; every page has EXAMPLES;
/// the config file has a page of its own, installed in man5, with every key.
#[test]
fn man_pages_have_examples_and_a_page_for_the_config_file() {
    let help = loopd_run(["--help"]);
    assert!(
        help.stdout
            .lines()
            .any(|l| l.trim_start().starts_with("man ")),
        "loopd man is not in --help:\n{help}"
    );
    let (_dir, dest) = staged();
    let man1 = dest.join("usr/local/share/man/man1");
    let mut pages = 0;
    for e in std::fs::read_dir(&man1).expect("man1") {
        let page = e.expect("entry").path();
        let text = render_man(&page);
        assert!(
            text.contains("EXAMPLES"),
            "{page:?} has no EXAMPLES:\n{text}"
        );
        pages += 1;
    }
    assert!(pages > 12, "only {pages} pages");
    let detach = render_man(&man1.join("loopd-detach.1"));
    assert!(detach.contains("loopd detach a --force"), "{detach}");
    let cfg = render_man(&dest.join("usr/local/share/man/man5/loopd.toml.5"));
    for s in [
        "LOOPD.TOML(5)",
        "KEYS",
        "image (path)",
        "size_limit (size)",
        "Default: false.",
        "tls_allow",
        "EXAMPLES",
        "[[device]]",
        "does not stop the start",
        "not attached at the next start",
    ] {
        assert!(cfg.contains(s), "loopd.toml.5 lacks {s:?}:\n{cfg}");
    }
    let top = render_man(&man1.join("loopd.1"));
    assert!(top.contains("loopd.toml(5)"), "{top}");
}

#[test]
fn bash_completes_subcommands_and_options() {
    let (_dir, dest) = staged();
    let script = dest.join("usr/local/share/bash-completion/completions/loopd");
    assert_eq!(bash_complete(&script, None, &["loopd", "at"]), ["attach"]);
    assert_eq!(
        bash_complete(&script, None, &["loopd", "kernel", "de"]),
        ["detach"]
    );
    let serve = bash_complete(&script, None, &["loopd", "serve", "--conf"]);
    assert_eq!(serve, ["--config"]);
    let none = bash_complete(&script, None, &["loopd", "serve", "--follow-i"]);
    assert!(none.is_empty(), "a hidden option is completed: {none:?}");
}

#[test]
fn systemd_analyze_verify_accepts_the_installed_units() {
    require_tool("systemd-analyze");
    // Installed for real into a temporary prefix, so that ExecStart= names a
    // binary that exists (verify checks it).
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = dir.path().join("usr");
    let units = dir.path().join("units");
    let etc = dir.path().join("etc");
    install(&[
        "--prefix",
        prefix.to_str().expect("utf-8"),
        "--unitdir",
        units.to_str().expect("utf-8"),
        "--sysconfdir",
        etc.to_str().expect("utf-8"),
    ]);
    let service = std::fs::read_to_string(units.join("loopd.service")).expect("unit");
    let exec = format!(
        "ExecStart={}/bin/loopd serve --config {}/loopd/devices.toml",
        prefix.display(),
        etc.display()
    );
    assert!(service.contains(&exec), "{exec:?} not in:\n{service}");
    let mut c = tool("systemd-analyze");
    c.arg("verify")
        .arg("--man=no")
        .arg(units.join("loopd.service"))
        .arg(units.join("loopd.socket"))
        .arg(units.join("loopd-control.socket"));
    let out = run_cmd_timeout(c, Duration::from_secs(60));
    // Verify's complaints about our units name them; others (the host's own
    // units) are not ours to judge.
    let ours: Vec<&str> = out
        .stderr
        .lines()
        .chain(out.stdout.lines())
        .filter(|l| l.contains("loopd"))
        .collect();
    assert!(
        out.success() && ours.is_empty(),
        "systemd-analyze verify found problems:\n{out}"
    );
}

#[test]
fn shipped_devices_toml_starts_a_daemon_with_no_devices() {
    let (_dir, dest) = staged();
    let config = dest.join("etc/loopd/devices.toml");
    let server = Server::daemon().arg("--config").arg(&config).start();
    let list = server.ctl_json(&["list"]);
    assert!(
        list.arr().is_empty(),
        "devices from an all-comment config: {list:?}"
    );
}

#[test]
fn an_existing_devices_toml_is_not_overwritten() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dir.path().join("dest");
    let conf = dest.join("etc/loopd/devices.toml");
    std::fs::create_dir_all(conf.parent().expect("parent")).expect("mkdir");
    let mine = "[[device]]\nimage = \"/srv/mine.img\"\n";
    std::fs::write(&conf, mine).expect("write");
    let out = install(&["--destdir", dest.to_str().expect("utf-8")]);
    assert_eq!(std::fs::read_to_string(&conf).expect("read"), mine);
    assert!(
        out.stdout.contains("exists; left as it is"),
        "install did not say it kept the file:\n{out}"
    );
    // A second install over the first keeps it too, and replaces the rest.
    install(&["--destdir", dest.to_str().expect("utf-8")]);
    assert_eq!(std::fs::read_to_string(&conf).expect("read"), mine);
}
