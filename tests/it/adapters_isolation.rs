//! Gradient isolation by agent id: a mixed batch gives each adapter exactly the gradient of its
//! own rows; optimizer steps on one agent's rows leave every other adapter, its optimizer state
//! and the base byte-identical; shared mode's one step equals the scaled accumulation. The
//! adapters' gradients on the test device (a GPU's kernels with backwards of their own) match
//! the CPU's, through one scored forward and through the update's whole gradient pass (shared
//! prompts, `choice` decisions, with and without activation checkpointing).

use crate::common;

use std::collections::BTreeMap;

use burn::tensor::{Tensor, TensorData};
use troupe::adapters::optim::{adapter_grads, AdapterGrads};
use troupe::adapters::{AdamWConfig, AdamWState, LoraAdapter, MultiAdapterManager};
use troupe::generate::{next_token_logprobs, ScoringBatch};
use troupe::model::{Model, PromptCache};

fn setup() -> (Model, MultiAdapterManager, Vec<Vec<u32>>) {
    setup_on(&common::test_device())
}

fn setup_on(device: &burn::tensor::Device) -> (Model, MultiAdapterManager, Vec<Vec<u32>>) {
    use troupe::model::{LoadOptions, Precision};
    let dir = common::models_dir().join("tiny-qwen3");
    let model = Model::load(&LoadOptions::path(&dir).dtype(Precision::F32), device).unwrap();
    let device = device.clone();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.load_adapters(&dir.join("adapters")).unwrap();
    let texts = [
        "Player 1 hints red. Play card 0.",
        "def main(xs):\n    return helper(xs)",
        "North opens 1NT.",
        "Discard card 3 now.",
    ];
    let rows = texts.iter().map(|t| model.tokenizer.encode(t).unwrap()).collect();
    (model, manager, rows)
}

/// Sum over rows of `weights[row]` x (sum of the row's real next-token log-probs); the
/// trainable adapters used are returned with it so their gradients can be read.
fn weighted_loss(
    model: &Model,
    manager: &MultiAdapterManager,
    tokens: &[Vec<u32>],
    agents: &[Option<usize>],
    weights: &[f32],
) -> (Tensor<1>, BTreeMap<String, LoraAdapter>) {
    let (delta, used) = manager.mixed(agents, true).unwrap();
    let batch = ScoringBatch::new(&model.lm, tokens).unwrap();
    let logprobs = next_token_logprobs(&model.lm, &batch, Some(&delta)).unwrap();
    let [rows, width] = logprobs.dims();
    let mut mask = Vec::with_capacity(rows * width);
    for (row, len) in batch.lengths.iter().enumerate() {
        mask.extend((0..width).map(|t| if t + 1 < *len { weights[row] } else { 0.0 }));
    }
    let mask = Tensor::<2>::from_data(TensorData::new(mask, [rows, width]), model.lm.device());
    ((logprobs * mask).sum().neg(), used)
}

fn grads_of(
    model: &Model,
    manager: &MultiAdapterManager,
    tokens: &[Vec<u32>],
    agents: &[Option<usize>],
    weights: &[f32],
) -> BTreeMap<String, AdapterGrads> {
    let (loss, used) = weighted_loss(model, manager, tokens, agents, weights);
    let grads = loss.backward();
    used.iter().filter_map(|(name, adapter)| adapter_grads(adapter, &grads).map(|g| (name.clone(), g))).collect()
}

fn max_diff(a: &AdapterGrads, b: &AdapterGrads) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .map(|(site, (ga, gb))| {
            let (ha, hb) = &b[site];
            let da: f32 = (ga.clone() - ha.clone()).abs().max().into_scalar();
            let db: f32 = (gb.clone() - hb.clone()).abs().max().into_scalar();
            da.max(db)
        })
        .fold(0.0, f32::max)
}

#[test]
fn mixed_batch_gradients_equal_separate_passes() {
    let (model, manager, tokens) = setup();
    let agents = [Some(0), Some(1), Some(0), None];
    let weights = [1.0, -0.5, 2.0, 3.0];
    let mixed = grads_of(&model, &manager, &tokens, &agents, &weights);
    assert_eq!(mixed.len(), 2, "both adapters got a gradient");
    for (agent, name) in [(0usize, "agent_0"), (1, "agent_1")] {
        let rows: Vec<usize> = (0..4).filter(|&r| agents[r] == Some(agent)).collect();
        let own_tokens: Vec<Vec<u32>> = rows.iter().map(|&r| tokens[r].clone()).collect();
        let own_weights: Vec<f32> = rows.iter().map(|&r| weights[r]).collect();
        let alone = grads_of(&model, &manager, &own_tokens, &vec![Some(agent); rows.len()], &own_weights);
        let diff = max_diff(&mixed[name], &alone[name]);
        let norm: f32 =
            mixed[name].values().map(|(a, _)| a.clone().abs().max().into_scalar::<f32>()).fold(0.0, f32::max);
        // Equal up to float32 summation order: within 4e-6 of the gradient's scale (a row
        // leaking into another adapter's gradient would differ by a large fraction of it).
        assert!(
            diff < 4e-6 * norm.max(1.0),
            "{name}: mixed-batch gradient differs from its own pass by {diff} (scale {norm})"
        );
        assert!(norm > 1e-4, "{name}: the gradient is not trivially zero");
    }
}

