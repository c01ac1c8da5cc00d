//! `troupe plot RUN_DIR`: learning curves of a run to `RUN_DIR/plots/*.png`. The drawing is in
//! [`crate::rl::run::plot`]; this file reads the argument and prints the JSON list of PNGs.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde_json::json;

/// Arguments of `troupe plot`.
#[derive(Debug, Args)]
pub struct PlotArgs {
    /// A run directory holding `metrics.jsonl` (a run killed mid-line is fine).
    pub run_dir: PathBuf,
}

/// Draws the run's curves; prints `{"plots": [...]}` to stdout.
pub fn run(args: PlotArgs) -> anyhow::Result<()> {
    let written = crate::rl::run::plot::plot_run(&args.run_dir)
        .with_context(|| format!("plotting run {}", args.run_dir.display()))?;
    super::output::emit(json!({ "plots": written }))?;
    Ok(())
}
