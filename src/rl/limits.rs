//! Upper bounds on the sizes a config may ask for, checked before anything is allocated: a
//! typo such as `training.group_size=100000000000` gets a clear error naming the key instead
//! of aborting the process on an impossible allocation.

use super::config::TrainConfig;

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
/// Highest LoRA rank (the model's own dimensions bound it further, checked against the model).
pub const MAX_LORA_RANK: usize = 65_536;
/// Most steps in one episode, and most retries of an illegal reply.
pub const MAX_STEPS: usize = 100_000_000;
/// Highest learning rate (AdamW's steps are about `lr` in size: above 1 the adapters' weights,
/// which start near 0.01, are overwritten by noise at the first step).
pub const MAX_LR: f64 = 1.0;

/// The first size in `config` beyond its bound, as (key, message).
pub fn oversized(config: &TrainConfig) -> Option<(&'static str, String)> {
    let t = &config.training;
    let checks = [
        ("training.group_size", t.group_size, MAX_GROUP_SIZE),
        ("training.groups_per_iteration", t.groups_per_iteration, MAX_GROUPS_PER_ITERATION),
        ("training.format_warmup_batch", t.format_warmup_batch, MAX_WARMUP_BATCH),
        ("action.max_new_tokens", config.action.max_new_tokens, MAX_NEW_TOKENS),
        ("eval.episodes", config.eval.episodes, MAX_EPISODES),
        ("agents.num_agents", config.agents.num_agents, MAX_AGENTS),
        ("agents.seats", config.agents.seats.len(), MAX_AGENTS),
        ("training.format_warmup_steps", t.format_warmup_steps, MAX_WARMUP_STEPS),
        ("training.max_episode_steps", t.max_episode_steps, MAX_STEPS),
        ("action.max_retries", config.action.max_retries, MAX_STEPS),
        ("eval.every_episodes", config.eval.every_episodes, MAX_EPISODES),
        ("runtime.micro_batch_rows", config.runtime.micro_batch_rows, MAX_BATCH_ROWS),
        ("runtime.eval_batch_episodes", config.runtime.eval_batch_episodes, MAX_BATCH_ROWS),
        ("adapter.r", config.adapter.r, MAX_LORA_RANK),
    ];
    for (key, value, limit) in checks {
        if value > limit {
            return Some((key, format!("{value} is too large (at most {limit})")));
        }
    }
    for (key, value) in [("training.lr", t.lr), ("training.format_warmup_lr", t.format_warmup_lr)] {
        if value.is_finite() && value > MAX_LR {
            return Some((key, format!("{value:e} is too large (at most {MAX_LR})")));
        }
    }
    let episodes = t.group_size.saturating_mul(t.groups_per_iteration);
    if episodes > MAX_EPISODES_PER_ITERATION {
        return Some((
            "training.group_size",
            format!(
                "{} x {} groups = {episodes} episodes per iteration is too many (at most {MAX_EPISODES_PER_ITERATION})",
                t.group_size, t.groups_per_iteration
            ),
        ));
    }
    None
}
