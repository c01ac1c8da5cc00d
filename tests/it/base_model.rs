//! The frozen base against Hugging Face transformers: every fixture model's log-probs, last
//! position top-5 and greedy continuation must match `expected.json` (made by transformers 5.23).

use crate::common;

use common::*;
use troupe::generate::{generate, last_logits, score_rows, GenerateOptions, SamplingConfig};

#[test]
fn base_logprobs_top5_and_greedy_match_transformers() {
    for dir in fixture_models() {
        let model = common::load_f32(&dir);
        let expected = expected(&dir);
        for case in expected["base"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let input_ids = model.tokenizer.encode(text).unwrap();
            assert_eq!(input_ids, ids(&case["input_ids"]), "{}: tokens of {text:?}", dir.display());

            let logprobs = score_rows(&model.lm, std::slice::from_ref(&input_ids), None).unwrap().remove(0);
            let diff = max_abs_diff(&logprobs, &floats(&case["logprobs"]));
            eprintln!("{}: {text:?} max log-prob diff {diff:.2e}", dir.file_name().unwrap().to_string_lossy());
            assert!(diff < tolerance(1e-3), "{}: log-probs of {text:?} differ by {diff}", dir.display());

            let logits = last_logits(&model.lm, &input_ids, None).unwrap();
            let what = format!("{}: {text:?}", dir.display());
            assert_top_k(&logits, &ids(&case["last_top5_ids"]), &floats(&case["last_top5_logits"]), &what);
            let top5_logits: Vec<f32> = ids(&case["last_top5_ids"]).iter().map(|&i| logits[i as usize]).collect();
            assert!(max_abs_diff(&top5_logits, &floats(&case["last_top5_logits"])) < tolerance(1e-3));

            let options = GenerateOptions {
                max_new_tokens: 16,
                sampling: SamplingConfig::greedy(),
                stop_at_eos: false,
                ..GenerateOptions::default()
            };
            let out =
                generate(&model.lm, &model.tokenizer.eos_token_ids, std::slice::from_ref(&input_ids), &options, None)
                    .unwrap();
            let logits_after =
                |prefix: &[u32]| last_logits(&model.lm, &[&input_ids[..], prefix].concat(), None).unwrap();
            assert_greedy(&out[0].output_ids, &ids(&case["greedy_16"]), logits_after, &what);
        }
    }
}
