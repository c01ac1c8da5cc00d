//! A resumed run keeps the experiment it started: `RUN_DIR/.config.reference.json` records the
//! resolved config when the run starts, and on `--resume` every key of `config.yaml` that was
//! edited since is either honoured (the run's length and logging: `run.iterations`,
//! `run.checkpoint_every`, `run.log_every`) or refused with the keys named, never ignored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{TrainConfig, CONFIG_FILE};
use crate::error::{Result, TroupeError};

/// The reference copy of the config a run started with.
pub const REFERENCE_FILE: &str = ".config.reference.json";

/// Keys a resumed run may change (by `--set` or by editing `config.yaml`).
pub const RESUMABLE_KEYS: [&str; 3] = ["run.iterations", "run.checkpoint_every", "run.log_every"];

/// Writes the reference copy of `config` into `run_dir`.
pub fn record(config: &TrainConfig, run_dir: &Path) -> Result<PathBuf> {
    let path = run_dir.join(REFERENCE_FILE);
    let value =
        serde_json::to_value(config).map_err(|e| TroupeError::Json { path: path.clone(), message: e.to_string() })?;
    let text = serde_json::to_vec_pretty(&value).expect("a JSON value serialises");
    crate::fsutil::write_atomic(&path, &text)?;
    Ok(path)
}

fn flatten(prefix: &str, value: &Value, out: &mut BTreeMap<String, Value>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (key, inner) in map {
                let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                flatten(&path, inner, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

/// The keys whose values differ between two configs, with both values (reference first).
pub fn differences(reference: &Value, current: &Value) -> Vec<(String, Value, Value)> {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten("", reference, &mut a);
    flatten("", current, &mut b);
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter_map(|key| {
            let (x, y) = (a.get(key).cloned().unwrap_or(Value::Null), b.get(key).cloned().unwrap_or(Value::Null));
            (x != y).then(|| (key.clone(), x, y))
        })
        .collect()
}

/// Checks `config` (read from `run_dir/config.yaml`, overrides applied) against the run's
/// reference: refuses edited keys outside [`RESUMABLE_KEYS`], naming each with both values.
/// `run.out_dir` is not compared (a run lives where its directory is). A run directory from
/// before references were kept is accepted with a warning.
pub fn check_resume(config: &TrainConfig, run_dir: &Path) -> Result<()> {
    let path = run_dir.join(REFERENCE_FILE);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!("{} has no {REFERENCE_FILE}: edits to {CONFIG_FILE} cannot be checked", run_dir.display());
            return Ok(());
        }
        Err(err) => return Err(TroupeError::io(&path, err)),
    };
    let recorded: Value =
        serde_json::from_slice(&text).map_err(|e| TroupeError::Json { path: path.clone(), message: e.to_string() })?;
    // A reference an earlier version recorded is read as this version reads configs (moved keys
    // in their new places, keys it did not have at the defaults it behaved by), so only real
    // edits remain; one that does not parse is compared as recorded.
    let reference = match crate::rl::config::migrate::upgrade_recorded(&recorded) {
        Some(upgraded) => serde_json::to_value(upgraded).unwrap_or(recorded),
        None => recorded,
    };
    let current =
        serde_json::to_value(config).map_err(|e| TroupeError::Json { path: path.clone(), message: e.to_string() })?;
    let refused: Vec<String> = differences(&reference, &current)
        .into_iter()
        .filter(|(key, _, _)| key != "run.out_dir" && !RESUMABLE_KEYS.contains(&key.as_str()))
        .map(|(key, was, now)| format!("{key} ({was} -> {now})"))
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    Err(TroupeError::BadValue {
        origin: Some(run_dir.join(CONFIG_FILE)),
        key: String::new(),
        message: format!(
            "edited since the run started: {}; a resumed run continues the same experiment, so only {} may change \
             (undo the edit, or start a new run with a new run.out_dir)",
            refused.join(", "),
            RESUMABLE_KEYS.join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reference_from_before_the_runtime_section_and_objectives_shows_no_edit() {
        // As the version before `runtime:` and `training.objective` recorded the defaults.
        let mut old = serde_json::to_value(TrainConfig::default()).unwrap();
        let training = old["training"].as_object_mut().unwrap();
        for key in ["objective", "group_by", "kl_estimator"] {
            training.remove(key);
        }
        training.insert("micro_batch_rows".into(), Value::from(16));
        old.as_object_mut().unwrap().remove("runtime");
        old["eval"].as_object_mut().unwrap().insert("batch_episodes".into(), Value::from(64));
        let upgraded = serde_json::to_value(super::super::migrate::upgrade_recorded(&old).unwrap()).unwrap();
        let current = serde_json::to_value(TrainConfig::default()).unwrap();
        assert_eq!(differences(&upgraded, &current), vec![]);
        // A real edit still shows.
        old["training"]["micro_batch_rows"] = Value::from(8);
        let upgraded = serde_json::to_value(super::super::migrate::upgrade_recorded(&old).unwrap()).unwrap();
        let keys: Vec<String> = differences(&upgraded, &current).into_iter().map(|(k, _, _)| k).collect();
        assert_eq!(keys, vec!["runtime.micro_batch_rows".to_string()]);
    }

    #[test]
    fn a_reference_with_seat_maps_from_before_a_new_key_shows_no_edit() {
        // JSON writes the seat maps' keys as strings ("1": "rule"); an earlier version's
        // reference must still read back, or every key added since would count as an edit.
        let text = "training: {partners: [{1: rule}, {0: rule}]}\neval: {baseline_seats: {1: random}}";
        let registry = troupe_envs::Registry::with_builtins();
        let config = TrainConfig::from_yaml_str(text, Path::new("test.yaml"), &[], &registry).unwrap();
        let mut old = serde_json::to_value(&config).unwrap();
        assert_eq!(old["training"]["partners"][0]["1"], Value::from("rule"));
        old["runtime"].as_object_mut().unwrap().remove("attention");
        let upgraded = serde_json::to_value(super::super::migrate::upgrade_recorded(&old).unwrap()).unwrap();
        assert_eq!(differences(&upgraded, &serde_json::to_value(&config).unwrap()), vec![]);
    }

    #[test]
    fn differences_name_nested_keys_and_both_values() {
        let a = serde_json::json!({"run": {"iterations": 2, "seed": 1}, "training": {"lr": 0.1}, "env": {"name": "hanabi"}});
        let b = serde_json::json!({"run": {"iterations": 3, "seed": 1}, "training": {"lr": 0.2}, "env": {"name": "hanabi", "players": 3}});
        let diff = differences(&a, &b);
        let keys: Vec<&str> = diff.iter().map(|(key, _, _)| key.as_str()).collect();
        assert_eq!(keys, ["env.players", "run.iterations", "training.lr"]);
        assert_eq!(diff[2].1, serde_json::json!(0.1));
        assert_eq!(diff[2].2, serde_json::json!(0.2));
    }
}
