//! The rollout-to-loss contract: a [`TrainBatch`] is everything an objective needs from an
//! iteration's rollouts, one [`TrainRow`] per reply (or `choice` decision) of an agent, with
//! the advantage credit assignment gave it and the log-probabilities recorded when it was
//! sampled (TRL's `_generate_and_score_completions` output, as named rows).
//!
//! Credit assignment ([`TrainBatch::from_groups`]) is the seam of advantage estimators
//! ([`crate::rl::credit::advantage`]): per group (G episodes from one start) and agent, each turn's return
//! is compared with the group's returns at the agent's same turn index (AT-GRPO's grouping by
//! agent and turn) or with all the agent's turns in the group, per `training.group_by`.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::advantage::{estimate_turn_advantages, scale_by_batch_std, AdvantageBaseline, RewardScaling};
use crate::rl::rollout::{ChoiceTurn, EpisodeRecord};

/// Which returns a turn's advantage is measured against (`training.group_by`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageGrouping {
    /// The group's returns of the same agent at the same turn index (AT-GRPO): a move is
    /// compared with moves made at the same point of the other games of its group.
    #[default]
    AgentTurn,
    /// All of the agent's turns in the group pooled: one baseline per agent and group.
    Agent,
}

/// How returns become advantages: the baseline, the std that divides and the grouping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdvantageSettings {
    /// `training.advantage`.
    pub baseline: AdvantageBaseline,
    /// `training.scale_rewards`.
    pub scaling: RewardScaling,
    /// `training.group_by`.
    pub grouping: AdvantageGrouping,
}

/// One row to train on: a reply of one agent, or one `choice` decision.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainRow {
    /// The agent whose adapter scores the row.
    pub agent: usize,
    /// Prompt then reply (for a `choice` decision, the prompt alone).
    pub tokens: Vec<u32>,
    /// Tokens of `tokens` that are prompt; the rest are the completion.
    pub prompt_len: usize,
    /// The row's advantage.
    pub advantage: f64,
    /// Log-probabilities recorded at sampling: one per completion token, or one for a decision
    /// (`log pi(chosen)`). Empty when the row was not sampled by the policy (the format
    /// warm-up's targets); the clipped objective needs them.
    pub sampling_logprobs: Vec<f32>,
    /// A `choice` decision: the policy is the softmax over these candidates.
    pub choice: Option<ChoiceTurn>,
    /// The base model's (adapters off) log-probabilities of the row's units, when the KL
    /// penalty is on: per completion token, or the log-policy over each candidate.
    pub reference_logprobs: Option<Vec<f32>>,
}

impl TrainRow {
    /// What the loss averages over for this row: its reply tokens, or one decision.
    pub fn units(&self) -> usize {
        if self.choice.is_some() {
            1
        } else {
            self.tokens.len() - self.prompt_len
        }
    }

    /// The completion mask: `true` for each completion token of `tokens`.
    pub fn completion_mask(&self) -> Vec<bool> {
        (0..self.tokens.len()).map(|i| i >= self.prompt_len).collect()
    }
}

/// An iteration's rows, in a fixed order (group, agent, episode, turn).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainBatch {
    /// The rows.
    pub rows: Vec<TrainRow>,
}

impl TrainBatch {
    /// Credit assignment: `groups[g]` holds G episodes from one start and `returns[g][e][t]` is
    /// turn t of episode e's return (discounted return-to-go of its seat). Turns with an empty
    /// completion are left out.
    pub fn from_groups(
        groups: &[Vec<EpisodeRecord>],
        returns: &[Vec<Vec<f64>>],
        seat_agents: &[usize],
        settings: AdvantageSettings,
    ) -> Self {
        let mut rows = Vec::new();
        let agents: BTreeSet<usize> = seat_agents.iter().copied().collect();
        for (group, group_returns) in groups.iter().zip(returns) {
            for &agent in &agents {
                let per_episode: Vec<Vec<f64>> = group
                    .iter()
                    .zip(group_returns)
                    .map(|(e, r)| e.turns.iter().zip(r).filter(|(t, _)| t.agent == agent).map(|(_, g)| *g).collect())
                    .collect();
                let advantages = match settings.grouping {
                    AdvantageGrouping::AgentTurn => {
                        estimate_turn_advantages(&per_episode, settings.baseline, settings.scaling)
                    }
                    AdvantageGrouping::Agent => pooled_advantages(&per_episode, settings),
                };
                for (episode, adv) in group.iter().zip(advantages) {
                    for (turn, a) in episode.turns.iter().filter(|t| t.agent == agent).zip(adv) {
                        if turn.completion_ids.is_empty() {
                            continue;
                        }
                        let mut tokens = turn.prompt_ids.clone();
                        if turn.choice.is_none() {
                            tokens.extend_from_slice(&turn.completion_ids);
                        }
                        rows.push(TrainRow {
                            agent,
                            tokens,
                            prompt_len: turn.prompt_ids.len(),
                            advantage: a,
                            sampling_logprobs: turn.sampling_logprobs.clone(),
                            choice: turn.choice.clone(),
                            reference_logprobs: None,
                        });
                    }
                }
            }
        }
        let mut batch = Self { rows };
        if settings.scaling == RewardScaling::Batch {
            for &agent in &agents {
                let mut advantages: Vec<f64> =
                    batch.rows.iter().filter(|r| r.agent == agent).map(|r| r.advantage).collect();
                scale_by_batch_std(&mut advantages);
                for (row, a) in batch.rows.iter_mut().filter(|r| r.agent == agent).zip(advantages) {
                    row.advantage = a;
                }
            }
        }
        batch
    }

