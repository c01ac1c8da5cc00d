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
use troupe_envs::{Action, Environment, Registry, RewardFn, RewardInput};

use super::advantage::{estimate_turn_advantages, mean_std, scale_by_batch_std, AdvantageBaseline, RewardScaling};
use super::external_reward::{ExternalRewards, RewardItem};
use super::flops::FlopModel;
use super::loss::{k3_estimate, policy_loss, TokenWeights};
use super::rewards::{RewardFunction, RewardPipeline, SeatOutcome};
use super::rollout::{make_env, prompt_text, run_episodes, ChoiceTurn, EpisodeRecord, RolloutConfig};
use crate::adapters::optim::{adapter_grads, grad_norm_squared, scale_grads, AdapterGrads};
use crate::adapters::{AdamWConfig, AdamWState, AdapterMode, MultiAdapterManager};
use crate::error::{Result, TroupeError};
use crate::generate::choice::{candidate_logliks, choice_log_policy, chosen_indices, PackedChoices};
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
    /// The learning rate at iteration `total_iterations`, as a fraction of the peak.
    pub lr_final_fraction: f64,
    /// The run's length, over which the learning rate decays.
    pub total_iterations: u64,
    /// Per-agent gradient-norm clip (0: none).
    pub max_grad_norm: f64,
    /// The group baseline of the advantages.
    pub advantage: AdvantageBaseline,
    /// Which std divides the advantages.
    pub scale_rewards: RewardScaling,
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
    /// Wall time of each phase: `rollout` (generation or scoring, environments, rewards),
    /// `update` (the policy loss's forward and backward passes) and `optimizer` (clipping and
    /// AdamW).
    pub phase_seconds: BTreeMap<String, f64>,
    /// Useful floating-point work of the `rollout` and `update` phases ([`super::flops`]).
    pub phase_flops: BTreeMap<String, f64>,
    /// The mean over episodes of every metric the environment reports.
    pub env_metrics: BTreeMap<String, f64>,
    /// In `choice` mode, the policy's mean entropy (nats) over the decisions.
    pub choice_entropy: Option<f64>,
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
    external_rewards: ExternalRewards,
    /// The registered reward functions the pipeline lists, in order.
    registered_rewards: Vec<RewardFn>,
}

/// What one backward pass over an iteration's samples produced.
struct BackwardPass {
    grads: BTreeMap<String, AdapterGrads>,
    /// Useful FLOPs of the forward and backward passes run.
    flops: f64,
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
    /// Prompt then reply (for a `choice` decision, the prompt alone).
    tokens: Vec<u32>,
    prompt_len: usize,
    advantage: f64,
    /// A `choice` decision: the policy is the softmax over these candidates.
    choice: Option<ChoiceTurn>,
}

impl Sample {
    /// What the loss averages over for this sample: its reply tokens, or one decision.
    fn units(&self) -> usize {
        if self.choice.is_some() {
            1
        } else {
            self.tokens.len() - self.prompt_len
        }
    }
}

impl MagrpoTrainer {
    /// A trainer over `model` and `manager`, building environments from `registry`.
    pub fn new(
        model: Model,
        manager: MultiAdapterManager,
        registry: Registry,
        settings: TrainerSettings,
    ) -> Result<Self> {
        if settings.group_size < 2 {
            return Err(TroupeError::invalid("group_size", "a group needs at least 2 rollouts"));
        }
        for (seat, agent) in settings.seat_agents.iter().enumerate() {
            manager.adapter_name(*agent).map_err(|_| {
                TroupeError::invalid("seat_agents", format!("seat {seat} maps to agent {agent}, which has no adapter"))
            })?;
        }
        make_env(&registry, &settings.env_spec)?;
        let rng = ChaCha8Rng::seed_from_u64(settings.seed);
        let mut registered_rewards = Vec::new();
        for function in settings.rewards.functions() {
            if let RewardFunction::Registered(name) = &function.name {
                let found = registry.reward(name).ok_or_else(|| {
                    TroupeError::invalid("rewards.functions", format!("no reward function {name:?} is registered"))
                })?;
                registered_rewards.push(found);
            }
        }
        let external_rewards = ExternalRewards::start(&settings.rewards)?;
        Ok(Self {
            model,
            manager,
            optimizer_states: BTreeMap::new(),
            iteration: 0,
            rng,
            settings,
            registry,
            external_rewards,
            registered_rewards,
        })
    }

