//! Output formatting: tables and JSON.
//!
//! Human output never prints a string from the daemon (device names, image
//! paths, block devices, messages) as it is: [`s`] and [`esc`] escape it with
//! [`loopd::text::escape`] (controls, line breaks, bidi and invisible
//! characters as `\n`, `\u{202e}`…, a backslash as `\\`), so a name cannot
//! forge a table row or reach the terminal as a control sequence. JSON output
//! (`--json`) is serde's, byte for byte what the daemon sent.
//!
//! Sizes: JSON carries bytes (and `null` for no size limit). Text gives them
//! a human form by [`loopd::size`]'s one rule: `64 MiB (67108864 bytes)` on
//! `key: value` lines and in messages, `64M` in table cells; `--bytes` (as
//! losetup's and lsblk's) prints plain byte counts for scripts instead. No
//! size limit is the one word `none` in every text form.

use anyhow::Result;
use loopd::device::stats::{COUNTERS, Group};
use serde_json::Value;

/// `v[k]` for human output: a string escaped, `-` for null, else as JSON.
fn s(v: &Value, k: &str) -> String {
    match &v[k] {
        Value::String(x) => esc(x),
        Value::Null => "-".into(),
        x => esc(&x.to_string()),
    }
}

/// An untrusted string for a terminal (see the module doc).
pub fn esc(x: &str) -> String {
    loopd::text::escape(x).into_owned()
}

/// No size limit, in every text form.
const NO_LIMIT: &str = "none";

/// How text output writes sizes (see the module doc).
#[derive(Clone, Copy)]
pub struct Sizes {
    /// `--bytes`: plain byte counts.
    pub bytes: bool,
}

impl Sizes {
    /// A size on a `key: value` line or in a message.
    fn long(self, n: u64) -> String {
        if self.bytes {
            n.to_string()
        } else {
            loopd::size::human_exact(n)
        }
    }

    /// A size in a sentence: as [`Sizes::long`], with `bytes` after a plain count.
    fn said(self, n: u64) -> String {
        if self.bytes {
            format!("{n} bytes")
        } else {
            loopd::size::human_exact(n)
        }
    }

    /// A size in a table cell.
    fn cell(self, n: u64) -> String {
        if self.bytes {
            n.to_string()
        } else {
            loopd::size::human_short(n)
        }
    }

    /// `v[k]`, a size, as [`Sizes::long`] (`-` if absent).
    fn long_of(self, v: &Value, k: &str) -> String {
        v[k].as_u64().map_or_else(|| "-".into(), |n| self.long(n))
    }

    /// `v[k]`, a size, as [`Sizes::cell`] (`-` if absent).
    fn cell_of(self, v: &Value, k: &str) -> String {
        v[k].as_u64().map_or_else(|| "-".into(), |n| self.cell(n))
    }

    /// A config field's value in a sentence (`reload`'s changes): sizes as
    /// [`Sizes::said`], no size limit and the default block size as words,
    /// booleans as yes/no.
    pub fn value(self, field: &str, v: &Value) -> String {
        match (field, v) {
            ("size_limit", Value::Null) => NO_LIMIT.into(),
            ("block_size", Value::Null) => "default".into(),
            ("size_limit" | "offset", Value::Number(n)) => {
                n.as_u64().map_or_else(|| n.to_string(), |n| self.said(n))
            }
            (_, Value::Bool(b)) => if *b { "yes" } else { "no" }.into(),
            (_, Value::String(x)) => esc(x),
            (_, x) => esc(&x.to_string()),
        }
    }

    /// A size limit (`null`: none), as `f` writes a size.
    fn limit(self, v: &Value, f: fn(Sizes, u64) -> String) -> String {
        v["size_limit"]
            .as_u64()
            .map_or_else(|| NO_LIMIT.into(), |n| f(self, n))
    }
}

fn yn(v: &Value, k: &str) -> &'static str {
    if v[k].as_bool().unwrap_or(false) {
        "yes"
    } else {
        "no"
    }
}

fn pretty(v: &Value) -> Result<String> {
    Ok(serde_json::to_string_pretty(v)?)
}

/// `detach`, `reload-tls`: the daemon's reply as JSON, or one line of text.
pub fn print_done(v: &Value, json: bool, text: &str) -> Result<()> {
    if json {
        println!("{}", pretty(v)?);
    } else {
        println!("{}", esc(text));
    }
    Ok(())
}

