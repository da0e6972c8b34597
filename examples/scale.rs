//! Benchmark: loopd with many devices, and the `loopd attach` command.
//!
//! Measures, in one run on this machine, for one or two `loopd` binaries
//! (`--before BIN`: e.g. main's, built into another path; the other is this
//! tree's `target/release/loopd`), alternating them:
//! 1. restart with N devices in the state file (`--restart N`, default
//!    10,000; one small sparse file each): spawn → control socket ready, and
//!    spawn → the last recorded device opened by an NBD client (`NBD_OPT_GO`);
//!    then every device is checked to be listed and not missing;
//! 2. many devices (`--many N`, default 50,000, capped by the open-file
//!    limit): N durable attaches into one daemon over one control connection,
//!    the daemon's RSS per device, and attach latency of the first and last
//!    100 (median, p99);
//! 3. the shell command (`--cli ROUNDS`, default 200): `loopd attach` process
//!    start to exit (then `loopd detach`), next to `losetup -f --show` (then
//!    `losetup -d`, root only), interleaved;
//! 4. block devices made at once (`--ublk N`, default 100; root, ublk_drv):
//!    one `loopd attach --blockdev ublk IMG…` batch, each `/dev/ublkbN`'s
//!    first 4 KiB checked against its image, a restart that makes them again
//!    from the state file, the detach of all; next to N kernel loop devices
//!    set up in-process (`LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE`), checked the
//!    same way (see `common/blockdevs.rs`).
//!
//! `--restart` takes a list (`--restart 4900,10000`): one section each, in
//! the same run. The open-file limit: the soft limit is raised to the hard
//! one, and where the hard one is below what the counts need (4 descriptors
//! per device) it is raised too when the process may (root: up to
//! `fs.nr_open`); what is left caps the counts, and the report says so.
//!
//! Usage: `cargo run --release --example scale -- [--before BIN] [--restart N[,N…]]
//! [--many N] [--cli ROUNDS] [--ublk N] [--rounds R] [--only restart|many|cli|ublk[,…]]`.
//! Prints a markdown report on stdout. Files go to a temporary directory under
//! `$TMPDIR` (default /var/tmp; removed at the end).

use loopd::control::proto::{DeviceSpec, Request};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
// Section 4 (uses this example's daemon helpers, so not part of `common`).
#[path = "common/ublk.rs"]
mod ublk;

use common::{Ctl, nbd_go, run_timed, us};

const USAGE: &str = "usage: bench/scale [--before BIN] [--restart N[,N…]] [--many N] \
[--cli ROUNDS] [--ublk N] [--rounds R] [--only restart|many|cli|ublk[,…]]\n\
Prints a markdown report (see the top of examples/scale.rs and bench/RESULTS.md).";

/// Devices per `attach_batch` when a state file is made for the restart.
const MAKE_BATCH: usize = 1000;

fn this_loopd() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(Path::parent)
        .map(|p| p.join("loopd"))
        .expect("target dir")
}

struct Daemon {
    child: Child,
    pid: i32,
}

impl Daemon {
    /// SIGTERM, and the time until it has exited.
    fn stop(mut self) -> Duration {
        let t = Instant::now();
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        let _ = self.child.wait();
        self.pid = 0;
        t.elapsed()
    }

    fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// Nanoseconds on a CPU so far, all its threads (schedstat: finer than
    /// the clock ticks of /proc/PID/stat; a thread that ended is not counted).
    fn cpu_ns(&self) -> u64 {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return 0;
        };
        tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    /// Memory maps (lines of /proc/PID/maps): bounded by `vm.max_map_count`.
    fn maps(&self) -> usize {
        std::fs::read_to_string(format!("/proc/{}/maps", self.pid)).map_or(0, |s| s.lines().count())
    }

    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid)).map_or(0, |d| d.count())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.pid > 0 {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(self.pid, libc::SIGTERM) };
            let _ = self.child.wait();
        }
    }
}

