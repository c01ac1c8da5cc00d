//! Self-play and cross-play between independently trained teams (`troupe eval --crossplay RUN_A
//! RUN_B ...`): cell (i, j) seats agent 0 of run i with every other agent of run j and plays the
//! held-out evaluation. The diagonal is each team's self-play; off the diagonal, agents that never
//! met. Hanabi research reads the gap between the two as conventions only a team's own partner
//! understands (Hu et al., "Other-Play", 2020).

use serde::Serialize;
use troupe_envs::Registry;

use super::config::TrainConfig;
use super::eval::{evaluate, MeanStderr};
use crate::adapters::MultiAdapterManager;
use crate::error::{Result, TroupeError};
use crate::model::Model;

/// One cell of the matrix: agent 0 of run `row` with the other agents of run `column`.
#[derive(Clone, Debug, Serialize)]
pub struct CrossplayCell {
    /// The run whose agent 0 plays.
    pub row: usize,
    /// The run whose other agents play.
    pub column: usize,
    /// The environment's `score` metric over the held-out episodes.
    pub score: MeanStderr,
    /// Mean environment steps per episode.
    pub mean_steps: f64,
    /// Invalid replies / agent replies.
    pub invalid_rate: f64,
}

/// What `troupe eval --crossplay` prints.
#[derive(Clone, Debug, Serialize)]
pub struct CrossplayMatrix {
    /// The environment's registry name.
    pub env: String,
    /// Episodes per cell (the same held-out seeds in every cell).
    pub episodes: usize,
    /// Seed of the first episode.
    pub first_seed: u64,
    /// The runs' adapters, in row/column order.
    pub runs: Vec<String>,
    /// `score[i][j]`: agent 0 of run i with the other agents of run j, mean ± s.e.
    pub score: Vec<Vec<MeanStderr>>,
    /// Every cell with its details, row by row.
    pub cells: Vec<CrossplayCell>,
    /// Mean of the diagonal cells' means (each team with itself).
    pub self_play_mean: f64,
    /// Mean of the off-diagonal cells' means (agents of different runs).
    pub cross_play_mean: f64,
}

/// The team that seats agent 0 of `row` with every other agent of `column`, on `model`'s base.
/// Each adapter keeps its weights; names are made distinct per run (`run{i}_agent_{k}`).
pub fn seat_pair(
    model: &Model,
    runs: &[MultiAdapterManager],
    row: usize,
    column: usize,
) -> Result<MultiAdapterManager> {
    let mut seated = MultiAdapterManager::for_model(model);
    for agent in runs[column].agent_ids() {
        let run = if agent == 0 { row } else { column };
        let adapter = runs[run].adapter(agent)?.clone();
        seated.add_adapter(agent, &format!("run{run}_agent_{agent}"), adapter);
    }
    Ok(seated)
}

