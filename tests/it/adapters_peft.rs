//! PEFT interoperability: the fixture adapters (written by PEFT 0.21) load here and give
//! transformers + PEFT's log-probs, alone and mixed in one batch; saving them again gives the
//! same tensors; bad adapter directories are refused by name, leaving nothing half-written.

use crate::common;

use std::path::Path;

use common::*;
use troupe::adapters::peft::{read_adapter_dir, WEIGHTS_FILE};
use troupe::adapters::{AdapterConfig, MultiAdapterManager};
use troupe::generate::{generate, last_logits, score_rows, GenerateOptions, SamplingConfig};
use troupe::model::safetensors_io::TensorStore;
use troupe::model::{Model, ProjectionDelta};

fn manager_for(model: &Model, dir: &Path) -> MultiAdapterManager {
    let mut manager = MultiAdapterManager::new(&model.lm.config, model.lm.device());
    manager.load_adapters(&dir.join("adapters")).unwrap();
    manager
}

#[test]
fn fixture_adapters_match_peft_alone_and_mixed() {
    for dir in fixture_models() {
        let model = common::load_f32(&dir);
        let manager = manager_for(&model, &dir);
        assert_eq!(manager.adapter_name(0).unwrap(), "agent_0");
        assert_eq!(manager.adapter_name(1).unwrap(), "agent_1");
        let expected = expected(&dir);
        for (agent, key) in [(0usize, "agent_0"), (1, "agent_1")] {
            for case in expected[key].as_array().unwrap() {
                let ids_ = ids(&case["input_ids"]);
                let (delta, _) = manager.mixed(&[Some(agent)], false).unwrap();
                let got = score_rows(&model.lm, std::slice::from_ref(&ids_), Some(&delta as &dyn ProjectionDelta))
                    .unwrap()
                    .remove(0);
                let diff = max_abs_diff(&got, &floats(&case["logprobs"]));
                assert!(diff < tolerance(1e-3), "{} {key}: log-probs differ by {diff}", dir.display());
                let logits = last_logits(&model.lm, &ids_, Some(&delta)).unwrap();
                let what = format!("{} {key}", dir.display());
                assert_top_k(&logits, &ids(&case["last_top5_ids"]), &floats(&case["last_top5_logits"]), &what);
                let options = GenerateOptions {
                    max_new_tokens: 16,
                    sampling: SamplingConfig::greedy(),
                    stop_at_eos: false,
                    ..Default::default()
                };
                // The fixtures hold greedy continuations for the base only: with an adapter, the
                // KV-cache path must agree with recomputing the whole sequence.
                let cached = generate(&model.lm, &[], std::slice::from_ref(&ids_), &options, Some(&delta)).unwrap();
                let full =
                    generate(&model.lm, &[], &[ids_], &GenerateOptions { use_cache: false, ..options }, Some(&delta))
                        .unwrap();
                assert_same_generations(&cached, &full, &format!("{} {key}: KV cache with adapter", dir.display()));
            }
        }
        // One pass, three rows: agent_0, agent_1, bare base.
        let mixed = &expected["mixed_batch"];
        let names: Vec<&str> = mixed["adapter_names"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let rows: Vec<Option<usize>> =
            names.iter().map(|n| n.strip_prefix("agent_").map(|i| i.parse().unwrap())).collect();
        let tokens: Vec<Vec<u32>> = mixed["rows"].as_array().unwrap().iter().map(|r| ids(&r["input_ids"])).collect();
        let (delta, _) = manager.mixed(&rows, false).unwrap();
        let got = score_rows(&model.lm, &tokens, Some(&delta)).unwrap();
        for (row, case) in got.iter().zip(mixed["rows"].as_array().unwrap()) {
            let diff = max_abs_diff(row, &floats(&case["logprobs"]));
            assert!(diff < tolerance(1e-3), "{} mixed batch row differs by {diff}", dir.display());
        }
    }
}

/// A manager stacks the factors of a list of constant adapters once and reuses them for every
/// batch over those adapters; changing an adapter (set, add, remove, load) makes the next batch
/// use the new factors. Checked against PEFT's log-probs of the fixture's mixed batch.
#[test]
fn mixed_batches_follow_a_managers_adapters_when_they_change() {
    let dir = models_dir().join("tiny-qwen3");
    let model = common::load_f32(&dir);
    let mut manager = manager_for(&model, &dir);
    let mixed = &expected(&dir)["mixed_batch"];
    let rows: Vec<Option<usize>> = mixed["adapter_names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().strip_prefix("agent_").map(|i| i.parse().unwrap()))
        .collect();
    let tokens: Vec<Vec<u32>> = mixed["rows"].as_array().unwrap().iter().map(|r| ids(&r["input_ids"])).collect();
    let peft: Vec<Vec<f32>> = mixed["rows"].as_array().unwrap().iter().map(|r| floats(&r["logprobs"])).collect();
    let score = |manager: &MultiAdapterManager, rows: &[Option<usize>]| {
        score_rows(&model.lm, &tokens, Some(&manager.mixed(rows, false).unwrap().0)).unwrap()
    };
    let matches_peft = |got: &[Vec<f32>], what: &str| {
        for (row, (got, want)) in got.iter().zip(&peft).enumerate() {
            let diff = max_abs_diff(got, want);
            assert!(diff < tolerance(1e-3), "{what}: row {row} differs from PEFT by {diff}");
        }
    };
    let first = score(&manager, &rows);
    matches_peft(&first, "first batch");
    assert_eq!(score(&manager, &rows), first, "a second batch over the same adapters");
    let everyone = |agent| vec![Some(agent); tokens.len()];
    let (as_0, as_1) = (score(&manager, &everyone(0)), score(&manager, &everyone(1)));
    assert_ne!(as_0, as_1, "the fixture's two adapters differ");

    // Agent 0 takes agent 1's adapter: every batch naming agent 0 follows.
    let adapter_1 = manager.adapter(1).unwrap().clone();
    manager.set_adapter(0, adapter_1.clone()).unwrap();
    assert_eq!(score(&manager, &everyone(0)), as_1, "after set_adapter, all rows on agent 0");
    let swapped: Vec<Option<usize>> = rows.iter().map(|r| r.map(|_| 0)).collect();
    let want: Vec<Option<usize>> = rows.iter().map(|r| r.map(|_| 1)).collect();
    assert_eq!(score(&manager, &swapped), score(&manager, &want), "after set_adapter, mixed with the base");

    // Loading the fixture again brings agent 0's own adapter back.
    manager.load_adapters(&dir.join("adapters")).unwrap();
    assert_eq!(score(&manager, &rows), first, "after load_adapters");
    assert_eq!(score(&manager, &everyone(0)), as_0, "after load_adapters, all rows on agent 0");

    // Replaced under a new name, then removed.
    manager.add_adapter(0, "other", adapter_1);
    assert_eq!(score(&manager, &everyone(0)), as_1, "after add_adapter");
    manager.remove_adapter(0).unwrap();
    assert!(manager.mixed(&everyone(0), false).is_err(), "agent 0 has no adapter after remove_adapter");
    let own = read_adapter_dir(&dir.join("adapters").join("agent_0"), &model.lm.config, model.lm.device()).unwrap();
    manager.add_adapter(0, "agent_0", own);
    assert_eq!(score(&manager, &rows), first, "agent 0's own adapter added back");
}

#[test]
fn saving_loaded_adapters_gives_the_original_tensors_and_round_trips() {
    let device = common::test_device();
    let dir = models_dir().join("tiny-qwen3");
    let model = common::load_f32(&dir);
    let manager = manager_for(&model, &dir);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("saved");
    manager.save_adapters(&out).unwrap();
    for name in ["agent_0", "agent_1"] {
        let original =
            TensorStore::open_files(&[dir.join("adapters").join(name).join(WEIGHTS_FILE)], dir.clone()).unwrap();
        let saved = TensorStore::open_files(&[out.join(name).join(WEIGHTS_FILE)], out.clone()).unwrap();
        assert_eq!(original.names(), saved.names(), "{name}: same tensor names");
        for tensor in original.names() {
            assert_eq!(original.read(&tensor, None).unwrap(), saved.read(&tensor, None).unwrap(), "{name}: {tensor}");
        }
        let config_a = AdapterConfig::from_file(&dir.join("adapters").join(name).join("adapter_config.json")).unwrap();
        let config_b = AdapterConfig::from_file(&out.join(name).join("adapter_config.json")).unwrap();
        assert_eq!(config_a, config_b);
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join(name).join("adapter_config.json")).unwrap())
                .unwrap();
        for (field, value) in [("peft_type", "LORA"), ("task_type", "CAUSAL_LM"), ("bias", "none")] {
            assert_eq!(json[field], value);
        }
    }
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("troupe.json")).unwrap()).unwrap();
    assert_eq!(manifest["mode"], "per_agent");
    assert_eq!(manifest["agents"]["1"], "agent_1");

    // Fresh adapters: save -> load is exact.
    let mut fresh = MultiAdapterManager::new(&model.lm.config, &device);
    let config = AdapterConfig { r: 3, lora_alpha: 6.0, ..AdapterConfig::default() };
    fresh.create_adapters_seeded(3, &config, 9).unwrap();
    let path = tmp.path().join("fresh");
    fresh.save_adapters(&path).unwrap();
    let mut loaded = MultiAdapterManager::new(&model.lm.config, &device);
    loaded.load_adapters(&path).unwrap();
    for agent in 0..3 {
        assert_eq!(fresh.adapter(agent).unwrap().to_host().unwrap(), loaded.adapter(agent).unwrap().to_host().unwrap());
        assert_eq!(fresh.adapter(agent).unwrap().config, loaded.adapter(agent).unwrap().config);
    }
}

