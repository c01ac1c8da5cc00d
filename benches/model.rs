//! Prefill and decode throughput of the base model, tiny and small presets, batch 1 and 16 —
//! the same workloads as `tools/peer_bench.py` (prefill: one forward over B x 128
//! tokens with all logits; decode: B prompts of 16 tokens, 64 greedy new tokens, no EOS stop).
//!
//! `cargo bench --bench model` (criterion prints elements/s = tokens/s). On a GPU:
//! `TROUPE_DEVICE=cuda cargo bench --features cuda --bench model` (each timed pass ends when the
//! device has finished its work). `TROUPE_DTYPE=f32|bf16|f16` sets the base's precision (default
//! `auto`: bf16 on CUDA, f32 on the CPU), `TROUPE_ATTENTION=flash|materialized` the attention
//! kernel on a GPU (`runtime.attention`; default `auto`, the materialized one; the CPU runs its
//! fused attention whatever it says). `TROUPE_BENCH_PRESETS=small,qwen3-0.6b` picks the presets
//! (default `tiny,small`); each preset's groups are named after it (`prefill_qwen3-0.6b`).

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use burn::tensor::Tensor;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe::generate::{generate, GenerateOptions, SamplingConfig};
use troupe::model::{ForwardArgs, LoadOptions, Model, Preset, SequenceLayout};

fn random_rows(rng: &mut ChaCha8Rng, batch: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..batch).map(|_| (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()).collect()
}

fn bench_model(c: &mut Criterion) {
    troupe::device::tune_allocator();
    let device = troupe::device::default_device().expect("TROUPE_DEVICE");
    let precision = troupe::device::default_precision().expect("TROUPE_DTYPE");
    let kernel = troupe::device::default_attention_kernel().expect("TROUPE_ATTENTION");
    for preset in troupe::device::bench_presets(&[Preset::Tiny, Preset::Small]).expect("TROUPE_BENCH_PRESETS") {
        let mut model = Model::load(&LoadOptions::builtin(preset, 0).dtype(precision), &device).unwrap();
        model.lm.set_attention_kernel(kernel);
        let name = troupe::device::preset_name(preset);
        let vocab = model.tokenizer.vocab_size().min(model.lm.config.vocab_size);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut group = c.benchmark_group(format!("prefill_{name}"));
        group.sample_size(10);
        for batch in [1usize, 16] {
            let rows = random_rows(&mut rng, batch, 128, vocab);
            group.throughput(Throughput::Elements((batch * 128) as u64));
            group.bench_with_input(BenchmarkId::from_parameter(format!("b{batch}x128")), &rows, |b, rows| {
                b.iter(|| {
                    let tokens = model.lm.token_tensor(rows).unwrap();
                    let layout = SequenceLayout::new(rows.len()).step(&vec![vec![true; 128]; rows.len()], &device);
                    let logits: Tensor<3> =
                        model.lm.forward(tokens, ForwardArgs { layout: &layout, cache: None, delta: None }).unwrap();
                    device.sync().unwrap();
                    logits.dims()
                })
            });
        }
        group.finish();
        let mut group = c.benchmark_group(format!("decode_{name}"));
        group.sample_size(10);
        let options = GenerateOptions {
            max_new_tokens: 64,
            sampling: SamplingConfig::greedy(),
            seed: 0,
            stop_at_eos: false,
            use_cache: true,
        };
        for batch in [1usize, 16] {
            let prompts = random_rows(&mut rng, batch, 16, vocab);
            group.throughput(Throughput::Elements((batch * 64) as u64));
            group.bench_with_input(BenchmarkId::from_parameter(format!("b{batch}")), &prompts, |b, prompts| {
                b.iter(|| generate(&model.lm, &[], prompts, &options, None).unwrap())
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench_model);
criterion_main!(benches);
