//! `--set key.path=value` overrides on a YAML tree, checked against a schema (the defaults'
//! tree) before the typed parse: `training.lr=3e-4`, `agents.seats=[0, 1, 0, 1]`,
//! `agents.seats[2]=1`. Values are YAML scalars or flow collections. A key the schema does not
//! have is refused with the keys that exist there; below a list or a free-form section the typed
//! parse that follows checks it.

use serde_yaml::{Mapping, Value as Yaml};

/// What overrides are checked against.
pub struct Schema {
    /// The config's defaults as a YAML tree: every section and key that exists.
    pub defaults: Yaml,
    /// Sections whose keys are free-form (an environment's parameters), by path.
    pub free_form: &'static [&'static [&'static str]],
}

/// One segment of an override key: a mapping key, or a list index (`seats[2]` or `seats.2`).
#[derive(Debug, PartialEq)]
enum Segment {
    Key(String),
    Index(usize),
}

/// Splits `a.b[2].c` into segments; `None` when malformed (empty segment, bad index).
fn parse_key(key: &str) -> Option<Vec<Segment>> {
    let mut segments = Vec::new();
    for part in key.split('.') {
        let (name, mut rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if name.is_empty() && (segments.is_empty() || rest.is_empty()) {
            return None;
        }
        if !name.is_empty() {
            segments.push(Segment::Key(name.to_string()));
        }
        while !rest.is_empty() {
            let close = rest.find(']')?;
            let index = rest[1..close].trim().parse().ok()?;
            segments.push(Segment::Index(index));
            rest = &rest[close + 1..];
            if !rest.is_empty() && !rest.starts_with('[') {
                return None;
            }
        }
    }
    Some(segments)
}

/// Applies one `key.path=value` override to `tree`. The key is checked against the schema
/// (the defaults' tree) down to the first list or free-form section; below those, the typed
/// parse that follows checks it. Errors are `(key, message)`; the caller names `--set`, so
/// the message does not.
pub fn apply_override(tree: &mut Yaml, raw: &str, schema: &Schema) -> std::result::Result<(), (String, String)> {
    let Some((key, value)) = raw.split_once('=') else {
        return Err((raw.to_string(), "not of the form key.path=value".to_string()));
    };
    let key = key.trim();
    let segments = parse_key(key).ok_or_else(|| (key.to_string(), "malformed key".to_string()))?;
    if let Err(err) = super::file::check_depth(value, std::path::Path::new("--set")) {
        let message = match err {
            crate::error::TroupeError::BadValue { message, .. } => message,
            other => other.to_string(),
        };
        return Err((key.to_string(), format!("the value is {}", message.trim_start_matches("line 1: "))));
    }
    let value: Yaml =
        serde_yaml::from_str(value).map_err(|e| (key.to_string(), format!("the value is not YAML: {e}")))?;
    check_against_schema(key, &segments, schema)?;
    // A whole section replaced by a value would silently drop the section's earlier overrides
    // and file keys (`--set run=`): a section takes a mapping.
    if matches!(default_at(&schema.defaults, &segments), Some(Yaml::Mapping(_))) && !value.is_mapping() {
        return Err((
            key.to_string(),
            format!("a section, not a value; set its keys ({key}.KEY=VALUE) or a mapping ({key}={{KEY: VALUE}})"),
        ));
    }

    let defaults = &schema.defaults;
    let mut node = tree;
    for (depth, segment) in segments.iter().enumerate() {
        let here = || describe(&segments[..depth]);
        // Indexing a list the file leaves out (`agents.seats[1]=0`) starts from the default list.
        let indexes = match segment {
            Segment::Index(_) => true,
            Segment::Key(name) => name.parse::<usize>().is_ok(),
        };
        if node.is_null() && indexes {
            if let Some(list @ Yaml::Sequence(_)) = default_at(defaults, &segments[..depth]) {
                *node = list.clone();
            }
        }
        node = match segment {
            Segment::Key(name) => {
                if node.is_null() {
                    *node = Yaml::Mapping(Mapping::new());
                }
                match node {
                    Yaml::Mapping(map) => {
                        let existing = map.keys().find(|k| key_matches(k, name)).cloned();
                        let slot = existing.unwrap_or_else(|| mapping_key(name));
                        map.entry(slot).or_insert(Yaml::Null)
                    }
                    Yaml::Sequence(items) => {
                        let index: usize = name
                            .parse()
                            .map_err(|_| (key.to_string(), format!("{} is a list; index it with a number", here())))?;
                        sequence_slot(items, index, key, &here())?
                    }
                    _ => return Err((key.to_string(), format!("{} is a value, not a section", here()))),
                }
            }
            Segment::Index(index) => match node {
                Yaml::Sequence(items) => sequence_slot(items, *index, key, &here())?,
                _ => {
                    return Err((
                        key.to_string(),
                        format!("{} is not a list in the config; set the whole list instead", here()),
                    ))
                }
            },
        };
    }
    *node = value;
    Ok(())
}

/// The node of the defaults' tree at `segments`, if there is one.
fn default_at<'a>(defaults: &'a Yaml, segments: &[Segment]) -> Option<&'a Yaml> {
    segments.iter().try_fold(defaults, |node, segment| match segment {
        Segment::Key(name) => node.get(name.as_str()),
        Segment::Index(index) => node.get(*index),
    })
}

