//! [`TrainConfig::validate`]: every range and cross-reference a config must satisfy, checked
//! once, section by section, before anything is built or allocated, including upper bounds on
//! the sizes a config may ask for (a typo such as `training.group_size=100000000000` gets a
//! clear error naming the key instead of aborting the process on an impossible allocation).
//! Errors name the file and the key.

use std::path::Path;

use troupe_envs::Registry;

use super::TrainConfig;
use crate::error::{Result, TroupeError};
use crate::rl::credit::rewards::RewardFunction;
use crate::rl::rollout::ActionMode;

/// Most rollouts in one group.
pub const MAX_GROUP_SIZE: usize = 4096;
/// Most groups in one iteration.
pub const MAX_GROUPS_PER_ITERATION: usize = 4096;
/// Most episodes in one iteration (group size x groups).
pub const MAX_EPISODES_PER_ITERATION: usize = 65_536;
/// Most new tokens per reply (the model's context is checked separately).
pub const MAX_NEW_TOKENS: usize = 1 << 20;
/// Most evaluation episodes (also `env bench` / `env record --episodes`).
pub const MAX_EPISODES: usize = 10_000_000;
/// Most agents (adapters).
pub const MAX_AGENTS: usize = 4096;
/// Most examples per format warm-up step.
pub const MAX_WARMUP_BATCH: usize = 65_536;
/// Most format warm-up steps.
pub const MAX_WARMUP_STEPS: usize = 1_000_000;
/// Most rows in one forward/backward pass, and most episodes played at once in evaluation.
pub const MAX_BATCH_ROWS: usize = 65_536;
/// Most tokens in one micro-batch of the update (`runtime.micro_batch_tokens`).
pub const MAX_BATCH_TOKENS: usize = 1 << 30;
/// Highest LoRA rank (the model's own dimensions bound it further, checked against the model).
pub const MAX_LORA_RANK: usize = 65_536;
/// Most steps in one episode, and most retries of an illegal reply.
pub const MAX_STEPS: usize = 100_000_000;
/// Highest learning rate (AdamW's steps are about `lr` in size: above 1 the adapters' weights,
/// which start near 0.01, are overwritten by noise at the first step).
pub const MAX_LR: f64 = 1.0;

/// `Err` naming `key` when `value` is above `limit`.
fn at_most(key: &str, value: usize, limit: usize) -> std::result::Result<(), Refusal> {
    if value > limit {
        return refuse(key, format!("{value} is too large (at most {limit})"));
    }
    Ok(())
}

/// A refused value: the key and what is wrong.
type Refusal = (String, String);

/// `Err((key, message))` for a refused value.
fn refuse<T>(key: &str, message: impl Into<String>) -> std::result::Result<T, Refusal> {
    Err((key.to_string(), message.into()))
}

impl TrainConfig {
    /// Checks everything that does not need the environment built: ranges and sizes, seats that
    /// name existing agents, a known environment name (in `registry`), model preset, device,
    /// reward pipeline and baseline policies. Errors name `origin` and the key.
    pub fn validate(&self, origin: &Path, registry: &Registry) -> Result<()> {
        let checks: [&dyn Fn() -> std::result::Result<(), Refusal>; 9] = [
            &|| self.check_run(),
            &|| self.check_model(),
            &|| self.check_agents(registry),
            &|| self.check_adapter(),
            &|| self.check_action(),
            &|| self.check_training(),
            &|| self.check_rewards(registry),
            &|| self.check_eval(registry),
            &|| self.check_partners(registry),
        ];
        for check in checks {
            if let Err((key, message)) = check() {
                return Err(TroupeError::BadValue { origin: Some(origin.to_path_buf()), key, message });
            }
        }
        Ok(())
    }

    fn check_run(&self) -> std::result::Result<(), Refusal> {
        if self.run.checkpoint_every == 0 {
            return refuse("run.checkpoint_every", "must be at least 1");
        }
        if self.run.log_every == 0 {
            return refuse("run.log_every", "must be at least 1");
        }
        if self.runtime.eval_batch_episodes == 0 {
            return refuse("runtime.eval_batch_episodes", "must be at least 1");
        }
        if self.runtime.micro_batch_rows == 0 {
            return refuse("runtime.micro_batch_rows", "must be at least 1");
        }
        at_most("runtime.micro_batch_rows", self.runtime.micro_batch_rows, MAX_BATCH_ROWS)?;
        if let Some(tokens) = self.runtime.micro_batch_tokens {
            if tokens == 0 {
                return refuse(
                    "runtime.micro_batch_tokens",
                    "must be at least 1 (or left out for row-sized micro-batches)",
                );
            }
            at_most("runtime.micro_batch_tokens", tokens, MAX_BATCH_TOKENS)?;
        }
        at_most("runtime.eval_batch_episodes", self.runtime.eval_batch_episodes, MAX_BATCH_ROWS)
    }

