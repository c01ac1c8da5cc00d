//! `--adapter` on the model commands, `troupe adapters inspect` and `troupe adapters merge`,
//! run as a user runs them.

use crate::common;

use std::process::Command;

use troupe::model::safetensors_io::{StoredFloat, TensorStore};

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

/// The text the merged models are scored on.
const TEXT: &str = "North opens 1NT; East doubles; the contract is 3NT.";

/// The largest difference between the log-probs of [`TEXT`] under the merged model at `merged`
/// and under the base at `base` with the adapter `spec`.
fn merged_against_adapter(merged: &std::path::Path, base: &std::path::Path, spec: &str) -> f64 {
    let merged = json_stdout(&troupe(&["logprobs", "--model", merged.to_str().unwrap(), "--text", TEXT]));
    let with_adapter =
        json_stdout(&troupe(&["logprobs", "--model", base.to_str().unwrap(), "--adapter", spec, "--text", TEXT]));
    floats(&merged["logprobs"])
        .iter()
        .zip(floats(&with_adapter["logprobs"]))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
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
    let diff = merged_against_adapter(&out_dir, &dir, &spec);
    assert!(diff < 1e-4, "merged differs from base + adapter by {diff}");
    let base = json_stdout(&troupe(&["logprobs", "--model", dir.to_str().unwrap(), "--text", TEXT]));
    let merged = json_stdout(&troupe(&["logprobs", "--model", out_dir.to_str().unwrap(), "--text", TEXT]));
    assert_ne!(base["logprobs"], merged["logprobs"]);
}

/// `troupe adapters merge` of `agent_0` into `model` (a fixture's name), with `extra`
/// arguments; the merged directory.
fn merge_agent_0(model: &str, out: &std::path::Path, extra: &[&str]) -> std::path::PathBuf {
    let dir = common::models_dir().join(model);
    let spec = format!("{}:agent_0", dir.join("adapters").display());
    let out_dir = out.join(model);
    let args = ["adapters", "merge", "--model", dir.to_str().unwrap(), "--adapter", &spec, "--out"];
    let mut args: Vec<&str> = args.to_vec();
    args.push(out_dir.to_str().unwrap());
    args.extend_from_slice(extra);
    json_stdout(&troupe(&args));
    out_dir
}

fn open(path: &std::path::Path) -> TensorStore {
    TensorStore::open_files(&[path.to_path_buf()], path.to_path_buf()).unwrap()
}

/// The largest distance between two bf16 values in units in the last place (both given as the
/// f32 values they are).
fn bf16_ulps(a: f32, b: f32) -> u32 {
    let bits = |v: f32| {
        let bits = half::bf16::from_f32(v).to_bits() as i32;
        // Ordered as integers across zero: negative values count down from zero.
        if bits & 0x8000 != 0 {
            -(bits & 0x7fff)
        } else {
            bits
        }
    };
    bits(a).abs_diff(bits(b))
}

/// Every fixture's `agent_0` merged by troupe against PEFT's `merge_and_unload` on the model as
/// saved (fixtures/models/*/merged_agent_0.safetensors): each tensor kept in the base's type
/// (bf16 for tiny-qwen3, f32 for the others), the untouched tensors byte for byte the base's,
/// `config.json` unchanged. troupe rounds `W + scale * B A` once to the base's type, where PEFT
/// on the CPU rounds the delta to it and then the sum: in bf16 the two may differ by one unit
/// in the last place, allowed here in under 2% of the values; in f32 by 1e-6. On these fixtures
/// every value agrees exactly (about 95,000 a model).
#[test]
fn merged_weights_match_peft_in_the_bases_own_type() {
    let tmp = tempfile::tempdir().unwrap();
    for model in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        let base_dir = common::models_dir().join(model);
        let out = merge_agent_0(model, tmp.path(), &[]);
        let ours = open(&out.join("model.safetensors"));
        let base = open(&base_dir.join("model.safetensors"));
        let peft = open(&base_dir.join("merged_agent_0.safetensors"));
        assert_eq!(ours.names(), base.names(), "{model}");
        let (mut compared, mut off_by_one) = (0usize, 0usize);
        for name in ours.names() {
            assert_eq!(ours.stored_float(&name), base.stored_float(&name), "{model}: {name}");
            let got = ours.read(&name, None).unwrap().values;
            if !peft.contains(&name) {
                assert_eq!(got, base.read(&name, None).unwrap().values, "{model}: {name} is the base's");
                continue;
            }
            let expected = peft.read(&name, None).unwrap().values;
            assert_eq!(peft.stored_float(&name), base.stored_float(&name), "{model}: PEFT keeps {name}'s type");
            for (g, e) in got.iter().zip(&expected) {
                compared += 1;
                if base.stored_float(&name) == Some(StoredFloat::Bf16) {
                    let ulps = bf16_ulps(*g, *e);
                    assert!(ulps <= 1, "{model}: {name}: {g} against PEFT's {e}");
                    off_by_one += usize::from(ulps == 1);
                } else {
                    assert!((g - e).abs() <= 1e-6, "{model}: {name}: {g} against PEFT's {e}");
                }
            }
        }
        assert!(compared > 10_000, "{model}: {compared} merged values compared");
        assert!(off_by_one * 50 < compared, "{model}: {off_by_one} of {compared} values one bf16 unit off");
        let config = |dir: &std::path::Path| std::fs::read(dir.join("config.json")).unwrap();
        assert_eq!(config(&out), config(&base_dir), "{model}: config.json copied as it was");
    }
}

