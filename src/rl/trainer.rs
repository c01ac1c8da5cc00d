//! `MagrpoTrainer`: one iteration in phases with a contract between them (DESIGN.md,
//! "Training"):
//!
//! 1. **rollouts**: G episodes from each of several starts ([`super::rollout`]);
//! 2. **credit** ([`super::credit::Credit`]): rewards shaped per step and seat, turned into
//!    advantages, one [`TrainBatch`](super::credit::batch::TrainBatch) row per reply or decision;
//!    with a KL penalty, the base model's log-probs are attached to the rows;
//! 3. **update**: the [`Objective`]'s loss over the batch in mixed-adapter micro-batches, one
//!    backward each ([`super::update`]);
//! 4. **optimizer**: one clipped AdamW step per adapter that got a gradient
//!    ([`super::optimizer`]).
//!
//! Phases 3 and 4 repeat `training.objective.epochs_per_iteration` times (the clipped
//! objective). Each agent's loss is normalised over its own units, so the summed loss gives every
//! adapter exactly its own agent's gradient. The trainer knows no task by name.

use std::collections::BTreeMap;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe_envs::Registry;

use super::config::sections::seating_of_group;
use super::config::TrainConfig;
use super::credit::{Credit, Credited};
use super::flops::FlopModel;
use super::objective::{LossStats, Objective};
use super::optimizer::{clip_fraction, AgentOptimizers};
use super::rollout::stats::RolloutStats;
use super::rollout::{episode_rngs, make_env, EpisodeRecord};
use super::update::Scorer;
pub use super::warmup::FormatWarmup;
use crate::adapters::{AdamWState, MultiAdapterManager};
use crate::error::{Result, RunError, TroupeError};
use crate::model::Model;

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
    /// The loss (of the first epoch, with several).
    pub loss: f64,
    /// Per adapter name: gradient norm before clipping (adapters that got none are absent; of
    /// the first epoch, with several).
    pub grad_norm: BTreeMap<String, f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Generated tokens per second of rollout.
    pub rollout_tokens_per_second: f64,
    /// Wall time of the iteration.
    pub seconds: f64,
    /// Mean per-unit KL estimate to the base model, when the penalty is on.
    pub kl: Option<f64>,
    /// The clipped objective: the fraction of units whose importance ratio lay outside the clip
    /// range, over every epoch.
    pub clip_fraction: Option<f64>,
    /// Mean environment steps per episode.
    pub mean_episode_steps: f64,
    /// Wall time of each phase: `rollout` (generation or scoring, environments), `credit`
    /// (rewards, advantages, the KL reference), `update` (the loss's forward and backward
    /// passes) and `optimizer` (clipping and AdamW); and inside them ([`crate::profile`]):
    /// `prefill` and `decode` (of `rollout`), `update_forward` and `backward` (of `update`).
    pub phase_seconds: BTreeMap<String, f64>,
    /// Useful floating-point work of the `rollout` and `update` phases ([`super::flops`]).
    pub phase_flops: BTreeMap<String, f64>,
    /// On a GPU, the most device memory each phase kept at its boundaries, and the allocator's
    /// reservation then ([`crate::profile::memory`]); empty on the CPU.
    pub phase_memory: BTreeMap<String, crate::profile::memory::DeviceMemory>,
    /// The mean over episodes of every metric the environment reports.
    pub env_metrics: BTreeMap<String, f64>,
    /// In `choice` mode, the policy's mean entropy (nats) over the decisions.
    pub choice_entropy: Option<f64>,
    /// TRL's completion and group statistics ([`super::trl_stats`]), by their metric names.
    pub trl: BTreeMap<String, f64>,
}

/// One iteration's rollouts, drawn by [`MagrpoTrainer::plan`]: every episode's environment
/// seed and random stream, so the episodes can be played anywhere (in one batch, or split across
/// processes holding the same base and adapters) and give the same samples.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RolloutPlan {
    /// The 1-based iteration the plan belongs to.
    pub iteration: u64,
    /// The iteration's seed (the update's dropout seeds derive from it).
    pub iteration_seed: u64,
    /// Seed of the episodes' generators: episode `i` draws from stream `i` of it.
    pub episode_seed: u64,
    /// Each group's environment seed (its start).
    pub starts: Vec<u64>,
    /// Episodes per start.
    pub group_size: usize,
}

impl RolloutPlan {
    /// How many episodes the plan holds (`starts.len() x group_size`, group by group).
    pub fn episodes(&self) -> usize {
        self.starts.len() * self.group_size
    }
}