    fn check_model(&self) -> std::result::Result<(), Refusal> {
        if self.model.path.is_none() {
            if let Err(message) = self.model.preset() {
                return refuse("model.preset", message);
            }
        }
        if let Err(err) = crate::device::parse_device(&self.model.device) {
            let message = match err {
                TroupeError::BadValue { message, .. } => message,
                other => other.to_string(),
            };
            return refuse("model.device", message);
        }
        if let Err(message) = self.model.dtype.check(self.model.quantized) {
            return refuse("model.dtype", message);
        }
        Ok(())
    }

    fn check_agents(&self, registry: &Registry) -> std::result::Result<(), Refusal> {
        if !registry.contains(&self.env.name) {
            let known: Vec<&str> = registry.list().map(|(name, _)| name).collect();
            return refuse(
                "env.name",
                format!("unknown environment {:?} (registered: {})", self.env.name, known.join(", ")),
            );
        }
        let agents = &self.agents;
        if agents.num_agents == 0 {
            return refuse("agents.num_agents", "must be at least 1");
        }
        if agents.num_agents > MAX_AGENTS {
            return refuse("agents.num_agents", format!("{} is too large (at most {MAX_AGENTS})", agents.num_agents));
        }
        if agents.seats.is_empty() {
            return refuse("agents.seats", "names no seat (one agent id per seat of the environment)");
        }
        at_most("agents.seats", agents.seats.len(), MAX_AGENTS)?;
        for (seat, &agent) in agents.seats.iter().enumerate() {
            if agent >= agents.num_agents {
                return refuse(
                    &format!("agents.seats[{seat}]"),
                    format!(
                        "agent {agent} does not exist (agents.num_agents is {}: ids 0 to {})",
                        agents.num_agents,
                        agents.num_agents - 1
                    ),
                );
            }
        }
        if let Some(idle) = (0..agents.num_agents).find(|a| !agents.seats.contains(a)) {
            return refuse(
                "agents.num_agents",
                format!("agent {idle} plays no seat in agents.seats {:?}, so it could never train", agents.seats),
            );
        }
        Ok(())
    }

    fn check_adapter(&self) -> std::result::Result<(), Refusal> {
        at_most("adapter.r", self.adapter.r, MAX_LORA_RANK)?;
        match self.adapter.validate(Path::new("")) {
            Err(TroupeError::BadValue { key: field, message, .. }) => refuse(&format!("adapter.{field}"), message),
            Err(other) => refuse("adapter", other.to_string()),
            Ok(()) => Ok(()),
        }
    }

    fn check_action(&self) -> std::result::Result<(), Refusal> {
        let action = &self.action;
        if !action.invalid_penalty.is_finite() {
            return refuse("action.invalid_penalty", format!("{} is not a finite number", action.invalid_penalty));
        }
        if action.max_new_tokens == 0 {
            return refuse("action.max_new_tokens", "must be at least 1");
        }
        if action.max_new_tokens > MAX_NEW_TOKENS {
            return refuse(
                "action.max_new_tokens",
                format!("{} is too large (at most {MAX_NEW_TOKENS})", action.max_new_tokens),
            );
        }
        at_most("action.max_retries", action.max_retries, MAX_STEPS)?;
        if !(action.temperature.is_finite() && action.temperature >= 0.0) {
            return refuse("action.temperature", format!("{} is not a number >= 0", action.temperature));
        }
        if !(action.top_p > 0.0 && action.top_p <= 1.0) {
            return refuse("action.top_p", format!("{} is not in (0, 1]", action.top_p));
        }
        if action.mode == ActionMode::Choice && (action.top_k != 0 || action.top_p < 1.0) {
            let key = if action.top_k != 0 { "action.top_k" } else { "action.top_p" };
            return refuse(key, "`choice` mode samples from softmax(log-likelihood / temperature) over the legal actions; top_k and top_p do not apply (set 0 and 1.0)");
        }
        Ok(())
    }

