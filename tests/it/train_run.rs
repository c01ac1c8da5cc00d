//! Training runs on disk: exact resume, checkpoints that survive a kill, the NaN stop, and the
//! eval summary. Tiny settings (built-in tiny model, 2-step Hanabi episodes) keep them fast.

use crate::common;

use std::path::{Path, PathBuf};

use troupe::error::{RunError, TroupeError};
use troupe::rl::config::TrainConfig;
use troupe::rl::run::checkpoint::{checkpoint_dir, list_checkpoints, write_checkpoint_files, CHECKPOINTS_DIR};
use troupe::rl::run::metrics::{metrics_path, read_metrics, IterationMetrics};
use troupe::rl::run::TrainingRun;
use troupe_envs::Registry;

/// A 2-player Hanabi config small enough for tests, writing to `out_dir`.
fn config(out_dir: &Path, iterations: usize, checkpoint_every: usize, extra: &[&str]) -> TrainConfig {
    let yaml = format!(
        "run: {{out_dir: {out}, seed: 11, iterations: {iterations}, checkpoint_every: {checkpoint_every}}}\n\
         env: {{name: hanabi, players: 2, history_moves: 1}}\n\
         adapter: {{r: 4, lora_alpha: 8.0}}\n\
         action: {{mode: free, max_new_tokens: 4, chat_template: false}}\n\
         training: {{group_size: 2, groups_per_iteration: 1, lr: 1.0e-2, warmup_iterations: 1, max_episode_steps: 3}}\n",
        out = out_dir.display()
    );
    let overrides: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    TrainConfig::from_yaml_str(&yaml, Path::new("test.yaml"), &overrides, &Registry::with_builtins()).unwrap()
}

fn try_start(config: TrainConfig) -> Result<TrainingRun, TroupeError> {
    TrainingRun::start(config, Path::new("test.yaml"), Registry::with_builtins(), &common::test_device())
}

fn start(config: TrainConfig) -> TrainingRun {
    try_start(config).unwrap()
}

fn try_resume(run_dir: &Path, overrides: &[&str]) -> Result<TrainingRun, TroupeError> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    TrainingRun::resume(run_dir, &overrides, Registry::with_builtins(), &common::test_device())
}

fn resume(run_dir: &Path, overrides: &[&str]) -> TrainingRun {
    try_resume(run_dir, overrides).unwrap()
}

fn finish(run: &mut TrainingRun) {
    while !run.finished() {
        run.run_iteration().unwrap();
    }
}

/// Trains a fresh run to its last iteration, then closes it (its lock released).
fn train_to_end(config: TrainConfig) {
    finish(&mut start(config));
}

