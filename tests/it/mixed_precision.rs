//! `model.dtype`: the frozen base held and multiplied in bf16 or f16 against references we did
//! not write: transformers in float32 math (`expected.json`) and transformers with the model
//! cast to bfloat16 (`expected_bf16.json`, bf16 math throughout), with the PEFT fixture adapters;
//! and adapters trained on a bf16 base, saved in PEFT's f32 layout, reloaded on an f32 base.
//!
//! Tolerances (measured on the three fixture models, CPU, `cargo test --test it mixed_precision::
//! -- --nocapture`; `docs/gpu.md`, "Mixed precision"), each about twice the measured worst case over
//! every log-prob of the base and both adapters: troupe in bf16 against transformers in f32
//! [`BF16_VS_F32`] (measured 8.4e-2); against transformers with the model cast to bf16
//! [`BF16_VS_TRANSFORMERS_BF16`] (measured 1.5e-1: transformers' bf16 also rounds the residual
//! stream and every activation, troupe keeps them in f32, and transformers' own bf16 lies 1.2e-1
//! from its f32); troupe in f16 against f32 [`F16_VS_F32`] (measured 1.5e-2). Adapters trained
//! on the bf16 base give the same log-probs on the f32 base within [`BF16_VS_F32`] (measured
//! 4.6e-2). Adapters troupe trained on the bf16 base (`fixtures/bf16-trained`), loaded by PEFT on
//! transformers' model: troupe in f32 matches PEFT in f32 within 1e-3 (measured 4.3e-6), troupe in
//! bf16 matches PEFT in f32 within [`BF16_VS_F32`] (measured 5.3e-2) and PEFT on the bf16 model
//! within [`BF16_VS_TRANSFORMERS_BF16`] (measured 9.7e-2; `tools/peft_check.py` trains afresh
//! and checks the same).

use crate::common;

use std::path::Path;

use burn::tensor::DType;
use common::*;
use troupe::adapters::MultiAdapterManager;
use troupe::generate::score_rows;
use troupe::model::{LoadOptions, Model, Precision, ProjectionDelta};
use troupe::rl::config::TrainConfig;
use troupe::rl::run::checkpoint::checkpoint_dir;
use troupe::rl::run::TrainingRun;
use troupe_envs::Registry;

/// troupe in bf16 against transformers in float32 math, per log-prob.
const BF16_VS_F32: f32 = 0.15;
/// troupe in bf16 against transformers with the model cast to bfloat16, per log-prob.
const BF16_VS_TRANSFORMERS_BF16: f32 = 0.25;
/// troupe in f16 against transformers in float32 math, per log-prob.
const F16_VS_F32: f32 = 3e-2;

fn expected_bf16(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected_bf16.json")).unwrap()).unwrap()
}

/// The log-probs of `ids` under the base with `agent`'s adapter (or none).
fn score(model: &Model, manager: &MultiAdapterManager, agent: Option<usize>, ids: &[u32]) -> Vec<f32> {
    let rows = std::slice::from_ref(&ids.to_vec()).to_vec();
    match agent {
        Some(agent) => {
            let (delta, _) = manager.mixed(&[Some(agent)], false).unwrap();
            score_rows(&model.lm, &rows, Some(&delta as &dyn ProjectionDelta)).unwrap().remove(0)
        }
        None => score_rows(&model.lm, &rows, None).unwrap().remove(0),
    }
}

fn load(dir: &Path, precision: Precision) -> Model {
    Model::load(&LoadOptions::path(dir).dtype(precision), &test_device()).unwrap()
}

/// Whether the test device holds a base in bf16: the CPU and CUDA do; wgpu's shaders have no
/// bf16, and there loading one is refused with an error naming `model.dtype` (checked here, and
/// the caller's bf16 checks left out).
fn bf16_on_test_device() -> bool {
    let device = test_device();
    if device == burn::tensor::Device::flex() || troupe::device::is_cuda(&device) {
        return true;
    }
    let dir = models_dir().join("tiny-qwen2");
    let err = Model::load(&LoadOptions::path(&dir).dtype(Precision::Bf16), &device).unwrap_err();
    assert!(err.to_string().contains("model.dtype"), "{err}");
    eprintln!("the test device has no bf16 ({err}): its bf16 checks are left out");
    false
}

