//! `scale`'s section 4: block devices made at once. N ublk devices from one
//! `loopd attach --blockdev ublk IMG…` (one `attach_batch`), then the same N
//! made again by a restart on the state file, each `/dev/ublkbN`'s first
//! 4 KiB checked against its image both times, and the detach of all; next to
//! N kernel loop devices set up in-process (`LOOP_CTL_GET_FREE` +
//! `LOOP_CONFIGURE`, through `loopd::kernel_loop::attach`, which also probes
//! the image and checks its lock), checked the same way and detached.
//!
//! Root only, with `ublk_drv` loaded (a VM: `bench/vm-scale`). A device the
//! kernel refuses (`ublks_max`, default 64) is reported with its error, not
//! hidden: the section says how many were made. Included by `scale.rs` alone
//! (`#[path]`): it uses that example's daemon helpers.

use crate::common::{Ctl, us};
use crate::{pct, start};
use loopd::control::proto::Request;
use loopd::kernel_loop;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The first 4 KiB of image `i`: bytes no other image has.
fn head(i: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (i as u64 + 1);
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

/// `n` 1 MiB images named `{prefix}{i}.raw`, each with its own first 4 KiB.
fn images(dir: &Path, prefix: &str, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("{prefix}{i}.raw"));
            std::fs::write(&p, head(i))
                .and_then(|()| std::fs::File::options().write(true).open(&p))
                .and_then(|f| f.set_len(1 << 20))
                .expect("image");
            p
        })
        .collect()
}

/// How many of `devs` (device `i` for image `i`) read back their image's
/// first 4 KiB; the first mismatch or error.
fn check(devs: &[(usize, String)]) -> (usize, Option<String>) {
    let mut good = 0;
    let mut first = None;
    for (i, dev) in devs {
        let mut buf = vec![0u8; 4096];
        let r = std::fs::File::open(dev).and_then(|mut f| f.read_exact(&mut buf));
        match r {
            Ok(()) if buf == head(*i) => good += 1,
            Ok(()) => {
                first.get_or_insert(format!("{dev}: the first 4 KiB differ from its image"));
            }
            Err(e) => {
                first.get_or_insert(format!("{dev}: {e}"));
            }
        }
    }
    (good, first)
}

/// The block devices a `list` reply names, by device index (`u{i}`).
fn listed(ctl: &Path) -> Vec<(usize, String)> {
    let list = Ctl::connect(ctl).call(&Request::List);
    let v: serde_json::Value = serde_json::from_str(&list).expect("list json");
    let mut out: Vec<(usize, String)> = v["result"]["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .filter_map(|d| {
            let i = d["name"].as_str()?.strip_prefix('u')?.parse().ok()?;
            Some((i, d["blockdev"].as_str()?.to_owned()))
        })
        .collect();
    out.sort();
    out
}

/// One binary's row pair: the batch, then the restart, and the detach of all.
struct Rows {
    batch: String,
    restart: String,
}

pub fn run(bins: &[(String, PathBuf)], dir: &Path, n: usize) {
    println!("## {n} block devices made at once: ublk (one batch) and kernel loop\n");
    let root = rustix::process::geteuid().is_root();
    if !root || !Path::new("/dev/ublk-control").exists() {
        println!(
            "(skipped: needs root and /dev/ublk-control: `modprobe ublk_drv`, or run bench/vm-scale)\n"
        );
        return;
    }
    let limit = std::fs::read_to_string("/sys/module/ublk_drv/parameters/ublks_max")
        .map_or_else(|_| "unknown".into(), |s| s.trim().to_owned());
    println!("ublk_drv `ublks_max` = {limit}.\n");
    let d = dir.join("ublk");
    std::fs::create_dir_all(&d).expect("dir");
    let imgs = images(&d, "u", n);
    let rows: Vec<Rows> = bins
        .iter()
        .map(|(label, bin)| one(label, bin, &d, &imgs))
        .collect();
    // Kernel loop devices, in-process, on images of their own.
    let kimgs = images(&d, "k", n);
    let mut kt = Vec::new();
    let mut kdevs = Vec::new();
    let t = Instant::now();
    for (i, img) in kimgs.iter().enumerate() {
        let (a, took) = crate::common::loop_configure(img);
        kt.push(took);
        kdevs.push((i, a.device.display().to_string()));
    }
    let ktotal = t.elapsed();
    let (kgood, kbad) = check(&kdevs);
    let mut kdet = Vec::new();
    for (_, dev) in &kdevs {
        let t = Instant::now();
        kernel_loop::detach(Path::new(dev)).expect("kernel detach");
        kdet.push(us(t.elapsed()));
    }
    let kdet_total: f64 = kdet.iter().sum();
    println!(
        "| how | devices | in all, ms | per device, ms | one device, median / p99 ms | read back | detach all, ms (per device) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!("{}", r.batch);
        println!("{}", r.restart);
    }
    println!(
        "| kernel loop: `LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE` in-process, one after another | {n} | {:.0} | {:.2} | {:.2} / {:.2} | {kgood} | {:.0} ({:.2}) |",
        us(ktotal) / 1e3,
        us(ktotal) / 1e3 / n as f64,
        pct(&mut kt.clone(), 500) / 1e3,
        pct(&mut kt, 990) / 1e3,
        kdet_total / 1e3,
        kdet_total / 1e3 / n as f64
    );
    if let Some(b) = kbad {
        println!("\nFirst bad read of a loop device: {b}");
    }
    println!();
}

