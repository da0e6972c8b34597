//! Every source file of `src/`, every path it names resolved to the file that
//! defines it (the longest prefix of the path that is a file), and the queries
//! the rules ask of that graph.

use super::lex::code_lines;
use super::paths::{parse, parse_mod_decls};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// One source file.
pub struct File {
    /// Relative to the repository: `src/daemon/state.rs`.
    pub name: String,
    /// Module path from its crate's root, the crate first: `["lib", "daemon",
    /// "state"]`, `["main", "cli", "serve"]`.
    pub module: Vec<String>,
    pub src: String,
}

/// An edge: `from` names an item of `to`.
#[derive(Debug, Clone)]
pub struct Edge {
    pub from: usize,
    pub to: usize,
    pub line: usize,
    pub path: String,
    pub test: bool,
}

pub struct Tree {
    pub files: Vec<File>,
    pub edges: Vec<Edge>,
    /// Files that are test code as a whole.
    pub test_files: BTreeSet<usize>,
}

impl Tree {
    /// Resolve every path of every file to the file defining it.
    pub fn new(files: Vec<File>) -> Tree {
        let index: HashMap<Vec<String>, usize> = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.module.clone(), i))
            .collect();
        let mut edges = Vec::new();
        let mut test_modules = BTreeSet::new();
        for (fi, f) in files.iter().enumerate() {
            let children: Vec<String> = files
                .iter()
                .filter(|c| c.module.len() == f.module.len() + 1 && c.module.starts_with(&f.module))
                .filter_map(|c| c.module.last().cloned())
                .collect();
            // Paths are parsed relative to the crate's root (without the crate).
            let parsed = parse(&f.src, &f.module[1..], &children);
            for c in parsed.test_children {
                let mut m = f.module.clone();
                m.push(c);
                test_modules.insert(m);
            }
            for n in parsed.named {
                let mut full = vec![f.module[0].clone()];
                full.extend(n.path.iter().cloned());
                let to = (1..=full.len())
                    .rev()
                    .find_map(|k| index.get(&full[..k]).copied());
                if let Some(to) = to
                    && to != fi
                {
                    edges.push(Edge {
                        from: fi,
                        to,
                        line: n.line,
                        path: n.path.join("::"),
                        test: n.test,
                    });
                }
            }
        }
        let test_files = files
            .iter()
            .enumerate()
            .filter(|(_, f)| (1..=f.module.len()).any(|k| test_modules.contains(&f.module[..k])))
            .map(|(i, _)| i)
            .collect();
        Tree {
            files,
            edges,
            test_files,
        }
    }

    /// Read `src/` of the crate: `lib.rs` and its modules, `main.rs` and its.
    pub fn load(root: &Path) -> Tree {
        let src = root.join("src");
        let mut paths = Vec::new();
        rust_files(&src, &mut paths);
        let main = std::fs::read_to_string(src.join("main.rs")).expect("read src/main.rs");
        let bin_mods: Vec<String> = parse_mod_decls(&main);
        let mut files = Vec::new();
        for p in paths {
            let rel = p.strip_prefix(&src).expect("under src");
            let mut parts: Vec<String> = rel
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            let last = parts.pop().expect("a file name");
            let stem = last.trim_end_matches(".rs").to_string();
            if !(stem == "mod" || (parts.is_empty() && (stem == "lib" || stem == "main"))) {
                parts.push(stem.clone());
            }
            let krate = if (parts.is_empty() && stem == "main")
                || parts.first().is_some_and(|m| bin_mods.contains(m))
            {
                "main"
            } else {
                "lib"
            };
            let mut module = vec![krate.to_string()];
            module.extend(parts);
            files.push(File {
                name: format!("src/{}", rel.display()),
                module,
                src: std::fs::read_to_string(&p).expect("read source"),
            });
        }
        Tree::new(files)
    }

    pub fn is_test(&self, e: &Edge) -> bool {
        e.test || self.test_files.contains(&e.from)
    }

    /// Top-level module of file `i` (`daemon`), or `""` for a crate root.
    pub fn layer(&self, i: usize) -> &str {
        self.files[i].module.get(1).map_or("", String::as_str)
    }

    /// Rule 1: every edge from a file of `layer` to one of `forbidden`.
    pub fn between_layers(&self, layer: &str, forbidden: &[&str]) -> Vec<String> {
        assert!(
            self.files
                .iter()
                .any(|f| f.module.get(1).is_some_and(|m| m == layer)),
            "no sources for layer {layer}"
        );
        self.edges
            .iter()
            .filter(|e| self.layer(e.from) == layer && forbidden.contains(&self.layer(e.to)))
            .map(|e| self.describe(e))
            .collect()
    }

    /// Rule 2: (file, ancestor, description) of every upward non-test edge.
    pub fn upward(&self) -> Vec<(String, String, String)> {
        self.edges
            .iter()
            .filter(|e| !self.is_test(e))
            .filter(|e| {
                let (from, to) = (&self.files[e.from].module, &self.files[e.to].module);
                to.len() < from.len() && from.starts_with(to)
            })
            .map(|e| {
                (
                    self.files[e.from].name.clone(),
                    self.files[e.to].name.clone(),
                    self.describe(e),
                )
            })
            .collect()
    }

    /// Rule 3, files: every circle (sorted file names), with the edges in it.
    pub fn file_circles(&self) -> Vec<(Vec<String>, Vec<String>)> {
        let n = self.files.len();
        let mut adj = vec![BTreeSet::new(); n];
        for e in self.edges.iter().filter(|e| !self.is_test(e)) {
            adj[e.from].insert(e.to);
        }
        circles(&adj)
            .into_iter()
            .map(|c| {
                let set: BTreeSet<usize> = c.iter().copied().collect();
                let mut names: Vec<String> =
                    c.iter().map(|&i| self.files[i].name.clone()).collect();
                names.sort();
                let how = self
                    .edges
                    .iter()
                    .filter(|e| !self.is_test(e) && set.contains(&e.from) && set.contains(&e.to))
                    .map(|e| self.describe(e))
                    .collect();
                (names, how)
            })
            .collect()
    }

    /// Rule 3, layers: every circle among top-level modules.
    pub fn layer_circles(&self) -> Vec<Vec<String>> {
        let mut names: Vec<String> = self
            .files
            .iter()
            .enumerate()
            .map(|(i, f)| format!("{}::{}", f.module[0], self.layer(i)))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        names.sort();
        let at = |i: usize| {
            let key = format!("{}::{}", self.files[i].module[0], self.layer(i));
            names.binary_search(&key).expect("known layer")
        };
        let mut adj = vec![BTreeSet::new(); names.len()];
        for e in self.edges.iter().filter(|e| !self.is_test(e)) {
            let (a, b) = (at(e.from), at(e.to));
            // A crate root declares every layer; it is above them all.
            if a != b && !self.layer(e.to).is_empty() && !self.layer(e.from).is_empty() {
                adj[a].insert(b);
            }
        }
        circles(&adj)
            .into_iter()
            .map(|c| c.into_iter().map(|i| names[i].clone()).collect())
            .collect()
    }

    /// Rule 4: files over `limit` lines of code, with their count.
    pub fn too_long(&self, limit: usize) -> Vec<(String, usize)> {
        self.files
            .iter()
            .map(|f| (f.name.clone(), code_lines(&f.src)))
            .filter(|(_, n)| *n > limit)
            .collect()
    }

    pub fn describe(&self, e: &Edge) -> String {
        format!(
            "{}:{}: `{}` names an item of {}",
            self.files[e.from].name, e.line, e.path, self.files[e.to].name
        )
    }
}

/// The strongly connected components of more than one node (Tarjan), each
/// sorted.
pub fn circles(adj: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct St<'a> {
        adj: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on: Vec<bool>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut St<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on[v] = true;
        for &w in s.adj[v].iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort_unstable();
                s.out.push(comp);
            }
        }
    }
    let n = adj.len();
    let mut s = St {
        adj,
        index: vec![None; n],
        low: vec![0; n],
        stack: Vec::new(),
        on: vec![false; n],
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}
