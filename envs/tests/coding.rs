//! The coding task: problems, the evaluation harness, cooperation schemes, the reward and the
//! environment, all through the real sandbox (python3 required).

use std::io::Write;

use troupe_envs::coding::evaluate::{evaluate, evaluate_many, Submission, Verdict};
use troupe_envs::coding::problems::{load_problems, shipped_problems, Problem};
use troupe_envs::coding::schemes::Analysis;
use troupe_envs::coding::{CodingEnv, CodingParams};
use troupe_envs::sandbox::{Sandbox, SandboxConfig};
use troupe_envs::{Action, Environment, Registry};

fn config() -> SandboxConfig {
    SandboxConfig { timeout_ms: 4_000, memory_mb: 512, ..SandboxConfig::default() }
}

fn sandbox() -> Sandbox {
    Sandbox::shared(&config()).expect("python3 must be installed for the coding tests")
}

fn submission<'a>(problem: &'a Problem, program: String, with_preamble: bool) -> Submission<'a> {
    Submission { problem, program, helper_program: None, with_preamble, helper: Some("aux"), assert_timeout_s: 1.0 }
}

#[test]
fn every_shipped_canonical_solution_passes() {
    let problems = shipped_problems();
    assert!(problems.len() >= 10);
    let submissions: Vec<_> = problems.iter().map(|p| submission(p, p.canonical_program(), false)).collect();
    for (problem, result) in problems.iter().zip(evaluate_many(&sandbox(), &submissions)) {
        let evaluation = result.expect("the sandbox runs");
        assert_eq!(
            evaluation.verdict,
            Verdict::Passed,
            "{}: {:?}\n{}",
            problem.task_id,
            evaluation.verdict,
            evaluation.output
        );
        assert!(evaluation.asserts_total >= 4);
        let analysis = evaluation.analysis.expect("parsed");
        assert!(analysis.helper_called, "{}: the reference main must call its helper", problem.task_id);
    }
}

