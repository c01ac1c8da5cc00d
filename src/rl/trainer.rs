//! `MagrpoTrainer`: one MAGRPO iteration = G rollouts from each of several starts, turn-level
//! group-relative advantages per agent, the token-weighted policy loss over every agent's
//! replies in mixed-adapter micro-batches, and one clipped AdamW step per agent that acted.
//!
//! Each agent's loss is the mean over its own generated tokens of `-advantage x log p`; the
//! total is the sum over agents (divided by the number of agents in shared mode, where all
//! agents train one adapter). Because each adapter only sees its own rows, the summed loss
//! gives every adapter exactly its own agent's gradient.

use std::collections::BTreeMap;
use std::time::Instant;

use burn::tensor::Tensor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe_envs::{Action, Environment, Registry};

use super::advantage::{mean_std, turn_advantages};
use super::loss::{policy_loss, TokenWeights};
use super::rewards::{RewardPipeline, SeatOutcome};
use super::rollout::{make_env, prompt_text, run_episodes, EpisodeRecord, RolloutConfig};
use crate::adapters::optim::{adapter_grads, grad_norm_squared, scale_grads, AdapterGrads};
use crate::adapters::{AdamWConfig, AdamWState, AdapterMode, MultiAdapterManager};
use crate::error::{Result, TroupeError};
use crate::generate::{next_token_logprobs, ScoringBatch};
use crate::model::Model;

/// The knobs of one training run that the iteration needs.
#[derive(Clone, Debug)]
pub struct TrainerSettings {
    /// The environment spec (`{name: ..., params...}`) every episode is built from.
    pub env_spec: serde_json::Value,
    /// Agent id of each seat.
    pub seat_agents: Vec<usize>,
    /// Rollouts per start (G).
    pub group_size: usize,
    /// Starts (groups) per iteration.
    pub groups_per_iteration: usize,
    /// How replies become actions.
    pub rollout: RolloutConfig,
    /// AdamW (its `lr` is the peak learning rate).
    pub adamw: AdamWConfig,
    /// Linear warm-up of the learning rate over this many iterations.
    pub warmup_iterations: u64,
    /// Per-agent gradient-norm clip (0: none).
    pub max_grad_norm: f64,
    /// Divide advantages by the group std.
    pub normalize_std: bool,
    /// Discount of multi-turn returns.
    pub gamma: f64,
    /// Weight of the KL penalty to the base model (adapters switched off); 0 skips it.
    pub kl_coef: f64,
    /// Reward functions and processors applied to every seat's episode.
    pub rewards: RewardPipeline,
    /// Supervised warm-up on the action format before the first iteration.
    pub format_warmup: FormatWarmup,
    /// Rows per forward/backward micro-batch.
    pub micro_batch_rows: usize,
    /// Run seed (rollouts, dropout, starts).
    pub seed: u64,
}

/// Supervised warm-up on the action format, run once before the first MAGRPO iteration: each
/// agent's adapter is trained by next-token cross-entropy to answer its seats' prompts with the
/// text of a uniformly random legal action (then EOS), on states from games played by that
/// random policy. The targets carry no strategy (every legal action is equally likely), only
/// the format, so a model that starts by writing noise (the built-in one, which is random)
/// gets free-mode replies the parser accepts, and with them a learning signal; which actions
/// are good is left to MAGRPO. Needs an environment with finite legal action sets.
#[derive(Clone, Debug, PartialEq)]
pub struct FormatWarmup {
    /// Optimizer steps (0: no warm-up).
    pub steps: usize,
    /// Prompts per step.
    pub batch_size: usize,
    /// AdamW learning rate (constant; its moments are discarded afterwards).
    pub lr: f64,
}

impl Default for FormatWarmup {
    fn default() -> Self {
        Self { steps: 0, batch_size: 16, lr: 1e-3 }
    }
}

