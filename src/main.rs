//! The `loopd` command line. Subcommands only; the work is in the library.

mod cli;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use cli::print::Sizes;
use cli::{Cache, DeviceArgs};
use loopd::control::client;
use loopd::control::proto::{Request, SetSpec};
use loopd::server;
use std::path::PathBuf;

/// A userspace loop device: serves disk-image files as block devices over NBD,
/// with direct, asynchronous I/O (io_uring). `loopd serve` runs the server; the
/// other commands talk to a running server over its control socket.
#[derive(Parser)]
#[command(name = "loopd", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Subcommands. Their arguments are deferred (`Command::defer`): a run builds
/// the one it uses (`loopd attach` pays for attach's options, not serve's
/// eighty), while each one's name and doc stay eager for `loopd --help`.
/// Command-level text belongs on the variants: a doc comment on an `Args`
/// struct would be applied after the variant's and replace it.
#[derive(Subcommand)]
#[command(defer = true)]
enum Cmd {
    /// Run the server until Ctrl-C/SIGTERM (in the background with --fork): serve
    /// IMAGE (if given), the devices of --config and of the state file, and any
    /// attached later. SIGHUP re-reads --config and the TLS certificates.
    Serve(Box<cli::serve::ServeArgs>),
    /// Attach an image (or several, in one durable step) as new devices of a
    /// running server; prints each one's name and URIs.
    Attach(AttachArgs),
    /// Remove devices (one or several). Refuses while clients are connected
    /// unless --force.
    Detach(DetachArgs),
    /// List devices, like `losetup --list`.
    List(ListArgs),
    /// Show a device's configuration and live counters.
    Status(StatusArgs),
    /// Change a device's configuration while it serves.
    Set(SetArgs),
    /// Re-read the backing file's size (like `losetup --set-capacity`).
    Resize(ResizeArgs),
    /// Re-read the server's TLS certificates (as SIGHUP does): new connections
    /// use the new ones; on error the old ones stay in use.
    ReloadTls(ReloadTlsArgs),
    /// Re-read the TLS certificates and the --config file (as SIGHUP does):
    /// attach new devices, apply changes, report what needs a detach and attach.
    Reload(ReloadArgs),
    /// Kernel loop devices (/dev/loopN), set up in one LOOP_CONFIGURE call.
    #[command(subcommand)]
    Kernel(cli::kernel::KernelCmd),
    /// Print a shell completion script, e.g. `loopd completions bash >
    /// /usr/share/bash-completion/completions/loopd`.
    Completions(CompletionsArgs),
    /// Write the man pages into a directory: loopd.1, one per subcommand
    /// (loopd-attach.1, ...) and loopd.toml.5 (the --config file).
    Man(ManArgs),
}

#[derive(clap::Args)]
struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(clap::Args)]
struct ManArgs {
    /// Directory to write the pages into (created if missing).
    #[arg(long, value_name = "DIR")]
    out_dir: PathBuf,
}

// Where client commands find the server. (A plain comment: a doc comment on
// a flattened struct would become the `about` of each subcommand using it,
// as deferred arguments are added after the variant's own doc.)
#[derive(clap::Args)]
struct ControlArg {
    /// The server's control socket [default: $LOOPD_CONTROL, else the default
    /// socket directory's loopd.ctl].
    #[arg(long, value_name = "PATH", env = "LOOPD_CONTROL")]
    control: Option<PathBuf>,
}

impl ControlArg {
    fn path(&self) -> PathBuf {
        self.control
            .clone()
            .unwrap_or_else(|| server::default_socket_dir().join("loopd.ctl"))
    }
}

