//! `troupe eval --config FILE --adapters DIR [--episodes N]`: adapters play held-out episodes;
//! prints a JSON summary (mean score with its standard error, invalid-action rate, ...).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use troupe_envs::Registry;

use crate::adapters::MultiAdapterManager;
use crate::rl::checkpoint::{latest_checkpoint, ADAPTERS_DIR};
use crate::rl::config::TrainConfig;
use crate::rl::eval::evaluate;
use crate::rl::run::load_model;

/// Arguments of `troupe eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The run's YAML config (a run directory's `config.yaml` works too).
    #[arg(long)]
    pub config: PathBuf,
    /// The agents' adapters: a PEFT adapters directory (with `troupe.json`), a checkpoint
    /// directory, or a run directory (its newest checkpoint).
    #[arg(long)]
    pub adapters: PathBuf,
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
}

/// The adapters directory `path` names: itself, `path/adapters` (a checkpoint), or the newest
/// checkpoint's adapters of a run directory.
pub fn resolve_adapters_dir(path: &Path) -> anyhow::Result<PathBuf> {
    if path.join(crate::adapters::peft::MANIFEST_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    if path.join(ADAPTERS_DIR).is_dir() {
        return Ok(path.join(ADAPTERS_DIR));
    }
    if let Some((_, dir)) = latest_checkpoint(path)? {
        return Ok(dir.join(ADAPTERS_DIR));
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
        let limit = crate::rl::limits::MAX_EPISODES;
        if episodes == 0 || episodes > limit {
            anyhow::bail!("--episodes {episodes}: give between 1 and {limit} episodes");
        }
    }
    let mut set = args.set.clone();
    if args.quantized {
        set.push("model.quantized=true".to_string());
    }
    let config = TrainConfig::from_yaml_file(&args.config, &set, registry)?;
    config.build_env(&args.config, registry)?;
    let device = match device {
        Some(d) => d,
        None => crate::device::parse_device(&config.model.device)?,
    };
    let dir = resolve_adapters_dir(&args.adapters)?;
    let model = load_model(&config, &device)?;
    let mut manager = MultiAdapterManager::for_model(&model);
    manager.load_adapters(&dir).with_context(|| format!("loading adapters from {}", dir.display()))?;
    let episodes = args.episodes.unwrap_or(config.eval.episodes);
    let summary = evaluate(&model, &manager, &config, episodes, registry)
        .with_context(|| format!("evaluating {}", dir.display()))?;
    let mut value = serde_json::to_value(&summary)?;
    value["adapters"] = serde_json::Value::String(dir.display().to_string());
    super::output::emit(serde_json::to_string_pretty(&value)?)?;
    Ok(())
}
