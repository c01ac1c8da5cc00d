//! Running a program against a problem's tests in the sandbox, and reading the judge's report
//! into a [`Evaluation`]: passed, failed (with the reason and the failing assert), timed out,
//! or out of memory, plus how many asserts passed, how main uses the helper, and how often it
//! really called it.
//!
//! A verdict the generated code cannot forge: the code runs in its own sandboxed process (a
//! *party*, `party.py`) that never sees the tests and hands back only serialised plain values
//! (`wire.py`: exact builtin types, no subclasses, no objects with methods). The tests run in
//! a separate sandboxed process, the *judge* (`judge.py`), which alone holds them (on its
//! stdin) and the results channel, and calls the function under test through a proxy; every
//! comparison is made there on plain values. The helper agent's code runs in a third process,
//! and the main program's calls of the helper pass through the judge, which counts them while
//! the tests run: a helper call counts only when it is made.

use serde::{Deserialize, Serialize};

use super::problems::Problem;
use super::schemes::Analysis;
use crate::error::SandboxError;
use crate::sandbox::{Job, LinkedJob, LinkedOutput, Sandbox, Termination};

/// The plain-value wire format shared by judge and parties.
pub const WIRE: &str = include_str!("wire.py");
/// The judge (run after [`WIRE`]), which holds the tests and decides.
pub const JUDGE: &str = include_str!("judge.py");
/// A party (run after [`WIRE`]), which runs generated code and answers calls.
pub const PARTY: &str = include_str!("party.py");

const SIGXCPU: i32 = 24;
/// What the harness reports for an assert stopped by the per-assert time limit.
const ASSERT_TIMEOUT: &str = "timed out";

/// What is to be evaluated.
#[derive(Clone, Debug)]
pub struct Submission<'a> {
    /// The problem (its test, entry point and prompt).
    pub problem: &'a Problem,
    /// The main program: what defines the function under test (prompt plus completion, or
    /// the main agent's code; may also define the helper when one agent wrote both).
    pub program: String,
    /// The helper agent's code, run in its own process; the main program's calls of
    /// `helper` go there through the judge, which counts them. None: no helper agent.
    pub helper_program: Option<String>,
    /// Whether to run the prompt's own definitions (imports, given functions; not the stub of
    /// the entry point) before the program: for agents that write only their functions.
    pub with_preamble: bool,
    /// The helper function's name, for the cooperation analysis.
    pub helper: Option<&'a str>,
    /// Per-assert time limit in seconds (0: none besides the sandbox's wall clock).
    pub assert_timeout_s: f64,
}

impl Submission<'_> {
    /// The sandbox job for this submission: the judge, the main program's party and, with a
    /// helper agent, the helper's party.
    pub fn job(&self) -> LinkedJob {
        let problem = self.problem;
        let preamble = if self.with_preamble { problem.prompt.as_str() } else { "" };
        let judge = serde_json::json!({
            "program": self.program,
            "helper_program": self.helper_program,
            "preamble": problem.prompt,
            "test": problem.test,
            "entry_point": problem.entry_point,
            "helper": self.helper,
            "assert_timeout_s": self.assert_timeout_s,
        });
        let linked_helper = self.helper_program.as_ref().and(self.helper);
        let main = serde_json::json!({
            "serves": problem.entry_point,
            "entry_point": problem.entry_point,
            "program": self.program,
            "preamble": preamble,
            "helper": linked_helper,
            "call_timeout_s": self.assert_timeout_s,
        });
        let mut parties = vec![party_job(&main)];
        if let (Some(helper_program), Some(helper)) = (&self.helper_program, self.helper) {
            let spec = serde_json::json!({
                "serves": helper,
                "entry_point": problem.entry_point,
                "program": helper_program,
                "preamble": preamble,
                "helper": null,
                "call_timeout_s": self.assert_timeout_s,
            });
            parties.push(party_job(&spec));
        }
        LinkedJob {
            judge: Job { script: format!("{WIRE}\n{JUDGE}"), files: Vec::new(), stdin: judge.to_string().into_bytes() },
            parties,
        }
    }
}

