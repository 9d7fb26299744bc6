//! The rules of `docs/architecture.md`, checked against the code: which
//! room may use which (its "Rooms and their arrows" table), no circle, no
//! Lua script loaded from another room's folder, and the size bounds of
//! files and functions. The table is read from the document itself, so the
//! map a newcomer opens and the code cannot drift apart.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const DOC: &str = include_str!("../../docs/architecture.md");

/// The crate's source folder.
fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The room a file belongs to: its top-level module under `src/`
/// (`main.rs` and `cli/` are the binary, `cli`).
fn room_of(path: &Path) -> String {
    let rel = path.strip_prefix(src()).expect("under src");
    let first = rel.components().next().expect("a component");
    let name = first.as_os_str().to_str().expect("utf-8 path");
    match name.strip_suffix(".rs") {
        Some("main") => "cli".to_owned(),
        Some(module) => module.to_owned(),
        None => name.to_owned(),
    }
}

/// The code of a file without its `#[cfg(test)]` module (tests may reach
/// across rooms to set a scene) and without comments (a doc link is not a
/// dependency).
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The rooms of the crate: its top-level modules.
fn rooms() -> BTreeSet<String> {
    std::fs::read_dir(src())
        .expect("read src")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .into_string()
                .expect("utf-8")
        })
        .map(|name| name.trim_end_matches(".rs").to_owned())
        .collect()
}

/// The rooms `code` names as `<prefix><room>` (`crate::` inside the
/// library, `dtq_host::` in the binary).
fn rooms_used(code: &str, prefix: &str, rooms: &BTreeSet<String>) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for (at, _) in code.match_indices(prefix) {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let name: String = code[at + prefix.len()..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if rooms.contains(&name) {
            used.insert(name);
        }
    }
    used
}

/// The "Rooms and their arrows" table: room → the rooms it may use.
fn allowed() -> BTreeMap<String, BTreeSet<String>> {
    let start = DOC
        .find("## Rooms and their arrows")
        .expect("the table's section");
    let mut table = BTreeMap::new();
    for line in DOC[start..].lines().skip(1) {
        if line.starts_with("## ") {
            break;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || cells[1].starts_with('-') || cells[1] == "room" {
            continue;
        }
        let strip = |s: &str| s.trim().trim_matches('`').to_owned();
        let uses = cells[2]
            .split(',')
            .map(strip)
            .filter(|s| !s.is_empty() && s != "nothing")
            .collect();
        table.insert(strip(cells[1]), uses);
    }
    assert!(!table.is_empty(), "no rows in docs/architecture.md's table");
    table
}

#[test]
fn every_room_uses_only_the_rooms_the_map_allows() {
    let allowed = allowed();
    let rooms = rooms();
    let mut wrong = Vec::new();
    for file in rust_files(&src()) {
        let room = room_of(&file);
        if room == "lib" || room == "architecture" {
            continue;
        }
        let Some(may) = allowed.get(&room) else {
            wrong.push(format!(
                "{}: room `{room}` is not in the map",
                file.display()
            ));
            continue;
        };
        let code = code_of(&std::fs::read_to_string(&file).expect("read"));
        let prefix = if room == "cli" {
            "dtq_host::"
        } else {
            "crate::"
        };
        for used in rooms_used(&code, prefix, &rooms) {
            if used != room && !may.contains(&used) {
                wrong.push(format!("{}: `{room}` uses `{used}`", file.display()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "arrows the map does not allow:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_map_has_no_circle() {
    let allowed = allowed();
    // Depth-first search for a back edge.
    fn visit<'a>(
        room: &'a str,
        allowed: &'a BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) {
        if done.contains(room) {
            return;
        }
        assert!(
            !path.contains(&room),
            "a circle: {} -> {room}",
            path.join(" -> ")
        );
        path.push(room);
        for next in allowed.get(room).into_iter().flatten() {
            visit(next, allowed, path, done);
        }
        path.pop();
        done.insert(room);
    }
    let mut done = BTreeSet::new();
    for room in allowed.keys() {
        visit(room, &allowed, &mut Vec::new(), &mut done);
    }
}

#[test]
fn no_lua_is_loaded_from_another_folder() {
    for file in rust_files(&src()) {
        let text = std::fs::read_to_string(&file).expect("read");
        for (at, _) in text.match_indices("include_str!(\"../") {
            let rest = &text[at..];
            let end = rest.find(')').unwrap_or(rest.len());
            assert!(
                !rest[..end].contains(".lua"),
                "{} loads Lua from another folder: {}",
                file.display(),
                &rest[..end]
            );
        }
    }
}

/// Files may be long only where the doc's exceptions name them (one
/// cohesive table).
#[test]
fn files_and_functions_a_reader_can_hold() {
    const MAX_FILE_LINES: usize = 650;
    const MAX_FN_LINES: usize = 85;
    let exceptions: Vec<&str> = DOC
        .lines()
        .filter_map(|l| l.strip_prefix("- long by design: `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    let mut wrong = Vec::new();
    for file in rust_files(&src()) {
        let rel = file.strip_prefix(src()).expect("under src");
        let rel = rel.to_str().expect("utf-8");
        let text = std::fs::read_to_string(&file).expect("read");
        let code = match text.find("#[cfg(test)]\nmod tests") {
            Some(at) => &text[..at],
            None => &text[..],
        };
        let lines = code.lines().count();
        if lines > MAX_FILE_LINES && !exceptions.contains(&rel) {
            wrong.push(format!("{rel}: {lines} lines outside its tests"));
        }
        for (name, len) in functions(code) {
            if len > MAX_FN_LINES {
                wrong.push(format!("{rel}: fn {name} is {len} lines"));
            }
        }
    }
    assert!(wrong.is_empty(), "over the bounds:\n{}", wrong.join("\n"));
}

/// Each `fn` in `code` with its length in lines, from its signature to the
/// line that closes it at the signature's indentation.
fn functions(code: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let sig = [
            "fn ",
            "pub fn ",
            "pub(crate) fn ",
            "pub(super) fn ",
            "async fn ",
            "pub async fn ",
            "pub(crate) async fn ",
            "pub(super) async fn ",
        ]
        .iter()
        .find_map(|p| trimmed.strip_prefix(p));
        let Some(sig) = sig else { continue };
        let name: String = sig
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // A declaration without a body, or a body on the signature's line.
        let opens = lines[i..]
            .iter()
            .map(|l| l.trim_end())
            .find(|l| l.ends_with('{') || l.ends_with(';') || l.ends_with('}'));
        if !opens.is_some_and(|l| l.ends_with('{')) {
            continue;
        }
        let indent = line.len() - trimmed.len();
        let close = " ".repeat(indent) + "}";
        if let Some(end) = lines[i..].iter().position(|l| *l == close) {
            found.push((name, end + 1));
        }
    }
    found
}