#[test]
fn bf16_and_f16_log_probs_match_transformers_in_f32_and_in_bf16_within_the_stated_tolerance() {
    let (mut bf16_vs_f32, mut bf16_vs_theirs, mut f16_vs_f32, mut theirs_vs_f32) = (0f32, 0f32, 0f32, 0f32);
    let bf16 = bf16_on_test_device();
    let precisions: &[(Precision, DType)] = if bf16 {
        &[(Precision::Bf16, DType::BF16), (Precision::F16, DType::F16)]
    } else {
        &[(Precision::F16, DType::F16)]
    };
    for dir in fixture_models() {
        let (f32_ref, bf16_ref) = (expected(&dir), expected_bf16(&dir));
        assert_eq!(bf16_ref["lora_dtype"], serde_json::json!(["float32"]), "PEFT keeps LoRA in f32 on a bf16 model");
        for &(precision, dtype) in precisions {
            let model = load(&dir, precision);
            assert_eq!(model.lm.dtype(), dtype, "{}", dir.display());
            let mut manager = MultiAdapterManager::new(&model.lm.config, model.lm.device());
            manager.load_adapters(&dir.join("adapters")).unwrap();
            for (agent, key) in [(None, "base"), (Some(0), "agent_0"), (Some(1), "agent_1")] {
                let cases = f32_ref[key].as_array().unwrap().iter().zip(bf16_ref[key].as_array().unwrap());
                for (case, theirs) in cases {
                    let ids_ = ids(&case["input_ids"]);
                    assert_eq!(ids_, ids(&theirs["input_ids"]));
                    let got = score(&model, &manager, agent, &ids_);
                    let (want, theirs) = (floats(&case["logprobs"]), floats(&theirs["logprobs"]));
                    let what = format!("{} {key} {precision:?}", dir.display());
                    assert!(got.iter().all(|v| v.is_finite() && *v <= 0.0), "{what}: {got:?}");
                    if precision == Precision::Bf16 {
                        bf16_vs_f32 = bf16_vs_f32.max(max_abs_diff(&got, &want));
                        bf16_vs_theirs = bf16_vs_theirs.max(max_abs_diff(&got, &theirs));
                        theirs_vs_f32 = theirs_vs_f32.max(max_abs_diff(&theirs, &want));
                    } else {
                        f16_vs_f32 = f16_vs_f32.max(max_abs_diff(&got, &want));
                    }
                }
            }
        }
    }
    eprintln!("max |log-prob| differences: troupe f16 vs transformers f32 {f16_vs_f32:.2e}");
    if bf16 {
        eprintln!(
            "max |log-prob| differences: troupe bf16 vs transformers f32 {bf16_vs_f32:.2e}, vs transformers bf16 \
             {bf16_vs_theirs:.2e} (transformers bf16 vs f32 {theirs_vs_f32:.2e})"
        );
    }
    assert!(f16_vs_f32 < tolerance(F16_VS_F32), "f16 vs f32: {f16_vs_f32}");
    // Reduced precision changes the numbers (the test would pass vacuously on an f32 base).
    assert!(f16_vs_f32 > 1e-4, "{f16_vs_f32}");
    if bf16 {
        assert!(bf16_vs_f32 < tolerance(BF16_VS_F32), "bf16 vs f32: {bf16_vs_f32}");
        assert!(bf16_vs_theirs < tolerance(BF16_VS_TRANSFORMERS_BF16), "bf16 vs transformers bf16: {bf16_vs_theirs}");
        assert!(bf16_vs_f32 > 1e-3, "{bf16_vs_f32}");
    }
}

#[test]
fn auto_is_f32_on_the_cpu_and_the_base_in_bf16_takes_half_the_memory_with_the_same_fingerprint() {
    let dir = models_dir().join("tiny-llama");
    let cpu = burn::tensor::Device::flex();
    let auto = Model::load(&LoadOptions::path(&dir), &cpu).unwrap();
    assert_eq!(auto.lm.dtype(), DType::F32);
    let bf16 = Model::load(&LoadOptions::path(&dir).dtype(Precision::Bf16), &cpu).unwrap();
    assert_eq!(bf16.lm.dtype(), DType::BF16);
    // Norms stay in f32: a little more than half.
    let (full, half) = (auto.lm.weight_bytes(), bf16.lm.weight_bytes());
    assert!(half < full / 2 + full / 50, "{half} of {full}");
    assert_eq!(
        troupe::model::fingerprint::base_fingerprint(&auto.lm),
        troupe::model::fingerprint::base_fingerprint(&bf16.lm),
        "adapters move between the f32 and the bf16 base without a warning"
    );
    let err = Model::load(&LoadOptions::path(&dir).dtype(Precision::Bf16).quantized(true), &cpu).unwrap_err();
    assert!(err.to_string().contains("model.dtype"), "{err}");
}

