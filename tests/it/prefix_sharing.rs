//! Shared prompts: rows that start with the same tokens on the same adapter compute that prefix
//! once (a GRPO group's prompt), in generation and in scoring, and get what each row gets alone:
//! the same sampled tokens and log-probs, the same reply log-probs, the same adapter gradients.

use crate::common;

use std::collections::BTreeMap;

use troupe::adapters::optim::AdapterGrads;
use troupe::adapters::MultiAdapterManager;
use troupe::generate::prefix::SharedPrefixes;
use troupe::generate::{completion_logprobs, generate_rows, GenerateOptions, SamplingConfig, ScoringBatch};
use troupe::model::{Model, ProjectionDelta, PromptCache};

fn setup() -> (Model, MultiAdapterManager) {
    common::tiny_qwen3_with_adapters()
}

fn encode(model: &Model, text: &str) -> Vec<u32> {
    model.tokenizer.encode(text).unwrap()
}

#[test]
fn rows_sharing_a_prompt_generate_what_each_generates_alone() {
    let (model, manager) = setup();
    let (p, q) = (encode(&model, "Player 1 hints red. Play card 0."), encode(&model, "North opens 1NT."));
    assert_ne!(p.len(), q.len(), "prompts of different lengths: the batch is left-padded");
    let prompts = vec![p.clone(), p.clone(), q.clone(), p.clone(), q.clone(), p];
    let agents = [Some(0), Some(0), Some(1), Some(1), Some(1), None];
    let seeds: Vec<u64> = (0..prompts.len() as u64).map(|s| 100 + s).collect();
    let (delta, _) = manager.mixed(&agents, false).unwrap();
    let views: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let share = SharedPrefixes::find(&views, Some(&delta as &dyn ProjectionDelta)).expect("rows share prompts");
    // (agent 0, p), (agent 1, q), (agent 1, p), (no adapter, p): a prompt is shared only on one adapter.
    assert_eq!(share.unique, vec![0, 2, 3, 5]);
    assert_eq!(share.group_of_row, vec![0, 0, 1, 2, 1, 3]);
    // The prompts held once per group, or copied to every row: the same either way.
    let choices = [PromptCache::Copied, PromptCache::Shared];
    let samplings = [SamplingConfig::greedy(), SamplingConfig { temperature: 0.9, top_k: 0, top_p: 0.95 }];
    for (choice, sampling) in choices.into_iter().flat_map(|c| samplings.iter().map(move |s| (c, s.clone()))) {
        let mut model = model.clone();
        model.lm.set_prompt_cache(choice);
        let options = GenerateOptions { max_new_tokens: 8, sampling, seed: 0, stop_at_eos: false, use_cache: true };
        let batched =
            generate_rows(&model.lm, &[], &prompts, &[], &options, &seeds, Some(&delta as &dyn ProjectionDelta))
                .unwrap();
        for (row, generated) in batched.iter().enumerate() {
            let (own, _) = manager.mixed(&agents[row..=row], false).unwrap();
            let alone = generate_rows(
                &model.lm,
                &[],
                &prompts[row..=row],
                &[],
                &options,
                &seeds[row..=row],
                Some(&own as &dyn ProjectionDelta),
            )
            .unwrap();
            let what = format!("{}: row {row}", choice.name());
            common::assert_same_generations(&alone, std::slice::from_ref(generated), &what);
        }
        // Rows sharing a prompt and adapter but not a seed still sample their own replies.
        if !options.sampling.is_greedy() {
            assert_ne!(batched[0].output_ids, batched[1].output_ids);
        }
    }
}

/// A rollout's shape: groups of replies to one prompt, side by side, on two agents' adapters,
/// sampled past the cache's first reserved room (it grows): the prompts held once per group
/// decode what their copies decode.
#[test]
fn a_cache_holding_each_groups_prompt_once_decodes_what_copies_decode() {
    let (model, manager) = setup();
    let (p, q) = (encode(&model, "Player 1 hints red. Play card 0."), encode(&model, "North opens 1NT."));
    let mut prompts = Vec::new();
    let mut agents = Vec::new();
    for (prompt, agent) in [(&p, 0), (&q, 1), (&q, 0)] {
        prompts.extend(std::iter::repeat_n(prompt.clone(), 4));
        agents.extend(std::iter::repeat_n(Some(agent), 4));
    }
    let seeds: Vec<u64> = (0..prompts.len() as u64).map(|s| 7 + s).collect();
    let (delta, _) = manager.mixed(&agents, false).unwrap();
    let sampling = SamplingConfig { temperature: 0.9, top_k: 0, top_p: 0.95 };
    let options = GenerateOptions { max_new_tokens: 140, sampling, seed: 0, stop_at_eos: false, use_cache: true };
    let run = |choice: PromptCache| {
        let mut model = model.clone();
        model.lm.set_prompt_cache(choice);
        assert_eq!(model.lm.shares_prompts(), choice == PromptCache::Shared);
        generate_rows(&model.lm, &[], &prompts, &[], &options, &seeds, Some(&delta as &dyn ProjectionDelta)).unwrap()
    };
    let (copied, shared) = (run(PromptCache::Copied), run(PromptCache::Shared));
    assert!(copied.iter().all(|g| g.output_ids.len() == 140));
    common::assert_same_generations(&copied, &shared, "shared against copied prompts");
}