fn host(adapter: &LoraAdapter) -> BTreeMap<String, Vec<u8>> {
    adapter
        .to_host()
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.values.iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect()
}

fn state_bytes(state: &AdamWState) -> Vec<u8> {
    let mut out = state.step.to_le_bytes().to_vec();
    for (ma, mb) in state.moments().values() {
        for t in [&ma.m, &ma.v, &mb.m, &mb.v] {
            out.extend(t.to_data().into_bytes().to_vec());
        }
    }
    out
}

#[test]
fn steps_on_one_agent_leave_the_others_byte_identical() {
    let (model, mut manager, tokens) = setup();
    let adamw = AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..AdamWConfig::default() };
    let mut states: BTreeMap<String, AdamWState> = BTreeMap::new();
    let base_before = model.lm.layers[0].self_attn.qkv_proj.dense_t().to_data().into_bytes().to_vec();
    let step =
        |manager: &mut MultiAdapterManager, states: &mut BTreeMap<String, AdamWState>, agents: &[Option<usize>]| {
            let grads = grads_of(&model, manager, &tokens, agents, &[1.0, 1.0, 1.0, 1.0]);
            for (name, g) in grads {
                let agent = name.strip_prefix("agent_").unwrap().parse::<usize>().unwrap();
                let state = states.entry(name).or_default();
                let updated = adamw.step(manager.adapter(agent).unwrap(), &g, state, adamw.lr);
                manager.set_adapter(agent, updated).unwrap();
            }
        };
    // Both agents learn once, so agent 1 has non-zero moments...
    step(&mut manager, &mut states, &[Some(0), Some(1), Some(0), Some(1)]);
    let adapter_1 = host(manager.adapter(1).unwrap());
    let state_1 = state_bytes(&states["agent_1"]);
    let adapter_0 = host(manager.adapter(0).unwrap());
    // ...then three steps on agent 0's rows only (and a bare-base row).
    for _ in 0..3 {
        step(&mut manager, &mut states, &[Some(0), None, Some(0), Some(0)]);
    }
    assert_eq!(host(manager.adapter(1).unwrap()), adapter_1, "agent 1's adapter is byte-identical");
    assert_eq!(state_bytes(&states["agent_1"]), state_1, "agent 1's AdamW state is byte-identical");
    assert_ne!(host(manager.adapter(0).unwrap()), adapter_0, "agent 0 did learn");
    assert_eq!(states["agent_0"].step, 4);
    let base_after = model.lm.layers[0].self_attn.qkv_proj.dense_t().to_data().into_bytes().to_vec();
    assert_eq!(base_before, base_after, "the base never changes");
}

