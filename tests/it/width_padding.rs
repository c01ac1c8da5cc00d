//! Rows padded past the longest row, to a multiple of the model's width step (what troupe does
//! on a GPU, so that batches of nearby lengths reuse compiled kernels), score, train, generate
//! and choose as rows padded only to the longest: the padding is masked.

use crate::common;

use troupe::adapters::MultiAdapterManager;
use troupe::generate::choice::{score_choices, ChoiceScore};
use troupe::generate::{generate_rows, GenerateOptions, SamplingConfig, ScoringBatch};
use troupe::model::{CausalLm, Model, ProjectionDelta};

/// The `tiny-qwen3` fixture padding to multiples of 1 (the longest row), 5 and 8 slots, with its
/// two PEFT adapters.
fn setup() -> (Vec<CausalLm>, MultiAdapterManager, Model) {
    let (model, manager) = common::tiny_qwen3_with_adapters();
    let models = [1, 5, 8].into_iter().map(|step| model.lm.clone().with_width_step(step)).collect();
    (models, manager, model)
}

fn encode(model: &Model, text: &str) -> Vec<u32> {
    model.tokenizer.encode(text).unwrap()
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
        let rows = common::prompted_rows(&model, &prompts, &replies);
        let longest = rows.iter().map(Vec::len).max().unwrap();
        assert!(!longest.is_multiple_of(8) && !longest.is_multiple_of(5), "{longest}: the steps pad");
        let from: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let weights = [1.0, -0.5, 2.0, 0.75, -1.5];
        let weights = &weights[..rows.len()];
        let (want, want_grads) = common::scored_replies(&models[0], &manager, &rows, &from, &agents, weights);
        for lm in &models[1..] {
            let batch = ScoringBatch::new(lm, &rows).unwrap();
            assert_eq!(batch.tokens.dims()[1], longest.next_multiple_of(lm.width_step()), "padded to the step");
            let (got, grads) = common::scored_replies(lm, &manager, &rows, &from, &agents, weights);
            for (row, (w, g)) in want.iter().zip(&got).enumerate() {
                let diff = common::max_abs_diff(w, g);
                assert!(
                    diff < common::tolerance(1e-5),
                    "step {}, row {row}: log-probs differ by {diff}",
                    lm.width_step()
                );
            }
            common::assert_same_adapter_grads(&want_grads, &grads, &format!("step {}", lm.width_step()));
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