/// `--dtype` writes every tensor in the type asked for and names it in `config.json`, in the
/// key the file already has: tiny-qwen3's bf16 base merged into f32 (its `dtype` key) gives
/// PEFT's bf16 merge to within its rounding, and tiny-qwen2's 4.x-style config (`torch_dtype`)
/// merged into bf16 gets no second key.
#[test]
fn merged_weights_in_the_dtype_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let out = merge_agent_0("tiny-qwen3", tmp.path(), &["--dtype", "f32"]);
    let ours = open(&out.join("model.safetensors"));
    let peft = open(&common::models_dir().join("tiny-qwen3/merged_agent_0.safetensors"));
    for name in ours.names() {
        assert_eq!(ours.stored_float(&name), Some(StoredFloat::F32), "{name}");
    }
    for name in peft.names() {
        let got = ours.read(&name, None).unwrap().values;
        for (g, e) in got.iter().zip(peft.read(&name, None).unwrap().values) {
            assert!(bf16_ulps(*g, e) <= 1, "{name}: {g} against PEFT's {e}");
        }
    }
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["dtype"], "float32");

    let out = merge_agent_0("tiny-qwen2", tmp.path(), &["--dtype", "bf16"]);
    let ours = open(&out.join("model.safetensors"));
    for name in ours.names() {
        assert_eq!(ours.stored_float(&name), Some(StoredFloat::Bf16), "{name}");
    }
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert!(config.get("dtype").is_none(), "{config}");
    // The bf16 merge loads and scores like the f32 base with the adapter, to bf16's precision
    // (0.073 nats apart at most on this text: the fixture's weights are large, std 0.15).
    let dir = common::models_dir().join("tiny-qwen2");
    let diff = merged_against_adapter(&out, &dir, &format!("{}:agent_0", dir.join("adapters").display()));
    assert!(diff < 0.1, "the bf16 merge differs from base + adapter by {diff}");
}

/// A base that lacks a projection the adapter targets is refused with the tensor's name before
/// anything is written: no `--out`, no staging directory beside it.
#[test]
fn a_base_without_a_targeted_projection_is_refused_before_writing() {
    let err = failed_merge_of_edited_llama(&[], |tensors| {
        tensors.remove("model.layers.1.mlp.down_proj.weight").unwrap();
    });
    assert!(err.contains("model.layers.1.mlp.down_proj.weight"), "{err}");
}

/// A merged weight f16 cannot hold is refused (not written as an infinity), naming the tensor,
/// and nothing is left behind.
#[test]
fn a_weight_beyond_f16_is_refused_when_merging_into_f16() {
    let err = failed_merge_of_edited_llama(&["--dtype", "f16"], |tensors| {
        tensors.get_mut("model.norm.weight").unwrap().values[3] = 1e5;
    });
    assert!(err.contains("--dtype") && err.contains("model.norm.weight") && err.contains("65504"), "{err}");
}

/// Merges tiny-llama's `agent_0` into a copy of tiny-llama edited by `edit`, expecting a
/// failure that leaves nothing in the output's parent directory; the error.
fn failed_merge_of_edited_llama(
    extra: &[&str],
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, troupe::model::safetensors_io::HostTensor>),
) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    std::fs::create_dir(&base).unwrap();
    let fixture = common::models_dir().join("tiny-llama");
    for file in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture.join(file), base.join(file)).unwrap();
    }
    common::edit_safetensors(&base.join("model.safetensors"), edit);
    let spec = format!("{}:agent_0", fixture.join("adapters").display());
    let out = tmp.path().join("out").join("merged");
    std::fs::create_dir(out.parent().unwrap()).unwrap();
    let mut args = vec!["adapters", "merge", "--model", base.to_str().unwrap(), "--adapter", &spec];
    args.extend(["--out", out.to_str().unwrap()]);
    args.extend_from_slice(extra);
    let run = troupe(&args);
    assert!(!run.status.success());
    assert_eq!(std::fs::read_dir(out.parent().unwrap()).unwrap().count(), 0, "nothing written");
    common::stderr(&run)
}
