//! PEFT's on-disk layout: `DIR/<adapter_name>/adapter_config.json` +
//! `adapter_model.safetensors`, plus troupe's `DIR/troupe.json` manifest (agent id -> adapter
//! name, mode). Directories are written whole into a temporary sibling and renamed into place,
//! so a failure never leaves a partial directory behind.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use super::config::AdapterConfig;
use super::lora::LoraAdapter;
use crate::error::{Result, TroupeError};
use crate::fsutil::{write_atomic, write_dir_atomic};
use crate::model::safetensors_io::{write_safetensors, TensorStore};
use crate::model::ModelConfig;

/// File name of the adapter weights.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// File name of the adapter config.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// File name of troupe's manifest.
pub const MANIFEST_FILE: &str = "troupe.json";

/// How agents map to adapters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdapterMode {
    /// Each agent has its own adapter (`agent_0`, `agent_1`, ...).
    PerAgent,
    /// All agents share one adapter, saved as `shared/`.
    Shared,
}

/// `troupe.json`: which adapter each agent uses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Per-agent or shared.
    pub mode: AdapterMode,
    /// Agent id (as a string key, JSON style) -> adapter name.
    pub agents: BTreeMap<String, String>,
    /// The base model the adapters were trained on ([`crate::model::fingerprint`]); absent in
    /// directories written before it was recorded, or by PEFT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_fingerprint: Option<String>,
}

/// Warns (log target `troupe::adapters`) when adapters recorded on one base are loaded onto
/// another: same shapes, different weights, so nothing else would notice. Returns whether
/// they match (true when either side is unknown).
pub fn check_base(dir: &Path, recorded: Option<&str>, current: Option<&str>) -> bool {
    match (recorded, current) {
        (Some(recorded), Some(current)) if recorded != current => {
            tracing::warn!(
                target: "troupe::adapters",
                "{}: these adapters were trained on another base model (base fingerprint {recorded}, this model's is \
                 {current}); their outputs will not be what they were trained to give",
                dir.display()
            );
            false
        }
        _ => true,
    }
}

/// Reads one PEFT adapter directory, checking it against the base model.
pub fn read_adapter_dir(dir: &Path, base: &ModelConfig, device: &Device) -> Result<LoraAdapter> {
    let config = AdapterConfig::from_file(&dir.join(CONFIG_FILE))?;
    let weights_path = dir.join(WEIGHTS_FILE);
    let store = TensorStore::open_files(std::slice::from_ref(&weights_path), weights_path.clone())?;
    let tensors =
        store.names().into_iter().map(|n| store.read(&n, None).map(|t| (n, t))).collect::<Result<BTreeMap<_, _>>>()?;
    for (name, tensor) in &tensors {
        tensor.check_finite(&weights_path, name)?;
    }
    LoraAdapter::from_host(config, &tensors, base, &weights_path, device)
}

/// Writes one adapter's two files into `dir` (which must exist).
fn write_adapter_files(dir: &Path, adapter: &LoraAdapter) -> Result<()> {
    let config = serde_json::to_vec_pretty(&adapter.config.to_peft_json()).expect("JSON values serialize");
    write_atomic(&dir.join(CONFIG_FILE), &config)?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(&dir.join(WEIGHTS_FILE), &adapter.to_host()?, Some(metadata))
}

/// Writes adapters (`name -> adapter`) and the manifest as one directory `dir`, replacing any
/// previous one only once everything is written.
pub fn write_adapters_dir(dir: &Path, adapters: &BTreeMap<String, LoraAdapter>, manifest: &Manifest) -> Result<()> {
    write_dir_atomic(dir, |staging| {
        for (adapter_name, adapter) in adapters {
            let sub = staging.join(adapter_name);
            std::fs::create_dir_all(&sub).map_err(|e| TroupeError::io(&sub, e))?;
            write_adapter_files(&sub, adapter)?;
        }
        let json = serde_json::to_vec_pretty(manifest).expect("manifest serializes");
        write_atomic(&staging.join(MANIFEST_FILE), &json)
    })
}

/// Reads a directory of adapters: with a `troupe.json`, as it says; without one (a directory
/// PEFT wrote), every subdirectory holding an `adapter_config.json`, named `agent_<i>` -> agent i
/// or, for other names, agents in name order. Everything is read and checked before anything is
/// returned.
pub fn read_adapters_dir(
    dir: &Path,
    base: &ModelConfig,
    device: &Device,
) -> Result<(Manifest, BTreeMap<String, LoraAdapter>)> {
    if !dir.is_dir() {
        return Err(TroupeError::io(
            dir,
            std::io::Error::new(std::io::ErrorKind::NotFound, "adapter directory not found"),
        ));
    }
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest = if manifest_path.exists() {
        let text = std::fs::read_to_string(&manifest_path).map_err(|e| TroupeError::io(&manifest_path, e))?;
        serde_json::from_str::<Manifest>(&text)
            .map_err(|e| TroupeError::Json { path: manifest_path.clone(), message: e.to_string() })?
    } else {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map_err(|e| TroupeError::io(dir, e))?
            .filter_map(|e| e.ok())
            .filter(|e| e.path().join(CONFIG_FILE).exists())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect();
        names.sort();
        if names.is_empty() && dir.join(CONFIG_FILE).exists() {
            // A single adapter directory rather than a directory of adapters.
            let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("agent_0").to_string();
            let adapter = read_adapter_dir(dir, base, device)?;
            let manifest = Manifest {
                mode: AdapterMode::PerAgent,
                agents: BTreeMap::from([("0".to_string(), name.clone())]),
                base_fingerprint: None,
            };
            return Ok((manifest, BTreeMap::from([(name, adapter)])));
        }
        if names.is_empty() {
            return Err(TroupeError::io(
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no adapter (no subdirectory with adapter_config.json)",
                ),
            ));
        }
        let by_id: Option<BTreeMap<String, String>> = names
            .iter()
            .map(|n| n.strip_prefix("agent_").and_then(|i| i.parse::<usize>().ok()).map(|i| (i.to_string(), n.clone())))
            .collect();
        let agents =
            by_id.unwrap_or_else(|| names.iter().enumerate().map(|(i, n)| (i.to_string(), n.clone())).collect());
        let mode = if names == ["shared"] { AdapterMode::Shared } else { AdapterMode::PerAgent };
        Manifest { mode, agents, base_fingerprint: None }
    };
    let mut adapters = BTreeMap::new();
    for name in manifest.agents.values() {
        if adapters.contains_key(name) {
            continue;
        }
        let sub = dir.join(name);
        adapters.insert(name.clone(), read_adapter_dir(&sub, base, device)?);
    }
    Ok((manifest, adapters))
}
