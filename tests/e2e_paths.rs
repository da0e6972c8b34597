//! Issue 22, point 3: the paths given to `--socket`, `--control`, `--metrics`
//! (a Unix socket) and `--pid-file` are loopd's only where nothing else is.
//! A regular file there (an image named by a typo), a directory, a symbolic
//! link or a FIFO is refused at start, named, and left byte for byte as it
//! was; a stale socket and a stale pid file (a dead pid) are replaced; and at
//! stop loopd removes only what it made, not a file put in its place while it
//! ran. nbdkit refuses the same socket path.

mod common;

use common::*;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What a mistyped path could hold: the start of a qcow2 image.
const IMAGE_BYTES: &[u8] = b"QFI\xfb\0\0\0\x03precious image bytes\n";

/// The four paths of one server, fresh in `dir`.
struct Paths {
    socket: PathBuf,
    control: PathBuf,
    metrics: PathBuf,
    pid: PathBuf,
}

impl Paths {
    fn new(dir: &Path) -> Paths {
        Paths {
            socket: dir.join("nbd.sock"),
            control: dir.join("nbd.ctl"),
            metrics: dir.join("metrics.sock"),
            pid: dir.join("loopd.pid"),
        }
    }

    fn all(&self) -> [(&'static str, &Path); 4] {
        [
            ("--socket", &self.socket),
            ("--control", &self.control),
            ("--metrics", &self.metrics),
            ("--pid-file", &self.pid),
        ]
    }

    fn args(&self) -> Vec<String> {
        self.all()
            .iter()
            .flat_map(|(o, p)| [o.to_string(), path_str(p).to_string()])
            .collect()
    }
}

fn serve(dir: &Path, img: &Path, p: &Paths) -> Out {
    let mut args = vec![
        "serve".to_string(),
        path_str(img).into(),
        "--state".into(),
        path_str(&dir.join("s.state")).into(),
    ];
    args.extend(p.args());
    loopd_run(&args)
}

/// Everything in `dir` but the files the test made itself and the state
/// file (and its lock).
fn left_in(dir: &Path, keep: &[&Path]) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !keep.contains(&p.as_path()))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with("s.state"))
        .collect();
    v.sort();
    v
}

#[test]
fn each_option_naming_a_regular_file_is_refused_and_the_file_kept() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, MIB);
    for (option, _) in Paths::new(dir.path()).all() {
        let p = Paths::new(dir.path());
        let target = p
            .all()
            .into_iter()
            .find(|(o, _)| *o == option)
            .map(|(_, t)| t.to_path_buf())
            .unwrap();
        std::fs::write(&target, IMAGE_BYTES).unwrap();
        let out = serve(dir.path(), &img, &p);
        assert!(!out.success(), "{option} on a regular file started:\n{out}");
        assert!(
            out.stderr.contains(path_str(&target)) && out.stderr.contains("regular file"),
            "{option}: the refusal does not name the file:\n{out}"
        );
        assert!(out.stderr.contains(option), "{option} not named:\n{out}");
        assert_eq!(
            std::fs::read(&target).unwrap(),
            IMAGE_BYTES,
            "{option}: the file was changed"
        );
        assert_eq!(
            left_in(dir.path(), &[&img, &target]),
            Vec::<String>::new(),
            "{option}: the refused start left files behind"
        );
        std::fs::remove_file(&target).unwrap();
    }
}

#[test]
fn directories_symlinks_and_fifos_are_refused_too() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, MIB);
    let victim = dir.path().join("victim.img");
    std::fs::write(&victim, IMAGE_BYTES).unwrap();
    let p = Paths::new(dir.path());

    // A symbolic link to the image, at --socket and at --pid-file.
    for (option, at) in [("--socket", &p.socket), ("--pid-file", &p.pid)] {
        std::os::unix::fs::symlink(&victim, at).unwrap();
        let out = serve(dir.path(), &img, &p);
        assert!(!out.success(), "{option} on a symlink started:\n{out}");
        assert!(out.stderr.contains("symbolic link"), "{out}");
        assert_eq!(std::fs::read(&victim).unwrap(), IMAGE_BYTES);
        assert!(at.symlink_metadata().unwrap().file_type().is_symlink());
        std::fs::remove_file(at).unwrap();
    }
    // A directory at --control, a FIFO at --metrics.
    std::fs::create_dir(&p.control).unwrap();
    let out = serve(dir.path(), &img, &p);
    assert!(
        !out.success() && out.stderr.contains("a directory"),
        "{out}"
    );
    assert!(p.control.is_dir());
    std::fs::remove_dir(&p.control).unwrap();
    let c = std::ffi::CString::new(path_str(&p.metrics)).unwrap();
    // SAFETY: mkfifo(3) reads the NUL-terminated path only.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let out = serve(dir.path(), &img, &p);
    assert!(!out.success() && out.stderr.contains("a FIFO"), "{out}");
    assert!(p.metrics.metadata().unwrap().file_type().is_fifo());
}

