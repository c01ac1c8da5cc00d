//! Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus), driven
//! by a seeded `ChaCha8Rng` so the same seed gives the same text on the same device. On the
//! host ([`sample`]) each row's logits are read back; on a GPU ([`sample_on_device`]) the same
//! candidates are drawn from where the logits are.

use burn::tensor::Tensor;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::model::fused::vexp;

/// How to pick the next token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingConfig {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1.0 = no limit).
    pub top_p: f32,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self { temperature: 1.0, top_k: 0, top_p: 1.0 }
    }
}

impl SamplingConfig {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0 }
    }

    /// Whether this config always takes the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// Index of the largest value (the first one on ties, as `torch.argmax` does).
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// Samples a token id from one row of logits.
///
/// The candidates are those of [`filtered_probs`] (the same set), found without sorting the
/// vocabulary: a selection by probability mass ([`nucleus`]) takes linear time where a sort of
/// 32000 keys per row and token took an eighth of a decoding step. The draw walks the
/// candidates in the order the selection leaves them, so a seed gives other tokens than a
/// walk in sorted order would, from the same distribution.
pub fn sample(logits: &[f32], config: &SamplingConfig, rng: &mut ChaCha8Rng) -> u32 {
    if config.is_greedy() {
        return argmax(logits) as u32;
    }
    let mut keys = probability_keys(logits, config);
    let mut kept = keys.as_mut_slice();
    if config.top_k > 0 && config.top_k < kept.len() {
        kept.select_nth_unstable(config.top_k - 1);
        kept = &mut kept[..config.top_k];
    }
    if config.top_p < 1.0 {
        let total: f64 = kept.iter().map(|&k| f64::from(key_probability(k))).sum();
        let keep = nucleus(kept, f64::from(config.top_p) * total);
        kept = &mut kept[..keep];
    }
    let total: f32 = kept.iter().map(|&k| key_probability(k)).sum();
    let mut target = rng.random::<f32>() * total;
    for &key in kept.iter() {
        let p = key_probability(key);
        if target < p {
            return key_token(key);
        }
        target -= p;
    }
    kept.last().map_or(0, |&k| key_token(k))
}

/// Whether [`sample_on_device`] draws from `logits`: plain f32 logits on a GPU (CUDA, wgpu)
/// with troupe's kernels on (`TROUPE_GPU_KERNELS`); never on the CPU, where [`sample`] draws
/// each row on the host.
pub fn on_device(logits: &Tensor<2>, config: &SamplingConfig) -> bool {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        crate::model::fused::gpu::samples(logits, config.temperature, config.top_p)
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    {
        let _ = (logits, config);
        false
    }
}

/// Each row's token and its log-probability (`log softmax(logits)[token]` at temperature 1)
/// drawn where the logits are, for logits [`on_device`] takes: the candidates of [`sample`]
/// (temperature, top-k, top-p, ties at the boundary by lowest id), walked in token-id order to
/// `uniforms[row]` (in `[0, 1)`, one a row, as [`sample`] draws one) of their mass. The same
/// distribution as [`sample`]'s, walked in another order, so a seed gives other tokens than on
/// the host; greedy configurations take the first maximum, as [`argmax`] does.
///
/// # Panics
/// If [`on_device`] does not take `logits`, or `uniforms` is not one value a row.
///
/// # Shapes
/// `logits`: `[rows, vocab]`, `uniforms`: `rows` -> `rows` (token, log-prob) pairs
///
/// # Errors
/// [`crate::TroupeError::Device`] when the device failed (this or an earlier kernel).
pub fn sample_on_device(
    logits: &Tensor<2>,
    uniforms: &[f32],
    config: &SamplingConfig,
) -> crate::Result<Vec<(u32, f32)>> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        crate::model::fused::gpu::sample_rows(logits, uniforms, config.temperature, config.top_k, config.top_p)
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    {
        let _ = (logits, uniforms, config);
        panic!("sampling on a device needs a GPU backend (`--features cuda` or `wgpu`)")
    }
}