/// What one iteration did.
#[derive(Clone, Debug, PartialEq)]
pub struct IterationStats {
    /// 1-based iteration number.
    pub iteration: u64,
    /// Per agent: mean and std over episodes of the agent's summed rewards (penalties included).
    pub mean_return: BTreeMap<usize, f64>,
    /// Per agent: std of the same.
    pub std_return: BTreeMap<usize, f64>,
    /// Mean environment score (the env's `score` metric) over episodes.
    pub mean_score: f64,
    /// Invalid replies / replies.
    pub invalid_rate: f64,
    /// The policy loss.
    pub loss: f64,
    /// Per adapter name: gradient norm before clipping (adapters that got none are absent).
    pub grad_norm: BTreeMap<String, f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Generated tokens per second of rollout.
    pub rollout_tokens_per_second: f64,
    /// Wall time of the iteration.
    pub seconds: f64,
    /// Mean per-token KL estimate (k3) to the base model, when `kl_coef` > 0.
    pub kl: Option<f64>,
    /// Mean environment steps per episode.
    pub mean_episode_steps: f64,
}

/// The trainer: a model, the agents' adapters, their optimizer states, the iteration count.
pub struct MagrpoTrainer {
    /// The frozen base and tokenizer.
    pub model: Model,
    /// The agents' adapters.
    pub manager: MultiAdapterManager,
    /// Per adapter name: AdamW state.
    pub optimizer_states: BTreeMap<String, AdamWState>,
    /// Iterations done.
    pub iteration: u64,
    /// The run's random stream: each iteration draws its own seed from it (rollouts,
    /// sampling, fallbacks, dropout), so saving it with a checkpoint makes resuming exact.
    pub rng: ChaCha8Rng,
    settings: TrainerSettings,
    registry: Registry,
}

/// What one backward pass over an iteration's samples produced.
struct BackwardPass {
    grads: BTreeMap<String, AdapterGrads>,
    loss: f64,
    kl_sum: f64,
    kl_tokens: usize,
    tokens_per_agent: BTreeMap<usize, usize>,
}

/// Prefixes a non-finite error's message with where it happened.
fn label_non_finite(err: TroupeError, place: &str) -> TroupeError {
    match err {
        TroupeError::NonFinite { message } => TroupeError::NonFinite { message: format!("{place}: {message}") },
        other => other,
    }
}

/// One reply to train on.
struct Sample {
    agent: usize,
    tokens: Vec<u32>,
    prompt_len: usize,
    advantage: f64,
}

impl MagrpoTrainer {
    /// A trainer over `model` and `manager`, building environments from `registry`.
    pub fn new(model: Model, manager: MultiAdapterManager, registry: Registry, settings: TrainerSettings) -> Result<Self> {
        if settings.group_size < 2 {
            return Err(TroupeError::invalid("group_size", "a group needs at least 2 rollouts"));
        }
        for (seat, agent) in settings.seat_agents.iter().enumerate() {
            manager.adapter_name(*agent).map_err(|_| TroupeError::invalid("seat_agents", format!("seat {seat} maps to agent {agent}, which has no adapter")))?;
        }
        make_env(&registry, &settings.env_spec)?;
        let rng = ChaCha8Rng::seed_from_u64(settings.seed);
        Ok(Self { model, manager, optimizer_states: BTreeMap::new(), iteration: 0, rng, settings, registry })
    }

    /// The settings the trainer was built with.
    pub fn settings(&self) -> &TrainerSettings {
        &self.settings
    }

    /// The learning rate of iteration `iteration` (1-based): linear warm-up, then constant.
    pub fn learning_rate(&self, iteration: u64) -> f64 {
        let peak = self.settings.adamw.lr;
        match self.settings.warmup_iterations {
            0 => peak,
            w => peak * (iteration.min(w) as f64 / w as f64),
        }
    }

