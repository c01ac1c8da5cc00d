//! `TrainConfig`: a training run's YAML config (DESIGN.md, "Training"; `configs/*.yaml`).
//!
//! Strict: every section and field has a default, an unknown key or a value of the wrong type is
//! an error naming the file and the key (`configs/hanabi.yaml: training.group_size: invalid type:
//! string "four", expected usize`). `--set a.b=c` overrides are applied to the YAML tree before
//! it is read, so they are checked exactly like the file. The resolved config
//! ([`TrainConfig::to_yaml`]) is what a run directory keeps.
//!
//! ```yaml
//! run:      {out_dir: runs/hanabi, seed: 0, iterations: 30, checkpoint_every: 5, log_every: 1}
//! model:    {path: null, preset: tiny, seed: 0, device: cpu, quantized: false}
//! env:      {name: hanabi, players: 2}          # name + the environment's own parameters
//! agents:   {num_agents: 2, seats: [0, 1], mode: per_agent}
//! adapter:  {r: 8, lora_alpha: 16.0, target_modules: [q_proj, k_proj, v_proj, o_proj], lora_dropout: 0.0, use_rslora: false}
//! action:   {mode: free, invalid_penalty: -1.0, fallback: random, max_retries: 1, max_new_tokens: 16,
//!            temperature: 1.0, top_p: 1.0, top_k: 0, chat_template: true}
//! training: {group_size: 4, groups_per_iteration: 2, lr: 1.0e-4, warmup_iterations: 0, max_grad_norm: 1.0,
//!            weight_decay: 0.0, beta1: 0.9, beta2: 0.999, advantage: mean, scale_rewards: group,
//!            group_by: agent_turn, objective: {kind: magrpo, epochs_per_iteration: 1, clip_low: 0.2,
//!            clip_high: 0.2, ratio: token, loss_normalization: agent_token_mean}, kl_coef: 0.0,
//!            kl_estimator: k3, gamma: 1.0, max_episode_steps: 50}
//! rewards:  {functions: [{name: env_return, weight: 1.0}], processors: [{type: identity}]}
//! eval:     {episodes: 20, seed: 1000000, baseline_seats: {}}
//! runtime:  {micro_batch_rows: 16, eval_batch_episodes: 64}
//! ```
//!
//! Sub-configs owned by a component are held as fields and keep their defaults on their own
//! type (`training.objective` is [`ObjectiveConfig`]; AdamW's defaults are
//! [`AdamWConfig::default`]'s); the `--set` engine is [`super::overrides`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_yaml::{Mapping, Value as Yaml};
use troupe_envs::{EnvError, Environment, Registry};

use super::advantage::{AdvantageBaseline, RewardScaling};
use super::batch::{AdvantageGrouping, AdvantageSettings};
use super::objective::{KlEstimator, KlPenalty, ObjectiveConfig};
use super::overrides::{apply_override, Schema};
use super::rewards::{RewardFunction, RewardPipeline, RewardProcessor, WeightedReward};
use super::rollout::RolloutConfig;
pub use super::rollout::{ActionMode, Fallback};
use super::trainer::TrainerSettings;
use crate::adapters::{AdamWConfig, AdapterConfig, AdapterMode};
use crate::error::{Result, TroupeError};
use crate::generate::choice::ChoiceScore;
use crate::generate::sampler::SamplingConfig;
use crate::model::{Preset, Projection};

/// A whole training run: every section of the YAML file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Where the run writes, how long it lasts, how often it checkpoints.
    pub run: RunSection,
    /// The base model.
    pub model: ModelSection,
    /// The environment and its parameters.
    pub env: EnvSection,
    /// Agents and which seat each plays.
    pub agents: AgentsSection,
    /// Every agent's LoRA adapter.
    pub adapter: AdapterSection,
    /// How agents' text becomes actions.
    pub action: ActionSection,
    /// MAGRPO's hyper-parameters.
    pub training: TrainingSection,
    /// Reward functions and processors.
    pub rewards: RewardsSection,
    /// Evaluation on held-out seeds.
    pub eval: EvalSection,
    /// Speed and memory settings that change no result's maths.
    pub runtime: RuntimeSection,
}

/// `runtime:` — how the work is cut into batches: memory and speed, not the experiment's maths
/// (a GPU wants far larger batches than 2 CPU cores).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeSection {
    /// Rows (replies, or `choice` decisions) per forward/backward micro-batch of the update.
    pub micro_batch_rows: usize,
    /// Evaluation episodes played together in one batch of rollouts.
    pub eval_batch_episodes: usize,
}

impl Default for RuntimeSection {
    fn default() -> Self {
        Self { micro_batch_rows: 16, eval_batch_episodes: 64 }
    }
}

/// `run:` — the run directory, seed, length and cadence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// The run directory (config.yaml, metrics.jsonl, checkpoints, plots).
    pub out_dir: PathBuf,
    /// Seed of everything the run samples (deals, generations, dropout).
    pub seed: u64,
    /// Training iterations.
    pub iterations: usize,
    /// A checkpoint every this many iterations (and after the last one).
    pub checkpoint_every: usize,
    /// A log line every this many iterations (metrics.jsonl gets every iteration).
    pub log_every: usize,
}

impl Default for RunSection {
    fn default() -> Self {
        Self { out_dir: PathBuf::from("runs/hanabi"), seed: 0, iterations: 30, checkpoint_every: 5, log_every: 1 }
    }
}

/// `model:` — a Hugging Face model directory or a GGUF file, or the built-in model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// A Hugging Face model directory or a GGUF file; `null` means the built-in model of `preset`.
    pub path: Option<PathBuf>,
    /// The built-in model's size when `path` is null: `tiny` or `small`.
    pub preset: String,
    /// Seed the built-in model is initialised from.
    pub seed: u64,
    /// Compute device: `cpu`, or `cuda` / `cuda:N` with the `cuda` feature.
    pub device: String,
    /// Keep the base's matrices quantized (a GGUF file's own block types, Q8_0 for float
    /// weights) under the f32 adapters: a several times smaller base; CPU only.
    pub quantized: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self { path: None, preset: "tiny".to_string(), seed: 0, device: "cpu".to_string(), quantized: false }
    }
}

