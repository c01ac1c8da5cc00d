//! Objectives: how the rows of a [`super::credit::batch::TrainBatch`] become a loss (TRL's
//! `_compute_loss`, alone). The config is `training.objective` ([`ObjectiveConfig`]) with
//! `training.kl` for the penalty to the base model.
//!
//! - `magrpo` (the default): on-policy, one update per iteration, `-A x log p` per unit (a reply
//!   token, or a `choice` decision).
//! - `clipped`: the importance-ratio objective of PPO / GRPO, `-min(r A, clip(r, 1 - clip_low,
//!   1 + clip_high) A)`, with `r = exp(log p - log p_sampled)` per token (`ratio: token`) or the
//!   geometric mean over a reply's tokens (`ratio: sequence`, as GSPO), and
//!   `epochs_per_iteration` optimizer steps on each iteration's batch. With one epoch its
//!   gradient is MAGRPO's (the ratio is 1 where the policy has not moved).
//!
//! Each agent's loss is normalised ([`LossNormalization`]): the mean over its units in the batch
//! (today's MAGRPO), the mean over its sequences of each sequence's token mean (GRPO as first
//! written), or a constant `rows x max_new_tokens` (Dr. GRPO), so summing agents' losses gives
//! every adapter exactly its own agent's gradient.

use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TroupeError};
use crate::readback::{self, Stage};

/// Which objective turns a batch into a loss (`training.objective.kind`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectiveKind {
    /// On-policy `-A log p`, one optimizer step per iteration.
    #[default]
    Magrpo,
    /// The clipped importance-ratio objective, `epochs_per_iteration` steps per iteration.
    Clipped,
}

/// Where the clipped objective's importance ratio is taken (`training.objective.ratio`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    /// One ratio per token (PPO, GRPO).
    #[default]
    Token,
    /// One ratio per reply: `exp(mean over its tokens of log p - log p_sampled)` (GSPO).
    Sequence,
}

/// How an agent's summed per-unit losses are divided (`training.objective.loss_normalization`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossNormalization {
    /// By the agent's units (reply tokens, or decisions) in the batch: every token weighs the
    /// same (DAPO's token-level mean; troupe's MAGRPO).
    #[default]
    AgentTokenMean,
    /// Each sequence's token mean, then the mean over the agent's sequences (GRPO as first
    /// written): every reply weighs the same whatever its length.
    SequenceMean,
    /// By `rows x action.max_new_tokens` (a `choice` decision counts as one unit out of one):
    /// a constant, so reply length biases nothing (Dr. GRPO).
    Constant,
}

/// The per-token estimator of KL(policy || base) (`training.kl_estimator`). In `choice` mode
/// the KL over a decision's candidates is computed exactly and this does not apply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `log p - log p_ref`: unbiased, can be negative per token.
    K1,
    /// `exp(ref - logp) - (ref - logp) - 1`: unbiased, never negative (GRPO's choice).
    #[default]
    K3,
}

crate::section::config_section! {
    /// `training.objective:` — the objective and its knobs.
    pub struct ObjectiveConfig {
        /// `magrpo` or `clipped`.
        pub kind: ObjectiveKind = ObjectiveKind::Magrpo,
        /// Optimizer steps on each iteration's batch (`clipped` only; `magrpo` takes exactly 1).
        pub epochs_per_iteration: usize = 1,
        /// The ratio may fall to `1 - clip_low` before the objective stops rewarding a decrease.
        pub clip_low: f64 = 0.2,
        /// The ratio may rise to `1 + clip_high` (DAPO's "clip higher" sets it above `clip_low`).
        pub clip_high: f64 = 0.2,
        /// `token` or `sequence`.
        pub ratio: RatioLevel = RatioLevel::Token,
        /// `agent_token_mean`, `sequence_mean` or `constant`.
        pub loss_normalization: LossNormalization = LossNormalization::AgentTokenMean,
    }
}

