//! Shell completions and man pages generated from the CLI definition.
//!
//! Both take the `clap::Command` that `main.rs` parses with, so they never
//! drift from it; its subcommands' arguments are deferred (added when a
//! subcommand is used, see `main.rs`), so both build the whole tree first.
//! Hidden subcommands and options (test and benchmark switches) appear in
//! neither. Man pages: `loopd.1` with the subcommand list, EXIT STATUS,
//! ENVIRONMENT and FILES, one page per subcommand (`loopd-attach.1`,
//! `loopd-kernel-attach.1`, ...), as git does, each with EXAMPLES
//! ([`super::examples`]); and `loopd.toml.5`, the `--config` file
//! ([`super::config_page`]). Completions: clap's script, plus (bash, zsh,
//! fish) the names of the running server's devices where a command takes
//! one ([`super::complete_names`]).

use clap::Command;
use clap_complete::Shell;
use clap_mangen::Man;
use clap_mangen::roff::{Roff, bold, italic, roman};
use std::path::{Path, PathBuf};

/// The name users type; completions are registered for it.
const BIN: &str = "loopd";

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// An environment variable loopd reads, for the man page.
struct EnvVar {
    name: &'static str,
    help: &'static str,
}

const ENVIRONMENT: &[EnvVar] = &[
    EnvVar {
        name: "LOOPD_LOG",
        help: "What is logged to standard error: error, warn, info (the default), debug, \
               trace, or per module, comma-separated (warn,loopd::frontend=debug).",
    },
    EnvVar {
        name: "LOOPD_CONTROL",
        help: "The control socket client commands talk to, when --control is not given.",
    },
    EnvVar {
        name: "LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID",
        help: "Socket activation (systemd.socket(5)): loopd serve takes its NBD socket \
               from the passed descriptor named nbd and its control socket from the one \
               named control, instead of binding them itself.",
    },
    EnvVar {
        name: "NOTIFY_SOCKET",
        help: "Readiness notification (sd_notify(3)): loopd serve sends READY=1 once its \
               sockets listen and its devices are restored, RELOADING=1 while it re-reads \
               its configuration and STOPPING=1 when it shuts down (Type=notify units).",
    },
    EnvVar {
        name: "XDG_RUNTIME_DIR",
        help: "Users other than root: the default sockets are in $XDG_RUNTIME_DIR/loopd/ \
               (else /tmp/loopd-UID/).",
    },
    EnvVar {
        name: "XDG_STATE_HOME",
        help: "Users other than root: the default state file is in $XDG_STATE_HOME/loopd/ \
               (else ~/.local/state/loopd/).",
    },
    EnvVar {
        name: "JOURNAL_STREAM",
        help: "Set by systemd when standard error goes to the journal: log lines then \
               carry no timestamp of their own (the journal adds one).",
    },
];

const FILES: &[(&str, &str)] = &[
    (
        "/run/loopd/loopd.sock",
        "The NBD Unix socket of a server run by root (others: in $XDG_RUNTIME_DIR/loopd/).",
    ),
    (
        "/run/loopd/loopd.ctl",
        "Its control socket, which attach, detach, list, status, set and the other client \
         commands use.",
    ),
    (
        "/var/lib/loopd/loopd.state",
        "The state file: devices attached over the control socket, restored when the \
         server starts (others: $XDG_STATE_HOME/loopd/loopd.state).",
    ),
    (
        "/etc/loopd/devices.toml",
        "The devices the service attaches at start (--config), as [[device]] tables; \
         re-read on reload.",
    ),
    (
        "loopd.service, loopd.socket, loopd-control.socket",
        "The systemd units installed by scripts/install.sh (in /etc/systemd/system or \
         the unit directory given to it).",
    ),
];

/// `cmd` (built) without hidden subcommands and options, recursively: what
/// completions offer. Argument groups are dropped (they may name hidden
/// options and only matter to parsing). The version is the top command's only
/// (building copies it into every subcommand, which completions never offered).
fn visible(cmd: &Command, top: bool) -> Command {
    let mut out = Command::new(cmd.get_name().to_string());
    if let Some(a) = cmd.get_about() {
        out = out.about(a.clone());
    }
    if let Some(v) = cmd.get_version().filter(|_| top) {
        out = out.version(v.to_string());
    }
    if cmd.is_subcommand_required_set() {
        out = out.subcommand_required(true);
    }
    for a in cmd.get_visible_aliases() {
        out = out.visible_alias(a.to_string());
    }
    out = out.args(
        cmd.get_arguments()
            .filter(|a| !a.is_hide_set())
            // Built later again, from the version and help settings.
            .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
            .cloned(),
    );
    out.subcommands(
        cmd.get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(|s| visible(s, false)),
    )
}

