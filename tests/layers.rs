//! The layering rule of docs/ARCHITECTURE.md, checked against the source: no
//! module of a lower layer names a higher one in a `crate::` path.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let p = e.expect("directory entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every `crate::X` in `layer`'s files where X is in `forbidden`.
fn violations(layer: &str, forbidden: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(layer);
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(!files.is_empty(), "no sources under {}", root.display());
    let mut bad = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read source");
        for (n, line) in text.lines().enumerate() {
            for m in forbidden {
                if line.contains(&format!("crate::{m}")) {
                    bad.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                }
            }
        }
    }
    bad
}

const ABOVE_ENGINE: &[&str] = &[
    "frontend", "reactor", "daemon", "server", "control", "ring", "metrics",
];

#[test]
fn engine_device_backing_block_never_import_a_layer_above() {
    let mut bad = Vec::new();
    bad.extend(violations("engine", ABOVE_ENGINE));
    bad.extend(violations("device", &[ABOVE_ENGINE, &["engine"]].concat()));
    bad.extend(violations(
        "backing",
        &[ABOVE_ENGINE, &["engine", "device"]].concat(),
    ));
    bad.extend(violations(
        "block",
        &[ABOVE_ENGINE, &["engine", "device", "backing"]].concat(),
    ));
    assert!(bad.is_empty(), "imports running up:\n{}", bad.join("\n"));
}

#[test]
fn ring_and_frontends_never_import_the_reactor_or_the_daemon() {
    let mut bad = violations(
        "ring",
        &[
            "frontend", "reactor", "daemon", "server", "control", "metrics",
        ],
    );
    bad.extend(violations(
        "frontend",
        &["reactor", "daemon", "server", "metrics"],
    ));
    assert!(bad.is_empty(), "imports running up:\n{}", bad.join("\n"));
}

#[test]
fn only_the_server_imports_metrics_and_metrics_never_imports_the_server() {
    let mut bad = Vec::new();
    for m in ["daemon", "reactor", "control", "tls"] {
        bad.extend(violations(m, &["metrics"]));
    }
    bad.extend(violations("metrics", &["server"]));
    assert!(bad.is_empty(), "imports running up:\n{}", bad.join("\n"));
}

#[test]
fn kernel_block_device_helpers_import_nothing_above_backing() {
    let above = [ABOVE_ENGINE, &["engine", "device"]].concat();
    let mut bad = Vec::new();
    for m in ["blockdev", "kernel_nbd", "kernel_loop"] {
        bad.extend(violations(m, &above));
    }
    assert!(bad.is_empty(), "imports running up:\n{}", bad.join("\n"));
}

#[test]
fn tls_imports_nothing_of_loopd() {
    let all = [
        "backing",
        "block",
        "blockdev",
        "control",
        "daemon",
        "device",
        "engine",
        "frontend",
        "kernel_loop",
        "kernel_nbd",
        "reactor",
        "ring",
        "server",
        "size",
    ];
    let bad = violations("tls", &all);
    assert!(
        bad.is_empty(),
        "tls imports loopd modules:\n{}",
        bad.join("\n")
    );
}

#[test]
fn text_imports_nothing_of_loopd() {
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text.rs");
    let text = std::fs::read_to_string(&f).expect("read src/text.rs");
    let bad: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("crate::") || l.contains("super::super"))
        .collect();
    assert!(
        bad.is_empty(),
        "src/text.rs imports loopd:\n{}",
        bad.join("\n")
    );
}
