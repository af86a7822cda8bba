//! No import cycle between the source files of `host`, `accel` or `sdk`
//! (issue 46): no file depends on itself through a chain of other files,
//! except by the one shape every Rust module has, a module's root file and
//! the files under it using each other (below).
//!
//! A file depends on another when it names something defined there: in a
//! `use` (plain, renamed, grouped or glob) or in a path in code
//! (`crate::engine::request::PROMPT_KERNEL_MIN_LEN`, `super::Foo::new`,
//! `manager::KvCacheManager`). A path is resolved the way rustc resolves
//! it, closely enough for this purpose:
//! - `crate`, `self`, `super`, `$crate`, a crate's own name, a child
//!   module or a name bound by a `use` start it;
//! - each further segment is looked up in the module reached so far: a
//!   child module descends, a name defined there (fn, struct, enum, trait,
//!   type, const, static, union, `macro_rules!`) ends at that module's
//!   file, and a name bound by a `use` there (a re-export, `pub` or not)
//!   is followed to where it is defined, so `crate::engine::kv_cache::
//!   KvCacheManager` (re-exported by `kv_cache/mod.rs` from `manager.rs`)
//!   is an edge to `manager.rs`, not to `mod.rs`;
//! - a name the module neither defines nor imports (an item a macro
//!   generates) is charged to the module's own file, so a miss errs toward
//!   an edge, not away from one.
//!
//! A path that ends at a module (`use crate::engine::kv_cache;`) is no edge
//! by itself: the names later reached through it are. `mod x;` is no edge
//! either (it declares the module tree, it uses nothing), nor is a
//! reference inside one file. A child that uses `super::Name` while its
//! `mod.rs` re-exports the child depends on `mod.rs` only when `Name` is
//! defined in `mod.rs` itself; when `mod.rs` re-exports `Name` from a
//! sibling, the edge goes to that sibling.
//!
//! Which cycles count. A module's root file (`lib.rs`, `mod.rs`, or `x.rs`
//! beside an `x/` folder) declares the module's children and is their
//! namespace: the files under it use what it defines (`super::Workspace`,
//! `crate::server::AppState`, the trait its children implement) while it
//! calls into them (routing a request to a handler, picking a model's
//! loader). That parent-and-children knot is how a Rust module is built
//! and says nothing about how its parts are layered; issue 46 is about the
//! other kind, the tangles the review found between modules that should
//! not know each other (plugins and tenants, protocol and structured,
//! scheduler and runner, amx_bf16 and bf16_tiles, the sdk's glue, host and
//! testing). So a cycle is allowed only when it passes through the root
//! file of the smallest module that holds all its files, and reported
//! when it avoids that file:
//! - between siblings (`a.rs` and `b.rs` under one `mod.rs`), also when
//!   each names the other through their parent's re-exports (those are
//!   followed to the defining file, as above);
//! - between cousins (`backend/mod.rs` and `quant/mod.rs`, or files under
//!   them);
//! - through a third module: a root, one of its children, a module
//!   outside it and back to the root (`p/mod.rs` calls `p/c.rs`, which
//!   uses `x.rs`, which uses a type of `p/mod.rs`). The smallest module
//!   holding that cycle is the one above `p`, whose root is not on it, so
//!   it is reported although one of its edges joins a parent and a child.
//!
//! A child module is all of its files: a module root and a file deeper
//! under it (`models/mod.rs` and `models/layers/decoder.rs`) are allowed to
//! use each other as a root and its child file are, else splitting a child
//! `x.rs` into `x/mod.rs` and `x/part.rs` would turn an allowed knot into
//! a reported one.
//!
//! Test code is left out: whatever is under `#[cfg(test)]` (or
//! `#[cfg(all(test, …))]`), the usual `#[cfg(test)] mod tests { … }`, a
//! `#[cfg(test)] mod tests;` file and the files under it, `#![cfg(test)]`,
//! and a test-only `use`, fn, field or statement. It is not in what is
//! built and shipped, so it cannot tangle the layering of the code; and
//! a unit test may well need the modules that depend on the code it tests
//! (a test of the GGUF reader writes its fixture with the GGUF writer,
//! which uses the reader's constants). Test files still belong to the
//! module tree. Comments, doc comments (intra-doc links included) and
//! string literals are not code and give no edges either.
//!
//! Every `.rs` file must belong to a module tree: one that does not is
//! unchecked (forgotten, dead, or behind a `#[path]` this test does not
//! follow), and is named on failure.
//!
//! On failure the test names each cycle found: the files of a strongly
//! connected component (Tarjan) of the files under one module root less
//! that root, and the edges in it that tie two of the root's child modules
//! together, with the names and lines that make each: what a reviewer
//! needs to cut it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The crates checked: name as written in paths, source dir (relative to
/// the workspace root), crate root files in it. `host/src/main.rs` is a
/// second crate (the binary) whose `crate::` is itself.
const CRATES: &[(&str, &str, &[&str])] = &[
    ("pagoda", "host/src", &["lib.rs", "main.rs"]),
    ("pagoda_accel", "accel/src", &["lib.rs"]),
    ("pagoda_sdk", "sdk/src", &["lib.rs"]),
];

