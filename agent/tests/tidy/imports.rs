//! Imports between the files of one crate, read from the product code of each file: the leaves of
//! `use` trees and the paths in code that start with `crate::`, `super::` or `self::` (a `super::`
//! resolved to the parent module's file). A path names the file of the longest module prefix it
//! has. A parent naming its child module without `self::` (`pub use tcp::TcpFabric` beside
//! `mod tcp;`) is not read: that is the parent's facade, and a child may use its parent. Paths to
//! other crates are Cargo's business.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::source::Source;

/// The crate a file belongs to and its module path there (`agent/src/fabric/tcp.rs`:
/// (`agent`, [fabric, tcp])). A `src/main.rs` is a crate of its own; `src/bin/` and files outside
/// `src/` (build scripts) are left out.
pub fn module_of(path: &Path) -> Option<(String, Vec<String>)> {
    let p = path.to_string_lossy();
    let (krate, rel) = p.split_once("/src/")?;
    if rel == "main.rs" {
        return Some((format!("{krate} (bin)"), Vec::new()));
    }
    if rel.starts_with("bin/") {
        return None;
    }
    let mut segs: Vec<String> = rel.trim_end_matches(".rs").split('/').map(str::to_string).collect();
    if matches!(segs.last().map(String::as_str), Some("mod" | "lib")) {
        segs.pop();
    }
    Some((krate.to_string(), segs))
}

/// One import: the line it is on and the path as written.
#[derive(Clone, Debug)]
pub struct Use {
    pub line: usize,
    pub path: String,
}

/// file -> file -> the imports that make the edge, within each crate.
pub type Edges = BTreeMap<String, BTreeMap<String, Vec<Use>>>;

pub fn edges(sources: &[Source]) -> Edges {
    let mut modules: BTreeMap<(String, Vec<String>), String> = BTreeMap::new();
    for s in sources {
        if let Some(m) = module_of(&s.path) {
            modules.insert(m, s.display());
        }
    }
    let mut out = Edges::new();
    for s in sources {
        let Some((krate, me)) = module_of(&s.path) else { continue };
        for (line, path) in paths(s) {
            let Some(first) = path.first() else { continue };
            let mut target: Vec<String> = match first.as_str() {
                "crate" => Vec::new(),
                "self" => me.clone(),
                "super" => me[..me.len().saturating_sub(1)].to_vec(),
                _ => continue,
            };
            let mut rest = &path[1..];
            if first == "super" {
                while rest.first().is_some_and(|s| s == "super") {
                    target.pop();
                    rest = &rest[1..];
                }
            }
            target.extend(rest.iter().cloned());
            let file = (0..=target.len()).rev().find_map(|n| modules.get(&(krate.clone(), target[..n].to_vec())));
            if let Some(file) = file {
                if *file != s.display() {
                    out.entry(s.display()).or_default().entry(file.clone()).or_default().push(Use { line, path: path.join("::") });
                }
            }
        }
    }
    out
}

#[derive(Debug, PartialEq)]
enum Tok {
    Word(String),
    Colons,
    Open,
    Close,
    Comma,
    Semi,
    Star,
    Other,
}

/// Every path in the product code of `s`, with its line: the leaves of each `use` tree, and every
/// `a::b::c` chain outside `use` items.
fn paths(s: &Source) -> Vec<(usize, Vec<String>)> {
    let mut toks: Vec<(usize, Tok)> = Vec::new();
    for (line, code) in s.product_code() {
        let c: Vec<char> = code.chars().collect();
        let mut i = 0;
        while i < c.len() {
            let ch = c[i];
            if ch.is_alphanumeric() || ch == '_' {
                let start = i;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                toks.push((line, Tok::Word(c[start..i].iter().collect())));
                continue;
            }
            let t = match ch {
                ':' if c.get(i + 1) == Some(&':') => {
                    i += 1;
                    Tok::Colons
                }
                '{' => Tok::Open,
                '}' => Tok::Close,
                ',' => Tok::Comma,
                ';' => Tok::Semi,
                '*' => Tok::Star,
                c if c.is_whitespace() => {
                    i += 1;
                    continue;
                }
                _ => Tok::Other,
            };
            toks.push((line, t));
            i += 1;
        }
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if toks[i].1 == Tok::Word("use".into()) {
            let line = toks[i].0;
            let mut j = i + 1;
            let mut leaves = Vec::new();
            use_tree(&toks, &mut j, Vec::new(), &mut leaves);
            out.extend(leaves.into_iter().map(|p| (line, p)));
            while j < toks.len() && toks[j].1 != Tok::Semi {
                j += 1;
            }
            i = j + 1;
            continue;
        }
        // A path chain: word (:: word)*, not itself the tail of a longer chain.
        if let Tok::Word(w) = &toks[i].1 {
            let after_colons = i > 0 && toks[i - 1].1 == Tok::Colons;
            if !after_colons && toks.get(i + 1).is_some_and(|t| t.1 == Tok::Colons) {
                let line = toks[i].0;
                let mut path = vec![w.clone()];
                let mut j = i + 1;
                while toks.get(j).is_some_and(|t| t.1 == Tok::Colons) {
                    match toks.get(j + 1) {
                        Some((_, Tok::Word(n))) => {
                            path.push(n.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                out.push((line, path));
                i = j;
                continue;
            }
        }
        i += 1;
    }
    out
}

/// Parses one use tree at `toks[*j..]` under `prefix`; pushes its leaves.
fn use_tree(toks: &[(usize, Tok)], j: &mut usize, prefix: Vec<String>, leaves: &mut Vec<Vec<String>>) {
    let mut path = prefix;
    loop {
        match toks.get(*j).map(|t| &t.1) {
            Some(Tok::Word(w)) if w == "as" => {
                *j += 2;
                break;
            }
            Some(Tok::Word(w)) => {
                if w != "self" || path.is_empty() {
                    path.push(w.clone());
                }
                *j += 1;
            }
            Some(Tok::Colons) => *j += 1,
            Some(Tok::Star) => {
                *j += 1;
                break;
            }
            Some(Tok::Open) => {
                *j += 1;
                loop {
                    match toks.get(*j).map(|t| &t.1) {
                        Some(Tok::Close) => {
                            *j += 1;
                            return;
                        }
                        Some(Tok::Comma) => *j += 1,
                        None | Some(Tok::Semi) => return,
                        _ => use_tree(toks, j, path.clone(), leaves),
                    }
                }
            }
            _ => break,
        }
    }
    leaves.push(path);
}

/// The strongly connected groups of more than one node in `edges` (Tarjan's algorithm).
pub fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let lw = self.low[w.as_str()];
                    let lv = self.low[v];
                    self.low.insert(v, lv.min(lw));
                } else if self.on_stack.contains(w.as_str()) {
                    let iw = self.index[w.as_str()];
                    let lv = self.low[v];
                    self.low.insert(v, lv.min(iw));
                }
            }
            if self.low[v] == self.index[v] {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    group.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    self.out.push(group);
                }
            }
        }
    }
    let mut walk =
        Walk { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on_stack: BTreeSet::new(), out: Vec::new() };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.out.sort();
    walk.out
}
