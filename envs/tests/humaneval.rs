//! The real HumanEval: every one of its 164 canonical solutions passes in the sandbox, through
//! the judge that holds the tests and the separate process that runs the solution (the
//! verdicts generated code cannot forge must not cost a single correct solution).
//!
//! The problems are `fixtures/humaneval/HumanEval.jsonl.gz` (see `fixtures/README.md`);
//! `TROUPE_HUMANEVAL=/path/to/HumanEval.jsonl.gz` checks another copy.

use std::path::PathBuf;

use troupe_envs::coding::check::check;
use troupe_envs::coding::problems::load_problems;
use troupe_envs::sandbox::{Sandbox, SandboxConfig};

#[test]
fn all_humaneval_canonical_solutions_pass() {
    let path = std::env::var_os("TROUPE_HUMANEVAL").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/humaneval/HumanEval.jsonl.gz"))
    });
    let problems = load_problems(&path).expect("reads HumanEval");
    assert_eq!(problems.len(), 164);
    let sandbox = Sandbox::new(SandboxConfig::default()).expect("sandbox");
    let summary = check(&sandbox, &problems, None, 3.0).expect("checks");
    eprintln!(
        "{} ({:.1} evaluations/s, {} at once; {})",
        summary.summary, summary.evaluations_per_second, summary.parallelism, summary.protections
    );
    assert_eq!(summary.summary, "164 passed, 0 failed", "{:#?}", summary.failures);
}
