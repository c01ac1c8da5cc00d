//! GGUF files against references troupe did not write (`fixtures/gguf/`, made by
//! `fixtures/gguf/make_fixtures.py`): every block format bit-for-bit against
//! `gguf.quants.dequantize`, and the tiny models' tokens, log-probs, top-5, greedy continuation,
//! configuration and chat template against transformers' GGUF loader. Bad files give one clear
//! error each.

use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use gguf_rs_lib::prelude::{GGUFBuilder, GGUFTensorType, MetadataValue};
use troupe::generate::{generate, last_logits, score_rows, GenerateOptions, SamplingConfig};
use troupe::model::gguf::dequant::dequantize;
use troupe::model::gguf::GgufFile;
use troupe::model::safetensors_io::TensorStore;
use troupe::model::{ChatMessage, Model};

fn gguf_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/gguf"))
}

fn expected_of(file: &str) -> serde_json::Value {
    let path = gguf_dir().join(file.replace(".gguf", ".expected.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn every_block_format_dequantizes_bit_for_bit_like_gguf_py() {
    let file = GgufFile::open(&gguf_dir().join("dequant.gguf")).unwrap();
    let reference_path = gguf_dir().join("dequant.safetensors");
    let reference = TensorStore::open_files(std::slice::from_ref(&reference_path), reference_path.clone()).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for entry in file.tensors() {
        let bytes = file.tensor_bytes(&entry.name).unwrap();
        let mut values = vec![0.0f32; entry.len()];
        dequantize(entry.ggml_type, &bytes, &mut values);
        let expected = reference.read(&entry.name, Some(&entry.shape)).unwrap();
        let mismatches = values.iter().zip(&expected.values).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(mismatches, 0, "{}: {mismatches} values differ from gguf.quants.dequantize", entry.name);
        seen.insert(entry.ggml_type.name());
    }
    assert_eq!(seen.len(), 11, "the fixture covers every type troupe reads: {seen:?}");
}

fn greedy(model: &Model, ids: &[u32], tokens: usize, stop_at_eos: bool) -> Vec<u32> {
    let options = GenerateOptions {
        max_new_tokens: tokens,
        sampling: SamplingConfig::greedy(),
        stop_at_eos,
        ..GenerateOptions::default()
    };
    generate(&model.lm, &model.tokenizer.eos_token_ids, &[ids.to_vec()], &options, None).unwrap().remove(0).output_ids
}

/// Checks a loaded GGUF model against its `expected.json`; returns the largest log-prob gap.
fn check_against_transformers(model: &Model, expected: &serde_json::Value, tolerance: f32) -> f32 {
    let name = expected["file"].as_str().unwrap();
    let config = &expected["config"];
    let ours = &model.lm.config;
    assert_eq!(ours.model_type.as_str(), config["model_type"].as_str().unwrap(), "{name}");
    for (field, value) in [
        ("vocab_size", ours.vocab_size),
        ("hidden_size", ours.hidden_size),
        ("intermediate_size", ours.intermediate_size),
        ("num_hidden_layers", ours.num_hidden_layers),
        ("num_attention_heads", ours.num_attention_heads),
        ("num_key_value_heads", ours.num_key_value_heads),
        ("head_dim", ours.head_dim),
        ("max_position_embeddings", ours.max_position_embeddings),
        ("parameters", ours.num_parameters()),
    ] {
        assert_eq!(value as u64, config[field].as_u64().unwrap(), "{name}: {field}");
    }
    assert_eq!(ours.rms_norm_eps, config["rms_norm_eps"].as_f64().unwrap(), "{name}: rms_norm_eps");
    assert_eq!(ours.rope_theta, config["rope_theta"].as_f64().unwrap(), "{name}: rope_theta");
    assert_eq!(ours.tie_word_embeddings, config["tie_word_embeddings"].as_bool().unwrap(), "{name}");
    assert_eq!(model.tokenizer.eos_token_ids, vec![expected["eos_token_id"].as_u64().unwrap() as u32], "{name}");

    let chat = &expected["chat"];
    let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
    let rendered = model.tokenizer.apply_chat_template(&messages, true).unwrap().expect("a chat template");
    assert_eq!(rendered, chat["rendered"].as_str().unwrap(), "{name}: chat template");

    let mut worst = 0.0f32;
    for case in expected["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = model.tokenizer.encode(text).unwrap();
        assert_eq!(ids, common::ids(&case["input_ids"]), "{name}: tokens of {text:?}");
        let logprobs = score_rows(&model.lm, std::slice::from_ref(&ids), None).unwrap().remove(0);
        let diff = max_abs_diff(&logprobs, &floats(&case["logprobs"]));
        eprintln!("{name}: {text:?} max log-prob diff {diff:.2e}");
        assert!(diff < tolerance, "{name}: log-probs of {text:?} differ by {diff}");
        worst = worst.max(diff);
        let logits = last_logits(&model.lm, &ids, None).unwrap();
        let what = format!("{name}: {text:?}");
        assert_top_k(&logits, &common::ids(&case["last_top5_ids"]), &floats(&case["last_top5_logits"]), &what);
        let expected_greedy = common::ids(&case["greedy"]);
        let stop = expected["greedy_stops_at_eos"].as_bool().unwrap();
        let logits_after = |prefix: &[u32]| last_logits(&model.lm, &[&ids[..], prefix].concat(), None).unwrap();
        assert_greedy(&greedy(model, &ids, expected_greedy.len(), stop), &expected_greedy, logits_after, &what);
    }
    worst
}

#[test]
fn tiny_gguf_models_match_transformers_gguf_loader() {
    for file in ["tiny-llama.gguf", "tiny-qwen2.gguf", "tiny-qwen3.gguf", "kquants-llama.gguf"] {
        let model = common::load_f32(&gguf_dir().join(file));
        check_against_transformers(&model, &expected_of(file), common::tolerance(1e-4));
    }
}

/// Rewrites a GGUF file through `gguf-rs-lib`'s builder, with metadata and tensors edited.
fn rewrite(
    src: &Path,
    dst: &Path,
    edit_metadata: impl Fn(&str, MetadataValue) -> Option<MetadataValue>,
    edit_tensor: impl Fn(&str, Vec<u64>, GGUFTensorType, Vec<u8>) -> (Vec<u64>, GGUFTensorType, Vec<u8>),
) {
    let file = GgufFile::open(src).unwrap();
    let mut builder = GGUFBuilder::new();
    for key in file.keys() {
        if let Some(value) = edit_metadata(&key, file.value(&key).unwrap().clone()) {
            builder = builder.add_metadata(key, value);
        }
    }
    for entry in file.tensors() {
        let dims: Vec<u64> = entry.shape.iter().rev().map(|&d| d as u64).collect();
        let ty = GGUFTensorType::from_u32(entry.ggml_type.ggml_id()).unwrap();
        let (dims, ty, bytes) = edit_tensor(&entry.name, dims, ty, file.tensor_bytes(&entry.name).unwrap());
        builder = builder.add_tensor(entry.name.clone(), dims, ty, bytes).unwrap();
    }
    builder.build_to_file(dst).unwrap();
}

fn load_error(path: &Path) -> String {
    let err = Model::from_path(path, &common::test_device()).expect_err("loading must fail").to_string();
    assert!(!err.contains('\n'), "one line: {err}");
    err
}

#[test]
fn bad_gguf_files_give_one_clear_error_each() {
    let tmp = tempfile::tempdir().unwrap();
    let src = gguf_dir().join("tiny-qwen2.gguf");
    let keep = |_: &str, v: MetadataValue| Some(v);
    let same = |_: &str, d: Vec<u64>, t: GGUFTensorType, b: Vec<u8>| (d, t, b);

    // The rewrite itself loads (the builder writes what troupe reads).
    let copy = tmp.path().join("copy.gguf");
    rewrite(&src, &copy, keep, same);
    Model::from_path(&copy, &common::test_device()).unwrap();

    // Truncated: in the metadata, and in the tensor data.
    let bytes = std::fs::read(&src).unwrap();
    for (cut, what) in [(1000, "metadata"), (bytes.len() - 100, "tensor data")] {
        let path = tmp.path().join(format!("cut-{cut}.gguf"));
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = load_error(&path);
        assert!(err.contains(&format!("cut-{cut}.gguf")) && err.contains("truncated"), "{what}: {err}");
    }
    let path = tmp.path().join("empty.gguf");
    std::fs::write(&path, b"").unwrap();
    assert!(load_error(&path).contains("empty.gguf"));

    // An architecture troupe does not implement.
    let path = tmp.path().join("arch.gguf");
    rewrite(
        &src,
        &path,
        |k, v| Some(if k == "general.architecture" { MetadataValue::String("gpt2".into()) } else { v }),
        same,
    );
    let err = load_error(&path);
    assert!(err.contains("general.architecture") && err.contains("\"gpt2\" is not supported"), "{err}");

    // A tensor type troupe does not read (IQ4_NL: 32 values in 18 bytes).
    let path = tmp.path().join("type.gguf");
    rewrite(&src, &path, keep, |name, d, t, b| {
        if name == "blk.1.attn_k.weight" {
            let blocks = (d.iter().product::<u64>() / 32) as usize;
            (d, GGUFTensorType::IQ4_NL, vec![0u8; blocks * 18])
        } else {
            (d, t, b)
        }
    });
    let err = load_error(&path);
    assert!(err.contains("`blk.1.attn_k.weight` has type IQ4_NL"), "{err}");

    // A SentencePiece tokenizer.
    let path = tmp.path().join("spm.gguf");
    rewrite(
        &src,
        &path,
        |k, v| Some(if k == "tokenizer.ggml.model" { MetadataValue::String("llama".into()) } else { v }),
        same,
    );
    let err = load_error(&path);
    assert!(err.contains("tokenizer.ggml.model \"llama\" is not supported"), "{err}");

    // Metadata that disagrees with the tensors' shapes.
    let path = tmp.path().join("shape.gguf");
    rewrite(&src, &path, |k, v| Some(if k == "qwen2.feed_forward_length" { MetadataValue::U32(192) } else { v }), same);
    let err = load_error(&path);
    assert!(
        err.contains("shape.gguf") && err.contains("blk.0.ffn_gate.weight") && err.contains("expected [192, 64]"),
        "{err}"
    );

    // A required key missing, and one of the wrong type.
    let path = tmp.path().join("missing.gguf");
    rewrite(&src, &path, |k, v| (k != "qwen2.block_count").then_some(v), same);
    let err = load_error(&path);
    assert!(err.contains("`qwen2.block_count` is missing"), "{err}");
    let path = tmp.path().join("wrongtype.gguf");
    rewrite(
        &src,
        &path,
        |k, v| Some(if k == "qwen2.embedding_length" { MetadataValue::String("64".into()) } else { v }),
        same,
    );
    let err = load_error(&path);
    assert!(err.contains("`qwen2.embedding_length` should be a non-negative integer"), "{err}");

    // Not a GGUF file at all, but named like one.
    let path = tmp.path().join("text.gguf");
    std::fs::write(&path, "hello, this is not a model").unwrap();
    let err = load_error(&path);
    assert!(err.contains("text.gguf") && err.contains("not a GGUF file"), "{err}");
}
