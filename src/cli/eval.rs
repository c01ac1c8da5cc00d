//! `troupe eval --config FILE [--adapters DIR] [--episodes N]`: adapters play held-out
//! episodes; prints a JSON summary (mean score with its standard error, invalid-action rate,
//! ...). Without `--adapters` every seat must be a baseline (`eval.baseline_seats`).
//! `troupe eval --config FILE --crossplay RUN_A RUN_B [...]`: the self-play / cross-play matrix
//! of independently trained teams (agent 0 of one run with the other agents of another), as JSON.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use troupe_envs::Registry;

use crate::adapters::MultiAdapterManager;
use crate::rl::config::TrainConfig;
use crate::rl::credit::Credit;
use crate::rl::crossplay::crossplay;
use crate::rl::eval::evaluate;
use crate::rl::run::load_model;

/// Arguments of `troupe eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The run's YAML config (a run directory's `config.yaml` works too).
    #[arg(long)]
    pub config: PathBuf,
    /// The agents' adapters: a PEFT adapters directory (with `troupe.json`), a checkpoint
    /// directory, or a run directory (its newest checkpoint). Not needed when every seat is
    /// played by a baseline (`--set 'eval.baseline_seats={0: rule, 1: rule}'`).
    #[arg(long, conflicts_with = "crossplay")]
    pub adapters: Option<PathBuf>,
    /// Two or more runs (each as `--adapters` takes it): every ordered pair plays the held-out
    /// episodes, agent 0 from the row's run and the other agents from the column's; prints the
    /// matrix of mean scores ± s.e.
    #[arg(long, num_args = 2.., value_name = "RUN")]
    pub crossplay: Vec<PathBuf>,
    /// Episodes (default: the config's `eval.episodes`).
    #[arg(long)]
    pub episodes: Option<usize>,
    /// Override a config value, `key.path=value` (repeatable), e.g.
    /// `--set action.mode=free --set 'eval.baseline_seats={1: rule}'`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Keep the base quantized: `--set model.quantized=true`.
    #[arg(long)]
    pub quantized: bool,
    /// Precision of the base's matrices (`model.dtype`): auto, bf16, f16 or f32.
    #[arg(long, value_enum)]
    pub dtype: Option<crate::model::Precision>,
}

/// The adapters directory `path` names: itself, `path/adapters` (a checkpoint), or the newest
/// checkpoint's adapters of a run directory.
pub fn resolve_adapters_dir(path: &Path) -> anyhow::Result<PathBuf> {
    if let Some(dir) = crate::rl::run::adapters_dir_of(path)? {
        return Ok(dir);
    }
    if !path.exists() {
        anyhow::bail!("{}: no such directory", path.display());
    }
    anyhow::bail!(
        "{}: neither an adapters directory (troupe.json), a checkpoint, nor a run directory with checkpoints",
        path.display()
    )
}

/// Evaluates with the environments and policies of `registry`; prints the summary as JSON.
pub fn run(args: EvalArgs, device: Option<burn::tensor::Device>, registry: &Registry) -> anyhow::Result<()> {
    if let Some(episodes) = args.episodes {
        let limit = crate::rl::config::validate::MAX_EPISODES;
        if episodes == 0 || episodes > limit {
            anyhow::bail!("--episodes {episodes}: give between 1 and {limit} episodes");
        }
    }
    let mut set = args.set.clone();
    if args.quantized {
        set.push("model.quantized=true".to_string());
    }
    if let Some(dtype) = args.dtype {
        set.push(format!("model.dtype={}", dtype.name()));
    }
    let config = TrainConfig::from_yaml_file(&args.config, &set, registry)?;
    config.build_env(&args.config, registry)?;
    let device = match device {
        Some(d) => d,
        None => crate::device::parse_device(&config.model.device)?,
    };
    let episodes = args.episodes.unwrap_or(config.eval.episodes);
    if !args.crossplay.is_empty() {
        let dirs = args.crossplay.iter().map(|path| resolve_adapters_dir(path)).collect::<anyhow::Result<Vec<_>>>()?;
        let model = load_model(&config, &device)?;
        let mut runs = Vec::with_capacity(dirs.len());
        let mut names = Vec::with_capacity(dirs.len());
        for dir in dirs {
            let mut manager = MultiAdapterManager::for_model(&model);
            manager.load_adapters(&dir).with_context(|| format!("loading adapters from {}", dir.display()))?;
            runs.push(manager);
            names.push(dir.display().to_string());
        }
        let matrix = crossplay(&model, &runs, &names, &config, episodes, registry).context("cross-play")?;
        println!("{}", serde_json::to_string_pretty(&matrix)?);
        return Ok(());
    }
    let dir = match &args.adapters {
        Some(path) => Some(resolve_adapters_dir(path)?),
        None => {
            let seats = &config.agents.seats;
            if let Some(seat) = (0..seats.len()).find(|s| !config.eval.baseline_seats.contains_key(s)) {
                anyhow::bail!(
                    "--adapters is missing: seat {seat} is played by agent {} (without --adapters or --crossplay every seat needs a baseline in eval.baseline_seats)",
                    seats[seat]
                );
            }
            None
        }
    };
    let model = load_model(&config, &device)?;
    let mut manager = MultiAdapterManager::for_model(&model);
    if let Some(dir) = &dir {
        manager.load_adapters(dir).with_context(|| format!("loading adapters from {}", dir.display()))?;
    }
    tracing::info!("evaluating {episodes} held-out episodes of {}", config.env.name);
    let what = dir.as_ref().map_or_else(|| "the baselines".to_string(), |d| d.display().to_string());
    // The reward functions the run trains on (external processes started here) report too.
    let credit = Credit::new(&config, registry).with_context(|| format!("{}: rewards", args.config.display()))?;
    let summary = evaluate(&model, &manager, &config, episodes, registry, Some(&credit))
        .with_context(|| format!("evaluating {what}"))?;
    let mut value = serde_json::to_value(&summary)?;
    value["adapters"] = dir.map_or(serde_json::Value::Null, |d| serde_json::Value::String(d.display().to_string()));
    super::output::emit(serde_json::to_string_pretty(&value)?)?;
    Ok(())
}
