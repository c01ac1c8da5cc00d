//! The sections of a run's config that belong to no single component below the trainer: the
//! environment (`env:`), which agent plays each seat (`agents:`),
//! MAGRPO's own knobs (`training:`, holding the optimizer's, the KL penalty's, the objective's and
//! the format warm-up's sections as fields) and how the work is batched (`runtime:`). Every
//! default is written beside its field.

use serde::{Deserialize, Serialize};

use crate::adapters::{AdamWConfig, AdapterMode};
use crate::model::{AttentionKernel, KvCacheDtype, PromptCache};
use crate::rl::credit::advantage::{AdvantageBaseline, RewardScaling};
use crate::rl::credit::batch::{AdvantageGrouping, AdvantageSettings};
use crate::rl::objective::{KlPenalty, ObjectiveConfig};
use crate::rl::warmup::FormatWarmup;
use crate::section::config_section;

/// `env:` — the environment's registry name plus its own parameters, passed unchanged to
/// [`troupe_envs::Registry::make_from_spec`] (each environment checks its parameters strictly).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EnvConfig {
    /// The registry name (`hanabi`, `bridge`, `writing`, `writing_tldr`, `coding`, a plug-in's).
    pub name: String,
    /// The environment's parameters (everything but `name`).
    #[serde(flatten)]
    pub params: serde_json::Map<String, serde_json::Value>,
}

impl Default for EnvConfig {
    fn default() -> Self {
        let mut params = serde_json::Map::new();
        params.insert("players".to_string(), serde_json::Value::from(2));
        Self { name: "hanabi".to_string(), params }
    }
}

impl EnvConfig {
    /// The spec `{name: ..., <params>...}` that [`troupe_envs::Registry::make_from_spec`] takes.
    pub fn spec(&self) -> serde_json::Value {
        let mut object = self.params.clone();
        object.insert("name".to_string(), serde_json::Value::String(self.name.clone()));
        serde_json::Value::Object(object)
    }
}

config_section! {
    /// `agents:` — how many agents, and which agent plays each seat.
    pub struct AgentsConfig {
        /// Number of agents (adapters `agent_0` ... `agent_{n-1}`).
        pub num_agents: usize = 2,
        /// `seats[i]` is the agent id playing seat `i`; one entry per seat of the environment.
        pub seats: Vec<usize> = vec![0, 1],
        /// `per_agent` (one adapter and optimizer per agent) or `shared` (one for all agents).
        pub mode: AdapterMode = AdapterMode::PerAgent,
        /// Start from these adapters instead of fresh ones: a PEFT adapters directory (with
        /// `troupe.json`), a checkpoint, or a run directory (its newest checkpoint), as
        /// `troupe eval --adapters` takes them; an earlier run's agents, say, trained beside a
        /// scripted partner or by supervised fine-tuning. They must hold the same agents, mode
        /// and `adapter:` shape (rank, alpha, rsLoRA, targets); the optimizer starts afresh.
        /// Unset: fresh adapters (PEFT's initialisation, from `run.seed`).
        pub init_adapters: Option<std::path::PathBuf> = None,
    }
}

config_section! {
    /// `training:` — MAGRPO's hyper-parameters; the optimizer, the KL penalty, the objective and
    /// the format warm-up keep theirs in their own sections.
    pub struct TrainingConfig {
        /// Rollouts per group (G), all from the same start; at least 2.
        pub group_size: usize = 4,
        /// Groups per iteration.
        pub groups_per_iteration: usize = 2,
        /// AdamW per agent: `{lr, beta1, beta2, eps, weight_decay}`.
        pub optimizer: AdamWConfig = AdamWConfig::default(),
        /// Iterations of linear warmup from 0 to `optimizer.lr`.
        pub warmup_iterations: usize = 0,
        /// The learning rate at the last iteration (`run.iterations`) as a fraction of
        /// `optimizer.lr`, reached linearly after the warm-up (1: constant).
        pub lr_final_fraction: f64 = 1.0,
        /// Gradient clipping by global norm per agent (0: off).
        pub max_grad_norm: f64 = 1.0,
        /// What a return is compared with in its group: `mean` (GRPO), `max`, `rloo` (leave
        /// one out) or `raw` (no baseline).
        pub advantage: AdvantageBaseline = AdvantageBaseline::default(),
        /// Which standard deviation divides the advantages: `group`, `batch` or `none`.
        pub scale_rewards: RewardScaling = RewardScaling::default(),
        /// Which returns a turn is compared with: `agent_turn` (the same agent's turns at the
        /// same index in the group, AT-GRPO) or `agent` (all the agent's turns in the group).
        pub group_by: AdvantageGrouping = AdvantageGrouping::default(),
        /// The objective: `{kind: magrpo | clipped, epochs_per_iteration, clip_low, clip_high,
        /// ratio: token | sequence, loss_normalization: agent_token_mean | sequence_mean |
        /// constant}`.
        pub objective: ObjectiveConfig = ObjectiveConfig::default(),
        /// The KL penalty to the base model: `{coef, estimator: k3 | k1}`.
        pub kl: KlPenalty = KlPenalty::default(),
        /// Discount of later rewards when crediting a turn with its return.
        pub gamma: f64 = 1.0,
        /// A training episode is cut after this many steps.
        pub max_episode_steps: usize = 50,
        /// Supervised warm-up on the action format: `{steps, batch_size, lr}`.
        pub format_warmup: FormatWarmup = FormatWarmup::default(),
        /// Fixed partners in the training games: group `g` of an iteration seats the policies of
        /// `partners[g % len]` (`{seat: policy}`, the baseline policies of
        /// `eval.baseline_seats`) in place of their agents, and only the agents' moves are
        /// trained on. `[{1: rule}, {0: rule}]` trains agent 0 beside the rule player in even
        /// groups and agent 1 in odd ones; `{}` is a self-play group. Empty: self-play only.
        pub partners: Vec<std::collections::BTreeMap<usize, String>> = Vec::new(),
    }
}