#[test]
fn a_fresh_adapter_leaves_the_base_output_unchanged() {
    let device = common::test_device();
    let dir = models_dir().join("tiny-qwen2");
    let model = common::load_f32(&dir);
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    let config = AdapterConfig {
        target_modules: troupe::model::Projection::ALL.to_vec(),
        use_rslora: true,
        ..AdapterConfig::default()
    };
    manager.create_adapters(2, &config).unwrap();
    let tokens = vec![model.tokenizer.encode("Player 1 hints red. Play card 0.").unwrap()];
    let base = score_rows(&model.lm, &tokens, None).unwrap();
    let (delta, _) = manager.mixed(&[Some(1)], false).unwrap();
    assert_eq!(score_rows(&model.lm, &tokens, Some(&delta)).unwrap(), base);
}

/// Copies the tiny-qwen3 fixture adapters to a temp dir and applies `edit` to agent_0.
fn broken_copy(tmp: &Path, edit: impl FnOnce(&Path)) -> std::path::PathBuf {
    let src = models_dir().join("tiny-qwen3").join("adapters");
    let dst = tmp.join("adapters");
    for name in ["agent_0", "agent_1"] {
        std::fs::create_dir_all(dst.join(name)).unwrap();
        for file in ["adapter_config.json", WEIGHTS_FILE] {
            std::fs::copy(src.join(name).join(file), dst.join(name).join(file)).unwrap();
        }
    }
    edit(&dst.join("agent_0"));
    dst
}

