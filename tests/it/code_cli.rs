//! `troupe code check` end to end: the shipped cooperation problems pass, a broken completion
//! fails with its assert named, bad input gets one clear message and a non-zero exit.

use std::process::{Command, Output};

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("the troupe binary runs")
}

const PROBLEMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/envs/data/coding_problems.jsonl");

#[test]
fn canonical_solutions_of_the_shipped_problems_pass() {
    let output = troupe(&["code", "check", "--problems", PROBLEMS]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("10 passed, 0 failed"), "{stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON on stdout");
    assert_eq!(summary["passed"], 10);
    assert_eq!(summary["failed"], 0);
    assert!(summary["evaluations_per_second"].as_f64().is_some_and(|rate| rate > 0.0));
}

#[test]
fn a_broken_completion_fails_with_its_assert_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let solutions = dir.path().join("samples.jsonl");
    // A completion of troupe/coop/6 (run_length_encode) that drops every run's length.
    std::fs::write(&solutions, "{\"task_id\": \"troupe/coop/6\", \"completion\": \"    return s\\n\"}\n")
        .expect("write");
    let output = troupe(&["code", "check", "--problems", PROBLEMS, "--solutions", solutions.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("0 passed, 1 failed"), "{stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON on stdout");
    let failure = &summary["failures"][0];
    assert_eq!(failure["task_id"], "troupe/coop/6");
    assert_eq!(failure["verdict"]["status"], "failed");
    let named = failure["verdict"]["failing_assert"].as_str().expect("the assert is named");
    assert!(named.contains("assert candidate(\"aaabcc\") == \"a3b1c2\""), "{named}");
}

#[test]
fn bad_input_is_named() {
    let output = troupe(&["code", "check", "--problems", "/nonexistent/problems.jsonl"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("/nonexistent/problems.jsonl"));
    let dir = tempfile::tempdir().expect("temp dir");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"task_id\": \"x\"}\n").expect("write");
    let output = troupe(&["code", "check", "--problems", bad.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("bad.jsonl") && stderr.contains("line 1"), "{stderr}");
}
