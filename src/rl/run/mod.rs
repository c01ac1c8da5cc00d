//! A training run on disk (DESIGN.md, "Training"): the run directory, its resolved config,
//! `metrics.jsonl`, and checkpoints, around a [`MagrpoTrainer`].
//!
//! A fresh run writes `config.yaml` and the checkpoint of iteration 0 (the untrained adapters,
//! the baseline `troupe eval` compares against), then one metrics line per iteration and a
//! checkpoint every `run.checkpoint_every` iterations and after the last. A resumed run loads
//! the newest complete checkpoint, cuts `metrics.jsonl` back to it, and continues with the same
//! random stream, so 2 + resume + 2 iterations equal 4 straight.
//!
//! No dead ends: the run directory is locked for the run's life ([`self::lock`]); a run cut
//! off before its first checkpoint was whole resumes from the start with `--resume`; an
//! unreadable newest checkpoint is set aside (renamed `corrupt-iteration-N`) and the previous
//! one is used, with a warning; a config that cannot fit the model is refused before the
//! directory is created ([`super::config::preflight`]); edits to `config.yaml` are checked on resume
//! ([`super::config::guard`]).

pub mod checkpoint;
pub mod lock;
pub mod metrics;
pub mod plot;
pub mod tracking;

use std::path::{Path, PathBuf};

use troupe_envs::Registry;

use self::checkpoint::{clean_staging, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint};
use self::lock::{RunLock, LOCK_FILE};
use self::metrics::{truncate_to, IterationMetrics, MetricsWriter};
use self::tracking::Trackers;
use super::config::{TrainConfig, CONFIG_FILE};
use super::rollout::EpisodeRecord;
use super::trainer::{MagrpoTrainer, RolloutPlan, TrainerState};
use crate::adapters::{AdapterMode, MultiAdapterManager};
use crate::error::{Result, RunError, TroupeError};
use crate::model::Model;

crate::section::config_section! {
    /// `run:` — the run directory, seed, length and cadence.
    pub struct RunConfig {
        /// The run directory (config.yaml, metrics.jsonl, checkpoints, plots).
        pub out_dir: std::path::PathBuf = std::path::PathBuf::from("runs/hanabi"),
        /// Seed of everything the run samples (deals, generations, dropout).
        pub seed: u64 = 0,
        /// Training iterations.
        pub iterations: usize = 30,
        /// A checkpoint every this many iterations (and after the last one).
        pub checkpoint_every: usize = 5,
        /// A log line every this many iterations (metrics.jsonl gets every iteration).
        pub log_every: usize = 1,
        /// Where the metrics go: `jsonl` (`metrics.jsonl`, always written) and `tensorboard`
        /// (event files in `RUN_DIR/tensorboard/`, TRL's metric names; see `docs/tracking.md`).
        pub report_to: Vec<tracking::ReportTo> = tracking::default_report_to(),
    }
}

/// A run in progress: its directory, config, trainer and metrics file.
pub struct TrainingRun {
    /// The run directory.
    pub run_dir: PathBuf,
    /// The resolved config (what `config.yaml` holds).
    pub config: TrainConfig,
    /// The trainer (model, adapters, optimizer states, RNG, iteration count).
    pub trainer: MagrpoTrainer,
    /// The newest checkpoint on disk, as (iteration, directory).
    pub last_checkpoint: (u64, PathBuf),
    /// Seconds the last [`TrainingRun::run_iteration`] spent writing a checkpoint (0 when it
    /// wrote none); not in `metrics.jsonl`, whose line is written before the checkpoint.
    pub checkpoint_seconds: f64,
    metrics: MetricsWriter,
    /// `run.report_to`'s trackers besides `metrics.jsonl`.
    trackers: Trackers,
    /// Held for the run's life: no second trainer in this directory.
    _lock: RunLock,
}

/// An iteration begun by [`TrainingRun::begin_iteration`]: its rollout plan, waiting for its
/// episodes.
#[derive(Clone, Debug)]
pub struct PendingIteration {
    /// The episodes to play.
    pub plan: RolloutPlan,
    warmup: Vec<f64>,
    warmup_seconds: f64,
}