/// One key per token that orders by decreasing probability, then increasing id: a total
/// order (a probability is a non-negative float, whose bits order as integers do; inverted,
/// they sort in decreasing order), with the token id in the low half.
fn probability_keys(logits: &[f32], config: &SamplingConfig) -> Vec<u64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits.iter().map(|l| (l - max) / config.temperature).collect();
    vexp::exp_in_place(&mut probs);
    probs.iter().enumerate().map(|(i, p)| (u64::from(!p.to_bits()) << 32) | i as u64).collect()
}

/// The unnormalised probability a key holds.
fn key_probability(key: u64) -> f32 {
    f32::from_bits(!((key >> 32) as u32))
}

/// The token id a key holds.
fn key_token(key: u64) -> u32 {
    (key & 0xffff_ffff) as u32
}

/// Reorders `keys` so that its first `n` entries are the `n` smallest keys (the most probable
/// tokens) for the least `n` whose probabilities reach `mass`, and returns `n` (at least 1,
/// at most all). Quickselect on the mass: each round splits the undecided range at its middle
/// key and keeps the half that holds the boundary, so the work is linear in expectation.
pub fn nucleus(keys: &mut [u64], mass: f64) -> usize {
    let (mut lo, mut hi) = (0, keys.len());
    let mut before = 0.0f64;
    while hi - lo > 32 {
        let mid = lo + (hi - lo) / 2;
        keys[lo..hi].select_nth_unstable(mid - lo);
        let upper: f64 = keys[lo..=mid].iter().map(|&k| f64::from(key_probability(k))).sum();
        if before + upper >= mass {
            hi = mid + 1;
        } else {
            before += upper;
            lo = mid + 1;
        }
    }
    keys[lo..hi].sort_unstable();
    for (i, &key) in keys[lo..hi].iter().enumerate() {
        before += f64::from(key_probability(key));
        if before >= mass {
            return lo + i + 1;
        }
    }
    hi.max(1).min(keys.len())
}