impl ModelSection {
    /// The built-in model preset named by `preset`.
    pub fn preset(&self) -> std::result::Result<Preset, String> {
        <Preset as clap::ValueEnum>::from_str(&self.preset, true).map_err(|_| {
            let known: Vec<String> = <Preset as clap::ValueEnum>::value_variants()
                .iter()
                .filter_map(|p| clap::ValueEnum::to_possible_value(p).map(|v| v.get_name().to_string()))
                .collect();
            format!("unknown preset {:?} (known: {})", self.preset, known.join(", "))
        })
    }
}

/// `env:` — the environment's registry name plus its own parameters, passed unchanged to
/// [`Registry::make_from_spec`] (each environment checks its parameters strictly).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EnvSection {
    /// The registry name (`hanabi`, `bridge`, `writing`, `writing_tldr`, `coding`, a plug-in's).
    pub name: String,
    /// The environment's parameters (everything but `name`).
    #[serde(flatten)]
    pub params: serde_json::Map<String, serde_json::Value>,
}

impl Default for EnvSection {
    fn default() -> Self {
        let mut params = serde_json::Map::new();
        params.insert("players".to_string(), serde_json::Value::from(2));
        Self { name: "hanabi".to_string(), params }
    }
}

impl EnvSection {
    /// The spec `{name: ..., <params>...}` that [`Registry::make_from_spec`] takes.
    pub fn spec(&self) -> serde_json::Value {
        let mut object = self.params.clone();
        object.insert("name".to_string(), serde_json::Value::String(self.name.clone()));
        serde_json::Value::Object(object)
    }
}

/// `agents:` — how many agents, and which agent plays each seat.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentsSection {
    /// Number of agents (adapters `agent_0` ... `agent_{n-1}`).
    pub num_agents: usize,
    /// `seats[i]` is the agent id playing seat `i`; one entry per seat of the environment.
    pub seats: Vec<usize>,
    /// `per_agent` (one adapter and optimizer per agent) or `shared` (one for all agents).
    pub mode: AdapterMode,
}

impl Default for AgentsSection {
    fn default() -> Self {
        Self { num_agents: 2, seats: vec![0, 1], mode: AdapterMode::PerAgent }
    }
}

/// `adapter:` — the LoRA every agent gets (see [`AdapterConfig`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdapterSection {
    /// Rank of the low-rank update.
    pub r: usize,
    /// Scale numerator: the update is multiplied by `lora_alpha / r` (`/ sqrt(r)` with rsLoRA).
    pub lora_alpha: f64,
    /// Projections that get an update (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
    /// `up_proj`, `down_proj`).
    pub target_modules: Vec<Projection>,
    /// Dropout on the adapter's input while training, in [0, 1).
    pub lora_dropout: f64,
    /// rsLoRA scaling.
    pub use_rslora: bool,
}

impl Default for AdapterSection {
    fn default() -> Self {
        let defaults = AdapterConfig::default();
        Self {
            r: defaults.r,
            lora_alpha: defaults.lora_alpha,
            target_modules: defaults.target_modules,
            lora_dropout: defaults.lora_dropout,
            use_rslora: defaults.use_rslora,
        }
    }
}

/// `action:` — action mode, invalid-reply handling and sampling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActionSection {
    /// `free` (generate and parse), `constrained` (decode only legal actions' tokens) or
    /// `choice` (sample among the legal actions by likelihood).
    pub mode: ActionMode,
    /// Reward added to a seat for each invalid reply (free mode).
    pub invalid_penalty: f64,
    /// `retry`, `random` or `end_episode`.
    pub fallback: Fallback,
    /// Retries per turn with the `retry` fallback.
    pub max_retries: usize,
    /// Longest reply, in tokens.
    pub max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    pub temperature: f64,
    /// Nucleus sampling threshold in (0, 1] (1: off).
    pub top_p: f64,
    /// Keep the k most likely tokens (0: off).
    pub top_k: usize,
    /// Wrap prompts in the model's chat template when it has one.
    pub chat_template: bool,
    /// `choice` mode: score a legal action by its log-likelihood (`sum`) or its mean
    /// log-probability per token (`mean`, length-normalised).
    pub choice_score: ChoiceScore,
}

impl Default for ActionSection {
    fn default() -> Self {
        let sampling = SamplingConfig::default();
        Self {
            mode: ActionMode::Free,
            invalid_penalty: -1.0,
            fallback: Fallback::Random,
            max_retries: 1,
            max_new_tokens: 16,
            temperature: f64::from(sampling.temperature),
            top_p: f64::from(sampling.top_p),
            top_k: sampling.top_k,
            chat_template: true,
            choice_score: ChoiceScore::Sum,
        }
    }
}

impl ActionSection {
    /// The sampler settings of replies.
    pub fn sampling(&self) -> SamplingConfig {
        SamplingConfig { temperature: self.temperature as f32, top_k: self.top_k, top_p: self.top_p as f32 }
    }
}

/// `training:` — MAGRPO's hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingSection {
    /// Rollouts per group (G), all from the same start; at least 2.
    pub group_size: usize,
    /// Groups per iteration.
    pub groups_per_iteration: usize,
    /// AdamW learning rate (after warmup).
    pub lr: f64,
    /// Iterations of linear warmup from 0 to `lr`.
    pub warmup_iterations: usize,
    /// The learning rate at the last iteration (`run.iterations`) as a fraction of `lr`,
    /// reached linearly after the warm-up (1: constant).
    pub lr_final_fraction: f64,
    /// Gradient clipping by global norm per agent (0: off).
    pub max_grad_norm: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW's first-moment decay.
    pub beta1: f64,
    /// AdamW's second-moment decay.
    pub beta2: f64,
    /// What a return is compared with in its group: `mean` (GRPO), `max`, `rloo` (leave one
    /// out) or `raw` (no baseline).
    pub advantage: AdvantageBaseline,
    /// Which standard deviation divides the advantages: `group`, `batch` or `none`.
    pub scale_rewards: RewardScaling,
    /// Which returns a turn is compared with: `agent_turn` (the same agent's turns at the same
    /// index in the group, AT-GRPO) or `agent` (all the agent's turns in the group).
    pub group_by: AdvantageGrouping,
    /// The objective: `{kind: magrpo | clipped, epochs_per_iteration, clip_low, clip_high,
    /// ratio: token | sequence, loss_normalization: agent_token_mean | sequence_mean | constant}`.
    pub objective: ObjectiveConfig,
    /// Weight of the KL penalty to the base model (0: off).
    pub kl_coef: f64,
    /// The per-token KL estimator: `k3` (never negative) or `k1` (`log p - log p_ref`).
    pub kl_estimator: KlEstimator,
    /// Discount of later rewards when crediting a turn with its return.
    pub gamma: f64,
    /// An episode is cut after this many steps.
    pub max_episode_steps: usize,
    /// Steps of supervised warm-up on the action format before the first iteration (0: none;
    /// see [`crate::rl::trainer::FormatWarmup`]).
    pub format_warmup_steps: usize,
    /// Prompts per format warm-up step.
    pub format_warmup_batch: usize,
    /// Learning rate of the format warm-up.
    pub format_warmup_lr: f64,
}