    /// Plays the iteration's rollouts: `groups_per_iteration` starts x `group_size` episodes,
    /// all randomness drawn from `rng`.
    fn rollouts(&self, rng: &mut ChaCha8Rng) -> Result<Vec<Vec<EpisodeRecord>>> {
        let s = &self.settings;
        let starts: Vec<u64> = (0..s.groups_per_iteration).map(|_| rng.random()).collect();
        let mut envs = Vec::with_capacity(starts.len() * s.group_size);
        let mut seeds = Vec::with_capacity(envs.capacity());
        for &start in &starts {
            for _ in 0..s.group_size {
                envs.push(make_env(&self.registry, &s.env_spec)?);
                seeds.push(start);
            }
        }
        let records = run_episodes(&self.model, &self.manager, &mut envs, &seeds, &s.seat_agents, &s.rollout, rng)?;
        let mut groups = Vec::with_capacity(starts.len());
        let mut it = records.into_iter();
        for _ in 0..starts.len() {
            groups.push(it.by_ref().take(s.group_size).collect());
        }
        Ok(groups)
    }

    /// Turns groups of episodes into weighted samples: per agent, each of its turns gets its
    /// discounted return-to-go (of the shaped rewards, [`shaped_turn_rewards`]) against the
    /// group's at the same turn.
    fn samples(&self, groups: &[Vec<EpisodeRecord>], shaped: &[Vec<Vec<f64>>]) -> Vec<Sample> {
        let mut samples = Vec::new();
        let agents: Vec<usize> = {
            let mut a = self.settings.seat_agents.clone();
            a.sort_unstable();
            a.dedup();
            a
        };
        for (group, group_rewards) in groups.iter().zip(shaped) {
            for &agent in &agents {
                let rewards: Vec<Vec<f64>> = group
                    .iter()
                    .zip(group_rewards)
                    .map(|(e, r)| e.turns.iter().zip(r).filter(|(t, _)| t.agent == agent).map(|(_, r)| *r).collect())
                    .collect();
                let advantages = turn_advantages(&rewards, self.settings.gamma, self.settings.normalize_std);
                for (episode, adv) in group.iter().zip(advantages) {
                    for (turn, a) in episode.turns.iter().filter(|t| t.agent == agent).zip(adv) {
                        if turn.completion_ids.is_empty() {
                            continue;
                        }
                        let mut tokens = turn.prompt_ids.clone();
                        tokens.extend_from_slice(&turn.completion_ids);
                        samples.push(Sample { agent, tokens, prompt_len: turn.prompt_ids.len(), advantage: a });
                    }
                }
            }
        }
        samples
    }