/// On the device of `TROUPE_TEST_DEVICE`, an f32 base's fingerprint, taken from its files (a GPU
/// reads nothing back at load), is the CPU's, read from the weights it holds: adapters trained
/// on either move to the other without a warning. On the CPU it compares the CPU with itself.
#[test]
fn an_f32_base_has_the_same_fingerprint_on_the_test_device_as_on_the_cpu() {
    let dir = models_dir().join("tiny-qwen3");
    let options = LoadOptions::path(&dir).dtype(Precision::F32);
    let here = Model::load(&options, &test_device()).unwrap();
    let cpu = Model::load(&options, &burn::tensor::Device::flex()).unwrap();
    assert_eq!(
        troupe::model::fingerprint::base_fingerprint(&here.lm),
        troupe::model::fingerprint::base_fingerprint(&cpu.lm)
    );
}

/// Two MAGRPO iterations of 2-player Hanabi on the model in `model_dir` held in bf16.
fn bf16_run(out_dir: &Path, model_dir: &Path) -> TrainingRun {
    let yaml = format!(
        "run: {{out_dir: {out}, seed: 3, iterations: 2, checkpoint_every: 2}}\n\
         model: {{path: {model}, dtype: bf16}}\n\
         env: {{name: hanabi, players: 2, history_moves: 1}}\n\
         adapter: {{r: 4, lora_alpha: 8.0}}\n\
         action: {{mode: free, max_new_tokens: 4, chat_template: false}}\n\
         training: {{group_size: 2, groups_per_iteration: 1, lr: 5.0e-2, warmup_iterations: 0, max_episode_steps: 3}}\n",
        out = out_dir.display(),
        model = model_dir.display(),
    );
    let registry = Registry::with_builtins();
    let config = TrainConfig::from_yaml_str(&yaml, Path::new("test.yaml"), &[], &registry).unwrap();
    TrainingRun::start(config, Path::new("test.yaml"), registry, &test_device()).unwrap()
}

