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

use crate::error::{RunError, TroupeError};
use crate::rl::config::TrainConfig;
use crate::rl::run::metrics::IterationMetrics;
use crate::rl::run::TrainingRun;

/// Arguments of `troupe train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The run's YAML config (`configs/hanabi.yaml`, ...).
    #[arg(long, required_unless_present_any = ["resume", "print_config"], conflicts_with = "resume")]
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
    /// as YAML on stdout, and train nothing; without `--config`, every key at its default.
    #[arg(long)]
    pub print_config: bool,
    /// Keep the base quantized: `--set model.quantized=true`.
    #[arg(long, conflicts_with = "resume")]
    pub quantized: bool,
    /// After the run, print on stderr a table of seconds per phase per iteration (rollout
    /// prefill and decode, environments, credit, update forward and backward, optimizer,
    /// evaluation, checkpoint); the same figures are `seconds_*` keys of `metrics.jsonl`. On a
    /// GPU, a second table of the device memory each phase kept (`memory_mib_*` keys).
    #[arg(long)]
    pub profile: bool,
    /// On a GPU (a `--features cuda` build): count the kernels each phase launches and time
    /// them on the device; after the run, print launches and device milliseconds per phase and
    /// iteration and the kernels that took longest on stderr, and write the counts to
    /// `kernels.json` in the run directory. Timing each launch costs a little host time, which
    /// the iteration's seconds include.
    #[arg(long)]
    pub profile_kernels: bool,
}

/// `--profile-kernels`' recording: the tallies and, on a GPU build, the launch observer that
/// feeds them.
struct KernelRecording {
    recording: crate::profile::kernels::Recording,
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    _observer: burn_cubecl::cubecl::logging::LaunchObservation,
}

impl KernelRecording {
    /// Whether this build can count kernels (a GPU backend is compiled in).
    fn check() -> anyhow::Result<()> {
        if cfg!(any(feature = "cuda", feature = "wgpu")) {
            Ok(())
        } else {
            anyhow::bail!("--profile-kernels counts a GPU's kernels: build troupe with `--features cuda`")
        }
    }

    fn start() -> anyhow::Result<Self> {
        Self::check()?;
        Ok(Self {
            recording: crate::profile::kernels::Recording::start(),
            #[cfg(any(feature = "cuda", feature = "wgpu"))]
            _observer: crate::profile::observer::observe(true),
        })
    }

    /// Stops recording; writes `kernels.json` into `run_dir` and prints the table.
    fn finish(self, run_dir: &std::path::Path, iterations: u64) -> anyhow::Result<()> {
        let phases = self.recording.finish();
        let path = run_dir.join("kernels.json");
        let json = serde_json::to_vec_pretty(&json!({ "iterations": iterations, "phases": phases }))?;
        crate::fsutil::write_atomic(&path, &json).with_context(|| format!("writing {}", path.display()))?;
        if phases.is_empty() {
            eprintln!(
                "--profile-kernels: no kernel was launched (the CPU backend runs troupe's own code, not kernels)"
            );
        } else {
            eprint!("{}", crate::profile::kernels::kernel_table(&phases, iterations, 25));
            eprintln!("(all counts: {})", path.display());
        }
        Ok(())
    }
}

