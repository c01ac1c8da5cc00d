//! Mixed-adapter batches on the `small` preset (or `TROUPE_BENCH_PRESETS`): 32 rows x 64 tokens
//! spread over K = 1, 2, 4, 8 LoRA adapters (rank 8 on q,k,v,o) in ONE pass, against running
//! each adapter's rows as its own pass; for scoring (forward) and for training (forward +
//! backward). The same workload as `peer_bench.py`'s `mixed32_K*` (PEFT's per-row
//! `adapter_names`, inference only).
//!
//! `cargo bench --bench adapters` (`TROUPE_DEVICE=cuda` and `--features cuda` on a GPU;
//! `TROUPE_DTYPE=f32|bf16|f16` sets the base's precision, default `auto`: bf16 on CUDA;
//! `TROUPE_ATTENTION=flash|materialized` the attention kernel of the forward-only passes on a
//! GPU, default `auto`: the materialized one). `TROUPE_BENCH_PRESETS` picks the presets (default
//! `small`); another preset's groups carry its name (`lora_train_step_qwen3-0.6b`).

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe::adapters::optim::adapter_grads;
use troupe::adapters::{AdamWConfig, AdamWState, AdapterConfig, MultiAdapterManager};
use troupe::generate::{next_token_logprobs, ScoringBatch};
use troupe::model::{LoadOptions, Model, Preset};

const ROWS: usize = 32;
const LEN: usize = 64;

/// One pass over `rows` (row i on agent `agents[i]`); with `train`, also the backward pass.
fn pass(model: &Model, manager: &MultiAdapterManager, rows: &[Vec<u32>], agents: &[Option<usize>], train: bool) {
    let (delta, _used) = manager.mixed(agents, train).unwrap();
    let batch = ScoringBatch::new(&model.lm, rows).unwrap();
    let logprobs = next_token_logprobs(&model.lm, &batch, Some(&delta)).unwrap();
    let device = logprobs.device();
    if train {
        let _grads = logprobs.sum().neg().backward();
    } else {
        let _ = logprobs.dims();
    }
    device.sync().unwrap();
}

/// The presets to run at, each with its groups' suffix: none for `small`, whose names the
/// figures have always had, `_NAME` for another.
fn presets() -> Vec<(Preset, String)> {
    let presets = troupe::device::bench_presets(&[Preset::Small]).expect("TROUPE_BENCH_PRESETS");
    presets
        .into_iter()
        .map(|p| (p, if p == Preset::Small { String::new() } else { format!("_{}", troupe::device::preset_name(p)) }))
        .collect()
}

fn bench_adapters(c: &mut Criterion) {
    for (preset, suffix) in presets() {
        bench_adapters_at(c, preset, &suffix);
    }
}

fn bench_adapters_at(c: &mut Criterion, preset: Preset, suffix: &str) {
    troupe::device::tune_allocator();
    let device = troupe::device::default_device().expect("TROUPE_DEVICE");
    let precision = troupe::device::default_precision().expect("TROUPE_DTYPE");
    let mut model = Model::load(&LoadOptions::builtin(preset, 0).dtype(precision), &device).unwrap();
    model.lm.set_attention_kernel(troupe::device::default_attention_kernel().expect("TROUPE_ATTENTION"));
    let vocab = model.tokenizer.vocab_size();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let rows: Vec<Vec<u32>> =
        (0..ROWS).map(|_| (0..LEN).map(|_| rng.random_range(1..vocab as u32)).collect()).collect();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.create_adapters(8, &AdapterConfig::default()).unwrap();
    for (mode, train) in [("forward", false), ("forward_backward", true)] {
        let mut group = c.benchmark_group(format!("mixed32x64_{mode}{suffix}"));
        group.sample_size(10);
        for k in [1usize, 2, 4, 8] {
            let agents: Vec<Option<usize>> = (0..ROWS).map(|i| Some(i % k)).collect();
            group.bench_with_input(BenchmarkId::new("one_pass", format!("K{k}")), &agents, |b, agents| {
                b.iter(|| pass(&model, &manager, &rows, agents, train))
            });
            if k > 1 {
                group.bench_with_input(BenchmarkId::new("pass_per_adapter", format!("K{k}")), &k, |b, &k| {
                    b.iter(|| {
                        for agent in 0..k {
                            let own: Vec<Vec<u32>> =
                                (0..ROWS).filter(|i| i % k == agent).map(|i| rows[i].clone()).collect();
                            pass(&model, &manager, &own, &vec![Some(agent); own.len()], train);
                        }
                    })
                });
            }
        }
        group.finish();
    }
}

/// One LoRA training step as `peer_bench.py` times it: rank 8 on q,k,v,o, 8 x 128 tokens,
/// forward + backward + AdamW.
fn bench_train_step(c: &mut Criterion) {
    for (preset, suffix) in presets() {
        bench_train_step_at(c, preset, &suffix);
    }
}

fn bench_train_step_at(c: &mut Criterion, preset: Preset, suffix: &str) {
    troupe::device::tune_allocator();
    let device = troupe::device::default_device().expect("TROUPE_DEVICE");
    let precision = troupe::device::default_precision().expect("TROUPE_DTYPE");
    let model = Model::load(&LoadOptions::builtin(preset, 0).dtype(precision), &device).unwrap();
    let vocab = model.tokenizer.vocab_size();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let rows: Vec<Vec<u32>> = (0..8).map(|_| (0..128).map(|_| rng.random_range(1..vocab as u32)).collect()).collect();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.create_adapters(1, &AdapterConfig::default()).unwrap();
    let adamw = AdamWConfig::default();
    let mut state = AdamWState::default();
    let mut group = c.benchmark_group(format!("lora_train_step{suffix}"));
    group.sample_size(10);
    group.throughput(criterion::Throughput::Elements(8 * 128));
    group.bench_function("b8x128", |b| {
        b.iter(|| {
            let (delta, used) = manager.mixed(&[Some(0); 8], true).unwrap();
            let batch = ScoringBatch::new(&model.lm, &rows).unwrap();
            let loss = next_token_logprobs(&model.lm, &batch, Some(&delta)).unwrap().mean().neg();
            let grads = loss.backward();
            let g = adapter_grads(&used["agent_0"], &grads).unwrap();
            let updated = adamw.step(manager.adapter(0).unwrap(), &g, &mut state, adamw.lr);
            manager.set_adapter(0, updated).unwrap();
            device.sync().unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, bench_adapters, bench_train_step);
criterion_main!(benches);