impl ObjectiveConfig {
    /// Checks the knobs; an error is `(field, message)` with the field under `training.objective`.
    pub fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        if self.epochs_per_iteration == 0 {
            return Err(("epochs_per_iteration", "must be at least 1".into()));
        }
        if self.kind == ObjectiveKind::Magrpo && self.epochs_per_iteration != 1 {
            return Err((
                "epochs_per_iteration",
                format!(
                    "{} epochs need `kind: clipped` (magrpo is on-policy: one update per batch)",
                    self.epochs_per_iteration
                ),
            ));
        }
        for (field, value) in [("clip_low", self.clip_low), ("clip_high", self.clip_high)] {
            if !(value.is_finite() && value > 0.0) {
                return Err((field, format!("{value} is not a positive number")));
            }
        }
        if self.clip_low >= 1.0 {
            return Err(("clip_low", format!("{} would let the ratio's lower bound reach 0 or below", self.clip_low)));
        }
        Ok(())
    }

    /// Optimizer steps per iteration.
    pub fn epochs(&self) -> usize {
        match self.kind {
            ObjectiveKind::Magrpo => 1,
            ObjectiveKind::Clipped => self.epochs_per_iteration.max(1),
        }
    }

    /// The divisor of one row's per-unit losses: an agent with `agent_rows` rows and
    /// `agent_units` units in the batch, this row having `row_units` of at most
    /// `max_row_units` (`action.max_new_tokens` for a reply, 1 for a decision), and
    /// `agents_sharing` agents training one adapter (1 per agent).
    pub fn denominator(
        &self,
        agent_units: usize,
        agent_rows: usize,
        row_units: usize,
        max_row_units: usize,
        agents_sharing: usize,
    ) -> f64 {
        let sharing = agents_sharing.max(1) as f64;
        match self.loss_normalization {
            LossNormalization::AgentTokenMean => agent_units.max(1) as f64 * sharing,
            LossNormalization::SequenceMean => (agent_rows.max(1) * row_units.max(1)) as f64 * sharing,
            LossNormalization::Constant => (agent_rows.max(1) * max_row_units.max(row_units).max(1)) as f64 * sharing,
        }
    }
}

crate::section::config_section! {
    /// `training.kl:` — the KL penalty to the base model (adapters switched off, so the
    /// reference costs no second model): its weight and estimator.
    pub struct KlPenalty {
        /// Weight of the penalty (0: off, and no reference is computed).
        pub coef: f64 = 0.0,
        /// The per-token estimator: `k3` (never negative) or `k1` (`log p - log p_ref`).
        pub estimator: KlEstimator = KlEstimator::K3,
    }
}

/// The host-side terms of one micro-batch's rows, aligned with its `[rows, positions]` scores
/// (for `choice` rows, `positions` is 1: the decision).
#[derive(Clone, Debug, PartialEq)]
pub struct RowTerms {
    /// Per row: its advantage.
    pub advantage: Vec<f64>,
    /// Per row: the divisor of its units' losses ([`ObjectiveConfig::denominator`]).
    pub denominator: Vec<f64>,
    /// `[rows][positions]`: whether a position is one of the row's units.
    pub counted: Vec<Vec<bool>>,
    /// `[rows][positions]`: the log-probability recorded at sampling, at counted positions (0
    /// elsewhere); read by the clipped objective only.
    pub sampled: Vec<Vec<f32>>,
}

impl RowTerms {
    /// Number of counted units.
    pub fn units(&self) -> usize {
        self.counted.iter().flatten().filter(|c| **c).count()
    }

    /// A `[rows, positions]` tensor of `value(row)` at counted positions, 0 elsewhere.
    fn per_row(&self, device: &Device, value: impl Fn(usize) -> f32) -> Tensor<2> {
        let rows = self.counted.len();
        let positions = self.counted.first().map_or(0, Vec::len);
        let values: Vec<f32> = self
            .counted
            .iter()
            .enumerate()
            .flat_map(|(r, c)| {
                let v = value(r);
                c.iter().map(move |&c| if c { v } else { 0.0 })
            })
            .collect();
        Tensor::from_data(TensorData::new(values, [rows, positions]), device)
    }

    fn mask(&self, device: &Device) -> Tensor<2> {
        self.per_row(device, |_| 1.0)
    }