#[test]
fn a_broken_solution_fails_with_the_assert_named() {
    let problems = shipped_problems();
    let problem = problems.iter().find(|p| p.entry_point == "run_length_encode").expect("shipped");
    // Off by one: a one-character string encodes to nothing.
    let broken = problem.canonical_program().replace("while i < len(s):", "while i < len(s) - 1:");
    let evaluation = evaluate(&sandbox(), &submission(problem, broken, false)).expect("runs");
    match &evaluation.verdict {
        Verdict::Failed { reason, failing_assert } => {
            assert!(reason.contains("AssertionError"), "{reason}");
            let named = failing_assert.as_deref().expect("the failing assert is named");
            assert!(named.starts_with("line "), "{named}");
            assert!(named.contains("assert candidate(\"x\") == \"x1\""), "{named}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(evaluation.asserts_passed >= 1 && evaluation.asserts_passed < evaluation.asserts_total);
    assert!(evaluation.feedback().contains("first failing test"));
}

#[test]
fn syntax_errors_load_errors_and_hostile_code_get_their_verdicts() {
    let problems = shipped_problems();
    let problem = &problems[0];
    let entry = &problem.entry_point;
    let cases = [
        (format!("def {entry}(s):\n    return (\n"), "syntax"),
        (format!("raise RuntimeError('boom')\ndef {entry}(s):\n    return 0\n"), "load"),
        (format!("def {entry}(s):\n    while True:\n        pass\n"), "timeout"),
        (format!("def {entry}(s):\n    return len(bytearray(10 * 1024 ** 3))\n"), "memory"),
        (format!("import os\nos._exit(0)\ndef {entry}(s):\n    return 0\n"), "exit"),
    ];
    let submissions: Vec<_> = cases.iter().map(|(program, _)| submission(problem, program.clone(), true)).collect();
    for ((_, kind), result) in cases.iter().zip(evaluate_many(&sandbox(), &submissions)) {
        let evaluation = result.expect("runs");
        eprintln!("{kind}: {:?}", evaluation.verdict);
        match *kind {
            "syntax" => {
                assert!(!evaluation.parsed);
                assert!(
                    matches!(&evaluation.verdict, Verdict::Failed { reason, .. } if reason.starts_with("syntax error"))
                );
            }
            "load" => assert!(
                matches!(&evaluation.verdict, Verdict::Failed { reason, .. } if reason.contains("RuntimeError: boom"))
            ),
            // Every assert hits the per-assert limit (or the wall clock runs out first).
            "timeout" => {
                assert_eq!(evaluation.verdict, Verdict::TimedOut);
                assert_eq!(evaluation.asserts_passed, 0);
            }
            "memory" => assert_eq!(evaluation.verdict, Verdict::MemoryExceeded),
            "exit" => assert!(
                matches!(&evaluation.verdict, Verdict::Failed { reason, .. } if reason.contains("the candidate process ended")),
                "{:?}",
                evaluation.verdict
            ),
            _ => unreachable!("the cases above"),
        }
    }
}

/// A tiny problem for scheme detection: `f(xs)` with helper `aux(x)`.
fn scheme_problem() -> Problem {
    Problem {
        task_id: "schemes".to_string(),
        prompt: "def f(xs):\n    \"\"\"Sum of squares.\"\"\"\n".to_string(),
        entry_point: "f".to_string(),
        canonical_solution: "    return sum(x * x for x in xs)\n".to_string(),
        test: "def check(candidate):\n    assert candidate([1, 2]) == 5\n".to_string(),
        helper_solution: None,
    }
}

fn analyze(main: &str) -> Analysis {
    let problem = scheme_problem();
    let program = format!("def aux(x):\n    return x * x\n\n{main}");
    let evaluation = evaluate(&sandbox(), &submission(&problem, program, false)).expect("runs");
    evaluation.analysis.expect("parses")
}

#[test]
fn each_scheme_is_detected_by_parsing() {
    let fallback = analyze("def f(xs):\n    try:\n        return sum(aux(xs))\n    except TypeError:\n        return sum(x * x for x in xs)\n");
    assert_eq!(fallback.schemes_present(), ["fallback"]);

    let decorator = analyze("def f(xs):\n    squares = aux(len(xs))\n    return squares - len(xs) + sum(x * x for x in xs) - squares + len(xs)\n");
    assert_eq!(decorator.schemes_present(), ["decorator"]);

    let coordinator =
        analyze("def f(xs):\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n");
    assert_eq!(coordinator.schemes_present(), ["coordinator"]);
    assert_eq!(analyze("def f(xs):\n    return sum([aux(x) for x in xs])\n").schemes_present(), ["coordinator"]);
    assert_eq!(analyze("def f(xs):\n    return sum(map(aux, xs))\n").schemes_present(), ["coordinator"]);

    let filter =
        analyze("def f(xs):\n    if aux(len(xs)) > 100:\n        return -1\n    return sum(x * x for x in xs)\n");
    assert_eq!(filter.schemes_present(), ["strategy_filter"]);
    let both = analyze("def f(xs):\n    return sum(x * x for x in xs if aux(x) >= 0)\n");
    assert_eq!(both.schemes_present(), ["coordinator", "strategy_filter"]);

    // `for x in aux(...)`: the iterable is computed once, so the helper is not in a loop.
    let once = analyze(
        "def f(xs):\n    out = 0\n    for y in [aux(len(xs))]:\n        out = y\n    return sum(x * x for x in xs)\n",
    );
    assert!(!once.schemes_present().contains(&"coordinator"));
    assert!(once.schemes_present().contains(&"decorator"));
}

#[test]
fn helper_defined_but_never_called_is_no_cooperation() {
    let unused = analyze("def f(xs):\n    return sum(x * x for x in xs)\n");
    assert!(unused.defines_helper && unused.defines_entry);
    assert!(!unused.helper_called);
    assert!(unused.schemes_present().is_empty());

    // Text that merely mentions the helper fools a regex, not the parser.
    let mention = analyze(
        "def f(xs):\n    # aux(xs) would do it\n    note = \"aux(x) for x in xs\"\n    return sum(x * x for x in xs)\n",
    );
    assert!(!mention.helper_called);

    // A local function of the same name is not the helper agent's.
    let shadowed = analyze("def f(xs):\n    def aux(x):\n        return x * x\n    return sum(aux(x) for x in xs)\n");
    assert!(shadowed.helper_shadowed);
    assert!(!shadowed.helper_called);
    assert!(shadowed.schemes_present().is_empty());

    // A bare wrapper calls the helper but is no decorator.
    let wrapper = analyze("def f(xs):\n    \"\"\"doc\"\"\"\n    return aux(xs[0]) + aux(xs[1]) if len(xs) == 2 else sum(aux(x) for x in xs)\n");
    assert!(wrapper.helper_called && !wrapper.wrapper);
    let pure = analyze("def f(xs):\n    return aux(xs)\n");
    assert!(pure.helper_called && pure.wrapper);
    assert!(pure.schemes_present().is_empty());
}

fn coding_env(num_turns: usize) -> CodingEnv {
    let params = CodingParams { num_turns, sandbox: config(), assert_timeout_ms: 1_000, ..CodingParams::default() };
    CodingEnv::new(params).expect("builds")
}

fn canonical_pair(problem: &Problem) -> (String, String) {
    let helper = problem.helper_solution.clone().expect("shipped problems have a helper");
    let main = format!("{}{}", problem.prompt, problem.canonical_solution);
    (format!("```python\n{helper}```"), format!("Here it is:\n```python\n{main}```\n"))
}

#[test]
fn an_episode_rewards_every_level_and_reports_schemes() {
    let mut env = coding_env(1);
    env.reset(3);
    assert_eq!(env.acting_seats(), vec![0, 1]);
    assert!(env.legal_actions(0).is_none());
    let problem = env.problem().clone();
    assert!(env.observation(1).contains(&problem.entry_point));
    assert!(env.instructions(0).contains("`aux`"));
    let (helper, main) = canonical_pair(&problem);
    let actions = vec![env.parse_action(0, &helper).expect("code"), env.parse_action(1, &main).expect("code")];
    let rewards = env.step(&actions).expect("steps");
    assert_eq!(rewards, vec![1.0, 1.0]);
    assert!(env.is_terminal());
    let metrics = env.metrics();
    assert_eq!(metrics["score"], 1.0);
    assert_eq!(metrics["solved"], 1.0);
    assert_eq!(metrics["helper_called"], 1.0);
    let schemes: f64 = ["fallback", "decorator", "coordinator", "strategy_filter"]
        .iter()
        .map(|s| metrics[&format!("scheme_{s}")])
        .sum();
    assert!(schemes >= 1.0);
    assert!(env.step(&actions).is_err());
}

#[test]
fn level_boundaries_through_the_environment() {
    let mut env = coding_env(1);
    env.reset(0);
    let problem = env.problem().clone();
    let entry = problem.entry_point.clone();
    let helper = problem.helper_solution.clone().expect("helper");
    let cases = [
        // Level 1 just outside: the helper has the wrong name.
        (helper.replace("def aux(", "def aux2("), format!("{}{}", problem.prompt, problem.canonical_solution), 0.0),
        // Level 2 just outside: right names, but main does not parse.
        (helper.clone(), format!("def {entry}(sentence):\n    return (\n"), 0.25),
        // Level 2 just inside, level 3 at zero: parses, every test fails, no helper call.
        (helper.clone(), format!("def {entry}(sentence):\n    return -1\n"), 0.5),
        // Calls the helper but passes nothing: the cooperation level stays closed.
        (helper.clone(), format!("def {entry}(sentence):\n    aux(sentence)\n    return -1\n"), 0.5),
        // Everything.
        (helper.clone(), format!("{}{}", problem.prompt, problem.canonical_solution), 1.0),
    ];
    for (helper_code, main_code, expected) in cases {
        let record = env.score_pair(&helper_code, &main_code);
        assert!((record.scores.total - expected).abs() < 1e-9, "{main_code}: {:?}", record.scores);
    }
}

#[test]
fn cooperation_counts_only_helper_calls_made_while_the_tests_run() {
    let params = CodingParams { sandbox: config(), assert_timeout_ms: 1_000, ..CodingParams::default() };
    let mut env = CodingEnv::with_parts(params, std::sync::Arc::new(vec![scheme_problem()]), sandbox());
    env.reset(0);
    let helper = "def aux(x):\n    return x * x\n";
    // Correct mains that never call the helper agent's function while the tests run: a call
    // in dead code, after a return, in a function nobody calls, or of a look-alike of its own.
    let dead = [
        "def f(xs):\n    if False:\n        aux(xs)\n    return sum(x * x for x in xs)\n",
        "def f(xs):\n    return sum(x * x for x in xs)\n    aux(xs)\n",
        "def never():\n    return aux(1)\n\n\ndef f(xs):\n    return sum(x * x for x in xs)\n",
        "def aux(x):\n    return x * x\n\n\ndef f(xs):\n    return sum(aux(x) for x in xs)\n",
    ];
    for main in dead {
        let record = env.score_pair(helper, main);
        let evaluation = record.evaluation.as_ref().expect("ran");
        assert_eq!(evaluation.verdict, Verdict::Passed, "{main}\n{:?}", evaluation.verdict);
        assert_eq!(evaluation.helper_calls, 0, "{main}");
        assert_eq!(record.scores.cooperation, 0.0, "{main}");
        assert!((record.scores.total - 0.75).abs() < 1e-9, "{main}: {:?}", record.scores);
    }
    // A main that really calls it, through the judge.
    let record = env.score_pair(helper, "def f(xs):\n    return sum(aux(x) for x in xs)\n");
    assert_eq!(record.evaluation.as_ref().expect("ran").helper_calls, 2);
    assert_eq!(record.scores.total, 1.0);
}

#[test]
fn multi_turn_feeds_back_the_test_outcome() {
    let mut env = coding_env(2);
    env.reset(0);
    let entry = env.problem().entry_point.clone();
    let actions = vec![
        Action::Text("def aux(x):\n    return 0\n".into()),
        Action::Text(format!("def {entry}(s):\n    return -1\n")),
    ];
    env.step(&actions).expect("first turn");
    assert!(!env.is_terminal());
    let observation = env.observation(1);
    assert!(observation.contains("Turn 2 of 2"));
    assert!(observation.contains("tests passed"), "{observation}");
    assert!(observation.contains("first failing test"), "{observation}");
    assert!(observation.contains("does not call `aux`"), "{observation}");
    env.step(&actions).expect("second turn");
    assert!(env.is_terminal());
    assert_eq!(env.returns(), vec![1.0, 1.0]);
}

#[test]
fn problems_load_from_jsonl_and_gzip_and_errors_name_the_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let problems = shipped_problems();
    let plain = dir.path().join("p.jsonl");
    let text: String = problems.iter().map(|p| serde_json::to_string(p).expect("json") + "\n").collect();
    std::fs::write(&plain, &text).expect("write");
    let gz = dir.path().join("p.jsonl.gz");
    let mut encoder =
        flate2::write::GzEncoder::new(std::fs::File::create(&gz).expect("create"), flate2::Compression::fast());
    encoder.write_all(text.as_bytes()).expect("compress");
    encoder.finish().expect("finish");
    assert_eq!(load_problems(&plain).expect("plain"), problems);
    assert_eq!(load_problems(&gz).expect("gz"), problems);
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, format!("{}{{\"task_id\": 1}}\n", text.lines().next().expect("a line").to_string() + "\n"))
        .expect("write");
    let err = load_problems(&bad).expect_err("line 2 is malformed").to_string();
    assert!(err.contains("bad.jsonl") && err.contains("line 2"), "{err}");
    assert!(load_problems(&dir.path().join("missing.jsonl")).is_err());
}

#[test]
fn the_registry_builds_coding_with_checked_params() {
    let registry = Registry::with_builtins();
    let env = registry
        .make("coding", &serde_json::json!({"num_turns": 2, "sandbox": {"timeout_ms": 4000, "memory_mb": 512}}))
        .expect("builds");
    assert_eq!(env.num_seats(), 2);
    let err = registry.make("coding", &serde_json::json!({"num_turn": 2})).err().expect("unknown field").to_string();
    assert!(err.contains("num_turn"), "{err}");
    let err = registry.make("coding", &serde_json::json!({"num_turns": 0})).err().expect("zero turns").to_string();
    assert!(err.contains("num_turns"), "{err}");
}

#[test]
fn check_runs_canonical_solutions_and_given_completions() {
    use troupe_envs::coding::check::check;
    use troupe_envs::coding::problems::Solution;
    let problems = shipped_problems();
    let summary = check(&sandbox(), &problems, None, 2.0).expect("checks");
    assert_eq!(summary.summary, format!("{} passed, 0 failed", problems.len()));
    assert!(summary.evaluations_per_second > 0.0);

    let problem = problems.iter().find(|p| p.entry_point == "merge_intervals").expect("shipped");
    let helper = problem.helper_solution.clone().expect("helper");
    // Completions continue the prompt; the helper is not in the prompt, so a completion that
    // calls it must define it (here inside the body), and a wrong one fails with its assert.
    let good = format!("    {}\n{}", helper.replace('\n', "\n    "), problem.canonical_solution);
    let wrong = "    return intervals\n".to_string();
    let solutions = vec![
        Solution { task_id: problem.task_id.clone(), completion: good },
        Solution { task_id: problem.task_id.clone(), completion: wrong },
    ];
    let summary = check(&sandbox(), &problems, Some(&solutions), 2.0).expect("checks");
    assert_eq!(summary.summary, "1 passed, 1 failed");
    assert_eq!(summary.failures[0].sample, 1);
    match &summary.failures[0].verdict {
        Verdict::Failed { failing_assert: Some(assert), .. } => {
            assert!(assert.contains("assert candidate("), "{assert}")
        }
        other => panic!("{other:?}"),
    }
    let unknown = vec![Solution { task_id: "nope/1".to_string(), completion: String::new() }];
    let err = check(&sandbox(), &problems, Some(&unknown), 2.0).expect_err("unknown task").to_string();
    assert!(err.contains("nope/1"), "{err}");
}