/// Runs (or resumes) the training run with the environments and policies of `registry`; prints
/// `{"run_dir", "iterations", "last", "checkpoint"}`.
pub fn run(args: TrainArgs, device: Option<burn::tensor::Device>, registry: &Registry) -> anyhow::Result<()> {
    let registry = registry.clone();
    if args.profile_kernels {
        KernelRecording::check()?;
    }
    let mut set = args.set.clone();
    if args.quantized {
        set.push("model.quantized=true".to_string());
    }
    if args.print_config {
        let config = match (&args.resume, &args.config) {
            (Some(run_dir), _) => TrainConfig::from_run_dir(run_dir, &registry)?,
            (None, Some(path)) => TrainConfig::from_yaml_file(path, &set, &registry)?,
            (None, None) => TrainConfig::from_yaml_str("", std::path::Path::new("--set"), &set, &registry)?,
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
    if run.finished() {
        tracing::warn!(
            "{} is already at iteration {total} of {total}: nothing to train; extend it with --set run.iterations=N (N > {total})",
            run.run_dir.display()
        );
    }
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
    let mut profiled = Vec::new();
    let kernels = if args.profile_kernels { Some(KernelRecording::start()?) } else { None };
    let first_iteration = run.iteration();
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
                    TroupeError::Run(RunError::NonFinite { message }) => {
                        anyhow::anyhow!("training stopped: {message}; {hint}")
                    }
                    // A resume meets the same environment or reward process: it must be fixed first.
                    other @ TroupeError::Environment(_) => anyhow::Error::new(other).context(format!(
                        "training stopped; the last good checkpoint is {} (iteration {iteration}); fix what failed \
                             (it would stop a resume too), then continue with `troupe train --resume {}`",
                        dir.display(),
                        run.run_dir.display()
                    )),
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
        if args.profile {
            profiled.push(ProfileRow::new(&metrics, run.checkpoint_seconds));
        }
        last = Some(metrics);
    }
    bar.finish();
    if args.profile {
        eprint!("{}", profile_table(&profiled));
    }
    if let Some(kernels) = kernels {
        kernels.finish(&run.run_dir, run.iteration() - first_iteration)?;
    }
    // A run of no iterations (`run.iterations: 0`, the fresh adapters alone) has no curve to draw.
    let (plots, plot_error) = match run.iteration() {
        0 => (Vec::new(), None),
        _ => match crate::rl::run::plot::plot_run(&run.run_dir) {
            Ok(paths) => (paths, None),
            Err(err) => (Vec::new(), Some(err)),
        },
    };
    let summary = json!({
        "run_dir": run.run_dir,
        "iterations": run.iteration(),
        "checkpoint": run.last_checkpoint.1,
        "last": last,
        "plots": plots,
    });
    super::output::emit(serde_json::to_string_pretty(&summary)?)?;
    if let Some(err) = plot_error {
        anyhow::bail!(
            "training finished (last checkpoint {}), but its plots could not be drawn: {err}; draw them with \
             `troupe plot {}`",
            run.last_checkpoint.1.display(),
            run.run_dir.display()
        );
    }
    Ok(())
}

/// One iteration's seconds per phase, as the `--profile` table shows them.
#[derive(Clone, Debug, PartialEq)]
struct ProfileRow {
    iteration: u64,
    /// In table order: prefill, decode, env, credit, forward, backward, optimizer, eval,
    /// checkpoint, other, total.
    seconds: [f64; 11],
    /// On a GPU, MiB in table order: what prefill, decode, credit, forward, backward and
    /// optimizer kept at their boundaries, and the allocator's reservation.
    memory: Option<[f64; 7]>,
}

/// The `--profile` table's column headers, in [`ProfileRow::seconds`] order.
const PROFILE_COLUMNS: [&str; 11] =
    ["prefill", "decode", "env", "credit", "forward", "backward", "optimizer", "eval", "checkpoint", "other", "total"];

/// The memory table's column headers, in [`ProfileRow::memory`] order, and the metrics keys
/// they read.
const MEMORY_COLUMNS: [(&str, &str); 7] = [
    ("prefill", "memory_mib_prefill"),
    ("decode", "memory_mib_decode"),
    ("credit", "memory_mib_credit"),
    ("forward", "memory_mib_update_forward"),
    ("backward", "memory_mib_backward"),
    ("optimizer", "memory_mib_optimizer"),
    ("reserved", "memory_reserved_mib"),
];

impl ProfileRow {
    /// The row of one metrics line and the checkpoint written after it. `env` is the rollout
    /// less its generation (environment steps, prompts, parsing); `credit` is rewards,
    /// advantages and the KL reference; `other` is what no phase timer covers (the update's
    /// batching, the format warm-up, metrics); `total` the iteration with its checkpoint.
    fn new(metrics: &IterationMetrics, checkpoint: f64) -> Self {
        let get = |key: &str| metrics.extra.get(&format!("seconds_{key}")).copied().unwrap_or(0.0);
        let (prefill, decode) = (get("prefill"), get("decode"));
        let env = (get("rollout") - prefill - decode).max(0.0);
        let total = metrics.seconds + checkpoint;
        let mut seconds = [
            prefill,
            decode,
            env,
            get("credit"),
            get("update_forward"),
            get("backward"),
            get("optimizer"),
            get("eval"),
            checkpoint,
            0.0,
            total,
        ];
        seconds[9] = (total - seconds[..9].iter().sum::<f64>()).max(0.0);
        let memory = metrics
            .extra
            .contains_key("memory_reserved_mib")
            .then(|| MEMORY_COLUMNS.map(|(_, key)| metrics.extra.get(key).copied().unwrap_or(0.0)));
        Self { iteration: metrics.iteration, seconds, memory }
    }
}

/// The `--profile` table: one line per iteration and their mean; on a GPU, then the device
/// memory per iteration and its peak.
fn profile_table(rows: &[ProfileRow]) -> String {
    let mut out = String::new();
    let mut lines: Vec<(String, Vec<f64>)> =
        rows.iter().map(|r| (r.iteration.to_string(), r.seconds.to_vec())).collect();
    if !rows.is_empty() {
        let mut mean = vec![0.0; PROFILE_COLUMNS.len()];
        for row in rows {
            for (m, s) in mean.iter_mut().zip(&row.seconds) {
                *m += s / rows.len() as f64;
            }
        }
        lines.push(("mean".to_string(), mean));
    }
    write_table(&mut out, "seconds per phase and iteration (troupe train --profile)", &PROFILE_COLUMNS, &lines, 3);
    let mut lines: Vec<(String, Vec<f64>)> =
        rows.iter().filter_map(|r| r.memory.map(|m| (r.iteration.to_string(), m.to_vec()))).collect();
    if !lines.is_empty() {
        let mut peak = vec![0.0f64; MEMORY_COLUMNS.len()];
        for (_, mib) in &lines {
            for (p, m) in peak.iter_mut().zip(mib) {
                *p = p.max(*m);
            }
        }
        lines.push(("peak".to_string(), peak));
        let title =
            "device memory per phase and iteration, MiB: in use at the phase's boundaries; reserved by the allocator";
        write_table(&mut out, title, &MEMORY_COLUMNS.map(|(column, _)| column), &lines, 0);
    }
    out
}

/// Appends `title`, a header of `columns` and one line per `(label, figures)`, each figure with
/// `decimals` places.
fn write_table(out: &mut String, title: &str, columns: &[&str], lines: &[(String, Vec<f64>)], decimals: usize) {
    *out += title;
    out.push('\n');
    *out += &format!("{:>9}", "iteration");
    for column in columns {
        *out += &format!(" {column:>10}");
    }
    out.push('\n');
    for (label, figures) in lines {
        *out += &format!("{label:>9}");
        for figure in figures {
            *out += &format!(" {figure:>10.decimals$}");
        }
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_splits_the_rollout_and_keeps_the_total() {
        let mut metrics = IterationMetrics { iteration: 3, seconds: 10.0, ..IterationMetrics::default() };
        for (key, value) in
            [("rollout", 6.0), ("prefill", 1.0), ("decode", 4.0), ("credit", 0.5), ("update_forward", 1.0)]
        {
            metrics.extra.insert(format!("seconds_{key}"), value);
        }
        for (key, value) in [("backward", 2.0), ("optimizer", 0.25)] {
            metrics.extra.insert(format!("seconds_{key}"), value);
        }
        let row = ProfileRow::new(&metrics, 0.5);
        assert_eq!(row.seconds, [1.0, 4.0, 1.0, 0.5, 1.0, 2.0, 0.25, 0.0, 0.5, 0.25, 10.5]);
        let table = profile_table(&[row.clone(), row]);
        assert!(table.lines().nth(1).unwrap().contains("prefill"), "{table}");
        assert!(table.lines().last().unwrap().trim_start().starts_with("mean"), "{table}");
        assert!(!table.contains("memory"), "the CPU has no device memory to show: {table}");
    }

    #[test]
    fn on_a_gpu_the_profile_shows_each_phases_memory_and_its_peak() {
        let line = |iteration, decode, reserved| {
            let mut metrics = IterationMetrics { iteration, seconds: 1.0, ..IterationMetrics::default() };
            metrics.extra.insert("memory_mib_decode".into(), decode);
            metrics.extra.insert("memory_mib_backward".into(), 900.0);
            metrics.extra.insert("memory_reserved_mib".into(), reserved);
            ProfileRow::new(&metrics, 0.0)
        };
        let rows = [line(1, 300.0, 2000.0), line(2, 400.0, 1500.0)];
        assert_eq!(rows[0].memory, Some([0.0, 300.0, 0.0, 0.0, 900.0, 0.0, 2000.0]));
        let table = profile_table(&rows);
        let peak = table.lines().last().unwrap();
        let figures: Vec<&str> = peak.split_whitespace().collect();
        assert_eq!(figures, ["peak", "0", "400", "0", "0", "900", "0", "2000"], "{table}");
    }
}
