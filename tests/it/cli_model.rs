//! The model commands as a user runs them: `troupe init-model` then `troupe logprobs` and
//! `troupe generate` on the written directory, offline; bad input exits non-zero with one line.

use std::process::Command;

fn troupe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn json_stdout(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn init_model_then_logprobs_and_generate() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    let dir_s = dir.to_str().unwrap();
    let init = json_stdout(&troupe(&["init-model", "--out", dir_s, "--seed", "5"]));
    assert_eq!(init["parameters"], 918912);
    for file in
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    {
        assert!(dir.join(file).exists(), "{file} written");
    }
    let text = "Player 0 plays red 1.";
    let lp = json_stdout(&troupe(&["logprobs", "--model", dir_s, "--text", text]));
    let ids = lp["input_ids"].as_array().unwrap();
    let logprobs = lp["logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), ids.len() - 1);
    assert!(logprobs.iter().all(|v| v.as_f64().unwrap() < 0.0));

    // The directory holds the same model as the in-memory built-in one with that seed.
    let device = burn::tensor::Device::flex();
    let builtin = troupe::model::Model::builtin(troupe::model::Preset::Tiny, 5, &device).unwrap();
    let expected = troupe::generate::score_rows(&builtin.lm, &[builtin.tokenizer.encode(text).unwrap()], None).unwrap();
    let got: Vec<f32> = logprobs.iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert_eq!(got, expected[0]);

    let gen = json_stdout(&troupe(&[
        "generate",
        "--model",
        dir_s,
        "--prompt",
        "hint player",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        "2",
    ]));
    let again = json_stdout(&troupe(&[
        "generate",
        "--model",
        dir_s,
        "--prompt",
        "hint player",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        "2",
    ]));
    assert_eq!(gen["output_ids"], again["output_ids"]);
    assert!(gen["output_ids"].as_array().unwrap().len() <= 6);
    assert!(gen["text"].is_string() && gen["tokens_per_second"].as_f64().unwrap() > 0.0);
}

#[test]
fn default_model_needs_no_directory() {
    let out = json_stdout(&troupe(&["logprobs", "--text", "play card 2"]));
    assert!(out["input_ids"].as_array().unwrap().len() >= 2);
    let chat = json_stdout(&troupe(&["generate", "--prompt", "Your move?", "--chat", "--max-new-tokens", "3"]));
    assert_eq!(chat["prompt_ids"][0], 1, "the chat template opens with <|im_start|>");
}

#[test]
fn bad_input_is_one_line_and_nonzero() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope");
    for args in [
        vec!["logprobs", "--model", missing.to_str().unwrap(), "--text", "x"],
        vec!["generate", "--prompt", "x", "--top-p", "0"],
        vec!["--device", "tpu", "logprobs", "--text", "x"],
    ] {
        let out = troupe(&args);
        assert!(!out.status.success(), "{args:?} must fail");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
        assert!(lines[0].starts_with("error: "), "{stderr}");
    }
}

/// `TROUPE_MATMUL` reaches the frozen products: on the CPU (troupe's own products, whatever the
/// routine) every routine gives `auto`'s values exactly; on a GPU (`TROUPE_TEST_DEVICE`) the
/// routine without tile-matrix units and a double-buffered one (which falls back to `auto`, with
/// one warning, where the device has no such units) stay within the tests' tolerance of `auto`.
#[test]
fn the_matmul_kernel_reaches_the_frozen_products() {
    let device = std::env::var("TROUPE_TEST_DEVICE").ok().filter(|name| !name.is_empty());
    let run = |kernel: &str| {
        let mut args: Vec<&str> = device.iter().flat_map(|name| ["--device", name.as_str()]).collect();
        args.extend_from_slice(&["logprobs", "--text", "Player 1 hints red to player 0.", "--dtype", "f32"]);
        let out = Command::new(env!("CARGO_BIN_EXE_troupe")).args(&args).env("TROUPE_MATMUL", kernel).output().unwrap();
        json_stdout(&out)
    };
    let values = |json: &serde_json::Value| -> Vec<f64> {
        json["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
    };
    let auto = run("auto");
    for kernel in ["simple-unit", "double-cmma"] {
        let other = run(kernel);
        assert_eq!(other["input_ids"], auto["input_ids"], "{kernel}");
        let worst = values(&other).iter().zip(values(&auto)).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        // On a GPU f32 products round to TF32 on the tile-matrix units, and routines sum in
        // their own orders.
        let allowed = if device.as_deref().is_none_or(|name| name == "cpu") { 0.0 } else { 2e-2 };
        assert!(worst <= allowed, "{kernel}: log-probs differ from auto by {worst}");
    }
}

/// `--attention` reaches `logprobs` and `generate`: on the CPU (troupe's own fused attention,
/// whatever the flag) every kernel gives the default's values exactly; on a GPU
/// (`TROUPE_TEST_DEVICE=cuda`) the flash kernel runs without falling back and stays within the
/// tests' tolerance of the materialized one.
#[test]
fn attention_flag_reaches_logprobs_and_generate() {
    let device = std::env::var("TROUPE_TEST_DEVICE").ok().filter(|name| !name.is_empty());
    let run = |command: &[&str], kernel: &str| {
        let mut args: Vec<&str> = device.iter().flat_map(|name| ["--device", name.as_str()]).collect();
        args.extend_from_slice(command);
        args.extend_from_slice(&["--attention", kernel, "--dtype", "f32"]);
        let out = troupe(&args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!stderr.contains("using the materialized kernel"), "{kernel}: the flash kernel fell back: {stderr}");
        json_stdout(&out)
    };
    let text = ["logprobs", "--text", "Player 1 hints red to player 0, who plays card 3."];
    let prompt = ["generate", "--prompt", "Your move?", "--chat", "--max-new-tokens", "5"];
    let [auto, flash, materialized] =
        ["auto", "flash", "materialized"].map(|kernel| (run(&text, kernel), run(&prompt, kernel)));
    let values = |json: &serde_json::Value| -> Vec<f64> {
        json["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
    };
    for (kernel, (logprobs, generated)) in [("flash", &flash), ("materialized", &materialized)] {
        assert_eq!(logprobs["input_ids"], auto.0["input_ids"], "{kernel}");
        let worst = values(logprobs).iter().zip(values(&auto.0)).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        // On a GPU the products round to TF32 (`common::tolerance`), so a different attention
        // kernel moves the next products' roundings too.
        let allowed = if device.as_deref().is_none_or(|name| name == "cpu") { 0.0 } else { 2e-2 };
        assert!(worst <= allowed, "{kernel}: log-probs differ from auto by {worst}");
        if allowed == 0.0 {
            assert_eq!(generated["output_ids"], auto.1["output_ids"], "{kernel}: greedy generation");
        }
    }
    let bad = troupe(&["logprobs", "--text", "x", "--attention", "fast"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--attention"), "the error names the flag");
}