/// The seating group `group` of an iteration plays, out of `seatings` (`training.partners`):
/// entry `group % seatings`, or `None` when there are none (self-play). The rollout seats the
/// partners by it and the credit phase leaves their seats out by it.
pub fn seating_of_group(seatings: usize, group: usize) -> Option<usize> {
    (seatings > 0).then(|| group % seatings)
}

impl TrainingConfig {
    /// How returns become advantages (the credit phase's settings).
    pub fn advantage_settings(&self) -> AdvantageSettings {
        AdvantageSettings { baseline: self.advantage, scaling: self.scale_rewards, grouping: self.group_by }
    }
}

config_section! {
    /// `runtime:` — how the work is cut into batches: memory and speed, not the experiment's
    /// maths (a GPU wants far larger batches than 2 CPU cores).
    pub struct RuntimeConfig {
        /// Rows (replies, or `choice` decisions) per forward/backward micro-batch of the update.
        pub micro_batch_rows: usize = 16,
        /// When set, the update's micro-batches are sized by tokens instead of rows: rows are
        /// packed in order while their tokens (prompt + reply; for a `choice` decision, prompt +
        /// every candidate) stay within this budget, and a row longer than the budget goes
        /// alone. Unset: `micro_batch_rows` rows per micro-batch.
        pub micro_batch_tokens: Option<usize> = None,
        /// Activation checkpointing in the update: each decoder layer's activations are
        /// recomputed in the backward pass instead of kept from the forward, so only the
        /// residual stream between layers (and one layer's activations at a time) is held.
        /// Costs one more forward pass of the layers; the gradients are the same.
        pub gradient_checkpointing: bool = false,
        /// Evaluation episodes played together in one batch of rollouts.
        pub eval_batch_episodes: usize = 64,
        /// The attention kernel on a GPU for the forwards without gradients (rollouts,
        /// generation, scoring, evaluation): `flash` (burn-cubecl's flash kernel, no score matrix
        /// in memory), `materialized` (burn's separate kernels, the scores held) or `auto`
        /// (`materialized`). The update's forward, the CPU and a decoding step over a shared
        /// prompt (`prompt_cache`) are unaffected.
        pub attention: AttentionKernel = AttentionKernel::Auto,
        /// How a rollout's KV cache, and the update's scoring, hold the prompt a group's
        /// replies share: `shared` (once per group, beside each reply's own slots; attention
        /// reads both parts, and in the update keeps no per-reply copy and no probabilities),
        /// `copied` (each reply's row holds its own copy) or `auto` (`shared` on a GPU, `copied`
        /// on the CPU). The same next-token distributions and gradients within float rounding;
        /// `shared` holds and reads far fewer keys and values when prompts are long beside the
        /// replies.
        pub prompt_cache: PromptCache = PromptCache::Auto,
        /// What a rollout's KV cache holds its keys and values in: `auto` (the base's precision,
        /// `model.dtype`, on a GPU when it is bf16 or f16: half the bytes of f32, each value
        /// widened to f32 as attention reads it; f32 on the CPU) or `f32`. The update's scoring
        /// computes its keys and values anew in f32 either way.
        pub kv_cache: KvCacheDtype = KvCacheDtype::Auto,
    }
}