impl TrainingSection {
    /// The AdamW settings of every agent's optimizer (peak learning rate; epsilon at its default).
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            ..AdamWConfig::default()
        }
    }
}

impl Default for TrainingSection {
    fn default() -> Self {
        let adamw = AdamWConfig::default();
        let warmup = crate::rl::trainer::FormatWarmup::default();
        Self {
            group_size: 4,
            groups_per_iteration: 2,
            lr: 1.0e-4,
            warmup_iterations: 0,
            lr_final_fraction: 1.0,
            max_grad_norm: 1.0,
            weight_decay: adamw.weight_decay,
            beta1: adamw.beta1,
            beta2: adamw.beta2,
            advantage: AdvantageBaseline::default(),
            scale_rewards: RewardScaling::default(),
            group_by: AdvantageGrouping::default(),
            objective: ObjectiveConfig::default(),
            kl_coef: 0.0,
            kl_estimator: KlEstimator::default(),
            gamma: 1.0,
            max_episode_steps: 50,
            format_warmup_steps: warmup.steps,
            format_warmup_batch: warmup.batch_size,
            format_warmup_lr: warmup.lr,
        }
    }
}

/// `rewards:` — weighted reward functions, then processors in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardsSection {
    /// The functions summed (`env_return`, `score`, `invalid_actions`), each with a weight.
    pub functions: Vec<WeightedReward>,
    /// Applied in order to the sum: `identity`, `scale {factor}`, `clamp {min, max}`, `sigmoid`.
    pub processors: Vec<RewardProcessor>,
}

impl Default for RewardsSection {
    fn default() -> Self {
        Self {
            functions: vec![WeightedReward::builtin(RewardFunction::EnvReturn, 1.0)],
            processors: vec![RewardProcessor::Identity],
        }
    }
}

/// `eval:` — evaluation episodes on held-out seeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Episodes per evaluation.
    pub episodes: usize,
    /// Seed of the first evaluation episode (episode i uses `seed + i`), away from training's.
    pub seed: u64,
    /// Seats played by a baseline policy instead of their agent: seat -> policy name
    /// (`random`, `rule`, `canonical`).
    pub baseline_seats: BTreeMap<usize, String>,
    /// Evaluation episodes end after this many steps; `null` (the default) plays them to the
    /// end, as the references score games (a training move cap is `training.max_episode_steps`).
    pub max_episode_steps: Option<usize>,
    /// During training, a held-out evaluation every this many iterations (0: none), on the
    /// same `every_episodes` deals each time, written to `metrics.jsonl` as `eval_score` and
    /// `eval_score_stderr`.
    pub every: usize,
    /// Episodes of each evaluation during training.
    pub every_episodes: usize,
    /// Environment parameters that differ in evaluation, merged over `env:` (e.g. `{split:
    /// test}`: the held-out prompts of a text task).
    pub env: serde_json::Map<String, serde_json::Value>,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            episodes: 20,
            seed: 1_000_000,
            baseline_seats: BTreeMap::new(),
            max_episode_steps: None,
            every: 0,
            every_episodes: 32,
            env: Default::default(),
        }
    }
}

/// The resolved config's file name inside a run directory.
pub const CONFIG_FILE: &str = "config.yaml";

/// Sections whose keys are free-form (not checked against the schema when overriding).
const FREE_FORM: &[&[&str]] = &[&["env"], &["eval", "baseline_seats"], &["eval", "env"]];

/// Keys that moved, as `(old path, new path)`: a config that still uses an old one is read as
/// if it used the new one, with a warning (so older configs and run directories still load).
const MOVED_KEYS: [(&[&str], &[&str]); 2] = [
    (&["training", "micro_batch_rows"], &["runtime", "micro_batch_rows"]),
    (&["eval", "batch_episodes"], &["runtime", "eval_batch_episodes"]),
];

/// The schema `--set` overrides are checked against: the default config's tree.
fn schema() -> Schema {
    Schema {
        defaults: serde_yaml::to_value(TrainConfig::default()).expect("the default config serializes"),
        free_form: FREE_FORM,
    }
}

/// Moves every [`MOVED_KEYS`] entry of `tree` to its new place (the new key wins when both
/// are given), warning once per key.
fn migrate_moved_keys(tree: &mut Yaml, origin: &Path) {
    move_keys(tree, Some(origin));
}

/// A config recorded by an earlier version (`tree`, as JSON) read as this version reads it: moved
/// keys in their new places and every key it did not have at its default, which is what that
/// version did. `None` when it does not parse as a config.
pub(crate) fn upgrade_recorded(tree: &serde_json::Value) -> Option<TrainConfig> {
    let mut tree: Yaml = serde_yaml::to_value(tree).ok()?;
    move_keys(&mut tree, None);
    serde_yaml::from_value(tree).ok()
}

/// [`migrate_moved_keys`], warning (naming `origin`) only when `origin` is given.
fn move_keys(tree: &mut Yaml, origin: Option<&Path>) {
    for (old, new) in MOVED_KEYS {
        let Some(Yaml::Mapping(section)) = tree.get_mut(old[0]) else { continue };
        let Some(value) = section.remove(old[1]) else { continue };
        if let Some(origin) = origin {
            tracing::warn!("{}: `{}` is now `{}`; read as such", origin.display(), old.join("."), new.join("."));
        }
        let Yaml::Mapping(root) = tree else { continue };
        let target = root.entry(Yaml::String(new[0].to_string())).or_insert_with(|| Yaml::Mapping(Mapping::new()));
        if target.is_null() {
            *target = Yaml::Mapping(Mapping::new());
        }
        if let Yaml::Mapping(target) = target {
            target.entry(Yaml::String(new[1].to_string())).or_insert(value);
        }
    }
}

