//! Floating-point work of an iteration, counted as the useful multiply-adds of the model's
//! matrices (2 FLOPs each), the way MFU figures count them: the linear projections of every
//! token, the attention scores and weighted values of every (query, key) pair a causal or
//! packed layout lets a token see, and the LM head where logits are read. Padding and the
//! elementwise work (norms, RoPE, softmax) are not counted, nor are the LoRA factors' low-rank
//! products.
//!
//! A backward pass through the frozen base counts the products it computes
//! ([`FlopModel::with_backward`]): a frozen projection's backward is the gradient of its input
//! alone (one product, as many FLOPs as its forward: the frozen weight gets no gradient), the
//! LM head's likewise, attention's the gradients of the queries, keys and values (four
//! products, twice its forward's two). So a training step through the base is about twice its
//! forward, not the three times of full fine-tuning's MFU convention (which counts the weights'
//! gradients too). Recomputation (activation checkpointing, and on a GPU the attention's scores
//! recomputed in its backward) is not useful work and is not counted.

use crate::model::ModelConfig;

/// The per-token and per-pair costs of one model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlopModel {
    /// FLOPs of every linear projection of one token through all layers.
    pub linear_per_token: f64,
    /// FLOPs of one (query, key) pair through all layers' attention (scores and values).
    pub attention_per_pair: f64,
    /// FLOPs of the LM head at one position.
    pub head_per_position: f64,
}

impl FlopModel {
    /// The costs of `config`'s architecture.
    pub fn new(config: &ModelConfig) -> Self {
        let (h, i) = (config.hidden_size as f64, config.intermediate_size as f64);
        let q = (config.num_attention_heads * config.head_dim) as f64;
        let kv = (config.num_key_value_heads * config.head_dim) as f64;
        let layers = config.num_hidden_layers as f64;
        let per_layer = h * (q + 2.0 * kv) + q * h + 3.0 * h * i;
        Self {
            linear_per_token: 2.0 * per_layer * layers,
            attention_per_pair: 2.0 * 2.0 * q * layers,
            head_per_position: 2.0 * h * config.vocab_size as f64,
        }
    }

    /// The costs of a forward pass and its backward through the frozen base (module docs): the
    /// projections and the head twice their forward, attention three times.
    pub fn with_backward(self) -> Self {
        Self {
            linear_per_token: 2.0 * self.linear_per_token,
            attention_per_pair: 3.0 * self.attention_per_pair,
            head_per_position: 2.0 * self.head_per_position,
        }
    }

    /// Forward FLOPs of one causal sequence of `len` tokens with logits at `logits` positions.
    pub fn causal(&self, len: usize, logits: usize) -> f64 {
        let n = len as f64;
        n * self.linear_per_token
            + n * (n + 1.0) / 2.0 * self.attention_per_pair
            + logits as f64 * self.head_per_position
    }

    /// Forward FLOPs of `len` tokens that continue a cached prefix of `prefix` tokens (each
    /// sees the prefix and its own earlier tokens), with logits at `logits` positions:
    /// `causal(prefix, 0) + continuation(prefix, len, logits) == causal(prefix + len, logits)`.
    pub fn continuation(&self, prefix: usize, len: usize, logits: usize) -> f64 {
        let (p, c) = (prefix as f64, len as f64);
        c * self.linear_per_token
            + (c * p + c * (c + 1.0) / 2.0) * self.attention_per_pair
            + logits as f64 * self.head_per_position
    }

    /// Forward FLOPs of sequences that share prefixes computed once per distinct prefix
    /// ([`crate::generate::prefix`]): `rows` holds each row's (prefix key, prefix length, length
    /// after the prefix, logit positions); a key's prefix counts once.
    pub fn shared_prefixes<K: Eq + std::hash::Hash>(
        &self,
        rows: impl IntoIterator<Item = (K, usize, usize, usize)>,
    ) -> f64 {
        let mut seen = std::collections::HashSet::new();
        rows.into_iter()
            .map(|(key, prefix, len, logits)| {
                let first = if seen.insert(key) { self.causal(prefix, 0) } else { 0.0 };
                first + self.continuation(prefix, len, logits)
            })
            .sum()
    }

    /// Forward FLOPs of one packed `choice` decision: a prompt of `prompt` tokens, then
    /// candidates of `candidates[k]` tokens each seeing the prompt and their own earlier tokens;
    /// logits at the prompt's last position and at every candidate token but the last.
    pub fn packed_choice(&self, prompt: usize, candidates: &[usize]) -> f64 {
        let mut flops = self.causal(prompt, 1);
        for &c in candidates {
            flops += self.continuation(prompt, c, c.saturating_sub(1));
        }
        flops
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn counts_match_the_architecture_by_hand() {
        // Tiny preset: hidden 128, intermediate 384, 4 layers, 4 heads x 32, 2 KV heads x 32,
        // vocab 1024.
        let f = FlopModel::new(&Preset::Tiny.config());
        let per_layer = 128.0 * (128.0 + 64.0 + 64.0) + 128.0 * 128.0 + 3.0 * 128.0 * 384.0;
        assert_eq!(f.linear_per_token, 2.0 * 4.0 * per_layer);
        assert_eq!(f.attention_per_pair, 4.0 * 128.0 * 4.0);
        assert_eq!(f.head_per_position, 2.0 * 128.0 * 1024.0);
        // Two tokens: 2 linear passes, pairs (0,0), (1,0), (1,1), one head position.
        assert_eq!(f.causal(2, 1), 2.0 * f.linear_per_token + 3.0 * f.attention_per_pair + f.head_per_position);
        // A packed decision with one candidate equals the causal sequence of prompt + candidate
        // with logits at the candidate's positions.
        assert!((f.packed_choice(5, &[3]) - f.causal(8, 3)).abs() < 1e-6);
        // A continuation completes its prefix's sequence; a shared prefix counts once.
        assert!((f.causal(5, 0) + f.continuation(5, 3, 2) - f.causal(8, 2)).abs() < 1e-6);
        let shared = f.shared_prefixes([(0, 5, 3, 3), (0, 5, 2, 2), (1, 4, 3, 3)]);
        let expected = f.causal(5, 0) + f.continuation(5, 3, 3) + f.continuation(5, 2, 2) + f.causal(7, 3);
        assert!((shared - expected).abs() < 1e-6);
        // Forward and backward: the projections' and head's products twice, attention's three
        // times (the backward's dQ, dK, dV and dP beside the forward's scores and values).
        let b = f.with_backward();
        let want = 2.0 * 2.0 * f.linear_per_token + 3.0 * 3.0 * f.attention_per_pair + 2.0 * f.head_per_position;
        assert!((b.causal(2, 1) - want).abs() < 1e-6);
    }
}
