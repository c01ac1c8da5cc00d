//! Rewards (DESIGN.md, "Training"): one or more named reward functions, each with a weight,
//! summed into one number per seat; then reward processors (identity, scale, clamp, sigmoid)
//! applied in order.
//!
//! This is pure arithmetic on what an episode reports ([`SeatOutcome`]: the seat's return, its
//! invalid-action count, the episode metrics, and the values external reward functions gave it
//! — those are computed beforehand by [`crate::rl::credit::external_reward`]), so it does not depend on how
//! rollouts are run.

use serde::{Deserialize, Serialize};
use troupe_envs::EpisodeMetrics;

use crate::error::{EnvironmentError, Result, TroupeError};

crate::section::config_section! {
    /// `rewards:` — weighted reward functions, then processors in order.
    pub struct RewardsConfig {
        /// The functions summed (`env_return`, `score`, `invalid_actions`, `external`, a
        /// registered one), each with a weight.
        pub functions: Vec<WeightedReward> = vec![WeightedReward::builtin(RewardFunction::EnvReturn, 1.0)],
        /// Applied in order to the sum: `identity`, `scale {factor}`, `clamp {min, max}`,
        /// `sigmoid`.
        pub processors: Vec<RewardProcessor> = vec![RewardProcessor::Identity],
    }
}

impl RewardsConfig {
    /// The reward pipeline these sections describe (checked: weights, processors' ranges).
    pub fn pipeline(&self) -> Result<RewardPipeline> {
        RewardPipeline::new(self.functions.clone(), self.processors.clone())
    }
}

/// A reward function, by the name configs use (`rewards.functions[i].name`): a built-in one,
/// `external`, or any other name, which must be registered in the [`troupe_envs::Registry`]
/// (`register_reward`) by a plug-in.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum RewardFunction {
    /// The environment's return for the seat (the sum of its step rewards).
    EnvReturn,
    /// The episode metric `score` (the same for every seat of the episode).
    Score,
    /// Minus the number of invalid actions the seat produced.
    InvalidActions,
    /// A reward function in another process, any language (`command`), called with every
    /// episode's completions in one batch ([`crate::rl::credit::external_reward`]).
    External,
    /// A function a plug-in registered under this name.
    Registered(String),
}

impl From<String> for RewardFunction {
    fn from(name: String) -> Self {
        match name.as_str() {
            "env_return" => RewardFunction::EnvReturn,
            "score" => RewardFunction::Score,
            "invalid_actions" => RewardFunction::InvalidActions,
            "external" => RewardFunction::External,
            _ => RewardFunction::Registered(name),
        }
    }
}

impl From<RewardFunction> for String {
    fn from(function: RewardFunction) -> Self {
        function.name().to_string()
    }
}

impl RewardFunction {
    /// The name configs use.
    pub fn name(&self) -> &str {
        match self {
            RewardFunction::Registered(name) => name,
            RewardFunction::EnvReturn => "env_return",
            RewardFunction::Score => "score",
            RewardFunction::InvalidActions => "invalid_actions",
            RewardFunction::External => "external",
        }
    }

    /// Whether the value comes from outside the pipeline (an external process or a registered
    /// function), computed beforehand into [`SeatOutcome::computed`].
    pub fn is_computed(&self) -> bool {
        matches!(self, RewardFunction::External | RewardFunction::Registered(_))
    }

    /// The value of this function for one seat's outcome; a computed function (see
    /// [`RewardFunction::is_computed`]) reads `outcome.computed[index]`. `score` is an error when
    /// the environment does not report that metric.
    pub fn evaluate(&self, outcome: &SeatOutcome<'_>, index: usize) -> Result<f64> {
        match self {
            RewardFunction::External | RewardFunction::Registered(_) => {
                outcome.computed.get(index).copied().ok_or_else(|| TroupeError::reward(self.name(), "gave no value"))
            }
            RewardFunction::EnvReturn => Ok(outcome.env_return),
            RewardFunction::Score => outcome.metrics.get("score").copied().ok_or_else(|| {
                TroupeError::Environment(EnvironmentError::MissingMetric {
                    function: self.name().to_string(),
                    metric: "score".to_string(),
                    known: outcome.metrics.keys().cloned().collect::<Vec<_>>().join(", "),
                })
            }),
            RewardFunction::InvalidActions => Ok(-(outcome.invalid_actions as f64)),
        }
    }
}

