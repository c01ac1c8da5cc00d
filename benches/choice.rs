//! `choice`-mode decisions on the built-in tiny model, from real two-player Hanabi states in the
//! compact observation: packed scoring (each prompt read once, every legal action scored
//! against it in the same row) against one full row per (prompt, action) pair, and the choice
//! policy's training pass (forward + backward through both agents' adapters).
//!
//! The GEMM rate that `metrics.jsonl`'s achieved FLOP rates (`gflop_per_second_rollout`,
//! `gflop_per_second_update`) are read against: `cargo bench --bench gemm -- gemm/`.
//!
//! `cargo bench --bench choice`

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use burn::tensor::Device;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe::adapters::{AdapterConfig, MultiAdapterManager};
use troupe::generate::choice::{candidate_logliks, choice_log_policy, score_choices, ChoiceScore, PackedChoices};
use troupe::generate::score_rows;
use troupe::model::{Model, Preset};
use troupe::rl::rollout::prompt_text;
use troupe_envs::{Action, Registry};

/// Prompts and legal actions' tokens of `n` decisions met in random games.
fn decisions(model: &Model, n: usize) -> Vec<(Vec<u32>, Vec<Vec<u32>>)> {
    let registry = Registry::with_builtins();
    let spec = serde_json::json!({"name": "hanabi", "players": 2, "observation": "compact", "history_moves": 2});
    let mut env = registry.make_from_spec(&spec).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut out = Vec::with_capacity(n);
    env.reset(0);
    while out.len() < n {
        if env.is_terminal() {
            env.reset(rng.random());
        }
        let seat = env.acting_seats()[0];
        let prompt = model.tokenizer.encode(&prompt_text(model, env.as_ref(), seat, false, None).unwrap()).unwrap();
        let legal = env.legal_actions(seat).unwrap();
        let candidates = legal.iter().map(|a| model.tokenizer.encode(&a.text).unwrap()).collect();
        out.push((prompt, candidates));
        let pick = legal[rng.random_range(0..legal.len())].id;
        env.step(&[Action::Id(pick)]).unwrap();
    }
    out
}

fn bench_choice(c: &mut Criterion) {
    troupe::device::tune_allocator();
    let device = Device::flex();
    let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.create_adapters(2, &AdapterConfig::default()).unwrap();
    let all = decisions(&model, 64);
    let tokens: usize = all.iter().map(|(p, c)| p.len() + c.iter().map(Vec::len).sum::<usize>()).sum();
    eprintln!(
        "64 decisions: {:.1} prompt tokens and {:.1} legal actions of {:.1} tokens on average; {tokens} packed tokens",
        all.iter().map(|(p, _)| p.len()).sum::<usize>() as f64 / 64.0,
        all.iter().map(|(_, c)| c.len()).sum::<usize>() as f64 / 64.0,
        all.iter().flat_map(|(_, c)| c.iter().map(Vec::len)).sum::<usize>() as f64
            / all.iter().map(|(_, c)| c.len()).sum::<usize>() as f64,
    );
    let view = |d: &[(Vec<u32>, Vec<Vec<u32>>)]| -> Vec<(Vec<u32>, Vec<Vec<u32>>)> { d.to_vec() };
    let mut group = c.benchmark_group("choice_scoring");
    group.sample_size(10);
    for n in [16usize, 64] {
        let batch = view(&all[..n]);
        let refs: Vec<(&[u32], &[Vec<u32>])> = batch.iter().map(|(p, c)| (p.as_slice(), c.as_slice())).collect();
        let agents: Vec<Option<usize>> = (0..n).map(|i| Some(i % 2)).collect();
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(format!("packed_{n}_decisions"), |b| {
            b.iter(|| {
                let (delta, _) = manager.mixed(&agents, false).unwrap();
                score_choices(&model.lm, &refs, ChoiceScore::Mean, Some(&delta)).unwrap()
            })
        });
        if n == 16 {
            // Every (prompt, action) pair as its own row, as the scoring was done before.
            let mut rows = Vec::new();
            let mut row_agents = Vec::new();
            for (i, (prompt, candidates)) in batch.iter().enumerate() {
                for candidate in candidates {
                    let mut row = prompt.clone();
                    row.extend(candidate);
                    rows.push(row);
                    row_agents.push(Some(i % 2));
                }
            }
            group.bench_function(format!("row_per_action_{n}_decisions"), |b| {
                b.iter(|| {
                    let (delta, _) = manager.mixed(&row_agents, false).unwrap();
                    score_rows(&model.lm, &rows, Some(&delta)).unwrap()
                })
            });
        }
    }
    group.finish();

    let mut group = c.benchmark_group("choice_training");
    group.sample_size(10);
    let n = 16;
    let batch = view(&all[..n]);
    let refs: Vec<(&[u32], &[Vec<u32>])> = batch.iter().map(|(p, c)| (p.as_slice(), c.as_slice())).collect();
    let agents: Vec<Option<usize>> = (0..n).map(|i| Some(i % 2)).collect();
    group.throughput(Throughput::Elements(n as u64));
    group.bench_function(format!("forward_backward_{n}_decisions"), |b| {
        b.iter(|| {
            let (delta, _used) = manager.mixed(&agents, true).unwrap();
            let packed = PackedChoices::new(&model.lm, &refs).unwrap();
            let log_policy =
                choice_log_policy(candidate_logliks(&model.lm, &packed, ChoiceScore::Mean, Some(&delta)).unwrap(), 1.0);
            log_policy.narrow(1, 0, 1).sum().neg().backward()
        })
    });
    group.finish();
}

criterion_group!(benches, bench_choice);
criterion_main!(benches);