/// Start `loopd serve` and wait for its control line.
fn start(bin: &Path, dir: &Path, state: &Path) -> (Daemon, Instant, Duration) {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .arg("serve")
        .args(["--socket", dir.join("nbd.sock").to_str().unwrap()])
        .args(["--control", dir.join("nbd.ctl").to_str().unwrap()])
        .args(["--state", state.to_str().unwrap()])
        .env("LOOPD_LOG", "warn")
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
    let ready = t.elapsed();
    // Keep reading its stdout so the daemon never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let pid = child.id() as i32;
    (Daemon { child, pid }, t, ready)
}

fn spec(image: &Path, name: &str) -> DeviceSpec {
    DeviceSpec {
        image: image.to_path_buf(),
        name: Some(name.into()),
        ..Default::default()
    }
}

/// Nearest-rank percentile `p` (in thousandths) of `v` (sorted here).
fn pct(v: &mut [f64], p: usize) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) * p).div_ceil(1000)]
}

/// Make `n` sparse 1 MiB images `img{i}.raw` in `dir` (those missing).
fn images(dir: &Path, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("img{i}.raw"));
            if !p.exists() {
                std::fs::File::create(&p)
                    .and_then(|f| f.set_len(1 << 20))
                    .expect("image");
            }
            p
        })
        .collect()
}

