//! Durable attaches (issue 25): group commit and batches, before and after.

use super::{Ctl, loop_configure_us, loopd_bin, spec, start_bin, stats, us};
use loopd::control::proto::{Request, encode_request};
use std::io::{BufRead, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const CLIENTS: usize = 16;
const PER_CLIENT: usize = 64;
const BATCH: usize = 1000;
const SINGLES: usize = 100;

fn images(d: &Path, prefix: &str, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = d.join(format!("{prefix}{i}.img"));
            std::fs::File::create(&p)
                .and_then(|f| f.set_len(1 << 20))
                .expect("image");
            p
        })
        .collect()
}

/// One binary's round: (µs per device with 16 clients, ms for 1,000 in a
/// batch — or as single requests if `batch` is false, single attach µs).
fn round(bin: &Path, d: &Path, tag: &str, imgs: &Imgs, batch: bool) -> (f64, f64, Vec<f64>) {
    let dir = d.join(tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let state = dir.join("s.state");
    let (daemon, _) = start_bin(bin, &dir, &["--state", state.to_str().expect("utf-8")]);
    let ctl = dir.join("nbd.ctl");

    // Single attaches on an otherwise idle daemon.
    let mut conn = Ctl::connect(&ctl);
    let mut single = Vec::new();
    for (i, img) in imgs.single.iter().enumerate() {
        std::thread::sleep(Duration::from_millis(1));
        let t = Instant::now();
        conn.call(&Request::Attach(Box::new(spec(img, &format!("one{i}")))));
        single.push(us(t.elapsed()));
    }
    // 16 clients at once.
    let go = Arc::new(Barrier::new(CLIENTS + 1));
    let threads: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (go, ctl) = (Arc::clone(&go), ctl.clone());
            let mine: Vec<PathBuf> = imgs.storm[c * PER_CLIENT..(c + 1) * PER_CLIENT].to_vec();
            std::thread::spawn(move || {
                let mut conn = Ctl::connect(&ctl);
                go.wait();
                for (k, img) in mine.iter().enumerate() {
                    let name = format!("s{c}-{k}");
                    conn.call(&Request::Attach(Box::new(spec(img, &name))));
                }
                Instant::now()
            })
        })
        .collect();
    go.wait();
    let t0 = Instant::now();
    let end = threads
        .into_iter()
        .map(|t| t.join().expect("client"))
        .max()
        .expect("clients");
    let storm_us = us(end - t0) / (CLIENTS * PER_CLIENT) as f64;

    // 1,000 in one request (or one after another, for a loopd without batches).
    let t = Instant::now();
    if batch {
        let devices = imgs
            .batch
            .iter()
            .enumerate()
            .map(|(i, img)| spec(img, &format!("b{i}")))
            .collect();
        let reply = conn.call(&Request::AttachBatch { devices });
        assert!(
            !reply.contains("\"ok\":false"),
            "a device of the batch failed: {}",
            &reply[..reply.len().min(2000)]
        );
    } else {
        for (i, img) in imgs.batch.iter().enumerate() {
            conn.call(&Request::Attach(Box::new(spec(img, &format!("b{i}")))));
        }
    }
    let batch_ms = t.elapsed().as_secs_f64() * 1e3;

    drop(conn);
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
    (storm_us, batch_ms, single)
}

struct Imgs {
    storm: Vec<PathBuf>,
    batch: Vec<PathBuf>,
    single: Vec<PathBuf>,
}

/// `n` appends of a state-record-sized line, each followed by `fdatasync`,
/// on the filesystem of `d` (µs each).
fn bare_fdatasync(d: &Path, n: usize) -> Vec<f64> {
    let p = d.join("bare-sync.log");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&p)
        .expect("sync file");
    let line = [b'x'; 200];
    let v = (0..n)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(1));
            let t = Instant::now();
            f.write_all(&line).expect("write");
            f.sync_data().expect("fdatasync");
            us(t.elapsed())
        })
        .collect();
    let _ = std::fs::remove_file(&p);
    v
}