/// The completion script for `shell`. (Returned, not written: clap_complete
/// panics on a write error, e.g. a closed pipe.) `cmd` may be unbuilt, with
/// its subcommands' arguments deferred (`Command::defer`): it is built here.
pub fn completions(cmd: &Command, shell: Shell) -> Vec<u8> {
    let mut full = cmd.clone().disable_help_subcommand(true);
    full.build();
    let mut c = visible(&full, true).disable_help_subcommand(true);
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut c, BIN, &mut out);
    super::complete_names::add(shell, &full, out)
}

/// Write `loopd.1`, one page per visible subcommand and `loopd.toml.5` into
/// `dir` (created if missing); `exit_status` is the table of exit codes for
/// the EXIT STATUS section. Returns the files written.
pub fn man_pages(
    cmd: &Command,
    dir: &Path,
    exit_status: &[(u8, &str)],
) -> Result<Vec<PathBuf>, GenerateError> {
    std::fs::create_dir_all(dir).map_err(|source| GenerateError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut cmd = cmd.clone().disable_help_subcommand(true);
    cmd.build();
    let mut written = Vec::new();
    let mut subpages = Vec::new();
    collect_subpages(&cmd, &mut subpages);

    let path = dir.join(format!("{BIN}.1"));
    let mut roff = Roff::default();
    see_also(&mut roff, &subpages);
    let mut extra = top_sections(exit_status);
    examples(&mut extra, "");
    write_page(
        &path,
        &Man::new(cmd.clone()).manual("loopd manual"),
        &extra,
        &roff,
    )?;
    written.push(path);

    for (sub_path, sub) in &subpages {
        let man = Man::new(sub.clone()).manual("loopd manual");
        let path = dir.join(man.get_filename());
        let mut extra = Roff::default();
        examples(&mut extra, sub_path);
        let mut roff = Roff::default();
        roff.control("SH", ["SEE ALSO"]);
        let mut refs = vec![bold(BIN), roman("(1)")];
        if matches!(sub_path.as_str(), "serve" | "reload") {
            refs.extend([roman(", "), bold(super::config_page::NAME), roman("(5)")]);
        }
        roff.text(refs);
        write_page(&path, &man, &extra, &roff)?;
        written.push(path);
    }

    let path = dir.join(format!("{}.5", super::config_page::NAME));
    let version = cmd.get_version().unwrap_or_default().to_string();
    std::fs::write(&path, super::config_page::render(&version)).map_err(|source| {
        GenerateError::Write {
            path: path.clone(),
            source,
        }
    })?;
    written.push(path);
    Ok(written)
}

/// Every visible subcommand with its path (`"kernel attach"`), depth first,
/// parents before children.
fn collect_subpages(cmd: &Command, out: &mut Vec<(String, Command)>) {
    collect_under(cmd, "", out);
}

fn collect_under(cmd: &Command, prefix: &str, out: &mut Vec<(String, Command)>) {
    for s in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let path = if prefix.is_empty() {
            s.get_name().to_owned()
        } else {
            format!("{prefix} {}", s.get_name())
        };
        out.push((path.clone(), s.clone()));
        collect_under(s, &path, out);
    }
}

/// The EXAMPLES section of the page for subcommand path `path` (none if it
/// has no examples).
fn examples(roff: &mut Roff, path: &str) {
    let list = super::examples::for_path(path);
    if list.is_empty() {
        return;
    }
    roff.control("SH", ["EXAMPLES"]);
    for e in list {
        if !e.what.is_empty() {
            roff.control("PP", []);
            roff.text([roman(e.what)]);
        }
        roff.control("RS", ["4"]);
        roff.control("nf", []);
        roff.text([bold(e.command)]);
        roff.control("fi", []);
        roff.control("RE", []);
    }
}