    /// The settings the trainer was built with.
    pub fn settings(&self) -> &TrainerSettings {
        &self.settings
    }

    /// The registry environments are built from.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The learning rate of iteration `iteration` (1-based): linear warm-up, then linear decay
    /// to `lr_final_fraction` of the peak at the run's last iteration (constant when 1).
    pub fn learning_rate(&self, iteration: u64) -> f64 {
        let s = &self.settings;
        let peak = s.adamw.lr;
        let w = s.warmup_iterations;
        if iteration < w {
            return peak * iteration as f64 / w as f64;
        }
        // Linear from the peak (at the warm-up's end) to `lr_final_fraction` of it at the end.
        let span = s.total_iterations.saturating_sub(w.max(1));
        let progress = if span == 0 { 0.0 } else { (iteration.saturating_sub(w.max(1))) as f64 / span as f64 };
        peak * (1.0 - (1.0 - s.lr_final_fraction) * progress.min(1.0))
    }

    /// The computed reward functions' values for `episodes`, `[episode][seat][function]` in the
    /// pipeline's order: registered functions called per seat, external ones with one exchange
    /// per function (empty lists when there is none).
    fn computed_reward_values(&self, episodes: &[&EpisodeRecord]) -> Result<Vec<Vec<Vec<f64>>>> {
        if self.external_rewards.is_empty() && self.registered_rewards.is_empty() {
            return Ok(episodes.iter().map(|e| vec![Vec::new(); e.env_returns.len()]).collect());
        }
        let decode = |ids: &[u32]| self.model.tokenizer.decode(ids, true);
        // Only external functions are sent the prompts; registered ones read completions alone.
        let with_prompts = !self.external_rewards.is_empty();
        let mut items = Vec::with_capacity(episodes.len());
        for episode in episodes {
            let seats = episode.env_returns.len();
            let (mut completions, mut prompts) = (vec![Vec::new(); seats], vec![Vec::new(); seats]);
            for turn in episode.turns.iter().filter(|t| t.seat < seats) {
                completions[turn.seat].push(decode(&turn.completion_ids)?);
                if with_prompts {
                    prompts[turn.seat].push(decode(&turn.prompt_ids)?);
                }
            }
            items.push(RewardItem {
                seed: episode.seed,
                completions,
                prompts,
                returns: episode.env_returns.clone(),
                metrics: episode.metrics.clone(),
            });
        }
        let external = self.external_rewards.score(&items)?;
        let mut values = Vec::with_capacity(items.len());
        for ((item, episode), external) in items.iter().zip(episodes).zip(external) {
            let mut per_seat = Vec::with_capacity(item.returns.len());
            for (seat, external) in external.into_iter().enumerate() {
                let invalid_actions = episode.turns.iter().filter(|t| t.seat == seat && t.invalid).count();
                let input = RewardInput {
                    seat,
                    env_return: item.returns[seat],
                    invalid_actions,
                    metrics: &item.metrics,
                    completions: &item.completions[seat],
                };
                let (mut external, mut registered) = (external.into_iter(), self.registered_rewards.iter());
                let mut seat_values = Vec::new();
                for function in self.settings.rewards.computed_functions() {
                    let value = match function.name {
                        RewardFunction::External => external.next(),
                        _ => registered.next().map(|f| f(&input)),
                    };
                    let value = value.ok_or_else(|| {
                        TroupeError::invalid("rewards.functions", format!("`{}` gave no value", function.name.name()))
                    })?;
                    if !value.is_finite() {
                        return Err(TroupeError::invalid(
                            "rewards.functions",
                            format!("reward function `{}` gave {value} for seat {seat}", function.name.name()),
                        ));
                    }
                    seat_values.push(value);
                }
                per_seat.push(seat_values);
            }
            values.push(per_seat);
        }
        Ok(values)
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
    /// seat's discounted return-to-go (`returns`, from [`turn_returns`]) against the group's at
    /// the agent's same turn index (`training.advantage`), scaled by `training.scale_rewards`.
    fn samples(&self, groups: &[Vec<EpisodeRecord>], returns: &[Vec<Vec<f64>>]) -> Vec<Sample> {
        let mut samples = Vec::new();
        let agents: std::collections::BTreeSet<usize> = self.settings.seat_agents.iter().copied().collect();
        for (group, group_returns) in groups.iter().zip(returns) {
            for &agent in &agents {
                let per_episode: Vec<Vec<f64>> = group
                    .iter()
                    .zip(group_returns)
                    .map(|(e, r)| e.turns.iter().zip(r).filter(|(t, _)| t.agent == agent).map(|(_, g)| *g).collect())
                    .collect();
                let advantages =
                    estimate_turn_advantages(&per_episode, self.settings.advantage, self.settings.scale_rewards);
                for (episode, adv) in group.iter().zip(advantages) {
                    for (turn, a) in episode.turns.iter().filter(|t| t.agent == agent).zip(adv) {
                        if turn.completion_ids.is_empty() {
                            continue;
                        }
                        let mut tokens = turn.prompt_ids.clone();
                        if turn.choice.is_none() {
                            tokens.extend_from_slice(&turn.completion_ids);
                        }
                        samples.push(Sample {
                            agent,
                            tokens,
                            prompt_len: turn.prompt_ids.len(),
                            advantage: a,
                            choice: turn.choice.clone(),
                        });
                    }
                }
            }
        }
        if self.settings.scale_rewards == RewardScaling::Batch {
            for &agent in &agents {
                let mut advantages: Vec<f64> =
                    samples.iter().filter(|s| s.agent == agent).map(|s| s.advantage).collect();
                scale_by_batch_std(&mut advantages);
                for (sample, a) in samples.iter_mut().filter(|s| s.agent == agent).zip(advantages) {
                    sample.advantage = a;
                }
            }
        }
        samples
    }

    /// The summed gradients of the policy loss over `samples`, in micro-batches of
    /// mixed-adapter rows, plus the KL penalty to the base model when `kl_coef` > 0. Nothing is
    /// updated. Each agent's loss is a mean over its own units: reply tokens weighted by their
    /// sample's advantage (`-A log p(token)`), or, for `choice` decisions, `-A log pi(a)` with
    /// `pi = softmax(log-likelihood / temperature)` over the decision's candidates, so every
    /// candidate's tokens get gradient through the normaliser.
    fn backward_samples(&self, samples: &[Sample], seed: u64, kl_coef: f64) -> Result<BackwardPass> {
        let mut units_per_agent: BTreeMap<usize, usize> = BTreeMap::new();
        for s in samples {
            *units_per_agent.entry(s.agent).or_default() += s.units();
        }
        let shared_divisor = match self.manager.mode() {
            AdapterMode::Shared => units_per_agent.len().max(1) as f64,
            AdapterMode::PerAgent => 1.0,
        };
        let per_agent = |s: &Sample, x: f64| (x / (units_per_agent[&s.agent] as f64 * shared_divisor)) as f32;
        let mut pass = BackwardPass {
            grads: BTreeMap::new(),
            flops: 0.0,
            loss: 0.0,
            kl_sum: 0.0,
            kl_tokens: 0,
            tokens_per_agent: BTreeMap::new(),
        };
        let micro = self.settings.micro_batch_rows.max(1);
        // Every sample is scored, even one with zero advantage: its log-probs are what reveal a
        // diverged (non-finite) adapter before any update.
        let (choices, replies): (Vec<&Sample>, Vec<&Sample>) = samples.iter().partition(|s| s.choice.is_some());
        // Forward, then a backward of twice its work; the KL reference is one more forward.
        let passes = 3.0 + if kl_coef > 0.0 { 1.0 } else { 0.0 };
        pass.flops = passes * choices.iter().chain(&replies).map(|s| self.sample_flops(s)).sum::<f64>();
        for (chunk_index, chunk) in replies.chunks(micro).enumerate() {
            let rows: Vec<Option<usize>> = chunk.iter().map(|s| Some(s.agent)).collect();
            let (delta, used) = self.manager.mixed_for_training(&rows, seed ^ chunk_index as u64)?;
            let tokens: Vec<Vec<u32>> = chunk.iter().map(|s| s.tokens.clone()).collect();
            let batch = ScoringBatch::new(&self.model.lm, &tokens)?;
            let logprobs = next_token_logprobs(&self.model.lm, &batch, Some(&delta))?;
            let positions = logprobs.dims()[1];
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
                let k3 = k3_estimate(reference, logprobs);
                pass.kl_sum += f64::from((k3.clone().detach() * mask).sum().into_scalar::<f32>());
                pass.kl_tokens += per_token.num_tokens();
                loss = loss + (k3 * weight).sum();
            }
            self.accumulate(&mut pass, loss, &used)?;
        }
        let temperature = f64::from(self.settings.rollout.sampling.temperature);
        for (chunk_index, chunk) in choices.chunks(micro).enumerate() {
            let rows: Vec<Option<usize>> = chunk.iter().map(|s| Some(s.agent)).collect();
            let (delta, used) = self.manager.mixed_for_training(&rows, seed ^ (1 << 32) ^ chunk_index as u64)?;
            let decisions: Vec<(&[u32], &[Vec<u32>])> = chunk
                .iter()
                .map(|s| (&s.tokens[..s.prompt_len], s.choice.as_ref().expect("choice samples").candidates.as_slice()))
                .collect();
            let packed = PackedChoices::new(&self.model.lm, &decisions)?;
            let score = self.settings.rollout.choice_score;
            let log_policy =
                choice_log_policy(candidate_logliks(&self.model.lm, &packed, score, Some(&delta))?, temperature);
            let device = log_policy.device();
            let chosen: Vec<usize> = chunk.iter().map(|s| s.choice.as_ref().expect("choice samples").chosen).collect();
            let taken = log_policy.clone().gather(1, chosen_indices(&chosen, &device));
            let weights: Vec<f32> = chunk.iter().map(|s| per_agent(s, s.advantage)).collect();
            let weights = Tensor::<2>::from_data(burn::tensor::TensorData::new(weights, [chunk.len(), 1]), &device);
            let mut loss = (taken * weights).sum().neg();
            if kl_coef > 0.0 {
                // The exact KL(pi || pi_base) over the candidates, pi_base with every adapter off.
                let reference =
                    choice_log_policy(candidate_logliks(&self.model.lm, &packed, score, None)?, temperature).detach();
                let kl = (log_policy.clone().exp() * (log_policy - reference)).sum_dim(1);
                pass.kl_sum += f64::from(kl.clone().detach().sum().into_scalar::<f32>());
                pass.kl_tokens += chunk.len();
                let kl_weights: Vec<f32> = chunk.iter().map(|s| per_agent(s, kl_coef)).collect();
                let kl_weights =
                    Tensor::<2>::from_data(burn::tensor::TensorData::new(kl_weights, [chunk.len(), 1]), &device);
                loss = loss + (kl * kl_weights).sum();
            }
            self.accumulate(&mut pass, loss, &used)?;
        }
        pass.tokens_per_agent = units_per_agent;
        Ok(pass)
    }

