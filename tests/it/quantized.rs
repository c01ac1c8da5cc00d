//! The kept-quantized base (`--quantized`) against the dequantized f32 one on the tiny GGUF
//! fixtures (every block type) and a float checkpoint (made Q8_0): log-probs and greedy tokens,
//! the memory it holds, the product's gradient `dx = dy W`, a LoRA step whose gradients match the
//! f32 base's, and adapters trained on it that load on the dequantized base with the same outputs.

use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use common::*;
use troupe::adapters::optim::{adapter_grads, AdapterGrads};
use troupe::adapters::{AdamWConfig, AdamWState, MultiAdapterManager};
use troupe::generate::{generate, next_token_logprobs, score_rows, GenerateOptions, SamplingConfig, ScoringBatch};
use troupe::model::layers::LinearWeight;
use troupe::model::quant::quantized_linear;
use troupe::model::{BaseFormat, LoadOptions, Model};

/// Kept quantized and dequantized, the base computes with the same weights (ggml's
/// dequantization, bit for bit); with many rows per product (prefill, scoring, training: the
/// dequantized matrix and burn's GEMM) only the order of the sums differs. Measured on these
/// fixtures: at most 3.8e-6 (tiny-llama) and 1.1e-5 (kquants-llama), see the `eprintln!` lines.
const SAME_WEIGHTS_TOLERANCE: f32 = 5e-5;

/// With few rows per product (decoding, `FUSED_MAX_ROWS`) the inputs are also rounded to 16 bits
/// per 32-value block and multiplied in integers (`src/model/quant/activations.rs`). Measured on
/// these random-weight fixtures (whose outputs swing with small changes): at most 1.9e-4
/// (tiny-llama), 1.4e-4 (tiny-qwen2), 2.3e-4 (tiny-qwen3) and 2.8e-4 (kquants-llama); on SmolLM2
/// the same products stay within 9.2e-4 of transformers (`tests/gguf_smollm2.rs`).
const FEW_ROWS_TOLERANCE: f32 = 1e-3;

fn gguf(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/gguf")).join(name)
}

fn expected(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(gguf(&name.replace(".gguf", ".expected.json"))).unwrap()).unwrap()
}

fn greedy(model: &Model, ids: &[u32], tokens: usize) -> Vec<u32> {
    let options = GenerateOptions {
        max_new_tokens: tokens,
        sampling: SamplingConfig::greedy(),
        stop_at_eos: false,
        ..GenerateOptions::default()
    };
    generate(&model.lm, &model.tokenizer.eos_token_ids, &[ids.to_vec()], &options, None).unwrap().remove(0).output_ids
}

#[test]
fn kept_quantized_gguf_matches_the_dequantized_base() {
    let device = Device::flex();
    for name in ["tiny-llama.gguf", "tiny-qwen2.gguf", "tiny-qwen3.gguf", "kquants-llama.gguf"] {
        let dense = Model::from_path(&gguf(name), &device).unwrap();
        let quantized = Model::load(&LoadOptions::path(gguf(name)).quantized(true), &device).unwrap();
        assert_eq!(quantized.lm.format(), BaseFormat::Quantized);
        assert!(matches!(quantized.lm.layers[0].self_attn.qkv_proj.weight, LinearWeight::Quantized(_)));
        let want = expected(name);
        let cases: Vec<Vec<u32>> = want["cases"].as_array().unwrap().iter().map(|c| ids(&c["input_ids"])).collect();
        // One batch of every case (prefill-sized products) and each case alone (few rows).
        let all_dense = score_rows(&dense.lm, &cases, None).unwrap();
        let all_quantized = score_rows(&quantized.lm, &cases, None).unwrap();
        let mut worst = 0.0f32;
        for (case, (a, b)) in want["cases"].as_array().unwrap().iter().zip(all_dense.iter().zip(&all_quantized)) {
            worst = worst.max(max_abs_diff(a, b));
            // And against transformers' GGUF loader, as the dequantized base is held to.
            let reference = max_abs_diff(b, &floats(&case["logprobs"]));
            assert!(reference < 1e-4, "{name}: kept-quantized log-probs {reference} from transformers");
        }
        eprintln!("{name}: kept-quantized vs dequantized log-probs (many rows) differ by at most {worst:.1e}");
        assert!(worst < SAME_WEIGHTS_TOLERANCE, "{name}: {worst}");
        let mut worst_few = 0.0f32;
        for row in &cases {
            let short = &row[..row.len().min(6)];
            let a = score_rows(&dense.lm, &[short.to_vec()], None).unwrap().remove(0);
            let b = score_rows(&quantized.lm, &[short.to_vec()], None).unwrap().remove(0);
            worst_few = worst_few.max(max_abs_diff(&a, &b));
            assert_eq!(greedy(&dense, row, 8), greedy(&quantized, row, 8), "{name}: greedy tokens");
        }
        eprintln!("{name}: kept-quantized vs dequantized log-probs (few rows) differ by at most {worst_few:.1e}");
        assert!(worst_few < FEW_ROWS_TOLERANCE, "{name}: {worst_few}");
        assert_eq!(
            troupe::model::fingerprint::base_fingerprint(&dense.lm),
            troupe::model::fingerprint::base_fingerprint(&quantized.lm),
            "{name}: one fingerprint for both forms of the base"
        );
        // What `model inspect` reports is what the loaded base holds.
        let described = troupe::model::inspect::describe(&gguf(name)).unwrap();
        assert_eq!(
            described["memory_bytes"]["quantized"].as_u64().unwrap(),
            quantized.lm.weight_bytes() as u64,
            "{name}"
        );
        assert_eq!(described["memory_bytes"]["f32"].as_u64().unwrap(), dense.lm.weight_bytes() as u64, "{name}");
        assert!(quantized.lm.weight_bytes() < dense.lm.weight_bytes() / 2, "{name}");
    }
}

