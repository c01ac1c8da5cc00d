//! Rollouts: many episodes advance together. At each step every seat that must act, in every
//! live episode, is one row of ONE batched generation (or scoring, in `choice` mode), each row on
//! its agent's adapter.
//!
//! Three action modes ([`ActionMode`]) turn an agent's text into an action:
//! - `free`: generate, parse with the environment's parser; an invalid reply costs a penalty and
//!   falls back as configured.
//! - `constrained`: decode only token sequences that spell one of the seat's legal actions
//!   ([`crate::generate::generate_constrained`]); never invalid, needs a finite action set.
//! - `choice`: score every legal action's text by its log-likelihood and sample one.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use troupe_envs::policy::Policy;
use troupe_envs::{Action, ActionError, Environment, LegalAction, Registry, SeatId};

use crate::adapters::MultiAdapterManager;
use crate::error::{Result, TroupeError};
use crate::generate::choice::{score_choices, ChoiceScore};
use crate::generate::{generate_rows, GenerateOptions, SamplingConfig, TokenTrie};
use crate::model::{ChatMessage, Model, ProjectionDelta};

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

/// Rollout settings.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutConfig {
    /// Free text, constrained decoding or choice among legal actions.
    pub mode: ActionMode,
    /// Reward added to a seat for each invalid reply (usually negative).
    pub invalid_penalty: f64,
    /// What replaces an invalid reply.
    pub fallback: Fallback,
    /// Re-asks after an invalid reply (with `Fallback::Retry`).
    pub max_retries: usize,
    /// Longest reply in `free` mode (a `constrained` reply always runs to the end of its action).
    pub max_new_tokens: usize,
    /// Sampling of replies (among the allowed tokens in `constrained` mode; the temperature of
    /// `choice` mode's softmax).
    pub sampling: SamplingConfig,
    /// Wrap prompts in the model's chat template when it has one.
    pub chat_template: bool,
    /// Episodes stop after this many environment steps.
    pub max_episode_steps: usize,
    /// In `choice` mode, how a legal action's token log-probs make its score (the policy is
    /// `softmax(score / temperature)`).
    pub choice_score: ChoiceScore,
}

/// One agent reply that went into the environment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// The seat that acted.
    pub seat: SeatId,
    /// Its agent.
    pub agent: usize,
    /// The prompt tokens the reply was generated from (for a retried reply, the retry's prompt
    /// with its note about the refused reply).
    pub prompt_ids: Vec<u32>,
    /// The reply tokens (what the policy loss trains on).
    pub completion_ids: Vec<u32>,
    /// The log-probabilities recorded when the reply was sampled, the quantity the trainer
    /// scores: one per reply token (`free`, `constrained`: the model's full next-token
    /// distribution, [`crate::generate::Generation::logprobs`]) or one for the decision
    /// (`choice`: `log pi(chosen)` under the choice policy). Importance ratios start from them.
    pub sampling_logprobs: Vec<f32>,
    /// The reward this seat got from the step this turn belongs to (penalty included).
    pub reward: f64,
    /// Whether the reply was not a legal action.
    pub invalid: bool,
    /// The invalid-reply penalty included in `reward` (0 for a valid reply).
    pub penalty: f64,
    /// The environment step (0-based) this reply acted in.
    pub step: usize,
    /// In `choice` mode: every candidate the policy chose among and which it took
    /// (`completion_ids` is then `candidates[chosen]`).
    pub choice: Option<ChoiceTurn>,
}

/// A `choice`-mode decision: the legal actions' token sequences and the one sampled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChoiceTurn {
    /// Each legal action's tokens, in the environment's order.
    pub candidates: Vec<Vec<u32>>,
    /// Index of the action taken.
    pub chosen: usize,
    /// Entropy (nats) of the policy's distribution over the candidates at this decision.
    pub entropy: f64,
}

/// A finished episode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpisodeRecord {
    /// The seed it was reset with.
    pub seed: u64,
    /// Every reply, in order.
    pub turns: Vec<Turn>,
    /// Each seat's environment return (penalties excluded).
    pub env_returns: Vec<f64>,
    /// The environment's metrics at the end.
    pub metrics: troupe_envs::EpisodeMetrics,
    /// Environment steps taken.
    pub steps: usize,
    /// `[step][seat]`: every seat's environment reward at every step (penalties excluded).
    pub step_rewards: Vec<Vec<f64>>,
}

impl EpisodeRecord {
    /// Invalid replies / replies.
    pub fn invalid_rate(&self) -> f64 {
        if self.turns.is_empty() {
            0.0
        } else {
            self.turns.iter().filter(|t| t.invalid).count() as f64 / self.turns.len() as f64
        }
    }
}

