//! The paths a file names (`crate::`, `super::`, `self::`, `use child::`),
//! grouped uses expanded, made absolute from the crate's root; which code is
//! test code.

use super::lex::{Tok, Token, lex};

/// One path a file names, made absolute (module path from its crate's root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub path: Vec<String>,
    pub line: usize,
    /// In test code (an inline `#[cfg(test)]` item).
    pub test: bool,
}

/// What one file names, and which of its child modules are test-only.
#[derive(Debug, Default)]
pub struct Parsed {
    pub named: Vec<Named>,
    /// `#[cfg(test)] mod x;`: the children that are test code.
    pub test_children: Vec<String>,
}

/// A scope opened by `{`: an inline module (named) or any other block.
pub struct Scope {
    pub module: Option<String>,
    pub test: bool,
}

/// Every path `src` names, for a file whose module path is `module`
/// (`["daemon", "state"]` for `src/daemon/state.rs`). `children`: the names
/// of the file's child modules (a `use` may start with one of them).
pub fn parse(src: &str, module: &[String], children: &[String]) -> Parsed {
    let toks = lex(src);
    let mut out = Parsed::default();
    let mut scopes: Vec<Scope> = Vec::new();
    // `#[cfg(test)]` seen; applies to the next item.
    let mut cfg_test = false;
    let mut i = 0;
    let ident_at = |j: usize| match toks.get(j).map(|t| &t.tok) {
        Some(Tok::Ident(s)) => Some(s.as_str()),
        _ => None,
    };
    let tok_at = |j: usize| toks.get(j).map(|t| &t.tok);
    while i < toks.len() {
        let current = |scopes: &[Scope]| -> Vec<String> {
            let mut m = module.to_vec();
            m.extend(scopes.iter().filter_map(|s| s.module.clone()));
            m
        };
        let in_test = |scopes: &[Scope]| scopes.iter().any(|s| s.test);
        match &toks[i].tok {
            Tok::Punct('#')
                if tok_at(i + 1) == Some(&Tok::Punct('['))
                    && ident_at(i + 2) == Some("cfg")
                    && tok_at(i + 3) == Some(&Tok::Punct('('))
                    && ident_at(i + 4) == Some("test")
                    && tok_at(i + 5) == Some(&Tok::Punct(')')) =>
            {
                cfg_test = true;
                i += 6;
            }
            Tok::Ident(kw) if kw == "mod" => {
                let name = ident_at(i + 1).map(str::to_string);
                match (name, tok_at(i + 2)) {
                    (Some(name), Some(Tok::Punct('{'))) => {
                        let test = cfg_test;
                        scopes.push(Scope {
                            module: Some(name),
                            test,
                        });
                        cfg_test = false;
                        i += 3;
                    }
                    (Some(name), Some(Tok::Punct(';'))) => {
                        if cfg_test || in_test(&scopes) {
                            out.test_children.push(name);
                        }
                        cfg_test = false;
                        i += 3;
                    }
                    _ => i += 1,
                }
            }
            Tok::Punct('{') => {
                scopes.push(Scope {
                    module: None,
                    test: cfg_test,
                });
                cfg_test = false;
                i += 1;
            }
            Tok::Punct('}') => {
                scopes.pop();
                i += 1;
            }
            Tok::Punct(';') => {
                cfg_test = false;
                i += 1;
            }
            Tok::Ident(kw)
                if matches!(kw.as_str(), "crate" | "super" | "self")
                    && tok_at(i + 1) == Some(&Tok::Sep)
                    && (i == 0 || toks[i - 1].tok != Tok::Sep)
                    && !(i >= 2
                        && ident_at(i - 1) == Some("in")
                        && tok_at(i - 2) == Some(&Tok::Punct('('))) =>
            {
                let line = toks[i].line;
                let mut base = current(&scopes);
                let mut j = i;
                while let Some(s @ ("crate" | "super" | "self")) = ident_at(j) {
                    if tok_at(j + 1) != Some(&Tok::Sep) {
                        break;
                    }
                    match s {
                        "crate" => base.clear(),
                        "super" => {
                            base.pop();
                        }
                        _ => {}
                    }
                    j += 2;
                }
                let mut paths = Vec::new();
                i = use_tree(&toks, j, base, &mut paths);
                let test = in_test(&scopes);
                out.named
                    .extend(paths.into_iter().map(|path| Named { path, line, test }));
            }
            Tok::Ident(kw)
                if kw == "use"
                    && ident_at(i + 1).is_some_and(|c| children.iter().any(|x| x == c))
                    && tok_at(i + 2) == Some(&Tok::Sep) =>
            {
                // `use child::Item;`: relative to this module.
                let line = toks[i].line;
                let mut paths = Vec::new();
                i = use_tree(&toks, i + 1, current(&scopes), &mut paths);
                let test = in_test(&scopes);
                out.named
                    .extend(paths.into_iter().map(|path| Named { path, line, test }));
            }
            _ => i += 1,
        }
    }
    out
}

/// Read one use tree (or the path part of an expression) at `toks[i]`,
/// appending each full path under `prefix` to `out`; returns the index after
/// it. `a::b`, `a::{b, c::{d, self}}`, `a::*`, `a as b`, `self`.
pub fn use_tree(
    toks: &[Token],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    loop {
        match toks.get(i).map(|t| &t.tok) {
            Some(Tok::Punct('{')) => {
                i += 1;
                while let Some(t) = toks.get(i) {
                    match t.tok {
                        Tok::Punct('}') => return i + 1,
                        Tok::Punct(',') => i += 1,
                        _ => {
                            let before = i;
                            i = use_tree(toks, i, prefix.clone(), out);
                            if i == before {
                                i += 1;
                            }
                        }
                    }
                }
                return i;
            }
            Some(Tok::Punct('*')) => {
                out.push(prefix);
                return i + 1;
            }
            Some(Tok::Ident(s)) => {
                if s == "self" {
                    // `a::{self}`: `a` itself.
                } else if s == "super" {
                    prefix.pop();
                } else if s != "crate" {
                    prefix.push(s.clone());
                }
                i += 1;
                if toks.get(i).map(|t| &t.tok) == Some(&Tok::Sep) {
                    i += 1;
                    continue;
                }
                if let Some(Tok::Ident(a)) = toks.get(i).map(|t| &t.tok)
                    && a == "as"
                {
                    i += 2;
                }
                out.push(prefix);
                return i;
            }
            _ => {
                out.push(prefix);
                return i;
            }
        }
    }
}

/// `mod x;` declarations of a crate root.
pub fn parse_mod_decls(src: &str) -> Vec<String> {
    let toks = lex(src);
    toks.windows(3)
        .filter_map(|w| match (&w[0].tok, &w[1].tok, &w[2].tok) {
            (Tok::Ident(m), Tok::Ident(name), Tok::Punct(';')) if m == "mod" => Some(name.clone()),
            _ => None,
        })
        .collect()
}
