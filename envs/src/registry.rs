//! The registry: environment names -> constructors taking typed parameters, and baseline policy
//! names -> constructors, so a config says `env: {name: hanabi, players: 3}` or
//! `baseline_seats: {1: rule}` and a crate outside the workspace registers its own environments
//! and policies the same way as the built-in ones. One registry is built by the binary and handed
//! to every library entry point.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::environment::{Environment, EpisodeMetrics, SeatId};
use crate::error::EnvError;
use crate::policy::Policy;

/// Builds an environment from its parameters (a JSON object, `name` already removed).
pub type Constructor = Arc<dyn Fn(&Value) -> Result<Box<dyn Environment>, EnvError> + Send + Sync>;

/// One registered environment.
#[derive(Clone)]
pub struct RegistryEntry {
    /// One line saying what the environment is.
    pub description: String,
    constructor: Constructor,
}

/// What a registered reward function reads about one seat's finished episode.
#[derive(Clone, Copy, Debug)]
pub struct RewardInput<'a> {
    /// The seat.
    pub seat: SeatId,
    /// The seat's environment return.
    pub env_return: f64,
    /// How many of the seat's replies were not legal actions.
    pub invalid_actions: usize,
    /// The episode's metrics.
    pub metrics: &'a EpisodeMetrics,
    /// The seat's replies, in turn order.
    pub completions: &'a [String],
}

/// A reward function a plug-in registers: one number for one seat of one episode.
pub type RewardFn = Arc<dyn Fn(&RewardInput<'_>) -> f64 + Send + Sync>;

/// What a batch reward function (and an external one) is told about one finished episode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RewardItem {
    /// The episode's seed.
    pub seed: u64,
    /// Per seat: its agent's replies, in order.
    pub completions: Vec<Vec<String>>,
    /// Per seat: the prompt of each reply.
    pub prompts: Vec<Vec<String>>,
    /// Per seat: its environment return.
    pub returns: Vec<f64>,
    /// The episode's metrics.
    pub metrics: EpisodeMetrics,
}

/// A reward function called once per iteration with every episode: for each episode, either
/// one value (every seat gets it) or one value per seat. An `Err` names what went wrong; the
/// trainer reports it with the function's name.
pub type BatchRewardFn = Arc<dyn Fn(&[RewardItem]) -> Result<Vec<Vec<f64>>, String> + Send + Sync>;

/// A registered reward function: called per seat, or once per iteration with every episode.
#[derive(Clone)]
pub enum RegisteredReward {
    /// One number for one seat of one episode ([`Registry::register_reward`]).
    Seat(RewardFn),
    /// Every episode at once ([`Registry::register_batch_reward`]).
    Batch(BatchRewardFn),
}

/// One registered reward function.
#[derive(Clone)]
struct RewardEntry {
    description: String,
    function: RegisteredReward,
}

/// Builds a fresh baseline policy.
pub type PolicyConstructor = Arc<dyn Fn() -> Box<dyn Policy> + Send + Sync>;

/// One registered baseline policy.
#[derive(Clone)]
struct PolicyEntry {
    description: String,
    constructor: PolicyConstructor,
}

/// Environment names -> constructors, and baseline policy names -> constructors.
#[derive(Clone, Default)]
pub struct Registry {
    entries: BTreeMap<String, RegistryEntry>,
    policies: BTreeMap<String, PolicyEntry>,
    rewards: BTreeMap<String, RewardEntry>,
}

impl Registry {
    /// A registry with no environments.
    pub fn empty() -> Self {
        Self::default()
    }

    /// A registry holding every environment this crate ships.
    pub fn with_builtins() -> Self {
        let mut registry = Self::empty();
        crate::register_builtins(&mut registry);
        registry
    }

    /// Registers (or replaces) an environment under `name`.
    pub fn register<F>(&mut self, name: &str, description: &str, constructor: F)
    where
        F: Fn(&Value) -> Result<Box<dyn Environment>, EnvError> + Send + Sync + 'static,
    {
        self.entries.insert(
            name.to_string(),
            RegistryEntry { description: description.to_string(), constructor: Arc::new(constructor) },
        );
    }

    /// Registers (or replaces) a baseline policy under `name` (matched ignoring case).
    pub fn register_policy<F>(&mut self, name: &str, description: &str, constructor: F)
    where
        F: Fn() -> Box<dyn Policy> + Send + Sync + 'static,
    {
        self.policies.insert(
            name.trim().to_ascii_lowercase(),
            PolicyEntry { description: description.to_string(), constructor: Arc::new(constructor) },
        );
    }

    /// A fresh baseline policy by name (ignoring case and surrounding spaces).
    pub fn make_policy(&self, name: &str) -> Result<Box<dyn Policy>, EnvError> {
        let entry = self.policies.get(&name.trim().to_ascii_lowercase()).ok_or_else(|| EnvError::UnknownPolicy {
            name: name.to_string(),
            known: self.policies.keys().cloned().collect::<Vec<_>>().join(", "),
        })?;
        Ok((entry.constructor)())
    }

