//! Decoding's draw on a GPU (`troupe::generate::sampler::sample_on_device`): each row's token
//! drawn on the device from the candidates the host's sampler keeps (temperature, top-k, top-p,
//! ties at the boundary by lowest id), walked in id order to the row's uniform share of their
//! mass. Checked on the test device (`TROUPE_TEST_DEVICE`) against a definition written here in
//! f64, and by frequencies; on the CPU every draw stays on the host.

use crate::common;

use burn::tensor::{Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe::generate::sampler::{on_device, sample_on_device};
use troupe::generate::SamplingConfig;

/// The token the definition draws for one row and uniform `u`, and how close `u` lies (as a share
/// of the kept mass) to the edge of that token's range: the kept candidates are the first in
/// the order (weight down, id up) whose mass reaches `top_p` of the top-k's, walked in id order.
fn drawn(logits: &[f32], config: &SamplingConfig, u: f32) -> (u32, f64) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if config.is_greedy() {
        let first = logits.iter().position(|&x| x == max).unwrap();
        return (first as u32, 1.0);
    }
    let weights: Vec<f64> = logits.iter().map(|&x| f64::from(((x - max) / config.temperature).exp())).collect();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    if config.top_k > 0 && config.top_k < order.len() {
        order.truncate(config.top_k);
    }
    if config.top_p < 1.0 {
        let total: f64 = order.iter().map(|&i| weights[i]).sum();
        let mut cumulative = 0.0;
        let keep = order
            .iter()
            .position(|&i| {
                cumulative += weights[i];
                cumulative >= f64::from(config.top_p) * total
            })
            .map_or(order.len(), |n| n + 1);
        order.truncate(keep);
    }
    order.sort_unstable();
    let total: f64 = order.iter().map(|&i| weights[i]).sum();
    let target = f64::from(u) * total;
    let mut before = 0.0;
    for &i in &order {
        let after = before + weights[i];
        if target < after {
            let margin = ((target - before) / total).min((after - target) / total);
            return (i as u32, margin);
        }
        before = after;
    }
    (*order.last().unwrap() as u32, 0.0)
}

fn log_softmax_at(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    f64::from(logits[token as usize]) - (sum.ln() + f64::from(max))
}

#[test]
fn device_draws_are_the_kept_candidates_walked_in_id_order() {
    check_draws(
        &[
            SamplingConfig { temperature: 1.0, top_k: 0, top_p: 1.0 },
            SamplingConfig { temperature: 0.8, top_k: 0, top_p: 0.95 },
            SamplingConfig { temperature: 1.0, top_k: 0, top_p: 0.3 },
            SamplingConfig { temperature: 1.0, top_k: 40, top_p: 1.0 },
            SamplingConfig { temperature: 0.7, top_k: 50, top_p: 0.9 },
            SamplingConfig { temperature: 1.3, top_k: 3, top_p: 0.5 },
            SamplingConfig::greedy(),
            SamplingConfig { temperature: 1.0, top_k: 1, top_p: 1.0 },
        ],
        11,
        true,
    );
}

#[test]
fn device_draws_find_boundaries_among_tiny_weights_and_near_the_whole_mass() {
    check_draws(
        &[
            // Most weights 0 or subnormal: the boundary among the few that are not.
            SamplingConfig { temperature: 0.05, top_k: 0, top_p: 0.999 },
            // The nucleus a few tokens short of the top-k set.
            SamplingConfig { temperature: 1.0, top_k: 200, top_p: 0.999_999 },
        ],
        12,
        // All-equal weights keep `ceil(top_p * vocab)` of them, which rounding in f32 against
        // the definition's f64 may tell apart by one token near an integer.
        false,
    );
}

/// Each config's device draws against [`drawn`], over rows of 7, 300 and 5,000 logits: half of
/// them from a few values (ties, at the top-k and top-p boundaries too), half continuous, and
/// the first all equal if `equal_row`.
fn check_draws(configs: &[SamplingConfig], seed: u64, equal_row: bool) {
    let device = common::test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for vocab in [7usize, 300, 5000] {
        let rows = 24;
        let mut values: Vec<f32> = Vec::with_capacity(rows * vocab);
        for row in 0..rows {
            for _ in 0..vocab {
                values.push(match row {
                    0 if equal_row => 0.5,
                    r if r % 2 == 1 => f32::from(rng.random_range(0u8..12)) * 0.5 - 3.0,
                    _ => rng.random_range(-4.0f32..4.0),
                });
            }
        }
        let logits = Tensor::<2>::from_data(TensorData::new(values.clone(), [rows, vocab]), &device);
        for config in configs {
            if !on_device(&logits, config) {
                // The CPU draws on the host (as does a GPU asked for burn's composites).
                let composites = troupe::device::fused_gpu_kernels().is_ok_and(|ours| !ours);
                assert!(device == burn::tensor::Device::flex() || composites, "a GPU draws on the device");
                return;
            }
            let uniforms: Vec<f32> = (0..rows).map(|_| rng.random::<f32>()).collect();
            let got = sample_on_device(&logits, &uniforms, config).unwrap();
            assert_eq!(got.len(), rows);
            let mut near_edges = 0;
            for (row, &(token, logprob)) in got.iter().enumerate() {
                let row_logits = &values[row * vocab..(row + 1) * vocab];
                let (want, margin) = drawn(row_logits, config, uniforms[row]);
                if token != want {
                    // Only a draw within rounding of its range's edge may land next door.
                    assert!(margin < 1e-4, "vocab {vocab}, {config:?}, row {row}: drew {token}, want {want}");
                    near_edges += 1;
                }
                let exact = log_softmax_at(row_logits, token);
                assert!((f64::from(logprob) - exact).abs() < 1e-4, "row {row}: log-prob {logprob} vs {exact}");
            }
            assert!(near_edges <= 1, "vocab {vocab}, {config:?}: {near_edges} draws next to the defined ones");
        }
    }
}

#[test]
fn device_draws_follow_the_renormalised_nucleus() {
    let device = common::test_device();
    // softmax([2, 1, 0, -1]) = [0.644, 0.237, 0.087, 0.032]: top-p 0.9 keeps three tokens.
    let rows = 20_000;
    let values: Vec<f32> = (0..rows).flat_map(|_| [2.0f32, 1.0, 0.0, -1.0]).collect();
    let logits = Tensor::<2>::from_data(TensorData::new(values, [rows, 4]), &device);
    let config = SamplingConfig { temperature: 1.0, top_k: 0, top_p: 0.9 };
    if !on_device(&logits, &config) {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let uniforms: Vec<f32> = (0..rows).map(|_| rng.random::<f32>()).collect();
    let mut counts = [0usize; 4];
    for (token, _) in sample_on_device(&logits, &uniforms, &config).unwrap() {
        counts[token as usize] += 1;
    }
    assert_eq!(counts[3], 0, "the fourth token is outside the nucleus");
    let kept = [0.644f64, 0.237, 0.087];
    let sum: f64 = kept.iter().sum();
    for (count, p) in counts.iter().zip(kept) {
        let freq = *count as f64 / rows as f64;
        assert!((freq - p / sum).abs() < 0.01, "{freq} vs {}", p / sum);
    }
}