/// The prompt text for a seat: the environment's instructions and observation, in the model's
/// chat template when it has one and `chat_template` is on.
pub fn prompt_text(
    model: &Model,
    env: &dyn Environment,
    seat: SeatId,
    chat_template: bool,
    note: Option<&str>,
) -> Result<String> {
    let mut observation = env.observation(seat);
    if let Some(note) = note {
        observation.push_str("\n\n");
        observation.push_str(note);
    }
    chat_prompt(model, &env.instructions(seat), &observation, chat_template)
}

/// A prompt from a system and a user message: the model's chat template (with the generation
/// prompt) when it has one and `chat_template` is on, else the two joined by a blank line.
pub fn chat_prompt(model: &Model, system: &str, user: &str, chat_template: bool) -> Result<String> {
    if chat_template {
        let messages = [ChatMessage::new("system", system.to_string()), ChatMessage::new("user", user.to_string())];
        if let Some(text) = model.tokenizer.apply_chat_template(&messages, true)? {
            return Ok(text);
        }
    }
    Ok(format!("{system}\n\n{user}\n"))
}

/// A row waiting for an action: episode index, seat, prompt.
struct Pending {
    episode: usize,
    seat: SeatId,
    agent: usize,
    prompt_ids: Vec<u32>,
}

/// Where an acting seat's action comes from this step.
enum Source {
    /// Row `r` of the step's batch (an agent).
    Row(usize),
    /// A baseline policy, already decided.
    Baseline(Action),
}

/// The action a row settled on, with what the agent wrote.
struct Decided {
    action: Option<Action>,
    /// The prompt the reply was generated from, when it is not the turn's first one (a retry's
    /// prompt carries the note about the refused reply).
    retry_prompt: Option<Vec<u32>>,
    completion_ids: Vec<u32>,
    sampling_logprobs: Vec<f32>,
    invalid: bool,
    choice: Option<ChoiceTurn>,
}

/// Runs one episode per environment in `envs` (reset with `seeds[i]`) to the end, batching
/// every acting seat of every live episode into one generation per step. `seat_agents[s]` is
/// the agent of seat `s`. `rngs[i]` drives episode `i`'s sampling and fallbacks (one generator
/// per episode, see [`episode_rngs`]): an episode's replies do not depend on which other
/// episodes share its batches, so episodes split across processes play as in one batch.
pub fn run_episodes(
    model: &Model,
    manager: &MultiAdapterManager,
    envs: &mut [Box<dyn Environment>],
    seeds: &[u64],
    seat_agents: &[usize],
    config: &RolloutConfig,
    rngs: &mut [ChaCha8Rng],
) -> Result<Vec<EpisodeRecord>> {
    run_episodes_with_baselines(model, manager, envs, seeds, seat_agents, &mut BTreeMap::new(), config, rngs)
}

/// The generators of episodes `first..first + count` of a batch seeded with `seed`: one
/// `ChaCha8Rng` stream per episode index, so episode `i` draws the same numbers whether it is
/// played alone, in a slice, or with the whole batch.
pub fn episode_rngs(seed: u64, first: usize, count: usize) -> Vec<ChaCha8Rng> {
    (first..first + count)
        .map(|index| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(index as u64);
            rng
        })
        .collect()
}