/// The element `index` of a list, or an error naming the list's length.
fn sequence_slot<'a>(
    items: &'a mut [Yaml],
    index: usize,
    key: &str,
    here: &str,
) -> std::result::Result<&'a mut Yaml, (String, String)> {
    let len = items.len();
    items.get_mut(index).ok_or_else(|| {
        (
            key.to_string(),
            format!("index {index} is out of range: {here} has {len} entries; set the whole list instead"),
        )
    })
}

/// Whether a YAML mapping key is the override segment `name` (`1` matches both `1` and `"1"`).
fn key_matches(key: &Yaml, name: &str) -> bool {
    match key {
        Yaml::String(s) => s == name,
        Yaml::Number(n) => n.to_string() == name,
        _ => false,
    }
}

/// The mapping key for a new override segment: a number for digits (seat ids), else a string.
fn mapping_key(name: &str) -> Yaml {
    match name.parse::<u64>() {
        Ok(n) => Yaml::Number(n.into()),
        Err(_) => Yaml::String(name.to_string()),
    }
}

/// `a.b[2]` for the first segments of a key.
fn describe(segments: &[Segment]) -> String {
    let mut out = String::new();
    for segment in segments {
        match segment {
            Segment::Key(name) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(name);
            }
            Segment::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    if out.is_empty() {
        "the config".to_string()
    } else {
        out
    }
}

/// Refuses an override key the schema does not have, naming the keys that exist there.
fn check_against_schema(key: &str, segments: &[Segment], schema: &Schema) -> std::result::Result<(), (String, String)> {
    let mut node = &schema.defaults;
    let mut names: Vec<&str> = Vec::new();
    for (depth, segment) in segments.iter().enumerate() {
        if schema.free_form.contains(&names.as_slice()) {
            return Ok(());
        }
        let Segment::Key(name) = segment else { return Ok(()) };
        match node {
            Yaml::Mapping(map) => match map.get(name.as_str()) {
                Some(child) => {
                    node = child;
                    names.push(name);
                }
                None => {
                    let known: Vec<String> = map.keys().filter_map(|k| k.as_str().map(str::to_string)).collect();
                    let section = describe(&segments[..depth]);
                    let section = if depth == 0 { "sections".to_string() } else { format!("keys of {section}") };
                    return Err((key.to_string(), format!("unknown key (known {section}: {})", known.join(", "))));
                }
            },
            // Lists (seats, reward functions) are indexed; the typed parse checks their items.
            Yaml::Sequence(_) => return Ok(()),
            // A leaf (model.path, training.lr) takes a value but has no keys below.
            _ => return Err((key.to_string(), format!("{} is a value, not a section", describe(&segments[..depth])))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_keys_parse() {
        assert_eq!(
            parse_key("a.b[2][0].c"),
            Some(vec![
                Segment::Key("a".into()),
                Segment::Key("b".into()),
                Segment::Index(2),
                Segment::Index(0),
                Segment::Key("c".into())
            ])
        );
        for bad in ["", ".a", "a.", "a..b", "a[x]", "a[1", "a[1]b", "[1]"] {
            assert_eq!(parse_key(bad), None, "{bad:?}");
        }
    }
}