#[derive(clap::Args)]
struct AttachArgs {
    /// The image file (or block device), or an RBD image
    /// `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]` (see --ceph-conf, --ceph-id).
    /// Several images are attached in one request with one durable write
    /// (the options apply to each; --name only with one): each succeeds or
    /// fails on its own, a failure prints one error line naming its image,
    /// and the exit status is the first failure's.
    #[arg(value_name = "IMAGE", required_unless_present = "from")]
    images: Vec<PathBuf>,
    /// Also attach the images listed in FILE (`-`: stdin), one path per line
    /// (blank lines and lines starting with # skipped), like the images given
    /// as arguments, in the same request.
    #[arg(long, value_name = "FILE|-")]
    from: Option<PathBuf>,
    #[command(flatten)]
    dev: DeviceArgs,
    /// Remove the device when its last client disconnects.
    #[arg(long)]
    autoclear: bool,
    /// Print the result as JSON.
    #[arg(long, short = 'J')]
    json: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct DetachArgs {
    /// Device names. Each is detached on its own, in order (one request
    /// each): each success prints `detached NAME`, each failure one error
    /// line naming it, and the exit status is the first failure's. With
    /// several names --json prints one array, an object per name.
    #[arg(value_name = "NAME", required = true)]
    names: Vec<String>,
    /// Detach even with clients connected: their sockets are shut down and their
    /// file I/O in flight cancelled; the command returns once they are gone (or
    /// says how many still wait for a backing file that does not answer, after 5 s).
    #[arg(long)]
    force: bool,
    /// Print the result as JSON.
    #[arg(long, short = 'J')]
    json: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct ListArgs {
    /// Print JSON instead of a table.
    #[arg(long, short = 'J')]
    json: bool,
    /// Print sizes as plain byte counts (for scripts), not in human units.
    #[arg(long)]
    bytes: bool,
    /// The devices' names only, one a line (for the completion scripts).
    #[arg(long, hide = true, conflicts_with = "json")]
    names: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct StatusArgs {
    /// Device name (without one: every device, one row each).
    name: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, short = 'J')]
    json: bool,
    /// Print sizes as plain byte counts (for scripts), not in human units.
    #[arg(long)]
    bytes: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct SetArgs {
    /// Device name.
    name: String,
    /// New size of the window, in bytes (K/M/G/T), or `none` (or 0) to remove
    /// the limit (the window then reaches the end of the file). Shrinking the
    /// device needs --force while clients are connected.
    #[arg(long, visible_alias = "sizelimit", value_name = "BYTES|none", value_parser = cli::parse_limit)]
    size_limit: Option<cli::Limit>,
    /// New start of the window in the file (clients cannot follow: needs --force
    /// while clients are connected).
    #[arg(long, short = 'o', value_name = "BYTES", value_parser = loopd::size::parse_size)]
    offset: Option<u64>,
    /// New logical block size (clients cannot follow: needs --force while
    /// clients are connected).
    #[arg(
        long,
        short = 'b',
        visible_alias = "sector-size",
        value_name = "BYTES",
        value_parser = loopd::size::parse_block_size
    )]
    block_size: Option<u32>,
    /// New cache mode.
    #[arg(long, value_enum)]
    cache: Option<Cache>,
    /// Make the device read-only (true, or -r alone) or writable (false);
    /// turning it on needs --force while clients are connected.
    #[arg(long, short = 'r', value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    read_only: Option<bool>,
    /// Apply changes connected clients cannot follow (offset, block size, a
    /// smaller size, read-only on).
    #[arg(long)]
    force: bool,
    /// Print the result as JSON.
    #[arg(long, short = 'J')]
    json: bool,
    /// Print sizes as plain byte counts (for scripts), not in human units.
    #[arg(long)]
    bytes: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct ResizeArgs {
    /// Device name.
    name: String,
    /// Print the result as JSON.
    #[arg(long, short = 'J')]
    json: bool,
    /// Print sizes as plain byte counts (for scripts), not in human units.
    #[arg(long)]
    bytes: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct ReloadTlsArgs {
    /// Print the result as JSON.
    #[arg(long, short = 'J')]
    json: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(clap::Args)]
struct ReloadArgs {
    /// Print the report as JSON.
    #[arg(long, short = 'J')]
    json: bool,
    /// Print sizes as plain byte counts (for scripts), not in human units.
    #[arg(long)]
    bytes: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

/// The command line definition, with the exit status table after `--help`.
fn command() -> clap::Command {
    Cli::command().after_help(cli::exit::help_text())
}

fn main() -> std::process::ExitCode {
    // Client commands die quietly on a closed pipe (`loopd list | head -1`),
    // like other Unix tools; `serve` goes back to ignoring SIGPIPE.
    cli::exit::default_sigpipe();
    let m = match command().try_get_matches() {
        Ok(m) => m,
        Err(e) => return cli::exit::usage(e),
    };
    let json = cli::exit::wants_json(&m);
    let outcome = Cli::from_arg_matches(&m)
        .map_err(anyhow::Error::from)
        .and_then(run);
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => std::process::ExitCode::from(cli::exit::report(&e, json)),
    }
}

fn run(cli: Cli) -> Result<()> {
    // Only the server and `kernel` log; the client commands print their
    // result or error and nothing else, so they skip setting up the log
    // (one process start, like losetup, and no more).
    if matches!(cli.cmd, Cmd::Serve(_) | Cmd::Kernel(_)) {
        cli::log::init();
    }
    match cli.cmd {
        Cmd::Serve(a) => {
            cli::exit::ignore_sigpipe();
            cli::serve::serve(*a)
        }
        Cmd::Attach(a) => cli::attach::run(
            &a.ctl.path(),
            a.images,
            a.from.as_deref(),
            &a.dev,
            a.autoclear,
            a.json,
        ),
        Cmd::Detach(a) => cli::detach::run(&a.ctl.path(), &a.names, a.force, a.json),
        Cmd::List(a) if a.names => {
            cli::complete_names::print_names(&call(&a.ctl, &Request::List)?);
            Ok(())
        }
        Cmd::List(a) => cli::print_list(
            &call(&a.ctl, &Request::List)?,
            a.json,
            Sizes { bytes: a.bytes },
        ),
        Cmd::Status(a) => {
            let all = a.name.is_none();
            let v = call(&a.ctl, &Request::Status { name: a.name })?;
            if all {
                cli::print_status_all(&v, a.json, Sizes { bytes: a.bytes })
            } else {
                cli::print_status(&v, a.json, Sizes { bytes: a.bytes })
            }
        }
        Cmd::Set(a) => {
            let s = SetSpec {
                name: a.name,
                size_limit: a.size_limit.map(|l| l.0),
                offset: a.offset,
                block_size: a.block_size,
                cache: a.cache.map(Into::into),
                read_only: a.read_only,
                force: a.force,
            };
            cli::print_set(
                &call(&a.ctl, &Request::Set(s))?,
                a.json,
                Sizes { bytes: a.bytes },
            )
        }
        Cmd::Resize(a) => cli::print_set(
            &call(&a.ctl, &Request::Resize { name: a.name })?,
            a.json,
            Sizes { bytes: a.bytes },
        ),
        Cmd::ReloadTls(a) => {
            let v = call(&a.ctl, &Request::ReloadTls)?;
            cli::print_done(&v, a.json, "TLS certificates reloaded")
        }
        Cmd::Reload(a) => cli::reload::print(
            &call(&a.ctl, &Request::Reload)?,
            a.json,
            Sizes { bytes: a.bytes },
        ),
        Cmd::Kernel(k) => cli::kernel::run(k),
        Cmd::Completions(a) => {
            let script = cli::generate::completions(&Cli::command(), a.shell);
            std::io::Write::write_all(&mut std::io::stdout().lock(), &script)?;
            Ok(())
        }
        Cmd::Man(a) => {
            for p in cli::generate::man_pages(&Cli::command(), &a.out_dir, cli::exit::STATUSES)? {
                println!("{}", p.display());
            }
            Ok(())
        }
    }
}

/// Send a control request; a daemon error becomes this command's error.
fn call(ctl: &ControlArg, req: &Request) -> Result<serde_json::Value> {
    match client::call(&ctl.path(), req)? {
        Ok(v) => Ok(v),
        Err(e) => Err(cli::exit::DaemonError(e).into()),
    }
}

#[cfg(test)]
mod tests {
    //! The deferred command tree (`defer = true`) against the fully built
    //! one: same help, errors and matches for every subcommand, each
    //! subcommand's text its variant's, completions with every option.

    use super::*;
    use clap::Command;

    fn full() -> Command {
        let mut c = command();
        c.build();
        c
    }

    /// Every subcommand's path (`["kernel", "attach"]`), hidden ones too, but
    /// not clap's own `help`.
    fn paths(cmd: &Command, prefix: &[String], out: &mut Vec<Vec<String>>) {
        for s in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            let mut p = prefix.to_vec();
            p.push(s.get_name().to_owned());
            out.push(p.clone());
            paths(s, &p, out);
        }
    }

    fn all_paths() -> Vec<Vec<String>> {
        let mut out = vec![vec![]];
        paths(&full(), &[], &mut out);
        out
    }

    /// What a parse shows a user: the matches, or the error's kind, its
    /// text (help, usage, message) and where it goes.
    fn outcome(r: Result<clap::ArgMatches, clap::Error>) -> String {
        match r {
            Ok(m) => format!("ok {m:?}"),
            Err(e) => format!(
                "{:?} stderr={} exit={}\n{}",
                e.kind(),
                e.use_stderr(),
                e.exit_code(),
                e.render().ansi()
            ),
        }
    }

    #[test]
    fn deferred_tree_parses_like_the_full_tree() {
        let paths = all_paths();
        assert!(paths.len() > 12, "{paths:?}");
        let mut argvs: Vec<Vec<String>> = Vec::new();
        for p in &paths {
            for tail in [
                &["--help"][..],
                &["-h"],
                &["--version"],
                &[],
                &["--no-such-option"],
                &["--json", "--no-such-option"],
                &["x", "y", "z", "w"],
                &["--control"],
                &["--cache", "nonsense", "img"],
                &["--json", "--name", "n", "img"],
            ] {
                argvs.push(
                    p.iter()
                        .cloned()
                        .chain(tail.iter().map(|s| s.to_string()))
                        .collect(),
                );
            }
            argvs.push(
                ["help".to_owned()]
                    .into_iter()
                    .chain(p.iter().cloned())
                    .collect(),
            );
        }
        argvs.push(vec!["attac".into()]);
        argvs.push(vec!["attach".into(), "--hel".into()]);
        for a in &argvs {
            let argv = || std::iter::once("loopd".to_owned()).chain(a.iter().cloned());
            let lazy = outcome(command().try_get_matches_from(argv()));
            let eager = outcome(full().try_get_matches_from(argv()));
            assert_eq!(lazy, eager, "loopd {}", a.join(" "));
        }
    }

    /// The text a command shows of itself, as its parent's variant set it.
    fn own_text(c: &Command) -> Vec<String> {
        let s = |t: Option<&clap::builder::StyledStr>| t.map(|t| t.to_string()).unwrap_or_default();
        vec![
            s(c.get_about()),
            s(c.get_long_about()),
            s(c.get_before_help()),
            s(c.get_before_long_help()),
            s(c.get_after_help()),
            s(c.get_after_long_help()),
            format!("{:?}", c.get_all_aliases().collect::<Vec<_>>()),
            format!("hide={}", c.is_hide_set()),
        ]
    }

    /// Building a subcommand (adding its deferred arguments) must not change
    /// its about, help texts or aliases, which `loopd --help` shows unbuilt.
    fn check_own_text(cmd: &Command, path: &str) {
        let mut c = cmd.clone();
        // Builds this command alone: its deferred part registers its
        // subcommands, theirs stays deferred.
        let _ = c.render_help();
        for s in c.get_subcommands().filter(|s| s.get_name() != "help") {
            let name = format!("{path} {}", s.get_name());
            let mut built = s.clone();
            built.build();
            assert_eq!(own_text(s), own_text(&built), "{name}");
            assert!(!own_text(s)[0].is_empty(), "{name} has no about");
            check_own_text(s, &name);
        }
    }

    #[test]
    fn each_subcommand_keeps_its_variants_text_once_built() {
        check_own_text(&command(), "loopd");
    }

    /// Every subcommand (built) with its path, e.g. `"kernel attach"`.
    fn each_command(cmd: &Command, path: &str, out: &mut Vec<(String, Command)>) {
        for s in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            let name = format!("{path} {}", s.get_name()).trim().to_owned();
            out.push((name.clone(), s.clone()));
            each_command(s, &name, out);
        }
    }