fn load_error(model: &Model, dir: &Path) -> String {
    let mut manager = MultiAdapterManager::new(&model.lm.config, model.lm.device());
    manager.create_adapters(1, &AdapterConfig::default()).unwrap();
    let before = manager.adapter(0).unwrap().to_host().unwrap();
    let err = manager.load_adapters(dir).unwrap_err().to_string();
    assert_eq!(manager.adapter(0).unwrap().to_host().unwrap(), before, "a failed load changes nothing");
    err
}

#[test]
fn bad_adapters_are_refused_by_name() {
    let device = common::test_device();
    let qwen3 = common::load_f32(&models_dir().join("tiny-qwen3"));
    let llama = common::load_f32(&models_dir().join("tiny-llama"));
    let tmp = tempfile::tempdir().unwrap();

    // Made for another base: qwen3's adapters on llama (q_proj is 64x128 there, 64x64 here).
    let err = load_error(&llama, &models_dir().join("tiny-qwen3").join("adapters"));
    assert!(err.contains("has shape") && err.contains("expected") && err.contains("lora_"), "{err}");

    let dir = broken_copy(&tmp.path().join("missing"), |d| {
        edit_safetensors(&d.join(WEIGHTS_FILE), |t| {
            t.remove("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight");
        })
    });
    let err = load_error(&qwen3, &dir);
    assert!(err.contains("tensor `base_model.model.model.layers.1.mlp.down_proj.lora_B.weight` is missing"), "{err}");

    let dir = broken_copy(&tmp.path().join("target"), |d| {
        let path = d.join("adapter_config.json");
        let text = std::fs::read_to_string(&path).unwrap().replace("\"gate_proj\"", "\"gate_projection\"");
        std::fs::write(path, text).unwrap();
    });
    let err = load_error(&qwen3, &dir);
    assert!(err.contains("unknown target module \"gate_projection\""), "{err}");

    let dir = broken_copy(&tmp.path().join("corrupt"), |d| {
        std::fs::write(d.join(WEIGHTS_FILE), b"\x10\x00\x00\x00\x00\x00\x00\x00{not json").unwrap()
    });
    let err = load_error(&qwen3, &dir);
    assert!(err.contains(WEIGHTS_FILE) && err.contains("not a"), "{err}");

    let manager = MultiAdapterManager::new(&qwen3.lm.config, &device);
    let err = manager.adapter_name(3).unwrap_err().to_string();
    assert!(err.contains("agent 3 has no adapter"), "{err}");
    let single =
        read_adapter_dir(&models_dir().join("tiny-qwen3/adapters/agent_1"), &qwen3.lm.config, &device).unwrap();
    assert_eq!(single.config.r, 8);
}