/// A reward function with its weight (`{name: env_return, weight: 1.0}`, or
/// `{name: external, command: [python3, my_reward.py], weight: 1.0, timeout_s: 60, label: length}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedReward {
    /// The function.
    pub name: RewardFunction,
    /// Its weight in the sum (default 1).
    #[serde(default = "one")]
    pub weight: f64,
    /// For `external`: the process's argv, run from troupe's working directory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// For `external`: the longest wait for one batch's answer, in seconds (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// The name the function's own metrics go under (`rewards/<label>/mean` and `/std` in
    /// `metrics.jsonl`, `rewards.<label>` in `troupe eval`). Default: the function's name; for
    /// `external`, the file name without its extension of the command's last argument
    /// (`[python3, rewards/same_length.py]`: `same_length`). See
    /// [`RewardPipeline::labels`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

impl WeightedReward {
    /// A built-in function with its weight.
    pub fn builtin(name: RewardFunction, weight: f64) -> Self {
        Self { name, weight, command: Vec::new(), timeout_s: None, label: None }
    }

    /// The label when none is given: the function's name, or for `external` the stem of the
    /// command's last argument when that is a plain file name (else `external`).
    fn default_label(&self) -> String {
        if self.name == RewardFunction::External {
            let stem = self
                .command
                .last()
                .and_then(|arg| std::path::Path::new(arg).file_stem())
                .and_then(|stem| stem.to_str())
                .filter(|stem| is_label(stem));
            if let Some(stem) = stem {
                return stem.to_string();
            }
        }
        self.name.name().to_string()
    }
}

/// Whether `text` may name a reward function's metrics: letters, digits, `_`, `-` and `.`,
/// not starting with `-` or `.`.
fn is_label(text: &str) -> bool {
    !text.is_empty()
        && !text.starts_with(['-', '.'])
        && text.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

fn one() -> f64 {
    1.0
}

/// A transformation of the summed reward; processors are applied in the order listed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RewardProcessor {
    /// Leaves the reward as it is.
    Identity,
    /// Multiplies the reward by `factor`.
    Scale {
        /// The multiplier.
        factor: f64,
    },
    /// Limits the reward to `[min, max]`.
    Clamp {
        /// The lower bound.
        min: f64,
        /// The upper bound (at least `min`).
        max: f64,
    },
    /// The logistic function `1 / (1 + e^-x)`, mapping any reward into (0, 1).
    Sigmoid,
}

impl RewardProcessor {
    /// Applies the processor to `x`.
    pub fn apply(&self, x: f64) -> f64 {
        match *self {
            RewardProcessor::Identity => x,
            RewardProcessor::Scale { factor } => x * factor,
            // Not `f64::clamp`, which panics when min > max; `validate` refuses that case.
            RewardProcessor::Clamp { min, max } => x.max(min).min(max),
            RewardProcessor::Sigmoid => sigmoid(x),
        }
    }

    /// Checks the parameters: finite numbers, and `min <= max` for a clamp. The error names the
    /// offending field.
    pub fn validate(&self) -> std::result::Result<(), (&'static str, String)> {
        match *self {
            RewardProcessor::Identity | RewardProcessor::Sigmoid => Ok(()),
            RewardProcessor::Scale { factor } if !factor.is_finite() => {
                Err(("factor", format!("{factor} is not a finite number")))
            }
            RewardProcessor::Scale { .. } => Ok(()),
            RewardProcessor::Clamp { min, .. } if min.is_nan() => Err(("min", "is not a number".to_string())),
            RewardProcessor::Clamp { max, .. } if max.is_nan() => Err(("max", "is not a number".to_string())),
            RewardProcessor::Clamp { min, max } if min > max => Err(("max", format!("{max} is below min {min}"))),
            RewardProcessor::Clamp { .. } => Ok(()),
        }
    }
}

/// The logistic function, computed without overflow for large |x|.
fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// What the reward functions read about one seat's finished episode.
#[derive(Clone, Copy, Debug)]
pub struct SeatOutcome<'a> {
    /// The seat's environment return (sum of its step rewards).
    pub env_return: f64,
    /// How many of the seat's replies were not legal actions.
    pub invalid_actions: usize,
    /// The episode's metrics (`score`, ...), shared by all seats.
    pub metrics: &'a EpisodeMetrics,
    /// What each computed function (external, registered) gave this seat, in listed order.
    pub computed: &'a [f64],
}

/// The configured reward: weighted functions, then processors.
#[derive(Clone, Debug, PartialEq)]
pub struct RewardPipeline {
    functions: Vec<WeightedReward>,
    processors: Vec<RewardProcessor>,
}