/// `attach`: the name, then one URI per line.
pub fn print_device(v: &Value, json: bool) -> Result<()> {
    if json {
        println!("{}", pretty(v)?);
        return Ok(());
    }
    if v["write_protected"].as_bool().unwrap_or(false) {
        eprintln!(
            "loopd: note: {} is write-protected: the device is read-only",
            s(v, "image")
        );
    }
    if let Some(n) = v["note"].as_str() {
        eprintln!("loopd: note: {}", esc(n));
    }
    println!("{}", s(v, "name"));
    if let Some(b) = v["blockdev"].as_str() {
        println!("{}", esc(b));
    }
    for p in v["partitions"].as_array().into_iter().flatten() {
        println!("{}", esc(p.as_str().unwrap_or_default()));
    }
    for u in v["uris"].as_array().into_iter().flatten() {
        println!("{}", esc(u.as_str().unwrap_or_default()));
    }
    Ok(())
}

/// `list`: a table like `losetup --list`.
pub fn print_list(v: &Value, json: bool, sz: Sizes) -> Result<()> {
    let devs = v["devices"].as_array().cloned().unwrap_or_default();
    if json {
        println!("{}", pretty(&Value::Array(devs))?);
        return Ok(());
    }
    let header = [
        "NAME",
        "SIZE",
        "OFFSET",
        "SIZELIMIT",
        "BLOCK",
        "CACHE",
        "DIO",
        "RO",
        "AUTOCLEAR",
        "CLIENTS",
        "BLOCKDEV",
        "IMAGE",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for d in &devs {
        if d["state"].as_str() == Some("missing") {
            // Not attached: its recorded configuration, and why.
            rows.push(vec![
                s(d, "name"),
                "-".into(),
                sz.cell_of(d, "offset"),
                sz.limit(d, Sizes::cell),
                "-".into(),
                s(d, "cache"),
                "-".into(),
                yn(d, "read_only").into(),
                yn(d, "autoclear").into(),
                "-".into(),
                "-".into(),
                format!("{} (missing: {})", s(d, "image"), s(d, "reason")),
            ]);
            continue;
        }
        rows.push(vec![
            s(d, "name"),
            sz.cell_of(d, "size"),
            sz.cell_of(d, "offset"),
            sz.limit(d, Sizes::cell),
            s(d, "block_size"),
            s(d, "cache"),
            yn(d, "direct").into(),
            yn(d, "read_only").into(),
            yn(d, "autoclear").into(),
            s(d, "clients"),
            esc(d["blockdev"].as_str().unwrap_or("-")),
            s(d, "image"),
        ]);
    }
    print_table(&rows);
    Ok(())
}

/// `status`: configuration and counters as `key: value` lines.
pub fn print_status(v: &Value, json: bool, sz: Sizes) -> Result<()> {
    if json {
        println!("{}", pretty(v)?);
        return Ok(());
    }
    if v["state"].as_str() == Some("missing") {
        println!("name: {}", s(v, "name"));
        println!("image: {}", s(v, "image"));
        println!("state: missing: {}", s(v, "reason"));
        return Ok(());
    }
    println!("name: {}", s(v, "name"));
    println!("image: {}", s(v, "image"));
    println!("size: {}", sz.long_of(v, "size"));
    println!("offset: {}", sz.long_of(v, "offset"));
    println!("size_limit: {}", sz.limit(v, Sizes::long));
    println!("file_size: {}", sz.long_of(v, "file_size"));
    println!("block_size: {}", s(v, "block_size"));
    println!("cache: {}", s(v, "cache"));
    println!("strict_block_size: {}", yn(v, "strict_block_size"));
    println!("direct: {}", yn(v, "direct"));
    println!("read_only: {}", yn(v, "read_only"));
    println!("autoclear: {}", yn(v, "autoclear"));
    println!("clients: {}", s(v, "clients"));
    if let Some(b) = v["blockdev"].as_str() {
        println!("blockdev: {}", esc(b));
    }
    for k in ["ublk_fast_paths", "ublk_kernel_features"] {
        if let Some(names) = v[k].as_array() {
            let names: Vec<String> = names.iter().filter_map(Value::as_str).map(esc).collect();
            let shown = if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(" ")
            };
            println!("{k}: {shown}");
        }
    }
    let allow: Vec<String> = v["tls_allow"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(esc)
        .collect();
    if !allow.is_empty() {
        println!("tls_allow: {}", allow.join(" "));
    }
    println!("in_flight: {}", s(v, "in_flight"));
    println!("budget_held: {}", sz.long_of(v, "budget_held"));
    // Counters in the order they are declared (the JSON objects are sorted).
    for g in [Group::Requests, Group::Bytes, Group::Paths] {
        let parts: Vec<String> = COUNTERS
            .iter()
            .filter(|c| c.group == g)
            .map(|c| format!("{}={}", c.key, s(&v[g.name()], c.key)))
            .collect();
        println!("{}: {}", g.name(), parts.join(" "));
    }
    let errors: Vec<String> = v["errors"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, n)| esc(&format!("{k}={n}")))
        .collect();
    println!("errors: {}", errors.join(" "));
    for c in COUNTERS.iter().filter(|c| c.group == Group::Single) {
        println!("{}: {}", c.key, s(v, c.key));
    }
    println!("bytes_read: {}", sz.long_of(v, "bytes_read"));
    println!("bytes_written: {}", sz.long_of(v, "bytes_written"));
    let l = &v["latency"];
    println!(
        "latency_us: p50={} p99={} max={}",
        s(l, "p50_us"),
        s(l, "p99_us"),
        s(l, "max_us")
    );
    Ok(())
}

