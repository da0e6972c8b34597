//! Benchmark: how fast a device becomes usable.
//!
//! Measures, in one run on this machine:
//! 1. `attach` over the control socket: request sent → reply (the export is
//!    published) → an NBD client has completed `NBD_OPT_GO` on it;
//! 2. the same through the CLI (`loopd attach` process) against `losetup -f --show
//!    --direct-io=on -b 4096` and `loopd kernel attach` processes;
//! 3. kernel loop setup in-process (`LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE`);
//! 4. start-up with 200 devices from a `--config` file;
//! 5. durable attaches (group commit, batches): 16 control clients attaching
//!    at once (µs per device, amortised), one `attach_batch` of 1,000 devices
//!    (ms in all), a single attach on an idle daemon next to a bare
//!    `fdatasync` of the same filesystem, and `LOOP_CONFIGURE` in the same
//!    run. With `BENCH_LOOPD_BEFORE=/path/to/an/older/loopd` each of these is
//!    measured for both binaries in alternating rounds (`BENCH_GC_ROUNDS`,
//!    default 5), side by side; an older loopd without `attach_batch` does the
//!    1,000 as single requests on one client.
//!
//! Usage: `cargo run --release --example attach_latency -- [ROUNDS]` (root, for
//! the kernel loop cases). Prints a markdown report on stdout.

use loopd::control::proto::{DeviceSpec, Request};
use loopd::device::CacheMode;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn loopd_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/release/examples/attach_latency -> target/release/loopd
    exe.parent()
        .and_then(Path::parent)
        .map(|p| p.join("loopd"))
        .expect("target dir")
}

