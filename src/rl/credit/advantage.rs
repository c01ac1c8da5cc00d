//! MAGRPO's credit assignment: a group is G rollouts from the same start; each joint sample's
//! return minus a baseline from the group (its mean by default) is its advantage, optionally
//! divided by a standard deviation; in multi-turn episodes each turn is credited with its
//! discounted return-to-go against the group's at the same turn.
//!
//! Adding an estimator: a variant of [`AdvantageBaseline`] and its arm in
//! [`AdvantageBaseline::centered`]; configs name it as `training.advantage`.

use serde::{Deserialize, Serialize};

/// What a return is compared with inside its group (`training.advantage`), as CoMLRL's
/// `advantage_mode` names them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageBaseline {
    /// `r_i - mean(r)`: GRPO and MAGRPO.
    #[default]
    Mean,
    /// `r_i - max(r)`: only the group's best sample gets no penalty.
    Max,
    /// `r_i - mean_{j != i}(r_j)`: the leave-one-out baseline (RLOO), unbiased.
    Rloo,
    /// `r_i`: the return itself (REINFORCE without a baseline).
    Raw,
}

impl AdvantageBaseline {
    /// `returns` minus this baseline, per sample. A group of one sample has no other sample to
    /// leave out: RLOO then gives 0.
    pub fn centered(self, returns: &[f64]) -> Vec<f64> {
        let n = returns.len();
        match self {
            AdvantageBaseline::Mean => {
                let (mean, _) = mean_std(returns);
                returns.iter().map(|r| r - mean).collect()
            }
            AdvantageBaseline::Max => {
                let max = returns.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                returns.iter().map(|r| r - max).collect()
            }
            AdvantageBaseline::Rloo if n < 2 => vec![0.0; n],
            AdvantageBaseline::Rloo => {
                let sum: f64 = returns.iter().sum();
                returns.iter().map(|r| r - (sum - r) / (n - 1) as f64).collect()
            }
            AdvantageBaseline::Raw => returns.to_vec(),
        }
    }
}

/// Which standard deviation divides the advantages (`training.scale_rewards`, as TRL names it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardScaling {
    /// The std of the group's returns (at the same turn).
    #[default]
    Group,
    /// The std of every advantage of the agent in the iteration's batch.
    Batch,
    /// None: advantages keep the returns' units (Dr. GRPO).
    None,
}

/// Added to the group std before dividing, so identical returns give zero advantages.
pub const STD_EPS: f64 = 1e-6;

/// Mean and (population) standard deviation.
pub fn mean_std(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Group-relative advantages of one group's returns: `r - mean(r)`, divided by
/// `std(r) + STD_EPS` when `normalize_std`.
pub fn group_advantages(returns: &[f64], normalize_std: bool) -> Vec<f64> {
    let (mean, std) = mean_std(returns);
    returns.iter().map(|r| if normalize_std { (r - mean) / (std + STD_EPS) } else { r - mean }).collect()
}

/// Discounted return-to-go of every turn: `G[t] = r[t] + gamma * G[t + 1]`.
pub fn discounted_returns(rewards: &[f64], gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; rewards.len()];
    let mut running = 0.0;
    for t in (0..rewards.len()).rev() {
        running = rewards[t] + gamma * running;
        out[t] = running;
    }
    out
}

/// Turn-level advantages for one group of multi-turn samples: `rewards[j][t]` is sample j's
/// reward at its turn t. Each turn's return-to-go is compared with the mean (and std) of the
/// group's returns-to-go at the same turn index, over the samples that reached it. A
/// single-turn group reduces to [`group_advantages`] of the returns.
pub fn turn_advantages(rewards: &[Vec<f64>], gamma: f64, normalize_std: bool) -> Vec<Vec<f64>> {
    let returns: Vec<Vec<f64>> = rewards.iter().map(|r| discounted_returns(r, gamma)).collect();
    like_turn_advantages(&returns, normalize_std)
}

/// Group-relative advantages of per-turn returns: `returns[j][t]` (sample j's return from its
/// turn t on) against the group's mean (and std) at the same turn index, over the samples that
/// reached it.
pub fn like_turn_advantages(returns: &[Vec<f64>], normalize_std: bool) -> Vec<Vec<f64>> {
    let scaling = if normalize_std { RewardScaling::Group } else { RewardScaling::None };
    estimate_turn_advantages(returns, AdvantageBaseline::Mean, scaling)
}

/// Per-turn advantages of one group: `returns[j][t]` against `baseline` of the group's returns
/// at the same turn index (over the samples that reached it), divided by their std plus
/// [`STD_EPS`] when `scaling` is [`RewardScaling::Group`]. [`RewardScaling::Batch`] is applied
/// afterwards, over a whole batch, by [`scale_by_batch_std`]; here it divides by nothing.
// The turn index `t` picks the same position across every sample's list, so a range loop reads best.
#[allow(clippy::needless_range_loop)]
pub fn estimate_turn_advantages(
    returns: &[Vec<f64>],
    baseline: AdvantageBaseline,
    scaling: RewardScaling,
) -> Vec<Vec<f64>> {
    let turns = returns.iter().map(Vec::len).max().unwrap_or(0);
    let mut out: Vec<Vec<f64>> = returns.iter().map(|r| vec![0.0; r.len()]).collect();
    for t in 0..turns {
        let at_t: Vec<(usize, f64)> =
            returns.iter().enumerate().filter_map(|(j, r)| r.get(t).map(|g| (j, *g))).collect();
        let values: Vec<f64> = at_t.iter().map(|(_, g)| *g).collect();
        let (_, std) = mean_std(&values);
        let divisor = if scaling == RewardScaling::Group { std + STD_EPS } else { 1.0 };
        for ((j, _), centered) in at_t.iter().zip(baseline.centered(&values)) {
            out[*j][t] = centered / divisor;
        }
    }
    out
}

