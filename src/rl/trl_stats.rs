//! The iteration statistics TRL's GRPO trainer logs that troupe's other metrics do not already
//! give: completion lengths, the share of replies cut at `max_new_tokens`, the share of groups
//! whose rewards do not vary (no learning signal), and the mean reward of each turn. They go to
//! `metrics.jsonl`'s `extra` under TRL's names (`completions/mean_length`,
//! `completions/clipped_ratio`, `frac_reward_zero_std`) and `turn_<k>_reward`; the trackers
//! ([`super::run::tracking`]) log them as `turn_k/reward`.

use std::collections::BTreeMap;

use super::rollout::EpisodeRecord;

/// The statistics of one iteration's episodes. `shaped` holds each episode's shaped rewards as
/// the trainer credits them, `[group][episode][seat][step]`; `seat_agents[s]` is seat `s`'s
/// agent; `max_new_tokens` is the reply cap (`None` where replies are not generated token by
/// token, `choice` mode, whose replies are never cut).
pub fn trl_stats(
    groups: &[Vec<EpisodeRecord>],
    shaped: &[Vec<Vec<Vec<f64>>>],
    seat_agents: &[usize],
    max_new_tokens: Option<usize>,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let turns: Vec<_> = groups.iter().flatten().flat_map(|e| &e.turns).collect();
    if !turns.is_empty() {
        let lengths: usize = turns.iter().map(|t| t.completion_ids.len()).sum();
        out.insert("completions/mean_length".to_string(), lengths as f64 / turns.len() as f64);
        if let Some(cap) = max_new_tokens {
            let clipped = turns.iter().filter(|t| t.completion_ids.len() >= cap).count();
            out.insert("completions/clipped_ratio".to_string(), clipped as f64 / turns.len() as f64);
        }
    }
    // Per (group, agent): do the agent's returns differ between the group's episodes?
    let agents: std::collections::BTreeSet<usize> = seat_agents.iter().copied().collect();
    let mut pairs = 0usize;
    let mut flat = 0usize;
    for group in shaped {
        for &agent in &agents {
            let returns: Vec<f64> = group
                .iter()
                .map(|episode| {
                    episode
                        .iter()
                        .enumerate()
                        .filter(|(seat, _)| seat_agents.get(*seat) == Some(&agent))
                        .map(|(_, steps)| steps.iter().sum::<f64>())
                        .sum()
                })
                .collect();
            if returns.len() > 1 {
                pairs += 1;
                flat += usize::from(returns.iter().all(|r| *r == returns[0]));
            }
        }
    }
    if pairs > 0 {
        out.insert("frac_reward_zero_std".to_string(), flat as f64 / pairs as f64);
    }
    // Turn k: the k-th reply of an episode (0-based), its reward as the environment gave it.
    let mut by_turn: BTreeMap<usize, (f64, usize)> = BTreeMap::new();
    for episode in groups.iter().flatten() {
        for (k, turn) in episode.turns.iter().enumerate() {
            let entry = by_turn.entry(k).or_default();
            entry.0 += turn.reward;
            entry.1 += 1;
        }
    }
    // Only short episodes get per-turn curves (a 70-move game would give 70 of them).
    if by_turn.len() <= 8 {
        for (k, (sum, count)) in by_turn {
            out.insert(format!("turn_{k}_reward"), sum / count as f64);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::rollout::Turn;

    fn turn(seat: usize, tokens: usize, reward: f64) -> Turn {
        Turn {
            seat,
            agent: seat,
            prompt_ids: vec![1],
            completion_ids: vec![7; tokens],
            sampling_logprobs: vec![0.0; tokens],
            reward,
            invalid: false,
            penalty: 0.0,
            step: 0,
            choice: None,
        }
    }

    fn episode(turns: Vec<Turn>) -> EpisodeRecord {
        EpisodeRecord {
            seed: 0,
            turns,
            env_returns: vec![0.0, 0.0],
            metrics: Default::default(),
            steps: 1,
            step_rewards: vec![vec![0.0, 0.0]],
        }
    }

    #[test]
    fn lengths_clipping_flat_groups_and_turns() {
        let groups = vec![vec![
            episode(vec![turn(0, 4, 1.0), turn(1, 2, 0.0)]),
            episode(vec![turn(0, 4, 3.0), turn(1, 6, 0.0)]),
        ]];
        // Agent 0's returns differ within the group, agent 1's do not.
        let shaped = vec![vec![vec![vec![1.0], vec![0.5]], vec![vec![3.0], vec![0.5]]]];
        let stats = trl_stats(&groups, &shaped, &[0, 1], Some(4));
        assert_eq!(stats["completions/mean_length"], 4.0);
        assert_eq!(stats["completions/clipped_ratio"], 0.75);
        assert_eq!(stats["frac_reward_zero_std"], 0.5);
        assert_eq!(stats["turn_0_reward"], 2.0);
        assert_eq!(stats["turn_1_reward"], 0.0);
        assert!(!trl_stats(&groups, &shaped, &[0, 1], None).contains_key("completions/clipped_ratio"));
    }
}
