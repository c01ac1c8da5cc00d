//! `troupe eval`: trained (or untrained) adapters play episodes on held-out seeds, optionally
//! with baseline policies in some seats, and the result is summarised with standard errors.

use std::collections::BTreeMap;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use troupe_envs::policy::Policy;
use troupe_envs::{Registry, SeatId};

use super::config::{ActionMode, TrainConfig};
use super::credit::advantage::mean_std;
use super::credit::Credit;
use super::protocol_writer::run_protocol;
use super::rollout::{episode_rngs, make_env, EpisodeRecord, Rollout};
use crate::adapters::MultiAdapterManager;
use crate::error::{Result, TroupeError};
use crate::model::Model;
use troupe_envs::coding::protocols::{is_coding_task, CodingProtocol, ProtocolSetup, ProtocolSummary};

crate::section::config_section! {
    /// `eval:` — evaluation episodes on held-out seeds.
    pub struct EvalConfig {
        /// Episodes per evaluation.
        pub episodes: usize = 20,
        /// Seed of the first evaluation episode (episode i uses `seed + i`), away from
        /// training's.
        pub seed: u64 = 1_000_000,
        /// Seats played by a baseline policy instead of their agent: seat -> policy name
        /// (`random`, `rule`, `canonical`).
        pub baseline_seats: BTreeMap<usize, String> = BTreeMap::new(),
        /// Evaluation episodes end after this many steps; `null` (the default) plays them to the
        /// end, as the references score games (a training move cap is
        /// `training.max_episode_steps`).
        pub max_episode_steps: Option<usize> = None,
        /// During training, a held-out evaluation every this many iterations and at the last one
        /// (0: none), on the same `every_episodes` deals each time, written to `metrics.jsonl` as
        /// `eval_score` and `eval_score_stderr`.
        pub every: usize = 0,
        /// Episodes of each evaluation during training.
        pub every_episodes: usize = 32,
        /// Environment parameters that differ in evaluation, merged over `env:` (e.g. `{split:
        /// test}`: the held-out prompts of a text task).
        pub env: serde_json::Map<String, serde_json::Value> = serde_json::Map::new(),
    }
}

/// A mean with its standard error (sample std / sqrt(n)).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MeanStderr {
    /// The mean.
    pub mean: f64,
    /// Its standard error.
    pub stderr: f64,
}

impl MeanStderr {
    /// Mean and standard error of `values` (0 and 0 when empty).
    pub fn of(values: &[f64]) -> Self {
        let (mean, std) = mean_std(values);
        let n = values.len().max(1) as f64;
        let stderr = if values.len() > 1 { std * (n / (n - 1.0)).sqrt() / n.sqrt() } else { 0.0 };
        Self { mean, stderr }
    }
}

/// What `troupe eval` prints.
#[derive(Clone, Debug, Serialize)]
pub struct EvalSummary {
    /// The environment's registry name.
    pub env: String,
    /// Episodes played.
    pub episodes: usize,
    /// Seed of the first episode (episode i uses `first_seed + i`), held out from training.
    pub first_seed: u64,
    /// The action mode the agents played in.
    pub mode: ActionMode,
    /// The environment's `score` metric over episodes.
    pub score: MeanStderr,
    /// Per agent (by id): its seats' environment return over episodes.
    pub agent_return: BTreeMap<usize, MeanStderr>,
    /// Invalid replies / agent replies.
    pub invalid_rate: f64,
    /// Agent replies counted.
    pub agent_turns: usize,
    /// Mean environment steps per episode.
    pub mean_steps: f64,
    /// Seats played by a baseline policy instead of their agent.
    pub baseline_seats: BTreeMap<usize, String>,
    /// The coding task's inference-only protocols (single agent, parallel, helper then main,
    /// one round of discussion) on the same seeds; absent for other environments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocols: Option<Vec<ProtocolSummary>>,
    /// Every episode metric the environment reports (`score`, `lives_lost`, `plays`, ...), as
    /// a mean with its standard error over the episodes that report it.
    pub metrics: BTreeMap<String, MeanStderr>,
    /// Every configured reward function (`rewards.functions`, external ones included), by its
    /// label: its unweighted value, averaged over the seats the agents play, as a mean with its
    /// standard error over the episodes. Absent when the evaluation was not given the rewards.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub rewards: BTreeMap<String, MeanStderr>,
    /// Wall time.
    pub seconds: f64,
}