impl TrainConfig {
    /// Reads `path`, applies the `--set key.path=value` overrides, parses strictly and validates
    /// against the environments and policies of `registry` (see [`TrainConfig::from_yaml_str`]).
    /// A file that holds no config (empty, or only comments) and a section left empty (as a
    /// file cut off after `eval:` leaves it) are errors; a file that does not end with a
    /// newline, as a cut-off one does not, gets a warning.
    pub fn from_yaml_file(path: &Path, overrides: &[String], registry: &Registry) -> Result<Self> {
        let text = super::config_file::read_config(path)?;
        super::config_file::check_whole(&text, path)?;
        Self::from_yaml_str(&text, path, overrides, registry)
    }

    /// Parses `text` (named `origin` in errors): the YAML tree, then each override in order
    /// (`training.lr=3e-4`, `agents.seats=[0, 1, 0, 1]`, `agents.seats[2]=1`; values are YAML
    /// scalars or flow collections), then the typed config, then [`TrainConfig::validate`].
    pub fn from_yaml_str(text: &str, origin: &Path, overrides: &[String], registry: &Registry) -> Result<Self> {
        let config_error =
            |key: String, message: String| TroupeError::Config { path: origin.to_path_buf(), key, message };
        let mut tree: Yaml = serde_yaml::from_str(text).map_err(|e| config_error(String::new(), e.to_string()))?;
        if tree.is_null() {
            tree = Yaml::Mapping(Mapping::new());
        }
        if !tree.is_mapping() {
            return Err(config_error(
                String::new(),
                "the config must be a mapping of sections (run, model, env, ...)".into(),
            ));
        }
        migrate_moved_keys(&mut tree, origin);
        let schema = schema();
        for raw in overrides {
            apply_override(&mut tree, raw, &schema).map_err(|(key, message)| config_error(key, message))?;
        }
        if let Some((key, value)) = super::config_file::non_finite_number(&tree) {
            return Err(config_error(key, format!("{value} is not a finite number")));
        }
        let config: TrainConfig = serde_path_to_error::deserialize(tree).map_err(|err| {
            let key = err.path().to_string();
            let key = if key == "." { String::new() } else { key };
            config_error(key, err.into_inner().to_string())
        })?;
        config.validate(origin, registry)?;
        Ok(config)
    }

    /// Reads the resolved config a run directory keeps (`RUN_DIR/config.yaml`), as
    /// `troupe train --resume RUN_DIR` does, validated like any config file.
    pub fn from_run_dir(run_dir: &Path, registry: &Registry) -> Result<Self> {
        Self::from_yaml_file(&run_dir.join(CONFIG_FILE), &[], registry)
    }

    /// Writes the resolved config to `RUN_DIR/config.yaml` atomically (creating `run_dir`).
    pub fn save(&self, run_dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(run_dir).map_err(|e| TroupeError::io(run_dir, e))?;
        let path = run_dir.join(CONFIG_FILE);
        crate::fsutil::write_atomic(&path, self.to_yaml()?.as_bytes())?;
        Ok(path)
    }

    /// The resolved config as YAML (what a run directory keeps as `config.yaml`); reading it
    /// back gives an equal config.
    pub fn to_yaml(&self) -> Result<String> {
        serde_yaml::to_string(self).map_err(|e| TroupeError::Config {
            path: PathBuf::from("config.yaml"),
            key: String::new(),
            message: e.to_string(),
        })
    }

