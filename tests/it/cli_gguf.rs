//! The commands on GGUF files, run as a user runs them: `model inspect`, `logprobs`,
//! `generate --chat`, `adapters merge`, and a training config's `model.path: FILE.gguf`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn troupe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn json_stdout(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn gguf(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/gguf")).join(name)
}

fn expected(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(gguf(&name.replace(".gguf", ".expected.json"))).unwrap()).unwrap()
}

#[test]
fn inspect_describes_file_and_directory() {
    let path = gguf("tiny-llama.gguf");
    let out = json_stdout(&troupe(&["model", "inspect", path.to_str().unwrap()]));
    let want = expected("tiny-llama.gguf");
    assert_eq!(out["format"], "gguf");
    assert_eq!(out["architecture"], "llama");
    assert_eq!(out["parameters"], want["config"]["parameters"]);
    assert_eq!(out["tokenizer"]["model"], "gpt2");
    // Every stored type of the file, with tensor counts that add up.
    let types = out["tensor_types"].as_object().unwrap();
    for name in ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"] {
        assert!(types.contains_key(name), "{name} in {types:?}");
    }
    let counted: u64 = types.values().map(|v| v["tensors"].as_u64().unwrap()).sum();
    assert_eq!(counted, out["tensors"].as_u64().unwrap());
    let memory = &out["memory_bytes"];
    assert_eq!(memory["f32"].as_u64().unwrap(), 4 * want["config"]["parameters"].as_u64().unwrap());
    assert!(memory["quantized"].as_u64().unwrap() < memory["f32"].as_u64().unwrap() / 2, "{memory}");

    let dir = common::models_dir().join("tiny-qwen3");
    let out = json_stdout(&troupe(&["model", "inspect", dir.to_str().unwrap()]));
    assert_eq!(out["format"], "safetensors");
    assert_eq!(out["architecture"], "qwen3");
    assert!(out["tensor_types"]["BF16"]["tensors"].as_u64().unwrap() > 0);

    let missing = troupe(&["model", "inspect", "no-such-model.gguf"]);
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains("no-such-model.gguf") && stderr.trim().lines().count() == 1, "{stderr}");
}

#[test]
fn logprobs_and_chat_generation_read_the_file() {
    let path = gguf("tiny-qwen3.gguf");
    let want = expected("tiny-qwen3.gguf");
    let case = &want["cases"][1];
    let out = json_stdout(&troupe(&[
        "logprobs",
        "--model",
        path.to_str().unwrap(),
        "--text",
        case["text"].as_str().unwrap(),
    ]));
    assert_eq!(out["input_ids"], case["input_ids"]);
    let diff = common::max_abs_diff(&common::floats(&out["logprobs"]), &common::floats(&case["logprobs"]));
    assert!(diff < 1e-4, "{diff}");
    // Kept quantized, the same weights in their block formats; this short text is scored with few
    // rows per product, so its inputs are also rounded to 16-bit blocks (measured: 2.8e-4; the
    // few-row tolerance of tests/quantized.rs).
    let quantized = json_stdout(&troupe(&[
        "logprobs",
        "--model",
        path.to_str().unwrap(),
        "--quantized",
        "--text",
        case["text"].as_str().unwrap(),
    ]));
    assert_eq!(quantized["input_ids"], case["input_ids"]);
    let diff = common::max_abs_diff(&common::floats(&quantized["logprobs"]), &common::floats(&case["logprobs"]));
    assert!(diff < 1e-3, "--quantized: {diff}");
    let out = json_stdout(&troupe(&[
        "generate",
        "--model",
        path.to_str().unwrap(),
        "--chat",
        "--prompt",
        "Your move?",
        "--max-new-tokens",
        "4",
    ]));
    let prompt: Vec<u32> = common::ids(&out["prompt_ids"]);
    assert!(prompt.len() > 5 && prompt[0] == 1, "the ChatML template opens with <|im_start|> (id 1): {prompt:?}");
}

#[test]
fn an_adapter_merges_into_a_gguf_base() {
    // tiny-llama's PEFT adapters fit its GGUF conversion (same shapes, quantized weights).
    let base = gguf("tiny-llama.gguf");
    let spec = format!("{}:agent_0", common::models_dir().join("tiny-llama/adapters").display());
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("merged");
    json_stdout(&troupe(&[
        "adapters",
        "merge",
        "--model",
        base.to_str().unwrap(),
        "--adapter",
        &spec,
        "--out",
        out_dir.to_str().unwrap(),
    ]));
    for file in
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
    {
        assert!(out_dir.join(file).exists(), "{file}");
    }
    let text = "Player 1 hints red. Play card 0.";
    let merged = json_stdout(&troupe(&["logprobs", "--model", out_dir.to_str().unwrap(), "--text", text]));
    let with_adapter =
        json_stdout(&troupe(&["logprobs", "--model", base.to_str().unwrap(), "--adapter", &spec, "--text", text]));
    assert_eq!(merged["input_ids"], with_adapter["input_ids"]);
    let diff = common::max_abs_diff(&common::floats(&merged["logprobs"]), &common::floats(&with_adapter["logprobs"]));
    assert!(diff < 1e-4, "merged differs from GGUF base + adapter by {diff}");
    // The merged directory keeps the chat template.
    let chat = json_stdout(&troupe(&[
        "generate",
        "--model",
        out_dir.to_str().unwrap(),
        "--chat",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "1",
    ]));
    assert_eq!(common::ids(&chat["prompt_ids"])[0], 1);
}

#[test]
fn a_config_names_a_gguf_model_path() {
    // `train` and `eval` load their model through `load_model`; the tiny files' byte-level
    // vocabularies make game prompts longer than their 512 positions, so the run itself is
    // exercised on directories (tests/cli_train.rs) and here only the loading.
    let path = gguf("tiny-qwen2.gguf");
    let text = format!("model: {{path: {}}}\nenv: {{name: hanabi}}\n", path.display());
    let registry = troupe_envs::Registry::with_builtins();
    let config = troupe::rl::config::TrainConfig::from_yaml_str(&text, Path::new("gguf.yaml"), &[], &registry).unwrap();
    let model = troupe::rl::run::load_model(&config, &burn::tensor::Device::flex()).unwrap();
    assert_eq!(model.lm.config.model_type.as_str(), "qwen2");
    assert_eq!(model.lm.format(), troupe::model::BaseFormat::F32);
    let quantized = ["model.quantized=true".to_string()];
    let config =
        troupe::rl::config::TrainConfig::from_yaml_str(&text, Path::new("gguf.yaml"), &quantized, &registry).unwrap();
    let model = troupe::rl::run::load_model(&config, &burn::tensor::Device::flex()).unwrap();
    assert_eq!(model.lm.format(), troupe::model::BaseFormat::Quantized);
    assert_eq!(config.adapter_config().base_model_name_or_path.as_deref(), Some(path.to_str().unwrap()));
    let config = troupe::rl::config::TrainConfig::from_yaml_str(
        "model: {path: missing.gguf}\n",
        Path::new("gguf.yaml"),
        &[],
        &registry,
    )
    .unwrap();
    let err = troupe::rl::run::load_model(&config, &burn::tensor::Device::flex()).err().unwrap().to_string();
    assert!(err.contains("missing.gguf"), "{err}");
}