struct Daemon {
    child: Child,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// Start `loopd serve` and wait for its control line; returns the daemon and the
/// time from spawn to ready.
fn start(dir: &Path, extra: &[&str]) -> (Daemon, Duration) {
    start_bin(&loopd_bin(), dir, extra)
}

/// [`start`] with the loopd binary `bin`.
fn start_bin(bin: &Path, dir: &Path, extra: &[&str]) -> (Daemon, Duration) {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .arg("serve")
        .args(["--socket", dir.join("nbd.sock").to_str().unwrap()])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn loopd");
    let out = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(out).lines();
    loop {
        let l = lines
            .next()
            .expect("loopd exited before it was ready")
            .expect("read");
        if l.starts_with("control: ") {
            break;
        }
    }
    (Daemon { child }, t.elapsed())
}

fn spec(image: &Path, name: &str) -> DeviceSpec {
    DeviceSpec {
        image: image.to_path_buf(),
        name: Some(name.into()),
        offset: 0,
        size_limit: None,
        block_size: Some(4096),
        cache: CacheMode::Direct,
        read_only: false,
        autoclear: false,
        create: None,
        shared: false,
        format: None,
        ..Default::default()
    }
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    // Nearest-rank percentile, p in thousandths.
    let pct = |p: usize| v[((v.len() - 1) * p).div_ceil(1000)];
    (pct(500), pct(990), v.iter().sum::<f64>() / v.len() as f64)
}

mod common;
#[path = "attach_latency/durable.rs"]
mod durable;

use common::{Ctl, loop_configure_us, nbd_go, run_timed, us};

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let dir = tempfile::Builder::new()
        .prefix("loopd-bench-attach")
        .tempdir_in("/var/tmp")
        .expect("tempdir");
    let d = dir.path();
    if std::env::var_os("BENCH_ONLY_DURABLE").is_some() {
        durable::section(d);
        return;
    }
    let image = d.join("img.raw");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(64 << 20))
        .expect("image");

    println!("## Attach latency ({rounds} rounds each)\n");
    println!("| case | median µs | p99 µs | mean µs |");
    println!("|---|---:|---:|---:|");
    let row = |name: &str, v: Vec<f64>| {
        let (m, p, a) = stats(v);
        println!("| {name} | {m:.0} | {p:.0} | {a:.0} |");
        m
    };

    // 1. Control socket, in-process client.
    let state = std::env::var("BENCH_STATE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| d.join("s.state"));
    let (daemon, _) = start(d, &["--state", state.to_str().unwrap()]);
    let mut ctl = Ctl::connect(&d.join("nbd.ctl"));
    let (mut reply, mut open) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let name = format!("d{i}");
        let t = Instant::now();
        ctl.call(&Request::Attach(Box::new(spec(&image, &name))));
        reply.push(us(t.elapsed()));
        nbd_go(&d.join("nbd.sock"), &name);
        open.push(us(t.elapsed()));
        // The client has hung up, but the server may not have seen it yet.
        ctl.call(&Request::Detach { name, force: true });
    }
    let loopd_reply = row(
        "loopd attach, control request → reply (export published)",
        reply,
    );
    let loopd_open = row(
        "loopd attach, control request → NBD client has opened it (OPT_GO)",
        open,
    );

    // 2. Whole commands, process start included.
    let bin = loopd_bin();
    let mut cli = Vec::new();
    for i in 0..rounds.min(100) {
        let name = format!("c{i}");
        let (t, _) = run_timed(
            Command::new(&bin)
                .args([
                    "attach",
                    image.to_str().unwrap(),
                    "--name",
                    &name,
                    "--block-size",
                    "4096",
                ])
                .args([
                    "--cache",
                    "direct",
                    "--control",
                    d.join("nbd.ctl").to_str().unwrap(),
                ]),
        );
        cli.push(us(t));
        ctl.call(&Request::Detach { name, force: false });
    }
    let loopd_cli = row("`loopd attach` command (process start to exit)", cli);
    drop(daemon);

    let root = rustix::process::geteuid().is_root() && Path::new("/dev/loop-control").exists();
    if root {
        let (mut ls, mut lk, mut lib) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds.min(100) {
            let (t, dev) = run_timed(
                Command::new("losetup")
                    .args(["-f", "--show", "--direct-io=on", "-b", "4096"])
                    .arg(&image),
            );
            ls.push(us(t));
            run_timed(Command::new("losetup").args(["-d", &dev]));
            let (t, dev) = run_timed(
                Command::new(&bin)
                    .args([
                        "kernel",
                        "attach",
                        "--direct-io",
                        "on",
                        "--block-size",
                        "4096",
                    ])
                    .arg(&image),
            );
            lk.push(us(t));
            run_timed(Command::new(&bin).args(["kernel", "detach", &dev]));
            lib.push(loop_configure_us(&image));
        }
        let losetup = row("`losetup -f --show --direct-io=on -b 4096` command", ls);
        let kcli = row(
            "`loopd kernel attach --direct-io on --block-size 4096` command",
            lk,
        );
        let klib = row("kernel loop in-process: GET_FREE + LOOP_CONFIGURE", lib);
        println!();
        println!(
            "Ratios (median): losetup command / loopd NBD attach (request → published) = {:.1}×; ",
            losetup / loopd_reply
        );
        println!(
            "losetup command / loopd NBD attach (request → client opened) = {:.1}×; ",
            losetup / loopd_open
        );
        println!(
            "losetup command / `loopd attach` command = {:.2}×; ",
            losetup / loopd_cli
        );
        println!(
            "losetup command / `loopd kernel attach` command = {:.2}×; ",
            losetup / kcli
        );
        println!(
            "losetup command / in-process LOOP_CONFIGURE = {:.1}×.",
            losetup / klib
        );
    } else {
        println!("\n(kernel loop cases skipped: not root or no /dev/loop-control)");
    }

    // 4. 200 devices from a config file at start.
    let n = 200;
    let mut toml = String::new();
    for i in 0..n {
        let p = d.join(format!("cfg{i}.img"));
        std::fs::File::create(&p)
            .and_then(|f| f.set_len(1 << 20))
            .expect("image");
        toml.push_str(&format!(
            "[[device]]\nimage = \"{}\"\nname = \"cfg{i}\"\n\n",
            p.display()
        ));
    }
    std::fs::write(d.join("devices.toml"), toml).expect("config");
    let (base, base_t) = start(d, &["--state", d.join("empty.state").to_str().unwrap()]);
    drop(base);
    let (many, many_t) = start(
        d,
        &[
            "--config",
            d.join("devices.toml").to_str().unwrap(),
            "--state",
            d.join("empty2.state").to_str().unwrap(),
        ],
    );
    drop(many);
    println!();
    println!("## Start-up with {n} devices from --config\n");
    println!("| case | ms |");
    println!("|---|---:|");
    println!(
        "| `loopd serve` with no devices: spawn → control socket ready | {:.1} |",
        base_t.as_secs_f64() * 1e3
    );
    println!(
        "| `loopd serve --config` with {n} devices: spawn → ready | {:.1} |",
        many_t.as_secs_f64() * 1e3
    );
    println!(
        "| difference: {n} attaches | {:.1} |",
        (many_t.as_secs_f64() - base_t.as_secs_f64()) * 1e3
    );

    // 5. Durable attaches: group commit and batches.
    durable::section(d);
}