/// The (id, unnormalised probability) pairs that survive temperature, top-k and top-p, sorted
/// by decreasing probability.
pub fn filtered_probs(logits: &[f32], config: &SamplingConfig) -> Vec<(usize, f32)> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    // Sorted by decreasing probability, ties by increasing id: a total order, so an unstable
    // sort of one integer key per token gives it exactly (a probability is a non-negative
    // float, whose bits order as integers do; inverted, they sort in decreasing order).
    let mut keys: Vec<u64> = logits
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let p = ((l - max) / config.temperature).exp();
            (u64::from(!p.to_bits()) << 32) | i as u64
        })
        .collect();
    keys.sort_unstable();
    let mut probs: Vec<(usize, f32)> =
        keys.into_iter().map(|k| ((k & 0xffff_ffff) as usize, f32::from_bits(!((k >> 32) as u32)))).collect();
    if config.top_k > 0 && config.top_k < probs.len() {
        probs.truncate(config.top_k);
    }
    if config.top_p < 1.0 {
        let total: f32 = probs.iter().map(|(_, p)| p).sum();
        let mut cumulative = 0.0;
        let mut keep = probs.len();
        for (i, (_, p)) in probs.iter().enumerate() {
            cumulative += p / total;
            if cumulative >= config.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep.max(1));
    }
    probs
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn greedy_takes_first_max() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample(&[0.1, 3.0, 2.0], &SamplingConfig::greedy(), &mut rng), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [2.0, 1.0, 0.0, -1.0];
        let k2 = SamplingConfig { temperature: 1.0, top_k: 2, top_p: 1.0 };
        assert_eq!(filtered_probs(&logits, &k2).iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
        // softmax([2,1,0,-1]) = [0.644, 0.237, 0.087, 0.032]: p=0.85 keeps two, p=0.9 three.
        let p85 = SamplingConfig { temperature: 1.0, top_k: 0, top_p: 0.85 };
        assert_eq!(filtered_probs(&logits, &p85).len(), 2);
        let p90 = SamplingConfig { temperature: 1.0, top_k: 0, top_p: 0.9 };
        assert_eq!(filtered_probs(&logits, &p90).len(), 3);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for _ in 0..200 {
            assert!(sample(&logits, &k2, &mut rng) < 2);
        }
    }

    #[test]
    fn probabilities_come_sorted_by_decreasing_value_then_id() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        // Ties included: logits drawn from a few values.
        let logits: Vec<f32> = (0..2000).map(|_| f32::from(rng.random_range(0u8..40)) * 0.25 - 3.0).collect();
        let config = SamplingConfig { temperature: 0.7, top_k: 0, top_p: 1.0 };
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut expected: Vec<(usize, f32)> =
            logits.iter().enumerate().map(|(i, l)| (i, ((l - max) / config.temperature).exp())).collect();
        expected.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        assert_eq!(filtered_probs(&logits, &config), expected);
    }

    #[test]
    fn the_selection_keeps_the_sorted_nucleus() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for (vocab, top_p, top_k) in [(5000, 0.95, 0), (5000, 0.3, 0), (3000, 0.9, 40), (100, 0.0, 0), (7, 0.999, 0)] {
            // Ties included: logits drawn from a few values.
            let logits: Vec<f32> = (0..vocab).map(|_| f32::from(rng.random_range(0u8..60)) * 0.2 - 6.0).collect();
            let config = SamplingConfig { temperature: 0.8, top_k, top_p };
            // The definition, in f64: the most probable tokens (ties by id) in sorted order until
            // their share reaches top_p. (`filtered_probs` sums in f32 and may keep one more tied
            // token where the share lands on top_p within rounding.)
            let sorted = filtered_probs(&logits, &SamplingConfig { top_p: 1.0, ..config.clone() });
            let total: f64 = sorted.iter().map(|&(_, p)| f64::from(p)).sum();
            let mut cumulative = 0.0;
            let keep = sorted
                .iter()
                .position(|&(_, p)| {
                    cumulative += f64::from(p);
                    cumulative >= f64::from(top_p) * total
                })
                .map_or(sorted.len(), |i| i + 1);
            let mut want: Vec<usize> = sorted[..keep].iter().map(|&(id, _)| id).collect();
            let close: Vec<usize> = filtered_probs(&logits, &config).into_iter().map(|(id, _)| id).collect();
            assert!(
                close.len().abs_diff(want.len()) <= 1
                    && close[..keep.min(close.len())] == want[..keep.min(close.len())]
            );
            let mut keys = probability_keys(&logits, &config);
            let mut kept = keys.as_mut_slice();
            if top_k > 0 {
                kept.select_nth_unstable(top_k - 1);
                kept = &mut kept[..top_k];
            }
            let total: f64 = kept.iter().map(|&k| f64::from(key_probability(k))).sum();
            let n = nucleus(kept, f64::from(top_p) * total);
            let mut got: Vec<usize> = kept[..n].iter().map(|&k| key_token(k) as usize).collect();
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "vocab {vocab}, top_p {top_p}, top_k {top_k}");
        }
    }

    #[test]
    fn top_p_draws_follow_the_renormalised_nucleus() {
        // softmax([2,1,0,-1]) = [0.644, 0.237, 0.087, 0.032]: p = 0.9 keeps three tokens.
        let logits = [2.0, 1.0, 0.0, -1.0];
        let config = SamplingConfig { temperature: 1.0, top_k: 0, top_p: 0.9 };
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut counts = [0usize; 4];
        for _ in 0..20000 {
            counts[sample(&logits, &config, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[3], 0);
        let kept = [0.644f64, 0.237, 0.087];
        let sum: f64 = kept.iter().sum();
        for (count, p) in counts.iter().zip(kept) {
            let freq = *count as f64 / 20000.0;
            assert!((freq - p / sum).abs() < 0.015, "{freq} vs {}", p / sum);
        }
    }

    #[test]
    fn same_seed_same_samples_and_frequencies_follow_softmax() {
        let logits = [1.0, 0.0];
        let config = SamplingConfig::default();
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..4000).map(|_| sample(&logits, &config, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        let zeros = draw(5).iter().filter(|t| **t == 0).count() as f64 / 4000.0;
        let expected = 1.0 / (1.0 + (-1.0f64).exp());
        assert!((zeros - expected).abs() < 0.03, "{zeros} vs {expected}");
    }
}
