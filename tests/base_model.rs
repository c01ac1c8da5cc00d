//! The frozen base against Hugging Face transformers: every fixture model's log-probs, last
//! position top-5 and greedy continuation must match `expected.json` (made by transformers 5.23).

mod common;

use burn::tensor::Device;
use common::*;
use troupe::generate::{generate, last_logits, score_rows, GenerateOptions, SamplingConfig};
use troupe::model::Model;

#[test]
fn base_logprobs_top5_and_greedy_match_transformers() {
    let device = Device::flex();
    for dir in fixture_models() {
        let model = Model::from_dir(&dir, &device).unwrap();
        let expected = expected(&dir);
        for case in expected["base"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let input_ids = model.tokenizer.encode(text).unwrap();
            assert_eq!(input_ids, ids(&case["input_ids"]), "{}: tokens of {text:?}", dir.display());

            let logprobs = score_rows(&model.lm, std::slice::from_ref(&input_ids), None).unwrap().remove(0);
            let diff = max_abs_diff(&logprobs, &floats(&case["logprobs"]));
            eprintln!("{}: {text:?} max log-prob diff {diff:.2e}", dir.file_name().unwrap().to_string_lossy());
            assert!(diff < 1e-3, "{}: log-probs of {text:?} differ by {diff}", dir.display());

            let logits = last_logits(&model.lm, &input_ids, None).unwrap();
            assert_eq!(top_k_ids(&logits, 5), ids(&case["last_top5_ids"]), "{}: top-5 of {text:?}", dir.display());
            let top5_logits: Vec<f32> = ids(&case["last_top5_ids"]).iter().map(|&i| logits[i as usize]).collect();
            assert!(max_abs_diff(&top5_logits, &floats(&case["last_top5_logits"])) < 1e-3);

            let options = GenerateOptions {
                max_new_tokens: 16,
                sampling: SamplingConfig::greedy(),
                stop_at_eos: false,
                ..GenerateOptions::default()
            };
            let out = generate(&model.lm, &model.tokenizer.eos_token_ids, &[input_ids], &options, None).unwrap();
            assert_eq!(out[0].output_ids, ids(&case["greedy_16"]), "{}: greedy of {text:?}", dir.display());
        }
    }
}