/// Divides every advantage by the std of all of them plus [`STD_EPS`] (batch scaling).
pub fn scale_by_batch_std(advantages: &mut [f64]) {
    let (_, std) = mean_std(advantages);
    for a in advantages {
        *a /= std + STD_EPS;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_baseline_matches_a_hand_computation_on_a_group_of_four() {
        // Returns 1, 2, 3, 6: mean 3, max 6, population std sqrt(3.5).
        let r = [1.0, 2.0, 3.0, 6.0];
        close(&AdvantageBaseline::Mean.centered(&r), &[-2.0, -1.0, 0.0, 3.0]);
        close(&AdvantageBaseline::Max.centered(&r), &[-5.0, -4.0, -3.0, 0.0]);
        // Leave one out: 1 - (11/3), 2 - (10/3), 3 - (9/3), 6 - (6/3).
        close(&AdvantageBaseline::Rloo.centered(&r), &[1.0 - 11.0 / 3.0, 2.0 - 10.0 / 3.0, 0.0, 4.0]);
        close(&AdvantageBaseline::Raw.centered(&r), &r);
        assert_eq!(AdvantageBaseline::Rloo.centered(&[5.0]), vec![0.0]);
        let per_turn: Vec<Vec<f64>> = r.iter().map(|x| vec![*x]).collect();
        let std = 3.5f64.sqrt() + STD_EPS;
        let grouped = estimate_turn_advantages(&per_turn, AdvantageBaseline::Max, RewardScaling::Group);
        close(&grouped.concat(), &[-5.0 / std, -4.0 / std, -3.0 / std, 0.0]);
        let unscaled = estimate_turn_advantages(&per_turn, AdvantageBaseline::Rloo, RewardScaling::None);
        close(&unscaled.concat(), &AdvantageBaseline::Rloo.centered(&r));
        // Batch scaling divides by the std of all advantages: here [-2, -1, 0, 3] has std sqrt(3.5).
        let mut batch = estimate_turn_advantages(&per_turn, AdvantageBaseline::Mean, RewardScaling::Batch).concat();
        close(&batch, &[-2.0, -1.0, 0.0, 3.0]);
        scale_by_batch_std(&mut batch);
        close(&batch, &[-2.0 / std, -1.0 / std, 0.0, 3.0 / std]);
        // The default estimator is the one MAGRPO always used.
        assert_eq!(like_turn_advantages(&per_turn, true), grouped_mean(&per_turn));
    }

    fn grouped_mean(per_turn: &[Vec<f64>]) -> Vec<Vec<f64>> {
        estimate_turn_advantages(per_turn, AdvantageBaseline::default(), RewardScaling::default())
    }

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-9, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn group_advantages_center_and_scale() {
        // mean 2, population std sqrt(2/3)
        close(&group_advantages(&[1.0, 2.0, 3.0], false), &[-1.0, 0.0, 1.0]);
        let s = (2.0f64 / 3.0).sqrt() + STD_EPS;
        close(&group_advantages(&[1.0, 2.0, 3.0], true), &[-1.0 / s, 0.0, 1.0 / s]);
        // A group that all scored the same teaches nothing.
        close(&group_advantages(&[5.0, 5.0, 5.0, 5.0], true), &[0.0; 4]);
        assert!(group_advantages(&[], true).is_empty());
    }

    #[test]
    fn discounted_returns_run_backwards() {
        close(&discounted_returns(&[1.0, 0.0, 2.0], 0.5), &[1.5, 1.0, 2.0]);
        close(&discounted_returns(&[1.0, 1.0, 1.0], 1.0), &[3.0, 2.0, 1.0]);
    }

    #[test]
    fn turn_advantages_compare_like_turns() {
        // Sample 0 scores at turn 1, sample 1 scores nothing, sample 2 ends after one turn.
        let rewards = vec![vec![0.0, 1.0], vec![0.0, 0.0], vec![2.0]];
        let adv = turn_advantages(&rewards, 1.0, false);
        // Turn 0 returns-to-go: 1, 0, 2 (mean 1); turn 1: 1, 0 (mean 0.5).
        close(&adv[0], &[0.0, 0.5]);
        close(&adv[1], &[-1.0, -0.5]);
        close(&adv[2], &[1.0]);
        // Single-turn groups are plain group advantages.
        let single = turn_advantages(&[vec![1.0], vec![3.0]], 0.9, true);
        close(&[single[0][0], single[1][0]], &group_advantages(&[1.0, 3.0], true));
    }
}