#[test]
fn shared_mode_step_equals_the_scaled_accumulation() {
    let (model, _, tokens) = setup();
    let device = model.lm.device().clone();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    let config = troupe::adapters::AdapterConfig { r: 4, lora_alpha: 8.0, ..Default::default() };
    manager.create_shared_adapter(2, &config, 3).unwrap();
    // Give B non-zero values so every factor gets a gradient.
    let mut adapter = manager.adapter(0).unwrap().clone();
    for pair in adapter.pairs.values_mut() {
        let dims = pair.b.dims();
        let values: Vec<f32> = (0..dims[0] * dims[1]).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.01).collect();
        pair.b = Tensor::from_data(TensorData::new(values, dims), &device);
    }
    manager.set_adapter(0, adapter).unwrap();
    assert_eq!(manager.adapter_name(1).unwrap(), "shared");
    // Two agents x two samples each; agent = row / 2.
    let agents = [Some(0), Some(0), Some(1), Some(1)];
    let (samples, num_agents) = (2.0f32, 2.0f32);
    let scale = 1.0 / (samples * num_agents);
    let one_pass = grads_of(&model, &manager, &tokens, &agents, &[scale; 4]);
    // Accumulate each sample's scaled gradient separately.
    let mut accumulated: Option<AdapterGrads> = None;
    for row in 0..4 {
        let g = grads_of(&model, &manager, &[tokens[row].clone()], &[agents[row]], &[scale]).remove("shared").unwrap();
        accumulated = Some(match accumulated {
            None => g,
            Some(acc) => {
                acc.into_iter().map(|(site, (a, b))| (site, (a + g[&site].0.clone(), b + g[&site].1.clone()))).collect()
            }
        });
    }
    let accumulated = accumulated.unwrap();
    assert!(max_diff(&one_pass["shared"], &accumulated) < common::tolerance(1e-5));
    let adamw = AdamWConfig::default();
    let (mut s1, mut s2) = (AdamWState::default(), AdamWState::default());
    let a = adamw.step(manager.adapter(0).unwrap(), &one_pass["shared"], &mut s1, 1e-3).to_host().unwrap();
    let b = adamw.step(manager.adapter(0).unwrap(), &accumulated, &mut s2, 1e-3).to_host().unwrap();
    for (name, t) in &a {
        let d = t.values.iter().zip(&b[name].values).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(d < 1e-6, "{name}: one step differs from the accumulated step by {d}");
    }
    let tmp = tempfile::tempdir().unwrap();
    manager.save_adapters(&tmp.path().join("a")).unwrap();
    let saved: Vec<String> = std::fs::read_dir(tmp.path().join("a"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let mut saved = saved;
    saved.sort();
    assert_eq!(saved, vec!["shared".to_string(), "troupe.json".to_string()], "saved once, under shared/");
}

/// The adapters' gradients on the device of `TROUPE_TEST_DEVICE` against the CPU's, through the
/// whole scored forward and its backward: one adapter on all seven projections (the stacked
/// q/k/v parts and the SwiGLU gate with both deltas), one on q and v only (a part without a
/// delta, the MLP without). On a GPU this runs troupe's kernels with backwards of their own (the
/// RMS norm, the rotary embedding, the stacked parts, the gate, the LM head's log-probs); on the
/// CPU it compares the CPU with itself.
#[test]
fn adapter_gradients_on_the_test_device_match_the_cpus() {
    let agents = [Some(0), Some(1), Some(0), Some(1)];
    let weights = [1.0, -0.5, 2.0, 0.75];
    let (model, manager, tokens) = setup();
    let got = grads_of(&model, &manager, &tokens, &agents, &weights);
    let (cpu_model, cpu_manager, cpu_tokens) = setup_on(&burn::tensor::Device::flex());
    let want = grads_of(&cpu_model, &cpu_manager, &cpu_tokens, &agents, &weights);
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    let host = |t: &Tensor<2>| -> Vec<f32> { t.to_data().convert::<f32>().try_into_vec::<f32>().unwrap() };
    for (name, sites) in &want {
        assert_eq!(sites.keys().collect::<Vec<_>>(), got[name].keys().collect::<Vec<_>>(), "{name}: sites");
        let scale =
            sites.values().flat_map(|(a, b)| host(a).into_iter().chain(host(b))).fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 1e-4, "{name}: the gradient is not trivially zero");
        for (site, (want_a, want_b)) in sites {
            let (got_a, got_b) = &got[name][site];
            for (what, g, w) in [("A", got_a, want_a), ("B", got_b, want_b)] {
                let worst = host(g).iter().zip(host(w)).map(|(g, w)| (g - w).abs()).fold(0.0f32, f32::max);
                assert!(
                    worst <= common::tolerance(1e-4) * scale,
                    "{name} {site:?} {what}: off by {worst} at scale {scale}"
                );
            }
        }
    }
}