/// The model a config names: a Hugging Face directory, or the built-in preset; its attention
/// kernel `runtime.attention`, its rollouts' prompt cache `runtime.prompt_cache` and the cache's
/// element type `runtime.kv_cache`.
pub fn load_model(config: &TrainConfig, device: &burn::tensor::Device) -> Result<Model> {
    let mut model = Model::load(&config.model, device).map_err(|err| match err {
        TroupeError::BadValue { key: name, message, .. } if name == "model.preset" => {
            TroupeError::BadValue { origin: Some(PathBuf::from(CONFIG_FILE)), key: name, message }
        }
        other => other,
    })?;
    model.lm.set_attention_kernel(config.runtime.attention);
    model.lm.set_prompt_cache(config.runtime.prompt_cache);
    model.lm.set_kv_cache(config.runtime.kv_cache);
    Ok(model)
}

/// The agents' fresh adapters, as the config asks (seeded from the run seed).
pub fn fresh_adapters(config: &TrainConfig, model: &Model) -> Result<MultiAdapterManager> {
    let mut manager = MultiAdapterManager::for_model(model);
    let adapter = config.adapter_config();
    match config.agents.mode {
        AdapterMode::PerAgent => manager.create_adapters_seeded(config.agents.num_agents, &adapter, config.run.seed)?,
        AdapterMode::Shared => manager.create_shared_adapter(config.agents.num_agents, &adapter, config.run.seed)?,
    }
    Ok(manager)
}

/// The adapters directory `path` names: itself (a PEFT adapters directory with `troupe.json`),
/// `path/adapters` (a checkpoint), or the newest checkpoint's adapters of a run directory;
/// `None` when it is none of these.
pub fn adapters_dir_of(path: &Path) -> Result<Option<PathBuf>> {
    if path.join(crate::adapters::peft::MANIFEST_FILE).exists() {
        return Ok(Some(path.to_path_buf()));
    }
    if path.join(checkpoint::ADAPTERS_DIR).is_dir() {
        return Ok(Some(path.join(checkpoint::ADAPTERS_DIR)));
    }
    if path.is_dir() {
        if let Some((_, dir)) = latest_checkpoint(path)? {
            return Ok(Some(dir.join(checkpoint::ADAPTERS_DIR)));
        }
    }
    Ok(None)
}

/// The adapters a new run starts from: fresh ones ([`fresh_adapters`]), or those
/// `agents.init_adapters` names, checked to hold the config's agents, mode and adapter shape
/// (each keeps the config's `adapter:` settings, dropout included). `origin` names the config
/// file in errors.
pub fn initial_adapters(config: &TrainConfig, model: &Model, origin: &Path) -> Result<MultiAdapterManager> {
    let mut manager = fresh_adapters(config, model)?;
    let Some(path) = &config.agents.init_adapters else {
        return Ok(manager);
    };
    let bad = |key: &str, message: String| TroupeError::config(origin, key, message);
    let dir = adapters_dir_of(path)?.ok_or_else(|| {
        let what = if path.exists() {
            "neither an adapters directory (troupe.json), a checkpoint, nor a run directory with checkpoints"
        } else {
            "no such directory"
        };
        bad("agents.init_adapters", format!("{}: {what}", path.display()))
    })?;
    let mut loaded = MultiAdapterManager::for_model(model);
    loaded.load_adapters(&dir).map_err(|err| bad("agents.init_adapters", format!("{}: {err}", dir.display())))?;
    if loaded.mode() != manager.mode() || loaded.agent_ids() != manager.agent_ids() {
        return Err(bad(
            "agents.init_adapters",
            format!(
                "{} holds agents {:?} ({:?} mode); the config has agents {:?} ({:?} mode, agents.num_agents, agents.mode)",
                dir.display(),
                loaded.agent_ids(),
                loaded.mode(),
                manager.agent_ids(),
                manager.mode()
            ),
        ));
    }
    let wanted = config.adapter_config();
    for agent in manager.agent_ids() {
        let mut adapter = loaded.adapter(agent)?.clone();
        let have = &adapter.config;
        let targets = |c: &crate::adapters::AdapterConfig| {
            let mut t: Vec<String> = c.target_modules.iter().map(|p| p.module_name().to_string()).collect();
            t.sort();
            t
        };
        let differs = [
            ("adapter.r", have.r != wanted.r, format!("{}", have.r), format!("{}", wanted.r)),
            (
                "adapter.lora_alpha",
                have.lora_alpha != wanted.lora_alpha,
                have.lora_alpha.to_string(),
                wanted.lora_alpha.to_string(),
            ),
            (
                "adapter.use_rslora",
                have.use_rslora != wanted.use_rslora,
                have.use_rslora.to_string(),
                wanted.use_rslora.to_string(),
            ),
            (
                "adapter.target_modules",
                targets(have) != targets(&wanted),
                format!("{:?}", targets(have)),
                format!("{:?}", targets(&wanted)),
            ),
        ];
        if let Some((key, _, theirs, ours)) = differs.into_iter().find(|d| d.1) {
            return Err(bad(
                key,
                format!("{ours}, but agent {agent}'s adapter in {} (agents.init_adapters) has {theirs}", dir.display()),
            ));
        }
        adapter.config = wanted.clone();
        manager.set_adapter(agent, adapter)?;
    }
    Ok(manager)
}