    fn check_training(&self) -> std::result::Result<(), Refusal> {
        let t = &self.training;
        if t.group_size < 2 {
            return refuse(
                "training.group_size",
                format!("{} is too small: group-relative advantages need at least 2 rollouts per group", t.group_size),
            );
        }
        if t.groups_per_iteration == 0 {
            return refuse("training.groups_per_iteration", "must be at least 1");
        }
        for (key, value, limit) in [
            ("training.group_size", t.group_size, MAX_GROUP_SIZE),
            ("training.groups_per_iteration", t.groups_per_iteration, MAX_GROUPS_PER_ITERATION),
            ("training.format_warmup.batch_size", t.format_warmup.batch_size, MAX_WARMUP_BATCH),
            ("training.format_warmup.steps", t.format_warmup.steps, MAX_WARMUP_STEPS),
            ("training.max_episode_steps", t.max_episode_steps, MAX_STEPS),
        ] {
            if value > limit {
                return refuse(key, format!("{value} is too large (at most {limit})"));
            }
        }
        let episodes = t.group_size.saturating_mul(t.groups_per_iteration);
        if episodes > MAX_EPISODES_PER_ITERATION {
            return refuse(
                "training.group_size",
                format!(
                    "{} x {} groups = {episodes} episodes per iteration is too many (at most {MAX_EPISODES_PER_ITERATION})",
                    t.group_size, t.groups_per_iteration
                ),
            );
        }
        let o = &t.optimizer;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return refuse("training.optimizer.lr", format!("{} is not a positive number", o.lr));
        }
        for (key, value) in [("training.optimizer.lr", o.lr), ("training.format_warmup.lr", t.format_warmup.lr)] {
            if value.is_finite() && value > MAX_LR {
                return refuse(key, format!("{value:e} is too large (at most {MAX_LR})"));
            }
        }
        if !(o.eps.is_finite() && o.eps > 0.0) {
            return refuse("training.optimizer.eps", format!("{} is not a positive number", o.eps));
        }
        for (key, value) in [
            ("training.max_grad_norm", t.max_grad_norm),
            ("training.optimizer.weight_decay", o.weight_decay),
            ("training.kl.coef", t.kl.coef),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return refuse(key, format!("{value} is not a number >= 0"));
            }
        }
        for (key, value) in [("training.optimizer.beta1", o.beta1), ("training.optimizer.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&value) {
                return refuse(key, format!("{value} is not in [0, 1)"));
            }
        }
        if !(t.lr_final_fraction.is_finite() && (0.0..=1.0).contains(&t.lr_final_fraction)) {
            return refuse("training.lr_final_fraction", format!("{} is not in [0, 1]", t.lr_final_fraction));
        }
        if !(0.0..=1.0).contains(&t.gamma) {
            return refuse("training.gamma", format!("{} is not in [0, 1]", t.gamma));
        }
        let warmup = &t.format_warmup;
        if warmup.steps > 0 && warmup.batch_size == 0 {
            return refuse("training.format_warmup.batch_size", "must be at least 1 when format_warmup.steps > 0");
        }
        if !(warmup.lr.is_finite() && warmup.lr > 0.0) {
            return refuse("training.format_warmup.lr", format!("must be a positive number, got {}", warmup.lr));
        }
        if t.max_episode_steps == 0 {
            return refuse("training.max_episode_steps", "must be at least 1");
        }
        if let Err((field, message)) = t.objective.check() {
            return refuse(&format!("training.objective.{field}"), message);
        }
        Ok(())
    }

    fn check_rewards(&self, registry: &Registry) -> std::result::Result<(), Refusal> {
        if let Err(TroupeError::BadValue { key, message, .. }) = self.rewards.pipeline() {
            return refuse(&key, message);
        }
        for (i, function) in self.rewards.functions.iter().enumerate() {
            if let RewardFunction::Registered(name) = &function.name {
                if registry.reward(name).is_none() {
                    let mut known = vec!["env_return", "score", "invalid_actions", "external"];
                    known.extend(registry.rewards().map(|(name, _)| name));
                    return refuse(
                        &format!("rewards.functions[{i}].name"),
                        format!("unknown reward function {name:?} (known: {})", known.join(", ")),
                    );
                }
            }
        }
        Ok(())
    }

    fn check_partners(&self, registry: &Registry) -> std::result::Result<(), Refusal> {
        let seats = self.agents.seats.len();
        let seatings = self.training.partners.len();
        if seatings > self.training.groups_per_iteration {
            return refuse(
                "training.partners",
                format!(
                    "{seatings} seatings need at least as many groups an iteration (training.groups_per_iteration is {})",
                    self.training.groups_per_iteration
                ),
            );
        }
        for (i, partners) in self.training.partners.iter().enumerate() {
            for (&seat, policy) in partners {
                let key = format!("training.partners[{i}].{seat}");
                if seat >= seats {
                    return refuse(&key, format!("seat {seat} does not exist (agents.seats has {seats} seats)"));
                }
                if let Err(err) = registry.make_policy(policy) {
                    return refuse(&key, err.to_string());
                }
            }
            if partners.len() == seats {
                return refuse(
                    &format!("training.partners[{i}]"),
                    "every seat is a partner: no agent would play (and learn) in these groups",
                );
            }
        }
        Ok(())
    }

    fn check_eval(&self, registry: &Registry) -> std::result::Result<(), Refusal> {
        let eval = &self.eval;
        if eval.episodes == 0 {
            return refuse("eval.episodes", "must be at least 1");
        }
        if eval.episodes > MAX_EPISODES {
            return refuse("eval.episodes", format!("{} is too large (at most {MAX_EPISODES})", eval.episodes));
        }
        if eval.max_episode_steps == Some(0) {
            return refuse("eval.max_episode_steps", "must be at least 1, or null for whole episodes");
        }
        at_most("eval.every_episodes", eval.every_episodes, MAX_EPISODES)?;
        if eval.every > 0 && eval.every_episodes == 0 {
            return refuse("eval.every_episodes", "must be at least 1 when eval.every > 0");
        }
        for (&seat, policy) in &eval.baseline_seats {
            if seat >= self.agents.seats.len() {
                return refuse(
                    &format!("eval.baseline_seats.{seat}"),
                    format!("seat {seat} does not exist (agents.seats has {} seats)", self.agents.seats.len()),
                );
            }
            if let Err(err) = registry.make_policy(policy) {
                return refuse(&format!("eval.baseline_seats.{seat}"), err.to_string());
            }
        }
        Ok(())
    }
}