/// One page: clap_mangen's sections, then `extra`, then `tail` and VERSION.
fn write_page(path: &Path, man: &Man, extra: &Roff, tail: &Roff) -> Result<(), GenerateError> {
    let err = |source| GenerateError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut buf: Vec<u8> = Vec::new();
    // Into a Vec: cannot fail.
    let _ = man.render(&mut buf);
    // clap_mangen puts VERSION last; keep ours before it.
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, version) = match text.find("\n.SH VERSION") {
        Some(i) => (&text[..=i], &text[i + 1..]),
        None => (text.as_str(), ""),
    };
    let page = format!("{head}{}{}{version}", extra.to_roff(), tail.to_roff());
    std::fs::write(path, page).map_err(err)
}

/// EXIT STATUS, ENVIRONMENT and FILES of `loopd.1`.
fn top_sections(exit_status: &[(u8, &str)]) -> Roff {
    let mut roff = Roff::default();
    roff.control("SH", ["EXIT STATUS"]);
    for (code, what) in exit_status {
        roff.control("TP", []);
        roff.text([bold(code.to_string())]);
        roff.text([roman(*what)]);
    }
    roff.control("SH", ["ENVIRONMENT"]);
    for v in ENVIRONMENT {
        roff.control("TP", []);
        roff.text([bold(v.name)]);
        roff.text([roman(v.help)]);
    }
    roff.control("SH", ["FILES"]);
    for (path, what) in FILES {
        roff.control("TP", []);
        roff.text([italic(*path)]);
        roff.text([roman(*what)]);
    }
    roff
}

/// SEE ALSO of `loopd.1`: the subcommand pages and the tools loopd stands beside.
fn see_also(roff: &mut Roff, subpages: &[(String, Command)]) {
    roff.control("SH", ["SEE ALSO"]);
    let mut refs: Vec<String> = subpages
        .iter()
        .map(|(_, s)| format!("{}(1)", s.get_display_name().unwrap_or(s.get_name())))
        .collect();
    refs.push(format!("{}(5)", super::config_page::NAME));
    refs.extend(
        [
            "losetup(8)",
            "qemu-nbd(8)",
            "nbdinfo(1)",
            "systemd.socket(5)",
            "sd_notify(3)",
        ]
        .map(String::from),
    );
    roff.text([roman(refs.join(", "))]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction};

    fn sample() -> Command {
        Command::new(BIN)
            .version("1.0")
            .about("A tool")
            .subcommand(
                Command::new("attach")
                    .about("Attach")
                    .arg(Arg::new("name").long("name"))
                    .arg(
                        Arg::new("secret")
                            .long("secret-switch")
                            .action(ArgAction::SetTrue)
                            .hide(true),
                    ),
            )
            .subcommand(Command::new("kernel").subcommand(Command::new("list")))
            .subcommand(Command::new("man").hide(true))
    }

    fn bash() -> String {
        String::from_utf8(completions(&sample(), Shell::Bash)).expect("utf-8 script")
    }

    #[test]
    fn completions_offer_visible_commands_and_options_only() {
        let s = bash();
        assert!(s.contains("attach"), "{s}");
        assert!(s.contains("--name"), "{s}");
        assert!(!s.contains("--secret-switch"), "{s}");
        assert!(!s.contains("loopd__man"), "{s}");
        assert!(!s.contains(" man "), "{s}");
    }

    #[test]
    fn man_pages_one_per_visible_subcommand_with_extra_sections() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files =
            man_pages(&sample(), dir.path(), &[(0, "success"), (1, "failure")]).expect("man pages");
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap_or_default().to_string_lossy().into())
            .collect();
        assert_eq!(
            names,
            [
                "loopd.1",
                "loopd-attach.1",
                "loopd-kernel.1",
                "loopd-kernel-list.1",
                "loopd.toml.5"
            ]
        );
        let top = std::fs::read_to_string(dir.path().join("loopd.1")).expect("loopd.1");
        for s in [
            "EXIT STATUS",
            ".SH ENVIRONMENT",
            "LISTEN_FDNAMES",
            ".SH FILES",
        ] {
            assert!(top.contains(s), "{s} missing:\n{top}");
        }
        assert!(top.find(".SH FILES") < top.find(".SH VERSION"), "{top}");
        let attach = std::fs::read_to_string(dir.path().join("loopd-attach.1")).expect("page");
        assert!(attach.contains("name"), "{attach}");
        assert!(!attach.contains("secret"), "{attach}");
    }
}