    /// The summed gradients of the token-weighted loss over `samples` (each agent's loss a
    /// mean over its own completion tokens), in micro-batches of mixed-adapter rows, plus the
    /// KL penalty to the base model when `kl_coef` > 0. Nothing is updated.
    fn backward_samples(&self, samples: &[Sample], seed: u64, kl_coef: f64) -> Result<BackwardPass> {
        let mut tokens_per_agent: BTreeMap<usize, usize> = BTreeMap::new();
        for s in samples {
            *tokens_per_agent.entry(s.agent).or_default() += s.tokens.len() - s.prompt_len;
        }
        let shared_divisor = match self.manager.mode() {
            AdapterMode::Shared => tokens_per_agent.len().max(1) as f64,
            AdapterMode::PerAgent => 1.0,
        };
        let mut grads: BTreeMap<String, AdapterGrads> = BTreeMap::new();
        let mut loss_total = 0.0;
        let (mut kl_sum, mut kl_tokens) = (0.0f64, 0usize);
        let micro = self.settings.micro_batch_rows.max(1);
        for (chunk_index, chunk) in samples.chunks(micro).enumerate() {
            let rows: Vec<Option<usize>> = chunk.iter().map(|s| Some(s.agent)).collect();
            let (delta, used) = self.manager.mixed_for_training(&rows, seed ^ chunk_index as u64)?;
            let tokens: Vec<Vec<u32>> = chunk.iter().map(|s| s.tokens.clone()).collect();
            let batch = ScoringBatch::new(&self.model.lm, &tokens)?;
            let logprobs = next_token_logprobs(&self.model.lm, &batch, Some(&delta))?;
            let positions = logprobs.dims()[1];
            let per_agent = |s: &Sample, x: f64| (x / (tokens_per_agent[&s.agent] as f64 * shared_divisor)) as f32;
            let weights: Vec<f32> = chunk.iter().map(|s| per_agent(s, s.advantage)).collect();
            let prompt_len: Vec<usize> = chunk.iter().map(|s| s.prompt_len).collect();
            let token_weights = TokenWeights::for_completions(&prompt_len, &batch.lengths, &weights, positions);
            // policy_loss divides by the chunk's token count; the weights are already normalised.
            let mut loss = policy_loss(logprobs.clone(), &token_weights, None, token_weights.num_tokens() as f64)?;
            if kl_coef > 0.0 {
                // The base model is the reference: the same rows with every adapter off. Per
                // agent, the mean over its tokens of k3 = exp(ref - logp) - (ref - logp) - 1.
                let reference = next_token_logprobs(&self.model.lm, &batch, None)?.detach();
                let kl_weights: Vec<f32> = chunk.iter().map(|s| per_agent(s, kl_coef)).collect();
                let per_token = TokenWeights::for_completions(&prompt_len, &batch.lengths, &kl_weights, positions);
                let (weight, mask) = per_token.tensors(&logprobs.device());
                let diff = reference - logprobs;
                let k3: Tensor<2> = diff.clone().exp() - diff - 1.0;
                kl_sum += f64::from((k3.clone().detach() * mask).sum().into_scalar::<f32>());
                kl_tokens += per_token.num_tokens();
                loss = loss + (k3 * weight).sum();
            }
            let value: f32 = loss.clone().into_scalar();
            if !value.is_finite() {
                return Err(TroupeError::NonFinite { message: format!("the loss is {value}; stopped before any update") });
            }
            loss_total += f64::from(value);
            let backward = loss.backward();
            for (name, adapter) in &used {
                if let Some(g) = adapter_grads(adapter, &backward) {
                    let summed = match grads.remove(name) {
                        None => g,
                        Some(acc) => acc.into_iter().map(|(site, (a, b))| (site, (a + g[&site].0.clone(), b + g[&site].1.clone()))).collect(),
                    };
                    grads.insert(name.clone(), summed);
                }
            }
        }
        Ok(BackwardPass { grads, loss: loss_total, kl_sum, kl_tokens, tokens_per_agent })
    }

    /// One clipped AdamW step per adapter in `grads` at learning rate `lr`, with moments in
    /// `states`. Every norm is checked before any adapter moves, so a non-finite gradient
    /// changes nothing. Returns the norms before clipping.
    fn apply_grads(&mut self, grads: BTreeMap<String, AdapterGrads>, lr: f64, states: &mut BTreeMap<String, AdamWState>) -> Result<BTreeMap<String, f64>> {
        let mut grad_norm = BTreeMap::new();
        for (name, g) in &grads {
            let norm = grad_norm_squared(g).sqrt();
            if !norm.is_finite() {
                return Err(TroupeError::NonFinite { message: format!("adapter {name} has a non-finite gradient ({norm}); stopped before any update") });
            }
            grad_norm.insert(name.clone(), norm);
        }
        for (name, g) in grads {
            let norm = grad_norm[&name];
            let g = if self.settings.max_grad_norm > 0.0 && norm > self.settings.max_grad_norm {
                scale_grads(g, self.settings.max_grad_norm / norm)
            } else {
                g
            };
            let agent = self
                .manager
                .agent_ids()
                .into_iter()
                .find(|a| self.manager.adapter_name(*a).map(|n| n == name).unwrap_or(false))
                .expect("every trained adapter belongs to an agent");
            let state = states.entry(name).or_default();
            let updated = self.settings.adamw.step(self.manager.adapter(agent)?, &g, state, lr);
            self.manager.set_adapter(agent, updated)?;
        }
        Ok(grad_norm)
    }

