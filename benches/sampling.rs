//! Sampling one token from a 32000-token row of logits (temperature 1, top-p 0.95), the step
//! a decoding batch repeats for every row and token.
//!
//! `cargo bench --bench sampling`

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe::generate::sampler::sample;
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
}

criterion_group!(benches, bench_sampling);
criterion_main!(benches);
