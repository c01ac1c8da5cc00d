//! A config file is accepted only whole: one that holds nothing (empty, or comments only) would
//! train on defaults, and so would one cut off part-way (a section left with no value). Both
//! are refused with the file named; a file that does not end with a newline (as one cut
//! mid-line does not) gets a warning.

use std::path::Path;

use serde_yaml::Value as Yaml;

use crate::error::{Result, TroupeError};

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
}