/// Every file of a checkpoint's adapters directory, by relative path.
fn adapter_files(checkpoint: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let root = checkpoint.join("adapters");
    let mut out = Vec::new();
    for agent in std::fs::read_dir(&root).unwrap() {
        let agent = agent.unwrap().path();
        if agent.is_dir() {
            for file in std::fs::read_dir(&agent).unwrap() {
                let file = file.unwrap().path();
                out.push((file.strip_prefix(&root).unwrap().to_path_buf(), std::fs::read(&file).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// The metrics that must replay exactly (everything but wall-clock timings and, on a GPU, the
/// device memory, which follows the allocator's history in the process).
fn replayable(metrics: &[IterationMetrics]) -> Vec<IterationMetrics> {
    metrics
        .iter()
        .cloned()
        .map(|mut m| {
            m.seconds = 0.0;
            m.tokens_per_second = 0.0;
            m.extra.retain(|key, _| {
                !key.starts_with("seconds_") && !key.starts_with("gflop_per_second_") && !key.starts_with("memory_")
            });
            m
        })
        .collect()
}

fn metrics(run_dir: &Path) -> Vec<IterationMetrics> {
    read_metrics(&metrics_path(run_dir)).unwrap().records
}

#[test]
fn four_iterations_straight_equal_two_plus_resume_plus_two() {
    let tmp = tempfile::tempdir().unwrap();
    let straight = tmp.path().join("straight");
    train_to_end(config(&straight, 4, 2, &[]));

    let split = tmp.path().join("split");
    train_to_end(config(&split, 2, 2, &[]));
    let mut second = resume(&split, &["run.iterations=4"]);
    assert_eq!(second.iteration(), 2);
    finish(&mut second);

    let a = adapter_files(&checkpoint_dir(&straight, 4));
    let b = adapter_files(&checkpoint_dir(&split, 4));
    assert!(!a.is_empty());
    assert_eq!(a, b, "adapters after 4 straight and 2 + 2 are byte-identical");
    assert_ne!(a, adapter_files(&checkpoint_dir(&straight, 0)), "training changed the adapters");
    let (ma, mb) = (metrics(&straight), metrics(&split));
    assert_eq!(ma.len(), 4);
    assert_eq!(replayable(&ma), replayable(&mb));
    let opt = |dir: &Path| std::fs::read(checkpoint_dir(dir, 4).join("optimizer.safetensors")).unwrap();
    assert_eq!(opt(&straight), opt(&split), "optimizer moments too");
}

#[test]
fn a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint_usable() {
    let tmp = tempfile::tempdir().unwrap();
    let straight = tmp.path().join("straight");
    train_to_end(config(&straight, 3, 1, &[]));

    let killed = tmp.path().join("killed");
    let mut run = start(config(&killed, 3, 1, &[]));
    run.run_iteration().unwrap();
    run.run_iteration().unwrap();
    // The process dies while writing checkpoint 3: the trainer ran iteration 3, its metrics
    // line is half written, and the checkpoint's staging directory holds a partial write.
    run.trainer.step().unwrap();
    let staging = killed.join(CHECKPOINTS_DIR).join(".iteration-000003.staging-4242");
    std::fs::create_dir_all(&staging).unwrap();
    let t = &run.trainer;
    let state = t.state();
    write_checkpoint_files(&staging, 3, &t.manager, &state.optimizer_states, &state.rng).unwrap();
    let optimizer = staging.join("optimizer.safetensors");
    let bytes = std::fs::read(&optimizer).unwrap();
    std::fs::write(&optimizer, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::remove_file(staging.join("state.json")).unwrap();
    drop(run);
    let mut file = std::fs::OpenOptions::new().append(true).open(metrics_path(&killed)).unwrap();
    std::io::Write::write_all(&mut file, b"{\"iteration\": 3, \"mean_ret").unwrap();
    drop(file);

    let listed: Vec<u64> = list_checkpoints(&killed).unwrap().into_iter().map(|(i, _)| i).collect();
    assert_eq!(listed, vec![0, 1, 2], "the partial checkpoint is not listed");
    let mut resumed = resume(&killed, &[]);
    assert_eq!(resumed.iteration(), 2, "resumes from the last whole checkpoint");
    assert!(!staging.exists(), "the partial write is cleaned up");
    finish(&mut resumed);
    assert_eq!(adapter_files(&checkpoint_dir(&straight, 3)), adapter_files(&checkpoint_dir(&killed, 3)));
    assert_eq!(replayable(&metrics(&straight)), replayable(&metrics(&killed)));
}

#[test]
fn a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("nan");
    let mut run = start(config(&dir, 4, 1, &[]));
    run.run_iteration().unwrap();
    let good = adapter_files(&checkpoint_dir(&dir, 1));
    // A diverged adapter: every B factor of agent 0 is NaN, so its log-probs and the loss are.
    let mut adapter = run.trainer.manager.adapter(0).unwrap().clone();
    for pair in adapter.pairs.values_mut() {
        pair.b = pair.b.clone().mul_scalar(f32::NAN);
    }
    run.trainer.manager.set_adapter(0, adapter).unwrap();
    let err = run.run_iteration().expect_err("a NaN loss is an error");
    assert!(matches!(err, TroupeError::Run(RunError::NonFinite { .. })), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("iteration 2") && message.contains("NaN"), "{message}");
    assert_eq!(run.iteration(), 1, "the failed iteration does not count");
    drop(run);
    let listed: Vec<u64> = list_checkpoints(&dir).unwrap().into_iter().map(|(i, _)| i).collect();
    assert_eq!(listed, vec![0, 1]);
    assert_eq!(adapter_files(&checkpoint_dir(&dir, 1)), good);
    assert_eq!(metrics(&dir).len(), 1, "no metrics line for the failed iteration");
    let resumed = resume(&dir, &[]);
    assert_eq!(resumed.iteration(), 1);
}

#[test]
fn a_directory_holding_a_run_is_not_overwritten_and_resume_keeps_the_experiment() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let run = start(config(&dir, 1, 1, &[]));
    drop(run);
    let err = try_start(config(&dir, 1, 1, &[])).err().unwrap().to_string();
    assert!(err.contains("already holds a run") && err.contains("--resume"), "{err}");
    let err = try_resume(&dir, &["training.lr=1.0"]).err().unwrap().to_string();
    assert!(err.contains("training.optimizer.lr") && err.contains("only run.iterations"), "{err}");
    let err = try_resume(&tmp.path().join("nowhere"), &[]).err().unwrap().to_string();
    assert!(err.contains("not a run directory"), "{err}");
}

#[test]
fn a_run_starts_from_an_earlier_runs_adapters_and_refuses_ones_of_another_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let first = tmp.path().join("first");
    train_to_end(config(&first, 2, 2, &[]));
    let trained = adapter_files(&checkpoint_dir(&first, 2));
    assert!(trained != adapter_files(&checkpoint_dir(&first, 0)), "the first run trained");

    // A run directory (its newest checkpoint), a checkpoint, or an adapters directory.
    let sources = [first.clone(), checkpoint_dir(&first, 2), checkpoint_dir(&first, 2).join("adapters")];
    for (i, source) in sources.iter().enumerate() {
        let out = tmp.path().join(format!("from-{i}"));
        let init = format!("agents.init_adapters={}", source.display());
        let mut run = start(config(&out, 2, 2, &[&init]));
        assert!(adapter_files(&checkpoint_dir(&out, 0)) == trained, "{}: starts from them", source.display());
        finish(&mut run);
        assert!(adapter_files(&checkpoint_dir(&out, 2)) != trained, "{}: training goes on", source.display());
    }

    let init = format!("agents.init_adapters={}", first.display());
    for (extra, expected) in [
        ("adapter.r=8", vec!["adapter.r", "8", "4", "init_adapters"]),
        ("adapter.target_modules=[q_proj]", vec!["adapter.target_modules", "init_adapters"]),
        ("agents.mode=shared", vec!["agents.init_adapters", "Shared", "PerAgent"]),
    ] {
        let out = tmp.path().join("refused");
        let err = try_start(config(&out, 1, 1, &[&init, extra])).err().expect(extra).to_string();
        for part in expected {
            assert!(err.contains(part), "{extra}: {err}");
        }
        assert!(!out.exists(), "{extra}: nothing written");
    }
    let missing = tmp.path().join("missing");
    let set = format!("agents.init_adapters={}", missing.display());
    let err = try_start(config(&tmp.path().join("refused"), 1, 1, &[&set])).err().unwrap().to_string();
    assert!(err.contains("agents.init_adapters") && err.contains("no such directory"), "{err}");
}

/// On a GPU every iteration's metrics hold the device memory each phase kept, read from the
/// allocator: at least the base's weights whenever the run holds them, the decoding phase's
/// cache on top, and a reservation covering all of it; on the CPU there is no allocator to read.
#[test]
fn a_gpu_runs_metrics_hold_each_phases_device_memory_and_a_cpu_runs_none() {
    let dir = tempfile::tempdir().unwrap();
    let mut run = start(config(&dir.path().join("run"), 2, 10, &[]));
    let weights = run.trainer.model.lm.weight_bytes() as f64 / (1024.0 * 1024.0);
    finish(&mut run);
    let gpu = troupe::profile::memory::read(&common::test_device()).is_some();
    for line in metrics(&dir.path().join("run")) {
        let memory: Vec<(&String, &f64)> = line.extra.iter().filter(|(k, _)| k.starts_with("memory_")).collect();
        if !gpu {
            assert!(memory.is_empty(), "the CPU has no device memory to report: {memory:?}");
            continue;
        }
        let mib = |phase: &str| line.extra.get(&format!("memory_mib_{phase}")).copied();
        let reserved = line.extra["memory_reserved_mib"];
        let (decode, credit) = (mib("decode").unwrap(), mib("credit").unwrap());
        assert!(credit >= weights && decode >= weights, "the weights ({weights} MiB) are held: {memory:?}");
        for (key, value) in &memory {
            assert!(reserved >= **value, "{key} exceeds the reservation: {memory:?}");
        }
        if let Some(forward) = mib("update_forward") {
            assert!(forward >= credit, "the update's forward keeps its activations: {memory:?}");
        }
    }
}