fn party_job(spec: &serde_json::Value) -> Job {
    Job { script: format!("{WIRE}\n{PARTY}"), files: Vec::new(), stdin: spec.to_string().into_bytes() }
}

/// The outcome class of one evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Verdict {
    /// Every assert passed.
    Passed,
    /// Something failed: a syntax error, an error while loading, a failing assert.
    Failed {
        /// Why, in one line.
        reason: String,
        /// The first failing assert: `line N: <source>`.
        failing_assert: Option<String>,
    },
    /// The wall-clock or CPU limit ran out.
    TimedOut,
    /// The program ran out of memory (its address-space limit).
    MemoryExceeded,
}

impl Verdict {
    /// A short label: `passed`, `failed`, `timed_out`, `memory`.
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::Passed => "passed",
            Verdict::Failed { .. } => "failed",
            Verdict::TimedOut => "timed_out",
            Verdict::MemoryExceeded => "memory",
        }
    }
}

/// Everything learnt from one evaluation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Evaluation {
    /// The outcome class.
    pub verdict: Verdict,
    /// Whether the program parses (Python's `ast`).
    pub parsed: bool,
    /// Asserts that passed.
    pub asserts_passed: usize,
    /// Asserts in the test (0 when the program never got as far as the tests).
    pub asserts_total: usize,
    /// How main's source uses the helper (when the program parses): a description of the
    /// code, not proof that the helper ran.
    pub analysis: Option<Analysis>,
    /// Calls of the helper agent's function that the main program made while the tests ran,
    /// counted by the judge (0 without a helper agent).
    pub helper_calls: u64,
    /// The program's output (capped).
    pub output: String,
    /// Wall-clock time of the evaluation in seconds.
    pub seconds: f64,
}

impl Evaluation {
    /// The fraction of asserts passed (0 when there are none).
    pub fn pass_fraction(&self) -> f64 {
        if self.asserts_total == 0 {
            0.0
        } else {
            self.asserts_passed as f64 / self.asserts_total as f64
        }
    }

    /// One line of feedback for an agent: the verdict and, on failure, why.
    pub fn feedback(&self) -> String {
        match &self.verdict {
            Verdict::Passed => format!("all {} tests passed", self.asserts_total),
            Verdict::Failed { reason, failing_assert } => {
                let mut text = format!("{}/{} tests passed; {reason}", self.asserts_passed, self.asserts_total);
                if let Some(assert) = failing_assert {
                    text.push_str(&format!("; first failing test: {assert}"));
                }
                text
            }
            Verdict::TimedOut => {
                format!("{}/{} tests passed, then the code timed out", self.asserts_passed, self.asserts_total)
            }
            Verdict::MemoryExceeded => {
                format!("{}/{} tests passed, then the code ran out of memory", self.asserts_passed, self.asserts_total)
            }
        }
    }
}

#[derive(Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event {
    SyntaxError { message: String },
    Analysis(Analysis),
    LoadError { message: String },
    Plan { asserts: usize },
    Assert { line: usize, source: String, passed: bool, error: Option<String> },
    SetupError { line: usize, source: String, error: String },
    Memory,
    HelperCalls { count: u64 },
    Done,
}

/// Runs one submission in `sandbox`.
pub fn evaluate(sandbox: &Sandbox, submission: &Submission<'_>) -> Result<Evaluation, SandboxError> {
    let output = sandbox.run_linked(&submission.job())?;
    Ok(interpret(&output))
}

/// Runs many submissions, in parallel up to the sandbox's bound; results in input order.
pub fn evaluate_many(sandbox: &Sandbox, submissions: &[Submission<'_>]) -> Vec<Result<Evaluation, SandboxError>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<Evaluation, SandboxError>>>> =
        submissions.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..sandbox.parallelism().min(submissions.len()) {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(submission) = submissions.get(index) else { break };
                let result = evaluate(sandbox, submission);
                *results[index].lock().unwrap_or_else(|poison| poison.into_inner()) = Some(result);
            });
        }
    });
    results
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .unwrap_or_else(|poison| poison.into_inner())
                .expect("every submission index is taken by exactly one worker")
        })
        .collect()
}