    fn sampled_tensor(&self, device: &Device) -> Tensor<2> {
        let rows = self.sampled.len();
        let positions = self.sampled.first().map_or(0, Vec::len);
        let values: Vec<f32> = self.sampled.iter().flatten().copied().collect();
        Tensor::from_data(TensorData::new(values, [rows, positions]), device)
    }
}

/// What a micro-batch's loss measured besides its value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossStats {
    /// Sum of the KL estimate over counted units (0 without a penalty).
    pub kl_sum: f64,
    /// Units the KL was summed over.
    pub kl_units: usize,
    /// Units whose ratio lay outside `[1 - clip_low, 1 + clip_high]` (clipped objective).
    pub clipped_units: usize,
    /// Units whose ratio was measured (clipped objective).
    pub ratio_units: usize,
}

impl LossStats {
    /// Adds `other`'s counts and sums to these.
    pub fn add(&mut self, other: &LossStats) {
        self.kl_sum += other.kl_sum;
        self.kl_units += other.kl_units;
        self.clipped_units += other.clipped_units;
        self.ratio_units += other.ratio_units;
    }
}

/// An objective ready to compute losses: its config and the KL penalty.
#[derive(Clone, Debug, PartialEq)]
pub struct Objective {
    /// The objective's knobs.
    pub config: ObjectiveConfig,
    /// The KL penalty to the base model.
    pub kl: KlPenalty,
}

impl Objective {
    /// The loss of a micro-batch of reply rows: their next-token log-probs under the policy
    /// being trained, and the base model's (`reference`, no gradient) when the penalty is on.
    ///
    /// # Shapes
    /// `logprobs`, `reference`: `[rows, positions]` -> `[1]`
    pub fn token_loss(
        &self,
        logprobs: Tensor<2>,
        terms: &RowTerms,
        reference: Option<Tensor<2>>,
    ) -> Result<(Tensor<1>, LossStats)> {
        check_shape(&logprobs, terms)?;
        let device = logprobs.device();
        let mut stats = LossStats::default();
        let mut loss = self.surrogate(logprobs.clone(), terms, &mut stats, true);
        if let (Some(reference), true) = (reference, self.kl.coef > 0.0) {
            let mask = terms.mask(&device);
            let estimate = match self.kl.estimator {
                KlEstimator::K3 => k3_estimate(reference.detach(), logprobs),
                KlEstimator::K1 => logprobs - reference.detach(),
            };
            stats.kl_sum += f64::from(readback::to_scalar((estimate.clone().detach() * mask).sum(), Stage::Update)?);
            stats.kl_units += terms.units();
            let weight = terms.per_row(&device, |r| (self.kl.coef / terms.denominator[r]) as f32);
            loss = loss + (estimate * weight).sum();
        }
        Ok((loss, stats))
    }

    /// The loss of a micro-batch of `choice` decisions: `log_policy` is each decision's
    /// log-probability over its candidates (absent candidates far below), `chosen` the one
    /// taken, `terms` one position per row; `reference` the base model's log-policy (no
    /// gradient) when the penalty is on, whose KL over the candidates is exact.
    ///
    /// # Shapes
    /// `log_policy`, `reference`: `[rows, candidates]`; `chosen`: `[rows, 1]` -> `[1]`
    pub fn choice_loss(
        &self,
        log_policy: Tensor<2>,
        chosen: Tensor<2, burn::tensor::Int>,
        terms: &RowTerms,
        reference: Option<Tensor<2>>,
    ) -> Result<(Tensor<1>, LossStats)> {
        let taken = log_policy.clone().gather(1, chosen);
        check_shape(&taken, terms)?;
        let device = taken.device();
        let mut stats = LossStats::default();
        let mut loss = self.surrogate(taken, terms, &mut stats, false);
        if let (Some(reference), true) = (reference, self.kl.coef > 0.0) {
            let kl = (log_policy.clone().exp() * (log_policy - reference.detach())).sum_dim(1);
            stats.kl_sum += f64::from(readback::to_scalar(kl.clone().detach().sum(), Stage::Update)?);
            stats.kl_units += terms.units();
            let weight = terms.per_row(&device, |r| (self.kl.coef / terms.denominator[r]) as f32);
            loss = loss + (kl * weight).sum();
        }
        Ok((loss, stats))
    }