    fn commands() -> Vec<(String, Command)> {
        let mut out = Vec::new();
        each_command(&full(), "", &mut out);
        out
    }

    /// `list -J` but not `status -J` was a surprise: every `--json` is `-J` too.
    #[test]
    fn every_json_option_is_also_short_j() {
        let mut n = 0;
        for (name, c) in commands() {
            for a in c.get_arguments().filter(|a| a.get_long() == Some("json")) {
                assert_eq!(a.get_short(), Some('J'), "loopd {name} --json has no -J");
                n += 1;
            }
        }
        assert!(n >= 11, "only {n} --json options");
    }

    /// `-f` has one meaning per command: losetup's (`--find`) on `kernel
    /// attach`, which mimics losetup, and qemu-nbd's (`--format`) elsewhere;
    /// where `-f` is find, `--format` has no short spelling.
    #[test]
    fn short_f_means_one_thing_per_command() {
        let mut seen = Vec::new();
        for (name, c) in commands() {
            let f: Vec<&str> = c
                .get_arguments()
                .filter(|a| {
                    a.get_short() == Some('f')
                        || a.get_all_short_aliases().is_some_and(|s| s.contains(&'f'))
                })
                .map(|a| a.get_id().as_str())
                .collect();
            let want: &[&str] = match name.as_str() {
                "kernel attach" => &["find"],
                _ if c.get_arguments().any(|a| a.get_id() == "format") => &["format"],
                _ => &[],
            };
            assert_eq!(f, want, "loopd {name} -f");
            if !f.is_empty() {
                seen.push(name);
            }
        }
        assert_eq!(seen, ["serve", "attach", "kernel attach"]);
    }

