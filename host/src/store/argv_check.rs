//! The checks that hold every script's ARGV to its [`ArgvLayout`], for the
//! tests of each room with scripts (`store`, `sandbox`, `deploy`): each
//! passes its layouts with the text of their scripts to [`check_room`].
//!
//! A script reads its arguments by name: `local ARG_NOW = 2` at the top,
//! then `ARGV[ARG_NOW]`. So, in every room:
//! - each script of `<room>/lua/` that reads ARGV has a layout (a new
//!   script cannot be left out: the room's `lua/` is listed, not a count);
//! - a layout's names are its script's `<prefix><NAME> = <n>` locals, in
//!   order, with the right numbers, and its header names each of them;
//! - no script uses a name of that prefix it does not declare (a misspelt
//!   name is `nil` in Lua, and `ARGV[nil]` is `nil`, silently);
//! - and no Lua file anywhere reads ARGV at a literal index (`ARGV[2]`,
//!   `unpack(ARGV, 2)`, `ipairs(ARGV)`), which
//!   `no_lua_reads_argv_at_a_literal_index` checks across the rooms.

use std::path::{Path, PathBuf};

use super::scripts::ArgvLayout;

/// `host/src/<room>/lua`.
fn lua_dir(room: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(room)
        .join("lua")
}

/// The `.lua` files directly in `dir` (not its `include/`), by stem.
fn scripts_in(dir: &Path) -> Vec<(String, String)> {
    let mut scripts: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| {
            let path = entry.expect("a directory entry").path();
            let stem = path.file_name()?.to_str()?.strip_suffix(".lua")?.to_owned();
            let text = std::fs::read_to_string(&path).expect("a readable script");
            Some((stem, text))
        })
        .collect();
    scripts.sort();
    scripts
}

/// A Lua text split into its code and its comments (`--[[ … ]]` blocks
/// and `--` to the end of a line).
fn split(text: &str) -> (String, String) {
    let (mut code, mut comments) = (String::new(), String::new());
    let mut rest = text;
    while let Some(at) = rest.find("--") {
        code.push_str(&rest[..at]);
        let end = if rest[at..].starts_with("--[[") {
            rest[at..].find("]]").map_or(rest.len(), |n| at + n + 2)
        } else {
            rest[at..].find('\n').map_or(rest.len(), |n| at + n)
        };
        comments.push_str(&rest[at..end]);
        comments.push('\n');
        rest = &rest[end..];
    }
    code.push_str(rest);
    (code, comments)
}

/// The code of a Lua text, without its comments.
pub(crate) fn code(text: &str) -> String {
    split(text).0
}

