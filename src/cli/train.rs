//! `troupe train --config FILE [--set key.path=value]... [--resume RUN_DIR]`: a MAGRPO run
//! with a progress bar on stderr, metrics and checkpoints in the run directory, and a JSON
//! summary on stdout.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use troupe_envs::Registry;

use crate::error::TroupeError;
use crate::rl::config::TrainConfig;
use crate::rl::run::TrainingRun;

/// Arguments of `troupe train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The run's YAML config (`configs/hanabi.yaml`, ...).
    #[arg(long, required_unless_present = "resume", conflicts_with = "resume")]
    pub config: Option<PathBuf>,
    /// Override a config value, `key.path=value` (repeatable; YAML value). With `--resume`, only
    /// `run.iterations`, `run.checkpoint_every` and `run.log_every`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Continue the run in this directory from its newest checkpoint, exactly.
    #[arg(long, value_name = "RUN_DIR")]
    pub resume: Option<PathBuf>,
    /// No progress bar (log lines only).
    #[arg(long)]
    pub quiet: bool,
    /// Print the resolved config (the file and every `--set`, with every default written out)
    /// as YAML on stdout, and train nothing.
    #[arg(long)]
    pub print_config: bool,
    /// Keep the base quantized: `--set model.quantized=true`.
    #[arg(long, conflicts_with = "resume")]
    pub quantized: bool,
}

/// Runs (or resumes) the training run with the environments and policies of `registry`; prints
/// `{"run_dir", "iterations", "last", "checkpoint"}`.
pub fn run(args: TrainArgs, device: Option<burn::tensor::Device>, registry: &Registry) -> anyhow::Result<()> {
    let registry = registry.clone();
    let mut set = args.set.clone();
    if args.quantized {
        set.push("model.quantized=true".to_string());
    }
    if args.print_config {
        let config = match (&args.resume, &args.config) {
            (Some(run_dir), _) => TrainConfig::from_run_dir(run_dir, &registry)?,
            (None, Some(path)) => TrainConfig::from_yaml_file(path, &set, &registry)?,
            (None, None) => anyhow::bail!("give --config FILE, or --resume RUN_DIR"),
        };
        print!("{}", config.to_yaml()?);
        return Ok(());
    }
    let mut run = match (&args.resume, &args.config) {
        (Some(run_dir), _) => {
            let device = match device {
                Some(d) => d,
                None => crate::device::parse_device(&TrainConfig::from_run_dir(run_dir, &registry)?.model.device)?,
            };
            TrainingRun::resume(run_dir, &args.set, registry, &device)
                .with_context(|| format!("resuming {}", run_dir.display()))?
        }
        (None, Some(path)) => {
            let config = TrainConfig::from_yaml_file(path, &set, &registry)?;
            let device = match device {
                Some(d) => d,
                None => crate::device::parse_device(&config.model.device)?,
            };
            TrainingRun::start(config, path, registry, &device)?
        }
        (None, None) => anyhow::bail!("give --config FILE, or --resume RUN_DIR"),
    };
    let total = run.config.run.iterations as u64;
    // indicatif draws nothing when stderr is not a terminal; then every line is printed as is.
    let plain = args.quiet || !std::io::stderr().is_terminal();
    let bar = if plain { ProgressBar::hidden() } else { ProgressBar::new(total) };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} it  {msg}  (eta {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_position(run.iteration());
    bar.set_message("first iteration...");
    bar.enable_steady_tick(Duration::from_millis(250));
    tracing::info!(run_dir = %run.run_dir.display(), from = run.iteration(), to = total, "training");
    let mut last = None;
    while !run.finished() {
        let metrics = match run.run_iteration() {
            Ok(m) => m,
            Err(err) => {
                bar.abandon();
                let (iteration, dir) = &run.last_checkpoint;
                let hint = format!(
                    "the last good checkpoint is {} (iteration {iteration}); continue with `troupe train --resume {}`",
                    dir.display(),
                    run.run_dir.display()
                );
                return Err(match err {
                    TroupeError::NonFinite { message } => anyhow::anyhow!("training stopped: {message}; {hint}"),
                    other => anyhow::Error::new(other).context(format!("training stopped; {hint}")),
                });
            }
        };
        let mean_return = metrics.mean_return.values().sum::<f64>() / metrics.mean_return.len().max(1) as f64;
        let score = metrics.extra.get("score").copied().unwrap_or(0.0);
        bar.set_message(format!(
            "mean return {mean_return:+.3}  score {score:.2}  invalid {:.0}%  {:.1} s/it",
            metrics.invalid_rate * 100.0,
            metrics.seconds
        ));
        bar.set_position(metrics.iteration);
        if metrics.iteration % run.config.run.log_every as u64 == 0 {
            let line = format!(
                "iteration {}: mean return {mean_return:+.3}, score {score:.2}, invalid rate {:.3}, loss {:+.4}, lr {:.2e}, {:.0} tok/s, {:.1} s",
                metrics.iteration, metrics.invalid_rate, metrics.loss, metrics.lr, metrics.tokens_per_second, metrics.seconds
            );
            let line = match (metrics.extra.get("eval_score"), metrics.extra.get("eval_score_stderr")) {
                (Some(score), Some(stderr)) => format!("{line}; held-out score {score:.2} ± {stderr:.2}"),
                _ => line,
            };
            if plain {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
        }
        last = Some(metrics);
    }
    bar.finish();
    let plots = match crate::rl::plot::plot_run(&run.run_dir) {
        Ok(paths) => paths,
        Err(err) => {
            tracing::warn!("no plots: {err}");
            Vec::new()
        }
    };
    let summary = json!({
        "run_dir": run.run_dir,
        "iterations": run.iteration(),
        "checkpoint": run.last_checkpoint.1,
        "last": last,
        "plots": plots,
    });
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}