    /// The supervised format warm-up ([`FormatWarmup`]); returns each step's mean negative
    /// log-likelihood per target token (averaged over agents). Its randomness comes from the
    /// run's stream, so a resumed run repeats it exactly.
    pub fn format_warmup(&mut self) -> Result<Vec<f64>> {
        let warmup = self.settings.format_warmup.clone();
        if warmup.steps == 0 {
            return Ok(Vec::new());
        }
        let mut rng = ChaCha8Rng::seed_from_u64(self.rng.random());
        let eos = self.model.tokenizer.eos_token_ids.first().copied();
        let mut envs: Vec<(Box<dyn Environment>, usize)> = Vec::with_capacity(warmup.batch_size);
        for _ in 0..warmup.batch_size.max(1) {
            let mut env = make_env(&self.registry, &self.settings.env_spec)?;
            env.reset(rng.random());
            envs.push((env, 0));
        }
        let mut states = BTreeMap::new();
        let mut nll = Vec::with_capacity(warmup.steps);
        for step in 0..warmup.steps {
            let mut samples = Vec::with_capacity(envs.len());
            for (env, steps) in envs.iter_mut() {
                if env.is_terminal() || *steps >= self.settings.rollout.max_episode_steps {
                    env.reset(rng.random());
                    *steps = 0;
                }
                let mut actions = Vec::new();
                for seat in env.acting_seats() {
                    let legal = env.legal_actions(seat).filter(|l| !l.is_empty()).ok_or_else(|| {
                        TroupeError::invalid("training.format_warmup_steps", format!("the format warm-up needs finite legal actions; {} has none", env.name()))
                    })?;
                    let pick = &legal[rng.random_range(0..legal.len())];
                    let prompt = prompt_text(&self.model, env.as_ref(), seat, self.settings.rollout.chat_template, None)?;
                    let mut tokens = self.model.tokenizer.encode(&prompt)?;
                    let prompt_len = tokens.len();
                    tokens.extend(self.model.tokenizer.encode(&pick.text)?);
                    tokens.extend(eos);
                    samples.push(Sample { agent: self.settings.seat_agents[seat], tokens, prompt_len, advantage: 1.0 });
                    actions.push(Action::Id(pick.id));
                }
                env.step(&actions).map_err(|e| TroupeError::invalid("format warm-up", e.to_string()))?;
                *steps += 1;
            }
            let agents = samples.iter().map(|s| s.agent).collect::<std::collections::BTreeSet<_>>().len().max(1);
            let place = format!("format warm-up step {}", step + 1);
            let pass = self.backward_samples(&samples, rng.random(), 0.0).map_err(|e| label_non_finite(e, &place))?;
            nll.push(pass.loss / agents as f64);
            tracing::debug!(step = step + 1, nll = pass.loss / agents as f64, "format warm-up");
            self.apply_grads(pass.grads, warmup.lr, &mut states).map_err(|e| label_non_finite(e, &place))?;
        }
        Ok(nll)
    }