/// The batch, the restart and the detach of all with binary `bin`.
fn one(label: &str, bin: &Path, d: &Path, imgs: &[PathBuf]) -> Rows {
    let n = imgs.len();
    let state = d.join(format!("ublk-{label}.state"));
    let _ = std::fs::remove_file(&state);
    let ctl = d.join("nbd.ctl");
    let (daemon, _, _) = start(bin, d, &state);
    // The batch: one process, one attach_batch, N block devices. Names u{i}
    // are given by the file stems.
    let t = Instant::now();
    let out = Command::new(bin)
        .args(["attach", "--blockdev", "ublk", "--json", "--control"])
        .arg(&ctl)
        .args(imgs)
        .output()
        .expect("spawn loopd attach");
    let batch = t.elapsed();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let items = v.as_array().cloned().unwrap_or_default();
    let made = items.iter().filter(|x| x["ok"] == true).count();
    let errors: Vec<String> = items
        .iter()
        .filter(|x| x["ok"] != true)
        .map(|x| x["error"]["message"].as_str().unwrap_or("?").to_owned())
        .collect();
    let devs = listed(&ctl);
    let (good, bad) = check(&devs);
    println!(
        "{label}: `loopd attach --blockdev ublk --json IMG×{n}` (one `attach_batch`): exit status {}, \
         {made} of {n} made; {good} of {} read back their image's first 4 KiB.",
        out.status.code().unwrap_or(-1),
        devs.len()
    );
    if let Some(b) = bad {
        println!("\n{label}: first bad read: {b}");
    }
    if !errors.is_empty() {
        println!(
            "\n{label}: {} refused; the first: `{}`",
            errors.len(),
            errors[0].replace('`', "'")
        );
    }
    // A restart makes them again from the state file.
    let stop = daemon.stop();
    let gone = devs.iter().filter(|(_, p)| Path::new(p).exists()).count();
    let (daemon, t0, ready) = start(bin, d, &state);
    let devs2 = listed(&ctl);
    let listed_at = t0.elapsed();
    let (good2, bad2) = check(&devs2);
    println!(
        "\n{label}: stop (SIGTERM) took {:.0} ms and left {gone} of the {} block device nodes; \
         after the restart {} block devices were listed at {:.0} ms.\n",
        us(stop) / 1e3,
        devs.len(),
        devs2.len(),
        us(listed_at) / 1e3
    );
    if let Some(b) = bad2 {
        println!("{label}: first bad read after the restart: {b}\n");
    }
    // Detach all over one control connection.
    let mut c = Ctl::connect(&ctl);
    let mut det = Vec::new();
    for (i, _) in &devs2 {
        let t = Instant::now();
        c.call(&Request::Detach {
            name: format!("u{i}"),
            force: false,
        });
        det.push(us(t.elapsed()));
    }
    let left = devs2.iter().filter(|(_, p)| Path::new(p).exists()).count();
    let det_total: f64 = det.iter().sum();
    drop(c);
    daemon.stop();
    Rows {
        batch: format!(
            "| ublk ({label}): one `loopd attach --blockdev ublk` batch (CLI process included) | {made} | {:.0} | {:.2} | – | {good} | {:.0} ({:.2}; {left} nodes left) |",
            us(batch) / 1e3,
            us(batch) / 1e3 / made.max(1) as f64,
            det_total / 1e3,
            det_total / 1e3 / det.len().max(1) as f64
        ),
        restart: format!(
            "| ublk ({label}): restart on the state file (spawn → ready) | {} | {:.0} | {:.2} | – | {good2} | – |",
            devs2.len(),
            us(ready) / 1e3,
            us(ready) / 1e3 / devs2.len().max(1) as f64
        ),
    }
}