/// [`run_episodes`] with some seats played by baseline policies (`baselines[seat]`) instead of
/// their agents, as `troupe eval` seats them. A baseline's moves are not agent turns: they get
/// no row in the batch and no [`Turn`] in the record.
#[allow(clippy::too_many_arguments)]
pub fn run_episodes_with_baselines(
    model: &Model,
    manager: &MultiAdapterManager,
    envs: &mut [Box<dyn Environment>],
    seeds: &[u64],
    seat_agents: &[usize],
    baselines: &mut BTreeMap<SeatId, Box<dyn Policy>>,
    config: &RolloutConfig,
    rngs: &mut [ChaCha8Rng],
) -> Result<Vec<EpisodeRecord>> {
    if envs.len() != seeds.len() {
        return Err(TroupeError::invalid("seeds", "one seed per environment"));
    }
    if envs.len() != rngs.len() {
        return Err(TroupeError::invalid("rngs", "one random generator per environment"));
    }
    let mut records: Vec<EpisodeRecord> = Vec::with_capacity(envs.len());
    troupe_envs::batch::reset_all(envs, seeds)?;
    for (env, &seed) in envs.iter().zip(seeds) {
        if seat_agents.len() < env.num_seats() {
            return Err(TroupeError::setting("agents.seats", format!("{} seats need an agent each", env.num_seats())));
        }
        records.push(EpisodeRecord {
            seed,
            turns: Vec::new(),
            env_returns: vec![0.0; env.num_seats()],
            metrics: Default::default(),
            steps: 0,
            step_rewards: Vec::new(),
        });
    }
    let mut ended = vec![false; envs.len()];
    loop {
        let mut pending = Vec::new();
        // Per live episode: each acting seat's action source, in acting order.
        let mut acting: Vec<(usize, Vec<Source>)> = Vec::new();
        for (i, env) in envs.iter().enumerate() {
            if ended[i] || env.is_terminal() || records[i].steps >= config.max_episode_steps {
                ended[i] = true;
                continue;
            }
            let mut sources = Vec::new();
            for seat in env.acting_seats() {
                if let Some(policy) = baselines.get_mut(&seat) {
                    let action = policy
                        .act(env.as_ref(), seat, &mut rngs[i])
                        .map_err(|e| TroupeError::setting(format!("eval.baseline_seats.{seat}"), e.to_string()))?;
                    sources.push(Source::Baseline(action));
                    continue;
                }
                let text = prompt_text(model, env.as_ref(), seat, config.chat_template, None)?;
                sources.push(Source::Row(pending.len()));
                pending.push(Pending {
                    episode: i,
                    seat,
                    agent: seat_agents[seat],
                    prompt_ids: model.tokenizer.encode(&text)?,
                });
            }
            if !sources.is_empty() {
                acting.push((i, sources));
            }
        }
        if acting.is_empty() {
            break;
        }
        let decided = match config.mode {
            _ if pending.is_empty() => Vec::new(),
            ActionMode::Free => decide_free(model, manager, envs, &pending, config, rngs)?,
            ActionMode::Constrained => decide_constrained(model, manager, envs, &pending, config, rngs)?,
            ActionMode::Choice => decide_choice(model, manager, envs, &pending, config, rngs)?,
        };
        // Every live episode's joint action, stepped together (an external environment's
        // episodes in one exchange).
        let joint: Vec<(usize, Option<Vec<Action>>)> = acting
            .iter()
            .map(|(episode, sources)| {
                let actions = sources
                    .iter()
                    .map(|s| match s {
                        Source::Row(r) => decided[*r].action.clone(),
                        Source::Baseline(action) => Some(action.clone()),
                    })
                    .collect();
                (*episode, actions)
            })
            .collect();
        let steps: Vec<(usize, Vec<Action>)> =
            joint.iter().filter_map(|(episode, actions)| actions.clone().map(|a| (*episode, a))).collect();
        let mut stepped = troupe_envs::batch::step_all(envs, &steps).into_iter();
        for ((episode, sources), (_, actions)) in acting.into_iter().zip(&joint) {
            let rows: Vec<usize> =
                sources.iter().filter_map(|s| if let Source::Row(r) = s { Some(*r) } else { None }).collect();
            let record = &mut records[episode];
            let outcome = if actions.is_some() { stepped.next() } else { None };
            let step_rewards = match outcome {
                Some(Ok(rewards)) => rewards,
                Some(Err(ActionError::Failed(message))) => {
                    return Err(TroupeError::env_step(envs[episode].name(), message));
                }
                // Every action sent was legal or read by the environment itself: a refusal is a
                // defect of the environment, never a quiet end of the episode.
                Some(Err(err)) => {
                    let sent =
                        actions.as_deref().unwrap_or_default().iter().map(ToString::to_string).collect::<Vec<_>>();
                    // An illegal-action error names the action itself: not said twice.
                    let what = match &err {
                        ActionError::Illegal { .. } => "refused an action".to_string(),
                        _ => format!("refused the joint action [{}]", sent.join(", ")),
                    };
                    return Err(TroupeError::env_step(
                        envs[episode].name(),
                        format!("{what} at step {} of the episode with seed {}: {err}", record.steps, record.seed),
                    ));
                }
                None => {
                    ended[episode] = true;
                    vec![0.0; record.env_returns.len()]
                }
            };
            let step = record.steps;
            record.steps += 1;
            for (seat, reward) in step_rewards.iter().enumerate() {
                record.env_returns[seat] += reward;
            }
            record.step_rewards.push(step_rewards.clone());
            for &r in &rows {
                let p = &pending[r];
                let d = &decided[r];
                let penalty = if d.invalid { config.invalid_penalty } else { 0.0 };
                record.turns.push(Turn {
                    seat: p.seat,
                    agent: p.agent,
                    prompt_ids: d.retry_prompt.clone().unwrap_or_else(|| p.prompt_ids.clone()),
                    completion_ids: d.completion_ids.clone(),
                    sampling_logprobs: d.sampling_logprobs.clone(),
                    reward: step_rewards.get(p.seat).copied().unwrap_or(0.0) + penalty,
                    invalid: d.invalid,
                    penalty,
                    step,
                    choice: d.choice.clone(),
                });
            }
        }
    }
    for (record, env) in records.iter_mut().zip(envs.iter()) {
        record.metrics = env.metrics();
    }
    Ok(records)
}

