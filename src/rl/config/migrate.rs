//! Keys that moved between versions. A config (or a run directory's recorded one) that still
//! uses an old key is read as if it used the new one, with a warning naming both, so older
//! configs and run directories keep loading and resuming; a `--set` override of an old key is
//! moved the same way.

use std::path::Path;

use serde_yaml::{Mapping, Value as Yaml};

/// Keys that moved, as `(old path, new path)`.
pub const MOVED_KEYS: [(&[&str], &[&str]); 11] = [
    (&["training", "micro_batch_rows"], &["runtime", "micro_batch_rows"]),
    (&["eval", "batch_episodes"], &["runtime", "eval_batch_episodes"]),
    (&["training", "lr"], &["training", "optimizer", "lr"]),
    (&["training", "beta1"], &["training", "optimizer", "beta1"]),
    (&["training", "beta2"], &["training", "optimizer", "beta2"]),
    (&["training", "weight_decay"], &["training", "optimizer", "weight_decay"]),
    (&["training", "kl_coef"], &["training", "kl", "coef"]),
    (&["training", "kl_estimator"], &["training", "kl", "estimator"]),
    (&["training", "format_warmup_steps"], &["training", "format_warmup", "steps"]),
    (&["training", "format_warmup_batch"], &["training", "format_warmup", "batch_size"]),
    (&["training", "format_warmup_lr"], &["training", "format_warmup", "lr"]),
];

/// Moves every [`MOVED_KEYS`] entry of `tree` to its new place (the new key wins when both
/// are given), warning once per key when `origin` (the file) is given.
pub fn move_keys(tree: &mut Yaml, origin: Option<&Path>) {
    let (mut moved, mut ignored) = (Vec::new(), Vec::new());
    for (old, new) in MOVED_KEYS {
        let Some(value) = remove_path(tree, old) else { continue };
        let (old, new) = (old.join("."), new.join("."));
        if insert_path_if_absent(tree, &new.split('.').collect::<Vec<_>>(), value) {
            moved.push(format!("`{old}` as `{new}`"));
        } else {
            ignored.push(format!("`{old}` (`{new}` is given too)"));
        }
    }
    let Some(origin) = origin else { return };
    if !moved.is_empty() {
        tracing::warn!("{}: keys that moved, read at their new place: {}", origin.display(), moved.join(", "));
    }
    if !ignored.is_empty() {
        tracing::warn!("{}: old keys ignored: {}", origin.display(), ignored.join(", "));
    }
}

/// `raw` (`key.path=value`) with a moved key rewritten to its new place, with a warning.
pub fn moved_override(raw: &str) -> String {
    let Some((key, value)) = raw.split_once('=') else { return raw.to_string() };
    let key = key.trim();
    for (old, new) in MOVED_KEYS {
        let (old, new) = (old.join("."), new.join("."));
        if let Some(rest) = key.strip_prefix(old.as_str()) {
            if rest.is_empty() || rest.starts_with('.') || rest.starts_with('[') {
                tracing::warn!("--set: `{old}` is now `{new}`; read as such");
                return format!("{new}{rest}={value}");
            }
        }
    }
    raw.to_string()
}

/// Removes the value at `path` (a chain of mappings), if there is one.
fn remove_path(tree: &mut Yaml, path: &[&str]) -> Option<Yaml> {
    let (last, parents) = path.split_last()?;
    let mut node = tree;
    for key in parents {
        node = node.as_mapping_mut()?.get_mut(*key)?;
    }
    node.as_mapping_mut()?.remove(*last)
}

/// Puts `value` at `path`, creating (or filling in a null) mapping on the way, unless a value is
/// there already; whether it was put.
fn insert_path_if_absent(tree: &mut Yaml, path: &[&str], value: Yaml) -> bool {
    let Some((last, parents)) = path.split_last() else { return false };
    let mut node = tree;
    for key in parents {
        let Yaml::Mapping(map) = node else { return false };
        let child = map.entry(Yaml::String((*key).to_string())).or_insert_with(|| Yaml::Mapping(Mapping::new()));
        if child.is_null() {
            *child = Yaml::Mapping(Mapping::new());
        }
        node = child;
    }
    let Yaml::Mapping(map) = node else { return false };
    let key = Yaml::String((*last).to_string());
    if map.contains_key(&key) {
        return false;
    }
    map.insert(key, value);
    true
}

/// A config recorded by an earlier version (`tree`, as JSON) read as this version reads it: moved
/// keys in their new places and every key it did not have at its default, which is what that
/// version did. `None` when it does not parse as a config.
pub(crate) fn upgrade_recorded(tree: &serde_json::Value) -> Option<super::TrainConfig> {
    let mut tree: Yaml = serde_yaml::to_value(tree).ok()?;
    move_keys(&mut tree, None);
    // Back through JSON, not YAML: JSON wrote the seat maps' integer keys as strings, and only
    // serde_json reads a string key back as a number.
    serde_json::from_value(serde_json::to_value(tree).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_keys_move_to_their_sections_and_the_new_key_wins() {
        let mut tree: Yaml =
            serde_yaml::from_str("training: {lr: 0.1, kl_coef: 0.2, optimizer: {lr: 0.3}, format_warmup_steps: 4}")
                .unwrap();
        move_keys(&mut tree, None);
        let expected: Yaml =
            serde_yaml::from_str("training: {optimizer: {lr: 0.3}, kl: {coef: 0.2}, format_warmup: {steps: 4}}")
                .unwrap();
        assert_eq!(tree, expected);
    }

    #[test]
    fn overrides_of_old_keys_are_moved() {
        assert_eq!(moved_override("training.lr=3e-4"), "training.optimizer.lr=3e-4");
        assert_eq!(moved_override("training.kl_estimator=k1"), "training.kl.estimator=k1");
        assert_eq!(moved_override("training.lr_final_fraction=0.5"), "training.lr_final_fraction=0.5");
        assert_eq!(moved_override("training.optimizer.lr=1"), "training.optimizer.lr=1");
    }
}
