//! The crate's modules import one way: no cycle among the files of `src/`, none among its
//! top-level modules, and neither backend imports the other. A cycle makes two files one unit
//! that can only be read, tested and changed together; this test names it when it comes back.
//!
//! The edges are read from the source text (std only, no parser crate): every `crate::…`,
//! `super::…` and `self::…` path outside comments, strings and `#[cfg(test)]` items, and the
//! paths of `use` items that start at a child module. A path resolves to the file that defines
//! its item, following the `pub use` re-exports of facades (`lib.rs`, `mod.rs`): a file that
//! names `crate::DType` depends on `tensor.rs`, not on `lib.rs`. Module declarations (`mod x;`)
//! are not edges: a facade over its children is the intended shape.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// One source file: its module path (`["cuda", "launch"]`; the crate root is `[]`) and its text
/// with comments, string and char literals and `#[cfg(test)]` items removed.
struct Module {
    path: Vec<String>,
    file: String,
    code: String,
}

/// Pairs of top-level modules that must not depend on each other in either direction: the
/// backends share code through neutral modules, never through one another.
const SEPARATE: &[(&str, &str)] = &[("cuda", "cpu")];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir).expect("src/ is readable").map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file under `src/`: `lib.rs` -> [], `a/mod.rs` -> [a], `a/b.rs` -> [a, b].
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !(stem == "mod" || (parts.is_empty() && stem == "lib")) {
        parts.push(stem.to_string());
    }
    parts
}

