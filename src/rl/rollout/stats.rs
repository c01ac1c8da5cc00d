//! The rollout phase's statistics over an iteration's episodes: what the agents generated and
//! did, the environment's metrics, and the phase's floating-point work ([`crate::rl::flops`]).

use std::collections::{BTreeMap, BTreeSet};

use super::EpisodeRecord;
use crate::rl::credit::advantage::mean_std;
use crate::rl::flops::FlopModel;

/// What one iteration's rollouts did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RolloutStats {
    /// Reply tokens generated (a `choice` decision counts its chosen action's tokens).
    pub generated_tokens: usize,
    /// Invalid replies / replies.
    pub invalid_rate: f64,
    /// Mean environment score (the env's `score` metric) over episodes.
    pub mean_score: f64,
    /// Mean environment steps per episode.
    pub mean_episode_steps: f64,
    /// In `choice` mode, the policy's mean entropy (nats) over the decisions.
    pub choice_entropy: Option<f64>,
    /// The mean of every metric the environment reports, over the episodes that report it.
    pub env_metrics: BTreeMap<String, f64>,
    /// Useful floating-point work of the phase's forward passes.
    pub flops: f64,
}

impl RolloutStats {
    /// The statistics of `episodes` under the model whose work `flop_model` counts.
    pub fn of<'a>(episodes: impl Iterator<Item = &'a EpisodeRecord> + Clone, flop_model: &FlopModel) -> Self {
        let turns = || episodes.clone().flat_map(|e| &e.turns);
        // A prompt that several replies of one agent answer is prefilled once (a group's).
        let flops: f64 = turns()
            .filter_map(|t| t.choice.as_ref().map(|c| (t, c)))
            .map(|(t, c)| {
                flop_model.packed_choice(t.prompt_ids.len(), &c.candidates.iter().map(Vec::len).collect::<Vec<_>>())
            })
            .sum::<f64>()
            + flop_model.shared_prefixes(turns().filter(|t| t.choice.is_none()).map(|t| {
                ((t.agent, &t.prompt_ids), t.prompt_ids.len(), t.completion_ids.len(), t.completion_ids.len())
            }));
        let replies = turns().count();
        let invalid = turns().filter(|t| t.invalid).count();
        let scores: Vec<f64> = episodes.clone().map(|e| e.metrics.get("score").copied().unwrap_or(0.0)).collect();
        let steps: Vec<f64> = episodes.clone().map(|e| e.steps as f64).collect();
        let entropies: Vec<f64> = turns().filter_map(|t| t.choice.as_ref().map(|c| c.entropy)).collect();
        let names: BTreeSet<&String> = episodes.clone().flat_map(|e| e.metrics.keys()).collect();
        let env_metrics = names
            .into_iter()
            .map(|name| {
                // Over the episodes that report the metric (an environment may report some only
                // in some episodes; none is counted as 0).
                let values: Vec<f64> = episodes.clone().filter_map(|e| e.metrics.get(name).copied()).collect();
                (name.clone(), mean_std(&values).0)
            })
            .collect();
        Self {
            generated_tokens: turns().map(|t| t.completion_ids.len()).sum(),
            invalid_rate: if replies == 0 { 0.0 } else { invalid as f64 / replies as f64 },
            mean_score: mean_std(&scores).0,
            mean_episode_steps: mean_std(&steps).0,
            choice_entropy: (!entropies.is_empty()).then(|| mean_std(&entropies).0),
            env_metrics,
            flops,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn a_metric_is_averaged_over_the_episodes_that_report_it() {
        let episode = |metrics: &[(&str, f64)]| EpisodeRecord {
            seed: 0,
            turns: Vec::new(),
            env_returns: vec![0.0],
            metrics: metrics.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            steps: 1,
            step_rewards: vec![vec![0.0]],
        };
        let episodes = [
            episode(&[("score", 1.0), ("bonus", 4.0)]),
            episode(&[("score", 3.0)]),
            episode(&[("score", 2.0), ("bonus", 2.0)]),
        ];
        let stats = RolloutStats::of(episodes.iter(), &FlopModel::new(&Preset::Tiny.config()));
        // `bonus` over the two episodes that have it, not (4 + 0 + 2) / 3.
        assert_eq!(stats.env_metrics["bonus"], 3.0);
        assert_eq!(stats.env_metrics["score"], 2.0);
        assert_eq!(stats.mean_score, 2.0);
    }
}
