//! The checker's own tests: the parser on strings, the rules on a small fake
//! tree with each kind of violation.

use super::lex::code_lines;
use super::paths::parse;
use super::tree::{File, Tree};

/// The limit of `tests/layers.rs`, for the size test.
const MAX_CODE_LINES: usize = 600;

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// The absolute paths `src` names from module `module`, as `a::b` strings.
fn named(src: &str, module: &[&str], children: &[&str]) -> Vec<(String, bool)> {
    parse(src, &strs(module), &strs(children))
        .named
        .into_iter()
        .map(|n| (n.path.join("::"), n.test))
        .collect()
}

fn plain(v: &[&str]) -> Vec<(String, bool)> {
    v.iter().map(|s| (s.to_string(), false)).collect()
}

#[test]
fn parser_expands_grouped_uses() {
    assert_eq!(
        named(
            "use crate::{a::b, c::{d, e::{self, F}}, g as h};",
            &["x", "y"],
            &[]
        ),
        plain(&["a::b", "c::d", "c::e", "c::e::F", "g"])
    );
    assert_eq!(
        named(
            "pub use crate::m::{self, N};\npub(crate) use self::k::*;",
            &["x"],
            &[]
        ),
        plain(&["m", "m::N", "x::k"])
    );
}

#[test]
fn parser_resolves_super_super_and_self() {
    assert_eq!(
        named(
            "use super::super::z::W;\nuse super::{self as up, Q};\nuse self::k::L;",
            &["x", "y", "w"],
            &[]
        ),
        plain(&["x::z::W", "x::y", "x::y::Q", "x::y::w::k::L"])
    );
    // A visibility names no item.
    assert_eq!(
        named("pub(in crate::x) fn f() {}", &["x", "y"], &[]),
        plain(&[])
    );
    // In a use tree, `super` may also follow `self`.
    assert_eq!(
        named("use self::super::A;", &["x", "y"], &[]),
        plain(&["x::A"])
    );
}

#[test]
fn parser_sees_paths_in_expressions_and_children() {
    assert_eq!(
        named(
            "fn f() { let v = crate::p::q(1); super::r::S { a: 1 }; }\nuse child::{T, U};\nuse std::x;",
            &["x", "y"],
            &["child"]
        ),
        plain(&["p::q", "x::r::S", "x::y::child::T", "x::y::child::U"])
    );
}

#[test]
fn parser_skips_comments_strings_and_chars() {
    let src = r##"
// use crate::a::B;
/* use crate::c::D; /* nested */ use crate::e::F; */
/// [`crate::g::H`]
fn f<'a>(s: &'a str) -> char {
    let _ = "crate::i::J {";
    let _ = r#"super::k::L }"#;
    let _ = b'{';
    '{'
}
use crate::m::N;
"##;
    assert_eq!(named(src, &["x"], &[]), plain(&["m::N"]));
}

#[test]
fn parser_marks_test_code_and_inline_modules() {
    let src = "
use super::A;
#[cfg(test)]
mod tests {
    use super::*;
    use super::super::B;
}
#[cfg(test)]
mod more;
mod inner {
    use super::C;
}
#[cfg(test)]
fn helper() { crate::d::E; }
fn after() { crate::f::G; }
";
    let p = parse(src, &strs(&["x", "y"]), &[]);
    let got: Vec<(String, bool)> = p
        .named
        .into_iter()
        .map(|n| (n.path.join("::"), n.test))
        .collect();
    assert_eq!(
        got,
        vec![
            ("x::A".to_string(), false),
            ("x::y".to_string(), true),
            ("x::B".to_string(), true),
            ("x::y::C".to_string(), false),
            ("d::E".to_string(), true),
            ("f::G".to_string(), false),
        ]
    );
    assert_eq!(p.test_children, strs(&["more"]));
}

#[test]
fn code_lines_leave_out_blanks_and_comments() {
    let src = "//! doc\n\n/* a\n b */\nfn f() {\n    // c\n    let s = \"x\n y\";\n}\n";
    // `fn f() {`, the two lines of the string, `}`.
    assert_eq!(code_lines(src), 4);
}

/// A small tree: `(file name, source)`, the module path from the name.
fn fake(files: &[(&str, &str)]) -> Tree {
    Tree::new(
        files
            .iter()
            .map(|(name, src)| {
                let mut module = vec!["lib".to_string()];
                let rel = name.trim_start_matches("src/").trim_end_matches(".rs");
                module.extend(
                    rel.split('/')
                        .filter(|s| *s != "mod" && *s != "lib")
                        .map(str::to_string),
                );
                File {
                    name: name.to_string(),
                    module,
                    src: src.to_string(),
                }
            })
            .collect(),
    )
}

#[test]
fn checker_finds_upward_imports_circles_and_layer_violations() {
    let t = fake(&[
        ("src/lib.rs", "pub mod a; pub mod b;"),
        ("src/a/mod.rs", "mod x; mod y; pub struct Top;"),
        // Upward, plainly and through a group and super::super.
        ("src/a/x.rs", "use super::{Top, y::Y};"),
        ("src/a/y.rs", "pub struct Y; mod z;"),
        ("src/a/y/z.rs", "fn f() { super::super::Top; }"),
        // A circle between siblings, and one between layers.
        ("src/b/mod.rs", "mod p; mod q; fn g() { crate::a::Top; }"),
        ("src/b/p.rs", "use super::q::Q; pub struct P;"),
        (
            "src/b/q.rs",
            "use crate::b::p::P; pub struct Q; #[cfg(test)] mod tests { use super::super::Z; }",
        ),
        ("src/a/w.rs", "use crate::{b::{p::P}};"),
    ]);
    let up: Vec<(String, String)> = t.upward().into_iter().map(|(f, a, _)| (f, a)).collect();
    assert_eq!(
        up,
        vec![
            ("src/a/x.rs".to_string(), "src/a/mod.rs".to_string()),
            ("src/a/y/z.rs".to_string(), "src/a/mod.rs".to_string()),
        ]
    );
    let circles: Vec<Vec<String>> = t.file_circles().into_iter().map(|(f, _)| f).collect();
    assert_eq!(circles, vec![strs(&["src/b/p.rs", "src/b/q.rs"])]);
    assert_eq!(t.layer_circles(), vec![strs(&["lib::a", "lib::b"])]);
    assert_eq!(t.between_layers("a", &["b"]).len(), 1);
    assert!(
        t.between_layers("a", &["b"])[0].starts_with("src/a/w.rs:1: `b::p::P`"),
        "{:?}",
        t.between_layers("a", &["b"])
    );
}

#[test]
fn checker_counts_lines_per_file() {
    let long: String = (0..=MAX_CODE_LINES)
        .map(|i| format!("const C{i}: u8 = 0;\n"))
        .collect();
    let t = fake(&[("src/lib.rs", "pub mod a;"), ("src/a.rs", long.as_str())]);
    assert_eq!(
        t.too_long(MAX_CODE_LINES),
        vec![("src/a.rs".to_string(), MAX_CODE_LINES + 1)]
    );
}
