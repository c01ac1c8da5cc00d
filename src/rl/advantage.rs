//! MAGRPO's credit assignment: a group is G rollouts from the same start; each joint sample's
//! return minus the group mean (optionally over the group std) is its advantage, and in
//! multi-turn episodes each turn is credited with its discounted return-to-go against the
//! group's mean return-to-go at the same turn.

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
    returns
        .iter()
        .map(|r| if normalize_std { (r - mean) / (std + STD_EPS) } else { r - mean })
        .collect()
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
    let turns = returns.iter().map(Vec::len).max().unwrap_or(0);
    let mut out: Vec<Vec<f64>> = returns.iter().map(|r| vec![0.0; r.len()]).collect();
    for t in 0..turns {
        let at_t: Vec<(usize, f64)> = returns.iter().enumerate().filter_map(|(j, r)| r.get(t).map(|g| (j, *g))).collect();
        let values: Vec<f64> = at_t.iter().map(|(_, g)| *g).collect();
        for ((j, _), advantage) in at_t.iter().zip(group_advantages(&values, normalize_std)) {
            out[*j][t] = advantage;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
