//! The layering rules of docs/ARCHITECTURE.md, checked against the source.
//!
//! Every `.rs` file under `src/` is read, its comments and literals dropped,
//! and every path it names is resolved to the *file* that defines it:
//!
//! - paths starting with `crate::`, `super::` (any number, `super::super::`),
//!   `self::`, and `use` paths starting with the name of a child module;
//! - grouped uses are expanded (`use crate::{a::b, c::{d, self}}` names
//!   `a::b`, `c::d` and `c`), `pub use` counts like `use`, and so do paths in
//!   expressions and types (`crate::blockdev::users::settled_users(..)`);
//! - a path resolves to the longest prefix of its module path that is a file:
//!   `crate::daemon::state::StateLog` → `src/daemon/state.rs`,
//!   `crate::daemon::Daemon` → `src/daemon/mod.rs` (a re-export names the
//!   file that re-exports it, not the file that defines the item).
//!
//! `src/main.rs` and the modules it declares (`cli`) are a second crate: there
//! `crate::` is `main.rs`. Test code — an inline `#[cfg(test)]` item, or a
//! file declared by `#[cfg(test)] mod x;` — may import its parent (its
//! `use super::*` is how it reaches what it tests); it is left out of the
//! rules on upward imports and circles, but not out of the rules between
//! layers. Paths through a `use … as` alias or a bare name brought in by
//! another `use` are seen at that `use`, which is enough for every rule here.
//!
//! The rules:
//!
//! 1. **No upward import between layers**: a lower layer never names a higher
//!    one (the lists below).
//! 2. **No upward import inside a folder**: a file never names an item of a
//!    file that is its ancestor in the module tree — its folder's `mod.rs`,
//!    the `x.rs` whose `x/` folder it sits in, or `lib.rs`/`main.rs`. A parent
//!    declares, documents and re-exports its children and may use them; the
//!    children reach each other directly (`super::sibling::Item`), never
//!    through the parent (`super::Item`, even a re-exported one).
//! 3. **No import circle**: the graph of files (non-test edges) has no cycle,
//!    nor has the graph of top-level modules (`daemon` → `reactor` → …).
//! 4. **No file over [`MAX_CODE_LINES`] lines of code** (lines holding
//!    anything but whitespace and comments). A file's inline test module counts
//!    with it: tests that push a file over the limit move to a `tests.rs`
//!    child (`#[cfg(test)] mod tests;`), itself under the limit. The rule
//!    covers `src/`; the integration tests under `tests/` are not counted.
//!
//! [`EXCEPTIONS`] lists the violations other parts of issue 23 are removing;
//! an exception that no longer matches fails the test too, so the list only
//! shrinks.

mod layering;

use layering::lex::{Tok, lex};
use layering::tree::Tree;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The most lines of code a source file may hold.
const MAX_CODE_LINES: usize = 600;

/// A known violation, with the part of issue 23 that removes it.
struct Exception {
    rule: Rule,
    /// The file, relative to the repository (`src/…`).
    file: &'static str,
    /// For an upward import: the ancestor it names; for a circle: the other
    /// files of the circle, sorted; for a size: empty.
    other: &'static [&'static str],
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Rule {
    Upward,
    Circle,
    Size,
}

const EXCEPTIONS: &[Exception] = &[];

fn tree() -> Tree {
    Tree::load(Path::new(env!("CARGO_MANIFEST_DIR")))
}

/// Whether `EXCEPTIONS` holds (rule, file, other); marks it used.
fn excepted(used: &mut BTreeSet<usize>, rule: Rule, file: &str, other: &[String]) -> bool {
    let hit = EXCEPTIONS.iter().position(|x| {
        x.rule == rule
            && x.file == file
            && x.other.len() == other.len()
            && x.other.iter().zip(other).all(|(a, b)| a == b)
    });
    if let Some(i) = hit {
        used.insert(i);
    }
    hit.is_some()
}

// ---------------------------------------------------------------- the rules

const ABOVE_ENGINE: &[&str] = &[
    "frontend", "reactor", "daemon", "server", "control", "ring", "metrics",
];

#[test]
fn engine_device_backing_block_never_import_a_layer_above() {
    let t = tree();
    let mut bad = Vec::new();
    bad.extend(t.between_layers("engine", ABOVE_ENGINE));
    bad.extend(t.between_layers("device", &[ABOVE_ENGINE, &["engine"]].concat()));
    bad.extend(t.between_layers("backing", &[ABOVE_ENGINE, &["engine", "device"]].concat()));
    bad.extend(t.between_layers(
        "block",
        &[ABOVE_ENGINE, &["engine", "device", "backing"]].concat(),
    ));
    assert!(bad.is_empty(), "imports running up:\n{}", bad.join("\n"));
}