impl RewardPipeline {
    /// A pipeline summing `functions` and applying `processors` in order. Fails when no function
    /// is given, a weight is not finite, or a processor's parameters are invalid.
    pub fn new(functions: Vec<WeightedReward>, processors: Vec<RewardProcessor>) -> Result<Self> {
        if functions.is_empty() {
            return Err(TroupeError::setting("rewards.functions", "at least one reward function is needed"));
        }
        for (i, function) in functions.iter().enumerate() {
            if !function.weight.is_finite() {
                return Err(TroupeError::setting(
                    format!("rewards.functions[{i}].weight"),
                    format!("{} is not a finite number", function.weight),
                ));
            }
            let external = function.name == RewardFunction::External;
            if external && function.command.first().is_none_or(|c| c.is_empty()) {
                return Err(TroupeError::setting(
                    format!("rewards.functions[{i}].command"),
                    "an external reward function needs a command, e.g. [python3, my_reward.py]",
                ));
            }
            if !external && (!function.command.is_empty() || function.timeout_s.is_some()) {
                return Err(TroupeError::setting(
                    format!("rewards.functions[{i}].command"),
                    format!(
                        "only an external reward function takes a command or timeout_s, not {}",
                        function.name.name()
                    ),
                ));
            }
            if let Some(t) = function.timeout_s.filter(|t| !(t.is_finite() && *t > 0.0)) {
                return Err(TroupeError::setting(
                    format!("rewards.functions[{i}].timeout_s"),
                    format!("{t} is not a positive number of seconds"),
                ));
            }
            if let Some(label) = function.label.as_deref().filter(|l| !is_label(l)) {
                return Err(TroupeError::setting(
                    format!("rewards.functions[{i}].label"),
                    format!("{label:?} is not a metric name: use letters, digits, `_`, `-` and `.` (not first)"),
                ));
            }
        }
        for (i, function) in functions.iter().enumerate() {
            let Some(label) = &function.label else { continue };
            if let Some(j) = functions[..i].iter().position(|f| f.label.as_ref() == Some(label)) {
                return Err(TroupeError::setting(
                    format!("rewards.functions[{i}].label"),
                    format!("{label:?} is also the label of rewards.functions[{j}]; give each its own"),
                ));
            }
        }
        for (i, processor) in processors.iter().enumerate() {
            processor.validate().map_err(|(field, message)| {
                TroupeError::setting(format!("rewards.processors[{i}].{field}"), message)
            })?;
        }
        Ok(Self { functions, processors })
    }

    /// The weighted functions.
    pub fn functions(&self) -> &[WeightedReward] {
        &self.functions
    }

    /// The processors, in the order they are applied.
    pub fn processors(&self) -> &[RewardProcessor] {
        &self.processors
    }

    /// The external functions, in order.
    pub fn external_functions(&self) -> impl Iterator<Item = &WeightedReward> {
        self.functions.iter().filter(|f| f.name == RewardFunction::External)
    }

    /// The computed functions (external or registered), in the order [`SeatOutcome::computed`]
    /// holds their values.
    pub fn computed_functions(&self) -> impl Iterator<Item = &WeightedReward> {
        self.functions.iter().filter(|f| f.name.is_computed())
    }

    /// The name each function's own metrics go under, in listed order: its `label`, else the
    /// default ([`WeightedReward::label`]); a default that repeats an earlier label gets `_2`,
    /// `_3`, ... (two unlabelled `external` functions of `score.py` are `score` and `score_2`).
    pub fn labels(&self) -> Vec<String> {
        let mut labels: Vec<String> = Vec::with_capacity(self.functions.len());
        let given: Vec<&str> = self.functions.iter().filter_map(|f| f.label.as_deref()).collect();
        for function in &self.functions {
            let label = match &function.label {
                Some(label) => label.clone(),
                None => {
                    let base = function.default_label();
                    let taken = |l: &str| given.contains(&l) || labels.iter().any(|x| x == l);
                    let mut label = base.clone();
                    let mut n = 2;
                    while taken(&label) {
                        label = format!("{base}_{n}");
                        n += 1;
                    }
                    label
                }
            };
            labels.push(label);
        }
        labels
    }

    /// Each function's own value for one seat, unweighted, in listed order (what its metrics
    /// report). A value that is not finite is an error naming the function.
    pub fn function_values(&self, outcome: &SeatOutcome<'_>) -> Result<Vec<f64>> {
        let mut values = Vec::with_capacity(self.functions.len());
        let mut computed = 0;
        for function in &self.functions {
            let value = function.name.evaluate(outcome, computed)?;
            computed += usize::from(function.name.is_computed());
            if !value.is_finite() {
                return Err(TroupeError::reward(function.name.name(), format!("gave {value}")));
            }
            values.push(value);
        }
        Ok(values)
    }