#[test]
fn float_checkpoint_kept_as_q8_0_stays_close() {
    let device = Device::flex();
    let dir = models_dir().join("tiny-qwen2");
    let dense = Model::from_path(&dir, &device).unwrap();
    let quantized = Model::load(&LoadOptions::path(&dir).quantized(true), &device).unwrap();
    let rows: Vec<Vec<u32>> = ["Player 1 hints red. Play card 0.", "North opens 1NT."]
        .iter()
        .map(|t| dense.tokenizer.encode(t).unwrap())
        .collect();
    let a = score_rows(&dense.lm, &rows, None).unwrap();
    let b = score_rows(&quantized.lm, &rows, None).unwrap();
    let worst = a.iter().zip(&b).map(|(x, y)| max_abs_diff(x, y)).fold(0.0, f32::max);
    // Q8_0 rounds each weight by up to half a step of max|w|/127 per 32 values: a real
    // quantization error, not summation order. Measured on this random-weight model (weights of
    // std 0.15, whose outputs swing with small weight changes): 0.102 at most.
    eprintln!("tiny-qwen2 as Q8_0: log-probs differ from f32 by at most {worst:.1e}");
    assert!(worst > 0.0 && worst < 0.2, "{worst}");
    let described = troupe::model::inspect::describe(&dir).unwrap();
    assert_eq!(described["memory_bytes"]["quantized"].as_u64().unwrap(), quantized.lm.weight_bytes() as u64);
    assert_eq!(described["memory_bytes"]["f32"].as_u64().unwrap(), dense.lm.weight_bytes() as u64);
}

#[test]
fn quantized_product_backward_is_dy_w() {
    let device = Device::flex();
    let model = Model::load(&LoadOptions::path(gguf("tiny-llama.gguf")).quantized(true), &device).unwrap();
    let LinearWeight::Quantized(weight) = &model.lm.layers[0].mlp.down_proj.weight else { panic!("kept quantized") };
    let [out, input] = weight.dims();
    let w = Tensor::<2>::from_data(TensorData::new(weight.dequantize(), [out, input]), &device);
    // Few rows (the fused product) and many (dequantize + GEMM).
    for m in [3usize, 40] {
        let x_values: Vec<f32> = (0..m * input).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let dy_values: Vec<f32> = (0..m * out).map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0).collect();
        let x =
            Tensor::<2>::from_data(TensorData::new(x_values, [m, input]), &device.clone().autodiff()).require_grad();
        let dy = Tensor::<2>::from_data(TensorData::new(dy_values, [m, out]), &device.clone().autodiff());
        let y = quantized_linear(x.clone(), weight);
        let want_y = x.clone().without_autodiff().matmul(w.clone().transpose());
        let forward: f32 = (y.clone().without_autodiff() - want_y).abs().max().into_scalar();
        assert!(forward < 1e-4, "m {m}: forward differs by {forward}");
        let grads = (y * dy.clone()).sum().backward();
        let dx = x.grad(&grads).expect("the input gets a gradient");
        let want_dx = dy.without_autodiff().matmul(w.clone());
        let backward: f32 = (dx - want_dx).abs().max().into_scalar();
        assert!(backward < 1e-4, "m {m}: dx differs from dy W by {backward}");
    }
}

fn adapter_gradients(
    model: &Model,
    manager: &MultiAdapterManager,
    rows: &[Vec<u32>],
) -> BTreeMap<String, AdapterGrads> {
    let agents: Vec<Option<usize>> = (0..rows.len()).map(|r| Some(r % 2)).collect();
    let (delta, used) = manager.mixed(&agents, true).unwrap();
    let batch = ScoringBatch::new(&model.lm, rows).unwrap();
    let logprobs = next_token_logprobs(&model.lm, &batch, Some(&delta)).unwrap();
    let [n, width] = logprobs.dims();
    let mut mask = Vec::with_capacity(n * width);
    for len in &batch.lengths {
        mask.extend((0..width).map(|t| if t + 1 < *len { 1.0f32 } else { 0.0 }));
    }
    let mask = Tensor::<2>::from_data(TensorData::new(mask, [n, width]), model.lm.device());
    let grads = (logprobs * mask).sum().neg().backward();
    used.iter().filter_map(|(name, adapter)| adapter_grads(adapter, &grads).map(|g| (name.clone(), g))).collect()
}

