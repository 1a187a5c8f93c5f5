//! The crate's module dependencies run one way.
//!
//! Parses every source file of the crate, collects the crate-local paths it names (`use`
//! items, paths in code, `$crate::`/`crate::` paths inside macros), resolves each to the
//! module that defines it, and checks that:
//! - no file module depends on itself through others (no import circle),
//! - no top-level module does either, and each one uses only modules listed before it in the
//!   layer list of `docs/architecture.md`, which must name every top-level module,
//! - nothing inside the crate imports through the crate root's re-exports.
//!
//! Every other crate of the workspace (and the tools) is held to the first rule: no import
//! circle between its files, nor between its top-level modules. There a path through the crate
//! root counts as a use of the module the root re-exports it from.
//!
//! And no function anywhere in the workspace, outside the kernels, runs to 100 lines or more.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// A module path below the crate root, as `["store", "param"]`.
type Module = Vec<String>;

/// Every `.rs` file under `dir`, with its module path.
fn modules(dir: &Path, prefix: &Module, out: &mut BTreeMap<Module, PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("source directory")
        .map(|entry| entry.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 file name")
            .to_string();
        if path.is_dir() {
            if prefix.is_empty() && name == "bin" {
                // Binaries are crates of their own, using this one by name.
                continue;
            }
            let mut sub = prefix.clone();
            sub.push(name);
            modules(&path, &sub, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let module = match name.as_str() {
                "lib" | "mod" => prefix.clone(),
                "main" if prefix.is_empty() => prefix.clone(),
                _ => {
                    let mut m = prefix.clone();
                    m.push(name);
                    m
                }
            };
            out.insert(module, path);
        }
    }
}

/// The paths one file names, each with the inline module (`mod tests { … }`) it is written
/// in, relative to the file's module.
#[derive(Default)]
struct Paths {
    inline: Vec<String>,
    paths: Vec<(Vec<String>, Vec<String>)>,
}

impl Paths {
    fn push(&mut self, path: Vec<String>) {
        self.paths.push((self.inline.clone(), path));
    }

    fn use_tree(&mut self, prefix: &[String], tree: &syn::UseTree) {
        let with = |segment: String| {
            let mut path = prefix.to_vec();
            path.push(segment);
            path
        };
        match tree {
            syn::UseTree::Path(p) => self.use_tree(&with(p.ident.to_string()), &p.tree),
            syn::UseTree::Name(n) => self.push(with(n.ident.to_string())),
            syn::UseTree::Rename(r) => self.push(with(r.ident.to_string())),
            syn::UseTree::Glob(_) => self.push(prefix.to_vec()),
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| self.use_tree(prefix, t)),
        }
    }

    /// `crate :: a :: b` (also after `$`) inside a macro's tokens.
    fn tokens(&mut self, tokens: TokenStream) {
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        for (i, token) in tokens.iter().enumerate() {
            match token {
                TokenTree::Group(group) => self.tokens(group.stream()),
                TokenTree::Ident(ident) if ident == "crate" => {
                    let mut path = vec!["crate".to_string()];
                    let mut j = i + 1;
                    while let (
                        Some(TokenTree::Punct(a)),
                        Some(TokenTree::Punct(b)),
                        Some(TokenTree::Ident(next)),
                    ) = (tokens.get(j), tokens.get(j + 1), tokens.get(j + 2))
                    {
                        if a.as_char() != ':' || b.as_char() != ':' {
                            break;
                        }
                        path.push(next.to_string());
                        j += 3;
                    }
                    self.push(path);
                }
                _ => {}
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if item.content.is_some() {
            self.inline.push(item.ident.to_string());
            syn::visit::visit_item_mod(self, item);
            self.inline.pop();
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(&[], &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.push(path.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
    }
}

/// The module of this crate that `path`, written in module `from` (with its inline modules
/// `inline`), names; `None` for another crate's path or an item in scope. A path through the
/// crate root's re-exports is an `Err`, or, given the root's `exports` (item name to module),
/// the module the item comes from.
fn resolve(
    from: &Module,
    inline: &[String],
    path: &[String],
    known: &BTreeMap<Module, PathBuf>,
    exports: Option<&BTreeMap<String, Module>>,
) -> Result<Option<Module>, String> {
    let Some(first) = path.first() else {
        return Ok(None);
    };
    let here: Module = from.iter().chain(inline).cloned().collect();
    let (base, rest): (Module, &[String]) = match first.as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (here, &path[1..]),
        "super" => {
            let up = path.iter().take_while(|s| *s == "super").count();
            (here[..here.len().saturating_sub(up)].to_vec(), &path[up..])
        }
        _ => {
            let mut child = here.clone();
            child.push(first.clone());
            if !known.contains_key(&child) {
                return Ok(None);
            }
            (here, path)
        }
    };
    // The deepest known module along the path.
    let mut found = base.clone();
    let mut walked = base;
    for segment in rest {
        walked.push(segment.clone());
        if known.contains_key(&walked) {
            found = walked.clone();
        } else {
            break;
        }
    }
    if found.is_empty() {
        if first != "crate" || rest.is_empty() {
            return Ok(None);
        }
        let Some(exports) = exports else {
            return Err(format!("`{}` goes through the crate root", path.join("::")));
        };
        match exports.get(&rest[0]) {
            Some(module) => found = module.clone(),
            None => return Ok(None),
        }
    }
    if found.starts_with(from) {
        // The file's own items, or its inline modules'.
        return Ok(None);
    }
    Ok(Some(found))
}

/// The items the crate root brings in with `use`, by name, with the module each comes from.
fn root_exports(known: &BTreeMap<Module, PathBuf>) -> BTreeMap<String, Module> {
    let Some(root) = known.get(&Vec::new()) else {
        return BTreeMap::new();
    };
    let text = std::fs::read_to_string(root).expect("crate root");
    let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", root.display()));
    let mut paths = Paths::default();
    for item in &ast.items {
        if let syn::Item::Use(item) = item {
            paths.use_tree(&[], &item.tree);
        }
    }
    let mut exports = BTreeMap::new();
    for (_, path) in paths.paths {
        let rest = match path.first().map(String::as_str) {
            Some("crate" | "self") => &path[1..],
            _ => &path[..],
        };
        // The deepest module of this crate along the path, as `resolve` walks it.
        let mut module = Vec::new();
        for segment in rest {
            module.push(segment.clone());
            if !known.contains_key(&module) {
                module.pop();
                break;
            }
        }
        if let (Some(name), false) = (path.last(), module.is_empty()) {
            exports.insert(name.clone(), module);
        }
    }
    exports
}

/// Module-to-module edges of the crate, by file module; and paths through the crate root
/// (errors unless `through_root`, where they resolve through the root's re-exports).
fn edges(src: &Path, through_root: bool) -> (BTreeMap<Module, BTreeSet<Module>>, Vec<String>) {
    let mut known = BTreeMap::new();
    modules(src, &Vec::new(), &mut known);
    let exports = through_root.then(|| root_exports(&known));
    let mut graph: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    let mut errors = Vec::new();
    for (module, file) in &known {
        if module.is_empty() {
            // The crate root declares and re-exports every module.
            continue;
        }
        let text = std::fs::read_to_string(file).expect("source file");
        let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let mut paths = Paths::default();
        paths.visit_file(&ast);
        let entry = graph.entry(module.clone()).or_default();
        for (inline, path) in paths.paths {
            match resolve(module, &inline, &path, &known, exports.as_ref()) {
                Ok(Some(target)) => {
                    entry.insert(target);
                }
                Ok(None) => {}
                Err(error) => errors.push(format!("{}: {error}", file.display())),
            }
        }
    }
    (graph, errors)
}

/// A cycle of `graph`, if it has one.
fn find_cycle<N: Ord + Clone>(graph: &BTreeMap<N, BTreeSet<N>>) -> Option<Vec<N>> {
    fn visit<N: Ord + Clone>(
        node: &N,
        graph: &BTreeMap<N, BTreeSet<N>>,
        done: &mut BTreeSet<N>,
        stack: &mut Vec<N>,
    ) -> Option<Vec<N>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.clone());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, done, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut done, &mut Vec::new()))
}

fn show(module: &Module) -> String {
    if module.is_empty() {
        "crate".into()
    } else {
        module.join("::")
    }
}

/// The layers listed in `docs/architecture.md` between `<!-- layers -->` and
/// `<!-- /layers -->`, lowest first: one line per layer, its modules separated by commas
/// (with or without backticks or a leading list marker).
fn documented_layers(doc: &str) -> Vec<BTreeSet<String>> {
    let start = doc
        .find("<!-- layers -->")
        .expect("a `<!-- layers -->` marker");
    let end = doc
        .find("<!-- /layers -->")
        .expect("a `<!-- /layers -->` marker");
    doc[start + "<!-- layers -->".len()..end]
        .lines()
        .map(|line| line.trim().trim_start_matches(['-', '*', ' ']))
        .filter(|line| !line.is_empty() && !line.starts_with("```"))
        .map(|line| {
            let names = line.split(':').next().unwrap_or(line);
            names
                .split(',')
                .map(|name| {
                    name.trim()
                        .trim_matches('`')
                        .trim_end_matches('/')
                        .to_string()
                })
                .filter(|name| !name.is_empty())
                .collect()
        })
        .collect()
}

#[test]
fn module_dependencies_run_one_way() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (graph, errors) = edges(&root.join("src"), false);
    assert!(
        errors.is_empty(),
        "imports through the crate root:\n{}",
        errors.join("\n")
    );
    assert!(
        graph.len() > 10,
        "the crate's modules were not found: {graph:?}"
    );

    if let Some(cycle) = find_cycle(&graph) {
        let cycle: Vec<String> = cycle.iter().map(show).collect();
        panic!("import circle between files: {}", cycle.join(" -> "));
    }

    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, targets) in &graph {
        let Some(first) = from.first() else { continue };
        let entry = top.entry(first.clone()).or_default();
        for target in targets {
            if let Some(to) = target.first()
                && to != first
            {
                entry.insert(to.clone());
            }
        }
    }
    if let Some(cycle) = find_cycle(&top) {
        panic!("import circle between modules: {}", cycle.join(" -> "));
    }

    let doc = std::fs::read_to_string(root.join("../../docs/architecture.md"))
        .expect("docs/architecture.md");
    let layers = documented_layers(&doc);
    let layer_of = |module: &str| layers.iter().position(|layer| layer.contains(module));
    let mut wrong = Vec::new();
    for (from, targets) in &top {
        let Some(here) = layer_of(from) else {
            wrong.push(format!("`{from}` is missing from the layer list"));
            continue;
        };
        for to in targets {
            match layer_of(to) {
                Some(there) if there < here => {}
                Some(_) => wrong.push(format!("`{from}` uses `{to}`, listed at or above it")),
                None => wrong.push(format!("`{to}` is missing from the layer list")),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/architecture.md's layers do not match the code:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_finds_a_circle() {
    // The checker itself: a three-file circle and a two-module one are reported.
    let dir = std::env::temp_dir().join(format!("burn-zero-arch-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("a")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\n").unwrap();
    std::fs::write(src.join("a/mod.rs"), "mod x;\nmod y;\n").unwrap();
    std::fs::write(src.join("a/x.rs"), "use crate::a::y::Y;\npub struct X;\n").unwrap();
    std::fs::write(src.join("a/y.rs"), "pub struct Y(crate::b::B);\n").unwrap();
    std::fs::write(
        src.join("b.rs"),
        "macro_rules! m { () => { $crate::a::x::X } }\npub struct B;\n",
    )
    .unwrap();
    let (graph, errors) = edges(&src, false);
    std::fs::remove_dir_all(&dir).ok();
    assert!(errors.is_empty(), "{errors:?}");
    let cycle = find_cycle(&graph).expect("a -> y -> b -> x -> y is a circle");
    let cycle: Vec<String> = cycle.iter().map(show).collect();
    assert_eq!(cycle, ["a::x", "a::y", "b", "a::x"]);
}

/// Every crate of the workspace and every tool: no import circle between files or top-level
/// modules.
#[test]
fn no_crate_of_the_workspace_has_an_import_circle() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut sources = vec![workspace.join("src")];
    for group in ["crates", "tools"] {
        let mut found: Vec<PathBuf> = std::fs::read_dir(workspace.join(group))
            .expect("workspace folder")
            .map(|entry| entry.expect("directory entry").path().join("src"))
            .filter(|src| src.is_dir())
            .collect();
        found.sort();
        sources.extend(found);
    }
    assert!(
        sources.len() > 8,
        "the workspace's crates were not found: {sources:?}"
    );
    let mut circles = Vec::new();
    for src in &sources {
        let (graph, _) = edges(src, true);
        if let Some(cycle) = find_cycle(&graph) {
            let cycle: Vec<String> = cycle.iter().map(show).collect();
            circles.push(format!("{}: files {}", src.display(), cycle.join(" -> ")));
        }
        let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, targets) in &graph {
            let Some(first) = from.first() else { continue };
            let entry = top.entry(first.clone()).or_default();
            for to in targets.iter().filter_map(|t| t.first()) {
                if to != first {
                    entry.insert(to.clone());
                }
            }
        }
        if let Some(cycle) = find_cycle(&top) {
            circles.push(format!("{}: modules {}", src.display(), cycle.join(" -> ")));
        }
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_check_follows_the_crate_root_s_re_exports() {
    // Outside core a path through the root is allowed, and counts as a use of its module.
    let dir = std::env::temp_dir().join(format!("burn-zero-arch-root-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(
        src.join("lib.rs"),
        "mod a;\nmod b;\npub use a::A;\npub use b::B;\n",
    )
    .unwrap();
    std::fs::write(src.join("a.rs"), "pub struct A(crate::B);\n").unwrap();
    std::fs::write(src.join("b.rs"), "pub struct B(Box<crate::A>);\n").unwrap();
    let (strict, errors) = edges(&src, false);
    let (through, _) = edges(&src, true);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(find_cycle(&strict).is_none());
    let cycle = find_cycle(&through).expect("a -> b -> a through the root is a circle");
    let cycle: Vec<String> = cycle.iter().map(show).collect();
    assert_eq!(cycle, ["a", "b", "a"]);
}

/// Every `.rs` file under `dir`, recursively (none when it does not exist).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The functions of `text` (formatted by rustfmt) that run to `limit` lines or more, from the
/// `fn` line to the brace that closes it at the same indentation, as `(line, name, length)`.
fn long_functions(text: &str, limit: usize) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut long = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let words: Vec<&str> = body.split_whitespace().collect();
        let Some(fn_at) = words.iter().position(|w| *w == "fn") else {
            continue;
        };
        let qualifiers = ["pub", "const", "async", "unsafe", "extern", "\"C\""];
        let qualified = words[..fn_at]
            .iter()
            .all(|w| qualifiers.contains(w) || w.starts_with("pub("));
        if !qualified || body.starts_with("//") {
            continue;
        }
        let name: String = words
            .get(fn_at + 1)
            .map(|w| {
                w.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect()
            })
            .unwrap_or_default();
        // The signature ends at the first line ending in `{` (a body), `;` (none) or `}` (a
        // body on the same line).
        let Some(open) = (at..lines.len()).find(|&i| {
            let l = lines[i].trim_end();
            l.ends_with('{') || l.ends_with(';') || l.ends_with('}')
        }) else {
            continue;
        };
        if !lines[open].trim_end().ends_with('{') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = (open + 1..lines.len()).find(|&i| lines[i] == close) {
            let length = end - at + 1;
            if length >= limit {
                long.push((at + 1, name, length));
            }
        }
    }
    long
}

#[test]
fn no_function_outside_the_kernels_runs_to_100_lines() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches", "examples"] {
        rust_files(&workspace.join(dir), &mut files);
    }
    for group in ["crates", "tools"] {
        for entry in std::fs::read_dir(workspace.join(group)).expect("workspace folder") {
            let krate = entry.expect("directory entry").path();
            for dir in ["src", "tests", "benches", "examples"] {
                rust_files(&krate.join(dir), &mut files);
            }
        }
    }
    // The kernels are cubecl's `#[cube]` functions, one launch's arithmetic each.
    let kernels = workspace.join("crates/burn-zero-kernels/src/kernel");
    files.retain(|file| !file.starts_with(&kernels));
    assert!(
        files.len() > 100,
        "the workspace's files were not found: {}",
        files.len()
    );
    let mut long = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("source file");
        for (line, name, length) in long_functions(&text, 100) {
            long.push(format!(
                "{}:{line}: `{name}`, {length} lines",
                file.display()
            ));
        }
    }
    assert!(
        long.is_empty(),
        "functions of 100 lines or more:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_length_check_measures_a_function_from_fn_to_its_closing_brace() {
    let body = "    let x = 1;\n".repeat(97);
    let text = format!(
        "pub(crate) fn long(\n    a: usize,\n) {{\n{body}}}\n\nfn short() {{}}\n\nimpl A {{\n    \
         fn inner() {{\n{body}{body}    }}\n    fn declared();\n}}\n"
    );
    let long = long_functions(&text, 100);
    assert_eq!(
        long,
        [
            (1, "long".to_string(), 101),
            (106, "inner".to_string(), 196)
        ]
    );
}