#[test]
fn ring_and_frontends_never_import_the_reactor_or_the_daemon() {
    let t = tree();
    let mut bad = t.between_layers(
        "ring",
        &[
            "frontend", "reactor", "daemon", "server", "control", "metrics",
        ],
    );
    bad.extend(t.between_layers("frontend", &["reactor", "daemon", "server", "metrics"]));
    assert!(bad.is_empty(), "imports running up:\n{}", bad.join("\n"));
}

#[test]
fn only_the_server_imports_metrics_and_metrics_never_imports_the_server() {
    let t = tree();
    let mut bad = Vec::new();
    for m in ["daemon", "reactor", "control", "tls"] {
        bad.extend(t.between_layers(m, &["metrics"]));
    }
    bad.extend(t.between_layers("metrics", &["server"]));
    assert!(bad.is_empty(), "imports running up:\n{}", bad.join("\n"));
}

#[test]
fn kernel_block_device_helpers_import_nothing_above_backing() {
    let t = tree();
    let above = [ABOVE_ENGINE, &["engine", "device"]].concat();
    let mut bad = Vec::new();
    for m in ["blockdev", "kernel_nbd", "kernel_loop"] {
        bad.extend(t.between_layers(m, &above));
    }
    assert!(bad.is_empty(), "imports running up:\n{}", bad.join("\n"));
}

/// Every layer of the library but `text` (which imports nothing) and `tls`.
const LOOPD: &[&str] = &[
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
    "metrics",
    "reactor",
    "ring",
    "server",
    "size",
];

#[test]
fn tls_imports_nothing_of_loopd() {
    let t = tree();
    let bad = t.between_layers("tls", LOOPD);
    assert!(
        bad.is_empty(),
        "tls imports loopd modules:\n{}",
        bad.join("\n")
    );
}

#[test]
fn text_imports_nothing_of_loopd() {
    let t = tree();
    let bad = t.between_layers("text", &[LOOPD, &["tls"]].concat());
    assert!(
        bad.is_empty(),
        "src/text.rs imports loopd:\n{}",
        bad.join("\n")
    );
}

#[test]
fn no_file_imports_an_item_of_its_ancestor() {
    let t = tree();
    let mut used = BTreeSet::new();
    let mut bad = Vec::new();
    for (from, to, how) in t.upward() {
        if !excepted(&mut used, Rule::Upward, &from, &[to]) {
            bad.push(how);
        }
    }
    assert!(
        bad.is_empty(),
        "upward imports inside a folder (a child reaches its siblings directly, never \
         through its parent's file):\n{}",
        bad.join("\n")
    );
    stale(Rule::Upward, &used);
}

#[test]
fn no_import_circle_between_files() {
    let t = tree();
    let mut used = BTreeSet::new();
    let mut bad = Vec::new();
    for (files, how) in t.file_circles() {
        let (first, rest) = files.split_first().expect("a circle has files");
        if !excepted(&mut used, Rule::Circle, first, rest) {
            bad.push(format!("{}:\n  {}", files.join(" ↔ "), how.join("\n  ")));
        }
    }
    assert!(bad.is_empty(), "import circles:\n{}", bad.join("\n"));
    stale(Rule::Circle, &used);
}

#[test]
fn no_import_circle_between_layers() {
    let bad = tree().layer_circles();
    assert!(bad.is_empty(), "import circles between layers: {bad:?}");
}

#[test]
fn no_source_file_over_the_limit() {
    let t = tree();
    let mut used = BTreeSet::new();
    let mut bad = Vec::new();
    for (f, n) in t.too_long(MAX_CODE_LINES) {
        if !excepted(&mut used, Rule::Size, &f, &[]) {
            bad.push(format!("{f}: {n} lines of code (at most {MAX_CODE_LINES})"));
        }
    }
    assert!(bad.is_empty(), "files over the limit:\n{}", bad.join("\n"));
    stale(Rule::Size, &used);
}

/// Fail on an exception of `rule` that matched nothing: it is fixed, remove it.
fn stale(rule: Rule, used: &BTreeSet<usize>) {
    let stale: Vec<String> = EXCEPTIONS
        .iter()
        .enumerate()
        .filter(|(i, x)| x.rule == rule && !used.contains(i))
        .map(|(_, x)| format!("{:?} {} {:?}", x.rule, x.file, x.other))
        .collect();
    assert!(
        stale.is_empty(),
        "exceptions no longer needed (remove them from EXCEPTIONS):\n{}",
        stale.join("\n")
    );
}

/// `daemon/`'s files that extend `Daemon`, in the order of `daemon/mod.rs`'s
/// documentation: each calls methods of the files before it only.
const DAEMON_ORDER: &[&str] = &[
    "registry", "record", "kernel", "detach", "attach", "set", "restore", "follow", "janitor",
    "reload", "request",
];