#[test]
fn no_file_level_import_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent: the workspace root")
        .to_path_buf();
    let specs: Vec<CrateSpec> = CRATES
        .iter()
        .map(|(name, dir, roots)| CrateSpec {
            name: name.to_string(),
            dir: root.join(dir),
            roots: roots.iter().map(|r| r.to_string()).collect(),
        })
        .collect();
    let tree = Tree::load(&specs);

    // Every file must be part of a module tree: one that is not would go
    // unchecked (dead code, or a `#[path]` this test does not follow).
    let unreached: Vec<String> = specs
        .iter()
        .flat_map(|spec| tree.outside(&spec.dir))
        .map(|f| rel(&root, &f))
        .collect();
    let graph = tree.graph();
    let report = cycle_report(&tree, &graph, &root);
    assert!(
        report.is_empty() && unreached.is_empty(),
        "import cycles between files:\n{report}\nfiles outside every module tree: {unreached:?}"
    );
}

// ---------------------------------------------------------------- model

struct CrateSpec {
    name: String,
    dir: PathBuf,
    roots: Vec<String>,
}

#[derive(Default)]
struct Module {
    /// The file the module's items are written in.
    file: usize,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    /// Items defined here, and whether each is `pub` (any `pub(...)`).
    defs: BTreeMap<String, bool>,
    imports: Vec<Import>,
    globs: Vec<Glob>,
    /// Compiled only under `#[cfg(test)]` (itself or a module around it).
    test: bool,
}

/// A name bound by a `use` in a module.
struct Import {
    name: String,
    path: Vec<String>,
    public: bool,
    /// False for a `use` inside a function body, which only that body sees.
    item_level: bool,
}

struct Glob {
    path: Vec<String>,
    public: bool,
}

/// A reference in a file's code to resolve: `scope` is the module (file
/// or inline) it is written in.
struct Ref {
    scope: usize,
    path: Vec<String>,
    line: usize,
    glob: bool,
}

struct File {
    path: PathBuf,
    /// The module the file is the body of (its `mod x;` names it).
    module: usize,
    refs: Vec<Ref>,
    /// Every identifier in the file: what a glob import may bring in.
    idents: BTreeMap<String, usize>,
}

#[derive(Clone, Debug, PartialEq)]
enum Res {
    Module(usize),
    Item { file: usize, name: String },
    External,
}

/// Edges of the file graph: (from, to) → the names that make the edge,
/// each with the first line in `from` that names it.
type Graph = BTreeMap<(usize, usize), BTreeMap<String, usize>>;

struct Tree {
    modules: Vec<Module>,
    files: Vec<File>,
    crate_roots: BTreeMap<String, usize>,
}

/// The deepest chain of `use`s followed while resolving one path.
const MAX_DEPTH: u32 = 48;

impl Tree {
    fn load(specs: &[CrateSpec]) -> Tree {
        let mut t = Tree {
            modules: Vec::new(),
            files: Vec::new(),
            crate_roots: BTreeMap::new(),
        };
        for spec in specs {
            for (k, r) in spec.roots.iter().enumerate() {
                let m = t.new_module(None);
                // The library (first root) is the one its name refers to.
                if k == 0 {
                    t.crate_roots.insert(spec.name.clone(), m);
                }
                t.parse_file(&spec.dir.join(r), m);
            }
        }
        t
    }

    fn new_module(&mut self, parent: Option<usize>) -> usize {
        let test = parent.is_some_and(|p| self.modules[p].test);
        self.modules.push(Module {
            parent,
            test,
            ..Module::default()
        });
        self.modules.len() - 1
    }