/// Reads the judge's report and the processes' ends into an [`Evaluation`]. Only the judge's
/// channel counts; what the generated code printed is kept as output, never read as results.
pub fn interpret(linked: &LinkedOutput) -> Evaluation {
    let run = &linked.judge;
    let mut output = linked.parties.first().map(|party| party.output.clone()).unwrap_or_default();
    if let Some(helper) = linked.parties.get(1).filter(|party| !party.output.is_empty()) {
        output.push_str("\n[helper] ");
        output.push_str(&helper.output);
    }
    let mut evaluation = Evaluation {
        verdict: Verdict::Failed { reason: String::new(), failing_assert: None },
        parsed: false,
        asserts_passed: 0,
        asserts_total: 0,
        analysis: None,
        helper_calls: 0,
        output,
        seconds: run.wall_time.as_secs_f64(),
    };
    let mut failure: Option<String> = None;
    let mut failing_assert: Option<String> = None;
    let mut setup_error: Option<String> = None;
    let mut memory = false;
    let mut assert_timed_out = false;
    let mut done = false;
    let mut syntax_error = false;
    for line in run.channel.lines() {
        let Ok(event) = serde_json::from_str::<Event>(line) else { continue };
        match event {
            Event::SyntaxError { message } => {
                syntax_error = true;
                failure = Some(format!("syntax error: {message}"));
            }
            Event::Analysis(analysis) => {
                evaluation.parsed = true;
                evaluation.analysis = Some(analysis);
            }
            Event::LoadError { message } => failure = Some(format!("error while loading the code: {message}")),
            Event::Plan { asserts } => evaluation.asserts_total = asserts,
            Event::Assert { line, source, passed, error } => {
                if !passed && error.as_deref() == Some(ASSERT_TIMEOUT) {
                    assert_timed_out = true;
                }
                if passed {
                    evaluation.asserts_passed += 1;
                } else if failing_assert.is_none() {
                    failing_assert = Some(format!("line {line}: {source}"));
                    failure = Some(format!("test failed with {}", error.unwrap_or_else(|| "an error".to_string())));
                }
            }
            Event::SetupError { line, source, error } => {
                if setup_error.is_none() {
                    setup_error = Some(format!("test setup line {line} ({source}) failed: {error}"));
                }
            }
            Event::Memory => memory = true,
            Event::HelperCalls { count } => evaluation.helper_calls = count,
            Event::Done => done = true,
        }
    }
    if syntax_error {
        evaluation.parsed = false;
    }
    if !done && !run.output.is_empty() {
        tracing::debug!(target: "troupe_envs::coding", "the judge stopped early: {}", run.output);
    }
    evaluation.verdict = match run.termination {
        Termination::TimedOut => Verdict::TimedOut,
        Termination::DiskLimit => Verdict::Failed { reason: "filled its disk allowance".to_string(), failing_assert },
        Termination::Signaled(SIGXCPU) => Verdict::TimedOut,
        _ if assert_timed_out => Verdict::TimedOut,
        _ if memory || (!done && run.output.contains("MemoryError")) => Verdict::MemoryExceeded,
        Termination::Signaled(signal) => {
            Verdict::Failed { reason: format!("killed by signal {signal}"), failing_assert }
        }
        Termination::Exited(code) if !done => Verdict::Failed {
            reason: failure.unwrap_or_else(|| {
                let last = run.output.lines().rev().find(|line| !line.trim().is_empty()).unwrap_or("").trim();
                format!(
                    "the judge exited with code {code} before the tests finished{}{last}",
                    if last.is_empty() { "" } else { ": " }
                )
            }),
            failing_assert,
        },
        Termination::Exited(_) => {
            if let Some(reason) = failure {
                Verdict::Failed { reason, failing_assert }
            } else if evaluation.asserts_total == 0 {
                Verdict::Failed {
                    reason: setup_error.unwrap_or_else(|| "the test has no asserts".to_string()),
                    failing_assert: None,
                }
            } else if evaluation.asserts_passed == evaluation.asserts_total {
                Verdict::Passed
            } else {
                Verdict::Failed { reason: setup_error.unwrap_or_else(|| "a test failed".to_string()), failing_assert }
            }
        }
    };
    evaluation
}