/// What a checkpoint keeps of a trainer besides its adapters: restored with
/// [`MagrpoTrainer::restore`], read with [`MagrpoTrainer::state`].
#[derive(Clone, Debug)]
pub struct TrainerState {
    /// Iterations done.
    pub iteration: u64,
    /// The run's random stream.
    pub rng: ChaCha8Rng,
    /// Per adapter name: AdamW state.
    pub optimizer_states: BTreeMap<String, AdamWState>,
}

/// The trainer: a model, the agents' adapters, their optimizers, the iteration count.
pub struct MagrpoTrainer {
    /// The frozen base and tokenizer.
    pub model: Model,
    /// The agents' adapters.
    pub manager: MultiAdapterManager,
    optimizers: AgentOptimizers,
    iteration: u64,
    /// The run's random stream: each iteration draws its own seed from it (rollouts,
    /// sampling, fallbacks, dropout), so saving it with a checkpoint makes resuming exact.
    rng: ChaCha8Rng,
    /// The run's config (validated when it was read).
    config: TrainConfig,
    registry: Registry,
    /// The credit phase (reward functions and processors, discount, advantages).
    credit: Credit,
}

/// Prefixes a non-finite error's message with where it happened.
pub(crate) fn label_non_finite(err: TroupeError, place: &str) -> TroupeError {
    match err {
        TroupeError::Run(RunError::NonFinite { message }) => {
            TroupeError::Run(RunError::NonFinite { message: format!("{place}: {message}") })
        }
        other => other,
    }
}

impl MagrpoTrainer {
    /// A trainer over `model` and `manager` for the run `config` (validated:
    /// [`TrainConfig::validate`]), building environments from `registry`.
    pub fn new(model: Model, manager: MultiAdapterManager, registry: Registry, config: &TrainConfig) -> Result<Self> {
        for (seat, agent) in config.agents.seats.iter().enumerate() {
            manager.adapter_name(*agent).map_err(|_| {
                TroupeError::setting("agents.seats", format!("seat {seat} maps to agent {agent}, which has no adapter"))
            })?;
        }
        make_env(&registry, &config.env.spec())?;
        let credit = Credit::new(config, &registry)?;
        Ok(Self {
            model,
            manager,
            optimizers: AgentOptimizers::new(config.training.optimizer.clone(), config.training.max_grad_norm),
            iteration: 0,
            rng: ChaCha8Rng::seed_from_u64(config.run.seed),
            config: config.clone(),
            registry,
            credit,
        })
    }

    /// The config the trainer was built with.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The credit phase.
    pub fn credit(&self) -> &Credit {
        &self.credit
    }

    /// The registry environments are built from.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Iterations done.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// Per adapter name: the AdamW state of the adapters that have trained.
    pub fn optimizer_states(&self) -> &BTreeMap<String, AdamWState> {
        &self.optimizers.states
    }

    /// What a checkpoint keeps (besides the adapters).
    pub fn state(&self) -> TrainerState {
        TrainerState {
            iteration: self.iteration,
            rng: self.rng.clone(),
            optimizer_states: self.optimizers.states.clone(),
        }
    }

    /// Continues from a checkpoint's state (its adapters are loaded into the manager apart).
    pub fn restore(&mut self, state: TrainerState) {
        self.iteration = state.iteration;
        self.rng = state.rng;
        self.optimizers.states = state.optimizer_states;
    }

    /// The run's random stream, for phases outside the iteration that draw from it (the format
    /// warm-up), so a resumed run repeats them exactly.
    pub(crate) fn rng_mut(&mut self) -> &mut ChaCha8Rng {
        &mut self.rng
    }

