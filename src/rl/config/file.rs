//! A config file is accepted only whole: one that holds nothing (empty, or comments only) would
//! train on defaults, and so would one cut off part-way (a section left with no value). Both
//! are refused with the file named; a file that does not end with a newline (as one cut
//! mid-line does not) gets a warning. A file is read only up to [`MAX_CONFIG_BYTES`], and its
//! nesting is measured (in one pass) before the YAML parser sees it: a parser's time and stack
//! grow faster than the depth of what it parses.

use std::io::Read;
use std::path::Path;

use serde_yaml::Value as Yaml;

use crate::error::{Result, TroupeError};

/// Largest config file read (configs are a few kilobytes).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Deepest nesting of mappings and sequences in a config (a config needs four).
pub const MAX_CONFIG_DEPTH: usize = 64;

/// Reads the config file `path`: at most [`MAX_CONFIG_BYTES`] (what is larger, or never ends
/// as `/dev/zero` does, is refused without reading the rest), as UTF-8, then
/// [`check_depth`].
pub fn read_config(path: &Path) -> Result<String> {
    let file = std::fs::File::open(path).map_err(|e| TroupeError::io(path, e))?;
    if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(TroupeError::BadValue {
            origin: Some(path.to_path_buf()),
            key: String::new(),
            message: "is a directory, not a config file".into(),
        });
    }
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes).map_err(|e| TroupeError::io(path, e))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(TroupeError::BadValue {
            origin: Some(path.to_path_buf()),
            key: String::new(),
            message: format!("is larger than {MAX_CONFIG_BYTES} bytes, too large for a config file"),
        });
    }
    let text = String::from_utf8(bytes).map_err(|e| TroupeError::BadValue {
        origin: Some(path.to_path_buf()),
        key: String::new(),
        message: format!("is not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to()),
    })?;
    check_depth(&text, path)?;
    Ok(text)
}

/// Refuses YAML `text` nested deeper than [`MAX_CONFIG_DEPTH`], measured in one pass without
/// parsing: flow brackets (`{`, `[` outside quotes and comments) plus block levels (a stack of
/// indentation columns, and each leading `- ` / `? ` indicator of a line). The measure may
/// exceed the true depth, never fall short of it.
pub fn check_depth(text: &str, origin: &Path) -> Result<()> {
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    for (number, line) in text.lines().enumerate() {
        let content = line.trim_start_matches([' ', '\t']);
        if flow == 0 && !content.is_empty() && !content.starts_with('#') {
            let indent = line.len() - content.len();
            while indents.last().is_some_and(|&top| top > indent) {
                indents.pop();
            }
            if indents.last() != Some(&indent) {
                indents.push(indent);
            }
        }
        let mut rest = content;
        let mut indicators = 0usize;
        while let Some(after) = rest.strip_prefix("- ").or_else(|| rest.strip_prefix("? ")) {
            indicators += 1;
            rest = after.trim_start_matches(' ');
        }
        let mut quote: Option<char> = None;
        let mut deepest_flow = flow;
        let mut previous = ' ';
        for c in rest.chars() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') if previous == ' ' || "[{,:".contains(previous) => quote = Some(c),
                (None, '#') if previous == ' ' => break,
                (None, '{' | '[') => {
                    flow += 1;
                    deepest_flow = deepest_flow.max(flow);
                }
                (None, '}' | ']') => flow = flow.saturating_sub(1),
                _ => {}
            }
            previous = c;
        }
        let depth = indents.len() + indicators + deepest_flow;
        if depth > MAX_CONFIG_DEPTH {
            return Err(TroupeError::BadValue {
                origin: Some(origin.to_path_buf()),
                key: String::new(),
                message: format!(
                    "line {}: nested more than {MAX_CONFIG_DEPTH} levels deep, deeper than any config",
                    number + 1
                ),
            });
        }
    }
    Ok(())
}