/// Plays the held-out evaluation of `config` for every ordered pair of `runs` (agent 0 from the
/// row's run, the other agents from the column's): `runs.len()²` evaluations on the same seeds.
/// Every run must hold the same agent ids, at least two.
pub fn crossplay(
    model: &Model,
    runs: &[MultiAdapterManager],
    names: &[String],
    config: &TrainConfig,
    episodes: usize,
    registry: &Registry,
) -> Result<CrossplayMatrix> {
    if runs.len() < 2 {
        return Err(TroupeError::invalid("crossplay", "give at least two runs to seat against each other"));
    }
    if names.len() != runs.len() {
        return Err(TroupeError::invalid("names", "one name per run"));
    }
    let agents = runs[0].agent_ids();
    if agents.len() < 2 || agents[0] != 0 {
        return Err(TroupeError::invalid(
            "crossplay",
            format!("{}: cross-play needs agents 0 and at least one other (agents: {agents:?})", names[0]),
        ));
    }
    for (run, name) in runs.iter().zip(names) {
        if run.agent_ids() != agents {
            return Err(TroupeError::invalid(
                "crossplay",
                format!("{name}: agents {:?}, but {} has agents {agents:?}", run.agent_ids(), names[0]),
            ));
        }
    }
    let mut score = vec![Vec::with_capacity(runs.len()); runs.len()];
    let mut cells = Vec::with_capacity(runs.len() * runs.len());
    for (row, row_scores) in score.iter_mut().enumerate() {
        for column in 0..runs.len() {
            let seated = seat_pair(model, runs, row, column)?;
            let summary = evaluate(model, &seated, config, episodes, registry, None)?;
            tracing::info!(row, column, score = summary.score.mean, "cross-play cell");
            row_scores.push(summary.score);
            cells.push(CrossplayCell {
                row,
                column,
                score: summary.score,
                mean_steps: summary.mean_steps,
                invalid_rate: summary.invalid_rate,
            });
        }
    }
    let mean = |values: Vec<f64>| values.iter().sum::<f64>() / values.len().max(1) as f64;
    let self_play_mean = mean(cells.iter().filter(|c| c.row == c.column).map(|c| c.score.mean).collect());
    let cross_play_mean = mean(cells.iter().filter(|c| c.row != c.column).map(|c| c.score.mean).collect());
    Ok(CrossplayMatrix {
        env: config.env.name.clone(),
        episodes,
        first_seed: config.eval.seed,
        runs: names.to_vec(),
        score,
        cells,
        self_play_mean,
        cross_play_mean,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::LoraAdapter;
    use crate::rl::run::{fresh_adapters, load_model};
    use burn::tensor::{Tensor, TensorData};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// A trained-looking team: fresh adapters whose B factors are seeded noise, so each run's
    /// agents play differently from the base and from every other run's.
    fn team(config: &TrainConfig, model: &Model, seed: u64) -> MultiAdapterManager {
        let mut manager = fresh_adapters(config, model).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for agent in manager.agent_ids() {
            let mut adapter: LoraAdapter = manager.adapter(agent).unwrap().clone();
            for pair in adapter.pairs.values_mut() {
                let [rows, cols] = pair.b.dims();
                let values: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.5..0.5)).collect();
                pair.b = Tensor::from_data(TensorData::new(values, [rows, cols]), &pair.b.device());
            }
            manager.set_adapter(agent, adapter).unwrap();
        }
        manager
    }

    #[test]
    fn the_matrix_equals_hand_seated_evaluations_of_the_same_pairs() {
        let registry = Registry::with_builtins();
        let yaml = "env: {name: hanabi, players: 2, observation: compact}\n\
                    action: {mode: choice, choice_score: mean, chat_template: false}\n\
                    eval: {seed: 500}\n\
                    runtime: {eval_batch_episodes: 2}";
        let config = TrainConfig::from_yaml_str(yaml, std::path::Path::new("test.yaml"), &[], &registry).unwrap();
        let device = burn::tensor::Device::flex();
        let model = load_model(&config, &device).unwrap();
        let runs = vec![team(&config, &model, 1), team(&config, &model, 2)];
        let names = vec!["a".to_string(), "b".to_string()];
        let matrix = crossplay(&model, &runs, &names, &config, 4, &registry).unwrap();
        assert_eq!(matrix.cells.len(), 4);

        // By hand: each run saved as PEFT writes it, a directory assembled from agent_0 of one
        // and agent_1 of the other, loaded and evaluated as `troupe eval --adapters` does.
        let tmp = tempfile::tempdir().unwrap();
        for (k, run) in runs.iter().enumerate() {
            run.save_adapters(&tmp.path().join(format!("run{k}"))).unwrap();
        }
        let mut by_hand = Vec::new();
        for row in 0..2 {
            for column in 0..2 {
                let dir = tmp.path().join(format!("seated{row}{column}"));
                std::fs::create_dir_all(&dir).unwrap();
                let copy = |run: usize, name: &str| {
                    let from = tmp.path().join(format!("run{run}")).join(name);
                    std::fs::create_dir_all(dir.join(name)).unwrap();
                    for file in std::fs::read_dir(&from).unwrap() {
                        let file = file.unwrap().path();
                        std::fs::copy(&file, dir.join(name).join(file.file_name().unwrap())).unwrap();
                    }
                };
                copy(row, "agent_0");
                copy(column, "agent_1");
                let manifest = tmp.path().join(format!("run{column}")).join(crate::adapters::peft::MANIFEST_FILE);
                std::fs::copy(manifest, dir.join(crate::adapters::peft::MANIFEST_FILE)).unwrap();
                let mut manager = MultiAdapterManager::for_model(&model);
                manager.load_adapters(&dir).unwrap();
                let summary = evaluate(&model, &manager, &config, 4, &registry, None).unwrap();
                let cell = &matrix.cells[row * 2 + column];
                assert_eq!((cell.row, cell.column), (row, column));
                assert_eq!(cell.score, summary.score, "cell ({row}, {column})");
                assert_eq!(matrix.score[row][column], summary.score);
                assert_eq!(cell.mean_steps, summary.mean_steps, "cell ({row}, {column})");
                assert_eq!(cell.invalid_rate, summary.invalid_rate);
                by_hand.push(serde_json::to_string(&summary.metrics).unwrap());
            }
        }
        // The pairs play differently: the seating matters, so the equalities above say something.
        by_hand.sort();
        by_hand.dedup();
        assert!(by_hand.len() > 1, "every pairing played the same games");
    }

    #[test]
    fn runs_with_other_agents_are_refused() {
        let registry = Registry::with_builtins();
        let yaml = "env: {name: hanabi, players: 2, observation: compact}";
        let config = TrainConfig::from_yaml_str(yaml, std::path::Path::new("test.yaml"), &[], &registry).unwrap();
        let model = load_model(&config, &burn::tensor::Device::flex()).unwrap();
        let two = fresh_adapters(&config, &model).unwrap();
        let mut one = fresh_adapters(&config, &model).unwrap();
        one.remove_adapter(1).unwrap();
        let names = vec!["a".to_string(), "b".to_string()];
        let err = crossplay(&model, &[two.clone(), one], &names, &config, 1, &registry).unwrap_err().to_string();
        assert!(err.contains("b: agents [0]"), "{err}");
        let err = crossplay(&model, &[two], &names[..1], &config, 1, &registry).unwrap_err().to_string();
        assert!(err.contains("at least two runs"), "{err}");
    }
}
