//! Rollouts: many episodes advance together. At each step every seat that must act, in every
//! live episode, is one row of ONE batched generation (or scoring, in `choice` mode), each row on
//! its agent's adapter.
//!
//! The action mode ([`ActionMode`], `action:` in the config) turns an agent's text into an
//! action; each mode is a [`Decider`] in its own file ([`free`], [`constrained`], [`choice`]),
//! chosen once per rollout, so this loop knows none of them by name.

pub mod action;
pub mod choice;
pub mod constrained;
pub mod free;
pub mod modes;
pub mod stats;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use troupe_envs::policy::Policy;
use troupe_envs::{Action, ActionError, Environment, Registry, SeatId};

use crate::adapters::MultiAdapterManager;
use crate::error::{Result, TroupeError};
use crate::model::{ChatMessage, Model};
pub use action::{ActionConfig, ActionMode, Decided, Decider, Fallback, Pending, Step};
pub use choice::{choice_entropy, choice_log_prob, sample_choice};

/// Rollout settings: the action settings (`action:`) and the step cap of episodes
/// (`training.max_episode_steps`, or `eval.max_episode_steps` in evaluation).
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutConfig {
    /// How agents' text becomes actions.
    pub action: ActionConfig,
    /// Episodes stop after this many environment steps.
    pub max_episode_steps: usize,
}

/// Where an acting seat's action comes from this step.
enum Source {
    /// Row `r` of the step's batch (an agent).
    Row(usize),
    /// A baseline policy, already decided.
    Baseline(Action),
}

/// One batch of episodes to play: the model, the adapters, which agent plays each seat, and
/// the rollout settings.
pub struct Rollout<'a> {
    /// The frozen base and tokenizer.
    pub model: &'a Model,
    /// The agents' adapters.
    pub manager: &'a MultiAdapterManager,
    /// `seat_agents[s]` is the agent of seat `s`.
    pub seat_agents: &'a [usize],
    /// The rollout settings.
    pub config: &'a RolloutConfig,
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
    if envs.len() != seeds.len() {
        return Err(TroupeError::invalid("seeds", "one seed per environment"));
    }
    Rollout { model, manager, seat_agents, config }.play(envs, seeds, &mut BTreeMap::new(), rngs)
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