#[test]
fn a_failed_save_leaves_no_partial_directory() {
    let device = common::test_device();
    let model = common::load_f32(&models_dir().join("tiny-qwen3"));
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.create_adapters(2, &AdapterConfig::default()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // The target's parent is a file: nothing can be written, and nothing is left behind.
    let blocker = tmp.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    assert!(manager.save_adapters(&blocker.join("adapters")).is_err());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("file")]);
    // Saving over an existing directory replaces it whole.
    let out = tmp.path().join("adapters");
    manager.save_adapters(&out).unwrap();
    manager.create_adapters_seeded(1, &AdapterConfig::default(), 1).unwrap();
    manager.save_adapters(&out).unwrap();
    assert!(!out.join("agent_1").exists(), "the old directory was replaced, not merged");
}

#[test]
fn lora_dropout_applies_in_training_only() {
    let dir = models_dir().join("tiny-qwen3");
    let model = common::load_f32(&dir);
    let mut manager = manager_for(&model, &dir);
    let mut adapter = manager.adapter(0).unwrap().clone();
    adapter.config.lora_dropout = 0.5;
    manager.add_adapter(0, "agent_0", adapter);
    let tokens = vec![model.tokenizer.encode("Player 1 hints red. Play card 0.").unwrap(); 2];
    let rows = [Some(0), Some(1)];
    let plain = score_rows(&model.lm, &tokens, Some(&manager.mixed(&rows, false).unwrap().0)).unwrap();
    let train =
        |seed| score_rows(&model.lm, &tokens, Some(&manager.mixed_for_training(&rows, seed).unwrap().0)).unwrap();
    let (a, b) = (train(1), train(1));
    assert_eq!(a, b, "the dropout seed fixes the masks");
    // (The differentiable path rounds differently from the inference path by ~1e-6.)
    assert!(max_abs_diff(&a[0], &plain[0]) > 1e-2, "agent 0's rows see dropout (p = 0.5) in training");
    assert!(max_abs_diff(&a[1], &plain[1]) < 1e-5, "agent 1 has lora_dropout 0: its rows are untouched");
    assert_ne!(train(2)[0], a[0]);
    // Scoring and generation (the non-training path) never apply dropout.
    assert_eq!(score_rows(&model.lm, &tokens, Some(&manager.mixed(&rows, false).unwrap().0)).unwrap(), plain);
}