    /// Per agent: units (reply tokens or decisions) over its rows.
    pub fn units_per_agent(&self) -> BTreeMap<usize, usize> {
        let mut units = BTreeMap::new();
        for row in &self.rows {
            *units.entry(row.agent).or_default() += row.units();
        }
        units
    }

    /// Per agent: its rows.
    pub fn rows_per_agent(&self) -> BTreeMap<usize, usize> {
        let mut rows = BTreeMap::new();
        for row in &self.rows {
            *rows.entry(row.agent).or_default() += 1;
        }
        rows
    }
}

/// Advantages with one baseline per agent and group: every turn's return against all of the
/// agent's turns' returns in the group (shape as `per_episode`).
fn pooled_advantages(per_episode: &[Vec<f64>], settings: AdvantageSettings) -> Vec<Vec<f64>> {
    let flat: Vec<Vec<f64>> = vec![per_episode.iter().flatten().copied().collect()];
    // One "turn index" holding every return: transpose to one return per pseudo-sample.
    let as_samples: Vec<Vec<f64>> = flat[0].iter().map(|g| vec![*g]).collect();
    let centered: Vec<f64> =
        estimate_turn_advantages(&as_samples, settings.baseline, settings.scaling).into_iter().flatten().collect();
    let mut it = centered.into_iter();
    per_episode.iter().map(|r| it.by_ref().take(r.len()).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::rollout::Turn;

    fn turn(agent: usize, step: usize) -> Turn {
        Turn {
            seat: agent,
            agent,
            prompt_ids: vec![1, 2],
            completion_ids: vec![3],
            sampling_logprobs: vec![-0.5],
            reward: 0.0,
            invalid: false,
            penalty: 0.0,
            step,
            choice: None,
        }
    }

    fn episode(turns: Vec<Turn>) -> EpisodeRecord {
        EpisodeRecord {
            seed: 0,
            turns,
            env_returns: vec![0.0, 0.0],
            metrics: Default::default(),
            steps: 2,
            step_rewards: Vec::new(),
        }
    }

    #[test]
    fn a_group_of_four_gets_hand_computed_advantages() {
        // Four one-turn episodes of agent 0 with returns 1, 2, 3, 6: mean 3, std sqrt(3.5).
        let group: Vec<EpisodeRecord> = (0..4).map(|_| episode(vec![turn(0, 0)])).collect();
        let returns = vec![vec![vec![1.0], vec![2.0], vec![3.0], vec![6.0]]];
        let settings =
            |baseline, scaling| AdvantageSettings { baseline, scaling, grouping: AdvantageGrouping::AgentTurn };
        let batch = TrainBatch::from_groups(
            std::slice::from_ref(&group),
            &returns,
            &[0],
            settings(AdvantageBaseline::Mean, RewardScaling::None),
        );
        let adv: Vec<f64> = batch.rows.iter().map(|r| r.advantage).collect();
        assert_eq!(adv, vec![-2.0, -1.0, 0.0, 3.0]);
        assert_eq!(batch.rows[0].tokens, vec![1, 2, 3]);
        assert_eq!(batch.rows[0].sampling_logprobs, vec![-0.5]);
        assert_eq!(batch.rows[0].completion_mask(), vec![false, false, true]);
        let rloo = TrainBatch::from_groups(
            std::slice::from_ref(&group),
            &returns,
            &[0],
            settings(AdvantageBaseline::Rloo, RewardScaling::None),
        );
        let adv: Vec<f64> = rloo.rows.iter().map(|r| r.advantage).collect();
        let want = [1.0 - 11.0 / 3.0, 2.0 - 10.0 / 3.0, 0.0, 4.0];
        assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-12), "{adv:?}");
        assert_eq!(batch.units_per_agent()[&0], 4);
    }

    #[test]
    fn grouping_by_agent_pools_turns_while_agent_turn_compares_like_turns() {
        // Two episodes, two turns each of agent 0: returns [1, 0] and [3, 2].
        let group: Vec<EpisodeRecord> = (0..2).map(|_| episode(vec![turn(0, 0), turn(0, 1)])).collect();
        let returns = vec![vec![vec![1.0, 0.0], vec![3.0, 2.0]]];
        let run = |grouping| {
            let settings =
                AdvantageSettings { baseline: AdvantageBaseline::Mean, scaling: RewardScaling::None, grouping };
            TrainBatch::from_groups(std::slice::from_ref(&group), &returns, &[0], settings)
                .rows
                .iter()
                .map(|r| r.advantage)
                .collect::<Vec<_>>()
        };
        // Same turn index: turn 0 against mean 2, turn 1 against mean 1.
        assert_eq!(run(AdvantageGrouping::AgentTurn), vec![-1.0, -1.0, 1.0, 1.0]);
        // Pooled: all four against mean 1.5.
        assert_eq!(run(AdvantageGrouping::Agent), vec![-0.5, -1.5, 1.5, 0.5]);
    }
}