    /// Reads `path` as the body of module `module`, then the files of the
    /// modules it declares.
    fn parse_file(&mut self, path: &Path, module: usize) {
        let src = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let toks = tokenize(&src);
        let file = self.files.len();
        self.files.push(File {
            path: path.to_path_buf(),
            module,
            refs: Vec::new(),
            idents: BTreeMap::new(),
        });
        self.modules[module].file = file;
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        let parent_dir = path.parent().unwrap_or(Path::new("")).to_path_buf();
        let own_dir = if matches!(stem, "mod" | "lib" | "main") {
            parent_dir
        } else {
            parent_dir.join(stem)
        };
        // (module, brace depth of its items, directory of its child files)
        let mut scopes: Vec<(usize, usize, PathBuf)> = vec![(module, 0, own_dir)];
        let mut depth = 0usize;
        let mut public = false;
        let mut to_parse: Vec<(PathBuf, usize)> = Vec::new();
        // Tokens before this index belong to a `#[cfg(test)]` item.
        let mut test_until = 0usize;
        let mut i = 0;
        while i < toks.len() {
            let (m, item_depth, dir) = scopes.last().cloned().expect("the file's scope stays");
            let item_level = depth == item_depth;
            let line = toks[i].line;
            // Test code declares modules (their files are part of the
            // tree) but defines, imports and names nothing that counts.
            let test = i < test_until || self.modules[m].test;
            match &toks[i].tok {
                Tok::Punct('#') => match cfg_test_attr(&toks, i) {
                    Some((after, inner)) => {
                        if inner {
                            // `#![cfg(test)]`: the rest of this module.
                            self.modules[m].test = true;
                        } else {
                            // An item stops at its `;` or `}`; a field, variant,
                            // arm or argument at its `,` too.
                            let end = item_end(&toks, after, !item_level);
                            test_until = test_until.max(end);
                        }
                        i = after;
                    }
                    None => i += 1,
                },
                Tok::Punct('{') => {
                    depth += 1;
                    public = false;
                    i += 1;
                }
                Tok::Punct('}') => {
                    depth = depth.saturating_sub(1);
                    if scopes.len() > 1 && depth < item_depth {
                        scopes.pop();
                    }
                    public = false;
                    i += 1;
                }
                Tok::Punct(';') => {
                    public = false;
                    i += 1;
                }
                Tok::Ident(w) if w == "pub" => {
                    public = true;
                    i += 1;
                }
                Tok::Ident(w) if w == "use" => {
                    let mut items = Vec::new();
                    i = parse_use_tree(&toks, i + 1, Vec::new(), &mut items);
                    while i < toks.len() && toks[i].tok != Tok::Punct(';') {
                        i += 1;
                    }
                    for u in items {
                        if test {
                            continue;
                        }
                        if u.glob {
                            if item_level {
                                self.modules[m].globs.push(Glob {
                                    path: u.path.clone(),
                                    public,
                                });
                            }
                        } else if let Some(name) = u.name {
                            self.modules[m].imports.push(Import {
                                name,
                                path: u.path.clone(),
                                public,
                                item_level,
                            });
                        }
                        self.files[file].refs.push(Ref {
                            scope: m,
                            path: u.path,
                            line,
                            glob: u.glob,
                        });
                    }
                    public = false;
                }
                Tok::Ident(w) if w == "mod" && item_level => {
                    let name = match toks.get(i + 1).map(|t| &t.tok) {
                        Some(Tok::Ident(n)) => n.clone(),
                        _ => {
                            i += 1;
                            continue;
                        }
                    };
                    let child = self.new_module(Some(m));
                    self.modules[child].test |= test;
                    self.modules[m].children.insert(name.clone(), child);
                    match toks.get(i + 2).map(|t| &t.tok) {
                        Some(Tok::Punct(';')) => {
                            let a = dir.join(format!("{name}.rs"));
                            let b = dir.join(&name).join("mod.rs");
                            let f = if a.exists() { a } else { b };
                            to_parse.push((f, child));
                            i += 3;
                        }
                        Some(Tok::Punct('{')) => {
                            self.modules[child].file = file;
                            depth += 1;
                            scopes.push((child, depth, dir.join(&name)));
                            i += 3;
                        }
                        _ => i += 2,
                    }
                    public = false;
                }
                Tok::Ident(w)
                    if item_level
                        && matches!(
                            w.as_str(),
                            "fn" | "struct"
                                | "enum"
                                | "trait"
                                | "type"
                                | "const"
                                | "static"
                                | "union"
                        ) =>
                {
                    let mut j = i + 1;
                    // `static mut NAME`
                    if matches!(toks.get(j).map(|t| &t.tok), Some(Tok::Ident(n)) if n == "mut") {
                        j += 1;
                    }
                    if let Some(Tok::Ident(n)) = toks.get(j).map(|t| &t.tok) {
                        // `const fn`, `const unsafe fn`: the name comes with `fn`.
                        if !test
                            && !matches!(n.as_str(), "fn" | "unsafe" | "async" | "extern" | "_")
                        {
                            self.modules[m].defs.insert(n.clone(), public);
                        }
                    }
                    public = false;
                    i += 1;
                }
                Tok::Ident(w) if item_level && !test && w == "macro_rules" => {
                    if let (Some(Tok::Punct('!')), Some(Tok::Ident(n))) = (
                        toks.get(i + 1).map(|t| &t.tok),
                        toks.get(i + 2).map(|t| &t.tok),
                    ) {
                        self.modules[m].defs.insert(n.clone(), true);
                    }
                    i += 1;
                }
                Tok::Ident(w) => {
                    if !test {
                        self.files[file].idents.entry(w.clone()).or_insert(line);
                    }
                    let starts_path =
                        i == 0 || !matches!(toks[i - 1].tok, Tok::PathSep | Tok::Punct('.'));
                    if starts_path && toks.get(i + 1).map(|t| &t.tok) == Some(&Tok::PathSep) {
                        let mut path = vec![w.clone()];
                        let mut j = i + 1;
                        while toks.get(j).map(|t| &t.tok) == Some(&Tok::PathSep) {
                            match toks.get(j + 1).map(|t| &t.tok) {
                                Some(Tok::Ident(n)) => {
                                    path.push(n.clone());
                                    j += 2;
                                }
                                _ => break,
                            }
                        }
                        if !test {
                            self.files[file].refs.push(Ref {
                                scope: m,
                                path,
                                line,
                                glob: false,
                            });
                        }
                        i = j;
                    } else {
                        i += 1;
                    }
                }
                _ => i += 1,
            }
        }
        for (f, child) in to_parse {
            self.parse_file(&f, child);
        }
    }

    /// The `.rs` files under `dir` that no module tree reaches.
    fn outside(&self, dir: &Path) -> Vec<PathBuf> {
        rs_files(dir)
            .into_iter()
            .filter(|f| !self.files.iter().any(|t| &t.path == f))
            .collect()
    }

    /// The file that declares file `f` (`mod f;` in it, or in a module
    /// written inline in it); None for a crate root.
    fn parent_file(&self, f: usize) -> Option<usize> {
        self.modules[self.files[f].module]
            .parent
            .map(|p| self.modules[p].file)
    }

    fn root_of(&self, mut m: usize) -> usize {
        while let Some(p) = self.modules[m].parent {
            m = p;
        }
        m
    }

    /// Whether `inner` is `outer` or inside it (so sees its private items).
    fn within(&self, mut inner: usize, outer: usize) -> bool {
        loop {
            if inner == outer {
                return true;
            }
            match self.modules[inner].parent {
                Some(p) => inner = p,
                None => return false,
            }
        }
    }