    /// The policy term: `-sum(A / d x log p)` (MAGRPO) or the clipped surrogate's, over
    /// counted units. `per_token` says the positions are reply tokens (where a sequence-level
    /// ratio averages over a row's positions).
    fn surrogate(&self, logp: Tensor<2>, terms: &RowTerms, stats: &mut LossStats, per_token: bool) -> Tensor<1> {
        let device = logp.device();
        match self.config.kind {
            ObjectiveKind::Magrpo => {
                let weights = terms.per_row(&device, |r| (terms.advantage[r] / terms.denominator[r]) as f32);
                (logp * weights).sum().neg()
            }
            ObjectiveKind::Clipped => {
                let mask = terms.mask(&device);
                let log_ratio = (logp - terms.sampled_tensor(&device)) * mask.clone();
                let ratio = match (self.config.ratio, per_token) {
                    (RatioLevel::Sequence, true) => {
                        let [rows, positions] = log_ratio.dims();
                        let counts: Vec<f32> =
                            terms.counted.iter().map(|c| c.iter().filter(|c| **c).count().max(1) as f32).collect();
                        let counts = Tensor::<2>::from_data(TensorData::new(counts, [rows, 1]), &device);
                        (log_ratio.sum_dim(1) / counts).exp().expand([rows, positions])
                    }
                    _ => log_ratio.exp(),
                };
                let (low, high) = (1.0 - self.config.clip_low, 1.0 + self.config.clip_high);
                // A statistic only: a device failure leaves it empty and the loss's read, which
                // follows in the same micro-batch, reports it.
                let values = ratio
                    .clone()
                    .detach()
                    .try_into_data()
                    .ok()
                    .and_then(|d| d.try_into_vec::<f32>().ok())
                    .unwrap_or_default();
                for (v, c) in values.iter().zip(terms.counted.iter().flatten()) {
                    if *c {
                        stats.ratio_units += 1;
                        stats.clipped_units += usize::from(f64::from(*v) < low || f64::from(*v) > high);
                    }
                }
                let advantage = terms.per_row(&device, |r| terms.advantage[r] as f32);
                let unclipped = ratio.clone() * advantage.clone();
                let clipped = ratio.clamp(low, high) * advantage;
                let weights = terms.per_row(&device, |r| (1.0 / terms.denominator[r]) as f32);
                (unclipped.min_pair(clipped) * weights).sum().neg()
            }
        }
    }
}

fn check_shape(scores: &Tensor<2>, terms: &RowTerms) -> Result<()> {
    let dims = scores.dims();
    let rows = terms.counted.len();
    let positions = terms.counted.first().map_or(0, Vec::len);
    if rows != dims[0] || positions != dims[1] || terms.advantage.len() != rows || terms.denominator.len() != rows {
        return Err(TroupeError::invalid(
            "terms",
            format!("{rows} rows x {positions} positions do not match the scores {dims:?}"),
        ));
    }
    Ok(())
}