    /// Forward FLOPs of one sample's scoring.
    fn sample_flops(&self, s: &Sample) -> f64 {
        let model = FlopModel::new(&self.model.lm.config);
        match &s.choice {
            Some(choice) => {
                model.packed_choice(s.prompt_len, &choice.candidates.iter().map(Vec::len).collect::<Vec<_>>())
            }
            None => model.causal(s.tokens.len(), s.tokens.len() - s.prompt_len),
        }
    }

    /// Checks `loss`, adds it to `pass` and its gradients to the adapters' sums.
    fn accumulate(
        &self,
        pass: &mut BackwardPass,
        loss: Tensor<1>,
        used: &BTreeMap<String, crate::adapters::LoraAdapter>,
    ) -> Result<()> {
        let value: f32 = loss.clone().into_scalar();
        if !value.is_finite() {
            return Err(TroupeError::NonFinite { message: format!("the loss is {value}; stopped before any update") });
        }
        pass.loss += f64::from(value);
        let backward = loss.backward();
        for (name, adapter) in used {
            if let Some(g) = adapter_grads(adapter, &backward) {
                let summed = match pass.grads.remove(name) {
                    None => g,
                    Some(acc) => acc
                        .into_iter()
                        .map(|(site, (a, b))| (site, (a + g[&site].0.clone(), b + g[&site].1.clone())))
                        .collect(),
                };
                pass.grads.insert(name.clone(), summed);
            }
        }
        Ok(())
    }