impl TrainingRun {
    /// Starts a new run in `config.run.out_dir`, which must not hold a run already. Writes
    /// `config.yaml` and the checkpoint of iteration 0. `origin` names the config file in errors.
    /// Refuses a directory that holds a run already, or anything else (it is not troupe's to
    /// fill), and one another trainer holds; checks the config against the model before the
    /// directory is created.
    pub fn start(
        config: TrainConfig,
        origin: &Path,
        registry: Registry,
        device: &burn::tensor::Device,
    ) -> Result<Self> {
        config.build_env(origin, &registry)?;
        let run_dir = config.run.out_dir.clone();
        // A directory a trainer made (or is making) is locked first, so that a trainer still
        // running there is named; any other directory is refused before anything is written.
        let early_lock = if run_dir.join(LOCK_FILE).exists() || run_dir.join(CONFIG_FILE).exists() {
            Some(RunLock::acquire(&run_dir)?)
        } else {
            None
        };
        check_fresh_dir(&run_dir)?;
        let model = load_model(&config, device)?;
        super::config::preflight::check_against_model(&config, origin, &model, &registry)?;
        let manager = initial_adapters(&config, &model, origin)?;
        let lock = match early_lock {
            Some(lock) => lock,
            None => RunLock::acquire(&run_dir)?,
        };
        // Checked again under the lock: another trainer may have started here meanwhile.
        check_fresh_dir(&run_dir)?;
        Self::begin(config, run_dir, model, manager, registry, lock)
    }

    /// The fresh state of a run in `run_dir` (locked): `config.yaml`, the reference copy of
    /// the config, an empty `metrics.jsonl` and the checkpoint of iteration 0.
    fn begin(
        config: TrainConfig,
        run_dir: PathBuf,
        model: Model,
        manager: MultiAdapterManager,
        registry: Registry,
        lock: RunLock,
    ) -> Result<Self> {
        let trainer = MagrpoTrainer::new(model, manager, registry, &config)?;
        config.save(&run_dir)?;
        super::config::guard::record(&config, &run_dir)?;
        let _ = std::fs::remove_file(self::metrics::metrics_path(&run_dir));
        let metrics = MetricsWriter::open(&run_dir)?;
        let trackers = Trackers::open(&run_dir, &config.run.report_to)?;
        let state = trainer.state();
        let dir = save_checkpoint(&run_dir, 0, &trainer.manager, &state.optimizer_states, &state.rng)?;
        Ok(Self {
            run_dir,
            config,
            trainer,
            last_checkpoint: (0, dir),
            checkpoint_seconds: 0.0,
            metrics,
            trackers,
            _lock: lock,
        })
    }