#[test]
fn lora_trains_on_the_quantized_base_and_its_adapters_load_on_the_dequantized_one() {
    let device = Device::flex();
    let path = gguf("tiny-qwen2.gguf");
    let dense = Model::from_path(&path, &device).unwrap();
    let quantized = Model::load(&LoadOptions::path(&path).quantized(true), &device).unwrap();
    // The fixture's PEFT adapters (non-zero A and B, all seven projections on agent_0).
    let adapters = models_dir().join("tiny-qwen2").join("adapters");
    let mut on_quantized = MultiAdapterManager::for_model(&quantized);
    on_quantized.load_adapters(&adapters).unwrap();
    let mut on_dense = MultiAdapterManager::for_model(&dense);
    on_dense.load_adapters(&adapters).unwrap();
    let rows: Vec<Vec<u32>> = ["Player 1 hints red. Play card 0.", "def main(xs):\n    return helper(xs)"]
        .iter()
        .map(|t| dense.tokenizer.encode(t).unwrap())
        .collect();

    // Gradients land on both adapters and equal those on the f32 base up to summation order.
    let q_grads = adapter_gradients(&quantized, &on_quantized, &rows);
    let d_grads = adapter_gradients(&dense, &on_dense, &rows);
    assert_eq!(q_grads.keys().collect::<Vec<_>>(), vec!["agent_0", "agent_1"]);
    for (name, grads) in &q_grads {
        let mut scale = 0.0f32;
        let mut diff = 0.0f32;
        for (site, (ga, gb)) in grads {
            let (ha, hb) = &d_grads[name][site];
            scale = scale.max(ga.clone().abs().max().into_scalar::<f32>());
            diff = diff.max((ga.clone() - ha.clone()).abs().max().into_scalar::<f32>());
            diff = diff.max((gb.clone() - hb.clone()).abs().max().into_scalar::<f32>());
        }
        eprintln!("{name}: adapter gradients on the quantized base differ by {diff:.1e} (scale {scale:.1e})");
        assert!(scale > 1e-4 && diff < 1e-4 * scale.max(1.0), "{name}: {diff} at scale {scale}");
    }

    // One AdamW step per agent on the quantized base, saved, loaded onto the dequantized base.
    let adamw = AdamWConfig { lr: 1e-2, ..AdamWConfig::default() };
    for (name, grads) in &q_grads {
        let agent: usize = name.strip_prefix("agent_").unwrap().parse().unwrap();
        let mut state = AdamWState::default();
        let updated = adamw.step(on_quantized.adapter(agent).unwrap(), grads, &mut state, adamw.lr);
        on_quantized.set_adapter(agent, updated).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    on_quantized.save_adapters(dir.path()).unwrap();
    let mut reloaded = MultiAdapterManager::for_model(&dense);
    reloaded.load_adapters(dir.path()).unwrap();
    for agent in [0usize, 1] {
        let (q_delta, _) = on_quantized.mixed(&[Some(agent); 2], false).unwrap();
        let (d_delta, _) = reloaded.mixed(&[Some(agent); 2], false).unwrap();
        let a = score_rows(&quantized.lm, &rows, Some(&q_delta)).unwrap();
        let b = score_rows(&dense.lm, &rows, Some(&d_delta)).unwrap();
        let worst = a.iter().zip(&b).map(|(x, y)| max_abs_diff(x, y)).fold(0.0, f32::max);
        assert!(worst < SAME_WEIGHTS_TOLERANCE, "agent {agent}: {worst}");
    }
}

fn troupe(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn json_stdout(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn train_and_eval_take_quantized() {
    // The built-in tiny model, kept as Q8_0: one Hanabi iteration, then its evaluation.
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("tiny.yaml");
    let text = format!(
        "run: {{out_dir: {}, seed: 3, iterations: 1, checkpoint_every: 1}}\n\
         env: {{name: hanabi, players: 2, history_moves: 1}}\n\
         adapter: {{r: 4, lora_alpha: 8.0}}\n\
         action: {{mode: free, max_new_tokens: 4, chat_template: false}}\n\
         training: {{group_size: 2, groups_per_iteration: 1, lr: 1.0e-2, max_episode_steps: 3}}\n\
         eval: {{episodes: 2, seed: 5000}}\n",
        tmp.path().join("run").display()
    );
    std::fs::write(&config, text).unwrap();
    let config = config.to_str().unwrap();
    let summary = json_stdout(&troupe(&["train", "--config", config, "--quiet", "--quantized"]));
    assert_eq!(summary["iterations"], 1);
    let run = tmp.path().join("run");
    let resolved = std::fs::read_to_string(run.join("config.yaml")).unwrap();
    assert!(resolved.contains("quantized: true"), "{resolved}");
    let eval = json_stdout(&troupe(&["eval", "--config", config, "--adapters", run.to_str().unwrap(), "--quantized"]));
    assert_eq!(eval["episodes"], 2);
}