    /// Runs one iteration: rollouts, advantages, loss, one step per adapter that got rows.
    pub fn step(&mut self) -> Result<IterationStats> {
        let started = Instant::now();
        let iteration = self.iteration + 1;
        let iteration_seed: u64 = self.rng.random();
        let mut rollout_rng = ChaCha8Rng::seed_from_u64(iteration_seed);
        let groups = self.rollouts(&mut rollout_rng)?;
        let rollout_seconds = started.elapsed().as_secs_f64();
        let episodes: Vec<&EpisodeRecord> = groups.iter().flatten().collect();
        let generated: usize = episodes.iter().flat_map(|e| &e.turns).map(|t| t.completion_ids.len()).sum();
        let shaped: Vec<Vec<Vec<f64>>> = groups
            .iter()
            .map(|g| g.iter().map(|e| shaped_turn_rewards(e, &self.settings.rewards)).collect::<Result<Vec<_>>>())
            .collect::<Result<_>>()?;
        let samples = self.samples(&groups, &shaped);

        let pass = self.backward_samples(&samples, iteration_seed, self.settings.kl_coef)
            .map_err(|e| label_non_finite(e, &format!("iteration {iteration}")))?;
        let lr = self.learning_rate(iteration);
        let mut states = std::mem::take(&mut self.optimizer_states);
        let updated = self.apply_grads(pass.grads, lr, &mut states);
        self.optimizer_states = states;
        let grad_norm = updated.map_err(|e| label_non_finite(e, &format!("iteration {iteration}")))?;
        let tokens_per_agent = pass.tokens_per_agent;
        let (loss_total, kl_sum, kl_tokens) = (pass.loss, pass.kl_sum, pass.kl_tokens);
        self.iteration = iteration;

        let mut mean_return = BTreeMap::new();
        let mut std_return = BTreeMap::new();
        for &agent in tokens_per_agent.keys().chain(self.settings.seat_agents.iter()) {
            let returns: Vec<f64> = episodes
                .iter()
                .zip(shaped.iter().flatten())
                .map(|(e, r)| e.turns.iter().zip(r).filter(|(t, _)| t.agent == agent).map(|(_, r)| *r).sum())
                .collect();
            let (m, s) = mean_std(&returns);
            mean_return.insert(agent, m);
            std_return.insert(agent, s);
        }
        let turns: usize = episodes.iter().map(|e| e.turns.len()).sum();
        let invalid: usize = episodes.iter().map(|e| e.turns.iter().filter(|t| t.invalid).count()).sum();
        let scores: Vec<f64> = episodes.iter().map(|e| e.metrics.get("score").copied().unwrap_or(0.0)).collect();
        let steps: Vec<f64> = episodes.iter().map(|e| e.steps as f64).collect();
        Ok(IterationStats {
            iteration,
            mean_return,
            std_return,
            mean_score: mean_std(&scores).0,
            invalid_rate: if turns == 0 { 0.0 } else { invalid as f64 / turns as f64 },
            loss: loss_total,
            grad_norm,
            lr,
            rollout_tokens_per_second: generated as f64 / rollout_seconds.max(1e-9),
            seconds: started.elapsed().as_secs_f64(),
            kl: (self.settings.kl_coef > 0.0).then(|| kl_sum / kl_tokens.max(1) as f64),
            mean_episode_steps: mean_std(&steps).0,
        })
    }
}