    /// Resolves `path` as written in module `scope`.
    fn resolve(&self, scope: usize, path: &[String], depth: u32) -> Res {
        if depth > MAX_DEPTH || path.is_empty() {
            return Res::External;
        }
        let (mut m, mut i) = match path[0].as_str() {
            "crate" => (self.root_of(scope), 1),
            "self" => (scope, 1),
            "super" => {
                let mut m = scope;
                let mut i = 0;
                while path.get(i).map(String::as_str) == Some("super") {
                    match self.modules[m].parent {
                        Some(p) => m = p,
                        None => return Res::External,
                    }
                    i += 1;
                }
                (m, i)
            }
            first => match self.crate_roots.get(first) {
                Some(&r) => (r, 1),
                None => match self.lookup(scope, first, scope, false, depth + 1) {
                    Some(Res::Module(c)) => (c, 1),
                    Some(other) => return other,
                    None => return Res::External,
                },
            },
        };
        while i < path.len() {
            match self.lookup(m, &path[i], scope, false, depth + 1) {
                Some(Res::Module(c)) => m = c,
                Some(other) => return other,
                // Unresolved (say, an item a macro generates): the rest of
                // the path names it.
                None => {
                    return Res::Item {
                        file: self.modules[m].file,
                        name: path[i..].join("::"),
                    }
                }
            }
            i += 1;
        }
        Res::Module(m)
    }

    /// What `name` means in module `m`, looked up from module `from`.
    /// Through a glob only what `from` may see counts (`pub`, or any item
    /// of a module `from` is inside); a plain path in code that compiles
    /// can only name what it may see, so that is not checked.
    fn lookup(&self, m: usize, name: &str, from: usize, glob: bool, depth: u32) -> Option<Res> {
        if depth > MAX_DEPTH {
            return None;
        }
        let md = &self.modules[m];
        let inside = self.within(from, m);
        if let Some(&c) = md.children.get(name) {
            return Some(Res::Module(c));
        }
        if let Some(&public) = md.defs.get(name) {
            if public || inside || !glob {
                return Some(Res::Item {
                    file: md.file,
                    name: name.to_string(),
                });
            }
        }
        for imp in &md.imports {
            if imp.name == name && (imp.item_level || from == m) && (imp.public || inside || !glob)
            {
                return Some(self.resolve(m, &imp.path, depth + 1));
            }
        }
        for g in &md.globs {
            if !(g.public || inside) {
                continue;
            }
            if let Res::Module(gm) = self.resolve(m, &g.path, depth + 1) {
                if gm != m {
                    if let Some(r) = self.lookup(gm, name, from, true, depth + 1) {
                        return Some(r);
                    }
                }
            }
        }
        None
    }

    fn graph(&self) -> Graph {
        let mut g = Graph::new();
        let mut add = |from: usize, res: Res, line: usize| {
            if let Res::Item { file, name } = res {
                if file != from {
                    g.entry((from, file))
                        .or_default()
                        .entry(name)
                        .or_insert(line);
                }
            }
        };
        for (f, file) in self.files.iter().enumerate() {
            for r in &file.refs {
                let res = self.resolve(r.scope, &r.path, 0);
                if !r.glob {
                    add(f, res, r.line);
                    continue;
                }
                match res {
                    Res::Module(gm) => {
                        // A glob brings in what the file goes on to name.
                        for (ident, &line) in &file.idents {
                            if let Some(res) = self.lookup(gm, ident, r.scope, true, 0) {
                                add(f, res, line.max(r.line));
                            }
                        }
                    }
                    // `use some::Enum::*`: its variants, defined with it.
                    item => add(f, item, r.line),
                }
            }
        }
        g
    }
}

// ------------------------------------------------------------- use trees

struct UseItem {
    path: Vec<String>,
    /// The name bound (`None` for `as _`, and for globs).
    name: Option<String>,
    glob: bool,
}

/// Parses one use tree at `toks[i]` with the segments before it in
/// `prefix`; returns the index after it.
fn parse_use_tree(
    toks: &[Token],
    mut i: usize,
    prefix: Vec<String>,
    out: &mut Vec<UseItem>,
) -> usize {
    let mut path = prefix;
    if toks.get(i).map(|t| &t.tok) == Some(&Tok::PathSep) {
        // `use ::name`: an extern crate, never this one's modules.
        path.push("::".into());
        i += 1;
    }
    loop {
        match toks.get(i).map(|t| &t.tok) {
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                i += 1;
                if toks.get(i).map(|t| &t.tok) == Some(&Tok::PathSep) {
                    i += 1;
                    continue;
                }
                if path.last().map(String::as_str) == Some("self") {
                    path.pop();
                }
                let mut name = path.last().cloned();
                if matches!(toks.get(i).map(|t| &t.tok), Some(Tok::Ident(a)) if a == "as") {
                    name = match toks.get(i + 1).map(|t| &t.tok) {
                        Some(Tok::Ident(n)) if n != "_" => Some(n.clone()),
                        _ => None,
                    };
                    i += 2;
                }
                out.push(UseItem {
                    path,
                    name,
                    glob: false,
                });
                return i;
            }
            Some(Tok::Punct('*')) => {
                out.push(UseItem {
                    path,
                    name: None,
                    glob: true,
                });
                return i + 1;
            }
            Some(Tok::Punct('{')) => {
                i += 1;
                loop {
                    match toks.get(i).map(|t| &t.tok) {
                        None => return i,
                        Some(Tok::Punct('}')) => return i + 1,
                        Some(Tok::Punct(',')) => i += 1,
                        Some(_) => {
                            let before = i;
                            i = parse_use_tree(toks, i, path.clone(), out);
                            if i == before {
                                i += 1;
                            }
                        }
                    }
                }
            }
            _ => return i,
        }
    }
}