    /// Checks everything that does not need the environment built: ranges, seats that name
    /// existing agents, a known environment name (in `registry`), model preset, device, reward
    /// pipeline and baseline policies. Errors name `origin` and the key.
    pub fn validate(&self, origin: &Path, registry: &Registry) -> Result<()> {
        let fail = |key: &str, message: String| {
            Err(TroupeError::Config { path: origin.to_path_buf(), key: key.to_string(), message })
        };
        // run
        if self.run.checkpoint_every == 0 {
            return fail("run.checkpoint_every", "must be at least 1".into());
        }
        if self.run.log_every == 0 {
            return fail("run.log_every", "must be at least 1".into());
        }
        // model
        if self.model.path.is_none() {
            if let Err(message) = self.model.preset() {
                return fail("model.preset", message);
            }
        }
        if let Err(err) = crate::device::parse_device(&self.model.device) {
            let message = match err {
                TroupeError::InvalidArgument { message, .. } => message,
                other => other.to_string(),
            };
            return fail("model.device", message);
        }
        // env
        if !registry.contains(&self.env.name) {
            let known: Vec<&str> = registry.list().map(|(name, _)| name).collect();
            return fail(
                "env.name",
                format!("unknown environment {:?} (registered: {})", self.env.name, known.join(", ")),
            );
        }
        // agents
        if self.agents.num_agents == 0 {
            return fail("agents.num_agents", "must be at least 1".into());
        }
        if self.agents.seats.is_empty() {
            return fail("agents.seats", "names no seat (one agent id per seat of the environment)".into());
        }
        for (seat, &agent) in self.agents.seats.iter().enumerate() {
            if agent >= self.agents.num_agents {
                return fail(
                    &format!("agents.seats[{seat}]"),
                    format!(
                        "agent {agent} does not exist (agents.num_agents is {}: ids 0 to {})",
                        self.agents.num_agents,
                        self.agents.num_agents - 1
                    ),
                );
            }
        }
        if let Some(idle) = (0..self.agents.num_agents).find(|a| !self.agents.seats.contains(a)) {
            return fail(
                "agents.num_agents",
                format!("agent {idle} plays no seat in agents.seats {:?}, so it could never train", self.agents.seats),
            );
        }
        // adapter
        if let Err(err) = self.adapter_config().validate(origin) {
            return match err {
                TroupeError::ConfigField { field, message, .. } => fail(&format!("adapter.{field}"), message),
                other => Err(other),
            };
        }
        // action
        let action = &self.action;
        if !action.invalid_penalty.is_finite() {
            return fail("action.invalid_penalty", format!("{} is not a finite number", action.invalid_penalty));
        }
        if action.max_new_tokens == 0 {
            return fail("action.max_new_tokens", "must be at least 1".into());
        }
        if !(action.temperature.is_finite() && action.temperature >= 0.0) {
            return fail("action.temperature", format!("{} is not a number >= 0", action.temperature));
        }
        if !(action.top_p > 0.0 && action.top_p <= 1.0) {
            return fail("action.top_p", format!("{} is not in (0, 1]", action.top_p));
        }
        if let Some((key, message)) = super::limits::oversized(self) {
            return fail(key, message);
        }
        // training
        let t = &self.training;
        if t.group_size < 2 {
            return fail(
                "training.group_size",
                format!("{} is too small: group-relative advantages need at least 2 rollouts per group", t.group_size),
            );
        }
        if t.groups_per_iteration == 0 {
            return fail("training.groups_per_iteration", "must be at least 1".into());
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return fail("training.lr", format!("{} is not a positive number", t.lr));
        }
        for (key, value) in [
            ("training.max_grad_norm", t.max_grad_norm),
            ("training.weight_decay", t.weight_decay),
            ("training.kl_coef", t.kl_coef),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return fail(key, format!("{value} is not a number >= 0"));
            }
        }
        for (key, value) in [("training.beta1", t.beta1), ("training.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&value) {
                return fail(key, format!("{value} is not in [0, 1)"));
            }
        }
        if !(t.lr_final_fraction.is_finite() && (0.0..=1.0).contains(&t.lr_final_fraction)) {
            return fail("training.lr_final_fraction", format!("{} is not in [0, 1]", t.lr_final_fraction));
        }
        if !(0.0..=1.0).contains(&t.gamma) {
            return fail("training.gamma", format!("{} is not in [0, 1]", t.gamma));
        }
        if t.format_warmup_steps > 0 && t.format_warmup_batch == 0 {
            return fail("training.format_warmup_batch", "must be at least 1 when format_warmup_steps > 0".into());
        }
        if !(t.format_warmup_lr.is_finite() && t.format_warmup_lr > 0.0) {
            return fail("training.format_warmup_lr", format!("must be a positive number, got {}", t.format_warmup_lr));
        }
        if t.max_episode_steps == 0 {
            return fail("training.max_episode_steps", "must be at least 1".into());
        }
        // rewards
        if let Err(TroupeError::Setting { key, message }) = self.reward_pipeline() {
            return fail(&key, message);
        }
        for (i, function) in self.rewards.functions.iter().enumerate() {
            if let RewardFunction::Registered(name) = &function.name {
                if registry.reward(name).is_none() {
                    let mut known = vec!["env_return", "score", "invalid_actions", "external"];
                    known.extend(registry.rewards().map(|(name, _)| name));
                    return fail(
                        &format!("rewards.functions[{i}].name"),
                        format!("unknown reward function {name:?} (known: {})", known.join(", ")),
                    );
                }
            }
        }
        // eval
        if self.eval.episodes == 0 {
            return fail("eval.episodes", "must be at least 1".into());
        }
        if self.eval.max_episode_steps == Some(0) {
            return fail("eval.max_episode_steps", "must be at least 1, or null for whole episodes".into());
        }
        if self.eval.every > 0 && self.eval.every_episodes == 0 {
            return fail("eval.every_episodes", "must be at least 1 when eval.every > 0".into());
        }
        if self.runtime.eval_batch_episodes == 0 {
            return fail("runtime.eval_batch_episodes", "must be at least 1".into());
        }
        if self.runtime.micro_batch_rows == 0 {
            return fail("runtime.micro_batch_rows", "must be at least 1".into());
        }
        if let Err((field, message)) = t.objective.check() {
            return fail(&format!("training.objective.{field}"), message);
        }
        if self.action.mode == ActionMode::Choice && (self.action.top_k != 0 || self.action.top_p < 1.0) {
            let key = if self.action.top_k != 0 { "action.top_k" } else { "action.top_p" };
            return fail(key, "`choice` mode samples from softmax(log-likelihood / temperature) over the legal actions; top_k and top_p do not apply (set 0 and 1.0)".into());
        }
        for (&seat, policy) in &self.eval.baseline_seats {
            if seat >= self.agents.seats.len() {
                return fail(
                    &format!("eval.baseline_seats.{seat}"),
                    format!("seat {seat} does not exist (agents.seats has {} seats)", self.agents.seats.len()),
                );
            }
            if let Err(err) = registry.make_policy(policy) {
                return fail(&format!("eval.baseline_seats.{seat}"), err.to_string());
            }
        }
        Ok(())
    }

    /// The adapter configuration every agent gets (the model path recorded for deployment).
    pub fn adapter_config(&self) -> AdapterConfig {
        AdapterConfig {
            r: self.adapter.r,
            lora_alpha: self.adapter.lora_alpha,
            target_modules: self.adapter.target_modules.clone(),
            lora_dropout: self.adapter.lora_dropout,
            use_rslora: self.adapter.use_rslora,
            base_model_name_or_path: self.model.path.as_ref().map(|p| p.display().to_string()),
        }
    }

    /// The environment spec of evaluation: `env:` with `eval.env`'s parameters over it.
    pub fn eval_env_spec(&self) -> serde_json::Value {
        let mut spec = self.env.spec();
        if let serde_json::Value::Object(object) = &mut spec {
            for (key, value) in &self.eval.env {
                object.insert(key.clone(), value.clone());
            }
        }
        spec
    }

    /// The rollout settings of evaluation: `action:`, whole episodes (or
    /// `eval.max_episode_steps`), and an invalid reply never ends an episode with its points
    /// kept: `end_episode` becomes `random` (a uniformly random legal action replaces it, and
    /// it counts in the invalid rate).
    pub fn eval_rollout_config(&self) -> RolloutConfig {
        let mut rollout = self.rollout_config();
        rollout.max_episode_steps = self.eval.max_episode_steps.unwrap_or(usize::MAX);
        if rollout.fallback == Fallback::EndEpisode {
            rollout.fallback = Fallback::Random;
        }
        rollout
    }

    /// The rollout settings of `action:` (and `training.max_episode_steps`).
    pub fn rollout_config(&self) -> RolloutConfig {
        RolloutConfig {
            mode: self.action.mode,
            invalid_penalty: self.action.invalid_penalty,
            fallback: self.action.fallback,
            max_retries: self.action.max_retries,
            max_new_tokens: self.action.max_new_tokens,
            sampling: self.action.sampling(),
            chat_template: self.action.chat_template,
            max_episode_steps: self.training.max_episode_steps,
            choice_score: self.action.choice_score,
        }
    }

    /// What [`crate::rl::trainer::MagrpoTrainer`] needs from this config.
    pub fn trainer_settings(&self) -> Result<TrainerSettings> {
        let t = &self.training;
        Ok(TrainerSettings {
            env_spec: self.env.spec(),
            seat_agents: self.agents.seats.clone(),
            group_size: t.group_size,
            groups_per_iteration: t.groups_per_iteration,
            rollout: self.rollout_config(),
            adamw: t.adamw(),
            warmup_iterations: t.warmup_iterations as u64,
            lr_final_fraction: t.lr_final_fraction,
            total_iterations: self.run.iterations as u64,
            max_grad_norm: t.max_grad_norm,
            advantage: AdvantageSettings { baseline: t.advantage, scaling: t.scale_rewards, grouping: t.group_by },
            gamma: t.gamma,
            objective: t.objective.clone(),
            kl: KlPenalty { coef: t.kl_coef, estimator: t.kl_estimator },
            rewards: self.reward_pipeline()?,
            format_warmup: crate::rl::trainer::FormatWarmup {
                steps: t.format_warmup_steps,
                batch_size: t.format_warmup_batch,
                lr: t.format_warmup_lr,
            },
            micro_batch_rows: self.runtime.micro_batch_rows,
            seed: self.run.seed,
        })
    }

    /// The reward pipeline of `rewards:`.
    pub fn reward_pipeline(&self) -> Result<RewardPipeline> {
        RewardPipeline::new(self.rewards.functions.clone(), self.rewards.processors.clone())
    }

    /// Builds the environment from `env:` (and `eval.env`'s variant, when given) and checks what
    /// needs it: one agent per seat, and an action mode the environment supports (`constrained`
    /// and `choice` need a finite action set). The environment returned may have been reset;
    /// reset it before use. `origin` names the config file in errors.
    pub fn build_env(&self, origin: &Path, registry: &Registry) -> Result<Box<dyn Environment>> {
        let fail = |key: String, message: String| TroupeError::Config { path: origin.to_path_buf(), key, message };
        let env = registry.make_from_spec(&self.env.spec()).map_err(|err| match err {
            EnvError::BadParam { field, message, .. } => fail(format!("env.{field}"), message),
            EnvError::UnknownEnv { .. } => fail("env.name".into(), err.to_string()),
            other => fail("env".into(), other.to_string()),
        })?;
        if !self.eval.env.is_empty() {
            registry.make_from_spec(&self.eval_env_spec()).map_err(|err| match err {
                EnvError::BadParam { field, message, .. } => fail(format!("eval.env.{field}"), message),
                other => fail("eval.env".into(), other.to_string()),
            })?;
        }
        if env.num_seats() != self.agents.seats.len() {
            return Err(fail(
                "agents.seats".into(),
                format!(
                    "{:?} names {} seats but {} has {}",
                    self.agents.seats,
                    self.agents.seats.len(),
                    self.env.name,
                    env.num_seats()
                ),
            ));
        }
        let mut env = env;
        if self.action.mode != ActionMode::Free || self.training.format_warmup_steps > 0 {
            // The built environment is the probe (every caller resets it before use).
            let probe = &mut env;
            probe.reset(self.run.seed);
            if let Some(&seat) = probe.acting_seats().first() {
                if probe.legal_actions(seat).is_none() && self.action.mode == ActionMode::Free {
                    return Err(fail(
                        "training.format_warmup_steps".into(),
                        format!("the format warm-up needs a finite set of legal actions, but {} takes open-ended text; set it to 0", self.env.name),
                    ));
                }
                if probe.legal_actions(seat).is_none() {
                    return Err(fail(
                        "action.mode".into(),
                        format!(
                            "`{}` needs a finite set of legal actions, but {} takes open-ended text; use `free`",
                            self.action.mode, self.env.name
                        ),
                    ));
                }
            }
        }
        Ok(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, overrides: &[&str]) -> Result<TrainConfig> {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        TrainConfig::from_yaml_str(text, Path::new("configs/test.yaml"), &overrides, &Registry::with_builtins())
    }

    fn error(text: &str, overrides: &[&str]) -> String {
        parse(text, overrides).expect_err("this config must be refused").to_string()
    }

    #[test]
    fn empty_file_gives_the_documented_defaults() {
        let config = parse("", &[]).unwrap();
        assert_eq!(config, TrainConfig::default());
        assert_eq!(config.run.iterations, 30);
        assert_eq!(config.env.spec(), serde_json::json!({"name": "hanabi", "players": 2}));
        assert_eq!(config.agents.seats, vec![0, 1]);
        assert_eq!(config.action.mode, ActionMode::Free);
        assert_eq!(config.action.fallback, Fallback::Random);
        assert_eq!(config.training.lr, 1.0e-4);
        assert_eq!(config.eval.seed, 1_000_000);
        assert_eq!(config.model.preset(), Ok(Preset::Tiny));
        assert_eq!(config.adapter_config(), AdapterConfig::default());
    }

    #[test]
    fn sections_override_defaults_field_by_field() {
        let config = parse(
            "training: {group_size: 8}\nenv: {name: bridge, rotate_boards: true}\nagents: {seats: [0, 1, 0, 1]}\n\
             action: {mode: choice}\neval: {baseline_seats: {1: rule}}\n",
            &[],
        )
        .unwrap();
        assert_eq!(config.training.group_size, 8);
        assert_eq!(config.training.groups_per_iteration, 2, "untouched fields keep their default");
        assert_eq!(config.env.spec(), serde_json::json!({"name": "bridge", "rotate_boards": true}));
        assert_eq!(config.eval.baseline_seats.get(&1).map(String::as_str), Some("rule"));
    }

    #[test]
    fn wrong_type_names_file_and_key() {
        assert_eq!(
            error("training:\n  group_size: four\n", &[]),
            "configs/test.yaml: training.group_size: invalid type: string \"four\", expected usize"
        );
        let err = error("agents: {seats: [0, x]}", &[]);
        assert!(err.starts_with("configs/test.yaml: agents.seats[1]: invalid type"), "{err}");
    }

    #[test]
    fn unknown_keys_are_refused_with_the_key() {
        let err = error("training: {group_sise: 4}", &[]);
        assert!(err.contains("training.group_sise") && err.contains("unknown field `group_sise`"), "{err}");
        let err = error("trainning: {group_size: 4}", &[]);
        assert!(err.contains("unknown field `trainning`"), "{err}");
        let err = error("action: {mode: freestyle}", &[]);
        assert!(err.contains("action.mode") && err.contains("unknown variant `freestyle`"), "{err}");
        assert!(err.contains("expected one of `free`, `constrained`, `choice`"), "{err}");
        let err = error("rewards: {processors: [{type: clamp, min: 0, max: 1, extra: 2}]}", &[]);
        assert!(err.contains("rewards.processors[0]") && err.contains("extra"), "{err}");
        let err = error("adapter: {target_modules: [q_proj, x_proj]}", &[]);
        assert!(err.contains("adapter.target_modules[1]") && err.contains("x_proj"), "{err}");
    }

    #[test]
    fn yaml_syntax_errors_name_the_file() {
        let err = error("training: {group_size: 4\n", &[]);
        assert!(err.starts_with("configs/test.yaml: ") && err.contains("line"), "{err}");
        let err = error("- a\n- b\n", &[]);
        assert!(err.contains("mapping of sections"), "{err}");
    }

    #[test]
    fn seats_naming_a_missing_agent_are_refused() {
        let err = error("agents: {num_agents: 2, seats: [0, 1, 2, 1]}", &[]);
        assert!(err.starts_with("configs/test.yaml: agents.seats[2]: agent 2 does not exist"), "{err}");
        let err = error("agents: {num_agents: 3, seats: [0, 1]}", &[]);
        assert!(err.contains("agents.num_agents") && err.contains("agent 2 plays no seat"), "{err}");
        assert!(error("agents: {seats: []}", &[]).contains("agents.seats"));
    }

    #[test]
    fn ranges_are_validated() {
        for (text, key) in [
            ("training: {group_size: 1}", "training.group_size"),
            ("training: {lr: 0}", "training.lr"),
            ("training: {lr: -1.0e-4}", "training.lr"),
            ("training: {beta2: 1.0}", "training.beta2"),
            ("training: {gamma: 1.5}", "training.gamma"),
            ("training: {max_grad_norm: -1}", "training.max_grad_norm"),
            ("action: {top_p: 0}", "action.top_p"),
            ("action: {max_new_tokens: 0}", "action.max_new_tokens"),
            ("action: {temperature: -0.5}", "action.temperature"),
            ("adapter: {r: 0}", "adapter.r"),
            ("adapter: {lora_dropout: 1.0}", "adapter.lora_dropout"),
            ("run: {checkpoint_every: 0}", "run.checkpoint_every"),
            ("model: {preset: huge}", "model.preset"),
            ("model: {device: tpu}", "model.device"),
            ("env: {name: chess}", "env.name"),
            ("rewards: {functions: []}", "rewards.functions"),
            ("rewards: {processors: [{type: clamp, min: 1, max: 0}]}", "rewards.processors[0].max"),
            ("eval: {episodes: 0}", "eval.episodes"),
            ("eval: {baseline_seats: {5: rule}}", "eval.baseline_seats.5"),
            ("eval: {baseline_seats: {1: genius}}", "eval.baseline_seats.1"),
        ] {
            let err = error(text, &[]);
            assert!(err.starts_with(&format!("configs/test.yaml: {key}: ")), "{text}: {err}");
        }
        let err = error("env: {name: chess}", &[]);
        assert!(err.contains("hanabi"), "lists the registered environments: {err}");
        // A model path makes the preset irrelevant.
        assert!(parse("model: {path: /models/qwen3, preset: huge}", &[]).is_ok());
    }

    #[test]
    fn overrides_apply_before_parsing() {
        let config = parse(
            "training: {group_size: 4}\nagents: {num_agents: 2, seats: [0, 1]}\n",
            &[
                "training.group_size=6",
                "training.lr=3e-4",
                "run.out_dir=/tmp/run x",
                "env.name=bridge",
                "env.players=",
                "agents.seats=[0, 1, 0, 1]",
                "agents.seats[3]=0",
                "agents.seats.2=1",
                "eval.baseline_seats.1=rule",
                "model.path=/models/qwen3",
                "rewards.processors=[{type: scale, factor: 2}]",
                "rewards.processors[0].factor=3",
            ],
        )
        .unwrap();
        assert_eq!(config.training.group_size, 6);
        assert_eq!(config.training.lr, 3e-4);
        assert_eq!(config.run.out_dir, PathBuf::from("/tmp/run x"));
        assert_eq!(config.agents.seats, vec![0, 1, 1, 0]);
        assert_eq!(config.eval.baseline_seats.get(&1).map(String::as_str), Some("rule"));
        assert_eq!(config.model.path, Some(PathBuf::from("/models/qwen3")));
        assert_eq!(config.rewards.processors, vec![RewardProcessor::Scale { factor: 3.0 }]);
        // `env.players=` set the parameter to null; env params are free-form.
        assert_eq!(config.env.params.get("players"), Some(&serde_json::Value::Null));
    }

    #[test]
    fn indexing_a_list_the_file_leaves_out_starts_from_the_default() {
        let config = parse("", &["agents.seats[1]=0", "agents.num_agents=1", "rewards.functions[0].weight=2"]).unwrap();
        assert_eq!(config.agents.seats, vec![0, 0]);
        assert_eq!(config.rewards.functions, vec![WeightedReward::builtin(RewardFunction::EnvReturn, 2.0)]);
    }

    #[test]
    fn bad_overrides_are_named() {
        let err = error("", &["training.lrr=0.1"]);
        assert!(err.starts_with("configs/test.yaml: training.lrr: unknown key") && err.contains("lr,"), "{err}");
        let err = error("", &["trainig.lr=0.1"]);
        assert!(err.contains("trainig.lr: unknown key (known sections: run, model"), "{err}");
        let err = error("", &["training.group_size=four"]);
        assert!(err.contains("training.group_size: invalid type: string \"four\""), "{err}");
        assert!(error("", &["training.lr"]).contains("not of the form key.path=value"));
        assert!(error("", &["training..lr=1"]).contains("malformed key"));
        let err = error("", &["agents.seats[5]=1"]);
        assert!(err.contains("agents.seats[5]: index 5 is out of range: agents.seats has 2 entries"), "{err}");
        let err = error("", &["model.path[0]=x"]);
        assert!(err.contains("model.path[0]: model.path is not a list"), "{err}");
        let err = error("", &["training.lr.x=1"]);
        assert!(err.contains("training.lr is a value, not a section"), "{err}");
        let err = error("agents: {seats: [0, 1]}", &["agents.seats[5]=1"]);
        assert!(err.contains("index 5 is out of range: agents.seats has 2 entries"), "{err}");
    }

    #[test]
    fn resolved_yaml_round_trips() {
        let config = parse(
            "env: {name: bridge, rotate_boards: true}\nagents: {seats: [0, 1, 0, 1]}\naction: {mode: choice}\n\
             rewards: {functions: [{name: score, weight: 0.5}, {name: invalid_actions}], processors: [{type: clamp, min: -1, max: 1}, {type: sigmoid}]}\n\
             eval: {baseline_seats: {1: random}}\n",
            &[],
        )
        .unwrap();
        let yaml = config.to_yaml().unwrap();
        let again = parse(&yaml, &[]).unwrap();
        assert_eq!(again, config, "{yaml}");
    }

    #[test]
    fn env_checks_need_the_built_env() {
        let registry = Registry::with_builtins();
        let origin = Path::new("configs/test.yaml");
        let config = parse("env: {name: bridge}", &[]).unwrap();
        let err = config.build_env(origin, &registry).err().expect("bridge has 4 seats").to_string();
        assert!(err.contains("agents.seats") && err.contains("bridge has 4"), "{err}");
        let config = parse("env: {name: hanabi, players: 9}", &[]).unwrap();
        let err = config.build_env(origin, &registry).err().expect("9 players is too many").to_string();
        assert!(err.starts_with("configs/test.yaml: env.players"), "{err}");
        let config = parse("env: {name: writing}\naction: {mode: choice}", &[]).unwrap();
        let err = config.build_env(origin, &registry).err().expect("writing has no finite actions").to_string();
        assert!(err.contains("action.mode"), "{err}");
        let config = parse("env: {name: writing}\naction: {mode: constrained}", &[]).unwrap();
        let err = config.build_env(origin, &registry).err().expect("writing has no finite actions").to_string();
        assert!(err.starts_with("configs/test.yaml: action.mode: `constrained` needs a finite set"), "{err}");
        for (env, seats) in [("hanabi", "[0, 1]"), ("bridge", "[0, 1, 0, 1]")] {
            let config =
                parse(&format!("env: {{name: {env}}}\nagents: {{seats: {seats}}}\naction: {{mode: constrained}}"), &[])
                    .unwrap();
            assert_eq!(config.action.mode, ActionMode::Constrained);
            assert_eq!(config.rollout_config().mode, ActionMode::Constrained);
            assert!(config.build_env(origin, &registry).is_ok(), "{env} has finite legal actions");
        }
        let config = parse("env: {name: hanabi, players: 3}\nagents: {seats: [0, 1, 0]}", &[]).unwrap();
        assert_eq!(config.build_env(origin, &registry).unwrap().num_seats(), 3);
    }

    #[test]
    fn trainer_settings_come_from_the_sections() {
        let config = parse(
            "run: {seed: 7}\nenv: {name: bridge}\nagents: {seats: [0, 1, 0, 1]}\n\
             action: {mode: choice, fallback: end_episode, temperature: 0.5, max_new_tokens: 5}\n\
             training: {group_size: 3, lr: 2.0e-4, warmup_iterations: 4, weight_decay: 0.1, max_episode_steps: 9, micro_batch_rows: 4}",
            &[],
        )
        .unwrap();
        let settings = config.trainer_settings().unwrap();
        assert_eq!(settings.env_spec, serde_json::json!({"name": "bridge"}));
        assert_eq!(settings.seat_agents, vec![0, 1, 0, 1]);
        assert_eq!((settings.group_size, settings.groups_per_iteration, settings.seed), (3, 2, 7));
        assert_eq!((settings.adamw.lr, settings.adamw.weight_decay), (2.0e-4, 0.1));
        assert_eq!((settings.warmup_iterations, settings.micro_batch_rows), (4, 4));
        let rollout = &settings.rollout;
        assert_eq!((rollout.mode, rollout.fallback), (ActionMode::Choice, Fallback::EndEpisode));
        assert_eq!((rollout.max_new_tokens, rollout.max_episode_steps), (5, 9));
        assert_eq!(rollout.sampling.temperature, 0.5);
    }

    #[test]
    fn saved_config_reloads_from_the_run_dir() {
        let dir = tempfile::tempdir().unwrap();
        let config =
            parse("training: {group_size: 3}\nenv: {name: hanabi, players: 3}\nagents: {seats: [0, 1, 0]}", &[])
                .unwrap();
        let path = config.save(&dir.path().join("run")).unwrap();
        assert_eq!(path, dir.path().join("run").join(CONFIG_FILE));
        assert_eq!(TrainConfig::from_run_dir(&dir.path().join("run"), &Registry::with_builtins()).unwrap(), config);
        let err = TrainConfig::from_run_dir(dir.path(), &Registry::with_builtins()).unwrap_err().to_string();
        assert!(err.contains("config.yaml"), "{err}");
    }

    /// Every file in `configs/` parses, validates and builds its environment.
    #[test]
    fn shipped_configs_load_and_build_their_envs() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let registry = Registry::with_builtins();
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("configs"))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "yaml" || ext == "yml"))
            .collect();
        files.sort();
        let names: Vec<String> = files.iter().map(|p| p.file_stem().unwrap().to_string_lossy().into_owned()).collect();
        for expected in ["bridge", "coding", "hanabi", "writing"] {
            assert!(names.iter().any(|n| n == expected), "configs/{expected}.yaml is missing: {names:?}");
        }
        for path in &files {
            let config =
                TrainConfig::from_yaml_file(path, &[], &Registry::with_builtins()).unwrap_or_else(|e| panic!("{e}"));
            let env = match config.build_env(path, &registry) {
                // An OpenSpiel config needs `pip install open_spiel`, which a bare machine lacks;
                // its loading is checked above, its process where OpenSpiel is installed.
                Err(e) if config.env.name == "external" && e.to_string().contains("OpenSpiel is not installed") => {
                    eprintln!("{}: not built, OpenSpiel is not installed", path.display());
                    continue;
                }
                built => built.unwrap_or_else(|e| panic!("{e}")),
            };
            assert_eq!(env.num_seats(), config.agents.seats.len(), "{}", path.display());
            if config.env.name != "external" {
                assert_eq!(env.name(), config.env.name);
            }
        }
    }
}