    /// The scorer of the update phase over this trainer's model and adapters.
    pub fn scorer(&self) -> Scorer<'_> {
        Scorer {
            model: &self.model,
            manager: &self.manager,
            micro_batch_rows: self.config.runtime.micro_batch_rows,
            micro_batch_tokens: self.config.runtime.micro_batch_tokens,
            gradient_checkpointing: self.config.runtime.gradient_checkpointing,
            temperature: f64::from(self.config.action.sampling().temperature),
            choice_score: self.config.action.choice_score,
            max_new_tokens: self.config.action.max_new_tokens,
            skip_zero_advantage: true,
        }
    }

    /// The objective of the update phase.
    pub fn objective(&self) -> Objective {
        Objective { config: self.config.training.objective.clone(), kl: self.config.training.kl.clone() }
    }

    /// The learning rate of iteration `iteration` (1-based): linear warm-up, then linear decay
    /// to `lr_final_fraction` of the peak at the run's last iteration (constant when 1).
    pub fn learning_rate(&self, iteration: u64) -> f64 {
        let t = &self.config.training;
        let peak = t.optimizer.lr;
        let w = t.warmup_iterations as u64;
        if iteration < w {
            return peak * iteration as f64 / w as f64;
        }
        // Linear from the peak (at the warm-up's end) to `lr_final_fraction` of it at the end.
        let span = (self.config.run.iterations as u64).saturating_sub(w.max(1));
        let progress = if span == 0 { 0.0 } else { (iteration.saturating_sub(w.max(1))) as f64 / span as f64 };
        peak * (1.0 - (1.0 - t.lr_final_fraction) * progress.min(1.0))
    }

    /// The supervised format warm-up ([`FormatWarmup`]); returns each step's mean negative
    /// log-likelihood per target token (averaged over agents).
    pub fn format_warmup(&mut self) -> Result<Vec<f64>> {
        let warmup = self.config.training.format_warmup.clone();
        warmup.run(self)
    }

    /// Draws the next iteration's rollout plan from the run's random stream: the iteration's
    /// seed, `groups_per_iteration` starts and the episodes' generator seed. Call it once per
    /// iteration, then play the plan's episodes ([`MagrpoTrainer::play`], here or in other
    /// processes with the same base and adapters) and hand them to [`MagrpoTrainer::learn`].
    pub fn plan(&mut self) -> RolloutPlan {
        // The iteration's phase timers start here (what ran before, a warm-up, is not counted).
        crate::profile::take();
        crate::profile::memory::take();
        crate::profile::memory::watch(self.model.lm.device());
        // Kernels launched since the last iteration's phases (evaluation and checkpoints are
        // claimed by their own) are `other`'s; the device has run them by now, or will.
        crate::profile::kernels::close("other");
        crate::profile::kernels::resolve();
        let iteration_seed: u64 = self.rng.random();
        let mut rollout_rng = ChaCha8Rng::seed_from_u64(iteration_seed);
        let starts: Vec<u64> = (0..self.config.training.groups_per_iteration).map(|_| rollout_rng.random()).collect();
        RolloutPlan {
            iteration: self.iteration + 1,
            iteration_seed,
            episode_seed: rollout_rng.random(),
            starts,
            group_size: self.config.training.group_size,
        }
    }

    /// Plays episodes `range` of `plan` (indices into [`RolloutPlan::episodes`]) with the
    /// current adapters, in one batch. Episode `i` draws from its own generator
    /// ([`super::rollout::episode_rngs`]), so any split of the plan into ranges plays the same
    /// episodes as the whole plan at once.
    pub fn play(&self, plan: &RolloutPlan, range: std::ops::Range<usize>) -> Result<Vec<EpisodeRecord>> {
        let total = plan.episodes();
        if range.start > range.end || range.end > total {
            return Err(TroupeError::invalid(
                "range",
                format!("episodes {}..{} of a plan of {total}", range.start, range.end),
            ));
        }
        let spec = self.config.env.spec();
        let rollout = self.config.rollout_config();
        // Episodes are played together per seating (self-play alone: one seating, no partner);
        // every episode keeps its own generator, so its record is the one it would have in any
        // batch.
        let self_play = [BTreeMap::new()];
        let partners = match self.config.training.partners.as_slice() {
            [] => &self_play[..],
            seatings => seatings,
        };
        let play = super::rollout::Rollout {
            model: &self.model,
            manager: &self.manager,
            seat_agents: &self.config.agents.seats,
            config: &rollout,
        };
        let mut records: Vec<Option<EpisodeRecord>> = (0..range.len()).map(|_| None).collect();
        for (seating, seated) in partners.iter().enumerate() {
            let episodes: Vec<usize> = range
                .clone()
                .filter(|&e| seating_of_group(partners.len(), e / plan.group_size) == Some(seating))
                .collect();
            if episodes.is_empty() {
                continue;
            }
            let mut baselines = BTreeMap::new();
            for (&seat, name) in seated {
                baselines.insert(
                    seat,
                    self.registry.make_policy(name).map_err(|e| {
                        TroupeError::setting(format!("training.partners[{seating}].{seat}"), e.to_string())
                    })?,
                );
            }
            let mut envs = Vec::with_capacity(episodes.len());
            let mut seeds = Vec::with_capacity(episodes.len());
            let mut rngs = Vec::with_capacity(episodes.len());
            for &episode in &episodes {
                envs.push(make_env(&self.registry, &spec)?);
                seeds.push(plan.starts[episode / plan.group_size]);
                rngs.extend(episode_rngs(plan.episode_seed, episode, 1));
            }
            let played = play.play(&mut envs, &seeds, &mut baselines, &mut rngs)?;
            for (episode, record) in episodes.into_iter().zip(played) {
                records[episode - range.start] = Some(record);
            }
        }
        Ok(records.into_iter().map(|r| r.expect("every episode has a seating")).collect())
    }

    /// Runs one iteration: rollouts, credit, then per epoch the update and one optimizer step
    /// per adapter that got rows.
    pub fn step(&mut self) -> Result<IterationStats> {
        let started = Instant::now();
        let plan = self.plan();
        let episodes = self.play(&plan, 0..plan.episodes())?;
        self.learn(&plan, episodes, started.elapsed().as_secs_f64())
    }

    /// The rest of an iteration once `plan`'s episodes are played (all of them, in plan order):
    /// credit, then per epoch the update and one optimizer step per adapter that got rows.
    /// `rollout_seconds` is the wall time the episodes took, for the metrics.
    pub fn learn(
        &mut self,
        plan: &RolloutPlan,
        episodes: Vec<EpisodeRecord>,
        rollout_seconds: f64,
    ) -> Result<IterationStats> {
        let now = Instant::now();
        let started = now.checked_sub(std::time::Duration::from_secs_f64(rollout_seconds.max(0.0))).unwrap_or(now);
        if plan.iteration != self.iteration + 1 {
            return Err(TroupeError::invalid(
                "plan",
                format!(
                    "the plan is for iteration {}, the trainer is at iteration {}",
                    plan.iteration,
                    self.iteration + 1
                ),
            ));
        }
        if episodes.len() != plan.episodes() {
            return Err(TroupeError::invalid(
                "episodes",
                format!("{} episodes for a plan of {}", episodes.len(), plan.episodes()),
            ));
        }
        if let Some((i, e)) = episodes.iter().enumerate().find(|(i, e)| e.seed != plan.starts[i / plan.group_size]) {
            return Err(TroupeError::invalid(
                "episodes",
                format!(
                    "episode {i} was played from seed {}, the plan says {}",
                    e.seed,
                    plan.starts[i / plan.group_size]
                ),
            ));
        }
        let iteration = plan.iteration;
        let iteration_seed = plan.iteration_seed;
        let mut groups: Vec<Vec<EpisodeRecord>> = Vec::with_capacity(plan.starts.len());
        let mut it = episodes.into_iter();
        for _ in 0..plan.starts.len() {
            groups.push(it.by_ref().take(plan.group_size).collect());
        }
        let flop_model = FlopModel::new(&self.model.lm.config);
        let rollout = RolloutStats::of(groups.iter().flatten(), &flop_model);

        let credit_started = Instant::now();
        let Credited { mut batch, stats: credit, shaped } = self.credit.assign(&self.model.tokenizer, &groups)?;
        let cap =
            (self.config.action.mode == super::rollout::ActionMode::Free).then_some(self.config.action.max_new_tokens);
        let mut trl = super::trl_stats::trl_stats(&groups, &shaped, &self.config.agents.seats, cap);
        for (label, mean) in &credit.function_mean {
            trl.insert(format!("rewards/{label}/mean"), *mean);
        }
        for (label, std) in &credit.function_std {
            trl.insert(format!("rewards/{label}/std"), *std);
        }
        let objective = self.objective();
        // The KL reference is one more forward over the batch, once however many epochs follow.
        let mut update_flops = 0.0;
        if objective.kl.coef > 0.0 {
            self.scorer().attach_reference(&mut batch)?;
            update_flops += self.scorer().forward_flops(&batch);
        }
        let credit_seconds = credit_started.elapsed().as_secs_f64();
        crate::profile::close("credit");

        let lr = self.learning_rate(iteration);
        let place = format!("iteration {iteration}");
        let (mut update_seconds, mut optimizer_seconds) = (0.0, 0.0);
        let mut first = None;
        let mut stats = LossStats::default();
        for epoch in 0..objective.config.epochs() {
            let update_started = Instant::now();
            // Epoch 0 keeps the single-epoch run's dropout seeds.
            let seed = iteration_seed ^ ((epoch as u64) << 48);
            let pass = self.scorer().gradients(&batch, &objective, seed).map_err(|e| label_non_finite(e, &place))?;
            update_seconds += update_started.elapsed().as_secs_f64();
            update_flops += pass.flops;
            stats.add(&pass.stats);
            let optimizer_started = Instant::now();
            let grad_norm =
                self.optimizers.step(&mut self.manager, pass.grads, lr).map_err(|e| label_non_finite(e, &place))?;
            optimizer_seconds += optimizer_started.elapsed().as_secs_f64();
            crate::profile::close("optimizer");
            first.get_or_insert((pass.loss, grad_norm, pass.stats));
        }
        let (loss, grad_norm, first_stats) = first.expect("at least one epoch");
        self.iteration = iteration;
        let timed = crate::profile::take();
        let phase_memory = crate::profile::memory::take().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        Ok(IterationStats {
            iteration,
            mean_return: credit.mean_return,
            std_return: credit.std_return,
            mean_score: rollout.mean_score,
            invalid_rate: rollout.invalid_rate,
            loss,
            grad_norm,
            lr,
            rollout_tokens_per_second: rollout.generated_tokens as f64 / rollout_seconds.max(1e-9),
            seconds: started.elapsed().as_secs_f64(),
            kl: (objective.kl.coef > 0.0).then(|| first_stats.kl_sum / first_stats.kl_units.max(1) as f64),
            clip_fraction: clip_fraction(&stats),
            mean_episode_steps: rollout.mean_episode_steps,
            phase_seconds: [
                ("rollout", rollout_seconds),
                ("credit", credit_seconds),
                ("update", update_seconds),
                ("optimizer", optimizer_seconds),
            ]
            .into_iter()
            .chain(crate::profile::Phase::ALL.into_iter().map(|p| (p.name(), timed[p as usize])))
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
            phase_flops: [("rollout".to_string(), rollout.flops), ("update".to_string(), update_flops)]
                .into_iter()
                .collect(),
            phase_memory,
            choice_entropy: rollout.choice_entropy,
            env_metrics: rollout.env_metrics,
            trl,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::adapters::optim::{adapter_grads, AdapterGrads};
    use crate::adapters::AdapterConfig;
    use crate::generate::choice::{candidate_logliks, PackedChoices};
    use crate::model::Preset;
    use crate::rl::credit::batch::TrainBatch;
    use crate::rl::credit::batch::TrainRow;
    use crate::rl::rollout::{ActionMode, ChoiceTurn, Fallback};
    use burn::tensor::Device;

    /// A small Hanabi run in `choice` mode: groups of 2, one group, 2-step episodes.
    fn test_config(seat_agents: Vec<usize>) -> TrainConfig {
        let mut config = TrainConfig::default();
        config.env = crate::rl::config::EnvConfig::default();
        config.agents.num_agents = seat_agents.iter().max().map_or(1, |m| m + 1);
        config.agents.seats = seat_agents;
        config.action = crate::rl::rollout::ActionConfig {
            mode: ActionMode::Choice,
            max_retries: 0,
            max_new_tokens: 4,
            chat_template: false,
            ..Default::default()
        };
        config.training.group_size = 2;
        config.training.groups_per_iteration = 1;
        config.training.max_episode_steps = 2;
        config.training.optimizer = crate::adapters::AdamWConfig { lr: 1e-2, ..Default::default() };
        config.training.warmup_iterations = 2;
        config.run.iterations = 10;
        config.rewards.processors = vec![];
        config.runtime.micro_batch_rows = 2;
        config.run.seed = 3;
        config
    }

    fn trainer(seat_agents: Vec<usize>, agents: usize) -> MagrpoTrainer {
        trainer_with(test_config(seat_agents), agents)
    }

    fn trainer_with(config: TrainConfig, agents: usize) -> MagrpoTrainer {
        let device = Device::flex();
        let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
        let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
        manager.create_adapters(agents, &AdapterConfig { r: 4, lora_alpha: 8.0, ..AdapterConfig::default() }).unwrap();
        MagrpoTrainer::new(model, manager, Registry::with_builtins(), &config).unwrap()
    }

    fn partnered(seatings: &[&[(usize, &str)]]) -> TrainConfig {
        let mut config = test_config(vec![0, 1]);
        config.training.groups_per_iteration = 2;
        config.training.max_episode_steps = 6;
        config.training.partners =
            seatings.iter().map(|s| s.iter().map(|&(seat, name)| (seat, name.to_string())).collect()).collect();
        config
    }

    #[test]
    fn an_agent_that_never_acts_keeps_its_adapter_byte_identical() {
        // Agent 0 plays both seats; agent 1 never acts.
        let mut t = trainer(vec![0, 0], 2);
        let idle_before = t.manager.adapter(1).unwrap().to_host().unwrap();
        let active_before = t.manager.adapter(0).unwrap().to_host().unwrap();
        let stats = t.step().unwrap();
        assert_eq!(stats.iteration, 1);
        assert!((stats.lr - 5e-3).abs() < 1e-12, "warm-up: half the peak at iteration 1 of 2");
        assert_eq!(t.manager.adapter(1).unwrap().to_host().unwrap(), idle_before);
        assert!(!t.optimizer_states().contains_key("agent_1"), "no optimizer state for an idle agent");
        if stats.grad_norm.get("agent_0").is_some_and(|norm| *norm > 0.0) {
            assert_ne!(t.manager.adapter(0).unwrap().to_host().unwrap(), active_before, "the acting agent learned");
        }
    }

    #[test]
    fn fixed_partners_play_their_seats_and_only_the_agents_moves_are_trained() {
        // Group 0 seats the rule player at seat 1, group 1 at seat 0: each agent learns beside it.
        let mut t = trainer_with(partnered(&[&[(1, "rule")], &[(0, "rule")]]), 2);
        let mut plan = t.plan();
        let records = t.play(&plan, 0..plan.episodes()).unwrap();
        assert_eq!(records.len(), 4);
        for (episode, record) in records.iter().enumerate() {
            let learner = if episode / 2 == 0 { 0 } else { 1 };
            assert!(record.steps > 1, "both seats moved");
            assert!(!record.turns.is_empty());
            assert!(
                record.turns.iter().all(|turn| turn.seat == learner && turn.agent == learner),
                "episode {episode}: only seat {learner}'s agent has turns"
            );
        }
        // An episode's record does not depend on which other episodes share its batch.
        let split: Vec<EpisodeRecord> =
            [0..1, 1..3, 3..4].into_iter().flat_map(|range| t.play(&plan, range).unwrap()).collect();
        assert_eq!(split, records);
        // The rule partner plays as the baseline policy does: its moves are the environment's.
        let rule_moves = records[0].step_rewards.len() - records[0].turns.len();
        assert!(rule_moves > 0);
        let stats = t.learn(&plan, records, 0.0).unwrap();
        assert!(t.optimizer_states().contains_key("agent_0") && t.optimizer_states().contains_key("agent_1"));
        assert_eq!(stats.mean_return.len(), 2);
        // Only partners at seat 1: agent 1 never acts, its adapter stays byte-identical.
        let mut t = trainer_with(partnered(&[&[(1, "random")]]), 2);
        plan = t.plan();
        let records = t.play(&plan, 0..plan.episodes()).unwrap();
        assert!(records.iter().flat_map(|r| &r.turns).all(|turn| turn.seat == 0));
        let idle = t.manager.adapter(1).unwrap().to_host().unwrap();
        let stats = t.learn(&plan, records, 0.0).unwrap();
        assert_eq!(stats.mean_return.keys().collect::<Vec<_>>(), [&0], "no return for an agent that never played");
        assert_eq!(t.manager.adapter(1).unwrap().to_host().unwrap(), idle);
        assert!(!t.optimizer_states().contains_key("agent_1"));
    }

    #[test]
    fn without_partners_the_records_are_self_play_as_before() {
        let mut a = trainer(vec![0, 1], 2);
        let mut config = test_config(vec![0, 1]);
        config.training.partners = vec![Default::default()];
        let mut b = trainer_with(config, 2);
        let (plan_a, plan_b) = (a.plan(), b.plan());
        let (ra, rb) = (a.play(&plan_a, 0..plan_a.episodes()).unwrap(), b.play(&plan_b, 0..plan_b.episodes()).unwrap());
        assert_eq!(ra, rb, "an empty seating is self-play, episode for episode");
        assert!(ra.iter().flat_map(|r| &r.turns).any(|turn| turn.seat == 1));
    }

    #[test]
    fn the_learning_rate_warms_up_then_decays_linearly() {
        let mut t = trainer(vec![0, 1], 2);
        t.config.training.lr_final_fraction = 0.1;
        t.config.run.iterations = 12;
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
            (
                stats.loss,
                t.manager.adapter(0).unwrap().to_host().unwrap(),
                t.manager.adapter(1).unwrap().to_host().unwrap(),
            )
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn batch_reward_functions_score_every_episode_in_one_call() {
        use crate::rl::credit::rewards::{RewardFunction, WeightedReward};
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&calls);
        let mut registry = Registry::with_builtins();
        // Seat s of episode e gets e + s / 10 (per seat); "shared" gives every seat 2.
        registry.register_batch_reward("per_seat", "test", move |items| {
            seen.fetch_add(1, Ordering::SeqCst);
            assert!(items.iter().all(|i| i.prompts.iter().all(|p| !p.is_empty())), "prompts are sent");
            Ok(items
                .iter()
                .enumerate()
                .map(|(e, i)| (0..i.returns.len()).map(|s| e as f64 + s as f64 / 10.0).collect())
                .collect())
        });
        registry.register_batch_reward("shared", "test", |items| Ok(items.iter().map(|_| vec![2.0]).collect()));
        registry.register_batch_reward("short", "test", |_| Ok(vec![vec![1.0]]));
        registry.register_batch_reward("refuses", "test", |_| Err("no model loaded".into()));
        let named = |name: &str| WeightedReward::builtin(RewardFunction::Registered(name.into()), 1.0);
        let build = |names: &[&str]| {
            let mut t = trainer(vec![0, 1], 2);
            t.config.rewards.functions = names.iter().map(|n| named(n)).collect();
            MagrpoTrainer::new(t.model, t.manager, registry.clone(), &t.config).unwrap()
        };
        let t = build(&["per_seat", "shared"]);
        let plan = RolloutPlan { iteration: 1, iteration_seed: 1, episode_seed: 2, starts: vec![4], group_size: 2 };
        let episodes = t.play(&plan, 0..2).unwrap();
        let refs: Vec<&EpisodeRecord> = episodes.iter().collect();
        let values = t.credit.computed_reward_values(&t.model.tokenizer, &refs).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one call for the whole batch");
        assert_eq!(values, vec![vec![vec![0.0, 2.0], vec![0.1, 2.0]], vec![vec![1.0, 2.0], vec![1.1, 2.0]]]);
        let err = {
            let t = build(&["short"]);
            t.credit.computed_reward_values(&t.model.tokenizer, &refs)
        }
        .unwrap_err()
        .to_string();
        assert!(err.contains("short") && err.contains("1 rewards for 2 episodes"), "{err}");
        let err = {
            let t = build(&["refuses"]);
            t.credit.computed_reward_values(&t.model.tokenizer, &refs)
        }
        .unwrap_err()
        .to_string();
        assert!(err.contains("refuses") && err.contains("no model loaded"), "{err}");
    }

    #[test]
    fn a_plan_played_in_parts_trains_as_one_step() {
        // What a learner does with rollouts played by several processes: the same plan, played
        // in two ranges, learned from, gives the adapters `step` gives.
        let whole = {
            let mut t = trainer(vec![0, 1], 2);
            t.config.training.groups_per_iteration = 2;
            t.step().unwrap();
            (t.manager.adapter(0).unwrap().to_host().unwrap(), t.manager.adapter(1).unwrap().to_host().unwrap())
        };
        let mut t = trainer(vec![0, 1], 2);
        t.config.training.groups_per_iteration = 2;
        let plan = t.plan();
        assert_eq!(plan.episodes(), 4);
        let mut episodes = t.play(&plan, 0..3).unwrap();
        episodes.extend(t.play(&plan, 3..4).unwrap());
        let mut wrong = episodes.clone();
        wrong.pop();
        assert!(t.learn(&plan, wrong, 0.0).unwrap_err().to_string().contains("3 episodes for a plan of 4"));
        assert!(t.play(&plan, 2..5).is_err(), "a range beyond the plan is refused");
        let stats = t.learn(&plan, episodes, 0.0).unwrap();
        assert_eq!(stats.iteration, 1);
        assert_eq!(
            (t.manager.adapter(0).unwrap().to_host().unwrap(), t.manager.adapter(1).unwrap().to_host().unwrap()),
            whole
        );
        assert!(t.learn(&plan, Vec::new(), 0.0).unwrap_err().to_string().contains("plan is for iteration 1"));
    }

    /// Host values of every gradient tensor of one adapter, in site order (also read by the
    /// update phase's tests).
    pub(crate) fn flat(grads: &AdapterGrads) -> Vec<f32> {
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
        t.config.action.temperature = 0.7;
        t.config.action.choice_score = crate::generate::choice::ChoiceScore::Mean;
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
        let row = TrainRow {
            agent: 0,
            tokens: prompt.clone(),
            prompt_len: prompt.len(),
            advantage,
            sampling_logprobs: vec![0.0],
            choice: Some(ChoiceTurn { candidates: candidates.clone(), chosen: 0, entropy: 0.0 }),
            reference_logprobs: None,
        };
        let pass = t.scorer().gradients(&TrainBatch { rows: vec![row] }, &t.objective(), 0).unwrap();
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
    fn sampling_logprobs_match_rescoring_and_one_clipped_epoch_has_magrpos_gradient() {
        let cases = [
            (ActionMode::Choice, Fallback::Random),
            (ActionMode::Free, Fallback::Random),
            (ActionMode::Free, Fallback::Retry),
        ];
        for (mode, fallback) in cases {
            let mut t = trainer(vec![0, 1], 2);
            t.config.action.mode = mode;
            t.config.action.fallback = fallback;
            t.config.action.max_retries = 1;
            for agent in 0..2 {
                let mut adapter = t.manager.adapter(agent).unwrap().clone();
                for pair in adapter.pairs.values_mut() {
                    pair.b = pair.b.clone().add_scalar(0.01);
                }
                t.manager.set_adapter(agent, adapter).unwrap();
            }
            let plan = t.plan();
            let groups: Vec<Vec<EpisodeRecord>> =
                t.play(&plan, 0..plan.episodes()).unwrap().chunks(plan.group_size).map(<[_]>::to_vec).collect();
            let mut batch = t.credit.assign(&t.model.tokenizer, &groups).unwrap().batch;
            assert!(batch.rows.len() >= 4, "{mode:?}: rows to train on");
            if fallback == Fallback::Retry {
                // The random model's replies are refused, so rows were generated from a retry prompt.
                let retried = groups.iter().flatten().flat_map(|e| &e.turns).filter(|t| t.invalid).count();
                assert!(retried > 0, "a retried reply to check");
            }
            // Short games score nothing; give the rows distinct advantages to compare gradients.
            for (i, row) in batch.rows.iter_mut().enumerate() {
                row.advantage = (i % 4) as f64 - 1.5;
            }
            if mode == ActionMode::Free {
                // What generation recorded is what scoring the reply gives (another batch shape).
                for row in &batch.rows {
                    let (delta, _) = t.manager.mixed(&[Some(row.agent)], false).unwrap();
                    let scored =
                        crate::generate::score_rows(&t.model.lm, std::slice::from_ref(&row.tokens), Some(&delta))
                            .unwrap();
                    let reply = &scored[0][row.prompt_len - 1..];
                    assert_eq!(reply.len(), row.sampling_logprobs.len());
                    for (a, b) in reply.iter().zip(&row.sampling_logprobs) {
                        assert!((a - b).abs() < 1e-4, "scored {a} vs sampled {b}");
                    }
                }
            }
            let magrpo = t.scorer().gradients(&batch, &t.objective(), 1).unwrap();
            let mut clipped = t.objective();
            clipped.config.kind = crate::rl::objective::ObjectiveKind::Clipped;
            let pass = t.scorer().gradients(&batch, &clipped, 1).unwrap();
            assert_eq!(pass.stats.clipped_units, 0, "the policy that sampled is the one scored");
            assert_eq!(pass.stats.ratio_units, batch.rows.iter().map(|r| r.units()).sum::<usize>());
            assert_eq!(magrpo.grads.keys().collect::<Vec<_>>(), pass.grads.keys().collect::<Vec<_>>());
            for (name, grads) in &magrpo.grads {
                let (want, got) = (flat(grads), flat(&pass.grads[name]));
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(scale > 1e-6, "{mode:?}: a gradient to compare");
                for (w, g) in want.iter().zip(&got) {
                    assert!((w - g).abs() <= 1e-3 * scale, "{mode:?} {name}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn seats_must_map_to_agents_with_adapters() {
        let device = Device::flex();
        let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
        let manager = MultiAdapterManager::new(&model.lm.config, &device);
        let config = trainer(vec![0, 1], 2).config.clone();
        let err = MagrpoTrainer::new(model, manager, Registry::with_builtins(), &config).err().unwrap().to_string();
        assert!(err.contains("seat 0 maps to agent 0"), "{err}");
    }
}