    /// One clipped AdamW step per adapter in `grads` at learning rate `lr`, with moments in
    /// `states`. Every norm is checked before any adapter moves, so a non-finite gradient
    /// changes nothing. Returns the norms before clipping.
    fn apply_grads(
        &mut self,
        grads: BTreeMap<String, AdapterGrads>,
        lr: f64,
        states: &mut BTreeMap<String, AdamWState>,
    ) -> Result<BTreeMap<String, f64>> {
        let mut grad_norm = BTreeMap::new();
        for (name, g) in &grads {
            let norm = grad_norm_squared(g).sqrt();
            if !norm.is_finite() {
                return Err(TroupeError::NonFinite {
                    message: format!("adapter {name} has a non-finite gradient ({norm}); stopped before any update"),
                });
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
                        TroupeError::invalid(
                            "training.format_warmup_steps",
                            format!("the format warm-up needs finite legal actions; {} has none", env.name()),
                        )
                    })?;
                    let pick = &legal[rng.random_range(0..legal.len())];
                    let prompt =
                        prompt_text(&self.model, env.as_ref(), seat, self.settings.rollout.chat_template, None)?;
                    let mut tokens = self.model.tokenizer.encode(&prompt)?;
                    let prompt_len = tokens.len();
                    tokens.extend(self.model.tokenizer.encode(&pick.text)?);
                    tokens.extend(eos);
                    samples.push(Sample {
                        agent: self.settings.seat_agents[seat],
                        tokens,
                        prompt_len,
                        advantage: 1.0,
                        choice: None,
                    });
                    actions.push(Action::Id(pick.id));
                }
                env.step(&actions).map_err(|e| TroupeError::invalid("format warm-up", e.to_string()))?;
                *steps += 1;
            }
            let agents = samples.iter().map(|s| s.agent).collect::<std::collections::BTreeSet<_>>().len().max(1);
            let place = format!("format warm-up step {}", step + 1);
            let pass = self.backward_samples(&samples, rng.random(), 0.0).map_err(|e| label_non_finite(e, &place))?;
            nll.push(pass.loss / agents as f64);
            if (step + 1) % (warmup.steps / 10).max(1) == 0 || step + 1 == warmup.steps {
                tracing::info!(
                    "format warm-up step {}/{}: nll {:.3}",
                    step + 1,
                    warmup.steps,
                    pass.loss / agents as f64
                );
            }
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
        let computed = self.computed_reward_values(&episodes)?;
        let mut computed = computed.iter();
        let shaped: Vec<Vec<Vec<Vec<f64>>>> = groups
            .iter()
            .map(|g| {
                g.iter()
                    .map(|e| {
                        shaped_step_rewards(e, &self.settings.rewards, computed.next().map_or(&[][..], Vec::as_slice))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let returns: Vec<Vec<Vec<f64>>> = groups
            .iter()
            .zip(&shaped)
            .map(|(g, s)| g.iter().zip(s).map(|(e, r)| turn_returns(e, r, self.settings.gamma)).collect())
            .collect();
        let samples = self.samples(&groups, &returns);
        let backward_started = Instant::now();

        let pass = self
            .backward_samples(&samples, iteration_seed, self.settings.kl_coef)
            .map_err(|e| label_non_finite(e, &format!("iteration {iteration}")))?;
        let update_seconds = backward_started.elapsed().as_secs_f64();
        let update_flops = pass.flops;
        let flop_model = FlopModel::new(&self.model.lm.config);
        let rollout_flops: f64 = episodes
            .iter()
            .flat_map(|e| &e.turns)
            .map(|t| match &t.choice {
                Some(c) => {
                    flop_model.packed_choice(t.prompt_ids.len(), &c.candidates.iter().map(Vec::len).collect::<Vec<_>>())
                }
                None => flop_model.causal(t.prompt_ids.len() + t.completion_ids.len(), t.completion_ids.len()),
            })
            .sum();
        let optimizer_started = Instant::now();
        let lr = self.learning_rate(iteration);
        let mut states = std::mem::take(&mut self.optimizer_states);
        let updated = self.apply_grads(pass.grads, lr, &mut states);
        self.optimizer_states = states;
        let grad_norm = updated.map_err(|e| label_non_finite(e, &format!("iteration {iteration}")))?;
        let optimizer_seconds = optimizer_started.elapsed().as_secs_f64();
        let tokens_per_agent = pass.tokens_per_agent;
        let (loss_total, kl_sum, kl_tokens) = (pass.loss, pass.kl_sum, pass.kl_tokens);
        self.iteration = iteration;

        let mut mean_return = BTreeMap::new();
        let mut std_return = BTreeMap::new();
        for &agent in tokens_per_agent.keys().chain(self.settings.seat_agents.iter()) {
            // An agent's return: the summed shaped rewards of the seats it plays.
            let returns: Vec<f64> = shaped
                .iter()
                .flatten()
                .map(|per_seat| {
                    per_seat
                        .iter()
                        .enumerate()
                        .filter(|(seat, _)| self.settings.seat_agents.get(*seat) == Some(&agent))
                        .map(|(_, r)| r.iter().sum::<f64>())
                        .sum()
                })
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
            phase_seconds: [("rollout", rollout_seconds), ("update", update_seconds), ("optimizer", optimizer_seconds)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            phase_flops: [("rollout".to_string(), rollout_flops), ("update".to_string(), update_flops)]
                .into_iter()
                .collect(),
            choice_entropy: {
                let entropies: Vec<f64> = episodes
                    .iter()
                    .flat_map(|e| &e.turns)
                    .filter_map(|t| t.choice.as_ref().map(|c| c.entropy))
                    .collect();
                (!entropies.is_empty()).then(|| mean_std(&entropies).0)
            },
            env_metrics: {
                let names: std::collections::BTreeSet<&String> =
                    episodes.iter().flat_map(|e| e.metrics.keys()).collect();
                names
                    .into_iter()
                    .map(|name| {
                        let values: Vec<f64> =
                            episodes.iter().map(|e| e.metrics.get(name).copied().unwrap_or(0.0)).collect();
                        (name.clone(), mean_std(&values).0)
                    })
                    .collect()
            },
        })
    }
}

/// Every seat's reward at every step of `episode` under the configured pipeline: `[seat][step]`.
/// `external[seat]` holds the external reward functions' values for the seat (empty when the
/// pipeline has none).
///
/// A seat's reward at a step is `w_env x (its environment reward there)`, plus at its own turns
/// `w_env x (the invalid-reply penalty)` and `-w_invalid` for an invalid reply; the episode's last
/// step also gets the difference the `score` function and the processors make to the seat's
/// total, so a seat's rewards sum to its processed episode reward while step-level credit
/// survives. Every seat sees every step, so in a cooperative game a seat is credited with what
/// its partners score after its move (with identity processors and `env_return` alone, a seat's
/// rewards are exactly its environment rewards plus penalties).
pub fn shaped_step_rewards(
    episode: &EpisodeRecord,
    pipeline: &RewardPipeline,
    external: &[Vec<f64>],
) -> Result<Vec<Vec<f64>>> {
    let weight = |f: RewardFunction| pipeline.functions().iter().filter(|w| w.name == f).map(|w| w.weight).sum::<f64>();
    let (w_env, w_invalid) = (weight(RewardFunction::EnvReturn), weight(RewardFunction::InvalidActions));
    let seats = episode.env_returns.len();
    let steps = episode.step_rewards.len();
    let mut rewards: Vec<Vec<f64>> = (0..seats)
        .map(|seat| episode.step_rewards.iter().map(|r| w_env * r.get(seat).copied().unwrap_or(0.0)).collect())
        .collect();
    let mut env_return: Vec<f64> =
        (0..seats).map(|seat| episode.step_rewards.iter().map(|r| r.get(seat).copied().unwrap_or(0.0)).sum()).collect();
    let mut invalid = vec![0usize; seats];
    for turn in &episode.turns {
        if turn.seat < seats && turn.step < steps {
            rewards[turn.seat][turn.step] += w_env * turn.penalty - if turn.invalid { w_invalid } else { 0.0 };
            env_return[turn.seat] += turn.penalty;
            invalid[turn.seat] += usize::from(turn.invalid);
        }
    }
    if steps > 0 {
        for seat in 0..seats {
            let values = external.get(seat).map_or(&[][..], Vec::as_slice);
            let outcome = SeatOutcome {
                env_return: env_return[seat],
                invalid_actions: invalid[seat],
                metrics: &episode.metrics,
                computed: values,
            };
            let processed = pipeline.reward(&outcome)?;
            let so_far: f64 = rewards[seat].iter().sum();
            rewards[seat][steps - 1] += processed - so_far;
        }
    }
    Ok(rewards)
}

/// Each turn's discounted return-to-go, in turn order: the acting seat's shaped rewards
/// (`shaped[seat][step]`, from [`shaped_step_rewards`]) from the turn's step on, discounted by
/// `gamma` per environment step.
pub fn turn_returns(episode: &EpisodeRecord, shaped: &[Vec<f64>], gamma: f64) -> Vec<f64> {
    let to_go: Vec<Vec<f64>> = shaped.iter().map(|r| super::advantage::discounted_returns(r, gamma)).collect();
    episode.turns.iter().map(|t| to_go.get(t.seat).and_then(|r| r.get(t.step)).copied().unwrap_or(0.0)).collect()
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
                choice_score: crate::generate::choice::ChoiceScore::Sum,
            },
            adamw: AdamWConfig { lr: 1e-2, ..AdamWConfig::default() },
            warmup_iterations: 2,
            lr_final_fraction: 1.0,
            total_iterations: 10,
            max_grad_norm: 1.0,
            advantage: AdvantageBaseline::Mean,
            scale_rewards: RewardScaling::Group,
            gamma: 1.0,
            kl_coef: 0.0,
            rewards: RewardPipeline::new(
                vec![crate::rl::rewards::WeightedReward::builtin(crate::rl::rewards::RewardFunction::EnvReturn, 1.0)],
                vec![],
            )
            .unwrap(),
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
    fn the_learning_rate_warms_up_then_decays_linearly() {
        let mut t = trainer(vec![0, 1], 2);
        t.settings.lr_final_fraction = 0.1;
        t.settings.total_iterations = 12;
        let lr: Vec<f64> = (1..=12).map(|i| t.learning_rate(i) / 1e-2).collect();
        assert!((lr[0] - 0.5).abs() < 1e-12, "warm-up: half the peak at iteration 1 of 2");
        assert!((lr[1] - 1.0).abs() < 1e-12, "the peak when the warm-up ends");
        assert!((lr[11] - 0.1).abs() < 1e-12, "the final fraction at the last iteration");
        assert!((lr[6] - (1.0 - 0.9 * 5.0 / 10.0)).abs() < 1e-12, "linear in between");
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

    /// Host values of every gradient tensor of one adapter, in site order.
    fn flat(grads: &AdapterGrads) -> Vec<f32> {
        grads
            .values()
            .flat_map(|(a, b)| [a, b])
            .flat_map(|t| t.clone().into_data().try_into_vec::<f32>().unwrap())
            .collect()
    }

    #[test]
    fn the_choice_policy_gradient_includes_the_normaliser() {
        // One decision between two actions. The loss is -A log pi(a0) with pi = softmax(s / T),
        // s = the candidates' scores (mean log-prob per token), so its gradient is
        // -A / T (grad s(a0) - pi(a0) grad s(a0) - pi(a1) grad s(a1)): both candidates' tokens
        // get gradient. Hand-compose that from each candidate's own score gradient.
        let mut t = trainer(vec![0, 1], 2);
        t.settings.rollout.sampling.temperature = 0.7;
        t.settings.rollout.choice_score = crate::generate::choice::ChoiceScore::Mean;
        // A non-zero B so that every factor has a gradient.
        let mut adapter = t.manager.adapter(0).unwrap().clone();
        for pair in adapter.pairs.values_mut() {
            pair.b = pair.b.clone().add_scalar(0.01);
        }
        t.manager.set_adapter(0, adapter).unwrap();
        let enc = |text: &str| t.model.tokenizer.encode(text).unwrap();
        let prompt = enc("Hanabi 2p. You are P0. Your turn.");
        let candidates = vec![enc("play 1 [?1]"), enc("hint red [R1 R3]")];
        let advantage = 1.5;
        let sample = Sample {
            agent: 0,
            tokens: prompt.clone(),
            prompt_len: prompt.len(),
            advantage,
            choice: Some(ChoiceTurn { candidates: candidates.clone(), chosen: 0, entropy: 0.0 }),
        };
        let pass = t.backward_samples(&[sample], 0, 0.0).unwrap();
        let got = flat(&pass.grads["agent_0"]);

        let score_grad = |k: usize| -> (f32, Vec<f32>) {
            let (delta, used) = t.manager.mixed_for_training(&[Some(0)], 0).unwrap();
            let decisions: Vec<(&[u32], &[Vec<u32>])> = vec![(prompt.as_slice(), candidates.as_slice())];
            let packed = PackedChoices::new(&t.model.lm, &decisions).unwrap();
            let scores =
                candidate_logliks(&t.model.lm, &packed, crate::generate::choice::ChoiceScore::Mean, Some(&delta))
                    .unwrap();
            let s_k = scores.narrow(1, k, 1).sum();
            let value: f32 = s_k.clone().into_scalar();
            let grads = s_k.backward();
            (value, flat(&adapter_grads(&used["agent_0"], &grads).unwrap()))
        };
        let (s0, g0) = score_grad(0);
        let (s1, g1) = score_grad(1);
        let temperature = 0.7f32;
        let (e0, e1) = ((s0 / temperature).exp(), (s1 / temperature).exp());
        let (p0, p1) = (e0 / (e0 + e1), e1 / (e0 + e1));
        let expected: Vec<f32> =
            g0.iter().zip(&g1).map(|(a, b)| -(advantage as f32) / temperature * (a - p0 * a - p1 * b)).collect();
        assert_eq!(got.len(), expected.len());
        let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 1e-6, "a gradient to compare");
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() <= 1e-4 * scale + 1e-7, "{g} vs {e}");
        }
        // Without the normaliser the gradient would be -A / T grad s(a0): not what we got.
        let naive_gap =
            g0.iter().zip(&got).map(|(a, g)| (-(advantage as f32) / temperature * a - g).abs()).fold(0f32, f32::max);
        assert!(naive_gap > 1e-3 * scale, "the normaliser's gradient is there");
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
