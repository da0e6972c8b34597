//! loopd as a service: socket activation (`systemd-socket-activate`), readiness
//! and stopping notifications (`NOTIFY_SOCKET`), SIGHUP and `loopd reload`
//! re-reading --config, --pid-file, --fork, clean failure at start, socket
//! clashes, `--listen :PORT`.

mod common;

use common::*;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const START: Duration = Duration::from_secs(20);

/// A `loopd serve` (or a wrapper that execs it) run by the test: stdout lines
/// arrive on a channel, stderr is collected; killed on drop.
struct Proc {
    child: Child,
    lines: Receiver<String>,
    stderr: Arc<Mutex<Vec<u8>>>,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        cmd.env("PATH", tool_path_env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start loopd");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let buf = Arc::clone(&stderr);
        let mut err = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = err.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                buf.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Proc {
            child,
            lines,
            stderr,
        }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    /// Wait for a stdout line starting with `prefix`.
    fn wait_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + START;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(_) => panic!(
                    "no line starting with {prefix:?} from loopd; stderr:\n{}",
                    self.stderr()
                ),
            }
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(self.pid(), sig) };
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Wait (bounded) for the process to exit.
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + START;
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                // Let the stderr reader catch up.
                std::thread::sleep(Duration::from_millis(100));
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "loopd did not exit; stderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self) {
        self.signal(libc::SIGTERM);
        let st = self.wait_exit();
        assert!(
            st.success(),
            "loopd exited {st}; stderr:\n{}",
            self.stderr()
        );
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.alive() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A process the test does not own as a child (--fork's daemon): killed by pid
/// on drop if still alive.
struct PidGuard(i32);

impl PidGuard {
    fn alive(&self) -> bool {
        // SAFETY: kill(2) with signal 0 only checks the process exists.
        unsafe { libc::kill(self.0, 0) == 0 }
    }
}

impl Drop for PidGuard {
    fn drop(&mut self) {
        if self.alive() {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

fn loopd() -> Command {
    Command::new(loopd_bin())
}

fn unix_uri(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

fn nbd_size(uri: &str) -> u64 {
    let out = run("nbdinfo", ["--size", uri]);
    out.stdout
        .trim()
        .parse()
        .expect("nbdinfo --size prints a number")
}

fn ctl(control: &Path, args: &[&str]) -> Out {
    let mut c = loopd();
    c.args(args).arg("--control").arg(control);
    run_cmd_timeout(c, TOOL_TIMEOUT)
}

fn list_names(control: &Path) -> Vec<String> {
    let out = ctl(control, &["list", "--json"]).assert_success();
    Json::parse(&out.stdout)
        .arr()
        .iter()
        .map(|d| d.at("name").str().to_owned())
        .collect()
}

fn activate(dir: &Path, sockets: &[&Path], fdnames: &str, serve: &[&str]) -> Proc {
    let mut c = Command::new(require_tool("systemd-socket-activate"));
    for s in sockets {
        c.arg("-l").arg(s);
    }
    c.arg(format!("--fdname={fdnames}"))
        .arg(loopd_bin())
        .arg("serve");
    c.args(serve).arg("--state").arg(dir.join("st.state"));
    let p = Proc::spawn(c);
    // systemd-socket-activate binds, then execs loopd at the first connection.
    let deadline = Instant::now() + START;
    while !sockets.iter().all(|s| s.exists()) {
        assert!(
            Instant::now() < deadline,
            "systemd-socket-activate did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    p
}

/// Both sockets come from systemd: nbdinfo reads the export through the
/// activated NBD socket, `loopd list` works on the activated control socket,
/// and the socket files (systemd's) stay after loopd exits.
#[test]
fn socket_activation_nbd_and_control() {
    let dir = tempdir();
    let img = dir.path().join("img.img");
    create_sparse_image(&img, 4 * MIB);
    let nbd = dir.path().join("sa.sock");
    let control = dir.path().join("ctl.sock");
    let mut p = activate(
        dir.path(),
        &[&nbd, &control],
        "nbd:control",
        &[img.to_str().unwrap()],
    );
    assert_eq!(nbd_size(&unix_uri(&nbd)), 4 * MIB);
    p.wait_line("control:");
    assert_eq!(list_names(&control), ["img"]);
    p.stop();
    let err = p.stderr();
    assert!(err.contains("socket activation"), "{err}");
    assert!(nbd.exists(), "the activated NBD socket was removed");
    assert!(control.exists(), "the activated control socket was removed");
}

/// Only the NBD socket is activated: the control socket is made beside it
/// (extension .ctl) and removed at exit; the activated one stays.
#[test]
fn socket_activation_control_beside_nbd_socket() {
    let dir = tempdir();
    let img = dir.path().join("d.img");
    create_sparse_image(&img, 2 * MIB);
    let nbd = dir.path().join("sa.sock");
    let mut p = activate(dir.path(), &[&nbd], "nbd", &[img.to_str().unwrap()]);
    assert_eq!(nbd_size(&unix_uri(&nbd)), 2 * MIB);
    let line = p.wait_line("control:");
    let control = dir.path().join("sa.ctl");
    assert_eq!(line, format!("control: {}", control.display()));
    assert_eq!(list_names(&control), ["d"]);
    p.stop();
    assert!(nbd.exists(), "the activated NBD socket was removed");
    assert!(
        !control.exists(),
        "loopd's own control socket was left behind"
    );
}

/// Activated NBD sockets with --socket, or an activated control socket with
/// --control, are refused naming the option; an unknown fd name is refused.
#[test]
fn socket_activation_conflicts_name_the_option() {
    let dir = tempdir();
    let img = dir.path().join("c.img");
    create_sparse_image(&img, MIB);
    let img = img.to_str().unwrap();
    let other = dir.path().join("other.sock");
    let other = other.to_str().unwrap();
    for (fdname, extra, want) in [
        ("nbd", ["--socket", other], "drop --socket"),
        ("control", ["--control", other], "drop --control"),
        ("metrics", ["--name", "x"], "named \"metrics\""),
    ] {
        let sock = dir.path().join(format!("{fdname}.sock"));
        let mut args = vec![img];
        args.extend(extra);
        let mut p = activate(dir.path(), &[&sock], fdname, &args);
        // The first connection makes systemd-socket-activate exec loopd.
        let _c = UnixStream::connect(&sock).expect("connect");
        let st = p.wait_exit();
        assert!(!st.success(), "{fdname}: loopd started");
        let err = p.stderr();
        assert!(err.contains(want), "{fdname}: {err}");
    }
}

/// READY=1 comes once the socket accepts (with MAINPID and a status), SIGHUP
/// gives RELOADING=1 then READY=1, SIGTERM gives STOPPING=1.
#[test]
fn notify_ready_reloading_and_stopping() {
    let dir = tempdir();
    let img = dir.path().join("n.img");
    create_sparse_image(&img, MIB);
    let sock = dir.path().join("n.sock");
    let notify = dir.path().join("notify.sock");
    let rx = UnixDatagram::bind(&notify).expect("bind the notify socket");
    rx.set_read_timeout(Some(START)).unwrap();
    let recv = || {
        let mut buf = [0u8; 4096];
        let n = rx.recv(&mut buf).expect("a notification within 20 s");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let mut c = loopd();
    c.arg("serve")
        .arg(&img)
        .arg("--socket")
        .arg(&sock)
        .arg("--state")
        .arg(dir.path().join("n.state"))
        .env("NOTIFY_SOCKET", &notify);
    let mut p = Proc::spawn(c);
    let ready = recv();
    // Connectable the moment READY=1 is read.
    UnixStream::connect(&sock).expect("the socket accepts once READY=1 is sent");
    assert_eq!(nbd_size(&unix_uri(&sock)), MIB);
    assert!(ready.starts_with("READY=1\n"), "{ready:?}");
    assert!(ready.contains(&format!("MAINPID={}", p.pid())), "{ready:?}");
    assert!(ready.contains("STATUS=serving 1 devices"), "{ready:?}");

    p.signal(libc::SIGHUP);
    let reloading = recv();
    assert!(
        reloading.starts_with("RELOADING=1\nMONOTONIC_USEC="),
        "{reloading:?}"
    );
    assert!(recv().starts_with("READY=1"), "no READY=1 after the reload");
    assert!(p.alive(), "SIGHUP stopped the daemon");

    p.signal(libc::SIGTERM);
    assert_eq!(recv(), "STOPPING=1");
    let st = p.wait_exit();
    assert!(st.success(), "{}", p.stderr());
}

fn write_config(path: &Path, devices: &[(&str, &str)]) {
    let mut s = String::new();
    for (image, extra) in devices {
        s.push_str(&format!("[[device]]\nimage = \"{image}\"\n{extra}\n"));
    }
    std::fs::write(path, s).unwrap();
}

fn serve_with_config(dir: &Path, config: &Path) -> (Proc, PathBuf) {
    let sock = dir.join("cfg.sock");
    let mut c = loopd();
    c.arg("serve")
        .arg("--socket")
        .arg(&sock)
        .arg("--config")
        .arg(config)
        .arg("--state")
        .arg(dir.join("cfg.state"));
    let mut p = Proc::spawn(c);
    let line = p.wait_line("control:");
    (p, PathBuf::from(line.trim_start_matches("control: ")))
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + START;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGHUP keeps the daemon, attaches a device new in the config, applies a
/// live change (read_only), and keeps a device gone from the file with a
/// warning.
#[test]
fn sighup_reloads_config() {
    let dir = tempdir();
    for n in ["a", "b", "c"] {
        create_sparse_image(&dir.path().join(format!("{n}.img")), MIB);
    }
    let cfg = dir.path().join("devices.toml");
    write_config(&cfg, &[("a.img", ""), ("b.img", "")]);
    let (mut p, control) = serve_with_config(dir.path(), &cfg);
    assert_eq!(list_names(&control), ["a", "b"]);

    write_config(&cfg, &[("a.img", "read_only = true"), ("c.img", "")]);
    p.signal(libc::SIGHUP);
    wait_for("device c after SIGHUP", || {
        list_names(&control).contains(&"c".to_owned())
    });
    assert!(p.alive(), "SIGHUP stopped the daemon");
    assert_eq!(list_names(&control), ["a", "b", "c"]);
    let out = ctl(&control, &["status", "a", "--json"]).assert_success();
    assert!(
        Json::parse(&out.stdout).at("read_only").bool(),
        "read_only not applied: {}",
        out.stdout
    );
    wait_for("the summary line", || p.stderr().contains("reload of"));
    let err = p.stderr();
    assert!(
        err.contains("device \"b\" is no longer in the config file; it stays attached"),
        "{err}"
    );
    assert!(
        err.contains("1 attached, 1 changed, 0 unchanged, 0 not applied, 1 kept"),
        "{err}"
    );
    // Its data path still works.
    assert_eq!(
        nbd_size(&format!(
            "nbd+unix:///c?socket={}",
            dir.path().join("cfg.sock").display()
        )),
        MIB
    );
    p.stop();
}

/// `loopd reload` prints the report: applied, not applied (with what to do);
/// `--json` has the same; a config that no longer parses changes nothing and
/// fails with the parse error.
#[test]
fn reload_command_prints_the_report() {
    let dir = tempdir();
    for n in ["a", "b"] {
        create_sparse_image(&dir.path().join(format!("{n}.img")), MIB);
    }
    let cfg = dir.path().join("devices.toml");
    write_config(&cfg, &[("a.img", "")]);
    let (mut p, control) = serve_with_config(dir.path(), &cfg);

    write_config(
        &cfg,
        &[
            ("a.img", "cache = \"buffered\"\nshared = true"),
            ("b.img", ""),
        ],
    );
    let out = ctl(&control, &["reload"]).assert_success();
    assert!(out.stdout.contains("attached: b"), "{out}");
    assert!(out.stdout.contains("changed: a"), "{out}");
    assert!(
        out.stdout
            .contains("not applied: a: shared changed: detach and attach it to apply"),
        "{out}"
    );
    // Not applied is reported again until it is.
    let out = ctl(&control, &["reload", "--json"]).assert_success();
    let j = Json::parse(&out.stdout);
    assert_eq!(j.at("not_applied").arr().len(), 1, "{out}");
    assert_eq!(j.at("not_applied").arr()[0].at("name").str(), "a");
    assert_eq!(j.at("unchanged").arr()[0].str(), "b", "{out}");
    assert_eq!(j.at("tls").str(), "off");

    // A device that cannot be attached: reported, and the command fails.
    write_config(&cfg, &[("a.img", ""), ("b.img", ""), ("gone.img", "")]);
    let out = ctl(&control, &["reload"]);
    assert!(!out.success(), "{out}");
    assert!(out.stdout.contains("failed: gone: cannot attach"), "{out}");
    assert!(
        out.stderr
            .contains("the reload could not attach or change 1 device(s)"),
        "{out}"
    );

    let out = ctl(&control, &["reload", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{out}");
    let j = Json::parse(&out.stdout);
    assert_eq!(j.at("failed").arr()[0].at("name").str(), "gone", "{out}");

    std::fs::write(&cfg, "[[device]\nimage = ").unwrap();
    let out = ctl(&control, &["reload"]);
    assert!(!out.success(), "{out}");
    assert!(
        out.stderr.contains("not a valid config file") && out.stderr.contains("nothing changed"),
        "{out}"
    );
    // As it was: `gone` is listed (missing) since the reload that failed it.
    assert_eq!(list_names(&control), ["a", "b", "gone"]);
    assert!(p.alive());
    p.stop();
}

/// --pid-file: written with the daemon's pid once it serves, a second daemon
/// with the same file is refused, removed at exit.
#[test]
fn pid_file_written_refused_and_removed() {
    let dir = tempdir();
    let img = dir.path().join("p.img");
    create_sparse_image(&img, MIB);
    let pidf = dir.path().join("loopd.pid");
    let serve = |name: &str| {
        let mut c = loopd();
        c.arg("serve")
            .arg(&img)
            .arg("--shared")
            .arg("--socket")
            .arg(dir.path().join(format!("{name}.sock")))
            .arg("--state")
            .arg(dir.path().join(format!("{name}.state")))
            .arg("--pid-file")
            .arg(&pidf);
        Proc::spawn(c)
    };
    let mut a = serve("a");
    a.wait_line("control:");
    let text = std::fs::read_to_string(&pidf).expect("pid file");
    assert_eq!(text.trim(), a.pid().to_string());

    let mut b = serve("b");
    let st = b.wait_exit();
    assert!(!st.success());
    let err = b.stderr();
    assert!(
        err.contains("belongs to a running loopd") && err.contains("--pid-file"),
        "{err}"
    );
    assert!(
        !dir.path().join("b.sock").exists(),
        "the refused daemon bound"
    );
    assert_eq!(std::fs::read_to_string(&pidf).unwrap(), text);

    a.stop();
    assert!(!pidf.exists(), "the pid file was left behind");
}

/// --fork returns once the daemon serves; the daemon runs on (found by its pid
/// file) and stops cleanly; a start failure is reported by the command.
#[test]
fn fork_returns_once_serving() {
    let dir = tempdir();
    let img = dir.path().join("f.img");
    create_sparse_image(&img, MIB);
    let sock = dir.path().join("f.sock");
    let pidf = dir.path().join("f.pid");
    let mut c = loopd();
    c.arg("serve")
        .arg(&img)
        .arg("--socket")
        .arg(&sock)
        .arg("--state")
        .arg(dir.path().join("f.state"))
        .arg("--pid-file")
        .arg(&pidf)
        .arg("--fork")
        .stdin(Stdio::null());
    let out = run_cmd_timeout(c, START).assert_success();
    assert!(
        out.stdout.contains(&unix_uri(&sock).replace("///", "///f")),
        "{out}"
    );
    let pid: i32 = std::fs::read_to_string(&pidf)
        .expect("the pid file exists when --fork returns")
        .trim()
        .parse()
        .unwrap();
    let daemon = PidGuard(pid);
    assert!(daemon.alive());
    assert_eq!(nbd_size(&unix_uri(&sock)), MIB);
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    wait_for("the forked daemon to exit", || !daemon.alive());
    wait_for("the pid file to go", || !pidf.exists());
    assert!(!sock.exists());

    // A failure at start: the command says why and exits non-zero.
    let mut c = loopd();
    c.arg("serve")
        .arg(dir.path().join("missing.img"))
        .arg("--socket")
        .arg(&sock)
        .arg("--state")
        .arg(dir.path().join("f.state"))
        .arg("--fork")
        .stdin(Stdio::null());
    let out = run_cmd_timeout(c, START);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("missing.img"), "{out}");
    assert_eq!(
        out.stderr.matches("loopd: error:").count(),
        1,
        "the error is printed once: {out}"
    );
    assert!(!sock.exists());
}

/// A config file with a bad value stops the start and leaves nothing: no
/// socket, no temporary file, no image made by `create` for an earlier
/// device (the whole file is checked before any device is attached).
#[test]
fn start_failure_leaves_nothing_behind() {
    let dir = tempdir();
    let cfg = dir.path().join("devices.toml");
    write_config(
        &cfg,
        &[
            ("new.img", "create = \"1M\""),
            ("bad.img", "block_size = 1000"),
        ],
    );
    let sock = dir.path().join("s.sock");
    let mut c = loopd();
    c.arg("serve")
        .arg("--socket")
        .arg(&sock)
        .arg("--config")
        .arg(&cfg)
        .arg("--state")
        .arg(dir.path().join("s.state"))
        .arg("--pid-file")
        .arg(dir.path().join("s.pid"));
    let out = run_cmd_timeout(c, START);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("block_size 1000"), "{out}");
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "s.state")
        .collect();
    left.sort();
    assert_eq!(left, ["devices.toml"], "left behind: {left:?}");
}

/// A second server on a socket that answers is refused with the option to
/// set, and the first keeps its socket.
#[test]
fn socket_clash_names_the_option() {
    let dir = tempdir();
    let img = dir.path().join("k.img");
    create_sparse_image(&img, MIB);
    let sock = dir.path().join("k.sock");
    let serve = |ctl: &str| {
        let mut c = loopd();
        c.arg("serve")
            .arg(&img)
            .arg("--shared")
            .arg("--socket")
            .arg(&sock)
            .arg("--control")
            .arg(dir.path().join(format!("{ctl}.ctl")))
            .arg("--state")
            .arg(dir.path().join(format!("{ctl}.state")));
        Proc::spawn(c)
    };
    let mut a = serve("a");
    a.wait_line("control:");
    let mut b = serve("b");
    assert!(!b.wait_exit().success());
    let err = b.stderr();
    assert!(
        err.contains(&format!(
            "{} is in use by another server; stop it, or pass --socket PATH",
            sock.display()
        )),
        "{err}"
    );
    assert!(!dir.path().join("b.ctl").exists());
    assert_eq!(nbd_size(&unix_uri(&sock)), MIB);
    a.stop();
}

/// `--listen :PORT` listens on every address, so 127.0.0.1 reaches it; the
/// URI it prints is that loopback one (a client can use it, 0.0.0.0 names no
/// host), and a line says where it binds (issue 27).
#[test]
fn listen_colon_port_reaches_loopback() {
    let dir = tempdir();
    let img = dir.path().join("l.img");
    create_sparse_image(&img, MIB);
    let port = free_port();
    let mut c = loopd();
    c.arg("serve")
        .arg(&img)
        .arg("--listen")
        .arg(format!(":{port}"))
        .arg("--control")
        .arg(dir.path().join("l.ctl"))
        .arg("--state")
        .arg(dir.path().join("l.state"));
    let mut p = Proc::spawn(c);
    let uri = p.wait_line("nbd://");
    assert_eq!(uri, format!("nbd://127.0.0.1:{port}/l"));
    let bound = p.wait_line("listening on");
    assert!(
        bound.starts_with(&format!("listening on 0.0.0.0:{port} (every IPv4 address")),
        "{bound}"
    );
    assert_eq!(nbd_size(&uri), MIB);
    p.stop();
}

/// An activated TCP socket is an NBD listener too; `NOTIFY_SOCKET` may name
/// an abstract socket (`@name`).
#[test]
fn socket_activation_tcp_and_abstract_notify() {
    use std::os::linux::net::SocketAddrExt;
    let dir = tempdir();
    let img = dir.path().join("t.img");
    create_sparse_image(&img, 3 * MIB);
    let name = format!("loopd-test-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let rx = UnixDatagram::bind_addr(&addr).expect("bind an abstract datagram socket");
    rx.set_read_timeout(Some(START)).unwrap();
    let port = free_port();
    let mut c = Command::new(require_tool("systemd-socket-activate"));
    c.arg("-l")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--fdname=nbd")
        .arg(format!("--setenv=NOTIFY_SOCKET=@{name}"))
        .arg(loopd_bin())
        .arg("serve")
        .arg(&img)
        .arg("--control")
        .arg(dir.path().join("t.ctl"))
        .arg("--state")
        .arg(dir.path().join("t.state"));
    let mut p = Proc::spawn(c);
    let uri = format!("nbd://127.0.0.1:{port}/");
    let deadline = Instant::now() + START;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "systemd-socket-activate did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(nbd_size(&uri), 3 * MIB);
    assert_eq!(p.wait_line("nbd://"), format!("nbd://127.0.0.1:{port}/t"));
    let mut buf = [0u8; 4096];
    let n = rx.recv(&mut buf).expect("READY=1 on the abstract socket");
    assert!(buf[..n].starts_with(b"READY=1\n"));
    p.stop();
}

/// Two servers on every default path (as an unprivileged user, whose defaults
/// live under $XDG_RUNTIME_DIR and $XDG_STATE_HOME): the second is refused
/// with the option to set, and the first keeps serving.
#[test]
fn default_path_clash_names_the_option() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempdir();
    let uid = 65534u32; // nobody
    let chown = |p: &Path| {
        std::os::unix::fs::chown(p, Some(uid), Some(uid)).expect("chown to nobody");
    };
    chown(dir.path());
    let runtime = dir.path().join("run");
    let state = dir.path().join("state");
    for d in [&runtime, &state] {
        std::fs::create_dir(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
        chown(d);
    }
    let img = dir.path().join("def.img");
    create_sparse_image(&img, MIB);
    chown(&img);
    let serve = || {
        let mut c = Command::new(require_tool("setpriv"));
        c.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(loopd_bin())
        .arg("serve")
        .arg(&img)
        .arg("--shared")
        .env("XDG_RUNTIME_DIR", &runtime)
        .env("XDG_STATE_HOME", &state);
        Proc::spawn(c)
    };
    let mut a = serve();
    let sock = runtime.join("loopd/loopd.sock");
    assert_eq!(
        a.wait_line("nbd+unix://"),
        format!("nbd+unix:///def?socket={}", sock.display())
    );
    let mut b = serve();
    assert!(!b.wait_exit().success());
    let err = b.stderr();
    assert!(
        err.contains(&format!("{} is in use by another server", sock.display()))
            && err.contains("pass --socket PATH (and --control/--state) to run a second one"),
        "{err}"
    );
    assert_eq!(nbd_size(&unix_uri(&sock)), MIB);
    a.stop();
    assert!(!sock.exists());
}

/// A reload with a client connected: removing a size limit (growing the device)
/// is applied live; read-only on is not (the client cannot follow it, and a
/// reload never forces), is reported, and applies at the next reload once the
/// client is gone.
#[test]
fn reload_with_a_client_connected() {
    let dir = tempdir();
    create_sparse_image(&dir.path().join("a.img"), 2 * MIB);
    let cfg = dir.path().join("devices.toml");
    write_config(&cfg, &[("a.img", "size_limit = \"1M\"")]);
    let (mut p, control) = serve_with_config(dir.path(), &cfg);
    let (client, size, _) = RawClient::handshake(&dir.path().join("cfg.sock"), "a");
    assert_eq!(size, MIB);

    write_config(&cfg, &[("a.img", "")]);
    let out = ctl(&control, &["reload", "--json"]).assert_success();
    let j = Json::parse(&out.stdout);
    assert_eq!(j.at("changed").arr()[0].str(), "a", "{out}");
    let st = ctl(&control, &["status", "a", "--json"]).assert_success();
    assert_eq!(Json::parse(&st.stdout).at("size").u64(), 2 * MIB, "{st}");

    write_config(&cfg, &[("a.img", "read_only = true")]);
    let out = ctl(&control, &["reload", "--json"]).assert_success();
    let j = Json::parse(&out.stdout);
    let na = j.at("not_applied").arr();
    assert_eq!(na.len(), 1, "{out}");
    assert!(
        na[0].at("message").str().contains("1 connected client(s)")
            && na[0].at("message").str().contains("a reload never forces"),
        "{out}"
    );
    let st = ctl(&control, &["status", "a", "--json"]).assert_success();
    assert!(!Json::parse(&st.stdout).at("read_only").bool(), "{st}");

    drop(client);
    wait_for("the client to leave", || {
        let st = ctl(&control, &["status", "a", "--json"]).assert_success();
        Json::parse(&st.stdout).at("clients").u64() == 0
    });
    let out = ctl(&control, &["reload", "--json"]).assert_success();
    let j = Json::parse(&out.stdout);
    assert_eq!(j.at("changed").arr()[0].str(), "a", "{out}");
    let st = ctl(&control, &["status", "a", "--json"]).assert_success();
    assert!(Json::parse(&st.stdout).at("read_only").bool(), "{st}");
    p.stop();
}