/// The key path (`env.life_loss_penalty`, `agents.seats[1]`) and value of the first number in
/// `tree` that is not finite (`.nan`, `.inf`): refused everywhere, since the free-form sections
/// (an environment's parameters) carry JSON, where such a number would silently become null.
pub fn non_finite_number(tree: &Yaml) -> Option<(String, f64)> {
    fn walk(node: &Yaml, path: &mut String) -> Option<(String, f64)> {
        match node {
            Yaml::Number(n) => n.as_f64().filter(|x| !x.is_finite()).map(|x| (path.clone(), x)),
            Yaml::Sequence(items) => items.iter().enumerate().find_map(|(i, item)| {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                let found = walk(item, path);
                path.truncate(len);
                found
            }),
            Yaml::Mapping(map) => map.iter().find_map(|(key, value)| {
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key.as_str().unwrap_or("?"));
                let found = walk(value, path);
                path.truncate(len);
                found
            }),
            Yaml::Tagged(tagged) => walk(&tagged.value, path),
            _ => None,
        }
    }
    walk(tree, &mut String::new())
}

/// Refuses `text` (the file `origin`) when it holds no config or a section without a value.
pub fn check_whole(text: &str, origin: &Path) -> Result<()> {
    let fail =
        |key: String, message: String| TroupeError::BadValue { origin: Some(origin.to_path_buf()), key, message };
    // A syntax error is reported by the parser proper, with its line and column.
    let Ok(tree) = serde_yaml::from_str::<Yaml>(text) else { return Ok(()) };
    if tree.is_null() {
        return Err(fail(
            String::new(),
            "holds no config (the file is empty or only comments); a config needs at least one section (run, model, env, ...)"
                .into(),
        ));
    }
    if let Yaml::Mapping(sections) = &tree {
        for (key, value) in sections {
            if value.is_null() {
                let name = key.as_str().unwrap_or("?").to_string();
                return Err(fail(
                    name,
                    "has no value: the section is empty (was the file cut off?); remove it or fill it in".into(),
                ));
            }
        }
    }
    if !text.is_empty() && !text.ends_with('\n') {
        tracing::warn!(
            "{} does not end with a newline: if it was cut off, the keys after line {} take their defaults",
            origin.display(),
            text.lines().count()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> std::result::Result<(), String> {
        check_whole(text, Path::new("c.yaml")).map_err(|e| e.to_string())
    }

    #[test]
    fn empty_comment_only_and_cut_off_files_are_refused() {
        assert!(check("").unwrap_err().contains("holds no config"));
        assert!(check("# only a comment\n\n   # another\n").unwrap_err().contains("c.yaml"));
        let cut = check("run:\n  seed: 1\neval:\n").unwrap_err();
        assert!(cut.contains("eval") && cut.contains("cut off"), "{cut}");
        assert!(check("run:\n  seed: 1\n").is_ok());
        // Syntax errors are left to the parser, which names line and column.
        assert!(check("run: {seed: 1\n").is_ok());
    }

    #[test]
    fn non_finite_numbers_are_found_by_key() {
        let tree: Yaml =
            serde_yaml::from_str("env: {name: hanabi, life_loss_penalty: .nan}\nagents: {seats: [0, .inf]}\n")
                .expect("yaml");
        let (key, value) = non_finite_number(&tree).expect("found");
        assert_eq!(key, "env.life_loss_penalty");
        assert!(value.is_nan());
        let tree: Yaml = serde_yaml::from_str("agents: {seats: [0, -.inf]}\n").expect("yaml");
        assert_eq!(non_finite_number(&tree).map(|(k, _)| k).as_deref(), Some("agents.seats[1]"));
        assert!(non_finite_number(&serde_yaml::from_str("a: {b: 1.5}").expect("yaml")).is_none());
    }

    #[test]
    fn deep_nesting_is_refused_before_parsing() {
        let depth = |text: &str| check_depth(text, Path::new("c.yaml")).map_err(|e| e.to_string());
        let ok = "run:\n  seed: 1\nagents:\n  seats: [0, 1]\nrewards:\n  functions:\n    - {name: score, weight: 1}\n";
        depth(ok).expect("an ordinary config");
        depth("env: {params: {a: \"{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{\"}}\n")
            .expect("brackets in quotes do not count");
        for text in [
            format!("a: {}1{}\n", "{a: ".repeat(100_000), "}".repeat(100_000)),
            format!("a: {}1{}\n", "[".repeat(100_000), "]".repeat(100_000)),
            format!("a:\n{}1\n", "- ".repeat(100_000)),
            (0..200).map(|i| format!("{}k{i}:\n", " ".repeat(i))).collect::<String>(),
        ] {
            let err = depth(&text).unwrap_err();
            assert!(err.contains("c.yaml") && err.contains("nested more than 64 levels"), "{err}");
        }
    }
}