/// `status` without a name: one row per device (`--json`: the array of status
/// objects).
pub fn print_status_all(v: &Value, json: bool, sz: Sizes) -> Result<()> {
    let devs = v["devices"].as_array().cloned().unwrap_or_default();
    if json {
        println!("{}", pretty(&Value::Array(devs))?);
        return Ok(());
    }
    let header = [
        "NAME", "STATE", "CLIENTS", "INFLIGHT", "READS", "WRITES", "RBYTES", "WBYTES", "ERRORS",
        "P99US", "BUDGET", "IMAGE",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for d in &devs {
        let errors: u64 = d["errors"]
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(_, n)| n.as_u64())
            .sum();
        rows.push(vec![
            s(d, "name"),
            s(d, "state"),
            s(d, "clients"),
            s(d, "in_flight"),
            d["requests"]["read"].as_u64().unwrap_or(0).to_string(),
            d["requests"]["write"].as_u64().unwrap_or(0).to_string(),
            sz.cell_of(d, "bytes_read"),
            sz.cell_of(d, "bytes_written"),
            errors.to_string(),
            s(&d["latency"], "p99_us"),
            sz.cell_of(d, "budget_held"),
            s(d, "image"),
        ]);
    }
    print_table(&rows);
    Ok(())
}

/// Left-aligned columns, one space apart, one line per row: every cell is
/// escaped here too (a no-op on cells [`s`] made), whatever its source.
fn print_table(rows: &[Vec<String>]) {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| esc_once(c)).collect())
        .collect();
    let cols = rows.first().map(Vec::len).unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|i| {
            rows.iter()
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", line.join(" ").trim_end());
    }
}

/// A cell that may already be escaped: only what would still reach the
/// terminal raw is escaped (backslashes are left as they are).
fn esc_once(c: &str) -> String {
    loopd::text::sanitize_line(c).into_owned()
}

/// `set` / `resize`: what changed and how long the device was held, or why
/// nothing changed; and when the size limit caps the file, which part of it.
pub fn print_set(v: &Value, json: bool, sz: Sizes) -> Result<()> {
    if json {
        println!("{}", pretty(v)?);
        return Ok(());
    }
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let name = s(v, "name");
    let note = v["note"].as_str().map(esc);
    if v["changed"].as_bool().unwrap_or(false) {
        println!(
            "{name}: updated (size {}, offset {}, block size {}, read-only {}); requests held {} µs",
            sz.said(n("size")),
            sz.said(n("offset")),
            s(v, "block_size"),
            yn(v, "read_only"),
            s(v, "quiesced_us")
        );
        if let Some(n) = note {
            println!("{name}: note: {n}");
        }
    } else {
        match note {
            Some(n) => println!("{name}: nothing to change: {n}"),
            None => println!("{name}: nothing to change"),
        }
    }
    if v["capped_by_size_limit"].as_bool().unwrap_or(false) {
        // The part of the file after the offset is what the limit caps.
        let (limit, offset, file) = (n("size_limit"), n("offset"), n("file_size"));
        if offset == 0 {
            println!(
                "{name}: size limit {} caps the file's {}",
                sz.said(limit),
                sz.said(file)
            );
        } else {
            println!(
                "{name}: size limit {} caps the {} of the file after offset {} (the file is {})",
                sz.said(limit),
                sz.said(file.saturating_sub(offset)),
                sz.said(offset),
                sz.said(file),
            );
        }
    }
    Ok(())
}