#[test]
fn adapters_trained_on_a_bf16_base_save_as_peft_in_f32_and_reload_on_an_f32_base() {
    if !bf16_on_test_device() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // tiny-qwen2 with a context long enough for Hanabi's prompts (its weights unchanged: RoPE
    // extends to any position).
    let model_dir = tmp.path().join("tiny-qwen2");
    std::fs::create_dir(&model_dir).unwrap();
    for entry in std::fs::read_dir(models_dir().join("tiny-qwen2")).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, model_dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    let config_path = model_dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["max_position_embeddings"] = serde_json::json!(4096);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let out = tmp.path().join("run");
    let mut run = bf16_run(&out, &model_dir);
    while !run.finished() {
        run.run_iteration().unwrap();
    }
    drop(run);
    let adapters = checkpoint_dir(&out, 2).join("adapters");

    // PEFT's layout, its tensors in f32 (as PEFT saves them), B trained away from zero.
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapters.join("troupe.json")).unwrap()).unwrap();
    let f32_base = load(&model_dir, Precision::F32);
    assert_eq!(
        manifest["base_fingerprint"].as_str(),
        Some(troupe::model::fingerprint::base_fingerprint(&f32_base.lm).as_str()),
        "the bf16 base records its f32 weights' fingerprint"
    );
    let bytes = std::fs::read(adapters.join("agent_0").join("adapter_model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut trained = false;
    for (name, view) in tensors.tensors() {
        assert!(name.starts_with("base_model.model.model.layers."), "{name}");
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
        if name.contains("lora_B") {
            trained |= view.data().chunks(4).any(|b| f32::from_le_bytes(b.try_into().unwrap()) != 0.0);
        }
    }
    assert!(trained, "two iterations moved some lora_B off zero");

    // The same adapters on the f32 base and on the bf16 base: within the bf16 tolerance, and
    // changing the base's outputs.
    let bf16_base = load(&model_dir, Precision::Bf16);
    let manager = |model: &Model| {
        let mut manager = MultiAdapterManager::new(&model.lm.config, model.lm.device());
        manager.load_adapters(&adapters).unwrap();
        manager
    };
    let (on_f32, on_bf16) = (manager(&f32_base), manager(&bf16_base));
    let mut worst = 0f32;
    let mut moved = 0f32;
    for case in expected(&models_dir().join("tiny-qwen2"))["base"].as_array().unwrap() {
        let ids_ = ids(&case["input_ids"]);
        for agent in 0..2 {
            let f32_scores = score(&f32_base, &on_f32, Some(agent), &ids_);
            worst = worst.max(max_abs_diff(&f32_scores, &score(&bf16_base, &on_bf16, Some(agent), &ids_)));
            moved = moved.max(max_abs_diff(&f32_scores, &score(&f32_base, &on_f32, None, &ids_)));
        }
    }
    eprintln!("bf16-trained adapters, f32 base vs bf16 base: {worst:.2e}; adapter vs bare base: {moved:.2e}");
    assert!(worst < tolerance(BF16_VS_F32), "{worst}");
    assert!(moved > 1e-5, "the trained adapters change the outputs: {moved}");
}

/// `fixtures/bf16-trained`: two adapters troupe trained on tiny-qwen2 held in bf16 (Hanabi,
/// `tools/peft_check.py`), saved in PEFT's layout, and PEFT's log-probs with them loaded by
/// `PeftModel.from_pretrained` on the transformers model in float32 and in bfloat16. Read from
/// this repository (not `TROUPE_FIXTURES`): the base's weights are the same in any regeneration.
#[test]
fn adapters_trained_in_bf16_match_peft_on_the_f32_and_the_bf16_model() {
    if !bf16_on_test_device() {
        return;
    }
    let dir = repo_dir().join("fixtures/bf16-trained");
    let peft: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let model_dir = models_dir().join("tiny-qwen2");
    let (mut f32_vs_f32, mut bf16_vs_f32, mut bf16_vs_bf16, mut moved) = (0f32, 0f32, 0f32, 0f32);
    for precision in [Precision::F32, Precision::Bf16] {
        let model = load(&model_dir, precision);
        let mut manager = MultiAdapterManager::new(&model.lm.config, model.lm.device());
        manager.load_adapters(&dir.join("adapters")).unwrap();
        for (agent, key) in [(0, "agent_0"), (1, "agent_1")] {
            let cases =
                peft["peft_f32"][key].as_array().unwrap().iter().zip(peft["peft_bf16"][key].as_array().unwrap());
            for (i, (theirs_f32, theirs_bf16)) in cases.enumerate() {
                let ids_ = ids(&theirs_f32["input_ids"]);
                assert_eq!(ids_, ids(&theirs_bf16["input_ids"]));
                let got = score(&model, &manager, Some(agent), &ids_);
                let (want_f32, want_bf16) = (floats(&theirs_f32["logprobs"]), floats(&theirs_bf16["logprobs"]));
                assert!(got.iter().all(|v| v.is_finite() && *v <= 0.0), "{key} {precision:?}: {got:?}");
                if precision == Precision::F32 {
                    f32_vs_f32 = f32_vs_f32.max(max_abs_diff(&got, &want_f32));
                    let base = floats(&peft["peft_f32"]["base"][i]["logprobs"]);
                    moved = moved.max(max_abs_diff(&want_f32, &base));
                } else {
                    bf16_vs_f32 = bf16_vs_f32.max(max_abs_diff(&got, &want_f32));
                    bf16_vs_bf16 = bf16_vs_bf16.max(max_abs_diff(&got, &want_bf16));
                }
            }
        }
    }
    eprintln!(
        "bf16-trained adapters against PEFT: troupe f32 vs PEFT f32 {f32_vs_f32:.2e}, troupe bf16 vs PEFT f32 \
         {bf16_vs_f32:.2e}, troupe bf16 vs PEFT on the bf16 model {bf16_vs_bf16:.2e}; adapters vs bare base {moved:.2e}"
    );
    assert!(f32_vs_f32 < tolerance(1e-3), "f32: {f32_vs_f32}");
    assert!(bf16_vs_f32 < tolerance(BF16_VS_F32), "bf16 vs PEFT f32: {bf16_vs_f32}");
    assert!(bf16_vs_bf16 < tolerance(BF16_VS_TRANSFORMERS_BF16), "bf16 vs PEFT bf16: {bf16_vs_bf16}");
    assert!(moved > 1e-2, "the trained adapters change PEFT's outputs: {moved}");
}