    /// Every man page's examples parse as the command line they show (up to
    /// a `|` or `>` handing over to another program), and every visible
    /// page has some.
    #[test]
    fn every_example_parses_and_every_page_has_some() {
        let mut n = 0;
        for (path, list) in cli::examples::EXAMPLES {
            for e in *list {
                let argv: Vec<&str> = e
                    .command
                    .split_whitespace()
                    .take_while(|w| !matches!(*w, "|" | ">"))
                    .collect();
                assert_eq!(argv.first(), Some(&"loopd"), "{}", e.command);
                let r = command().try_get_matches_from(&argv);
                assert!(r.is_ok(), "{path:?}: {} does not parse: {r:?}", e.command);
                n += 1;
            }
        }
        assert!(n > 30, "only {n} examples");
        for p in all_paths() {
            let mut c = full();
            let mut hidden = false;
            for name in &p {
                c = c.find_subcommand(name).cloned().expect("subcommand");
                hidden |= c.is_hide_set();
            }
            if !hidden {
                assert!(
                    !cli::examples::for_path(&p.join(" ")).is_empty(),
                    "the page of {p:?} has no examples"
                );
            }
        }
    }

    #[test]
    fn completions_offer_every_deferred_option() {
        let script = String::from_utf8(cli::generate::completions(
            &command(),
            clap_complete::Shell::Fish,
        ))
        .expect("utf-8");
        let mut checked = 0;
        for p in all_paths().iter().filter(|p| !p.is_empty()) {
            let mut c = full();
            let mut hidden = false;
            for n in p {
                let Some(s) = c.find_subcommand(n).cloned() else {
                    panic!("{p:?}")
                };
                hidden |= s.is_hide_set();
                c = s;
            }
            if hidden {
                continue;
            }
            let leaf = p.last().expect("non-empty");
            // Not clap's own --help and --version (built into every subcommand).
            let own = |a: &&clap::Arg| !matches!(a.get_id().as_str(), "help" | "version");
            for a in c.get_arguments().filter(|a| !a.is_hide_set()).filter(own) {
                let Some(long) = a.get_long() else { continue };
                let line = format!("-l {long}");
                assert!(
                    script
                        .lines()
                        .any(|l| l.contains(&line) && l.contains(leaf.as_str())),
                    "{p:?} --{long} missing:\n{script}"
                );
                checked += 1;
            }
        }
        assert!(checked > 60, "only {checked} options checked");
    }
}