    /// Continues the run in `run_dir` from its newest complete checkpoint. `overrides`
    /// (`--set`) may only change `run.iterations`, `run.checkpoint_every` and `run.log_every`:
    /// anything else would make the continued run a different experiment.
    pub fn resume(
        run_dir: &Path,
        overrides: &[String],
        registry: Registry,
        device: &burn::tensor::Device,
    ) -> Result<Self> {
        let config_path = run_dir.join(CONFIG_FILE);
        if !config_path.exists() {
            return Err(TroupeError::Run(RunError::Checkpoint {
                path: run_dir.to_path_buf(),
                message: format!("no {CONFIG_FILE}: not a run directory"),
            }));
        }
        let lock = RunLock::acquire(run_dir)?;
        for raw in overrides {
            let raw = crate::rl::config::migrate::moved_override(raw);
            let key = raw.split('=').next().unwrap_or("").trim();
            if !matches!(key, "run.iterations" | "run.checkpoint_every" | "run.log_every") {
                return Err(TroupeError::BadValue { origin: Some(PathBuf::from("--set")), key: key.to_string(), message: "a resumed run keeps its config; only run.iterations, run.checkpoint_every and run.log_every may change".into() });
            }
        }
        let mut config = TrainConfig::from_yaml_file(&config_path, overrides, &registry)?;
        super::config::guard::check_resume(&config, run_dir)?;
        // The run lives where it is now, even if it was moved since it started.
        config.run.out_dir = run_dir.to_path_buf();
        clean_staging(run_dir)?;
        let latest = latest_checkpoint(run_dir)?;
        if let Some((last, _)) = latest.as_ref().filter(|(last, _)| *last > config.run.iterations as u64) {
            let from_set = overrides.iter().any(|o| o.split('=').next().is_some_and(|k| k.trim() == "run.iterations"));
            return Err(TroupeError::config(
                if from_set { PathBuf::from("--set") } else { config_path.clone() },
                "run.iterations",
                format!(
                    "{} is below the run's last checkpoint (iteration {last}): a resumed run only goes forward; set run.iterations above {last} to continue it",
                    config.run.iterations
                ),
            ));
        }
        let model = load_model(&config, device)?;
        if latest.is_none() {
            // Cut off before its first checkpoint was whole (a kill, a full disk): nothing was
            // trained yet, so the run starts again from its saved config.
            tracing::warn!(
                "{} has no complete checkpoint (the run stopped while writing its first); starting it again from iteration 0",
                run_dir.display()
            );
            super::config::preflight::check_against_model(&config, &config_path, &model, &registry)?;
            let manager = initial_adapters(&config, &model, &config_path)?;
            return Self::begin(config, run_dir.to_path_buf(), model, manager, registry, lock);
        }
        let mut manager = fresh_adapters(&config, &model)?;
        let (checkpoint, dir) = load_newest_readable(run_dir, &mut manager, device)?;
        let mut trainer = MagrpoTrainer::new(model, manager, registry, &config)?;
        trainer.restore(TrainerState {
            iteration: checkpoint.iteration,
            rng: checkpoint.rng,
            optimizer_states: checkpoint.optimizer_states,
        });
        let saved_iterations = TrainConfig::from_yaml_file(&config_path, &[], trainer.registry())?.run.iterations;
        if saved_iterations != config.run.iterations && config.training.lr_final_fraction < 1.0 {
            let next = checkpoint.iteration + 1;
            tracing::warn!(
                "run.iterations {saved_iterations} -> {}: the learning rate's decay is recomputed to end at iteration {}; iteration {next} runs at {:.3e}",
                config.run.iterations,
                config.run.iterations,
                trainer.learning_rate(next)
            );
        }
        if !overrides.is_empty() {
            config.save(run_dir)?;
        }
        truncate_to(run_dir, checkpoint.iteration)?;
        let metrics = MetricsWriter::open(run_dir)?;
        let trackers = Trackers::open(run_dir, &config.run.report_to)?;
        Ok(Self {
            run_dir: run_dir.to_path_buf(),
            config,
            trainer,
            last_checkpoint: (checkpoint.iteration, dir),
            checkpoint_seconds: 0.0,
            metrics,
            trackers,
            _lock: lock,
        })
    }