/// Scoring replies (the update's forward and backward): rows sharing a prompt on an adapter run
/// it once, and read its keys and values held once (`shared`, the GPU's default: one autodiff
/// node that recomputes its probabilities in the backward) or copied to each row (`copied`, the
/// CPU's), with prompts of two lengths and groups of uneven sizes: each row's log-probs, and the
/// adapters' gradients, are those of the rows scored alone.
#[test]
fn rows_sharing_a_prompt_score_and_train_as_each_row_alone() {
    let (model, manager) = setup();
    let p = encode(&model, "Player 1 hints red. What do you play?");
    let q = encode(&model, "North opens 1NT.");
    let replies = ["Play card 0.", "Discard card 3 now, then hint.", "Pass.", "Play card 2 please."];
    let prompts = [&p, &p, &q, &p, &q, &p];
    let agents = [Some(0), Some(0), Some(1), Some(1), Some(1), Some(0)];
    let rows = common::prompted_rows(&model, &prompts, &replies);
    let from: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let weights = [1.0, -0.5, 2.0, 0.75, -1.5, 0.5];
    for choice in [PromptCache::Copied, PromptCache::Shared] {
        let mut model = model.clone();
        model.lm.set_prompt_cache(choice);
        let (batched, grads) = common::scored_replies(&model.lm, &manager, &rows, &from, &agents, &weights);

        // The same without sharing: each row alone, gradients summed per adapter.
        let mut summed: BTreeMap<String, AdapterGrads> = BTreeMap::new();
        for row in 0..rows.len() {
            let (alone, own) = common::scored_replies(
                &model.lm,
                &manager,
                &rows[row..=row],
                &from[row..=row],
                &agents[row..=row],
                &weights[row..=row],
            );
            let diff = common::max_abs_diff(&alone[0], &batched[row]);
            assert!(
                diff < common::tolerance(1e-5),
                "{}, row {row}: shared-prefix log-probs differ from the row alone by {diff}",
                choice.name()
            );
            for (name, sites) in own {
                let total = summed.entry(name).or_default();
                for (site, (a, b)) in sites {
                    let entry = total.entry(site).or_insert_with(|| (a.zeros_like(), b.zeros_like()));
                    *entry = (entry.0.clone() + a, entry.1.clone() + b);
                }
            }
        }
        common::assert_same_adapter_grads(&grads, &summed, &format!("{}: shared prefixes", choice.name()));
    }
}

#[test]
fn reference_scoring_without_adapters_shares_prompts_too() {
    let (model, _) = setup();
    let p = encode(&model, "def main(xs):");
    let rows: Vec<Vec<u32>> = ["\n    return xs", "\n    pass", "  # todo"]
        .iter()
        .map(|reply| {
            let mut row = p.clone();
            row.extend(encode(&model, reply));
            row
        })
        .collect();
    let from = vec![p.len(); rows.len()];
    let views: Vec<&[u32]> = rows.iter().map(|r| &r[..p.len() - 1]).collect();
    assert!(SharedPrefixes::find(&views, None).is_some());
    let batch = ScoringBatch::new(&model.lm, &rows).unwrap();
    let shared = completion_logprobs(&model.lm, &batch, &from, None).unwrap();
    let width = shared.dims()[1];
    let shared = shared.into_data().try_into_vec::<f32>().unwrap();
    for (row, tokens) in rows.iter().enumerate() {
        let alone = ScoringBatch::new(&model.lm, std::slice::from_ref(tokens)).unwrap();
        let alone = completion_logprobs(&model.lm, &alone, &from[row..=row], None).unwrap();
        let alone = alone.into_data().try_into_vec::<f32>().unwrap();
        let n = tokens.len() - p.len();
        let diff = common::max_abs_diff(&alone[..n], &shared[row * width..row * width + n]);
        assert!(diff < common::tolerance(1e-5), "row {row}: {diff}");
    }
}

