//! Generation: the KV cache gives the same tokens as recomputing the whole sequence at every
//! step, for a batch of prompts of different lengths; batching does not change a row's output;
//! a seed fixes sampled text; EOS and max-new-tokens stop rows.

use crate::common;
use troupe::generate::{generate, score_rows, GenerateOptions, SamplingConfig};
use troupe::model::{Model, Preset};

fn prompts(model: &Model) -> Vec<Vec<u32>> {
    ["Player 1 hints red.", "North opens 1NT; East doubles; the contract is 3NT.", "def main(xs):"]
        .iter()
        .map(|t| model.tokenizer.encode(t).unwrap())
        .collect()
}

#[test]
fn kv_cache_matches_full_recompute_on_a_ragged_batch() {
    let model = common::builtin_f32(Preset::Tiny, 7);
    let prompts = prompts(&model);
    assert!(prompts.iter().map(Vec::len).collect::<std::collections::HashSet<_>>().len() > 1, "lengths differ");
    for sampling in [SamplingConfig::greedy(), SamplingConfig { temperature: 0.9, top_k: 50, top_p: 0.95 }] {
        let options = GenerateOptions { max_new_tokens: 12, sampling, seed: 11, stop_at_eos: false, use_cache: true };
        let cached = generate(&model.lm, &[], &prompts, &options, None).unwrap();
        let full =
            generate(&model.lm, &[], &prompts, &GenerateOptions { use_cache: false, ..options.clone() }, None).unwrap();
        common::assert_same_generations(&cached, &full, "cached vs full");
        assert!(cached.iter().all(|g| g.output_ids.len() == 12));
        if options.sampling.is_greedy() {
            // Each row alone gives what it gave inside the padded batch.
            for (prompt, batched) in prompts.iter().zip(&cached) {
                let alone = generate(&model.lm, &[], std::slice::from_ref(prompt), &options, None).unwrap().remove(0);
                common::assert_same_generations(
                    std::slice::from_ref(&alone),
                    std::slice::from_ref(batched),
                    "alone vs batched",
                );
            }
        }
    }
}

#[test]
fn padded_scoring_equals_scoring_each_row_alone() {
    let model = common::builtin_f32(Preset::Tiny, 1);
    let prompts = prompts(&model);
    let batched = score_rows(&model.lm, &prompts, None).unwrap();
    for (prompt, row) in prompts.iter().zip(&batched) {
        let alone = score_rows(&model.lm, std::slice::from_ref(prompt), None).unwrap().remove(0);
        let diff = alone.iter().zip(row).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff < common::tolerance(1e-5), "padding changed a row's log-probs by {diff}");
    }
}

#[test]
fn seed_fixes_sampled_text_and_stops_apply() {
    let model = common::builtin_f32(Preset::Tiny, 0);
    let prompts = prompts(&model);
    let sampled = |seed| {
        let options = GenerateOptions {
            max_new_tokens: 10,
            sampling: SamplingConfig { temperature: 1.0, top_k: 0, top_p: 1.0 },
            seed,
            stop_at_eos: false,
            use_cache: true,
        };
        generate(&model.lm, &[], &prompts, &options, None).unwrap()
    };
    assert_eq!(sampled(3), sampled(3));
    assert_ne!(sampled(3), sampled(4));

    // Make the first greedy token of row 0 an EOS id: that row stops after it, others go on.
    let greedy =
        GenerateOptions { max_new_tokens: 5, sampling: SamplingConfig::greedy(), ..GenerateOptions::default() };
    let first = generate(&model.lm, &[], &prompts, &greedy, None).unwrap();
    let eos = first[0].output_ids[0];
    let stopped = generate(&model.lm, &[eos], &prompts, &greedy, None).unwrap();
    assert_eq!(stopped[0].output_ids, vec![eos]);
    assert!(stopped[0].finished_by_eos);
    for (row, out) in stopped.iter().enumerate().skip(1) {
        let cut = first[row].output_ids.iter().position(|t| *t == eos).map_or(5, |i| i + 1);
        assert_eq!(out.output_ids, first[row].output_ids[..cut].to_vec());
    }
}

#[test]
fn completion_scoring_equals_full_scoring_at_the_completion_positions() {
    let model = common::builtin_f32(Preset::Tiny, 3);
    let rows = prompts(&model);
    // Completions start at different places in rows of different lengths.
    let from: Vec<usize> = rows.iter().map(|r| r.len() / 2).collect();
    let batch = troupe::generate::ScoringBatch::new(&model.lm, &rows).unwrap();
    let part = troupe::generate::completion_logprobs(&model.lm, &batch, &from, None).unwrap();
    let [n, width] = part.dims();
    assert_eq!((n, width), (rows.len(), rows.iter().zip(&from).map(|(r, f)| r.len() - f).max().unwrap()));
    let part = part.into_data().try_into_vec::<f32>().unwrap();
    let full = score_rows(&model.lm, &rows, None).unwrap();
    for (b, (row, &f)) in rows.iter().zip(&from).enumerate() {
        for j in 0..width {
            let got = part[b * width + j];
            if f + j < row.len() {
                // Token f + j is scored at full position f + j - 1.
                let want = full[b][f + j - 1];
                assert!((got - want).abs() < common::tolerance(1e-5), "row {b} token {}: {got} vs {want}", f + j);
            } else {
                assert_eq!(got, 0.0, "padding beyond row {b}'s completion");
            }
        }
    }
    assert!(troupe::generate::completion_logprobs(&model.lm, &batch, &[0, 1, 1], None).is_err());
}