    /// The registered baseline policies with their descriptions, sorted by name.
    pub fn policies(&self) -> impl Iterator<Item = (&str, &str)> {
        self.policies.iter().map(|(name, entry)| (name.as_str(), entry.description.as_str()))
    }

    /// Registers (or replaces) a reward function under `name`, for configs to list as
    /// `rewards.functions: [{name: NAME, weight: ...}]` beside the built-in ones.
    pub fn register_reward<F>(&mut self, name: &str, description: &str, function: F)
    where
        F: Fn(&RewardInput<'_>) -> f64 + Send + Sync + 'static,
    {
        self.rewards.insert(
            name.to_string(),
            RewardEntry { description: description.to_string(), function: RegisteredReward::Seat(Arc::new(function)) },
        );
    }

    /// Registers (or replaces) a reward function under `name` that scores every episode of an
    /// iteration in one call (what a Python function over lists of completions wants); configs
    /// list it as any other.
    pub fn register_batch_reward<F>(&mut self, name: &str, description: &str, function: F)
    where
        F: Fn(&[RewardItem]) -> Result<Vec<Vec<f64>>, String> + Send + Sync + 'static,
    {
        self.rewards.insert(
            name.to_string(),
            RewardEntry { description: description.to_string(), function: RegisteredReward::Batch(Arc::new(function)) },
        );
    }

    /// Registers (or replaces) an environment under `name` built by `constructor`, which is
    /// already shared (a binding that holds one constructor for several registries).
    pub fn register_shared(&mut self, name: &str, description: &str, constructor: Constructor) {
        self.entries.insert(name.to_string(), RegistryEntry { description: description.to_string(), constructor });
    }

    /// The registered reward function `name`, if any.
    pub fn reward(&self, name: &str) -> Option<RegisteredReward> {
        self.rewards.get(name).map(|entry| entry.function.clone())
    }

    /// The registered reward functions with their descriptions, sorted by name.
    pub fn rewards(&self) -> impl Iterator<Item = (&str, &str)> {
        self.rewards.iter().map(|(name, entry)| (name.as_str(), entry.description.as_str()))
    }

    /// The registered names with their descriptions, sorted by name.
    pub fn list(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().map(|(name, entry)| (name.as_str(), entry.description.as_str()))
    }

    /// Whether `name` is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Builds the environment `name` from `params` (a JSON object or null for defaults).
    pub fn make(&self, name: &str, params: &Value) -> Result<Box<dyn Environment>, EnvError> {
        let entry = self.entries.get(name).ok_or_else(|| EnvError::UnknownEnv {
            name: name.to_string(),
            known: self.entries.keys().cloned().collect::<Vec<_>>().join(", "),
        })?;
        (entry.constructor)(params)
    }

    /// Builds an environment from a spec object `{name: ..., <params>...}` as configs write it.
    pub fn make_from_spec(&self, spec: &Value) -> Result<Box<dyn Environment>, EnvError> {
        let bad = |message: &str| EnvError::BadParam {
            env: "env".to_string(),
            field: "name".to_string(),
            message: message.to_string(),
        };
        let object = spec.as_object().ok_or_else(|| bad("the env spec must be a mapping with a `name`"))?;
        let name = object.get("name").and_then(Value::as_str).ok_or_else(|| bad("missing or not a string"))?;
        let mut params = object.clone();
        params.remove("name");
        self.make(name, &Value::Object(params))
    }
}

/// Deserializes an environment's typed parameters from `params`, turning serde's message into
/// an [`EnvError::BadParam`] that names the environment and the field. `null` means all defaults.
/// Parameter structs should use `#[serde(deny_unknown_fields, default)]`.
pub fn parse_params<T: DeserializeOwned>(env: &str, params: &Value) -> Result<T, EnvError> {
    let value = if params.is_null() { Value::Object(Default::default()) } else { params.clone() };
    serde_path_to_error::deserialize(value).map_err(|err| {
        let path = err.path().to_string();
        let message = err.into_inner().to_string();
        // The path names the field whose value is wrong; a missing field is named by serde in
        // backticks ("missing field `command`"), at the path of its parent.
        if let Some(name) = message.strip_prefix("missing field `").and_then(|m| m.split('`').next()) {
            let field = if path == "." { name.to_string() } else { format!("{path}.{name}") };
            return EnvError::BadParam { env: env.to_string(), field, message: "is required".to_string() };
        }
        // An unknown field is named the same way ("unknown field `foo`, expected ...").
        let field = if message.starts_with("unknown field") {
            let name = message.split('`').nth(1).unwrap_or("params");
            if path == "." {
                name.to_string()
            } else if path == name || path.ends_with(&format!(".{name}")) {
                // serde_path_to_error already ends the path with the unknown key.
                path
            } else {
                format!("{path}.{name}")
            }
        } else if path == "." {
            "params".to_string()
        } else {
            path
        };
        EnvError::BadParam { env: env.to_string(), field, message }
    })
}
