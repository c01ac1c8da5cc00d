//! Random-policy steps per second: Hanabi with 2 and 5 players, and Bridge (auction and play).
//!
//! `cargo bench -p troupe-envs --bench env_steps`; the throughput criterion prints is in
//! environment steps (one move, call or card each) per second, policy time included.

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::json;
use troupe_envs::policy::RandomPolicy;
use troupe_envs::runner::run_episode;
use troupe_envs::{Environment, Registry};

fn steps_per_episode(env: &mut dyn Environment, episodes: u64) -> u64 {
    let mut policy = RandomPolicy;
    (0..episodes).map(|seed| run_episode(env, &mut policy, seed).expect("random play never fails").steps as u64).sum()
}

fn bench_env(c: &mut Criterion, label: &str, name: &str, params: serde_json::Value) {
    let registry = Registry::with_builtins();
    let mut env = registry.make(name, &params).expect("valid parameters");
    const EPISODES: u64 = 64;
    let steps = steps_per_episode(env.as_mut(), EPISODES);
    let mut group = c.benchmark_group("random_policy");
    group.throughput(Throughput::Elements(steps));
    group.bench_function(label, |b| b.iter(|| steps_per_episode(env.as_mut(), EPISODES)));
    group.finish();
}

fn benches(c: &mut Criterion) {
    bench_env(c, "hanabi_2p", "hanabi", json!({"players": 2}));
    bench_env(c, "hanabi_5p", "hanabi", json!({"players": 5}));
    bench_env(c, "bridge", "bridge", json!({}));
}

criterion_group!(env_steps, benches);
criterion_main!(env_steps);
