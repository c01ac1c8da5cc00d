//! Rows padded past the longest row, to a multiple of the model's width step (what troupe does
//! on a GPU, so that batches of nearby lengths reuse compiled kernels), score, train, generate
//! and choose as rows padded only to the longest: the padding is masked.

use crate::common;

use std::collections::BTreeMap;

use burn::tensor::{Tensor, TensorData};
use troupe::adapters::optim::{adapter_grads, AdapterGrads};
use troupe::adapters::MultiAdapterManager;
use troupe::generate::choice::{score_choices, ChoiceScore};
use troupe::generate::{completion_logprobs, generate_rows, GenerateOptions, SamplingConfig, ScoringBatch};
use troupe::model::{CausalLm, ProjectionDelta};

/// The `tiny-qwen3` fixture padding to multiples of 1 (the longest row), 5 and 8 slots, with its
/// two PEFT adapters.
fn setup() -> (Vec<CausalLm>, MultiAdapterManager, troupe::model::Model) {
    let device = common::test_device();
    let dir = common::models_dir().join("tiny-qwen3");
    let model = common::load_f32(&dir);
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.load_adapters(&dir.join("adapters")).unwrap();
    let models = [1, 5, 8].into_iter().map(|step| model.lm.clone().with_width_step(step)).collect();
    (models, manager, model)
}

fn encode(model: &troupe::model::Model, text: &str) -> Vec<u32> {
    model.tokenizer.encode(text).unwrap()
}

/// The rows' reply log-probs, and the gradients of `sum(weights[row] x logprobs)` per adapter.
fn scored(
    lm: &CausalLm,
    manager: &MultiAdapterManager,
    rows: &[Vec<u32>],
    from: &[usize],
    agents: &[Option<usize>],
    weights: &[f32],
) -> (Vec<f32>, BTreeMap<String, AdapterGrads>) {
    let (delta, used) = manager.mixed(agents, true).unwrap();
    let batch = ScoringBatch::new(lm, rows).unwrap();
    let longest = rows.iter().map(Vec::len).max().unwrap();
    assert_eq!(batch.tokens.dims()[1], longest.next_multiple_of(lm.width_step()), "padded to the step");
    let logprobs = completion_logprobs(lm, &batch, from, Some(&delta)).unwrap();
    let [n, width] = logprobs.dims();
    assert_eq!(width, rows.iter().zip(from).map(|(r, f)| r.len() - f).max().unwrap(), "cut to the longest reply");
    let values = logprobs.clone().into_data().try_into_vec::<f32>().unwrap();
    let weights = Tensor::<2>::from_data(
        TensorData::new(weights.iter().flat_map(|&w| vec![w; width]).collect::<Vec<_>>(), [n, width]),
        lm.device(),
    );
    let grads = (logprobs * weights).sum().backward();
    let grads =
        used.iter().filter_map(|(name, adapter)| adapter_grads(adapter, &grads).map(|g| (name.clone(), g))).collect();
    (values, grads)
}

/// The largest difference between two adapters' gradients, and the larger's scale.
fn grad_diff(a: &BTreeMap<String, AdapterGrads>, b: &BTreeMap<String, AdapterGrads>) -> (f32, f32) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let (mut diff, mut scale) = (0.0f32, 0.0f32);
    for (name, sites) in a {
        for (site, (ga, gb)) in sites {
            let (ha, hb) = &b[name][site];
            scale = scale.max(ga.clone().abs().max().into_scalar()).max(gb.clone().abs().max().into_scalar());
            diff = diff
                .max((ga.clone() - ha.clone()).abs().max().into_scalar())
                .max((gb.clone() - hb.clone()).abs().max().into_scalar());
        }
    }
    (diff, scale)
}