impl Rollout<'_> {
    /// Plays one episode per seed of `seeds` with at most `slots.len()` games in flight: the
    /// games in `slots` advance together, every acting seat of every live game one row of one
    /// batched pass per step, and when a game ends its slot is reset with the next seed, so the
    /// batch stays full while games of different lengths finish. Seats in `baselines` are played
    /// by those policies instead of their agents, as `troupe eval` seats them; a baseline's
    /// moves are not agent turns (no row in the batch, no [`Turn`] in the record). `rngs[i]` is
    /// episode `i`'s generator whichever slot plays it, so the records (in seed order) are
    /// those of the same episodes played one at a time or all at once.
    pub fn play(
        &self,
        slots: &mut [Box<dyn Environment>],
        seeds: &[u64],
        baselines: &mut BTreeMap<SeatId, Box<dyn Policy>>,
        rngs: &mut [ChaCha8Rng],
    ) -> Result<Vec<EpisodeRecord>> {
        let Rollout { model, manager, seat_agents, config } = *self;
        let decider = config.action.mode.decider();
        let step = Step { model, manager, action: &config.action };
        if rngs.len() != seeds.len() {
            return Err(TroupeError::invalid("rngs", "one random generator per episode"));
        }
        if slots.is_empty() && !seeds.is_empty() {
            return Err(TroupeError::invalid("slots", "at least one environment to play the episodes in"));
        }
        let in_flight = slots.len().min(seeds.len());
        let envs = &mut slots[..in_flight];
        let mut records: Vec<EpisodeRecord> = seeds
            .iter()
            .map(|&seed| EpisodeRecord {
                seed,
                turns: Vec::new(),
                env_returns: Vec::new(),
                metrics: Default::default(),
                steps: 0,
                step_rewards: Vec::new(),
            })
            .collect();
        let start = |record: &mut EpisodeRecord, env: &dyn Environment| -> Result<()> {
            if seat_agents.len() < env.num_seats() {
                return Err(TroupeError::setting(
                    "agents.seats",
                    format!("{} seats need an agent each", env.num_seats()),
                ));
            }
            record.env_returns = vec![0.0; env.num_seats()];
            Ok(())
        };
        troupe_envs::batch::reset_all(envs, &seeds[..in_flight])?;
        for (record, env) in records.iter_mut().zip(envs.iter()) {
            start(record, env.as_ref())?;
        }
        // Slot `i` plays episode `episode_of[i]` with that episode's generator, `slot_rngs[i]`
        // (handed back to `rngs` when the episode ends).
        let mut episode_of: Vec<usize> = (0..in_flight).collect();
        let mut slot_rngs: Vec<ChaCha8Rng> = rngs[..in_flight].to_vec();
        let mut next = in_flight;
        // `stopped[i]`: slot i's episode was ended by a fallback; `idle[i]`: no episode left for it.
        let mut stopped = vec![false; in_flight];
        let mut idle = vec![false; in_flight];
        loop {
            for i in 0..in_flight {
                while !idle[i]
                    && (stopped[i] || envs[i].is_terminal() || records[episode_of[i]].steps >= config.max_episode_steps)
                {
                    records[episode_of[i]].metrics = envs[i].metrics();
                    rngs[episode_of[i]] = slot_rngs[i].clone();
                    stopped[i] = false;
                    if next == seeds.len() {
                        idle[i] = true;
                        break;
                    }
                    troupe_envs::batch::reset_one(envs[i].as_mut(), seeds[next])?;
                    start(&mut records[next], envs[i].as_ref())?;
                    slot_rngs[i] = rngs[next].clone();
                    episode_of[i] = next;
                    next += 1;
                }
            }
            let mut pending = Vec::new();
            // Per live slot: each acting seat's action source, in acting order.
            let mut acting: Vec<(usize, Vec<Source>)> = Vec::new();
            for (i, env) in envs.iter().enumerate() {
                if idle[i] {
                    continue;
                }
                let mut sources = Vec::new();
                for seat in env.acting_seats() {
                    if let Some(policy) = baselines.get_mut(&seat) {
                        let action = policy
                            .act(env.as_ref(), seat, &mut slot_rngs[i])
                            .map_err(|e| TroupeError::setting(format!("eval.baseline_seats.{seat}"), e.to_string()))?;
                        sources.push(Source::Baseline(action));
                        continue;
                    }
                    let text = prompt_text(model, env.as_ref(), seat, config.action.chat_template, None)?;
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
            let decided =
                if pending.is_empty() { Vec::new() } else { decider.decide(&step, envs, &pending, &mut slot_rngs)? };
            // Every live game's joint action, stepped together (an external environment's
            // games in one exchange).
            let joint: Vec<(usize, Option<Vec<Action>>)> = acting
                .iter()
                .map(|(slot, sources)| {
                    let actions = sources
                        .iter()
                        .map(|s| match s {
                            Source::Row(r) => decided[*r].action.clone(),
                            Source::Baseline(action) => Some(action.clone()),
                        })
                        .collect();
                    (*slot, actions)
                })
                .collect();
            let steps: Vec<(usize, Vec<Action>)> =
                joint.iter().filter_map(|(slot, actions)| actions.clone().map(|a| (*slot, a))).collect();
            let mut stepped = troupe_envs::batch::step_all(envs, &steps).into_iter();
            for ((slot, sources), (_, actions)) in acting.into_iter().zip(&joint) {
                let rows: Vec<usize> =
                    sources.iter().filter_map(|s| if let Source::Row(r) = s { Some(*r) } else { None }).collect();
                let record = &mut records[episode_of[slot]];
                let outcome = if actions.is_some() { stepped.next() } else { None };
                let step_rewards = match outcome {
                    Some(Ok(rewards)) => rewards,
                    Some(Err(ActionError::Failed(message))) => {
                        return Err(TroupeError::env_step(envs[slot].name(), message));
                    }
                    // Every action sent was legal or read by the environment itself: a refusal is
                    // a defect of the environment, never a quiet end of the episode.
                    Some(Err(err)) => {
                        let sent =
                            actions.as_deref().unwrap_or_default().iter().map(ToString::to_string).collect::<Vec<_>>();
                        // An illegal-action error names the action itself: not said twice.
                        let what = match &err {
                            ActionError::Illegal { .. } => "refused an action".to_string(),
                            _ => format!("refused the joint action [{}]", sent.join(", ")),
                        };
                        return Err(TroupeError::env_step(
                            envs[slot].name(),
                            format!("{what} at step {} of the episode with seed {}: {err}", record.steps, record.seed),
                        ));
                    }
                    None => {
                        stopped[slot] = true;
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
                    let penalty = if d.invalid { config.action.invalid_penalty } else { 0.0 };
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
        Ok(records)
    }
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
    use rand::Rng;
    use troupe_envs::LegalAction;

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
            action: ActionConfig {
                mode,
                invalid_penalty: -1.0,
                fallback,
                max_retries: 1,
                max_new_tokens: 6,
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                chat_template: true,
                choice_score: crate::generate::choice::ChoiceScore::Sum,
            },
            max_episode_steps: 4,
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
        let mut cfg = RolloutConfig { max_episode_steps: 8, ..config(ActionMode::Constrained, Fallback::EndEpisode) };
        cfg.action.max_new_tokens = 1;
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