    /// The weighted sum of the functions, before processing.
    pub fn raw(&self, outcome: &SeatOutcome<'_>) -> Result<f64> {
        let values = self.function_values(outcome)?;
        Ok(self.functions.iter().zip(values).map(|(function, value)| function.weight * value).sum())
    }

    /// The processed reward of one seat.
    pub fn reward(&self, outcome: &SeatOutcome<'_>) -> Result<f64> {
        let raw = self.raw(outcome)?;
        Ok(self.processors.iter().fold(raw, |x, processor| processor.apply(x)))
    }

    /// The processed reward of every seat of an episode: `returns[s]` and `invalid_actions[s]`
    /// belong to seat `s`; `metrics` are the episode's.
    pub fn episode_rewards(
        &self,
        returns: &[f64],
        invalid_actions: &[usize],
        metrics: &EpisodeMetrics,
    ) -> Result<Vec<f64>> {
        if self.computed_functions().next().is_some() {
            return Err(TroupeError::setting(
                "rewards.functions",
                "computed reward values are needed (see shaped_step_rewards)",
            ));
        }
        if returns.len() != invalid_actions.len() {
            return Err(TroupeError::invalid(
                "invalid_actions",
                format!("{} seats of invalid counts for {} seats of returns", invalid_actions.len(), returns.len()),
            ));
        }
        returns
            .iter()
            .zip(invalid_actions)
            .map(|(&env_return, &invalid_actions)| {
                self.reward(&SeatOutcome { env_return, invalid_actions, metrics, computed: &[] })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(score: f64) -> EpisodeMetrics {
        [("score".to_string(), score), ("lives_lost".to_string(), 1.0)].into_iter().collect()
    }

    fn weighted(name: RewardFunction, weight: f64) -> WeightedReward {
        WeightedReward::builtin(name, weight)
    }

    #[test]
    fn processors_compute_their_functions() {
        assert_eq!(RewardProcessor::Identity.apply(-3.5), -3.5);
        assert_eq!(RewardProcessor::Scale { factor: 0.5 }.apply(-3.0), -1.5);
        let clamp = RewardProcessor::Clamp { min: -1.0, max: 2.0 };
        assert_eq!((clamp.apply(-5.0), clamp.apply(0.25), clamp.apply(9.0)), (-1.0, 0.25, 2.0));
        assert_eq!(RewardProcessor::Sigmoid.apply(0.0), 0.5);
        assert!((RewardProcessor::Sigmoid.apply(2.0) - 0.880_797_077_977_882_3).abs() < 1e-15);
        assert!((RewardProcessor::Sigmoid.apply(-2.0) - 0.119_202_922_022_117_6).abs() < 1e-15);
        // Large magnitudes saturate instead of overflowing to NaN.
        assert_eq!(RewardProcessor::Sigmoid.apply(1000.0), 1.0);
        assert_eq!(RewardProcessor::Sigmoid.apply(-1000.0), 0.0);
    }

    #[test]
    fn processors_apply_in_order() {
        let scale_then_clamp = RewardPipeline::new(
            vec![weighted(RewardFunction::EnvReturn, 1.0)],
            vec![RewardProcessor::Scale { factor: 10.0 }, RewardProcessor::Clamp { min: 0.0, max: 5.0 }],
        )
        .unwrap();
        let clamp_then_scale = RewardPipeline::new(
            vec![weighted(RewardFunction::EnvReturn, 1.0)],
            vec![RewardProcessor::Clamp { min: 0.0, max: 5.0 }, RewardProcessor::Scale { factor: 10.0 }],
        )
        .unwrap();
        let m = metrics(0.0);
        let outcome = SeatOutcome { env_return: 2.0, invalid_actions: 0, metrics: &m, computed: &[] };
        assert_eq!(scale_then_clamp.reward(&outcome).unwrap(), 5.0);
        assert_eq!(clamp_then_scale.reward(&outcome).unwrap(), 20.0);
    }

    #[test]
    fn functions_are_weighted_and_summed_per_seat() {
        let pipeline = RewardPipeline::new(
            vec![
                weighted(RewardFunction::EnvReturn, 1.0),
                weighted(RewardFunction::Score, 0.5),
                weighted(RewardFunction::InvalidActions, 2.0),
            ],
            vec![RewardProcessor::Identity],
        )
        .unwrap();
        let m = metrics(4.0);
        // seat 0: 3 + 0.5 * 4 - 2 * 1 = 3; seat 1: -1 + 2 - 2 * 3 = -5.
        let rewards = pipeline.episode_rewards(&[3.0, -1.0], &[1, 3], &m).unwrap();
        assert_eq!(rewards, vec![3.0, -5.0]);
        let outcome = SeatOutcome { env_return: 3.0, invalid_actions: 1, metrics: &m, computed: &[] };
        assert_eq!(pipeline.raw(&outcome).unwrap(), 3.0);
    }

    #[test]
    fn missing_score_metric_is_named() {
        let pipeline = RewardPipeline::new(vec![weighted(RewardFunction::Score, 1.0)], vec![]).unwrap();
        let m: EpisodeMetrics = [("turns".to_string(), 3.0)].into_iter().collect();
        let err = pipeline.episode_rewards(&[1.0], &[0], &m).unwrap_err().to_string();
        assert!(err.contains("`score`") && err.contains("turns"), "{err}");
    }

    #[test]
    fn bad_pipelines_are_refused() {
        let env_return = || vec![weighted(RewardFunction::EnvReturn, 1.0)];
        assert!(RewardPipeline::new(vec![], vec![]).is_err());
        assert!(RewardPipeline::new(vec![weighted(RewardFunction::Score, f64::NAN)], vec![]).is_err());
        let err = RewardPipeline::new(env_return(), vec![RewardProcessor::Clamp { min: 1.0, max: 0.0 }])
            .unwrap_err()
            .to_string();
        assert!(err.contains("rewards.processors[0].max"), "{err}");
        assert!(RewardPipeline::new(env_return(), vec![RewardProcessor::Scale { factor: f64::INFINITY }]).is_err());
        let pipeline = RewardPipeline::new(env_return(), vec![]).unwrap();
        let m = metrics(0.0);
        assert!(pipeline.episode_rewards(&[1.0, 2.0], &[0], &m).is_err(), "seat counts differ");
        assert!(pipeline.episode_rewards(&[f64::NAN], &[0], &m).is_err(), "a NaN return is refused");
    }

    #[test]
    fn every_function_has_a_label_of_its_own() {
        let external = |command: &[&str], label: Option<&str>| WeightedReward {
            command: command.iter().map(|c| c.to_string()).collect(),
            label: label.map(str::to_string),
            ..weighted(RewardFunction::External, 1.0)
        };
        let pipeline = RewardPipeline::new(
            vec![
                weighted(RewardFunction::EnvReturn, 1.0),
                external(&["python3", "rewards/same_length.py"], None),
                external(&["python3", "rewards/same_length.py", "--strict"], Some("strict")),
                external(&["./same_length.py"], None),
                external(&["sh", "-c", "exec python3 x.py"], None),
                weighted(RewardFunction::Registered("mine".into()), 1.0),
            ],
            vec![],
        )
        .unwrap();
        assert_eq!(pipeline.labels(), ["env_return", "same_length", "strict", "same_length_2", "external", "mine"]);

        let m = metrics(4.0);
        let outcome =
            SeatOutcome { env_return: 3.0, invalid_actions: 2, metrics: &m, computed: &[0.5, 1.5, 2.5, 3.5, 4.5] };
        assert_eq!(pipeline.function_values(&outcome).unwrap(), [3.0, 0.5, 1.5, 2.5, 3.5, 4.5]);

        let err = RewardPipeline::new(vec![external(&["x.py"], Some("a/b"))], vec![]).unwrap_err().to_string();
        assert!(err.contains("rewards.functions[0].label") && err.contains("\"a/b\""), "{err}");
        let err = RewardPipeline::new(
            vec![
                WeightedReward { label: Some("same".into()), ..weighted(RewardFunction::EnvReturn, 1.0) },
                external(&["x.py"], Some("same")),
            ],
            vec![],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("rewards.functions[1].label") && err.contains("rewards.functions[0]"), "{err}");
    }

    #[test]
    fn processors_parse_from_yaml() {
        let parsed: Vec<RewardProcessor> = serde_yaml::from_str(
            "[{type: identity}, {type: scale, factor: 2}, {type: clamp, min: -1, max: 1}, {type: sigmoid}]",
        )
        .unwrap();
        assert_eq!(
            parsed,
            vec![
                RewardProcessor::Identity,
                RewardProcessor::Scale { factor: 2.0 },
                RewardProcessor::Clamp { min: -1.0, max: 1.0 },
                RewardProcessor::Sigmoid,
            ]
        );
        assert!(serde_yaml::from_str::<RewardProcessor>("{type: scale, factor: 2, extra: 1}").is_err());
        assert!(serde_yaml::from_str::<RewardProcessor>("{type: softmax}").is_err());
        assert!(serde_yaml::from_str::<WeightedReward>("{name: score, weight: 1, x: 2}").is_err());
    }
}