struct Args {
    bins: Vec<(String, PathBuf)>,
    restart: Vec<usize>,
    many: usize,
    cli: usize,
    ublk: usize,
    rounds: usize,
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        bins: Vec::new(),
        restart: vec![10_000],
        many: 50_000,
        cli: 200,
        ublk: 100,
        rounds: 3,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--before" => a.bins.push(("before".into(), PathBuf::from(v()))),
            "--restart" => {
                a.restart = v()
                    .split(',')
                    .map(|n| n.parse().expect("--restart N[,N…]"))
                    .collect()
            }
            "--ublk" => a.ublk = v().parse().expect("--ublk N"),
            "--many" => a.many = v().parse().expect("--many N"),
            "--cli" => a.cli = v().parse().expect("--cli ROUNDS"),
            "--rounds" => a.rounds = v().parse().expect("--rounds R"),
            "--only" => a.only = Some(v()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => {
                eprintln!("scale: unknown argument {other:?}\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
    a.bins.push(("after".into(), this_loopd()));
    a
}

/// Raise the open-file limit (inherited by the daemons) to `need`: the
/// hard limit too where it is lower and the process may (root, up to
/// `fs.nr_open`), else the soft one to the hard one. The limit in force.
fn raise_nofile(need: u64) -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        if r.rlim_max < need {
            let up = libc::rlimit {
                rlim_cur: need,
                rlim_max: need,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &up) == 0 {
                return need;
            }
        }
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
    r.rlim_cur
}

fn main() {
    let a = args();
    let want = |s: &str| {
        a.only
            .as_deref()
            .is_none_or(|o| o.split(',').any(|x| x == s))
    };
    let most = a.restart.iter().copied().max().unwrap_or(0).max(a.many);
    let nofile = raise_nofile(4 * most as u64 + 1024);
    let tmp = std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
    let dir = tempfile::Builder::new()
        .prefix("loopd-bench-scale")
        .tempdir_in(tmp)
        .expect("tempdir");
    let d = dir.path();
    println!(
        "Binaries: {}. Open-file limit: {nofile}.\n",
        a.bins
            .iter()
            .map(|(n, p)| format!("{n} = {}", p.display()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if want("restart") {
        for &n in &a.restart {
            restart(&a, n, d, nofile);
        }
    }
    if want("many") {
        many(&a, d, nofile);
    }
    if want("cli") {
        cli(&a, d);
    }
    if want("ublk") {
        ublk::run(&a.bins, d, a.ublk);
    }
}

/// Section 1, restart: with `want` devices in the state file (as many as
/// the open-file limit lets one daemon hold, 4 descriptors each), and with
/// `want` recorded devices whose images are gone (all missing: the state
/// file's parsing, the restore loop and the compaction at 10,000 without the
/// descriptors).
fn restart(a: &Args, want: usize, d: &Path, nofile: u64) {
    // The daemon's restore keeps `reserved_fds` for connections and itself
    // and leaves devices past that missing (64 more: what is open at start).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let reserve = loopd::daemon::reserved_fds(cpus) + 64;
    let room = usize::try_from(nofile.saturating_sub(reserve) / 4).unwrap_or(usize::MAX);
    let n = want.min(room);
    if n < want {
        println!(
            "(restart: {n} devices, not {want}: 4 descriptors per device and an open-file limit of {nofile})\n"
        );
    }
    restart_gone(a, want, d);
    let imgs = images(d, n);
    let state = d.join("restart.state");
    let _ = std::fs::remove_file(&state);
    // The state file, made by this tree's binary: N attaches, then a stop.
    let (last_bin, last) = a.bins.last().expect("a binary");
    let (daemon, _, _) = start(last, d, &state);
    let mut ctl = Ctl::connect(&d.join("nbd.ctl"));
    let t = Instant::now();
    let all: Vec<_> = (imgs.iter().enumerate())
        .map(|(i, img)| spec(img, &format!("r{i}")))
        .collect();
    for chunk in all.chunks(MAKE_BATCH) {
        let reply = ctl.call(&Request::AttachBatch {
            devices: chunk.to_vec(),
        });
        assert!(!reply.contains("\"ok\":false"), "attach_batch: {reply}");
    }
    let made = t.elapsed();
    drop(ctl);
    daemon.stop();
    println!(
        "## Restart with {n} devices in the state file ({} rounds, alternating)\n",
        a.rounds
    );
    println!(
        "(state file made by {last_bin}: {n} attaches, in batches of {MAKE_BATCH}, in {:.1} s; one 1 MiB sparse file per device)\n",
        made.as_secs_f64()
    );
    println!(
        "| binary | spawn → ready, ms (median) | spawn → last device opened (OPT_GO), ms (median; all) | stop, ms (median) |"
    );
    println!("|---|---:|---:|---:|");
    type Row = (String, Vec<f64>, Vec<f64>, Vec<f64>);
    let mut rows: Vec<Row> = a
        .bins
        .iter()
        .map(|(n, _)| (n.clone(), Vec::new(), Vec::new(), Vec::new()))
        .collect();
    let last_name = format!("r{}", n - 1);
    for _ in 0..a.rounds {
        for (i, (_, bin)) in a.bins.iter().enumerate() {
            let (daemon, t0, ready) = start(bin, d, &state);
            nbd_go(&d.join("nbd.sock"), &last_name);
            let served = t0.elapsed();
            // Every device is back (none missing).
            let list = Ctl::connect(&d.join("nbd.ctl")).call(&Request::List);
            let v: serde_json::Value = serde_json::from_str(&list).expect("list json");
            let devs = v["result"]["devices"].as_array().expect("devices");
            let missing = devs.iter().filter(|x| x["state"] == "missing").count();
            assert_eq!(devs.len(), n, "devices listed");
            assert_eq!(missing, 0, "missing devices after restart");
            let stop = daemon.stop();
            rows[i].1.push(ready.as_secs_f64() * 1e3);
            rows[i].2.push(served.as_secs_f64() * 1e3);
            rows[i].3.push(stop.as_secs_f64() * 1e3);
        }
    }
    for (name, mut r, mut s, mut st) in rows {
        let all = s
            .iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "| {name} | {:.0} | {:.0} ({all}) | {:.0} |",
            pct(&mut r, 500),
            pct(&mut s, 500),
            pct(&mut st, 500)
        );
    }
    println!();
}

/// A state file of `n` devices whose images do not exist: every one is
/// listed as missing after the restart.
fn restart_gone(a: &Args, n: usize, d: &Path) {
    let state = d.join("gone.state");
    let mut text = String::from("{\"loopd_state\":1}\n");
    for i in 0..n {
        let s = spec(&d.join(format!("gone{i}.raw")), &format!("g{i}"));
        text.push_str(&serde_json::json!({ "put": s }).to_string());
        text.push('\n');
    }
    println!("## Restart with {n} recorded devices whose images are gone (all missing)\n");
    println!("| binary | spawn → ready, ms (median) | all |");
    println!("|---|---:|---|");
    let mut rows: Vec<Vec<f64>> = vec![Vec::new(); a.bins.len()];
    for _ in 0..a.rounds {
        for (i, (_, bin)) in a.bins.iter().enumerate() {
            std::fs::write(&state, &text).expect("state file");
            let (daemon, _, ready) = start(bin, d, &state);
            let list = Ctl::connect(&d.join("nbd.ctl")).call(&Request::List);
            let v: serde_json::Value = serde_json::from_str(&list).expect("list json");
            let devs = v["result"]["devices"].as_array().expect("devices");
            let missing = devs.iter().filter(|x| x["state"] == "missing").count();
            assert_eq!(missing, n, "missing devices listed");
            daemon.stop();
            rows[i].push(ready.as_secs_f64() * 1e3);
        }
    }
    for ((name, _), mut r) in a.bins.iter().zip(rows) {
        let all = r
            .iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!("| {name} | {:.0} | {all} |", pct(&mut r, 500));
    }
    println!();
}

/// Section 2: many devices in one daemon.
fn many(a: &Args, d: &Path, nofile: u64) {
    let want = a.many;
    println!("## Many devices: durable attaches into one daemon\n");
    println!(
        "| binary | devices | RSS before, MiB | RSS after, MiB | KiB per device | fds per device | memory maps before → after | attach µs first 100 (median / p99) | last 100 (median / p99) | p99 last/first | daemon CPU µs per attach, first / last 100 | total s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, bin) in &a.bins {
        let state = d.join(format!("many-{name}.state"));
        let _ = std::fs::remove_file(&state);
        let (daemon, _, _) = start(bin, d, &state);
        let mut ctl = Ctl::connect(&d.join("nbd.ctl"));
        let rss0 = daemon.rss_kib();
        let fd0 = daemon.fds();
        let maps0 = daemon.maps();
        // How many descriptors a device takes, from the first 100.
        let probe = images(d, 100);
        let mut lat = Vec::with_capacity(want);
        let c0 = daemon.cpu_ns();
        for (i, img) in probe.iter().enumerate() {
            let t = Instant::now();
            ctl.call(&Request::Attach(Box::new(spec(img, &format!("m{i}")))));
            lat.push(us(t.elapsed()));
        }
        // The control connection and the state file are not per device.
        let cpu_first = (daemon.cpu_ns() - c0) as f64 / 100e3;
        let per = ((daemon.fds() - fd0) / 100).max(1);
        let room = usize::try_from(nofile)
            .unwrap_or(usize::MAX)
            .saturating_sub(fd0 + 64)
            / per;
        let n = want.min(room);
        let imgs = images(d, n);
        let t = Instant::now();
        let mut c_last = 0;
        for (i, img) in imgs.iter().enumerate().skip(100) {
            if i == (n - 100).max(100) {
                c_last = daemon.cpu_ns();
            }
            let t = Instant::now();
            ctl.call(&Request::Attach(Box::new(spec(img, &format!("m{i}")))));
            lat.push(us(t.elapsed()));
        }
        let total = t.elapsed();
        let cpu_last = (daemon.cpu_ns() - c_last) as f64 / 100e3;
        let rss1 = daemon.rss_kib();
        let maps1 = daemon.maps();
        let (mut first, mut last) = (lat[..100].to_vec(), lat[lat.len() - 100..].to_vec());
        let (f50, f99) = (pct(&mut first, 500), pct(&mut first, 990));
        let (l50, l99) = (pct(&mut last, 500), pct(&mut last, 990));
        println!(
            "| {name} | {n}{} | {:.1} | {:.1} | {:.2} | {per} | {maps0} → {maps1} | {f50:.0} / {f99:.0} | {l50:.0} / {l99:.0} | {:.2} | {cpu_first:.0} / {cpu_last:.0} | {:.1} |",
            if n < want {
                format!(" (of {want}: open-file limit)")
            } else {
                String::new()
            },
            rss0 as f64 / 1024.0,
            rss1 as f64 / 1024.0,
            (rss1 - rss0) as f64 / n as f64,
            l99 / f99,
            total.as_secs_f64()
        );
        drop(ctl);
        daemon.stop();
    }
    println!();
}

/// Section 3: `loopd attach` from the shell, next to `losetup -f --show`.
fn cli(a: &Args, d: &Path) {
    let img = d.join("cli.raw");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .expect("image");
    let ctl = d.join("nbd.ctl");
    let state = d.join("cli.state");
    // One daemon (this tree's) serves both CLIs: only the command differs.
    let (daemon, _, _) = start(&a.bins.last().expect("a binary").1, d, &state);
    let root = rustix::process::geteuid().is_root() && Path::new("/dev/loop-control").exists();
    let mut rows: Vec<(String, Vec<f64>, Vec<f64>)> = Vec::new();
    for (n, _) in &a.bins {
        rows.push((format!("`loopd attach` ({n})"), Vec::new(), Vec::new()));
    }
    if root {
        rows.push(("`losetup -f --show`".into(), Vec::new(), Vec::new()));
    }
    // Each CLI run from a copy in the scratch directory, as an installed
    // binary would be: the file the linker just wrote into target/ started
    // measurably slower (about 70 µs here) than a copy of the same bytes.
    let bins: Vec<PathBuf> = a
        .bins
        .iter()
        .enumerate()
        .map(|(k, (_, bin))| {
            let to = d.join(format!("cli-{k}")).join("loopd");
            std::fs::create_dir_all(to.parent().expect("parent")).expect("dir");
            std::fs::copy(bin, &to).expect("copy the CLI binary");
            to
        })
        .collect();
    // Each round starts with the next command in turn: whichever runs right
    // after another's detach pays for it (measured: the same binary twice
    // was 250-300 µs slower in second place on a busy machine).
    let m = rows.len();
    for i in 0..a.cli {
        for j in 0..m {
            let k = (i + j) % m;
            if let Some(bin) = bins.get(k) {
                let name = format!("c{k}-{i}");
                let (t, _) = run_timed(
                    Command::new(bin)
                        .args(["attach", img.to_str().unwrap(), "--name", &name])
                        .args(["--control", ctl.to_str().unwrap()]),
                );
                rows[k].1.push(us(t));
                let (t, _) = run_timed(Command::new(bin).args([
                    "detach",
                    &name,
                    "--control",
                    ctl.to_str().unwrap(),
                ]));
                rows[k].2.push(us(t));
            } else {
                let (t, dev) = run_timed(Command::new("losetup").args(["-f", "--show"]).arg(&img));
                rows[k].1.push(us(t));
                let (t, _) = run_timed(Command::new("losetup").args(["-d", &dev]));
                rows[k].2.push(us(t));
            }
        }
    }
    daemon.stop();
    println!(
        "## The shell command ({} rounds, interleaved, each round starting with the next command; one daemon with a state file)\n",
        a.cli
    );
    println!("| command | attach median µs | attach p99 µs | detach median µs |");
    println!("|---|---:|---:|---:|");
    for (name, mut at, mut de) in rows {
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} |",
            pct(&mut at, 500),
            pct(&mut at, 990),
            pct(&mut de, 500)
        );
    }
    if !root {
        println!("\n(losetup skipped: not root or no /dev/loop-control)");
    }
    println!();
}