/// A uniformly random legal action of `seat`, if its action set is finite and non-empty.
fn random_legal(env: &dyn Environment, seat: SeatId, rng: &mut ChaCha8Rng) -> Option<Action> {
    let ids = env.legal_action_ids(seat)?;
    (!ids.is_empty()).then(|| Action::Id(ids[rng.random_range(0..ids.len())]))
}

/// Generation options for one batched reply: the config's sampling and length, stopping at EOS,
/// with the KV cache (each row's seed is drawn apart, [`row_seeds`]).
fn reply_options(config: &RolloutConfig) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: config.max_new_tokens,
        sampling: config.sampling.clone(),
        seed: 0,
        stop_at_eos: true,
        use_cache: true,
    }
}

/// A fresh sampling seed for each of `rows` (indices into `pending`), drawn from its episode's
/// generator.
fn row_seeds(pending: &[Pending], rows: impl Iterator<Item = usize>, rngs: &mut [ChaCha8Rng]) -> Vec<u64> {
    rows.map(|r| rngs[pending[r].episode].random()).collect()
}

/// `free` mode: one batched generation for all rows; invalid replies handled per the fallback.
fn decide_free(
    model: &Model,
    manager: &MultiAdapterManager,
    envs: &[Box<dyn Environment>],
    pending: &[Pending],
    config: &RolloutConfig,
    rngs: &mut [ChaCha8Rng],
) -> Result<Vec<Decided>> {
    let mut prompts: Vec<Vec<u32>> = pending.iter().map(|p| p.prompt_ids.clone()).collect();
    let mut decided: Vec<Option<Decided>> = (0..pending.len()).map(|_| None).collect();
    let mut todo: Vec<usize> = (0..pending.len()).collect();
    let retries = if config.fallback == Fallback::Retry { config.max_retries } else { 0 };
    for attempt in 0..=retries {
        let rows: Vec<Option<usize>> = todo.iter().map(|&r| Some(pending[r].agent)).collect();
        let (delta, _) = manager.mixed(&rows, false)?;
        let options = reply_options(config);
        let seeds = row_seeds(pending, todo.iter().copied(), rngs);
        let batch: Vec<Vec<u32>> = todo.iter().map(|&r| prompts[r].clone()).collect();
        let outputs = generate_rows(
            &model.lm,
            &model.tokenizer.eos_token_ids,
            &batch,
            &[],
            &options,
            &seeds,
            Some(&delta as &dyn ProjectionDelta),
        )?;
        let mut still = Vec::new();
        for (&r, out) in todo.iter().zip(outputs) {
            let p = &pending[r];
            let text = model.tokenizer.decode(&out.output_ids, true)?;
            match envs[p.episode].parse_action(p.seat, &text) {
                Ok(action) => {
                    decided[r] = Some(Decided {
                        action: Some(action),
                        retry_prompt: (attempt > 0).then(|| prompts[r].clone()),
                        completion_ids: out.output_ids,
                        sampling_logprobs: out.logprobs,
                        invalid: attempt > 0,
                        choice: None,
                    })
                }
                Err(ActionError::Failed(message)) => {
                    return Err(TroupeError::env_step(envs[p.episode].name(), message));
                }
                Err(err) if attempt < retries => {
                    let note = format!("Your reply {text:?} was not a legal action: {err}. Answer again.");
                    let prompt =
                        prompt_text(model, envs[p.episode].as_ref(), p.seat, config.chat_template, Some(&note))?;
                    prompts[r] = model.tokenizer.encode(&prompt)?;
                    still.push(r);
                }
                Err(_) => {
                    let action = match config.fallback {
                        Fallback::EndEpisode => None,
                        Fallback::Random | Fallback::Retry => {
                            random_legal(envs[p.episode].as_ref(), p.seat, &mut rngs[p.episode])
                        }
                    };
                    decided[r] = Some(Decided {
                        action,
                        retry_prompt: (attempt > 0).then(|| prompts[r].clone()),
                        completion_ids: out.output_ids,
                        sampling_logprobs: out.logprobs,
                        invalid: true,
                        choice: None,
                    });
                }
            }
        }
        todo = still;
        if todo.is_empty() {
            break;
        }
    }
    Ok(decided.into_iter().map(|d| d.expect("every row is decided by the last attempt")).collect())
}