/// The `local <prefix><NAME> = <n>` lines of `script`, in order.
pub(crate) fn argv_locals(script: &str, prefix: &str) -> Vec<(String, usize)> {
    script
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("local ")?.strip_prefix(prefix)?;
            let (name, value) = rest.split_once(" = ")?;
            Some((name.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The identifiers of `code` that start with `prefix` and are written in
/// capitals (`ARG_NOW`, `C_TASK_ID`).
fn prefixed_names(code: &str, prefix: &str) -> Vec<String> {
    code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.len() > prefix.len() && word.starts_with(prefix))
        .filter(|word| {
            word.chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_owned)
        .collect()
}

/// What `code` reads of ARGV at a literal index, one line each.
pub(crate) fn literal_reads(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in code.lines() {
        let squeezed: String = line.chars().filter(|c| !c.is_whitespace()).collect();
        let literal = |pattern: &str| {
            squeezed.match_indices(pattern).any(|(at, _)| {
                squeezed[at + pattern.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_digit())
            })
        };
        if literal("ARGV[") || literal("unpack(ARGV,") || squeezed.contains("ipairs(ARGV)") {
            found.push(line.trim().to_owned());
        }
    }
    found
}

/// Check one layout against `text`, the script as Redis runs it (its
/// fragments first, when they declare some of its names).
fn check_layout(layout: &ArgvLayout, text: &str) {
    let script = layout.script;
    let mut expected: Vec<(String, usize)> = (layout.names.iter())
        .enumerate()
        .map(|(i, name)| ((*name).to_owned(), layout.first + i))
        .collect();
    if let Some(rest) = layout.rest {
        expected.push((rest.to_owned(), layout.first + layout.names.len()));
    }
    assert_eq!(
        argv_locals(text, layout.prefix),
        expected,
        "{script}.lua: its {}* locals are not the layout's names",
        layout.prefix
    );
    let (code, comments) = split(text);
    for (name, _) in &expected {
        let name = format!("{}{name}", layout.prefix);
        assert!(
            comments.contains(&name),
            "{script}.lua: its header does not name {name}"
        );
    }
    for used in prefixed_names(&code, layout.prefix) {
        let declared = expected
            .iter()
            .any(|(name, _)| used == format!("{}{name}", layout.prefix));
        assert!(
            declared,
            "{script}.lua uses {used}, which it does not declare"
        );
    }
}

/// Check `room`'s layouts, each with its script's text as Redis runs it,
/// and that every script of `<room>/lua/` that reads ARGV has one, but
/// those in `apart` (checked elsewhere, each with its reason there).
pub(crate) fn check_room(room: &str, layouts: &[(&ArgvLayout, String)], apart: &[&str]) {
    for (layout, text) in layouts {
        check_layout(layout, text);
    }
    for (stem, text) in scripts_in(&lua_dir(room)) {
        if !code(&text).contains("ARGV") || apart.contains(&stem.as_str()) {
            continue;
        }
        assert!(
            layouts.iter().any(|(layout, _)| layout.script == stem),
            "{room}/lua/{stem}.lua reads ARGV but has no ArgvLayout in the room's test"
        );
    }
}

/// The text of `files` of `room`'s `lua/`, in order: a script after the
/// fragments that declare some of its names.
pub(crate) fn text(room: &str, files: &[&str]) -> String {
    files
        .iter()
        .map(|file| {
            let path = lua_dir(room).join(format!("{file}.lua"));
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .collect()
}

#[test]
fn no_lua_reads_argv_at_a_literal_index() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut seen = 0;
    for room in std::fs::read_dir(&src).expect("src") {
        let dir = room.expect("a directory entry").path().join("lua");
        if !dir.is_dir() {
            continue;
        }
        for dir in [dir.join("include"), dir] {
            if !dir.is_dir() {
                continue;
            }
            for (stem, text) in scripts_in(&dir) {
                seen += 1;
                let reads = literal_reads(&code(&text));
                assert!(
                    reads.is_empty(),
                    "{}/{stem}.lua reads ARGV at a literal index: {reads:?}",
                    dir.display()
                );
            }
        }
    }
    assert!(seen > 30, "only {seen} Lua files found");
}

#[test]
fn the_checks_see_what_they_look_for() {
    assert_eq!(
        literal_reads("local a = ARGV[2]\nlocal b = ARGV[ARG_B]\nunpack(ARGV, 3)"),
        vec!["local a = ARGV[2]", "unpack(ARGV, 3)"]
    );
    assert_eq!(
        literal_reads("for _, d in ipairs(ARGV) do"),
        vec!["for _, d in ipairs(ARGV) do"]
    );
    assert!(literal_reads("ARGV[a + 1], unpack(ARGV, ARG_FIELDS), #ARGV").is_empty());
    assert_eq!(
        split("--[[\n  ARGV[1] x\n]]\nlocal y = 1 -- ARGV[2]\nz"),
        (
            "\nlocal y = 1 \nz".to_owned(),
            "--[[\n  ARGV[1] x\n]]\n-- ARGV[2]\n".to_owned()
        )
    );
    assert_eq!(
        prefixed_names("ARGV[ARG_NOW] .. ARG_x .. MY_ARG_A", "ARG_"),
        vec!["ARG_NOW"]
    );
    assert_eq!(
        argv_locals("local ARG_A = 1\nlocal ARG_B = 2\nlocal x = 3", "ARG_"),
        vec![("A".to_owned(), 1), ("B".to_owned(), 2)]
    );
}
