//! `--adapter` on the model commands, `troupe adapters inspect` and `troupe adapters merge`,
//! run as a user runs them.

use crate::common;

use std::process::Command;

fn troupe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn json_stdout(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn logprobs_with_an_adapter_match_peft() {
    let dir = common::models_dir().join("tiny-qwen2");
    let expected = common::expected(&dir);
    let case = &expected["agent_1"][0];
    let adapters = dir.join("adapters");
    let spec = format!("{}:agent_1", adapters.display());
    let out = json_stdout(&troupe(&[
        "logprobs",
        "--model",
        dir.to_str().unwrap(),
        "--adapter",
        &spec,
        "--text",
        case["text"].as_str().unwrap(),
    ]));
    let diff =
        floats(&out["logprobs"]).iter().zip(floats(&case["logprobs"])).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(diff < 1e-3, "{diff}");
    // An adapter's own directory works without :NAME; a directory of two needs it.
    let single = adapters.join("agent_1");
    json_stdout(&troupe(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--adapter",
        single.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "3",
    ]));
    let ambiguous = troupe(&[
        "logprobs",
        "--model",
        dir.to_str().unwrap(),
        "--adapter",
        adapters.to_str().unwrap(),
        "--text",
        "hi",
    ]);
    assert!(!ambiguous.status.success());
    assert!(String::from_utf8_lossy(&ambiguous.stderr).contains("several adapters (agent_0, agent_1)"));
    let unknown = troupe(&[
        "logprobs",
        "--model",
        dir.to_str().unwrap(),
        "--adapter",
        &format!("{}:agent_9", adapters.display()),
        "--text",
        "hi",
    ]);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no adapter \"agent_9\""));
}

#[test]
fn inspect_reports_ranks_targets_and_counts() {
    let adapters = common::models_dir().join("tiny-qwen3").join("adapters");
    let out = json_stdout(&troupe(&["adapters", "inspect", adapters.to_str().unwrap()]));
    let list = out["adapters"].as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["name"], "agent_0");
    assert_eq!(list[0]["r"], 4);
    assert_eq!(list[0]["target_modules"].as_array().unwrap().len(), 7);
    assert_eq!(list[1]["r"], 8);
    assert_eq!(list[1]["use_rslora"], true);
    assert_eq!(list[1]["scale"].as_f64().unwrap(), 16.0 / 8f64.sqrt());
    // qwen3 fixture: 2 layers, q (64 -> 128) and v (64 -> 64), r = 8: A r x in, B out x r.
    assert_eq!(list[1]["parameters"], 2 * (8 * 64 + 128 * 8 + 8 * 64 + 64 * 8));
}

#[test]
fn merged_model_equals_base_plus_adapter() {
    let dir = common::models_dir().join("tiny-llama");
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("merged");
    let spec = format!("{}:agent_0", dir.join("adapters").display());
    json_stdout(&troupe(&[
        "adapters",
        "merge",
        "--model",
        dir.to_str().unwrap(),
        "--adapter",
        &spec,
        "--out",
        out_dir.to_str().unwrap(),
    ]));
    let text = "North opens 1NT; East doubles; the contract is 3NT.";
    let merged = json_stdout(&troupe(&["logprobs", "--model", out_dir.to_str().unwrap(), "--text", text]));
    let with_adapter =
        json_stdout(&troupe(&["logprobs", "--model", dir.to_str().unwrap(), "--adapter", &spec, "--text", text]));
    let diff = floats(&merged["logprobs"])
        .iter()
        .zip(floats(&with_adapter["logprobs"]))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(diff < 1e-4, "merged differs from base + adapter by {diff}");
    let base = json_stdout(&troupe(&["logprobs", "--model", dir.to_str().unwrap(), "--text", text]));
    assert_ne!(base["logprobs"], merged["logprobs"]);
}
