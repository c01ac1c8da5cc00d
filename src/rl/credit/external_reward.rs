//! Reward functions in another process, any language:
//! `rewards.functions: [{name: external, command: [python3, my_reward.py], weight: 1.0}]`.
//!
//! Once per iteration every episode goes to the process in one JSON line, and one line comes back
//! with a reward per episode (or per seat of each episode). The exchange (docs in envs/README.md,
//! "Reward functions in any language"; `python/troupe_reward.py` serves a Python function
//! `fn(completions_agent0, completions_agent1, ..., batch_items) -> list[float]`):
//!
//! ```text
//! > {"id":0,"method":"score","episodes":[{"seed":7,"completions":[["..."],["..."]],"prompts":[["..."],["..."]],"returns":[1.0,1.0],"metrics":{"score":1.0}}]}
//! < {"id":0,"result":{"rewards":[0.5]}}
//! ```

use std::sync::Mutex;
use std::time::Duration;

use serde_json::{Map, Value};
use troupe_envs::external::process::{CallError, Process};

use super::rewards::RewardPipeline;
use crate::error::{Result, TroupeError};

/// The default time limit of one `score` exchange, in seconds.
const DEFAULT_TIMEOUT_S: f64 = 60.0;

/// What a reward function is told about one episode (shared with registered batch functions).
pub use troupe_envs::RewardItem;

/// The running processes of a pipeline's external reward functions, in the order listed.
pub struct ExternalRewards {
    functions: Vec<ExternalReward>,
}

/// One external reward function's process.
struct ExternalReward {
    command: String,
    process: Mutex<Process>,
}

impl ExternalRewards {
    /// Starts a process for each external function of `pipeline` (none: nothing starts).
    pub fn start(pipeline: &RewardPipeline) -> Result<Self> {
        let mut functions = Vec::new();
        for function in pipeline.external_functions() {
            let command = function.command.join(" ");
            let timeout = Duration::from_secs_f64(function.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S));
            let process = Process::start(&function.command, timeout)
                .map_err(|message| TroupeError::reward(format!("external {command}"), message))?;
            functions.push(ExternalReward { command, process: Mutex::new(process) });
        }
        Ok(Self { functions })
    }

    /// Whether there is no external function.
    pub fn is_empty(&self) -> bool {
        self.functions.is_empty()
    }

    /// Every external function's value for every seat of every episode: `[episode][seat][function]`.
    /// An answer that is not one finite number (or one per seat) per episode is an error naming
    /// the function's command and the answer.
    pub fn score(&self, items: &[RewardItem]) -> Result<Vec<Vec<Vec<f64>>>> {
        let mut values: Vec<Vec<Vec<f64>>> =
            items.iter().map(|item| vec![Vec::with_capacity(self.functions.len()); item.returns.len()]).collect();
        if self.functions.is_empty() {
            return Ok(values);
        }
        let episodes = serde_json::to_value(items).map_err(|e| TroupeError::reward("external", e.to_string()))?;
        for function in &self.functions {
            let fail = |message: String| TroupeError::reward(format!("external {}", function.command), message);
            let mut fields = Map::new();
            fields.insert("episodes".to_string(), episodes.clone());
            let mut process = function.process.lock().unwrap_or_else(|e| e.into_inner());
            let result = process.call("score", fields).map_err(|err| match err {
                CallError::Refused(message) => fail(format!("refused `score`: {message}")),
                CallError::Broken(message) => fail(message),
            })?;
            let rewards = result
                .get("rewards")
                .and_then(Value::as_array)
                .ok_or_else(|| fail(format!("answered `score` without a `rewards` list: {result}")))?;
            if rewards.len() != items.len() {
                return Err(fail(format!("answered {} rewards for {} episodes", rewards.len(), items.len())));
            }
            for (e, (reward, item)) in rewards.iter().zip(items).enumerate() {
                let seats = item.returns.len();
                let per_seat: Option<Vec<f64>> = match reward {
                    Value::Number(n) => n.as_f64().map(|x| vec![x; seats]),
                    Value::Array(list) if list.len() == seats => list.iter().map(Value::as_f64).collect(),
                    _ => None,
                };
                let per_seat = per_seat.filter(|v| v.iter().all(|x| x.is_finite())).ok_or_else(|| {
                    fail(format!("episode {e}: reward {reward} is not a finite number or a list of {seats}"))
                })?;
                for (seat, x) in per_seat.into_iter().enumerate() {
                    values[e][seat].push(x);
                }
            }
        }
        Ok(values)
    }
}