// ------------------------------------------------------------ cfg(test)

/// An attribute at `toks[i]` (`#`) that compiles what it is on only for
/// tests (`#[cfg(test)]`, `#[cfg(all(test, …))]`): the index after it, and
/// whether it is an inner one (`#![cfg(test)]`, the rest of its module).
fn cfg_test_attr(toks: &[Token], i: usize) -> Option<(usize, bool)> {
    let tok = |k: usize| toks.get(k).map(|t| &t.tok);
    let mut j = i + 1;
    let inner = tok(j) == Some(&Tok::Punct('!'));
    if inner {
        j += 1;
    }
    if tok(j) != Some(&Tok::Punct('[')) {
        return None;
    }
    let close = matching(toks, j)?;
    let body = &toks[j + 1..close];
    let is = |k: usize, t: &Tok| body.get(k).map(|x| &x.tok) == Some(t);
    let test_only = is(0, &Tok::Ident("cfg".into()))
        && is(1, &Tok::Punct('('))
        && is(body.len() - 1, &Tok::Punct(')'))
        && cfg_is_test_only(&body[2..body.len() - 1]);
    test_only.then_some((close + 1, inner))
}

/// Whether a cfg predicate holds only in test builds: `test`, or an
/// `all(…)` with such an argument.
fn cfg_is_test_only(pred: &[Token]) -> bool {
    match pred.iter().map(|t| &t.tok).collect::<Vec<_>>().as_slice() {
        [Tok::Ident(t)] => t == "test",
        [Tok::Ident(all), Tok::Punct('('), .., Tok::Punct(')')] if all == "all" => {
            let args = &pred[2..pred.len() - 1];
            let mut start = 0;
            let mut nest = 0i32;
            for (k, t) in args.iter().enumerate() {
                match t.tok {
                    Tok::Punct('(') => nest += 1,
                    Tok::Punct(')') => nest -= 1,
                    Tok::Punct(',') if nest == 0 => {
                        if cfg_is_test_only(&args[start..k]) {
                            return true;
                        }
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            cfg_is_test_only(&args[start..])
        }
        _ => false,
    }
}

/// The index of the bracket closing the one at `toks[i]`.
fn matching(toks: &[Token], i: usize) -> Option<usize> {
    let mut nest = 0usize;
    for (k, t) in toks.iter().enumerate().skip(i) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => nest += 1,
            Tok::Punct(')' | ']' | '}') => {
                nest -= 1;
                if nest == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// The index just after the item (statement, field, arm) that starts at
/// `toks[i]`, its further attributes included: after its `;`, after the
/// `}` of its body, after its `,` when `commas`, or at the bracket that
/// closes what it is in.
fn item_end(toks: &[Token], mut i: usize, commas: bool) -> usize {
    while toks.get(i).map(|t| &t.tok) == Some(&Tok::Punct('#'))
        && toks.get(i + 1).map(|t| &t.tok) == Some(&Tok::Punct('['))
    {
        match matching(toks, i + 1) {
            Some(close) => i = close + 1,
            None => return toks.len(),
        }
    }
    let mut nest = 0usize;
    while i < toks.len() {
        match toks[i].tok {
            Tok::Punct('(' | '[' | '{') => nest += 1,
            Tok::Punct(c @ (')' | ']' | '}')) => {
                if nest == 0 {
                    return i;
                }
                nest -= 1;
                if nest == 0 && c == '}' {
                    return i + 1;
                }
            }
            Tok::Punct(';') if nest == 0 => return i + 1,
            Tok::Punct(',') if nest == 0 && commas => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

// ------------------------------------------------------------- tokenizer

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Punct(char),
    /// `::`
    PathSep,
    /// A literal, lifetime or macro variable: nothing a path is made of.
    Other,
}

struct Token {
    tok: Tok,
    line: usize,
}

/// Splits Rust source into identifiers, `::` and punctuation, dropping
/// comments and the contents of literals.
fn tokenize(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        let start_line = line;
        let mut push = |tok: Tok| {
            out.push(Token {
                tok,
                line: start_line,
            })
        };
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut nest = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    nest += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    nest -= 1;
                    i += 2;
                    if nest == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_string(&c, i + 1, &mut line);
            push(Tok::Other);
        } else if (ch == 'b' || ch == 'c') && at(i + 1) == '"' {
            i = skip_string(&c, i + 2, &mut line);
            push(Tok::Other);
        } else if ch == 'b' && at(i + 1) == '\'' {
            i = skip_char(&c, i + 1);
            push(Tok::Other);
        } else if let Some(end) = raw_string(&c, i, &mut line) {
            i = end;
            push(Tok::Other);
        } else if ch == 'r' && at(i + 1) == '#' && ident_char(at(i + 2)) {
            // A raw identifier, `r#type`.
            let s = i + 2;
            i = s;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            push(Tok::Ident(c[s..i].iter().collect()));
        } else if ch == '\'' {
            if at(i + 1) == '\\' || at(i + 2) == '\'' {
                i = skip_char(&c, i);
            } else {
                // A lifetime or label.
                i += 1;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
            }
            push(Tok::Other);
        } else if ch == '$' {
            // `$crate` is the crate; other `$name`s are macro variables.
            i += 1;
            let s = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            let w: String = c[s..i].iter().collect();
            push(if w == "crate" {
                Tok::Ident(w)
            } else {
                Tok::Other
            });
        } else if ch.is_ascii_digit() {
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            push(Tok::Other);
        } else if ident_char(ch) {
            let s = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            push(Tok::Ident(c[s..i].iter().collect()));
        } else if ch == ':' && at(i + 1) == ':' {
            i += 2;
            push(Tok::PathSep);
        } else {
            i += 1;
            push(Tok::Punct(ch));
        }
    }
    out
}

/// Skips a (byte, C) string body from just after its opening quote.
fn skip_string(c: &[char], mut i: usize, line: &mut usize) -> usize {
    while i < c.len() {
        match c[i] {
            '\\' => {
                if c.get(i + 1) == Some(&'\n') {
                    *line += 1;
                }
                i += 2;
            }
            '"' => return i + 1,
            '\n' => {
                *line += 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    i
}

/// Skips a char literal from its opening quote.
fn skip_char(c: &[char], mut i: usize) -> usize {
    i += 1;
    if c.get(i) == Some(&'\\') {
        i += 2;
    } else {
        i += 1;
    }
    while i < c.len() && c[i] != '\'' {
        i += 1;
    }
    i + 1
}

/// A raw string (`r"…"`, `r#"…"#`, `br"…"`, `cr"…"`) at `i`: its end.
fn raw_string(c: &[char], i: usize, line: &mut usize) -> Option<usize> {
    let mut j = i;
    if matches!(c.get(j), Some('b') | Some('c')) {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '\n' {
            *line += 1;
        }
        if c[j] == '"' && (1..=hashes).all(|k| c.get(j + k) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(j)
}

// ---------------------------------------------------------------- cycles

/// Strongly connected components with more than one file (Tarjan).
/// Only the files `keep` accepts, and the edges between them, count.
fn sccs(n: usize, graph: &Graph, keep: impl Fn(usize) -> bool) -> Vec<Vec<usize>> {
    let mut adj = vec![Vec::new(); n];
    for &(a, b) in graph.keys() {
        if keep(a) && keep(b) {
            adj[a].push(b);
        }
    }
    struct State<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for k in 0..s.adj[v].len() {
            let w = s.adj[v][k];
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        adj: &adj,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if keep(v) && s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}

/// One paragraph per cycle: its files, then each edge inside it that
/// ties two of the modules it joins, with the names that make it (and
/// the line naming each first). Empty: no cycle.
///
/// The cycles sought are those that avoid the root file of the smallest
/// module holding them (see the top of this file). For each module root
/// R (and, above all of them, the set of crate roots) this takes the
/// files under R but not R itself; a strongly connected component of
/// those that spans two of R's child modules holds such a cycle: an edge
/// from one child module to another inside it, then the shortest way
/// back, is a simple cycle that is under R, avoids R, and lies in no
/// single child. Conversely a cycle that passes through the root of the
/// smallest module holding it is never in such a component.
fn cycle_report(tree: &Tree, graph: &Graph, root: &Path) -> String {
    let n = tree.files.len();
    // The file, child of `level` (a crate root when `level` is None), that
    // `f` lies under or is; None when `f` is not under `level`.
    let branch = |level: Option<usize>, f: usize| -> Option<usize> {
        let mut x = f;
        loop {
            let p = tree.parent_file(x);
            if p == level {
                return Some(x);
            }
            x = p?;
        }
    };
    let mut found: BTreeMap<Vec<String>, String> = BTreeMap::new();
    let levels = std::iter::once(None).chain((0..n).map(Some));
    for level in levels {
        if level.is_some() && !(0..n).any(|f| tree.parent_file(f) == level) {
            continue;
        }
        for mut comp in sccs(n, graph, |f| branch(level, f).is_some()) {
            let first = branch(level, comp[0]);
            if comp.iter().all(|&f| branch(level, f) == first) {
                continue;
            }
            comp.sort_by_key(|&f| &tree.files[f].path);
            let names: Vec<String> = comp
                .iter()
                .map(|&f| rel(root, &tree.files[f].path))
                .collect();
            let mut out = String::new();
            let _ = writeln!(out, "cycle between {}:", names.join(", "));
            for &a in &comp {
                for &b in &comp {
                    if branch(level, a) == branch(level, b) {
                        continue;
                    }
                    if let Some(why) = graph.get(&(a, b)) {
                        let list: Vec<String> =
                            why.iter().map(|(n, l)| format!("{n} (line {l})")).collect();
                        let _ = writeln!(
                            out,
                            "  {} -> {}: {}",
                            rel(root, &tree.files[a].path),
                            rel(root, &tree.files[b].path),
                            list.join(", ")
                        );
                    }
                }
            }
            found.insert(names, out);
        }
    }
    found.into_values().collect()
}

fn rel(root: &Path, p: &Path) -> String {
    p.strip_prefix(root).unwrap_or(p).display().to_string()
}

fn rs_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let entries =
            std::fs::read_dir(&d).unwrap_or_else(|e| panic!("listing {}: {e}", d.display()));
        for e in entries {
            let p = e.expect("directory entry").path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

// ------------------------------------------------ the checker's own tests

/// A synthetic crate `demo` in a temp dir: `files` are (path under src,
/// text). Returns the edges as "from -> to: names" lines and the report.
fn analyze(tag: &str, files: &[(&str, &str)]) -> (Vec<String>, String) {
    let dir = pagoda_e2e::TempDir::new(tag);
    let src = dir.0.join("src");
    for (p, text) in files {
        let f = src.join(p);
        std::fs::create_dir_all(f.parent().expect("a file has a parent")).expect("mkdir");
        std::fs::write(&f, text).expect("write");
    }
    let specs = [CrateSpec {
        name: "demo".into(),
        dir: src.clone(),
        roots: vec!["lib.rs".into()],
    }];
    let tree = Tree::load(&specs);
    assert_eq!(tree.outside(&src), Vec::<PathBuf>::new(), "unreached");
    let graph = tree.graph();
    let edges = graph
        .iter()
        .map(|((a, b), why)| {
            let names: Vec<&str> = why.keys().map(String::as_str).collect();
            format!(
                "{} -> {}: {}",
                rel(&src, &tree.files[*a].path),
                rel(&src, &tree.files[*b].path),
                names.join(",")
            )
        })
        .collect();
    (edges, cycle_report(&tree, &graph, &src))
}

#[test]
fn checker_finds_a_cycle_through_a_chain_and_names_its_ties() {
    let (edges, report) = analyze(
        "cyc-chain",
        &[
            ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\npub mod d;\n"),
            (
                "a.rs",
                "use crate::b::{Bee, helper as h};\npub struct Ay;\n",
            ),
            (
                "b.rs",
                "pub struct Bee;\npub fn helper() {}\npub fn f() { crate::c::see(); }\n",
            ),
            ("c.rs", "pub fn see() -> super::a::Ay { super::a::Ay }\n"),
            // d uses a (by the crate's own name, as a macro or a doc
            // test would) but nothing uses d: outside the cycle.
            ("d.rs", "fn f() -> demo::a::Ay { demo::a::Ay }\n"),
        ],
    );
    assert!(
        edges.contains(&"a.rs -> b.rs: Bee,helper".to_string()),
        "{edges:?}"
    );
    assert!(
        edges.contains(&"b.rs -> c.rs: see".to_string()),
        "{edges:?}"
    );
    assert!(edges.contains(&"c.rs -> a.rs: Ay".to_string()), "{edges:?}");
    assert!(
        report.starts_with("cycle between a.rs, b.rs, c.rs:\n"),
        "{report}"
    );
    assert!(
        report.contains("  a.rs -> b.rs: Bee (line 1), helper (line 1)\n"),
        "{report}"
    );
    assert!(report.contains("  c.rs -> a.rs: Ay (line 1)\n"), "{report}");
    assert!(edges.contains(&"d.rs -> a.rs: Ay".to_string()), "{edges:?}");
    assert!(!report.contains("d.rs"), "{report}");
}

#[test]
fn checker_follows_reexports_to_the_defining_file() {
    let (edges, report) = analyze(
        "cyc-reexport",
        &[
            ("lib.rs", "pub mod kv;\npub mod engine;\n"),
            (
                "kv/mod.rs",
                "mod manager;\nmod pool;\npub use manager::Manager;\npub use self::pool::*;\n",
            ),
            ("kv/manager.rs", "pub struct Manager;\n"),
            ("kv/pool.rs", "pub struct Pool;\nfn private_helper() {}\n"),
            (
                "engine.rs",
                "use crate::kv;\nuse crate::kv::*;\n\
                 fn f() -> kv::Manager { let _ = Pool; private_helper(); kv::Manager }\n",
            ),
        ],
    );
    assert!(
        edges.contains(&"engine.rs -> kv/manager.rs: Manager".to_string()),
        "{edges:?}"
    );
    // Through `use crate::kv::*` and kv's `pub use self::pool::*`; a
    // private fn of pool is not brought in.
    assert!(
        edges.contains(&"engine.rs -> kv/pool.rs: Pool".to_string()),
        "{edges:?}"
    );
    assert!(
        !edges
            .iter()
            .any(|e| e.starts_with("engine.rs -> kv/mod.rs")),
        "{edges:?}"
    );
    assert_eq!(report, "");
}

#[test]
fn checker_allows_a_module_root_and_the_files_under_it_to_use_each_other() {
    let (edges, report) = analyze(
        "cyc-parent",
        &[
            ("lib.rs", "pub mod p;\npub mod q;\npub mod other;\n"),
            // p re-exports its child and the child uses a name p merely
            // re-exports from `other`: an edge to `other`, none to p.
            (
                "p/mod.rs",
                "mod child;\npub use child::Kid;\nuse crate::other::Shared;\n",
            ),
            ("p/child.rs", "pub struct Kid(super::Shared);\n"),
            ("other.rs", "pub struct Shared;\n"),
            // q and its child use each other; so do q and a file two
            // levels down; and `one` uses q's type while q calls `two`,
            // which uses `one`: each cycle passes through q/mod.rs.
            (
                "q/mod.rs",
                "mod child;\nmod deep;\nmod one;\nmod two;\n\
                 pub use child::Kid;\npub struct Own;\n\
                 pub fn run() { deep::leaf::go(); two::go(); }\n",
            ),
            ("q/child.rs", "pub struct Kid(super::Own);\n"),
            ("q/deep/mod.rs", "pub mod leaf;\n"),
            (
                "q/deep/leaf.rs",
                "pub fn go() -> Option<crate::q::Own> { None }\n",
            ),
            ("q/one.rs", "pub struct One(pub super::Own);\n"),
            ("q/two.rs", "pub fn go() { let _ = super::one::One; }\n"),
        ],
    );
    for e in [
        "p/child.rs -> other.rs: Shared",
        "q/child.rs -> q/mod.rs: Own",
        "q/mod.rs -> q/child.rs: Kid",
        "q/deep/leaf.rs -> q/mod.rs: Own",
        "q/mod.rs -> q/deep/leaf.rs: go",
        "q/one.rs -> q/mod.rs: Own",
        "q/mod.rs -> q/two.rs: go",
        "q/two.rs -> q/one.rs: One",
    ] {
        assert!(edges.contains(&e.to_string()), "{e}: {edges:?}");
    }
    assert!(
        !edges
            .iter()
            .any(|e| e.starts_with("p/child.rs -> p/mod.rs")),
        "{edges:?}"
    );
    assert_eq!(report, "");
}

#[test]
fn checker_finds_a_sibling_cycle_through_the_parents_reexports() {
    let (edges, report) = analyze(
        "cyc-siblings",
        &[
            ("lib.rs", "pub mod p;\n"),
            (
                "p/mod.rs",
                "mod a;\nmod b;\npub use a::Ay;\npub use b::Bee;\npub struct Shared;\n",
            ),
            ("p/a.rs", "pub struct Ay(super::Bee, super::Shared);\n"),
            ("p/b.rs", "pub struct Bee;\npub fn f(_: &super::Ay) {}\n"),
        ],
    );
    assert!(
        edges.contains(&"p/a.rs -> p/mod.rs: Shared".to_string()),
        "{edges:?}"
    );
    // The parent's own edges to them are allowed; the siblings' are not.
    assert_eq!(
        report,
        "cycle between p/a.rs, p/b.rs:\n  \
         p/a.rs -> p/b.rs: Bee (line 1)\n  \
         p/b.rs -> p/a.rs: Ay (line 2)\n"
    );
}

#[test]
fn checker_finds_a_cycle_that_leaves_a_module_through_a_third_one() {
    let (edges, report) = analyze(
        "cyc-third",
        &[
            ("lib.rs", "pub mod p;\npub mod x;\n"),
            (
                "p/mod.rs",
                "mod c;\npub struct Own;\npub fn run() { c::go() }\n",
            ),
            ("p/c.rs", "pub fn go() { crate::x::helper(); }\n"),
            (
                "x.rs",
                "pub fn helper() -> Option<crate::p::Own> { None }\n",
            ),
        ],
    );
    // p/mod.rs -> p/c.rs alone would be allowed; the way back runs
    // through x.rs, outside p.
    assert!(
        edges.contains(&"p/mod.rs -> p/c.rs: go".to_string()),
        "{edges:?}"
    );
    assert_eq!(
        report,
        "cycle between p/c.rs, p/mod.rs, x.rs:\n  \
         p/c.rs -> x.rs: helper (line 1)\n  \
         x.rs -> p/mod.rs: Own (line 1)\n"
    );
}

#[test]
fn checker_leaves_out_test_code() {
    let (edges, report) = analyze(
        "cyc-cfg-test",
        &[
            ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
            (
                "a.rs",
                "pub struct Ay;\n\
                 #[cfg(test)]\nuse crate::b::Bee;\n\
                 #[cfg(test)]\n#[allow(dead_code)]\nfn helper() -> Bee { crate::b::make() }\n\
                 #[cfg(all(test, feature = \"x\"))]\nconst N: usize = crate::b::N;\n\
                 pub fn after() -> crate::c::See { crate::c::See }\n\
                 #[cfg(test)]\nmod tests {\n    use super::*;\n    \
                 fn t() -> crate::b::Bee { let _ = Ay; helper() }\n}\n\
                 #[cfg(test)]\nmod more;\n\
                 pub struct Fields {\n    #[cfg(test)]\n    pub probe: crate::b::Bee,\n    \
                 pub kept: crate::c::See,\n}\n\
                 pub fn body() {\n    #[cfg(test)]\n    {\n        crate::b::make();\n    }\n    \
                 crate::c::touch();\n}\n\
                 #[cfg(any(test, feature = \"x\"))]\npub fn either() { crate::c::either(); }\n",
            ),
            // Under the test-only `mod more;`: in the tree, but test code.
            (
                "a/more.rs",
                "use crate::b::Bee;\npub fn m() -> Bee { Bee }\n",
            ),
            (
                "b.rs",
                "pub struct Bee;\npub const N: usize = 1;\n\
                 pub fn make() -> Bee { let _ = crate::a::Ay; Bee }\n",
            ),
            (
                "c.rs",
                "pub struct See;\npub fn touch() {}\npub fn either() {}\n",
            ),
        ],
    );
    assert_eq!(
        edges,
        vec![
            "a.rs -> c.rs: See,either,touch".to_string(),
            "b.rs -> a.rs: Ay".to_string(),
        ]
    );
    assert_eq!(report, "");
}

#[test]
fn checker_ignores_mod_declarations_tests_modules_comments_and_strings() {
    let (edges, report) = analyze(
        "cyc-noise",
        &[
            ("lib.rs", "pub mod a;\npub mod b;\n"),
            (
                "a.rs",
                "//! See [`crate::b::Bee`].\n\
                 pub struct Ay;\n\
                 /* crate::b::Bee */\n\
                 pub const S: &str = \"crate::b::Bee\";\n\
                 pub const R: &str = r#\"crate::b::Bee \"x\" \"#;\n\
                 pub fn lt<'a>(x: &'a str) -> char { let _ = x; 'b' }\n\
                 #[cfg(test)]\nmod tests {\n    use super::*;\n    fn t() -> Ay { Ay }\n}\n",
            ),
            (
                "b.rs",
                "pub struct Bee;\n\
                 fn f() -> usize { let x = crate::a::lt(\"\"); x.len_utf8() }\n",
            ),
        ],
    );
    assert_eq!(edges, vec!["b.rs -> a.rs: lt".to_string()]);
    assert_eq!(report, "");
}
