//! `action:`: how an agent's text becomes an action. The config ([`ActionConfig`]) names one
//! [`ActionMode`]; the mode is turned once into its [`Decider`] (`ActionMode::decider`, in
//! [`super::modes`]), the one trait every mode implements (`free`: [`super::free`], `constrained`: [`super::constrained`], `choice`:
//! [`super::choice`]). The rollout loop ([`super::Rollout`]) asks the decider for the actions of
//! every pending row of a step and knows no mode by name.
//!
//! A new action mode is one file implementing [`Decider`], its variant here and its arm in
//! [`super::modes`].

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use troupe_envs::{Action, Environment, LegalAction, SeatId};

use super::ChoiceTurn;
use crate::adapters::MultiAdapterManager;
use crate::error::{Result, TroupeError};
use crate::generate::choice::ChoiceScore;
use crate::generate::{GenerateOptions, SamplingConfig};
use crate::model::Model;

/// How agents' text becomes actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionMode {
    /// Generate text, parse it; invalid text gets the penalty and the fallback.
    Free,
    /// Generate text token by token, each token restricted to those that continue one of the
    /// seat's legal actions, so every reply spells a legal action (never invalid). Needs an
    /// environment with a finite legal action set (games, not writing or coding).
    Constrained,
    /// Score every legal action's text by its log-likelihood and sample from the softmax.
    Choice,
}

impl std::fmt::Display for ActionMode {
    /// The config spelling: `free`, `constrained` or `choice`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ActionMode::Free => "free",
            ActionMode::Constrained => "constrained",
            ActionMode::Choice => "choice",
        })
    }
}

/// What happens after an invalid reply in `free` mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fallback {
    /// Ask again with the parser's error shown (up to `max_retries`), then a random legal action.
    Retry,
    /// A uniformly random legal action.
    Random,
    /// End the episode.
    EndEpisode,
}

/// `action:` — action mode, invalid-reply handling and sampling. Every default is written here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActionConfig {
    /// `free` (generate and parse), `constrained` (decode only legal actions' tokens) or
    /// `choice` (sample among the legal actions by likelihood).
    pub mode: ActionMode,
    /// Reward added to a seat for each invalid reply (free mode; usually negative).
    pub invalid_penalty: f64,
    /// `retry`, `random` or `end_episode`: what replaces an invalid reply.
    pub fallback: Fallback,
    /// Re-asks per turn after an invalid reply (with the `retry` fallback).
    pub max_retries: usize,
    /// Longest reply in `free` mode, in tokens (a `constrained` reply always runs to the end of
    /// its action).
    pub max_new_tokens: usize,
    /// Sampling temperature (0: greedy); in `choice` mode, the temperature of the softmax over
    /// the legal actions' scores.
    pub temperature: f64,
    /// Nucleus sampling threshold in (0, 1] (1: off).
    pub top_p: f64,
    /// Keep the k most likely tokens (0: off).
    pub top_k: usize,
    /// Wrap prompts in the model's chat template when it has one.
    pub chat_template: bool,
    /// `choice` mode: score a legal action by its log-likelihood (`sum`) or its mean
    /// log-probability per token (`mean`, length-normalised); the policy is
    /// `softmax(score / temperature)`.
    pub choice_score: ChoiceScore,
}

impl Default for ActionConfig {
    fn default() -> Self {
        Self {
            mode: ActionMode::Free,
            invalid_penalty: -1.0,
            fallback: Fallback::Random,
            max_retries: 1,
            max_new_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            chat_template: true,
            choice_score: ChoiceScore::Sum,
        }
    }
}

impl ActionConfig {
    /// The sampler settings of replies (among the allowed tokens in `constrained` mode).
    pub fn sampling(&self) -> SamplingConfig {
        SamplingConfig { temperature: self.temperature as f32, top_k: self.top_k, top_p: self.top_p as f32 }
    }