/// The non-negative per-token KL estimator `k3 = exp(ref - logp) - (ref - logp) - 1` of
/// KL(policy || reference), from the sampled tokens' log-probs under each.
///
/// # Shapes
/// `reference`, `logprobs`: `[rows, positions]` -> `[rows, positions]`
pub fn k3_estimate(reference: Tensor<2>, logprobs: Tensor<2>) -> Tensor<2> {
    let diff = reference - logprobs;
    diff.clone().exp() - diff - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: Vec<f32>, dims: [usize; 2]) -> Tensor<2> {
        Tensor::from_data(TensorData::new(values, dims), &Device::flex().autodiff()).require_grad()
    }

    /// A group of four one-token-or-longer replies of one agent with known returns 1, 2, 3, 6
    /// (advantages -2, -1, 0, 3 under the mean baseline without scaling).
    fn group_of_four() -> RowTerms {
        RowTerms {
            advantage: vec![-2.0, -1.0, 0.0, 3.0],
            denominator: vec![5.0; 4], // 5 tokens in all: agent token mean
            counted: vec![vec![true, true], vec![true, false], vec![true, false], vec![true, false]],
            sampled: vec![vec![-1.0, -2.0], vec![-0.5, 0.0], vec![-1.0, 0.0], vec![-2.0, 0.0]],
        }
    }

    fn objective(kind: ObjectiveKind, ratio: RatioLevel) -> Objective {
        Objective {
            config: ObjectiveConfig { kind, ratio, ..ObjectiveConfig::default() },
            kl: KlPenalty { coef: 0.0, estimator: KlEstimator::K3 },
        }
    }

    fn grad_of(loss: Tensor<1>, x: &Tensor<2>) -> Vec<f32> {
        let grads = loss.backward();
        x.grad(&grads).unwrap().into_data().try_into_vec::<f32>().unwrap()
    }

    fn close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn magrpo_is_minus_advantage_times_logp_over_the_agent_tokens() {
        let terms = group_of_four();
        let logp = tensor(vec![-1.0, -2.0, -0.5, 9.0, -1.0, 9.0, -2.0, 9.0], [4, 2]);
        let (loss, _) =
            objective(ObjectiveKind::Magrpo, RatioLevel::Token).token_loss(logp.clone(), &terms, None).unwrap();
        // -(-2 x (-1 - 2) + -1 x -0.5 + 0 + 3 x -2) / 5 = -(6 + 0.5 - 6) / 5 = -0.1
        let value: f32 = loss.clone().into_scalar();
        assert!((value + 0.1).abs() < 1e-6, "{value}");
        close(&grad_of(loss, &logp), &[0.4, 0.4, 0.2, 0.0, 0.0, 0.0, -0.6, 0.0]);
    }

    #[test]
    fn clipped_with_an_unmoved_policy_has_magrpos_gradient() {
        let terms = group_of_four();
        // The policy that sampled: ratio 1 everywhere, so no clipping.
        let values = vec![-1.0, -2.0, -0.5, 0.0, -1.0, 0.0, -2.0, 0.0];
        for ratio in [RatioLevel::Token, RatioLevel::Sequence] {
            let logp = tensor(values.clone(), [4, 2]);
            let (loss, stats) =
                objective(ObjectiveKind::Clipped, ratio).token_loss(logp.clone(), &terms, None).unwrap();
            assert_eq!((stats.ratio_units, stats.clipped_units), (5, 0));
            close(&grad_of(loss, &logp), &[0.4, 0.4, 0.2, 0.0, 0.0, 0.0, -0.6, 0.0]);
        }
    }

    #[test]
    fn clipped_stops_the_gradient_beyond_the_bounds() {
        let terms = group_of_four();
        // Row 0 (A = -2): token ratios e^0.5 (outside 1.2: A < 0 so min keeps the unclipped,
        // larger-magnitude penalty) and e^-0.5 (below 0.8: clipped, no gradient).
        // Row 3 (A = 3): ratio e^0.3 = 1.35 > 1.2, clipped: no gradient.
        // Row 1 (A = -1): ratio e^0.1 = 1.105, inside: gradient -A r / d = 1.105 / 5.
        let logp = tensor(vec![-0.5, -2.5, -0.4, 0.0, -1.0, 0.0, -1.7, 0.0], [4, 2]);
        let (loss, stats) =
            objective(ObjectiveKind::Clipped, RatioLevel::Token).token_loss(logp.clone(), &terms, None).unwrap();
        assert_eq!((stats.ratio_units, stats.clipped_units), (5, 3));
        let e = std::f64::consts::E;
        // Hand value: -(1/5) sum min(rA, clip(r)A):
        // row 0: min(-2e^.5, -2 x 1.2) = -2e^.5; min(-2e^-.5, -2 x 0.8) = -1.6 (clipped)
        // row 1: -e^.1; row 2: 0; row 3: min(3e^.3, 3.6) = 3.6.
        let expected = -(-2.0 * e.powf(0.5) - 1.6 - e.powf(0.1) + 3.6) / 5.0;
        let value: f32 = loss.clone().into_scalar();
        assert!((f64::from(value) - expected).abs() < 1e-5, "{value} vs {expected}");
        close(&grad_of(loss, &logp), &[2.0 * e.powf(0.5) / 5.0, 0.0, e.powf(0.1) / 5.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn sequence_ratio_is_the_geometric_mean_over_a_reply() {
        let terms = RowTerms {
            advantage: vec![1.0],
            denominator: vec![2.0],
            counted: vec![vec![true, true]],
            sampled: vec![vec![-1.0, -1.0]],
        };
        // Token log-ratios 0.1 and -0.1: sequence ratio e^0 = 1, inside the bounds; each token's
        // gradient is -A / d x d(ratio)/d(logp_t) = -(1/2) x (1 x 2 tokens) / 2 tokens... i.e.
        // the loss -A x 2 x s / 2 with ds/dlogp_t = s / 2: gradient -0.5 per token.
        let logp = tensor(vec![-0.9, -1.1], [1, 2]);
        let (loss, _) =
            objective(ObjectiveKind::Clipped, RatioLevel::Sequence).token_loss(logp.clone(), &terms, None).unwrap();
        let value: f32 = loss.clone().into_scalar();
        assert!((value + 1.0).abs() < 1e-6, "two tokens of ratio 1, advantage 1, over 2: {value}");
        close(&grad_of(loss, &logp), &[-0.5, -0.5]);
    }

    #[test]
    fn kl_estimators_match_their_formulas() {
        let terms = RowTerms {
            advantage: vec![0.0],
            denominator: vec![2.0],
            counted: vec![vec![true, true]],
            sampled: vec![vec![0.0, 0.0]],
        };
        let logp = tensor(vec![-1.0, -2.0], [1, 2]);
        let reference = tensor(vec![-1.5, -1.0], [1, 2]);
        let k3 = |d: f64| d.exp() - d - 1.0;
        for (estimator, expected) in
            [(KlEstimator::K3, (k3(-0.5) + k3(1.0)) / 2.0), (KlEstimator::K1, ((-1.0 + 1.5) + (-2.0 + 1.0)) / 2.0)]
        {
            let o = Objective { config: ObjectiveConfig::default(), kl: KlPenalty { coef: 0.1, estimator } };
            let (loss, stats) = o.token_loss(logp.clone(), &terms, Some(reference.clone())).unwrap();
            let value: f32 = loss.into_scalar();
            assert!((f64::from(value) - 0.1 * expected).abs() < 1e-6, "{estimator:?}: {value}");
            assert!((stats.kl_sum / stats.kl_units as f64 - expected).abs() < 1e-6);
        }
    }

    #[test]
    fn normalisations_divide_as_documented() {
        let c = |n| ObjectiveConfig { loss_normalization: n, ..ObjectiveConfig::default() };
        // An agent with 3 rows and 10 tokens; this row has 4 tokens; replies of at most 8.
        assert_eq!(c(LossNormalization::AgentTokenMean).denominator(10, 3, 4, 8, 1), 10.0);
        assert_eq!(c(LossNormalization::SequenceMean).denominator(10, 3, 4, 8, 1), 12.0);
        assert_eq!(c(LossNormalization::Constant).denominator(10, 3, 4, 8, 1), 24.0);
        // Shared mode divides by the agents sharing the adapter too.
        assert_eq!(c(LossNormalization::AgentTokenMean).denominator(10, 3, 4, 8, 2), 20.0);
    }

    #[test]
    fn bad_knobs_are_refused() {
        let bad = ObjectiveConfig { epochs_per_iteration: 2, ..ObjectiveConfig::default() };
        assert_eq!(bad.check().unwrap_err().0, "epochs_per_iteration");
        let bad = ObjectiveConfig { kind: ObjectiveKind::Clipped, clip_low: 1.0, ..ObjectiveConfig::default() };
        assert_eq!(bad.check().unwrap_err().0, "clip_low");
        let ok =
            ObjectiveConfig { kind: ObjectiveKind::Clipped, epochs_per_iteration: 2, ..ObjectiveConfig::default() };
        assert!(ok.check().is_ok());
        assert_eq!(ok.epochs(), 2);
    }
}
