//! `MultiAdapterManager`: one LoRA adapter per agent (or one shared by all) over one frozen base,
//! with the API multi-adapter frameworks use (`create_adapters`, `activate_adapter`,
//! `save_adapters`, ...) and the per-row adapter selection a training engine needs.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::tensor::Device;

use super::config::AdapterConfig;
use super::lora::LoraAdapter;
use super::mixed::{MixedLora, StackedFactors};
use super::peft::{read_adapters_dir, write_adapters_dir, AdapterMode, Manifest};
use crate::error::{ModelError, Result, TroupeError};
use crate::model::ModelConfig;

/// The name of the adapter all agents use in shared mode.
pub const SHARED_ADAPTER: &str = "shared";

/// Agents' adapters over one base model.
#[derive(Clone, Debug)]
pub struct MultiAdapterManager {
    base: ModelConfig,
    device: Device,
    mode: AdapterMode,
    /// Adapter name -> adapter (outside autodiff).
    adapters: BTreeMap<String, LoraAdapter>,
    /// Agent id -> adapter name.
    agents: BTreeMap<usize, String>,
    /// The agent whose adapter single-adapter calls use; `None`: the bare base.
    active: Option<usize>,
    /// The base model's fingerprint, recorded on save and checked on load (when known).
    base_fingerprint: Option<String>,
    /// The constant adapters' stacked factors, reused by every batch over the same adapters
    /// until one changes.
    stacked: FactorCache,
}

/// The stacked factors of constant (non-trainable) mixed batches, by the adapters' names in
/// stacking order and whether every row uses the one adapter. Every method that changes an
/// adapter empties it ([`MultiAdapterManager::adapters_changed`]).
#[derive(Debug, Default)]
struct FactorCache(Mutex<HashMap<FactorKey, Arc<StackedFactors>>>);

/// The adapters' names in stacking order, and whether every row uses the one adapter.
type FactorKey = (Vec<String>, bool);

/// The most lists of adapters the cache keeps (a rollout uses a few); past it, it starts afresh.
const CACHED_LISTS: usize = 64;

impl Clone for FactorCache {
    fn clone(&self) -> Self {
        Self(Mutex::new(self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()))
    }
}

impl MultiAdapterManager {
    /// A manager with no adapters for a base model of `base`, keeping tensors on `device`.
    pub fn new(base: &ModelConfig, device: &Device) -> Self {
        Self {
            base: base.clone(),
            device: device.clone(),
            mode: AdapterMode::PerAgent,
            adapters: BTreeMap::new(),
            agents: BTreeMap::new(),
            active: None,
            base_fingerprint: None,
            stacked: FactorCache::default(),
        }
    }