/// A batch as a MAGRPO iteration gives the update: groups of replies sharing a prompt (the
/// update runs each shared prompt once and the replies after its keys and values), a lone
/// reply, and `choice` decisions, from both agents.
fn update_batch(model: &Model) -> troupe::rl::credit::batch::TrainBatch {
    use troupe::rl::credit::batch::{TrainBatch, TrainRow};
    use troupe::rl::rollout::ChoiceTurn;
    let enc = |t: &str| model.tokenizer.encode(t).unwrap();
    let mut rows = Vec::new();
    for (i, (prompt, reply, agent, advantage)) in [
        ("Player 1 hints red to player 2. Your move:", " play card 0", 0, 1.0),
        ("Player 1 hints red to player 2. Your move:", " discard card 3 now", 0, -0.5),
        ("def main(xs):\n    return", " helper(xs)", 1, 0.75),
        ("def main(xs):\n    return", " sorted(xs)[::-1]", 1, -1.25),
        ("North opens 1NT.", " Pass", 0, 0.5),
    ]
    .into_iter()
    .enumerate()
    {
        let mut tokens = enc(prompt);
        let prompt_len = tokens.len();
        tokens.extend(enc(reply));
        let units = tokens.len() - prompt_len;
        let sampling_logprobs = vec![-2.0 - 0.1 * i as f32; units];
        rows.push(TrainRow {
            agent,
            tokens,
            prompt_len,
            advantage,
            sampling_logprobs,
            choice: None,
            reference_logprobs: None,
        });
    }
    for (agent, prompt, advantage) in [(1, "Your turn. Legal: play 1-5", 1.5), (0, "Bid:", -0.5)] {
        let tokens = enc(prompt);
        let candidates = vec![enc("play 1"), enc("discard 3"), enc("hint red")];
        rows.push(TrainRow {
            agent,
            prompt_len: tokens.len(),
            tokens,
            advantage,
            sampling_logprobs: vec![-1.1],
            choice: Some(ChoiceTurn { candidates, chosen: 1, entropy: 0.0 }),
            reference_logprobs: None,
        });
    }
    TrainBatch { rows }
}

/// The update's whole gradient pass (`Scorer::gradients`: shared prompts run once, `choice`
/// decisions, micro-batches) on the test device, without and with activation checkpointing, and
/// with each prompt's keys and values held once for its replies or copied to each, against the
/// CPU's plain pass: the loss and both fixture adapters' gradients (one on all seven
/// projections, one on q and v), within 1e-4 of their scale. On a GPU this runs every kernel
/// with a backward of its own, the attention over a shared prompt's keys and values among them.
#[test]
fn the_updates_gradient_pass_on_the_test_device_matches_the_cpus() {
    use troupe::generate::choice::ChoiceScore;
    use troupe::rl::objective::{KlEstimator, KlPenalty, Objective, ObjectiveConfig, ObjectiveKind};
    use troupe::rl::update::{GradientPass, Scorer};

    let objective = Objective {
        config: ObjectiveConfig { kind: ObjectiveKind::Magrpo, ..ObjectiveConfig::default() },
        kl: KlPenalty { coef: 0.0, estimator: KlEstimator::K3 },
    };
    let pass = |device: &burn::tensor::Device, gradient_checkpointing: bool, cache: PromptCache| -> GradientPass {
        let (mut model, manager, _) = setup_on(device);
        model.lm.set_prompt_cache(cache);
        let scorer = Scorer {
            model: &model,
            manager: &manager,
            micro_batch_rows: 4,
            micro_batch_tokens: None,
            gradient_checkpointing,
            temperature: 1.0,
            choice_score: ChoiceScore::Sum,
            max_new_tokens: 8,
            skip_zero_advantage: true,
        };
        scorer.gradients(&update_batch(&model), &objective, 3).unwrap()
    };
    let want = pass(&burn::tensor::Device::flex(), false, PromptCache::Copied);
    let host = |t: &Tensor<2>| -> Vec<f32> { t.to_data().convert::<f32>().try_into_vec::<f32>().unwrap() };
    let cases = [
        (false, PromptCache::Auto),
        (true, PromptCache::Auto),
        (false, PromptCache::Shared),
        (false, PromptCache::Copied),
        (true, PromptCache::Copied),
    ];
    for (checkpointing, cache) in cases {
        let got = pass(&common::test_device(), checkpointing, cache);
        let case = format!("gradient checkpointing {checkpointing}, prompt cache {}", cache.name());
        let loss_bound = f64::from(common::tolerance(1e-5)) * want.loss.abs().max(1.0);
        assert!((got.loss - want.loss).abs() <= loss_bound, "{case}: loss {} vs the CPU's {}", got.loss, want.loss);
        assert_eq!(got.grads.keys().collect::<Vec<_>>(), want.grads.keys().collect::<Vec<_>>(), "{case}");
        for (name, sites) in &want.grads {
            let scale = sites
                .values()
                .flat_map(|(a, b)| host(a).into_iter().chain(host(b)))
                .fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(scale > 1e-4, "{case}, {name}: the gradient is not trivially zero");
            for (site, (want_a, want_b)) in sites {
                let (got_a, got_b) = &got.grads[name][site];
                for (what, g, w) in [("A", got_a, want_a), ("B", got_b, want_b)] {
                    let worst = host(g).iter().zip(host(w)).map(|(g, w)| (g - w).abs()).fold(0.0f32, f32::max);
                    assert!(
                        worst <= common::tolerance(1e-4) * scale,
                        "{case}, {name} {site:?} {what}: off by {worst} at scale {scale}"
                    );
                }
            }
        }
    }
}