/// Plays `episodes` held-out episodes: `eval.env` over the config's environment, seeds
/// `eval.seed` on, the seats in `baselines` played by those policies and the others by their
/// agents, with `runtime.eval_batch_episodes` games in flight (a finished game's slot takes the
/// next seed, as training keeps its batch full). Episode `i` draws from its own random stream,
/// so the records do not depend on how many games are in flight.
pub fn play_held_out(
    model: &Model,
    manager: &MultiAdapterManager,
    config: &TrainConfig,
    episodes: usize,
    registry: &Registry,
    baselines: &mut BTreeMap<SeatId, Box<dyn Policy>>,
) -> Result<Vec<EpisodeRecord>> {
    let rollout = config.eval_rollout_config();
    let spec = config.eval_env_spec();
    let seeds: Vec<u64> = (0..episodes as u64).map(|i| config.eval.seed + i).collect();
    let in_flight = config.runtime.eval_batch_episodes.clamp(1, episodes.max(1));
    let mut slots = (0..in_flight).map(|_| make_env(registry, &spec)).collect::<Result<Vec<_>>>()?;
    let mut rngs = episode_rngs(config.eval.seed, 0, episodes);
    let play = Rollout { model, manager, seat_agents: &config.agents.seats, config: &rollout };
    // Played in rounds of a few slots' worth of games, each round with every slot refilled as its
    // game ends, so a long evaluation reports progress; every episode keeps its own generator,
    // so the records are the same however the seeds are cut.
    let round = in_flight * 4;
    let started = Instant::now();
    let mut records: Vec<EpisodeRecord> = Vec::with_capacity(episodes);
    for (seeds, rngs) in seeds.chunks(round).zip(rngs.chunks_mut(round)) {
        records.extend(play.play(&mut slots, seeds, baselines, rngs)?);
        if episodes > round {
            tracing::info!(
                "evaluated {}/{episodes} episodes ({:.0} s)",
                records.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(records)
}

/// Plays `episodes` episodes of the config's environment with `manager`'s adapters on seeds
/// `config.eval.seed + i`, seating `config.eval.baseline_seats` policies in place of agents.
/// Episodes run to their end (or `eval.max_episode_steps`), and an invalid reply is replaced
/// by a random legal action rather than ending the episode ([`TrainConfig::eval_rollout_config`]),
/// so a game scores what the references would score it. With `rewards` (the run's credit
/// phase, its external reward processes running), every reward function's value is reported too
/// ([`EvalSummary::rewards`]).
pub fn evaluate(
    model: &Model,
    manager: &MultiAdapterManager,
    config: &TrainConfig,
    episodes: usize,
    registry: &Registry,
    rewards: Option<&Credit>,
) -> Result<EvalSummary> {
    let started = Instant::now();
    if episodes == 0 {
        return Err(TroupeError::invalid("episodes", "evaluate at least one episode"));
    }
    for (seat, &agent) in config.agents.seats.iter().enumerate() {
        if !config.eval.baseline_seats.contains_key(&seat) && manager.adapter_name(agent).is_err() {
            return Err(TroupeError::invalid(
                "adapters",
                format!(
                    "seat {seat} is played by agent {agent}, but the adapters have no agent {agent} (agents: {:?})",
                    manager.agent_ids()
                ),
            ));
        }
    }
    let mut baselines: BTreeMap<SeatId, Box<dyn Policy>> = BTreeMap::new();
    for (&seat, name) in &config.eval.baseline_seats {
        baselines.insert(seat, registry.make_policy(name)?);
    }
    let rollout = config.eval_rollout_config();
    let spec = config.eval_env_spec();
    let seeds: Vec<u64> = (0..episodes as u64).map(|i| config.eval.seed + i).collect();
    let records = play_held_out(model, manager, config, episodes, registry, &mut baselines)?;
    let scores: Vec<f64> = records.iter().map(|e| e.metrics.get("score").copied().unwrap_or(0.0)).collect();
    let names: std::collections::BTreeSet<&String> = records.iter().flat_map(|e| e.metrics.keys()).collect();
    let metrics = names
        .into_iter()
        .map(|name| {
            // Over the episodes that report the metric.
            let values: Vec<f64> = records.iter().filter_map(|e| e.metrics.get(name).copied()).collect();
            (name.clone(), MeanStderr::of(&values))
        })
        .collect();
    // Per agent, the seats it plays itself (a seat given to a baseline is not its).
    let mut agent_seats: BTreeMap<usize, Vec<SeatId>> = BTreeMap::new();
    for (seat, &agent) in config.agents.seats.iter().enumerate() {
        if !config.eval.baseline_seats.contains_key(&seat) {
            agent_seats.entry(agent).or_default().push(seat);
        }
    }
    let mut agent_return = BTreeMap::new();
    for (agent, seats) in agent_seats {
        let returns: Vec<f64> =
            records.iter().map(|e| seats.iter().filter_map(|&seat| e.env_returns.get(seat)).sum()).collect();
        agent_return.insert(agent, MeanStderr::of(&returns));
    }
    let rewards = match rewards {
        Some(credit) => {
            let agent_played: Vec<SeatId> =
                (0..config.agents.seats.len()).filter(|seat| !config.eval.baseline_seats.contains_key(seat)).collect();
            credit
                .score_episodes(&model.tokenizer, &records, &agent_played)?
                .functions
                .into_iter()
                .map(|(label, values)| (label, MeanStderr::of(&values)))
                .collect()
        }
        None => BTreeMap::new(),
    };
    let turns: usize = records.iter().map(|e| e.turns.len()).sum();
    let invalid: usize = records.iter().map(|e| e.turns.iter().filter(|t| t.invalid).count()).sum();
    let steps: Vec<f64> = records.iter().map(|e| e.steps as f64).collect();
    let probe = make_env(registry, &spec)?;
    let protocols = if is_coding_task(probe.as_ref()) {
        let setup = ProtocolSetup { env_spec: &spec, registry, seeds: &seeds, seat_agents: &config.agents.seats };
        let mut summaries = Vec::with_capacity(CodingProtocol::ALL.len());
        let mut rng = ChaCha8Rng::seed_from_u64(config.eval.seed);
        for protocol in CodingProtocol::ALL {
            summaries.push(run_protocol(model, manager, &setup, protocol, &rollout.action, &mut rng)?);
        }
        Some(summaries)
    } else {
        None
    };
    Ok(EvalSummary {
        env: config.env.name.clone(),
        episodes,
        first_seed: config.eval.seed,
        mode: config.action.mode,
        score: MeanStderr::of(&scores),
        agent_return,
        invalid_rate: if turns == 0 { 0.0 } else { invalid as f64 / turns as f64 },
        agent_turns: turns,
        mean_steps: mean_std(&steps).0,
        baseline_seats: config.eval.baseline_seats.clone(),
        protocols,
        metrics,
        rewards,
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::run::{fresh_adapters, load_model};

    #[test]
    fn the_summary_is_deterministic_for_a_seed_and_plays_whole_games() {
        let registry = Registry::with_builtins();
        let yaml = "env: {name: hanabi, players: 2, observation: compact}\n\
                    action: {mode: choice, choice_score: mean, chat_template: false}\n\
                    training: {max_episode_steps: 2}\n\
                    eval: {seed: 77}\n\
                    runtime: {eval_batch_episodes: 2}";
        let config = TrainConfig::from_yaml_str(yaml, std::path::Path::new("test.yaml"), &[], &registry).unwrap();
        let device = burn::tensor::Device::flex();
        let model = load_model(&config, &device).unwrap();
        let manager = fresh_adapters(&config, &model).unwrap();
        let run = || {
            let mut summary = evaluate(&model, &manager, &config, 3, &registry, None).unwrap();
            summary.seconds = 0.0;
            serde_json::to_string(&summary).unwrap()
        };
        let first = run();
        assert_eq!(first, run(), "same seed, same summary");
        let summary: serde_json::Value = serde_json::from_str(&first).unwrap();
        assert_eq!(summary["first_seed"], 77);
        // The training cap of 2 moves does not apply: every game runs to its end (three lost
        // lives at the least, so at least 3 moves).
        assert!(summary["mean_steps"].as_f64().unwrap() >= 3.0, "{summary}");
        let other = TrainConfig { eval: EvalConfig { seed: 78, ..config.eval.clone() }, ..config.clone() };
        let mut moved = evaluate(&model, &manager, &other, 3, &registry, None).unwrap();
        moved.seconds = 0.0;
        assert_ne!(serde_json::to_string(&moved).unwrap(), first, "other deals, another summary");
    }

    #[test]
    fn games_in_flight_give_the_records_of_one_game_at_a_time() {
        let registry = Registry::with_builtins();
        let yaml = "env: {name: hanabi, players: 2, observation: compact}\n\
                    action: {mode: choice, choice_score: mean, chat_template: false}\n\
                    eval: {seed: 300, baseline_seats: {1: random}}\n\
                    runtime: {eval_batch_episodes: 2}";
        let config = TrainConfig::from_yaml_str(yaml, std::path::Path::new("test.yaml"), &[], &registry).unwrap();
        let device = burn::tensor::Device::flex();
        let model = load_model(&config, &device).unwrap();
        let manager = fresh_adapters(&config, &model).unwrap();
        let episodes = 5;
        let baselines =
            || -> BTreeMap<SeatId, Box<dyn Policy>> { BTreeMap::from([(1, registry.make_policy("random").unwrap())]) };
        // 5 games through 2 slots: each slot is refilled as its game ends.
        let in_flight = play_held_out(&model, &manager, &config, episodes, &registry, &mut baselines()).unwrap();
        let rollout = config.eval_rollout_config();
        let spec = config.eval_env_spec();
        let alone: Vec<EpisodeRecord> = (0..episodes)
            .map(|i| {
                let mut envs = vec![make_env(&registry, &spec).unwrap()];
                let mut rngs = episode_rngs(config.eval.seed, i, 1);
                let seeds = [config.eval.seed + i as u64];
                let play =
                    Rollout { model: &model, manager: &manager, seat_agents: &config.agents.seats, config: &rollout };
                let mut records = play.play(&mut envs, &seeds, &mut baselines(), &mut rngs).unwrap();
                records.remove(0)
            })
            .collect();
        assert_eq!(in_flight.len(), episodes);
        for (i, (a, b)) in in_flight.iter().zip(&alone).enumerate() {
            assert_eq!(a, b, "episode {i}");
        }
        // Games of different lengths: slots were refilled at different steps.
        let steps: std::collections::BTreeSet<usize> = alone.iter().map(|e| e.steps).collect();
        assert!(steps.len() > 1, "{steps:?}");
        assert!(alone.iter().all(|e| !e.turns.is_empty()));
    }

    #[test]
    fn standard_error_uses_the_sample_std() {
        let s = MeanStderr::of(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.mean, 2.5);
        // Sample std sqrt(5/3), over sqrt(4).
        assert!((s.stderr - (5.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-12);
        assert_eq!(MeanStderr::of(&[7.0]), MeanStderr { mean: 7.0, stderr: 0.0 });
    }
}