/// `n` in-process `LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE` (µs each), if root.
fn loop_configure(image: &Path, n: usize) -> Option<Vec<f64>> {
    let root = rustix::process::geteuid().is_root() && Path::new("/dev/loop-control").exists();
    root.then(|| (0..n).map(|_| loop_configure_us(image)).collect())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Whether `bin` answers an `attach_batch` request (an older loopd does not).
fn has_batch(bin: &Path, d: &Path) -> bool {
    let dir = d.join("probe");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let state = dir.join("s.state");
    let (daemon, _) = start_bin(bin, &dir, &["--state", state.to_str().expect("utf-8")]);
    let s = std::os::unix::net::UnixStream::connect(dir.join("nbd.ctl")).expect("control");
    let mut w = s.try_clone().expect("clone");
    let line = encode_request(&Request::AttachBatch { devices: vec![] });
    w.write_all(format!("{line}\n").as_bytes()).expect("send");
    let mut reply = String::new();
    std::io::BufReader::new(s)
        .read_line(&mut reply)
        .expect("reply");
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
    reply.contains("\"ok\":true")
}

/// Section 5 of the report.
pub fn section(d: &Path) {
    let rounds: usize = std::env::var("BENCH_GC_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let after = loopd_bin();
    let before = std::env::var_os("BENCH_LOOPD_BEFORE").map(PathBuf::from);
    let imgs = Imgs {
        storm: images(d, "storm", CLIENTS * PER_CLIENT),
        batch: images(d, "batch", BATCH),
        single: images(d, "single", SINGLES),
    };
    let mut bins = vec![("after", after.clone())];
    if let Some(b) = before {
        bins.insert(0, ("before", b));
    }
    let batch_ok: Vec<bool> = bins.iter().map(|(_, b)| has_batch(b, d)).collect();
    // Per binary: storm µs/device, batch ms, single-attach medians (per round).
    let mut res: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> =
        bins.iter().map(|_| Default::default()).collect();
    let (mut sync, mut lc) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        // Alternate which binary goes first.
        let order: Vec<usize> = if r % 2 == 0 {
            (0..bins.len()).collect()
        } else {
            (0..bins.len()).rev().collect()
        };
        for i in order {
            let (tag, bin) = &bins[i];
            let (s, b, one) = round(bin, d, &format!("{tag}-{r}"), &imgs, batch_ok[i]);
            res[i].0.push(s);
            res[i].1.push(b);
            res[i].2.push(median(one));
        }
        sync.push(median(bare_fdatasync(d, SINGLES)));
        if let Some(v) = loop_configure(&imgs.single[0], SINGLES) {
            lc.push(median(v));
        }
    }
    println!();
    println!(
        "## Durable attaches: group commit and batches ({rounds} alternating rounds; medians of \
         the rounds' values)\n"
    );
    let head: Vec<String> = bins
        .iter()
        .map(|(t, b)| format!("{t} (`{}`)", b.display()))
        .collect();
    println!("| case | {} |", head.join(" | "));
    println!("|---|{}", "---:|".repeat(bins.len()));
    let row = |what: &str, k: usize| {
        let cells: Vec<String> = res
            .iter()
            .map(|r| {
                let v = match k {
                    0 => &r.0,
                    1 => &r.1,
                    _ => &r.2,
                };
                let (m, _, _) = stats(v.clone());
                format!("{m:.1}")
            })
            .collect();
        println!("| {what} | {} |", cells.join(" | "));
    };
    row(
        &format!(
            "attach, durable, {CLIENTS} control clients × {PER_CLIENT} at once: µs per device (wall / devices)"
        ),
        0,
    );
    let how: Vec<&str> = batch_ok
        .iter()
        .map(|b| {
            if *b {
                "one attach_batch"
            } else {
                "single requests"
            }
        })
        .collect();
    row(
        &format!("{BATCH} attaches, durable: ms in all ({})", how.join(" / ")),
        1,
    );
    row(
        &format!("a single attach on an idle daemon: µs (median of {SINGLES})"),
        2,
    );
    println!();
    let (s, _, _) = stats(sync);
    println!(
        "Same run: a bare `write` + `fdatasync` of a 200-byte line on the same filesystem: median {s:.0} µs."
    );
    if !lc.is_empty() {
        let (l, _, _) = stats(lc);
        println!("Same run: in-process `LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE`: median {l:.0} µs.");
    }
}