/// `text` with comments, string/char literals and `#[cfg(test)]` items blanked (newlines kept).
fn strip(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !prev_is_ident(&b, i) && raw_string_end(&b, i).is_some() {
            i = raw_string_end(&b, i).unwrap();
            out.push_str("\"\"");
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && (next == Some('\\') || b.get(i + 2) == Some(&'\'')) {
            // A char literal ('x', '\n', '\u{..}'); anything else after a quote is a lifetime.
            i += 2;
            while i < b.len() && b[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    remove_cfg_test(&out)
}

fn prev_is_ident(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// Where the raw string starting at `b[i] == 'r'` ends (one past its last `#`).
fn raw_string_end(b: &[char], i: usize) -> Option<usize> {
    let mut j = i + 1;
    let mut hashes = 0;
    while b.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if b.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < b.len() {
        if b[j] == '"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    None
}

/// `code` without the items under `#[cfg(test)]` (test modules, test-only imports): tests are
/// consumers of the code they test, not part of its layering.
fn remove_cfg_test(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        // The item ends at its first `;` outside braces, or at the brace closing its body.
        let mut depth = 0usize;
        let mut end = item.len();
        for (k, ch) in item.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        out.push_str(&"\n".repeat(item[..end].matches('\n').count()));
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The identifiers and `::`, `{`, `}`, `,`, `;` of `code`, in order (other punctuation as itself).
fn tokens(code: &str) -> Vec<String> {
    let b: Vec<char> = code.chars().collect();
    let mut t = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_alphanumeric() || c == '_' {
            let s = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            t.push(b[s..i].iter().collect());
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            t.push("::".into());
            i += 2;
        } else {
            if !c.is_whitespace() {
                t.push(c.to_string());
            }
            i += 1;
        }
    }
    t
}

/// The paths of a path tree at `t[*i]` (`a::b::{c, d::e as f}` -> [a::b::c, a::b::d::e]), each
/// with the name it is bound to when renamed (`f`), prefixed by `prefix`; `*i` ends after it.
fn path_tree(t: &[String], i: &mut usize, prefix: Vec<String>, out: &mut Vec<(Vec<String>, Option<String>)>) {
    let mut path = prefix;
    loop {
        match t.get(*i).map(String::as_str) {
            Some("{") => {
                *i += 1;
                while *i < t.len() && t[*i] != "}" {
                    path_tree(t, i, path.clone(), out);
                    if t.get(*i).map(String::as_str) == Some(",") {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            Some(seg) if seg.chars().all(|c| c.is_alphanumeric() || c == '_') => {
                path.push(seg.to_string());
                *i += 1;
                if t.get(*i).map(String::as_str) == Some("::") {
                    *i += 1;
                    continue;
                }
                let mut alias = None;
                if t.get(*i).map(String::as_str) == Some("as") {
                    alias = t.get(*i + 1).cloned();
                    *i += 2;
                }
                out.push((path, alias));
                return;
            }
            Some("*") => {
                *i += 1;
                out.push((path, None));
                return;
            }
            _ => {
                out.push((path, None));
                return;
            }
        }
    }
}

/// The paths a module names, each with the module it is named in (the file's, or an inline
/// `mod x { .. }` inside it): `crate::`/`super::`/`self::` paths anywhere, and `use` trees that
/// start at a child module (`use engine::Engine;` in a facade). `self` inside a `use` group
/// names the module it follows (`use super::fp8::{self, X}`), so it is dropped.
fn named_paths(m: &Module, children: &BTreeSet<String>) -> Vec<(Vec<String>, Vec<String>)> {
    let t = tokens(&m.code);
    let mut out = Vec::new();
    // The inline modules open at this point, with the brace depth each closes at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        match t[i].as_str() {
            "{" => {
                if i >= 2 && t[i - 2] == "mod" {
                    inline.push((t[i - 1].clone(), depth));
                }
                depth += 1;
            }
            "}" => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            _ => {}
        }
        let starts_path = (t[i] == "crate" || t[i] == "super" || t[i] == "self") && t.get(i + 1).map(String::as_str) == Some("::");
        let prev = if i > 0 { t[i - 1].as_str() } else { "" };
        let after_use = prev == "use" && inline.is_empty() && children.contains(&t[i]);
        if (starts_path && prev != "::") || after_use {
            let mut at = m.path.clone();
            at.extend(inline.iter().map(|(name, _)| name.clone()));
            let mut paths = Vec::new();
            path_tree(&t, &mut i, Vec::new(), &mut paths);
            for (mut p, _) in paths {
                if p.last().map(String::as_str) == Some("self") {
                    p.pop();
                }
                out.push((at.clone(), p));
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The crate's files, their re-exports and the file-level dependency edges.
struct Graph {
    modules: Vec<Module>,
    /// (module path, re-exported name) -> the path it re-exports, absolute.
    reexports: BTreeMap<(Vec<String>, String), Vec<String>>,
    /// file -> files it depends on (module paths), with one path that shows each edge.
    edges: BTreeMap<Vec<String>, BTreeMap<Vec<String>, String>>,
}

/// An absolute path (from the crate root) for `p` named in module `at`.
fn absolute(at: &[String], p: &[String]) -> Vec<String> {
    let mut base: Vec<String> = at.to_vec();
    let mut k = 0;
    match p.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            k = 1;
        }
        Some("self") => k = 1,
        Some("super") => {
            while p.get(k).map(String::as_str) == Some("super") {
                base.pop();
                k += 1;
            }
        }
        // A name in scope in `at`: a child module or one of its own items or imports.
        _ => {}
    }
    base.extend(p[k..].iter().cloned());
    base
}

impl Graph {
    fn load(root: &Path) -> Graph {
        let mut files = Vec::new();
        rust_files(root, &mut files);
        let mut modules: Vec<Module> = files
            .iter()
            .map(|f| {
                let rel = f.strip_prefix(root).unwrap();
                Module {
                    path: module_path(rel),
                    file: rel.to_string_lossy().replace('\\', "/"),
                    code: strip(&fs::read_to_string(f).expect("source is UTF-8")),
                }
            })
            .collect();
        // Files declared only under #[cfg(test)] (`#[cfg(test)] mod tests;`) are test code.
        let declared: BTreeSet<Vec<String>> = modules
            .iter()
            .flat_map(|m| {
                let t = tokens(&m.code);
                let mut kids = Vec::new();
                for w in t.windows(3) {
                    if w[0] == "mod" && w[2] == ";" {
                        let mut p = m.path.clone();
                        p.push(w[1].clone());
                        kids.push(p);
                    }
                }
                kids
            })
            .collect();
        modules.retain(|m| m.path.is_empty() || declared.contains(&m.path));
        let paths: BTreeSet<Vec<String>> = modules.iter().map(|m| m.path.clone()).collect();
        let children = |at: &[String]| -> BTreeSet<String> {
            paths.iter().filter(|p| p.len() == at.len() + 1 && p.starts_with(at)).map(|p| p.last().unwrap().clone()).collect()
        };
        // Re-exports: `pub use` / `pub(crate) use` trees, by the name they bind.
        let mut reexports = BTreeMap::new();
        for m in &modules {
            let t = tokens(&m.code);
            for i in 0..t.len() {
                let is_pub_use = t[i] == "use"
                    && i > 0
                    && (t[i - 1] == "pub" || (t[i - 1] == ")" && i >= 4 && t[i - 4] == "pub"));
                if !is_pub_use {
                    continue;
                }
                let mut j = i + 1;
                let mut trees = Vec::new();
                path_tree(&t, &mut j, Vec::new(), &mut trees);
                for (p, alias) in trees {
                    let Some(name) = alias.or_else(|| p.last().cloned()) else { continue };
                    if name == "self" || name == "_" {
                        continue;
                    }
                    let target = absolute(&m.path, &p);
                    reexports.insert((m.path.clone(), name), target);
                }
            }
        }
        let mut g = Graph { modules: Vec::new(), reexports, edges: BTreeMap::new() };
        for m in &modules {
            let kids = children(&m.path);
            let mut deps = BTreeMap::new();
            for (at, p) in named_paths(m, &kids) {
                let abs = absolute(&at, &p);
                let file = g.resolve(&abs, &paths, 0);
                if file != m.path {
                    deps.entry(file).or_insert_with(|| p.join("::"));
                }
            }
            g.edges.insert(m.path.clone(), deps);
        }
        g.modules = modules;
        g
    }

    /// The file (module path) that defines the item of the absolute path `p`.
    fn resolve(&self, p: &[String], modules: &BTreeSet<Vec<String>>, hops: usize) -> Vec<String> {
        let mut at: Vec<String> = Vec::new();
        for (k, seg) in p.iter().enumerate() {
            let mut next = at.clone();
            next.push(seg.clone());
            if modules.contains(&next) {
                at = next;
                continue;
            }
            if hops < 8 {
                if let Some(target) = self.reexports.get(&(at.clone(), seg.clone())) {
                    let mut full = target.clone();
                    full.extend(p[k + 1..].iter().cloned());
                    return self.resolve(&full, modules, hops + 1);
                }
            }
            break;
        }
        at
    }

    /// The edges between top-level modules (`crate` for the root), each with one file edge
    /// that shows it.
    fn top_level(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        let top = |p: &[String]| p.first().cloned().unwrap_or_else(|| "crate".into());
        let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for (from, deps) in &self.edges {
            let entry = out.entry(top(from)).or_default();
            for (to, via) in deps {
                // The root is the facade of every module; its re-exports are resolved above.
                if top(to) != top(from) && !to.is_empty() && !from.is_empty() {
                    entry.entry(top(to)).or_insert_with(|| format!("{} names {via}", self.file(from)));
                }
            }
        }
        out
    }

    fn file(&self, p: &[String]) -> String {
        self.modules.iter().find(|m| m.path == p).map(|m| format!("src/{}", m.file)).unwrap_or_else(|| p.join("::"))
    }
}

/// One cycle per strongly connected component of more than one node (Tarjan), as the path
/// through its edges, with the component's members.
#[allow(clippy::type_complexity)]
fn cycles<N: Ord + Clone>(edges: &BTreeMap<N, BTreeMap<N, String>>) -> Vec<(Vec<N>, BTreeSet<N>)> {
    struct State<N> {
        index: BTreeMap<N, usize>,
        low: BTreeMap<N, usize>,
        stack: Vec<N>,
        on: BTreeSet<N>,
        sccs: Vec<Vec<N>>,
    }
    fn visit<N: Ord + Clone>(v: &N, e: &BTreeMap<N, BTreeMap<N, String>>, s: &mut State<N>) {
        let i = s.index.len();
        s.index.insert(v.clone(), i);
        s.low.insert(v.clone(), i);
        s.stack.push(v.clone());
        s.on.insert(v.clone());
        for w in e.get(v).into_iter().flat_map(|d| d.keys()) {
            if !s.index.contains_key(w) {
                visit(w, e, s);
                let l = s.low[v].min(s.low[w]);
                s.low.insert(v.clone(), l);
            } else if s.on.contains(w) {
                let l = s.low[v].min(s.index[w]);
                s.low.insert(v.clone(), l);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on.remove(&w);
                scc.push(w.clone());
                if &w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                s.sccs.push(scc);
            }
        }
    }
    let mut s = State { index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), sccs: Vec::new() };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(v, edges, &mut s);
        }
    }
    // One cycle through each component: a shortest path back to its first node.
    s.sccs
        .into_iter()
        .map(|scc| {
            let members: BTreeSet<N> = scc.iter().cloned().collect();
            let start = members.iter().next().unwrap().clone();
            let mut prev: BTreeMap<N, N> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([start.clone()]);
            let mut seen = BTreeSet::from([start.clone()]);
            let mut last = start.clone();
            'bfs: while let Some(v) = queue.pop_front() {
                for w in edges[&v].keys().filter(|w| members.contains(*w)) {
                    if *w == start {
                        last = v.clone();
                        break 'bfs;
                    }
                    if seen.insert(w.clone()) {
                        prev.insert(w.clone(), v.clone());
                        queue.push_back(w.clone());
                    }
                }
            }
            let mut path = vec![last.clone()];
            while let Some(p) = prev.get(path.last().unwrap()) {
                path.push(p.clone());
            }
            path.reverse();
            path.push(start);
            (path, members)
        })
        .collect()
}

/// A cycle as its edges, then every other edge among the modules of its component (each of
/// them is part of some cycle too).
fn describe<N: Ord + Clone>(
    cycle: &[N],
    edges: &BTreeMap<N, BTreeMap<N, String>>,
    scc: &BTreeSet<N>,
    name: impl Fn(&N) -> String,
) -> String {
    let mut s = String::new();
    let shown: BTreeSet<(N, N)> = cycle.windows(2).map(|w| (w[0].clone(), w[1].clone())).collect();
    for w in cycle.windows(2) {
        s += &format!("\n    {} -> {}   ({})", name(&w[0]), name(&w[1]), edges[&w[0]][&w[1]]);
    }
    let mut rest = String::new();
    for a in scc {
        for (b, via) in edges[a].iter().filter(|(b, _)| scc.contains(*b)) {
            if !shown.contains(&(a.clone(), b.clone())) {
                rest += &format!("\n    {} -> {}   ({via})", name(a), name(b));
            }
        }
    }
    if !rest.is_empty() {
        s += "\n  other edges among these modules:";
        s += &rest;
    }
    s
}

/// The cycles of `edges` as a report, one paragraph per strongly connected component.
fn report<N: Ord + Clone>(edges: &BTreeMap<N, BTreeMap<N, String>>, name: impl Fn(&N) -> String) -> (usize, String) {
    let found = cycles(edges);
    let text: Vec<String> = found
        .iter()
        .map(|(c, scc)| format!("cycle:{}", describe(c, edges, scc, &name)))
        .collect();
    (found.len(), text.join("\n"))
}

#[test]
fn no_import_cycle_between_files() {
    let g = Graph::load(&src_dir());
    let (n, text) = report(&g.edges, |p| g.file(p));
    assert!(n == 0, "{n} import cycle(s) between files of src/:\n{text}");
}

#[test]
fn no_import_cycle_between_top_level_modules() {
    let g = Graph::load(&src_dir());
    let top = g.top_level();
    let (n, text) = report(&top, |m| m.clone());
    assert!(n == 0, "{n} import cycle(s) between top-level modules:\n{text}");
}

#[test]
fn backends_do_not_import_each_other() {
    let top = Graph::load(&src_dir()).top_level();
    let mut bad = Vec::new();
    for &(a, b) in SEPARATE {
        for (from, to) in [(a, b), (b, a)] {
            if let Some(via) = top.get(from).and_then(|d| d.get(to)) {
                bad.push(format!("{from} -> {to}   ({via})"));
            }
        }
    }
    assert!(bad.is_empty(), "backend imports the other backend:\n    {}", bad.join("\n    "));
}

/// The reader itself: on a small crate written here, it finds the edges a path names inline,
/// through `use` groups, `super::`, and facade re-exports, skips comments, strings and test
/// items, and reports the cycle.
#[test]
fn the_reader_finds_edges_and_cycles() {
    let dir = std::env::temp_dir().join(format!("module_layers_{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let files = [
        ("lib.rs", "mod cpu; mod cuda; mod tensor; pub use tensor::DType;\n"),
        ("tensor.rs", "pub enum DType { F16 }\n// crate::cuda::combine is only a comment\nconst S: &str = \"crate::cpu\";\n"),
        ("cpu/mod.rs", "pub(crate) mod inplace;\npub(crate) use inplace::num_splits;\n"),
        (
            "cpu/inplace.rs",
            "use crate::DType;\npub fn num_splits() -> usize { crate::cuda::combine::helper() }\n\
             #[cfg(test)]\nmod tests { use crate::cuda::launch; }\n",
        ),
        ("cuda/mod.rs", "mod combine; mod launch;\n"),
        ("cuda/combine.rs", "use super::{launch::{self, Plan}};\npub fn helper() -> usize { crate::cpu::inplace::num_splits() }\n"),
        ("cuda/launch.rs", "pub struct Plan;\nfn f() -> usize { crate::cpu::num_splits() }\n"),
    ];
    for (name, text) in files {
        let p = dir.join(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }
    let g = Graph::load(&dir);
    let p = |s: &str| s.split('/').filter(|x| !x.is_empty()).map(String::from).collect::<Vec<_>>();
    let deps = |s: &str| g.edges[&p(s)].keys().cloned().collect::<BTreeSet<_>>();
    assert_eq!(deps("cpu/inplace"), BTreeSet::from([p("tensor"), p("cuda/combine")]));
    assert_eq!(deps("cuda/combine"), BTreeSet::from([p("cuda/launch"), p("cpu/inplace")]));
    // Through the facade's re-export, to the file that defines the item.
    assert_eq!(deps("cuda/launch"), BTreeSet::from([p("cpu/inplace")]));
    assert_eq!(deps("tensor"), BTreeSet::new());
    let files_found = cycles(&g.edges);
    assert_eq!(files_found.len(), 1);
    let top = g.top_level();
    assert!(top["cuda"].contains_key("cpu") && top["cpu"].contains_key("cuda"));
    assert_eq!(cycles(&top).len(), 1);
    fs::remove_dir_all(&dir).unwrap();
}