    /// Generation options for one batched reply: the sampling and length, stopping at EOS, with
    /// the KV cache (each row's seed is drawn apart, [`row_seeds`]).
    pub(crate) fn reply_options(&self) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            sampling: self.sampling(),
            seed: 0,
            stop_at_eos: true,
            use_cache: true,
        }
    }
}

/// One action mode: turns the pending rows of a rollout step into actions.
pub trait Decider: Sync {
    /// Whether the mode needs a finite set of legal actions (games, not writing or coding).
    fn needs_finite_actions(&self) -> bool;

    /// Decides every row of `pending` (rows of one batched pass, each on its agent's adapter).
    /// `rngs[episode]` is each row's episode generator.
    fn decide(
        &self,
        step: &Step<'_>,
        envs: &[Box<dyn Environment>],
        pending: &[Pending],
        rngs: &mut [ChaCha8Rng],
    ) -> Result<Vec<Decided>>;
}

/// What a decider reads besides the rows: the model, the adapters and the action settings.
pub struct Step<'a> {
    /// The frozen base and tokenizer.
    pub model: &'a Model,
    /// The agents' adapters.
    pub manager: &'a MultiAdapterManager,
    /// `action:`.
    pub action: &'a ActionConfig,
}

/// A row waiting for an action: episode index, seat, prompt.
pub struct Pending {
    /// Index of the row's episode in the step's batch.
    pub episode: usize,
    /// The seat that must act.
    pub seat: SeatId,
    /// The seat's agent (whose adapter the row uses).
    pub agent: usize,
    /// The prompt's tokens.
    pub prompt_ids: Vec<u32>,
}

/// The action a row settled on, with what the agent wrote.
pub struct Decided {
    /// The action to step with (`None`: the episode ends, the `end_episode` fallback).
    pub action: Option<Action>,
    /// The prompt the reply was generated from, when it is not the turn's first one (a retry's
    /// prompt carries the note about the refused reply).
    pub retry_prompt: Option<Vec<u32>>,
    /// What the agent wrote (for a `choice` decision, the chosen action's tokens).
    pub completion_ids: Vec<u32>,
    /// The log-probabilities recorded at sampling ([`super::Turn::sampling_logprobs`]).
    pub sampling_logprobs: Vec<f32>,
    /// Whether the reply was not a legal action.
    pub invalid: bool,
    /// The `choice` decision's candidates and pick.
    pub choice: Option<ChoiceTurn>,
}

/// A uniformly random legal action of `seat`, if its action set is finite and non-empty.
pub(super) fn random_legal(env: &dyn Environment, seat: SeatId, rng: &mut ChaCha8Rng) -> Option<Action> {
    let ids = env.legal_action_ids(seat)?;
    (!ids.is_empty()).then(|| Action::Id(ids[rng.random_range(0..ids.len())]))
}

/// A fresh sampling seed for each of `rows` (indices into `pending`), drawn from its episode's
/// generator.
pub(super) fn row_seeds(pending: &[Pending], rows: impl Iterator<Item = usize>, rngs: &mut [ChaCha8Rng]) -> Vec<u64> {
    rows.map(|r| rngs[pending[r].episode].random()).collect()
}

/// The legal actions of `pending`'s seat, or an error naming `action.mode` when `mode` needs a
/// finite action set the environment does not have (writing, coding) or the seat has none.
pub(super) fn finite_legal_actions(
    envs: &[Box<dyn Environment>],
    p: &Pending,
    mode: ActionMode,
) -> Result<Vec<LegalAction>> {
    let env = envs[p.episode].as_ref();
    let legal = env.legal_actions(p.seat).ok_or_else(|| {
        TroupeError::setting(
            "action.mode",
            format!("`{mode}` mode needs finite legal actions; {} takes open-ended text (use `free`)", env.name()),
        )
    })?;
    if legal.is_empty() {
        return Err(TroupeError::setting(
            "action.mode",
            format!("`{mode}` mode: seat {} of {} must act but has no legal action", p.seat, env.name()),
        ));
    }
    Ok(legal)
}