#[test]
fn a_reserved_cache_written_in_place_gives_what_concatenation_gives_even_when_it_grows() {
    use troupe::model::{ForwardArgs, KvCache, SequenceLayout};
    let device = common::test_device();
    let model = common::builtin_f32(Preset::Tiny, 5);
    let lm = &model.lm;
    let layers = lm.config.num_hidden_layers;
    let prompts = prompts(&model);
    let width = prompts.iter().map(Vec::len).max().unwrap();
    // Left-padded prompts, then six single-token steps; the reserved cache starts with room
    // for the prompts and one token, so it must grow on the way.
    // Each step's tokens and their validity.
    type Step = (Vec<Vec<u32>>, Vec<Vec<bool>>);
    let mut steps: Vec<Step> = vec![(
        prompts.iter().map(|p| [vec![0; width - p.len()], p.clone()].concat()).collect(),
        prompts.iter().map(|p| [vec![false; width - p.len()], vec![true; p.len()]].concat()).collect(),
    )];
    for t in 0..6u32 {
        steps.push((prompts.iter().map(|p| vec![p[0] + t]).collect(), vec![vec![true]; prompts.len()]));
    }
    let (mut grown, mut concatenated) = (KvCache::with_capacity(layers, width + 1), KvCache::new(layers));
    let (mut grown_layout, mut concatenated_layout) =
        (SequenceLayout::new(prompts.len()), SequenceLayout::new(prompts.len()));
    // Off the CPU, the same room held in half precision too (bf16 under CUDA, f16 on wgpu), as a
    // half-precision base's generation holds it: within that rounding of the f32 cache's states.
    let half = if troupe::device::is_cuda(&device) { burn::tensor::DType::BF16 } else { burn::tensor::DType::F16 };
    let on_gpu = device != burn::tensor::Device::flex();
    let mut held = KvCache::with_capacity(layers, width + 1).holding(Some(half));
    let mut held_layout = SequenceLayout::new(prompts.len());
    let half_bound = if half == burn::tensor::DType::BF16 { 5e-2 } else { 1e-2 };
    let mut half_worst = 0.0f32;
    let mut rooms = Vec::new();
    for (tokens, valid) in &steps {
        let keys = grown.keys_after(valid[0].len());
        rooms.push(keys);
        let a = grown_layout.step_within(valid, keys, &device);
        let b = concatenated_layout.step(valid, &device);
        let run = |layout: &troupe::model::AttentionLayout, cache: &mut KvCache| {
            let hidden = lm
                .hidden_states(
                    lm.token_tensor(tokens).unwrap(),
                    ForwardArgs { layout, cache: Some(cache), delta: None },
                )
                .unwrap();
            hidden.into_data().try_into_vec::<f32>().unwrap()
        };
        let (x, y) = (run(&a, &mut grown), run(&b, &mut concatenated));
        // Only the masked room differs: the same keys and values, so the same outputs.
        let diff = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        assert!(diff < common::tolerance(1e-5), "hidden states differ by {diff}");
        assert_eq!(grown.len(), concatenated.len());
        if on_gpu {
            let c = held_layout.step_within(valid, held.keys_after(valid[0].len()), &device);
            let z = run(&c, &mut held);
            let diff = z.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
            assert!(diff < half_bound, "a half-precision room's hidden states differ by {diff}");
            half_worst = half_worst.max(diff);
            assert_eq!(held.len(), concatenated.len());
        }
    }
    assert_eq!(
        rooms,
        vec![width + 1, width + 1, 2 * width + 2, 2 * width + 2, 2 * width + 2, 2 * width + 2, 2 * width + 2]
    );
    if on_gpu {
        println!("a half-precision room's hidden states: at most {half_worst} from the f32 cache's");
        assert!(half_worst > 0.0, "the room was held in half precision: its rounding shows");
    }
}

#[test]
fn generation_past_the_reserved_cache_room_matches_full_recompute() {
    // More new tokens than generation reserves room for up front (128): the cache grows mid-way.
    let model = common::builtin_f32(Preset::Tiny, 9);
    let prompts = prompts(&model)[..2].to_vec();
    let options = GenerateOptions {
        max_new_tokens: 140,
        sampling: SamplingConfig { temperature: 0.8, top_k: 0, top_p: 0.9 },
        seed: 4,
        stop_at_eos: false,
        use_cache: true,
    };
    let cached = generate(&model.lm, &[], &prompts, &options, None).unwrap();
    let full = generate(&model.lm, &[], &prompts, &GenerateOptions { use_cache: false, ..options }, None).unwrap();
    common::assert_same_generations(&cached, &full, "grown cache vs full");
    assert!(cached.iter().all(|g| g.output_ids.len() == 140));
}