/// A cache holding two prompts once, its rows then picked again (a row dropped, the others
/// reordered): the next token's hidden states are those over each row's own copy picked alike.
#[test]
fn a_shared_prompt_cache_picks_rows_as_a_copied_one_does() {
    use troupe::model::{ForwardArgs, KvCache, SequenceLayout};
    let (model, _) = setup();
    let lm = &model.lm;
    let device = lm.device().clone();
    let layers = lm.config.num_hidden_layers;
    let (p, q) = (encode(&model, "Player 1 hints red."), encode(&model, "North opens 1NT, South passes."));
    let width = p.len().max(q.len());
    let left_padded = |row: &[u32]| {
        let mut tokens = vec![0; width - row.len()];
        tokens.extend_from_slice(row);
        let valid: Vec<bool> = (0..width).map(|i| i >= width - row.len()).collect();
        (tokens, valid)
    };
    let (prompts, prompt_valid): (Vec<Vec<u32>>, Vec<Vec<bool>>) = [&p, &q].iter().map(|r| left_padded(r)).unzip();
    let mut filled = KvCache::new(layers);
    let layout = SequenceLayout::new(2).step(&prompt_valid, &device);
    lm.fill_cache(
        lm.token_tensor(&prompts).unwrap(),
        ForwardArgs { layout: &layout, cache: Some(&mut filled), delta: None },
    )
    .unwrap();
    // Rows 0 and 2 on prompt p, row 1 on q; then rows 1, 2 (row 0 dropped: q's row first).
    let group_of_row = [0usize, 1, 0];
    let mut shared = KvCache::sharing_prompts(filled.clone(), &group_of_row, Some(8), &device).unwrap();
    let mut copied = filled;
    copied.select_rows(&[0, 1, 0], &device);
    let next = |cache: &mut KvCache| {
        cache.select_rows(&[1, 2], &device);
        let mut layout = SequenceLayout::new(2);
        layout.extend(&[prompt_valid[1].clone(), prompt_valid[0].clone()]);
        let step = layout.step_within(&[vec![true], vec![true]], cache.keys_after(1), &device);
        let tokens = lm.token_tensor(&[vec![5], vec![9]]).unwrap();
        let hidden = lm.hidden_states(tokens, ForwardArgs { layout: &step, cache: Some(cache), delta: None }).unwrap();
        hidden.into_data().try_into_vec::<f32>().unwrap()
    };
    let (from_shared, from_copies) = (next(&mut shared), next(&mut copied));
    assert_eq!(shared.len(), width + 1);
    let diff = common::max_abs_diff(&from_shared, &from_copies);
    assert!(diff < common::tolerance(1e-5), "shared against copied prompts: {diff}");
}

