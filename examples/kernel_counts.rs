//! Kernel launches per workload on a GPU device: a decoded token (batch 1 and 16, the `small`
//! preset or `TROUPE_BENCH_PRESETS`' first; and batch 16 over two agents' adapters, r8 on
//! q,k,v,o, as a rollout decodes), a 1 x 128 prefill, a LoRA training step's forward,
//! backward and AdamW (r8 on q,k,v,o, 8 x 128 tokens, as `benches/adapters.rs` times it), an
//! iteration's update of 16 rows over two agents' adapters (`Scorer::gradients`; with
//! `update-iteration`, 32 such rows in two micro-batches, counted per micro-batch; with
//! `update-shapes`, eight such micro-batches of random lengths, with the kernels each compiles when
//! `CUBECL_DEBUG_LOG` names a file; with `update-checkpointed`, the 16 rows under activation
//! checkpointing, each group's prompt held once and copied to each row), and a mixed-adapter forward of 32 x 64 rows over 1 and 8 adapters. Each workload runs once to
//! compile its kernels, then once counted. Counts, not times: they are the same on any cubecl
//! device, so a machine without a GPU counts them through wgpu on Mesa's lavapipe:
//!
//! ```bash
//! apt-get install mesa-vulkan-drivers   # lavapipe, a Vulkan device on the CPU
//! TROUPE_DEVICE=wgpu TROUPE_DTYPE=f32 cargo run --release --features wgpu --example kernel_counts [decode prefill train update update-iteration update-shapes update-checkpointed mixed]
//! ```
//!
//! (`TROUPE_DEVICE=cuda` and `--features cuda` on an NVIDIA GPU; `TROUPE_DTYPE` as for the
//! benchmarks; `TROUPE_GPU_KERNELS=burn` counts burn's composites in place of troupe's GPU
//! kernels; `TROUPE_WIDTH_STEP=1` pads batches only to their longest row, as the CPU does, in
//! place of the GPU's multiple of 8 slots; `TROUPE_TRACE_KERNEL=NAME` prints where each launch of
//! a kernel whose name holds NAME comes from, e.g. `CopyKernel` for the layout copies.)
#![allow(missing_docs)]

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn main() {
    eprintln!("error: kernel_counts counts a GPU's kernels: build it with `--features cuda` or `--features wgpu`");
    std::process::exit(2);
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn main() {
    counts::main();
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod counts {

    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use burn_cubecl::cubecl::logging::{LaunchObservation, LaunchObserver};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use troupe::adapters::optim::adapter_grads;
    use troupe::adapters::{AdamWConfig, AdamWState, AdapterConfig, MultiAdapterManager};
    use troupe::generate::choice::ChoiceScore;
    use troupe::generate::{generate, next_token_logprobs, GenerateOptions, SamplingConfig, ScoringBatch};
    use troupe::model::prompt_cache::PromptCache;
    use troupe::model::{CausalLm, ForwardArgs, LoadOptions, Model, Preset, ProjectionDelta, SequenceLayout};
    use troupe::rl::credit::batch::{TrainBatch, TrainRow};
    use troupe::rl::objective::{KlPenalty, Objective, ObjectiveConfig};
    use troupe::rl::update::Scorer;

    #[derive(Default)]
    struct Count(Mutex<BTreeMap<&'static str, usize>>);

    impl LaunchObserver for Count {
        fn launched(&self, kernel: &'static str) {
            *self.0.lock().unwrap().entry(kernel).or_default() += 1;
            // `TROUPE_TRACE_KERNEL=NAME`: where each launch of a kernel whose name holds NAME
            // comes from, one line a launch (its innermost eight frames with a source line, or
            // within burn's autodiff and cubecl operations, which are built without one).
            if let Ok(want) = std::env::var("TROUPE_TRACE_KERNEL") {
                if kernel.contains(want.as_str()) {
                    let trace = std::backtrace::Backtrace::force_capture().to_string();
                    // A frame's name, or its file and line where it has one.
                    let frames: Vec<&str> = trace
                        .lines()
                        .map(str::trim)
                        .filter(|l| {
                            l.contains("/src/") || l.contains("burn_autodiff::ops") || l.contains("burn_cubecl::ops")
                        })
                        .filter(|l| !l.contains("kernel_counts"))
                        .take(8)
                        .collect();
                    println!("trace {} | {}", short(kernel), frames.join(" | "));
                }
            }
        }
    }

    fn counted<T>(f: impl FnOnce() -> T) -> (T, BTreeMap<&'static str, usize>) {
        let counts = Arc::new(Count::default());
        let watching = LaunchObservation::new(counts.clone());
        let out = f();
        drop(watching);
        let map = counts.0.lock().unwrap().clone();
        (out, map)
    }

    fn short(name: &str) -> String {
        let name = troupe::profile::kernels::short_kernel_name(name);
        // cubek's matmul names its whole blueprint.
        match name.find('<') {
            Some(at) if name.starts_with("MatmulEntry") => format!("{}<..>", &name[..at]),
            _ => name,
        }
    }

    fn report(label: &str, map: &BTreeMap<&'static str, usize>, per: f64) {
        let total: usize = map.values().sum();
        println!("== {label}: {} launches", total as f64 / per);
        let mut v: Vec<_> = map.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1));
        for (k, c) in v.iter().take(40) {
            println!("  {:8.2} {}", **c as f64 / per, short(k));
        }
    }

    fn diff(a: &BTreeMap<&'static str, usize>, b: &BTreeMap<&'static str, usize>) -> BTreeMap<&'static str, usize> {
        let mut out = a.clone();
        for (k, v) in b {
            let e = out.entry(k).or_default();
            *e = e.saturating_sub(*v);
        }
        out.retain(|_, v| *v > 0);
        out
    }

    /// The launches of a greedy generation's first token (the prefill and the first draw) and of
    /// the eight tokens decoded after it (the counts of nine tokens less one's), each counted
    /// after a first run compiled the kernels.
    fn decode_counts(
        lm: &CausalLm,
        prompts: &[Vec<u32>],
        delta: Option<&dyn ProjectionDelta>,
    ) -> (BTreeMap<&'static str, usize>, BTreeMap<&'static str, usize>) {
        let run = |n| {
            let options = GenerateOptions {
                max_new_tokens: n,
                sampling: SamplingConfig::greedy(),
                seed: 0,
                stop_at_eos: false,
                use_cache: true,
            };
            counted(|| generate(lm, &[], prompts, &options, delta).unwrap()).1
        };
        run(9);
        let one = run(1);
        let nine = run(9);
        let per_token = diff(&nine, &one);
        (one, per_token)
    }

    pub fn main() {
        let device = troupe::device::default_device().expect("TROUPE_DEVICE");
        let precision = troupe::device::default_precision().expect("TROUPE_DTYPE");
        let preset = troupe::device::bench_presets(&[Preset::Small]).unwrap()[0];
        let what: Vec<String> = std::env::args().skip(1).collect();
        let named = |w: &str| what.iter().any(|x| x == w);
        // Every workload but `update-iteration` and `update-shapes` when none is named.
        let want = |w: &str| named(w) || (what.is_empty() && w != "update-shapes" && w != "update-iteration");
        let model = Model::load(&LoadOptions::builtin(preset, 0).dtype(precision), &device).unwrap();
        let vocab = model.tokenizer.vocab_size().min(model.lm.config.vocab_size);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let rows = |rng: &mut ChaCha8Rng, b: usize, l: usize| -> Vec<Vec<u32>> {
            (0..b).map(|_| (0..l).map(|_| rng.random_range(1..vocab as u32)).collect()).collect()
        };

        if want("decode") {
            for batch in [1usize, 16] {
                let prompts = rows(&mut rng, batch, 16);
                let (one, per_token) = decode_counts(&model.lm, &prompts, None);
                report(&format!("generate b{batch}, first token (prefill 16)"), &one, 1.0);
                report(&format!("decode b{batch}, per token"), &per_token, 8.0);
            }
            // A rollout's decoding: 16 rows, two agents' adapters (r8 on q,k,v,o) in turn.
            let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
            manager.create_adapters(2, &AdapterConfig::default()).unwrap();
            let agents: Vec<Option<usize>> = (0..16).map(|i| Some(i % 2)).collect();
            let prompts = rows(&mut rng, 16, 16);
            let (delta, _) = manager.mixed(&agents, false).unwrap();
            let (_, per_token) = decode_counts(&model.lm, &prompts, Some(&delta));
            report("decode b16, two adapters, per token", &per_token, 8.0);

            // A GRPO rollout's decoding: two groups of 8 replies to one prompt (48 tokens) each,
            // group g on agent g's adapter, the prompt held once per group (`shared`) and copied
            // to each row (`copied`).
            let agents: Vec<Option<usize>> = (0..16).map(|i| Some(i / 8)).collect();
            let group_prompts = rows(&mut rng, 2, 48);
            let prompts: Vec<Vec<u32>> = (0..16).map(|i| group_prompts[i / 8].clone()).collect();
            let (delta, _) = manager.mixed(&agents, false).unwrap();
            let mut lm = model.lm.clone();
            for cache in [PromptCache::Shared, PromptCache::Copied] {
                lm.set_prompt_cache(cache);
                let (_, per_token) = decode_counts(&lm, &prompts, Some(&delta));
                let label =
                    format!("decode b16 in 2 groups of 8, two adapters, prompt cache {}, per token", cache.name());
                report(&label, &per_token, 8.0);
            }
        }
        if want("prefill") {
            let r = rows(&mut rng, 1, 128);
            let pass = || {
                counted(|| {
                    let tokens = model.lm.token_tensor(&r).unwrap();
                    let layout = SequenceLayout::new(1).step(&[vec![true; 128]], &device);
                    let logits: burn::tensor::Tensor<3> =
                        model.lm.forward(tokens, ForwardArgs { layout: &layout, cache: None, delta: None }).unwrap();
                    device.sync().unwrap();
                    logits.dims()
                })
                .1
            };
            pass();
            report("prefill b1x128", &pass(), 1.0);
        }
        if want("train") {
            let r = rows(&mut rng, 8, 128);
            let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
            manager.create_adapters(1, &AdapterConfig::default()).unwrap();
            let adamw = AdamWConfig::default();
            let mut state = AdamWState::default();
            let mut step = |print: bool| {
                let (used, fwd) = counted(|| {
                    let (delta, used) = manager.mixed(&[Some(0); 8], true).unwrap();
                    let batch = ScoringBatch::new(&model.lm, &r).unwrap();
                    let loss = next_token_logprobs(&model.lm, &batch, Some(&delta)).unwrap().mean().neg();
                    (used, loss)
                });
                let (used, loss) = used;
                let (grads, bwd) = counted(|| loss.backward());
                let (_, opt) = counted(|| {
                    let g = adapter_grads(&used["agent_0"], &grads).unwrap();
                    let updated = adamw.step(manager.adapter(0).unwrap(), &g, &mut state, adamw.lr);
                    manager.set_adapter(0, updated).unwrap();
                    device.sync().unwrap();
                });
                if print {
                    report("lora step: forward", &fwd, 1.0);
                    report("lora step: backward", &bwd, 1.0);
                    report("lora step: adamw", &opt, 1.0);
                }
            };
            step(false);
            step(true);
        }
        if want("update") || want("update-iteration") || want("update-shapes") || named("update-checkpointed") {
            // An iteration's update as the trainer runs it (`Scorer::gradients`): 16 reply rows in
            // one micro-batch (`runtime.micro_batch_rows`' default), two agents' adapters (r8 on
            // q,k,v,o), 2 groups x 2 agents x 4 replies after prompts that each group's replies
            // of one agent share (each distinct prompt runs once).
            let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
            manager.create_adapters(2, &AdapterConfig::default()).unwrap();
            let batch = |rng: &mut ChaCha8Rng, groups: usize, prompt_len: usize, reply: usize| {
                let mut train_rows = Vec::new();
                for _group in 0..groups {
                    for agent in 0..2 {
                        let prompt = rows(rng, 1, prompt_len).remove(0);
                        for k in 0..4 {
                            // Replies of `reply - 7` to `reply` tokens.
                            let len = reply - 7 + 2 * k + agent;
                            let mut tokens = prompt.clone();
                            tokens.extend(rows(rng, 1, len).remove(0));
                            train_rows.push(TrainRow {
                                agent,
                                tokens,
                                prompt_len: prompt.len(),
                                advantage: if k % 2 == 0 { 1.0 } else { -1.0 },
                                sampling_logprobs: vec![-2.0; len],
                                choice: None,
                                reference_logprobs: None,
                            });
                        }
                    }
                }
                TrainBatch { rows: train_rows }
            };
            let scorer = Scorer {
                model: &model,
                manager: &manager,
                micro_batch_rows: 16,
                micro_batch_tokens: None,
                gradient_checkpointing: false,
                temperature: 1.0,
                choice_score: ChoiceScore::default(),
                max_new_tokens: 64,
                skip_zero_advantage: true,
            };
            let objective = Objective { config: ObjectiveConfig::default(), kl: KlPenalty::default() };
            let pass = |batch: &TrainBatch| {
                counted(|| {
                    let pass = scorer.gradients(batch, &objective, 0).unwrap();
                    device.sync().unwrap();
                    pass.loss
                })
                .1
            };
            if want("update") {
                let batch = batch(&mut rng, 2, 96, 32);
                pass(&batch);
                report("update: one micro-batch of 16 rows, forward and backward", &pass(&batch), 1.0);
            }
            if named("update-checkpointed") {
                // The same micro-batch under activation checkpointing, each group's prompt read
                // in place by its rows (`shared`, a GPU's default) and copied to each (`copied`).
                let batch = batch(&mut rng, 2, 96, 32);
                let mut lm = model.lm.clone();
                for cache in [PromptCache::Shared, PromptCache::Copied] {
                    lm.set_prompt_cache(cache);
                    let model = Model { lm: lm.clone(), ..model.clone() };
                    let scorer = Scorer { model: &model, gradient_checkpointing: true, ..scorer };
                    let pass = || {
                        counted(|| {
                            let pass = scorer.gradients(&batch, &objective, 0).unwrap();
                            device.sync().unwrap();
                            pass.loss
                        })
                        .1
                    };
                    pass();
                    let label = format!(
                        "update, checkpointed, prompt cache {}: one micro-batch of 16 rows, forward and backward",
                        cache.name()
                    );
                    report(&label, &pass(), 1.0);
                }
            }
            if want("update-iteration") {
                // Twice the rows, in the trainer's batch order (group by group, each agent's
                // replies together), which the update cuts into one micro-batch per agent.
                let batch = batch(&mut rng, 4, 96, 32);
                pass(&batch);
                report(
                    "update: 32 rows of two agents, per micro-batch of 16, forward and backward",
                    &pass(&batch),
                    2.0,
                );
            }
            if want("update-shapes") {
                // Eight micro-batches of random lengths, as an iteration's differ: the kernels each
                // compiles anew, counted from cubecl's compilation log when `CUBECL_DEBUG_LOG`
                // names a file (written by cubecl's logging thread, so read after a pause).
                let compiled = || {
                    std::thread::sleep(std::time::Duration::from_secs(2));
                    let log = std::fs::read_to_string(std::env::var("CUBECL_DEBUG_LOG").ok()?).ok()?;
                    Some(log.matches("[START_KERNEL_COMPILATION]").count())
                };
                let mut shapes = ChaCha8Rng::seed_from_u64(1);
                for _ in 0..8 {
                    let (prompt, reply) = (shapes.random_range(60..160usize), shapes.random_range(12..48usize));
                    let batch = batch(&mut rng, 2, prompt, reply);
                    let before = compiled();
                    let launches = pass(&batch);
                    let fresh = compiled().zip(before).map_or("?".to_string(), |(a, b)| (a - b).to_string());
                    let total: usize = launches.values().sum();
                    println!("update, prompts of {prompt}, replies up to {reply}: {total} launches, {fresh} kernels compiled");
                }
            }
        }
        if want("mixed") {
            let r = rows(&mut rng, 32, 64);
            let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
            manager.create_adapters(8, &AdapterConfig::default()).unwrap();
            for k in [1usize, 8] {
                let agents: Vec<Option<usize>> = (0..32).map(|i| Some(i % k)).collect();
                let pass = || {
                    counted(|| {
                        let (delta, _) = manager.mixed(&agents, false).unwrap();
                        let batch = ScoringBatch::new(&model.lm, &r).unwrap();
                        let lp = next_token_logprobs(&model.lm, &batch, Some(&delta)).unwrap();
                        device.sync().unwrap();
                        lp.dims()
                    })
                    .1
                };
                pass();
                report(&format!("mixed forward K{k}"), &pass(), 1.0);
            }
        }
    }
}
