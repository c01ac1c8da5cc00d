//! Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus), driven
//! by a seeded `ChaCha8Rng` so the same seed gives the same text.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

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
pub fn sample(logits: &[f32], config: &SamplingConfig, rng: &mut ChaCha8Rng) -> u32 {
    if config.is_greedy() {
        return argmax(logits) as u32;
    }
    let probs = filtered_probs(logits, config);
    let total: f32 = probs.iter().map(|(_, p)| p).sum();
    let mut target = rng.random::<f32>() * total;
    for (id, p) in &probs {
        if target < *p {
            return *id as u32;
        }
        target -= p;
    }
    probs.last().map_or(0, |(id, _)| *id as u32)
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
