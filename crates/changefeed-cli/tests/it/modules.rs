//! The binary's modules import each other without a cycle, and `usage` (usage errors and exit
//! codes) imports none of them: each command can be read, moved or split on its own.
//!
//! Read from the source as text: a module depends on another when its code (tests left out)
//! names `crate::OTHER` (comments left out too).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules its non-test code names.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if !name.ends_with(".rs") || name == "tests.rs" || name == "main.rs" {
                continue;
            }
            let relative = path.strip_prefix(&src).expect("under src");
            let first = relative.components().next().expect("a file");
            let module = first
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            let text = std::fs::read_to_string(&path).expect("a source file");
            let code: String = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or("")
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let named = graph.entry(module.clone()).or_default();
            for (i, _) in code.match_indices("crate::") {
                let rest = &code[i + "crate::".len()..];
                let other: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !other.is_empty() && other != module && !other.starts_with(char::is_uppercase) {
                    named.insert(other);
                }
            }
        }
    }
    graph
}

/// A cycle through the graph, if there is one, as the modules along it.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_string());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|start| visit(start, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_binarys_modules_import_each_other_without_a_cycle() {
    let graph = imports();
    assert!(
        graph.len() >= 10 && graph.contains_key("run") && graph.contains_key("usage"),
        "the modules were read: {graph:?}"
    );
    assert!(
        graph.values().flatten().any(|m| m == "usage"),
        "imports were read: {graph:?}"
    );
    if let Some(found) = cycle(&graph) {
        panic!(
            "the modules import each other in a cycle: {}",
            found.join(" → ")
        );
    }
    assert_eq!(
        graph["usage"],
        BTreeSet::new(),
        "usage is the leaf every command imports"
    );
}