#[test]
fn padded_rows_score_and_train_as_rows_padded_to_the_longest() {
    let (models, manager, model) = setup();
    let p = encode(&model, "Player 1 hints red. What will you play?");
    let q = encode(&model, "North opens 1NT.");
    let replies = ["Play card 0.", "Discard card 3 now, then hint.", "Pass.", "Play card 2 please."];
    // Rows that share prompts (a GRPO group's: scored through the shared-prefix path), and rows
    // that share none (scored whole).
    for prompts in [vec![&p, &p, &q, &p, &q], vec![&p, &q]] {
        let agents: Vec<Option<usize>> = (0..prompts.len()).map(|i| Some(usize::from(i >= 2))).collect();
        let rows: Vec<Vec<u32>> = prompts
            .iter()
            .zip(replies.iter().cycle())
            .map(|(prompt, reply)| {
                let mut row = (*prompt).clone();
                row.extend(encode(&model, reply));
                row
            })
            .collect();
        let longest = rows.iter().map(Vec::len).max().unwrap();
        assert!(!longest.is_multiple_of(8) && !longest.is_multiple_of(5), "{longest}: the steps pad");
        let from: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let weights = [1.0, -0.5, 2.0, 0.75, -1.5];
        let weights = &weights[..rows.len()];
        let (want, want_grads) = scored(&models[0], &manager, &rows, &from, &agents, weights);
        for lm in &models[1..] {
            let (got, grads) = scored(lm, &manager, &rows, &from, &agents, weights);
            let diff = common::max_abs_diff(&want, &got);
            assert!(diff < common::tolerance(1e-5), "step {}: log-probs differ by {diff}", lm.width_step());
            let (diff, scale) = grad_diff(&want_grads, &grads);
            assert!(scale > 1e-4, "the gradient is not trivially zero");
            assert!(
                diff < common::tolerance(1e-5) * scale.max(1.0),
                "step {}: gradients differ by {diff} (scale {scale})",
                lm.width_step()
            );
        }
    }
}

#[test]
fn padded_prompts_generate_what_prompts_padded_to_the_longest_generate() {
    let (models, manager, model) = setup();
    let (p, q) = (encode(&model, "Player 1 hints red. Play card 0 now."), encode(&model, "North opens 1NT."));
    assert!(!p.len().max(q.len()).is_multiple_of(8), "the step pads the prompts");
    let prompts = vec![p.clone(), p.clone(), q.clone(), p, q];
    let agents = [Some(0), Some(0), Some(1), Some(1), None];
    let seeds: Vec<u64> = (0..prompts.len() as u64).map(|s| 7 + s).collect();
    let (delta, _) = manager.mixed(&agents, false).unwrap();
    for sampling in [SamplingConfig::greedy(), SamplingConfig { temperature: 0.9, top_k: 0, top_p: 0.95 }] {
        let options = GenerateOptions { max_new_tokens: 8, sampling, seed: 0, stop_at_eos: false, use_cache: true };
        let generate = |lm: &CausalLm| {
            generate_rows(lm, &[], &prompts, &[], &options, &seeds, Some(&delta as &dyn ProjectionDelta)).unwrap()
        };
        let want = generate(&models[0]);
        for lm in &models[1..] {
            common::assert_same_generations(&want, &generate(lm), &format!("step {}", lm.width_step()));
        }
    }
}

#[test]
fn padded_packed_decisions_choose_as_decisions_packed_to_the_longest() {
    let (models, manager, model) = setup();
    let prompt = encode(&model, "Your move:");
    let other = encode(&model, "Player 2 discards. Your move:");
    let candidates: Vec<Vec<u32>> =
        ["Play card 0.", "Hint red.", "Discard card 4 at once."].iter().map(|c| encode(&model, c)).collect();
    let decisions: Vec<(&[u32], &[Vec<u32>])> =
        vec![(&prompt, &candidates[..]), (&other, &candidates[..2]), (&prompt, &candidates[1..])];
    let longest = decisions.iter().map(|(p, c)| p.len() + c.iter().map(Vec::len).sum::<usize>()).max().unwrap();
    assert!(!longest.is_multiple_of(8) && !longest.is_multiple_of(5), "{longest}: the steps pad");
    let (delta, _) = manager.mixed(&[Some(0), Some(1), None], false).unwrap();
    for score in [ChoiceScore::Sum, ChoiceScore::Mean] {
        let want = score_choices(&models[0], &decisions, score, Some(&delta)).unwrap();
        for lm in &models[1..] {
            let got = score_choices(lm, &decisions, score, Some(&delta)).unwrap();
            for (w, g) in want.iter().zip(&got) {
                let diff = common::max_abs_diff(w, g);
                assert!(diff < common::tolerance(1e-5), "step {}: log-likelihoods differ by {diff}", lm.width_step());
            }
        }
    }
}