    /// Forgets the stacked factors of the adapters as they were: called by every method that
    /// changes an adapter.
    fn adapters_changed(&mut self) {
        self.stacked.0.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// A manager for `model`, which records its base fingerprint with saved adapters and warns
    /// when loading adapters recorded on another base.
    pub fn for_model(model: &crate::model::Model) -> Self {
        let mut manager = Self::new(&model.lm.config, model.lm.device());
        manager.base_fingerprint = Some(crate::model::fingerprint::base_fingerprint(&model.lm));
        manager
    }

    /// The base model's fingerprint, when known.
    pub fn base_fingerprint(&self) -> Option<&str> {
        self.base_fingerprint.as_deref()
    }

    /// The default adapter name of an agent: `agent_<id>`.
    pub fn default_name(agent_id: usize) -> String {
        format!("agent_{agent_id}")
    }

    /// Replaces all adapters with `num_agents` fresh ones (`agent_0`, ...), PEFT-initialised
    /// (seed 0), and activates agent 0.
    pub fn create_adapters(&mut self, num_agents: usize, config: &AdapterConfig) -> Result<()> {
        self.create_adapters_seeded(num_agents, config, 0)
    }

    /// [`MultiAdapterManager::create_adapters`] with the initialisation drawn from `seed`
    /// (agent i uses seed + i).
    pub fn create_adapters_seeded(&mut self, num_agents: usize, config: &AdapterConfig, seed: u64) -> Result<()> {
        config.validate(Path::new("adapter config"))?;
        self.adapters_changed();
        self.adapters.clear();
        self.agents.clear();
        self.mode = AdapterMode::PerAgent;
        for agent in 0..num_agents {
            let name = Self::default_name(agent);
            self.adapters.insert(
                name.clone(),
                LoraAdapter::init(config.clone(), &self.base, seed.wrapping_add(agent as u64), &self.device),
            );
            self.agents.insert(agent, name);
        }
        self.active = (num_agents > 0).then_some(0);
        Ok(())
    }

    /// Shared-parameter mode: one adapter (`shared`) that all `num_agents` agents use.
    pub fn create_shared_adapter(&mut self, num_agents: usize, config: &AdapterConfig, seed: u64) -> Result<()> {
        config.validate(Path::new("adapter config"))?;
        self.adapters_changed();
        self.adapters.clear();
        self.agents.clear();
        self.mode = AdapterMode::Shared;
        self.adapters
            .insert(SHARED_ADAPTER.to_string(), LoraAdapter::init(config.clone(), &self.base, seed, &self.device));
        for agent in 0..num_agents {
            self.agents.insert(agent, SHARED_ADAPTER.to_string());
        }
        self.active = (num_agents > 0).then_some(0);
        Ok(())
    }

    /// Per-agent or shared.
    pub fn mode(&self) -> AdapterMode {
        self.mode
    }

    /// The agent ids that have an adapter, ascending.
    pub fn agent_ids(&self) -> Vec<usize> {
        self.agents.keys().copied().collect()
    }

    /// The adapter names, sorted (one name in shared mode).
    pub fn adapter_names(&self) -> Vec<String> {
        self.adapters.keys().cloned().collect()
    }

    fn unknown(&self, agent: usize) -> TroupeError {
        let known = self.agents.keys().map(|k| k.to_string()).collect::<Vec<_>>().join(", ");
        TroupeError::Model(ModelError::UnknownAgent {
            agent,
            known: if known.is_empty() { "none".into() } else { known },
        })
    }

    /// The adapter name of an agent.
    pub fn adapter_name(&self, agent_id: usize) -> Result<&str> {
        self.agents.get(&agent_id).map(String::as_str).ok_or_else(|| self.unknown(agent_id))
    }

    /// An agent's adapter.
    pub fn adapter(&self, agent_id: usize) -> Result<&LoraAdapter> {
        let name = self.adapter_name(agent_id)?;
        Ok(&self.adapters[name])
    }

    /// An adapter by name.
    pub fn adapter_by_name(&self, name: &str) -> Option<&LoraAdapter> {
        self.adapters.get(name)
    }

    /// Replaces an agent's adapter weights (after an optimizer step); the shapes must match.
    pub fn set_adapter(&mut self, agent_id: usize, adapter: LoraAdapter) -> Result<()> {
        let name = self.adapter_name(agent_id)?.to_string();
        self.adapters_changed();
        self.adapters.insert(name, adapter.frozen());
        Ok(())
    }

    /// Adds (or replaces) one agent's adapter under `name` (per-agent mode).
    pub fn add_adapter(&mut self, agent_id: usize, name: &str, adapter: LoraAdapter) {
        self.adapters_changed();
        self.mode = AdapterMode::PerAgent;
        if let Some(old) = self.agents.insert(agent_id, name.to_string()) {
            if !self.agents.values().any(|n| n == &old) {
                self.adapters.remove(&old);
            }
        }
        self.adapters.insert(name.to_string(), adapter.frozen());
    }

    /// Removes an agent's adapter (the agent then has none).
    pub fn remove_adapter(&mut self, agent_id: usize) -> Result<LoraAdapter> {
        let name = self.agents.remove(&agent_id).ok_or_else(|| self.unknown(agent_id))?;
        self.adapters_changed();
        if self.active == Some(agent_id) {
            self.active = None;
        }
        if self.agents.values().any(|n| n == &name) {
            return Ok(self.adapters[&name].clone());
        }
        Ok(self.adapters.remove(&name).expect("every agent's adapter is stored"))
    }

    /// Makes `agent_id`'s adapter the one single-adapter calls use.
    pub fn activate_adapter(&mut self, agent_id: usize) -> Result<()> {
        self.adapter_name(agent_id)?;
        self.active = Some(agent_id);
        Ok(())
    }

    /// The active agent, or `None` when adapters are disabled.
    pub fn active_adapter(&self) -> Option<usize> {
        self.active
    }

    /// Disables all adapters: single-adapter calls use the bare base.
    pub fn disable_adapters(&mut self) {
        self.active = None;
    }

    /// Per-row adapters for one batch: row i uses agent `rows[i]`'s adapter, or none when
    /// `None`. With `trainable`, the adapters are fresh autodiff leaves (returned, so their
    /// gradients can be read after backward); otherwise they are constants.
    pub fn mixed(&self, rows: &[Option<usize>], trainable: bool) -> Result<(MixedLora, BTreeMap<String, LoraAdapter>)> {
        let mut names: Vec<String> = Vec::new();
        let mut slots = Vec::with_capacity(rows.len());
        for row in rows {
            slots.push(match row {
                Some(agent) => {
                    let name = self.adapter_name(*agent)?.to_string();
                    Some(match names.iter().position(|n| n == &name) {
                        Some(i) => i,
                        None => {
                            names.push(name);
                            names.len() - 1
                        }
                    })
                }
                None => None,
            });
        }
        let used: BTreeMap<String, LoraAdapter> = names
            .iter()
            .map(|n| {
                let adapter = &self.adapters[n];
                (n.clone(), if trainable { adapter.trainable() } else { adapter.clone() })
            })
            .collect();
        if trainable {
            let refs: Vec<&LoraAdapter> = names.iter().map(|n| &used[n]).collect();
            return Ok((MixedLora::new(&refs, &slots, &self.base, &self.device), used));
        }
        // Every adapter named is used, in the order of the slots.
        let (in_use, shared) = StackedFactors::layout(&slots);
        let key = (names, shared.is_some());
        let mut cache = self.stacked.0.lock().unwrap_or_else(|e| e.into_inner());
        let factors = match cache.get(&key) {
            Some(factors) => factors.clone(),
            None => {
                let refs: Vec<&LoraAdapter> = key.0.iter().map(|n| &self.adapters[n]).collect();
                let factors = StackedFactors::new(&refs, &in_use, shared, &self.base, &self.device);
                // On a GPU, where a decoding step's time is in its launches, each layer's q/k/v
                // deltas run as one; the CPU keeps one delta a site (its arithmetic unchanged).
                let factors =
                    if self.device == Device::flex() { factors } else { factors.joined(&self.base, &self.device) };
                let factors = Arc::new(factors);
                if cache.len() >= CACHED_LISTS {
                    cache.clear();
                }
                cache.insert(key, factors.clone());
                factors
            }
        };
        drop(cache);
        let mixed = MixedLora::with_factors(factors, &slots, &self.device);
        Ok((mixed, used))
    }

    /// Like [`MultiAdapterManager::mixed`] with trainable adapters, plus each adapter's
    /// `lora_dropout` on its rows' adapter input, masks seeded by `dropout_seed`.
    pub fn mixed_for_training(
        &self,
        rows: &[Option<usize>],
        dropout_seed: u64,
    ) -> Result<(MixedLora, BTreeMap<String, LoraAdapter>)> {
        let rates = rows
            .iter()
            .map(|row| match row {
                Some(agent) => self.adapter(*agent).map(|a| a.config.lora_dropout),
                None => Ok(0.0),
            })
            .collect::<Result<Vec<f64>>>()?;
        let (mixed, used) = self.mixed(rows, true)?;
        Ok((mixed.with_dropout(rates, dropout_seed), used))
    }

    /// Adapters for a batch of `batch` rows all on the active adapter, or `None` when disabled.
    pub fn active_delta(&self, batch: usize) -> Result<Option<MixedLora>> {
        match self.active {
            Some(agent) => Ok(Some(self.mixed(&vec![Some(agent); batch], false)?.0)),
            None => Ok(None),
        }
    }

    /// The `troupe.json` manifest describing the current mapping.
    pub fn manifest(&self) -> Manifest {
        Manifest {
            mode: self.mode,
            agents: self.agents.iter().map(|(id, name)| (id.to_string(), name.clone())).collect(),
            base_fingerprint: self.base_fingerprint.clone(),
        }
    }

    /// Saves every adapter in PEFT's layout under `dir` (`dir/<name>/...`, plus `troupe.json`).
    /// The directory appears whole or not at all.
    pub fn save_adapters(&self, dir: &Path) -> Result<()> {
        write_adapters_dir(dir, &self.adapters, &self.manifest())
    }

    /// Loads adapters from `dir` (written by troupe or by PEFT), replacing the current ones only
    /// once every adapter has been read and checked against the base model.
    pub fn load_adapters(&mut self, dir: &Path) -> Result<()> {
        let (manifest, adapters) = read_adapters_dir(dir, &self.base, &self.device)?;
        super::peft::check_base(dir, manifest.base_fingerprint.as_deref(), self.base_fingerprint.as_deref());
        let mut agents = BTreeMap::new();
        for (id, name) in &manifest.agents {
            let id: usize = id.parse().map_err(|_| TroupeError::BadValue {
                origin: Some(dir.join(super::peft::MANIFEST_FILE)),
                key: format!("agents.{id}"),
                message: "agent ids must be non-negative integers".into(),
            })?;
            agents.insert(id, name.clone());
        }
        self.adapters_changed();
        self.mode = manifest.mode;
        self.adapters = adapters;
        self.active = agents.keys().next().copied();
        self.agents = agents;
        Ok(())
    }
}