/// The reward of every turn of `episode`, in turn order, under the configured pipeline.
///
/// Per seat, each turn gets `w_env x (its step reward, invalid penalty included)` plus
/// `-w_invalid` when the reply was invalid; the seat's last turn also gets `w_score x score` and
/// the difference the processors make to the seat's total, so a seat's turn rewards sum to its
/// processed episode reward while step-level credit survives (with identity processors and
/// `env_return` alone, the turn rewards are exactly the step rewards).
pub fn shaped_turn_rewards(episode: &EpisodeRecord, pipeline: &RewardPipeline) -> Result<Vec<f64>> {
    use super::rewards::RewardFunction;
    let weight = |f: RewardFunction| pipeline.functions().iter().filter(|w| w.name == f).map(|w| w.weight).sum::<f64>();
    let (w_env, w_invalid) = (weight(RewardFunction::EnvReturn), weight(RewardFunction::InvalidActions));
    let mut rewards: Vec<f64> = episode
        .turns
        .iter()
        .map(|t| w_env * t.reward - if t.invalid { w_invalid } else { 0.0 })
        .collect();
    let seats: std::collections::BTreeSet<usize> = episode.turns.iter().map(|t| t.seat).collect();
    for seat in seats {
        let turns: Vec<usize> = (0..episode.turns.len()).filter(|&i| episode.turns[i].seat == seat).collect();
        let env_return: f64 = turns.iter().map(|&i| episode.turns[i].reward).sum();
        let invalid_actions = turns.iter().filter(|&&i| episode.turns[i].invalid).count();
        let outcome = SeatOutcome { env_return, invalid_actions, metrics: &episode.metrics };
        let processed = pipeline.reward(&outcome)?;
        let so_far: f64 = turns.iter().map(|&i| rewards[i]).sum();
        let last = *turns.last().expect("a seat in the list has a turn");
        rewards[last] += processed - so_far;
    }
    Ok(rewards)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::AdapterConfig;
    use crate::generate::SamplingConfig;
    use crate::model::Preset;
    use crate::rl::rollout::{ActionMode, Fallback};
    use burn::tensor::Device;

    fn trainer(seat_agents: Vec<usize>, agents: usize) -> MagrpoTrainer {
        let device = Device::flex();
        let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
        let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
        manager.create_adapters(agents, &AdapterConfig { r: 4, lora_alpha: 8.0, ..AdapterConfig::default() }).unwrap();
        let settings = TrainerSettings {
            env_spec: serde_json::json!({"name": "hanabi", "players": 2}),
            seat_agents,
            group_size: 2,
            groups_per_iteration: 1,
            rollout: RolloutConfig {
                mode: ActionMode::Choice,
                invalid_penalty: -1.0,
                fallback: Fallback::Random,
                max_retries: 0,
                max_new_tokens: 4,
                sampling: SamplingConfig { temperature: 1.0, top_k: 0, top_p: 1.0 },
                chat_template: false,
                max_episode_steps: 2,
            },
            adamw: AdamWConfig { lr: 1e-2, ..AdamWConfig::default() },
            warmup_iterations: 2,
            max_grad_norm: 1.0,
            normalize_std: true,
            gamma: 1.0,
            kl_coef: 0.0,
            rewards: RewardPipeline::new(vec![crate::rl::rewards::WeightedReward { name: crate::rl::rewards::RewardFunction::EnvReturn, weight: 1.0 }], vec![]).unwrap(),
            format_warmup: FormatWarmup::default(),
            micro_batch_rows: 2,
            seed: 3,
        };
        MagrpoTrainer::new(model, manager, Registry::with_builtins(), settings).unwrap()
    }

    #[test]
    fn an_agent_that_never_acts_keeps_its_adapter_byte_identical() {
        // Agent 0 plays both seats; agent 1 never acts.
        let mut t = trainer(vec![0, 0], 2);
        let idle_before = t.manager.adapter(1).unwrap().to_host();
        let active_before = t.manager.adapter(0).unwrap().to_host();
        let stats = t.step().unwrap();
        assert_eq!(stats.iteration, 1);
        assert!((stats.lr - 5e-3).abs() < 1e-12, "warm-up: half the peak at iteration 1 of 2");
        assert_eq!(t.manager.adapter(1).unwrap().to_host(), idle_before);
        assert!(!t.optimizer_states.contains_key("agent_1"), "no optimizer state for an idle agent");
        if stats.grad_norm.contains_key("agent_0") {
            assert_ne!(t.manager.adapter(0).unwrap().to_host(), active_before, "the acting agent learned");
        }
    }

    #[test]
    fn iterations_are_deterministic() {
        let run = || {
            let mut t = trainer(vec![0, 1], 2);
            let stats = t.step().unwrap();
            (stats.loss, t.manager.adapter(0).unwrap().to_host(), t.manager.adapter(1).unwrap().to_host())
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn seats_must_map_to_agents_with_adapters() {
        let device = Device::flex();
        let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
        let manager = MultiAdapterManager::new(&model.lm.config, &device);
        let settings = trainer(vec![0, 1], 2).settings.clone();
        let err = MagrpoTrainer::new(model, manager, Registry::with_builtins(), settings).err().unwrap().to_string();
        assert!(err.contains("seat 0 maps to agent 0"), "{err}");
    }
}