/// The legal actions of `pending`'s seat, or an error naming `action.mode` when `mode` needs a
/// finite action set the environment does not have (writing, coding) or the seat has none.
fn finite_legal_actions(envs: &[Box<dyn Environment>], p: &Pending, mode: ActionMode) -> Result<Vec<LegalAction>> {
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

/// `constrained` mode: one batched generation of all rows, each row restricted to the token
/// sequences of its seat's legal actions. Each action's text is tokenised on its own (no special
/// tokens), as `choice` mode scores it, and the model's first EOS id is appended when it has
/// one: a reply ends the way a free reply does, so the loss also teaches the policy to stop after
/// an action, and an action whose tokens prefix another's stays reachable (its EOS decides).
///
/// The completion is the decoded tokens (the action's tokens and that EOS). The trainer scores
/// them with the unmasked model, as any other reply: the loss does not see the mask, so tokens
/// the trie forced (one legal continuation) are trained like sampled ones. The action is the
/// legal action whose text was spelled, and such a turn is never invalid.
fn decide_constrained(
    model: &Model,
    manager: &MultiAdapterManager,
    envs: &[Box<dyn Environment>],
    pending: &[Pending],
    config: &RolloutConfig,
    rngs: &mut [ChaCha8Rng],
) -> Result<Vec<Decided>> {
    let eos = model.tokenizer.eos_token_ids.first().copied();
    let mut legal_ids = Vec::with_capacity(pending.len());
    let mut tries = Vec::with_capacity(pending.len());
    for p in pending {
        let legal = finite_legal_actions(envs, p, ActionMode::Constrained)?;
        let mut sequences = Vec::with_capacity(legal.len());
        for action in &legal {
            let mut ids = model.tokenizer.encode(&action.text)?;
            ids.extend(eos);
            sequences.push(ids);
        }
        tries.push(TokenTrie::new(&sequences, eos)?);
        legal_ids.push(legal.into_iter().map(|a| a.id).collect::<Vec<_>>());
    }
    let agents: Vec<Option<usize>> = pending.iter().map(|p| Some(p.agent)).collect();
    let (delta, _) = manager.mixed(&agents, false)?;
    let options = reply_options(config);
    let seeds = row_seeds(pending, 0..pending.len(), rngs);
    let prompts: Vec<Vec<u32>> = pending.iter().map(|p| p.prompt_ids.clone()).collect();
    let constraints: Vec<Option<&TokenTrie>> = tries.iter().map(Some).collect();
    let outputs = generate_rows(
        &model.lm,
        &model.tokenizer.eos_token_ids,
        &prompts,
        &constraints,
        &options,
        &seeds,
        Some(&delta as &dyn ProjectionDelta),
    )?;
    Ok(outputs
        .into_iter()
        .zip(legal_ids)
        .map(|(out, ids)| {
            let picked = out.sequence.expect("a constrained row always completes a sequence");
            Decided {
                action: Some(Action::Id(ids[picked])),
                retry_prompt: None,
                completion_ids: out.output_ids,
                sampling_logprobs: out.logprobs,
                invalid: false,
                choice: None,
            }
        })
        .collect())
}

/// `choice` mode: every legal action's text is scored after its row's prompt, all rows in one
/// packed forward ([`score_choices`]: each prompt read once, its keys and values shared by all
/// its candidates), and an action is sampled from `softmax(log-likelihood / temperature)` (the
/// most likely at temperature 0). That distribution is the policy the trainer's choice
/// objective differentiates.
fn decide_choice(
    model: &Model,
    manager: &MultiAdapterManager,
    envs: &[Box<dyn Environment>],
    pending: &[Pending],
    config: &RolloutConfig,
    rngs: &mut [ChaCha8Rng],
) -> Result<Vec<Decided>> {
    let mut candidates: Vec<Vec<(u32, Vec<u32>)>> = Vec::with_capacity(pending.len());
    for p in pending {
        let legal = finite_legal_actions(envs, p, ActionMode::Choice)?;
        let mut list = Vec::with_capacity(legal.len());
        for action in legal {
            list.push((action.id, model.tokenizer.encode(&action.text)?));
        }
        candidates.push(list);
    }
    let token_lists: Vec<Vec<Vec<u32>>> =
        candidates.iter().map(|l| l.iter().map(|(_, ids)| ids.clone()).collect()).collect();
    let agents: Vec<Option<usize>> = pending.iter().map(|p| Some(p.agent)).collect();
    let (delta, _) = manager.mixed(&agents, false)?;
    let decisions: Vec<(&[u32], &[Vec<u32>])> =
        pending.iter().zip(&token_lists).map(|(p, c)| (p.prompt_ids.as_slice(), c.as_slice())).collect();
    let scores = score_choices(&model.lm, &decisions, config.choice_score, Some(&delta as &dyn ProjectionDelta))?;
    let temperature = config.sampling.temperature;
    let mut decided = Vec::with_capacity(pending.len());
    for (((list, tokens), likelihoods), p) in candidates.into_iter().zip(token_lists).zip(scores).zip(pending) {
        let pick = sample_choice(&likelihoods, temperature, &mut rngs[p.episode]);
        let entropy = choice_entropy(&likelihoods, temperature);
        decided.push(Decided {
            action: Some(Action::Id(list[pick].0)),
            retry_prompt: None,
            completion_ids: tokens[pick].clone(),
            sampling_logprobs: vec![choice_log_prob(&likelihoods, temperature, pick)],
            invalid: false,
            choice: Some(ChoiceTurn { candidates: tokens, chosen: pick, entropy }),
        });
    }
    Ok(decided)
}

/// `log softmax(scores / temperature)[pick]`, the choice policy's log-probability of `pick`
/// as the trainer computes it (`crate::generate::choice::choice_log_policy`: scores are divided
/// only at a positive temperature other than 1).
pub fn choice_log_prob(scores: &[f32], temperature: f32, pick: usize) -> f32 {
    let scale = |v: f32| {
        if temperature > 0.0 && temperature != 1.0 {
            f64::from(v) / f64::from(temperature)
        } else {
            f64::from(v)
        }
    };
    let max = scores.iter().map(|&v| scale(v)).fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = scores.iter().map(|&v| (scale(v) - max).exp()).sum();
    (scale(scores[pick]) - max - sum.ln()) as f32
}

/// Entropy (nats) of `softmax(scores / temperature)` (0 at temperature 0: the policy is greedy).
pub fn choice_entropy(scores: &[f32], temperature: f32) -> f64 {
    if temperature <= 0.0 {
        return 0.0;
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let weights: Vec<f64> = scores.iter().map(|&v| f64::from((v - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.iter().filter(|w| **w > 0.0).map(|w| -(w / total) * (w / total).ln()).sum()
}

/// Samples an index from `softmax(logliks / temperature)`; the most likely (first on ties) at
/// temperature 0.
pub fn sample_choice(logliks: &[f32], temperature: f32, rng: &mut ChaCha8Rng) -> usize {
    if temperature <= 0.0 {
        return logliks.iter().enumerate().fold(0, |best, (i, &v)| if v > logliks[best] { i } else { best });
    }
    let max = logliks.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let weights: Vec<f64> = logliks.iter().map(|&v| f64::from((v - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut draw = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if draw < *w {
            return i;
        }
        draw -= w;
    }
    weights.len() - 1
}

/// A fresh environment from a spec `{name: ..., <params>...}`; a bad spec is an error naming
/// `env`.
pub fn make_env(registry: &Registry, spec: &serde_json::Value) -> Result<Box<dyn Environment>> {
    Ok(registry.make_from_spec(spec)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::AdapterConfig;
    use crate::model::Preset;
    use burn::tensor::Device;

    fn setup() -> (Model, MultiAdapterManager, Vec<Box<dyn Environment>>) {
        let device = Device::flex();
        let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
        let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
        manager.create_adapters(2, &AdapterConfig::default()).unwrap();
        let registry = troupe_envs::Registry::with_builtins();
        let envs = (0..3).map(|_| registry.make("hanabi", &serde_json::json!({"players": 2})).unwrap()).collect();
        (model, manager, envs)
    }

    fn config(mode: ActionMode, fallback: Fallback) -> RolloutConfig {
        RolloutConfig {
            mode,
            invalid_penalty: -1.0,
            fallback,
            max_retries: 1,
            max_new_tokens: 6,
            sampling: SamplingConfig { temperature: 1.0, top_k: 0, top_p: 1.0 },
            chat_template: true,
            max_episode_steps: 4,
            choice_score: ChoiceScore::Sum,
        }
    }

    #[test]
    fn free_mode_batches_episodes_and_counts_invalid_replies() {
        let (model, manager, mut envs) = setup();
        let cfg = config(ActionMode::Free, Fallback::Random);
        let run = |envs: &mut [Box<dyn Environment>]| {
            let mut rngs = episode_rngs(5, 0, 3);
            run_episodes(&model, &manager, envs, &[1, 1, 2], &[0, 1], &cfg, &mut rngs).unwrap()
        };
        let a = run(&mut envs);
        assert_eq!(a.len(), 3);
        for record in &a {
            assert_eq!(record.steps, 4, "random fallback keeps the game going to the step limit");
            assert_eq!(record.turns.len(), 4);
            // Hanabi alternates seats; seat s is agent s.
            assert!(record.turns.iter().enumerate().all(|(i, t)| t.seat == i % 2 && t.agent == t.seat));
            for t in &record.turns {
                assert!(!t.prompt_ids.is_empty() && !t.completion_ids.is_empty());
                if t.invalid {
                    // A Hanabi step gives at most +1; the penalty is -1.
                    assert!(t.reward <= 1e-9, "penalty applied: {}", t.reward);
                }
            }
        }
        // An untrained tiny model rarely writes a legal move: the invalid rate is measured.
        assert!(a.iter().map(EpisodeRecord::invalid_rate).sum::<f64>() > 0.0);
        let b = run(&mut envs);
        let ids = |r: &[EpisodeRecord]| {
            r.iter().map(|e| e.turns.iter().map(|t| t.completion_ids.clone()).collect::<Vec<_>>()).collect::<Vec<_>>()
        };
        assert_eq!(ids(&a), ids(&b), "same seeds and rng: same rollouts");
    }

    #[test]
    fn episodes_split_across_batches_play_as_in_one_batch() {
        let (model, manager, _) = setup();
        let registry = troupe_envs::Registry::with_builtins();
        let seeds = [5, 5, 6];
        for mode in [ActionMode::Free, ActionMode::Constrained, ActionMode::Choice] {
            let cfg = RolloutConfig { max_episode_steps: 3, ..config(mode, Fallback::Random) };
            let play = |range: std::ops::Range<usize>| {
                let mut envs: Vec<Box<dyn Environment>> = range
                    .clone()
                    .map(|_| registry.make("hanabi", &serde_json::json!({"players": 2})).unwrap())
                    .collect();
                let mut rngs = episode_rngs(17, range.start, range.len());
                run_episodes(&model, &manager, &mut envs, &seeds[range], &[0, 1], &cfg, &mut rngs).unwrap()
            };
            let whole = play(0..3);
            let mut split = play(0..1);
            split.extend(play(1..3));
            let turns = |r: &[EpisodeRecord]| {
                r.iter()
                    .map(|e| e.turns.iter().map(|t| (t.completion_ids.clone(), t.invalid)).collect::<Vec<_>>())
                    .collect::<Vec<_>>()
            };
            assert_eq!(turns(&whole), turns(&split), "{mode}: a split plays the same episodes");
            for (a, b) in whole.iter().flat_map(|e| &e.turns).zip(split.iter().flat_map(|e| &e.turns)) {
                for (x, y) in a.sampling_logprobs.iter().zip(&b.sampling_logprobs) {
                    assert!((x - y).abs() < 1e-4, "{mode}: log-probs {x} vs {y}");
                }
            }
        }
        // Episodes 0 and 1 share a deal but not a random stream; a stream is its index's alone.
        let mut first = episode_rngs(17, 0, 3);
        let mut later = episode_rngs(17, 1, 2);
        let draws = |rngs: &mut [ChaCha8Rng]| rngs.iter_mut().map(|r| r.random::<u64>()).collect::<Vec<_>>();
        let (a, b) = (draws(&mut first), draws(&mut later));
        assert_ne!(a[0], a[1]);
        assert_eq!(&a[1..], &b[..]);
    }

    #[test]
    fn end_episode_fallback_stops_at_the_first_invalid_reply() {
        let (model, manager, mut envs) = setup();
        let cfg = config(ActionMode::Free, Fallback::EndEpisode);
        let mut rngs = episode_rngs(1, 0, 2);
        for record in run_episodes(&model, &manager, &mut envs[..2], &[3, 4], &[0, 1], &cfg, &mut rngs).unwrap() {
            if let Some(first_invalid) = record.turns.iter().position(|t| t.invalid) {
                assert_eq!(first_invalid, record.turns.len() - 1, "nothing after the invalid reply");
            }
        }
    }

    #[test]
    fn choice_mode_always_picks_a_legal_action() {
        let (model, manager, mut envs) = setup();
        let cfg = config(ActionMode::Choice, Fallback::Random);
        let cfg = RolloutConfig { max_episode_steps: 2, ..cfg };
        let mut rngs = episode_rngs(2, 0, 2);
        let records = run_episodes(&model, &manager, &mut envs[..2], &[7, 8], &[0, 1], &cfg, &mut rngs).unwrap();
        for record in records {
            // Three misplays end a Hanabi game early.
            assert!((1..=2).contains(&record.steps));
            assert_eq!(record.turns.len(), record.steps);
            assert!(record.turns.iter().all(|t| !t.invalid));
            assert_eq!(record.invalid_rate(), 0.0);
        }
    }

    #[test]
    fn constrained_mode_replies_always_spell_a_legal_action() {
        let (model, manager, mut envs) = setup();
        let cfg = RolloutConfig {
            max_episode_steps: 8,
            max_new_tokens: 1,
            ..config(ActionMode::Constrained, Fallback::EndEpisode)
        };
        let seeds = [11, 12, 13];
        let mut rngs = episode_rngs(9, 0, seeds.len());
        let records = run_episodes(&model, &manager, &mut envs, &seeds, &[0, 1], &cfg, &mut rngs).unwrap();
        let eos = model.tokenizer.eos_token_ids[0];
        let registry = troupe_envs::Registry::with_builtins();
        for record in &records {
            assert!(record.steps >= 1 && record.turns.len() == record.steps);
            assert_eq!(record.invalid_rate(), 0.0);
            // Replay: each completion is exactly one legal action's tokens plus EOS (longer than
            // max_new_tokens: constrained replies are not cut), and the free-text parser agrees.
            let mut env = registry.make("hanabi", &serde_json::json!({"players": 2})).unwrap();
            env.reset(record.seed);
            for turn in &record.turns {
                assert!(!turn.invalid && turn.completion_ids.len() > 1);
                assert_eq!(env.acting_seats(), vec![turn.seat]);
                let legal = env.legal_actions(turn.seat).unwrap();
                let spelled: Vec<&LegalAction> = legal
                    .iter()
                    .filter(|a| {
                        let mut ids = model.tokenizer.encode(&a.text).unwrap();
                        ids.push(eos);
                        ids == turn.completion_ids
                    })
                    .collect();
                assert_eq!(spelled.len(), 1, "one legal action spelled by {:?}", turn.completion_ids);
                let text = model.tokenizer.decode(&turn.completion_ids, true).unwrap();
                assert_eq!(env.parse_action(turn.seat, &text).unwrap(), Action::Id(spelled[0].id));
                env.step(&[Action::Id(spelled[0].id)]).unwrap();
            }
            assert_eq!(env.returns(), record.env_returns, "the replay reaches the same returns");
        }
        let distinct: std::collections::HashSet<_> =
            records.iter().flat_map(|r| r.turns.iter().map(|t| t.completion_ids.clone())).collect();
        assert!(distinct.len() > 3, "sampling varies the actions: {}", distinct.len());
    }

    #[test]
    fn constrained_mode_bids_legal_bridge_calls() {
        let (model, manager, _) = setup();
        let registry = troupe_envs::Registry::with_builtins();
        let mut envs = vec![registry.make("bridge", &serde_json::json!({})).unwrap()];
        let cfg = RolloutConfig { max_episode_steps: 6, ..config(ActionMode::Constrained, Fallback::EndEpisode) };
        let mut rngs = episode_rngs(4, 0, 1);
        let record =
            run_episodes(&model, &manager, &mut envs, &[21], &[0, 1, 0, 1], &cfg, &mut rngs).unwrap().remove(0);
        assert_eq!((record.steps, record.turns.len()), (6, 6), "every call was legal, so the auction went on");
        assert!(record
            .turns
            .iter()
            .enumerate()
            .all(|(i, t)| !t.invalid && t.agent == t.seat % 2 && t.seat == (record.turns[0].seat + i) % 4));
    }

    #[test]
    fn constrained_mode_needs_a_finite_action_set() {
        let (model, manager, _) = setup();
        let registry = troupe_envs::Registry::with_builtins();
        let mut envs = vec![registry.make("writing", &serde_json::json!({})).unwrap()];
        let cfg = config(ActionMode::Constrained, Fallback::Random);
        let mut rngs = episode_rngs(0, 0, 1);
        let err = run_episodes(&model, &manager, &mut envs, &[0], &[0, 1], &cfg, &mut rngs).unwrap_err().to_string();
        assert!(err.contains("action.mode") && err.contains("constrained") && err.contains("writing"), "{err}");
    }
}