    /// Iterations done.
    pub fn iteration(&self) -> u64 {
        self.trainer.iteration()
    }

    /// Whether every configured iteration is done.
    pub fn finished(&self) -> bool {
        self.trainer.iteration() >= self.config.run.iterations as u64
    }

    /// Runs one iteration, appends its metrics line, and checkpoints when due (every
    /// `run.checkpoint_every` iterations, and after the last). A failed iteration (a NaN loss,
    /// say) changes nothing on disk: the newest checkpoint stays the last good state.
    pub fn run_iteration(&mut self) -> Result<IterationMetrics> {
        let started = std::time::Instant::now();
        let pending = self.begin_iteration()?;
        let episodes = self.trainer.play(&pending.plan, 0..pending.plan.episodes())?;
        self.finish_iteration(pending, episodes, started.elapsed().as_secs_f64())
    }

    /// The first half of [`TrainingRun::run_iteration`], for rollouts played elsewhere (other
    /// processes holding the same base): the format warm-up when the run is at iteration 0, then
    /// the iteration's [`RolloutPlan`]. Ship the adapters as they are after this call.
    pub fn begin_iteration(&mut self) -> Result<PendingIteration> {
        // The format warm-up belongs to the first iteration (a run resumed from checkpoint 0
        // repeats it from the same random state).
        let warmup_started = std::time::Instant::now();
        let warmup = if self.trainer.iteration() == 0 { self.trainer.format_warmup()? } else { Vec::new() };
        let warmup_seconds = warmup_started.elapsed().as_secs_f64();
        Ok(PendingIteration { plan: self.trainer.plan(), warmup, warmup_seconds })
    }

    /// The second half of [`TrainingRun::run_iteration`]: learns from `pending`'s episodes (all
    /// of them, in plan order; `rollout_seconds` is the time they took), appends the metrics
    /// line and checkpoints when due.
    pub fn finish_iteration(
        &mut self,
        pending: PendingIteration,
        episodes: Vec<EpisodeRecord>,
        rollout_seconds: f64,
    ) -> Result<IterationMetrics> {
        let PendingIteration { plan, warmup, warmup_seconds } = pending;
        let stats = self.trainer.learn(&plan, episodes, rollout_seconds)?;
        let mut metrics = IterationMetrics::from(&stats);
        if let (Some(first), Some(last)) = (warmup.first(), warmup.last()) {
            metrics.extra.insert("format_warmup_nll_first".into(), *first);
            metrics.extra.insert("format_warmup_nll_last".into(), *last);
            metrics.extra.insert("format_warmup_seconds".into(), warmup_seconds);
            metrics.seconds += warmup_seconds;
        }
        let iteration = stats.iteration;
        let eval = &self.config.eval;
        let last = iteration >= self.config.run.iterations as u64;
        if eval.every > 0 && (iteration % eval.every as u64 == 0 || last) {
            let started = std::time::Instant::now();
            let summary = crate::profile::kernels::scoped("eval", || self.held_out_eval())?;
            metrics.extra.insert("eval_score".into(), summary.score.mean);
            metrics.extra.insert("eval_score_stderr".into(), summary.score.stderr);
            metrics.extra.insert("eval_episode_steps".into(), summary.mean_steps);
            metrics.extra.insert("eval_invalid_rate".into(), summary.invalid_rate);
            for (label, value) in &summary.rewards {
                metrics.extra.insert(format!("eval_rewards/{label}/mean"), value.mean);
                metrics.extra.insert(format!("eval_rewards/{label}/stderr"), value.stderr);
            }
            metrics.extra.insert("seconds_eval".into(), started.elapsed().as_secs_f64());
            metrics.seconds += started.elapsed().as_secs_f64();
        }
        self.metrics.append(&metrics)?;
        self.trackers.log(&metrics)?;
        self.checkpoint_seconds = 0.0;
        if iteration % self.config.run.checkpoint_every as u64 == 0 || iteration >= self.config.run.iterations as u64 {
            let started = std::time::Instant::now();
            crate::profile::kernels::scoped("checkpoint", || self.checkpoint())?;
            self.checkpoint_seconds = started.elapsed().as_secs_f64();
        }
        Ok(metrics)
    }