#[test]
fn filling_a_cache_writes_what_a_forward_writes() {
    use troupe::model::{ForwardArgs, KvCache, SequenceLayout};
    let device = common::test_device();
    let model = common::builtin_f32(Preset::Tiny, 3);
    let prompt = prompts(&model).remove(1);
    let layers = model.lm.config.num_hidden_layers;
    let (mut forward, mut filled) = (KvCache::new(layers), KvCache::new(layers));
    let (mut seq_forward, mut seq_filled) = (SequenceLayout::new(1), SequenceLayout::new(1));
    let tokens = || model.lm.token_tensor(std::slice::from_ref(&prompt)).unwrap();
    let valid = vec![vec![true; prompt.len()]];
    let layout = seq_forward.step(&valid, &device);
    model.lm.hidden_states(tokens(), ForwardArgs { layout: &layout, cache: Some(&mut forward), delta: None }).unwrap();
    let layout = seq_filled.step(&valid, &device);
    model.lm.fill_cache(tokens(), ForwardArgs { layout: &layout, cache: Some(&mut filled), delta: None }).unwrap();
    assert_eq!(forward.len(), filled.len());
    // The next token's hidden state from either cache: equal bit for bit.
    let next = model.lm.token_tensor(&[vec![prompt[0]]]).unwrap();
    let step = |cache: &mut KvCache, seq: &mut SequenceLayout| {
        let layout = seq.step(&[vec![true]], &device);
        let hidden =
            model.lm.hidden_states(next.clone(), ForwardArgs { layout: &layout, cache: Some(cache), delta: None });
        hidden.unwrap().into_data().convert::<f32>().try_into_vec::<f32>().unwrap()
    };
    assert_eq!(step(&mut forward, &mut seq_forward), step(&mut filled, &mut seq_filled));
    // A cache is required.
    let layout = SequenceLayout::new(1).step(&valid, &device);
    assert!(model.lm.fill_cache(tokens(), ForwardArgs { layout: &layout, cache: None, delta: None }).is_err());
}

/// A reserved cache held in the base's half precision (`runtime.kv_cache: auto` on a GPU: bf16
/// under CUDA, f16 on wgpu, whose shaders have no bf16) against one held in f32, the base the
/// same: the same greedy tokens and log-probs within the half precision's rounding, over rows
/// with their own prompts (the cache copied to each row's room) and over rows sharing one (the
/// prompt held once, then each row's own room). On the CPU `auto` holds f32.
#[test]
fn a_cache_held_in_half_precision_generates_what_an_f32_cache_generates() {
    use burn::tensor::{DType, Device};
    use troupe::model::{KvCacheDtype, LoadOptions, Precision};

    let device = common::test_device();
    let low = if troupe::device::is_cuda(&device) { Precision::Bf16 } else { Precision::F16 };
    let mut model = Model::load(&LoadOptions::builtin(Preset::Tiny, 5).dtype(low), &device).unwrap();
    if device == Device::flex() {
        assert_eq!(model.lm.cache_dtype(), None, "the CPU holds f32");
        return;
    }
    let half = model.lm.dtype();
    assert!(matches!(half, DType::BF16 | DType::F16));
    assert_eq!(model.lm.cache_dtype(), Some(half), "auto holds the base's precision on a GPU");
    let mut rows = prompts(&model);
    let shared = rows[1].clone();
    rows.extend([shared.clone(), shared]);
    let options = GenerateOptions {
        max_new_tokens: 10,
        sampling: SamplingConfig::greedy(),
        seed: 0,
        stop_at_eos: false,
        use_cache: true,
    };
    // bf16 keeps 8 bits of mantissa, f16 11.
    let bound = if half == DType::BF16 { 2e-2 } else { 2e-3 };
    let mut largest = 0.0f32;
    for batch in [&rows[..3], &rows[1..]] {
        let held = generate(&model.lm, &[], batch, &options, None).unwrap();
        model.lm.set_kv_cache(KvCacheDtype::F32);
        assert_eq!(model.lm.cache_dtype(), None);
        let f32s = generate(&model.lm, &[], batch, &options, None).unwrap();
        model.lm.set_kv_cache(KvCacheDtype::Auto);
        for (row, (a, b)) in held.iter().zip(&f32s).enumerate() {
            assert_eq!(a.output_ids, b.output_ids, "row {row}: the same greedy tokens");
            let worst = a.logprobs.iter().zip(&b.logprobs).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(worst < bound, "row {row}: log-probs {worst} apart (allowed {bound})");
            largest = largest.max(worst);
        }
    }
    println!("half-precision cache against f32: log-probs at most {largest} apart");
    assert!(largest > 0.0, "the cache was held in half precision: its rounding shows");
}
