//! `loopd reload`: the report of a `reload` request (TLS certificates and the
//! `--config` file re-read, as SIGHUP does), as text or JSON; exits non-zero
//! when a device could not be attached or changed.

use anyhow::Result;
use loopd::text::sanitize_line;
use serde_json::Value;

/// Print the daemon's reload report; an error when a device could not be
/// attached or changed (after the report).
pub fn print(v: &Value, json: bool, sz: super::print::Sizes) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(v)?);
    } else {
        print_text(v, sz);
    }
    let failed = v
        .get("failed")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    if failed == 0 {
        return Ok(());
    }
    let msg = format!("the reload could not attach or change {failed} device(s)");
    if json {
        // The report is the one JSON document on stdout; no error object after it.
        use std::io::Write;
        let _ = std::io::stdout().flush();
        eprintln!("loopd: error: {msg}");
        std::process::exit(super::exit::OTHER.into());
    }
    anyhow::bail!("{msg}")
}

/// The label of the devices gone from the file but still attached: what
/// becomes of them, and what to do.
const KEPT_LABEL: &str = "kept though no longer in the file (attached until the server stops, \
                          not at its next start; detach it to remove it now, or put it back \
                          in the file to keep it)";

/// One changed device: `c1: size-limit 50 MiB (52428800 bytes) → none,
/// cache direct → buffered` (the name alone if the daemon did not say).
fn changed_line(name: &str, v: &Value, sz: super::print::Sizes) -> String {
    let fields = v
        .get("changes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|c| c.get("fields"))
        .and_then(Value::as_array);
    let name = super::print::esc(name);
    let Some(fields) = fields.filter(|f| !f.is_empty()) else {
        return name;
    };
    let parts: Vec<String> = fields
        .iter()
        .map(|f| {
            let key = f.get("field").and_then(Value::as_str).unwrap_or("?");
            let val = |k: &str| sz.value(key, f.get(k).unwrap_or(&Value::Null));
            format!(
                "{} {} → {}",
                super::print::esc(&key.replace('_', "-")),
                val("from"),
                val("to")
            )
        })
        .collect();
    format!("{name}: {}", parts.join(", "))
}

fn print_text(v: &Value, sz: super::print::Sizes) {
    let names = |k: &str| -> Vec<String> {
        v.get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(super::print::esc))
                    .collect()
            })
            .unwrap_or_default()
    };
    let tls = v.get("tls").and_then(Value::as_str).unwrap_or("?");
    println!("TLS certificates: {}", sanitize_line(tls));
    let Some(cfg) = v.get("config").and_then(Value::as_str) else {
        println!("config: none (the server runs without --config)");
        return;
    };
    println!("config: {}", super::print::esc(cfg));
    for n in v
        .get("changed")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(n) = n.as_str() {
            println!("changed: {}", changed_line(n, v, sz));
        }
    }
    for (key, label) in [
        ("attached", "attached"),
        ("unchanged", "unchanged"),
        ("kept", KEPT_LABEL),
    ] {
        let n = names(key);
        if !n.is_empty() {
            println!("{label}: {}", n.join(", "));
        }
    }
    for (key, label) in [("not_applied", "not applied"), ("failed", "failed")] {
        for p in v.get(key).and_then(Value::as_array).into_iter().flatten() {
            let name = p.get("name").and_then(Value::as_str).unwrap_or("?");
            let msg = p.get("message").and_then(Value::as_str).unwrap_or("");
            println!(
                "{label}: {}: {}",
                super::print::esc(name),
                sanitize_line(msg)
            );
        }
    }
}