    /// The agents' held-out evaluation during training: `eval.every_episodes` whole episodes
    /// on the fixed deals `eval.seed + i`, every seat played by its agent. Its randomness is its
    /// own (seeded from `eval.seed`), so it does not change the run's random stream.
    pub fn held_out_eval(&self) -> Result<super::eval::EvalSummary> {
        let mut config = self.config.clone();
        config.eval.baseline_seats.clear();
        let t = &self.trainer;
        super::eval::evaluate(&t.model, &t.manager, &config, config.eval.every_episodes, t.registry(), Some(t.credit()))
    }

    /// Writes a checkpoint of the current state now.
    pub fn checkpoint(&mut self) -> Result<PathBuf> {
        let t = &self.trainer;
        let state = t.state();
        let dir = save_checkpoint(&self.run_dir, state.iteration, &t.manager, &state.optimizer_states, &state.rng)?;
        self.last_checkpoint = (state.iteration, dir.clone());
        Ok(dir)
    }
}

/// Refuses `run_dir` when it holds a run already (pointing at `--resume`) or anything else but
/// a lock file (a directory troupe did not make is not troupe's to fill).
fn check_fresh_dir(run_dir: &Path) -> Result<()> {
    if run_dir.join(CONFIG_FILE).exists() || latest_checkpoint(run_dir)?.is_some() {
        return Err(TroupeError::Run(RunError::Checkpoint {
            path: run_dir.to_path_buf(),
            message: format!(
                "already holds a run; continue it with `troupe train --resume {}` or choose another run.out_dir",
                run_dir.display()
            ),
        }));
    }
    if run_dir.exists() && !run_dir.is_dir() {
        return Err(TroupeError::Run(RunError::Checkpoint {
            path: run_dir.to_path_buf(),
            message: "run.out_dir is a file, not a directory".into(),
        }));
    }
    if let Ok(entries) = std::fs::read_dir(run_dir) {
        let others: Vec<String> = entries
            .filter_map(|entry| entry.ok())
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name != LOCK_FILE)
            .collect();
        if !others.is_empty() {
            return Err(TroupeError::Run(RunError::Checkpoint {
                path: run_dir.to_path_buf(),
                message: format!(
                    "exists and is not a run directory (it holds {}{}); choose an empty or new run.out_dir",
                    others.iter().take(3).cloned().collect::<Vec<_>>().join(", "),
                    if others.len() > 3 { ", ..." } else { "" }
                ),
            }));
        }
    }
    Ok(())
}

/// Loads the newest checkpoint that reads whole. One that does not is renamed
/// `corrupt-iteration-N` (kept for inspection, never tried again) and the one before it is
/// used, with a warning naming both.
fn load_newest_readable(
    run_dir: &Path,
    manager: &mut MultiAdapterManager,
    device: &burn::tensor::Device,
) -> Result<(self::checkpoint::Checkpoint, PathBuf)> {
    let mut failures: Vec<String> = Vec::new();
    for (_, dir) in list_checkpoints(run_dir)?.into_iter().rev() {
        match load_checkpoint(&dir, manager, device) {
            Ok(checkpoint) => {
                if !failures.is_empty() {
                    tracing::warn!("resuming from {} instead: {}", dir.display(), failures.join("; "));
                    eprintln!("warning: {}; resuming from {}", failures.join("; "), dir.display());
                }
                return Ok((checkpoint, dir));
            }
            Err(err) => {
                let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let aside = dir.with_file_name(format!("corrupt-{name}"));
                let _ = std::fs::remove_dir_all(&aside);
                std::fs::rename(&dir, &aside).map_err(|e| TroupeError::io(&dir, e))?;
                failures.push(format!(
                    "checkpoint {} is unreadable ({err}); moved to {}",
                    dir.display(),
                    aside.display()
                ));
            }
        }
    }
    Err(TroupeError::Run(RunError::Checkpoint {
        path: run_dir.join(self::checkpoint::CHECKPOINTS_DIR),
        message: format!("no readable checkpoint to resume from: {}", failures.join("; ")),
    }))
}