/// A decoding step's attention over a shared cache (`prompt_cache::attend` with one query a
/// row, what every layer runs at every token of a GRPO rollout on a GPU) against an f64
/// definition: each row's query heads over its group's prompt keys followed by its own, with
/// scattered groups of uneven sizes and a group without rows, grouped-query heads, queries as a
/// strided view, prompt padding of each row's own length, own slots not yet written (hidden), key
/// counts spanning several of the kernel's tiles with the prompt ending inside one, head widths of
/// a power of two and not, and a row that sees no key (zeros on a GPU). On a GPU troupe's decoding
/// kernel must be the one that ran (`fused::gpu::decode_attention`); on the CPU the two-part
/// products run and must give the same.
#[test]
fn a_decoding_steps_attention_over_a_shared_prompt_matches_f64_on_the_test_device() {
    use burn::tensor::{Bool, Tensor, TensorData};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use troupe::model::prompt_cache::{attend, GroupLayout};

    let device = common::test_device();
    let on_gpu = device != burn::tensor::Device::flex();
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let group_of_row = [2usize, 0, 2, 2, 0];
    let (rows, groups) = (group_of_row.len(), 3);
    // (heads, kv_heads, head_dim, prompt slots, own slots)
    for (heads, kv_heads, dim, prompt, own) in [(4, 2, 16, 37, 70), (6, 3, 96, 150, 64), (16, 8, 128, 20, 64)] {
        let keys = prompt + own;
        // Row r: prompt padding `pad[r]`, own slots written `filled[r]`; row 4 sees nothing.
        let pad = [0, 3, 5, 1, prompt];
        let filled = [own, 1, 9, own / 2, 0];
        let hidden: Vec<bool> =
            (0..rows).flat_map(|r| (0..keys).map(move |j| j < pad[r] || j >= prompt + filled[r])).collect();
        let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
        let (q, pk, pv) = (
            random(rows * heads * dim),
            random(groups * kv_heads * prompt * dim),
            random(groups * kv_heads * prompt * dim),
        );
        let (ok, ov) = (random(rows * kv_heads * own * dim), random(rows * kv_heads * own * dim));
        let tensor = |v: &[f32], dims: [usize; 4]| Tensor::<4>::from_data(TensorData::new(v.to_vec(), dims), &device);
        // Stored `[rows, seq, heads, dim]` and viewed heads first, as a projection's output is.
        let qt = tensor(&q, [rows, 1, heads, dim]).swap_dims(1, 2);
        let (pkt, pvt) = (tensor(&pk, [groups, kv_heads, prompt, dim]), tensor(&pv, [groups, kv_heads, prompt, dim]));
        let (okt, ovt) = (tensor(&ok, [rows, kv_heads, own, dim]), tensor(&ov, [rows, kv_heads, own, dim]));
        let mask = Tensor::<4, Bool>::from_data(TensorData::new(hidden.clone(), [rows, 1, 1, keys]), &device);
        let layout = GroupLayout::new(&group_of_row, groups, &device).unwrap();
        let got = attend(qt.clone(), (pkt.clone(), pvt.clone()), &layout, (okt.clone(), ovt.clone()), &mask);
        let got = got.into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if on_gpu {
            let index: Vec<i64> = group_of_row.iter().map(|&g| g as i64).collect();
            let of_row = Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(index, [rows]), &device);
            let kernel = troupe::model::fused::gpu::decode_attention(
                &qt,
                Some((&pkt, &pvt, &of_row)),
                (&okt, &ovt),
                &mask,
                None,
            )
            .expect("the decoding kernel runs on a GPU")
            .0;
            let kernel = kernel.into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
            assert_eq!(kernel, got, "attend runs the decoding kernel");
            // A cache held in half precision (`runtime.kv_cache: auto` on a GPU): each key and
            // value widened as it is read, what the kernel gives over the rounded values in f32,
            // and what `attend` gives over the half-precision parts.
            use burn::tensor::DType;
            let half = if troupe::device::is_cuda(&device) { DType::BF16 } else { DType::F16 };
            let (hpk, hpv, hok, hov) =
                (pkt.clone().cast(half), pvt.clone().cast(half), okt.clone().cast(half), ovt.clone().cast(half));
            let wide = |t: &Tensor<4>| t.clone().cast(DType::F32);
            let flat = |t: Tensor<4>| t.into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
            let decode = |pk: &Tensor<4>, pv: &Tensor<4>, ok: &Tensor<4>, ov: &Tensor<4>| {
                troupe::model::fused::gpu::decode_attention(&qt, Some((pk, pv, &of_row)), (ok, ov), &mask, None)
                    .expect("the decoding kernel reads a half-precision cache")
                    .0
            };
            let from_half = flat(decode(&hpk, &hpv, &hok, &hov));
            assert_eq!(from_half, flat(decode(&wide(&hpk), &wide(&hpv), &wide(&hok), &wide(&hov))), "widened as read");
            let attended = attend(qt.clone(), (hpk, hpv), &layout, (hok, hov), &mask);
            assert_eq!(flat(attended), from_half, "attend over a half-precision cache runs the kernel");
        }
        let scale = 1.0 / (dim as f64).sqrt();
        let group = heads / kv_heads;
        for r in 0..rows {
            let g = group_of_row[r];
            let seen: Vec<usize> = (0..keys).filter(|&j| !hidden[r * keys + j]).collect();
            for h in 0..heads {
                let kv = h / group;
                let key = |j: usize| -> &[f32] {
                    if j < prompt {
                        &pk[((g * kv_heads + kv) * prompt + j) * dim..][..dim]
                    } else {
                        &ok[((r * kv_heads + kv) * own + j - prompt) * dim..][..dim]
                    }
                };
                let value = |j: usize, d: usize| -> f64 {
                    f64::from(if j < prompt {
                        pv[((g * kv_heads + kv) * prompt + j) * dim + d]
                    } else {
                        ov[((r * kv_heads + kv) * own + j - prompt) * dim + d]
                    })
                };
                let query = &q[(r * heads + h) * dim..][..dim];
                let out = &got[(r * heads + h) * dim..][..dim];
                let label = format!("{heads}/{kv_heads} heads x {dim}, {prompt} + {own} keys, row {r}, head {h}");
                if seen.is_empty() {
                    // The GPU's attentions give zeros; burn's softmax elsewhere spreads equal weights.
                    if on_gpu {
                        assert!(out.iter().all(|&x| x == 0.0), "{label}: sees no key");
                    }
                    continue;
                }
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&j| query.iter().zip(key(j)).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() * scale)
                    .collect();
                let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (d, &x) in out.iter().enumerate() {
                    let want = seen.iter().zip(&weights).map(|(&j, w)| w * value(j, d)).sum::<f64>() / total;
                    let error = (f64::from(x) - want).abs() / want.abs().max(1.0);
                    assert!(error < f64::from(common::tolerance(1e-5)), "{label}, column {d}: {x} against {want}");
                }
            }
        }
    }
}
