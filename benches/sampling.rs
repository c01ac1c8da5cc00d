//! Sampling one token from a row of logits, the step a decoding batch repeats for every row and
//! token: on the host, 16 rows of 32,000 logits (temperature 1; top-p 0.95, top-k 50, or the
//! whole distribution); on a GPU device (`TROUPE_DEVICE`), the draw on the device
//! (`sample_on_device`, one kernel) over 64 rows of a Qwen3 vocabulary (151,936 logits), with
//! top-p 0.95, top-k 50 then top-p 0.9, the whole distribution, and greedy, each pass ending
//! when its two numbers a row are back on the host.
//!
//! `cargo bench --bench sampling`; on a GPU, `TROUPE_DEVICE=cuda cargo bench --features cuda
//! --bench sampling` (`wgpu` likewise).

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use burn::tensor::{Tensor, TensorData};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe::generate::sampler::{on_device, sample, sample_on_device};
use troupe::generate::SamplingConfig;

fn bench_sampling(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let rows: Vec<Vec<f32>> = (0..16).map(|_| (0..32000).map(|_| rng.random_range(-3.0f32..3.0)).collect()).collect();
    let mut group = c.benchmark_group("sample_32000");
    group.throughput(Throughput::Elements(rows.len() as u64));
    for (name, config) in [
        ("top_p_0.95", SamplingConfig { temperature: 1.0, top_k: 0, top_p: 0.95 }),
        ("top_k_50", SamplingConfig { temperature: 1.0, top_k: 50, top_p: 1.0 }),
        ("plain", SamplingConfig::default()),
    ] {
        group.bench_function(name, |b| b.iter(|| rows.iter().map(|row| sample(row, &config, &mut rng)).sum::<u32>()));
    }
    group.finish();
    bench_device_draw(c, &mut rng);
}

/// The draw on a GPU device, skipped where the device draws on the host (the CPU).
fn bench_device_draw(c: &mut Criterion, rng: &mut ChaCha8Rng) {
    let device = troupe::device::default_device().expect("TROUPE_DEVICE");
    let (rows, vocab) = (64usize, 151_936usize);
    let values: Vec<f32> = (0..rows * vocab).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let logits = Tensor::<2>::from_data(TensorData::new(values, [rows, vocab]), &device);
    let configs = [
        ("top_p_0.95", SamplingConfig { temperature: 1.0, top_k: 0, top_p: 0.95 }),
        ("top_k_50_top_p_0.9", SamplingConfig { temperature: 1.0, top_k: 50, top_p: 0.9 }),
        ("plain", SamplingConfig::default()),
        ("greedy", SamplingConfig::greedy()),
    ];
    if !configs.iter().all(|(_, config)| on_device(&logits, config)) {
        return;
    }
    let mut group = c.benchmark_group("device_draw_64x151936");
    group.sample_size(10);
    group.throughput(Throughput::Elements(rows as u64));
    for (name, config) in configs {
        let uniforms: Vec<f32> = (0..rows).map(|_| rng.random::<f32>()).collect();
        group.bench_function(name, |b| b.iter(|| sample_on_device(&logits, &uniforms, &config).unwrap()));
    }
    group.finish();
}

criterion_group!(benches, bench_sampling);
criterion_main!(benches);
