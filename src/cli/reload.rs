//! `loopd reload`: the report of a `reload` request (TLS certificates and the
//! `--config` file re-read, as SIGHUP does), as text or JSON; exits non-zero
//! when a device could not be attached or changed.

use anyhow::Result;
use loopd::text::sanitize_line;
use serde_json::Value;

/// Print the daemon's reload report; an error when a device could not be
/// attached or changed (after the report).
pub fn print(v: &Value, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(v)?);
    } else {
        print_text(v);
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

fn print_text(v: &Value) {
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
    for (key, label) in [
        ("attached", "attached"),
        ("changed", "changed"),
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
