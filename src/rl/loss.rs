//! The MAGRPO policy loss over a scored batch: every generated token of an agent is weighted by
//! its sample's advantage, `loss = -sum(advantage * log p) / tokens`, plus an optional KL penalty
//! to the base model (whose log-probs come from the same model with adapters switched off).

use burn::tensor::{Device, Tensor, TensorData};

use crate::error::{Result, TroupeError};

/// Which next-token positions count and with what weight, for a `[rows, positions]` batch of
/// log-probs (`positions` = tokens per row - 1; position `t` scores token `t + 1`).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenWeights {
    /// `[rows][positions]`: the advantage on generated tokens, 0 on prompt and padding.
    pub advantage: Vec<Vec<f32>>,
    /// `[rows][positions]`: whether the position is a generated token (counted in the mean).
    pub counted: Vec<Vec<bool>>,
}

impl TokenWeights {
    /// Weights for rows whose tokens `prompt_len[r]..len[r]` were generated, each row carrying
    /// one advantage, padded to `positions`.
    pub fn for_completions(prompt_len: &[usize], len: &[usize], advantage: &[f32], positions: usize) -> Self {
        let mut weights = Self { advantage: Vec::new(), counted: Vec::new() };
        for ((&p, &n), &a) in prompt_len.iter().zip(len).zip(advantage) {
            // Token k (k >= p) is scored at position k - 1.
            let counted: Vec<bool> = (0..positions).map(|t| t + 1 >= p && t + 1 < n).collect();
            weights.advantage.push(counted.iter().map(|&c| if c { a } else { 0.0 }).collect());
            weights.counted.push(counted);
        }
        weights
    }

    /// Number of counted tokens.
    pub fn num_tokens(&self) -> usize {
        self.counted.iter().flatten().filter(|c| **c).count()
    }

    /// The per-token weights and the 0/1 mask of counted tokens, on `device`.
    ///
    /// # Shapes
    /// both `[rows, positions]`
    pub fn tensors(&self, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let rows = self.advantage.len();
        let positions = self.advantage.first().map_or(0, Vec::len);
        let adv: Vec<f32> = self.advantage.iter().flatten().copied().collect();
        let mask: Vec<f32> = self.counted.iter().flatten().map(|&c| if c { 1.0 } else { 0.0 }).collect();
        (
            Tensor::from_data(TensorData::new(adv, [rows, positions]), device),
            Tensor::from_data(TensorData::new(mask, [rows, positions]), device),
        )
    }
}

/// `-sum(advantage * logp) / N` over counted tokens, plus `kl_coef * sum(k3) / N` when
/// `reference` (the base model's log-probs, no gradient) is given, with the non-negative
/// estimator `k3 = exp(ref - logp) - (ref - logp) - 1`. `scale` multiplies the whole loss
/// (shared mode's 1 / (samples x agents) accumulation uses it).
///
/// # Shapes
/// `logprobs`, `reference`: `[rows, positions]` -> `[1]`
pub fn policy_loss(
    logprobs: Tensor<2>,
    weights: &TokenWeights,
    reference: Option<(Tensor<2>, f64)>,
    scale: f64,
) -> Result<Tensor<1>> {
    let dims = logprobs.dims();
    if weights.advantage.len() != dims[0] || weights.advantage.first().map_or(0, Vec::len) != dims[1] {
        return Err(TroupeError::invalid("weights", format!("shape does not match the log-probs {dims:?}")));
    }
    let tokens = weights.num_tokens().max(1) as f64;
    let (advantage, mask) = weights.tensors(&logprobs.device());
    let mut loss = (logprobs.clone() * advantage).sum().neg();
    if let Some((reference, kl_coef)) = reference {
        loss = loss + (k3_estimate(reference.detach(), logprobs) * mask).sum() * kl_coef;
    }
    Ok(loss * (scale / tokens))
}

/// The non-negative per-token KL estimator `k3 = exp(ref - logp) - (ref - logp) - 1` of
/// KL(policy || reference), from the sampled tokens' log-probs under each.
///
/// # Shapes
/// `reference`, `logprobs`: `[rows, positions]` -> `[rows, positions]`
pub fn k3_estimate(reference: Tensor<2>, logprobs: Tensor<2>) -> Tensor<2> {
    let diff = reference - logprobs;
    diff.clone().exp() - diff - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: Vec<f32>, dims: [usize; 2]) -> Tensor<2> {
        Tensor::from_data(TensorData::new(values, dims), &Device::flex())
    }

    #[test]
    fn completion_weights_cover_generated_tokens_only() {
        // Row 0: 2 prompt tokens + 2 generated (len 4); row 1: 1 prompt + 1 generated (len 2).
        let w = TokenWeights::for_completions(&[2, 1], &[4, 2], &[0.5, -1.0], 3);
        assert_eq!(w.counted, vec![vec![false, true, true], vec![true, false, false]]);
        assert_eq!(w.advantage, vec![vec![0.0, 0.5, 0.5], vec![-1.0, 0.0, 0.0]]);
        assert_eq!(w.num_tokens(), 3);
    }

    #[test]
    fn loss_is_minus_mean_weighted_logprob() {
        let w = TokenWeights::for_completions(&[2, 1], &[4, 2], &[0.5, -1.0], 3);
        let logp = tensor(vec![-9.0, -1.0, -2.0, -3.0, -9.0, -9.0], [2, 3]);
        // -(0.5 * -1 + 0.5 * -2 + -1 * -3) / 3 = -(−0.5 − 1 + 3) / 3 = -0.5
        let loss: f32 = policy_loss(logp.clone(), &w, None, 1.0).unwrap().into_scalar();
        assert!((loss + 0.5).abs() < 1e-6, "{loss}");
        let scaled: f32 = policy_loss(logp.clone(), &w, None, 0.25).unwrap().into_scalar();
        assert!((scaled + 0.125).abs() < 1e-6);
        // KL to an identical reference is zero; to a different one it is positive.
        let same: f32 = policy_loss(logp.clone(), &w, Some((logp.clone(), 0.1)), 1.0).unwrap().into_scalar();
        assert!((same - loss).abs() < 1e-6);
        let other = tensor(vec![-9.0, -1.5, -2.0, -2.0, -9.0, -9.0], [2, 3]);
        let with_kl: f32 = policy_loss(logp, &w, Some((other, 0.1)), 1.0).unwrap().into_scalar();
        let k3 = |d: f64| d.exp() - d - 1.0;
        let expected = -0.5 + 0.1 * (k3(-0.5) + k3(0.0) + k3(1.0)) / 3.0;
        assert!((f64::from(with_kl) - expected).abs() < 1e-5, "{with_kl} vs {expected}");
    }

    #[test]
    fn gradient_is_minus_advantage_over_tokens() {
        let device = Device::flex().autodiff();
        let w = TokenWeights::for_completions(&[1], &[3], &[2.0], 2);
        let logp = Tensor::<2>::from_data(TensorData::new(vec![-1.0f32, -2.0], [1, 2]), &device).require_grad();
        let grads = policy_loss(logp.clone(), &w, None, 1.0).unwrap().backward();
        let g = logp.grad(&grads).unwrap().into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        assert_eq!(g, vec![-1.0, -1.0], "d/dlogp of -(2 logp0 + 2 logp1)/2");
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let w = TokenWeights::for_completions(&[1], &[3], &[1.0], 2);
        assert!(policy_loss(tensor(vec![0.0; 3], [1, 3]), &w, None, 1.0).is_err());
    }
}