#[test]
fn a_stale_socket_and_a_stale_pid_file_are_replaced_and_removed_at_stop() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, MIB);
    let p = Paths::new(dir.path());
    // Sockets left by a server that died, and the pid file of a dead pid.
    for s in [&p.socket, &p.control, &p.metrics] {
        drop(std::os::unix::net::UnixListener::bind(s).unwrap());
        assert!(s.exists());
    }
    std::fs::write(&p.pid, format!("{}\n", 1 << 30)).unwrap();
    let mut srv = Server::builder(&img)
        .socket_path(&p.socket)
        .with_control()
        .args(["--control", path_str(&p.control)])
        .args(["--metrics", path_str(&p.metrics)])
        .args(["--pid-file", path_str(&p.pid)])
        .start();
    assert_eq!(
        std::fs::read_to_string(&p.pid).unwrap(),
        format!("{}\n", srv.pid())
    );
    srv.ctl_ok(&["list"]);
    srv.stop_ok();
    for (option, path) in p.all() {
        assert!(!path.exists(), "{option}: {} left behind", path.display());
    }
    // A pid file whose pid is alive (this test's) but no loopd holds: refused.
    std::fs::write(&p.pid, format!("{}\n", std::process::id())).unwrap();
    let out = serve(dir.path(), &img, &p);
    assert!(
        !out.success() && out.stderr.contains("running process"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(&p.pid).unwrap(),
        format!("{}\n", std::process::id())
    );
}

#[test]
fn files_put_in_place_of_the_sockets_and_pid_file_are_not_deleted_at_stop() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, MIB);
    let p = Paths::new(dir.path());
    let mut srv = Server::builder(&img)
        .socket_path(&p.socket)
        .with_control()
        .args(["--control", path_str(&p.control)])
        .args(["--metrics", path_str(&p.metrics)])
        .args(["--pid-file", path_str(&p.pid)])
        .start();
    for (option, path) in p.all() {
        assert!(path.exists(), "{option}: {} was not made", path.display());
        std::fs::remove_file(path).unwrap();
        std::fs::write(path, IMAGE_BYTES).unwrap();
    }
    srv.stop_ok();
    for (option, path) in p.all() {
        assert_eq!(
            std::fs::read(path).ok().as_deref(),
            Some(IMAGE_BYTES),
            "{option}: the file put at {} was deleted or changed at stop",
            path.display()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while srv.stderr_text().matches("left as it is").count() < 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        srv.stderr_text().matches("left as it is").count() == 4,
        "no warning about the replaced paths:\n{}",
        srv.stderr_text()
    );
}

/// nbdkit, given the same mistake (`-U` naming a regular file), refuses it
/// and leaves the file as it was; so does loopd (above).
#[test]
fn nbdkit_refuses_a_regular_file_as_its_socket_too() {
    let dir = tempdir();
    let target = dir.path().join("disk.img");
    std::fs::write(&target, IMAGE_BYTES).unwrap();
    let mut c = std::process::Command::new(require_tool("nbdkit"));
    c.env("PATH", tool_path_env())
        .args(["-f", "-U", path_str(&target), "memory", "1M"]);
    let t = Instant::now();
    let out = run_cmd_timeout(c, Duration::from_secs(20));
    assert!(!out.success(), "nbdkit served on a regular file:\n{out}");
    assert!(t.elapsed() < Duration::from_secs(15), "nbdkit did not exit");
    assert_eq!(std::fs::read(&target).unwrap(), IMAGE_BYTES);
}
