//! The coding task's level-based reward: structure, syntax, tests, cooperation, each level
//! weighted and each reached only when the one before it holds (structure and syntax fully,
//! tests with at least one passing assert when `cooperation_needs_passing_test`).

use serde::{Deserialize, Serialize};

use super::evaluate::Evaluation;

/// Weights of the four levels (default 0.25 each, so a perfect pair scores 1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LevelWeights {
    /// Both functions present with the right names.
    pub structure: f64,
    /// The joint program parses.
    pub syntax: f64,
    /// Scaled by the fraction of the problem's asserts that pass.
    pub tests: f64,
    /// Main really calls the helper (while the tests run, as the judge observes).
    pub cooperation: f64,
}

impl Default for LevelWeights {
    fn default() -> Self {
        Self { structure: 0.25, syntax: 0.25, tests: 0.25, cooperation: 0.25 }
    }
}

/// The reward, level by level.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LevelScores {
    /// Level 1.
    pub structure: f64,
    /// Level 2.
    pub syntax: f64,
    /// Level 3.
    pub tests: f64,
    /// Level 4.
    pub cooperation: f64,
    /// The highest level reached (0: none).
    pub level: u8,
    /// The sum.
    pub total: f64,
}

/// Whether `code` defines a top-level function `name` (`def name(` or `async def name(` at the
/// start of a line). Deliberately forgiving of the rest of the code, which may not parse: the
/// structure level comes before the syntax level.
pub fn defines_function(code: &str, name: &str) -> bool {
    code.lines().any(|line| {
        let rest = line.strip_prefix("async ").unwrap_or(line);
        rest.strip_prefix("def ")
            .map(str::trim_start)
            .and_then(|rest| rest.strip_prefix(name))
            .is_some_and(|after| after.trim_start().starts_with('('))
    })
}

/// Level 1 alone: the helper agent's code defines `helper`, the main agent's defines `entry`.
pub fn structure_ok(helper_code: &str, main_code: &str, helper: &str, entry: &str) -> bool {
    defines_function(helper_code, helper) && defines_function(main_code, entry)
}

/// Scores a pair. `evaluation` is None when the structure level failed (nothing was run).
pub fn score(
    weights: &LevelWeights,
    structure: bool,
    evaluation: Option<&Evaluation>,
    cooperation_needs_passing_test: bool,
) -> LevelScores {
    let mut scores = LevelScores::default();
    if !structure {
        return scores;
    }
    scores.structure = weights.structure;
    scores.level = 1;
    let Some(evaluation) = evaluation.filter(|evaluation| evaluation.parsed) else {
        scores.total = scores.structure;
        return scores;
    };
    scores.syntax = weights.syntax;
    scores.level = 2;
    scores.tests = weights.tests * evaluation.pass_fraction();
    if evaluation.asserts_passed > 0 {
        scores.level = 3;
    }
    // Observed by the judge while the tests ran, not read from the source: a call in dead code
    // earns nothing.
    let called = evaluation.helper_calls > 0;
    if called && (!cooperation_needs_passing_test || evaluation.asserts_passed > 0) {
        scores.cooperation = weights.cooperation;
        scores.level = 4;
    }
    scores.total = scores.structure + scores.syntax + scores.tests + scores.cooperation;
    scores
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coding::evaluate::Verdict;
    use crate::coding::schemes::Analysis;

    fn evaluation(parsed: bool, passed: usize, total: usize, called: bool) -> Evaluation {
        Evaluation {
            verdict: if passed == total {
                Verdict::Passed
            } else {
                Verdict::Failed { reason: "x".into(), failing_assert: None }
            },
            parsed,
            asserts_passed: passed,
            asserts_total: total,
            analysis: parsed.then(|| Analysis { helper_called: called, ..Analysis::default() }),
            helper_calls: u64::from(called),
            output: String::new(),
            seconds: 0.0,
        }
    }

    #[test]
    fn function_definitions_are_found_at_line_starts_only() {
        assert!(defines_function("def aux(x):\n    return x", "aux"));
        assert!(defines_function("import math\nasync def aux (x): pass", "aux"));
        assert!(!defines_function("def auxiliary(x): pass", "aux"));
        assert!(!defines_function("    def aux(x): pass", "aux"));
        assert!(!defines_function("# def aux(x)", "aux"));
    }

    #[test]
    fn each_level_boundary() {
        let w = LevelWeights::default();
        // Level 1: just outside (a name wrong) and just inside.
        assert!(!structure_ok("def aux2(x): pass", "def f(x): pass", "aux", "f"));
        assert_eq!(score(&w, false, None, true).total, 0.0);
        assert_eq!(score(&w, true, None, true).total, 0.25);
        // Level 2: does not parse / parses with no test passing and no call.
        assert_eq!(score(&w, true, Some(&evaluation(false, 0, 0, false)), true).total, 0.25);
        assert_eq!(score(&w, true, Some(&evaluation(true, 0, 4, false)), true).total, 0.5);
        // Level 3: the fraction of asserts.
        assert_eq!(score(&w, true, Some(&evaluation(true, 1, 4, false)), true).total, 0.5625);
        assert_eq!(score(&w, true, Some(&evaluation(true, 4, 4, false)), true).total, 0.75);
        // Level 4: calls the helper but no test passes (gated) / one passes / all pass.
        assert_eq!(score(&w, true, Some(&evaluation(true, 0, 4, true)), true).total, 0.5);
        assert_eq!(score(&w, true, Some(&evaluation(true, 0, 4, true)), false).total, 0.75);
        assert_eq!(score(&w, true, Some(&evaluation(true, 1, 4, true)), true).total, 0.8125);
        let full = score(&w, true, Some(&evaluation(true, 4, 4, true)), true);
        assert_eq!((full.total, full.level), (1.0, 4));
    }

    #[test]
    fn weights_are_configurable() {
        let w = LevelWeights { structure: 1.0, syntax: 0.0, tests: 2.0, cooperation: 0.5 };
        assert_eq!(score(&w, true, Some(&evaluation(true, 2, 4, true)), true).total, 2.5);
    }
}