/// The methods each of `files` defines in its `impl Daemon` blocks, and the
/// `self.method(` calls made there (with their line).
fn daemon_methods(src: &str) -> (Vec<String>, Vec<(String, usize)>) {
    let toks = lex(src);
    let (mut defs, mut calls) = (Vec::new(), Vec::new());
    let mut depth = 0usize;
    // The depth at which an `impl Daemon` block opened.
    let mut in_impl: Option<usize> = None;
    for (i, t) in toks.iter().enumerate() {
        let at = |k: usize| toks.get(k).map(|t| &t.tok);
        let ident = |k: usize| match at(k) {
            Some(Tok::Ident(s)) => Some(s.as_str()),
            _ => None,
        };
        match &t.tok {
            Tok::Punct('{') => {
                if in_impl.is_none()
                    && i >= 2
                    && ident(i - 1) == Some("Daemon")
                    && ident(i - 2) == Some("impl")
                {
                    in_impl = Some(depth);
                }
                depth += 1;
            }
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if in_impl == Some(depth) {
                    in_impl = None;
                }
            }
            Tok::Ident(k) if in_impl.is_some() && k == "fn" => {
                if let Some(name) = ident(i + 1) {
                    defs.push(name.to_string());
                }
            }
            Tok::Ident(k)
                if in_impl.is_some()
                    && k == "self"
                    && at(i + 1) == Some(&Tok::Punct('.'))
                    && at(i + 3) == Some(&Tok::Punct('(')) =>
            {
                if let Some(name) = ident(i + 2) {
                    calls.push((name.to_string(), t.line));
                }
            }
            _ => {}
        }
    }
    (defs, calls)
}

/// `impl Daemon` spans several files (one per kind of work); the calls
/// between them, which no import shows, run one way: down `DAEMON_ORDER`.
#[test]
fn daemon_files_call_only_the_files_before_them() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/daemon");
    let mut owner: BTreeMap<String, usize> = BTreeMap::new();
    let mut all_calls = Vec::new();
    for (k, f) in DAEMON_ORDER.iter().enumerate() {
        let src = std::fs::read_to_string(dir.join(format!("{f}.rs")))
            .unwrap_or_else(|e| panic!("read src/daemon/{f}.rs: {e}"));
        let (defs, calls) = daemon_methods(&src);
        assert!(!defs.is_empty(), "src/daemon/{f}.rs has no `impl Daemon`");
        for d in defs {
            if let Some(other) = owner.insert(d.clone(), k) {
                panic!("Daemon::{d} in {} and {f}", DAEMON_ORDER[other]);
            }
        }
        all_calls.extend(calls.into_iter().map(|(c, line)| (k, c, line)));
    }
    // Every other file of daemon/ with an `impl Daemon` must be in the list.
    for e in std::fs::read_dir(&dir).expect("read src/daemon") {
        let p = e.expect("entry").path();
        let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned());
        if p.extension().is_some_and(|x| x == "rs")
            && let Some(stem) = stem
            && !DAEMON_ORDER.contains(&stem.as_str())
        {
            let src = std::fs::read_to_string(&p).expect("read source");
            assert!(
                daemon_methods(&src).0.is_empty(),
                "src/daemon/{stem}.rs extends Daemon: add it to DAEMON_ORDER"
            );
        }
    }
    let bad: Vec<String> = all_calls
        .into_iter()
        .filter_map(|(k, c, line)| {
            let o = *owner.get(&c)?;
            (o > k).then(|| {
                format!(
                    "src/daemon/{}.rs:{line}: calls Daemon::{c} of {}.rs, listed after it",
                    DAEMON_ORDER[k], DAEMON_ORDER[o]
                )
            })
        })
        .collect();
    assert!(
        bad.is_empty(),
        "calls running up the daemon's files:\n{}",
        bad.join("\n")
    );
}

#[test]
fn daemon_call_order_check_sees_calls_in_impl_blocks_only() {
    let (defs, calls) = daemon_methods(
        "impl Daemon { fn a(&self) { self.b(); x.c(); } }\nimpl Other { fn d(&self) { self.e(); } }",
    );
    assert_eq!(defs, vec!["a".to_string()]);
    assert_eq!(calls, vec![("b".to_string(), 1)]);
}

/// The exceptions name files that exist (a typo would never match).
#[test]
fn exceptions_name_real_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for x in EXCEPTIONS {
        for f in std::iter::once(&x.file).chain(x.other) {
            assert!(
                root.join(f).is_file(),
                "EXCEPTIONS names {f}, which does not exist"
            );
        }
    }
}
