//! Scoring a choice among candidate continuations with one pass over the shared prompt.
//!
//! A decision is a prompt and K candidate continuations (a game's legal actions). Instead of K
//! rows that each repeat the prompt, the decision is ONE row, `prompt ++ cand_0 ++ ... ++
//! cand_{K-1}`, with an attention layout in which every candidate's tokens see the whole prompt
//! and their own earlier tokens but no other candidate, at the RoPE positions they would have
//! right after the prompt. The prompt is read once and its keys and values are shared by every
//! candidate, exactly what a KV cache of the prompt reused per candidate computes, in one
//! forward that also carries gradients for training. Logits are computed only at the positions
//! that predict a candidate token (the prompt's last one and every candidate token but the
//! last), so the LM head costs `candidate tokens x vocab`, not `row length x vocab`.

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::error::{Result, TroupeError};
use crate::model::checkpoint::{Checkpointed, Stream};
use crate::model::fused::logsumexp;
use crate::model::{AttentionLayout, CausalLm, ForwardArgs, ProjectionDelta};

/// Added in place of a missing candidate's log-likelihood so that it takes no probability.
const ABSENT: f32 = -1.0e9;

/// How a candidate's token log-probs make its score.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChoiceScore {
    /// The sequence log-likelihood, `sum_j log p(cand[j] | ...)`: the model's own probability
    /// of writing the action.
    #[default]
    Sum,
    /// The mean log-probability per token (length-normalised, as multiple-choice evaluations
    /// score answers of different lengths): longer action texts are not penalised for their
    /// length, which keeps a model that starts from random weights exploring every action.
    Mean,
}

/// A batch of decisions packed for [`candidate_logliks`]: one row per decision.
#[derive(Clone, Debug)]
pub struct PackedChoices {
    /// `[decisions, width]` token ids, right-padded.
    tokens: Tensor<2, Int>,
    /// Positions and mask of the packed rows.
    layout: AttentionLayout,
    /// `[predictors]`: flat `row * width + slot` of every position whose next-token
    /// distribution scores a candidate token.
    predictors: Tensor<1, Int>,
    /// `[candidate tokens]`: flat `predictor * vocab + token` of each candidate token's logit.
    target_logits: Tensor<1, Int>,
    /// `[candidate tokens]`: the predictor row of each candidate token (for its log-normaliser).
    target_predictor: Tensor<1, Int>,
    /// `[candidates x max_tokens]`: index into `[candidate tokens ++ one zero]` of each
    /// candidate's tokens, padded with the zero's index.
    candidate_tokens: Tensor<1, Int>,
    /// `[decisions x max_candidates]`: index into `[candidates ++ one ABSENT]`.
    decision_candidates: Tensor<1, Int>,
    /// Longest candidate, in tokens.
    max_tokens: usize,
    /// Most candidates of one decision.
    max_candidates: usize,
    /// Candidates per decision.
    counts: Vec<usize>,
    /// `[candidates]`: 1 / the candidate's token count.
    inverse_lengths: Tensor<1>,
}

impl PackedChoices {
    /// Packs `decisions` (each a prompt of at least one token and at least one candidate of
    /// at least one token) for `lm`.
    pub fn new(lm: &CausalLm, decisions: &[(&[u32], &[Vec<u32>])]) -> Result<Self> {
        if decisions.is_empty() {
            return Err(TroupeError::invalid("decisions", "nothing to score"));
        }
        for (prompt, candidates) in decisions {
            if prompt.is_empty() || candidates.is_empty() || candidates.iter().any(Vec::is_empty) {
                return Err(TroupeError::invalid(
                    "decisions",
                    "every decision needs a prompt and non-empty candidates",
                ));
            }
        }
        let device = lm.device().clone();
        let vocab = lm.config.vocab_size;
        let longest = decisions.iter().map(|(p, c)| p.len() + c.iter().map(Vec::len).sum::<usize>()).max().unwrap_or(0);
        // Rounded up to the model's width step ([`CausalLm::width_step`]: on a GPU, so that packs
        // of nearby widths reuse compiled kernels).
        let width = lm.padded_width(longest);
        let batch = decisions.len();
        let max_tokens = decisions.iter().flat_map(|(_, c)| c.iter().map(Vec::len)).max().unwrap_or(1);
        let max_candidates = decisions.iter().map(|(_, c)| c.len()).max().unwrap_or(1);
        let total_candidates: usize = decisions.iter().map(|(_, c)| c.len()).sum();
        let total_tokens: usize = decisions.iter().flat_map(|(_, c)| c.iter().map(Vec::len)).sum();

        let mut rows: Vec<Vec<u32>> = Vec::with_capacity(batch);
        let mut positions = Vec::with_capacity(batch * width);
        let mut mask = Vec::with_capacity(batch * width * width);
        let mut predictors: Vec<i64> = Vec::new();
        let mut target_logits = Vec::with_capacity(total_tokens);
        let mut target_predictor = Vec::with_capacity(total_tokens);
        let mut candidate_tokens = Vec::with_capacity(total_candidates * max_tokens);
        let mut decision_candidates = Vec::with_capacity(batch * max_candidates);
        let mut counts = Vec::with_capacity(batch);
        let mut inverse_lengths = Vec::with_capacity(total_candidates);
        for (row, (prompt, candidates)) in decisions.iter().enumerate() {
            let p = prompt.len();
            let mut tokens = prompt.to_vec();
            // The block (0 = prompt, k + 1 = candidate k) and in-block index of every slot.
            let mut block = vec![0usize; p];
            let mut index: Vec<usize> = (0..p).collect();
            for (k, candidate) in candidates.iter().enumerate() {
                tokens.extend_from_slice(candidate);
                block.extend(std::iter::repeat_n(k + 1, candidate.len()));
                index.extend(0..candidate.len());
            }
            let real = tokens.len();
            tokens.resize(width, 0);
            rows.push(tokens.clone());
            for slot in 0..width {
                positions.push(if slot < real {
                    (if block[slot] == 0 { index[slot] } else { p + index[slot] }) as i64
                } else {
                    0
                });
                for key in 0..width {
                    let hidden = if slot >= real {
                        // Padding queries look at the prompt only (their output is unused).
                        key >= p
                    } else if key >= real {
                        true
                    } else if block[key] == 0 {
                        block[slot] == 0 && key > slot
                    } else {
                        block[key] != block[slot] || key > slot
                    };
                    mask.push(hidden);
                }
            }
            // The prompt's last slot predicts every candidate's first token.
            let shared = predictors.len();
            predictors.push((row * width + p - 1) as i64);
            let mut start = p;
            let first_candidate = candidate_tokens.len() / max_tokens;
            for candidate in candidates.iter() {
                let mut own = Vec::with_capacity(max_tokens);
                for (j, &token) in candidate.iter().enumerate() {
                    let predictor = if j == 0 {
                        shared
                    } else {
                        predictors.push((row * width + start + j - 1) as i64);
                        predictors.len() - 1
                    };
                    own.push(target_logits.len() as i64);
                    target_logits.push((predictor * vocab + token as usize) as i64);
                    target_predictor.push(predictor as i64);
                    if token as usize >= vocab {
                        return Err(TroupeError::invalid(
                            "tokens",
                            format!("token id {token} is outside the vocabulary of {vocab}"),
                        ));
                    }
                }
                own.resize(max_tokens, total_tokens as i64);
                inverse_lengths.push(1.0 / candidate.len() as f32);
                candidate_tokens.extend(own);
                start += candidate.len();
            }
            for k in 0..max_candidates {
                decision_candidates.push(if k < candidates.len() {
                    (first_candidate + k) as i64
                } else {
                    total_candidates as i64
                });
            }
            counts.push(candidates.len());
        }
        // The head's rows rounded likewise; the extra ones read slot 0 and nothing reads them.
        predictors.resize(lm.padded_width(predictors.len()), 0);
        let int1 = |values: Vec<i64>| {
            let n = values.len();
            Tensor::<1, Int>::from_data(TensorData::new(values, [n]), &device)
        };
        Ok(Self {
            tokens: lm.token_tensor(&rows)?,
            layout: AttentionLayout::new(positions, mask, [batch, width, width], &device),
            predictors: int1(predictors),
            target_logits: int1(target_logits),
            target_predictor: int1(target_predictor),
            candidate_tokens: int1(candidate_tokens),
            decision_candidates: int1(decision_candidates),
            max_tokens,
            max_candidates,
            counts,
            inverse_lengths: Tensor::from_data(TensorData::new(inverse_lengths, [total_candidates]), &device),
        })
    }

    /// Candidates of each decision.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// Most candidates of one decision (the width of [`candidate_logliks`]' output).
    pub fn max_candidates(&self) -> usize {
        self.max_candidates
    }
}

/// The score of every candidate after its prompt: its log-likelihood `sum_j log p(cand[j] |
/// prompt, cand[..j])`, or that over its length ([`ChoiceScore`]), for every decision of
/// `packed` in one forward. Entry `[d, k]` is candidate k of decision d; missing candidates
/// (k >= that decision's count) hold -1e9. Differentiable when the adapters in `delta` require
/// gradients.
///
/// # Shapes
/// -> `[decisions, max_candidates]`
pub fn candidate_logliks(
    lm: &CausalLm,
    packed: &PackedChoices,
    score: ChoiceScore,
    delta: Option<&dyn ProjectionDelta>,
) -> Result<Tensor<2>> {
    let hidden = lm.hidden_states(packed.tokens.clone(), ForwardArgs { layout: &packed.layout, cache: None, delta })?;
    Ok(logliks_from_hidden(lm, packed, score, hidden))
}

/// [`candidate_logliks`] turned into a loss by `loss_of` and differentiated with activation
/// checkpointing ([`crate::model::checkpoint`]).
pub fn checkpointed_choice_loss(
    lm: &CausalLm,
    packed: &PackedChoices,
    score: ChoiceScore,
    delta: Option<&dyn ProjectionDelta>,
    loss_of: impl FnOnce(Tensor<2>) -> Result<Tensor<1>>,
) -> Result<Checkpointed> {
    let streams = [Stream { tokens: packed.tokens.clone(), layout: &packed.layout, delta, after: None, output: true }];
    lm.checkpointed_backward(&streams, |mut hidden| loss_of(logliks_from_hidden(lm, packed, score, hidden.remove(0))))
}

/// The candidates' log-likelihoods from the packed rows' final hidden states.
///
/// # Shapes
/// `hidden`: `[batch, width, hidden]` -> `[decisions, max_candidates]`
fn logliks_from_hidden(lm: &CausalLm, packed: &PackedChoices, score: ChoiceScore, hidden: Tensor<3>) -> Tensor<2> {
    let [batch, width] = packed.tokens.dims();
    let size = hidden.dims()[2];
    let at = hidden.reshape([batch * width, size]).select(0, packed.predictors.clone());
    let logits = lm.lm_head.forward_2d(at);
    let [predictors, vocab] = logits.dims();
    let lse = logsumexp(logits.clone());
    let token_logp = logits.reshape([predictors * vocab]).select(0, packed.target_logits.clone())
        - lse.select(0, packed.target_predictor.clone());
    let device = token_logp.device();
    let padded = Tensor::cat(vec![token_logp, Tensor::<1>::zeros([1], &device)], 0);
    let candidates = packed.candidate_tokens.dims()[0] / packed.max_tokens;
    let per_candidate = padded
        .select(0, packed.candidate_tokens.clone())
        .reshape([candidates, packed.max_tokens])
        .sum_dim(1)
        .reshape([candidates]);
    let per_candidate = match score {
        ChoiceScore::Sum => per_candidate,
        ChoiceScore::Mean => per_candidate * packed.inverse_lengths.clone(),
    };
    let padded = Tensor::cat(vec![per_candidate, Tensor::<1>::full([1], ABSENT, &device)], 0);
    padded.select(0, packed.decision_candidates.clone()).reshape([batch, packed.max_candidates])
}

/// [`candidate_logliks`] read back to the host, each decision cut to its own candidates.
pub fn score_choices(
    lm: &CausalLm,
    decisions: &[(&[u32], &[Vec<u32>])],
    score: ChoiceScore,
    delta: Option<&dyn ProjectionDelta>,
) -> Result<Vec<Vec<f32>>> {
    let started = std::time::Instant::now();
    let packed = PackedChoices::new(lm, decisions)?;
    let logliks = candidate_logliks(lm, &packed, score, delta)?;
    let values = crate::readback::to_vec(logliks, crate::readback::Stage::Scoring)?;
    crate::profile::since(crate::profile::Phase::Prefill, started);
    Ok(values.chunks(packed.max_candidates).zip(packed.counts()).map(|(row, &n)| row[..n].to_vec()).collect())
}

/// The choice policy's log-probabilities: `log softmax(logliks / temperature)` over each row's
/// present candidates (absent ones stay far below every present one).
///
/// # Shapes
/// `logliks`: `[decisions, max_candidates]` -> `[decisions, max_candidates]`
pub fn choice_log_policy(logliks: Tensor<2>, temperature: f64) -> Tensor<2> {
    let scaled = if temperature > 0.0 && temperature != 1.0 { logliks / temperature } else { logliks };
    let max = scaled.clone().detach().max_dim(1);
    let lse = (scaled.clone() - max.clone()).exp().sum_dim(1).log() + max;
    scaled - lse
}

/// A `[rows, 1]` Int tensor of the chosen candidate index of each decision.
pub fn chosen_indices(chosen: &[usize], device: &Device) -> Tensor<2, Int> {
    let values: Vec<i64> = chosen.iter().map(|&c| c as i64).collect();
    Tensor::from_data(TensorData::new(values, [chosen.len(), 1]), device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::score_rows;
    use crate::model::{Model, Preset};
    use burn::tensor::Device;

    #[test]
    fn packed_scoring_equals_scoring_each_candidate_in_full() {
        let model = Model::builtin(Preset::Tiny, 0, &Device::flex()).unwrap();
        let enc = |t: &str| model.tokenizer.encode(t).unwrap();
        let prompts = [enc("Hanabi 2p. You are P0. Your turn. Legal: play 1-5"), enc("Bid:")];
        let candidates = [
            vec![enc("play 1 [?1]"), enc("discard 3 [??]"), enc("hint red [R1 R3]"), enc("p")],
            vec![enc("1NT"), enc("pass")],
        ];
        let decisions: Vec<(&[u32], &[Vec<u32>])> =
            prompts.iter().map(Vec::as_slice).zip(candidates.iter().map(Vec::as_slice)).collect();
        let packed = score_choices(&model.lm, &decisions, ChoiceScore::Sum, None).unwrap();
        let mean = score_choices(&model.lm, &decisions, ChoiceScore::Mean, None).unwrap();
        for ((sums, means), cands) in packed.iter().zip(&mean).zip(&candidates) {
            for ((sum, mean), cand) in sums.iter().zip(means).zip(cands) {
                assert!((sum / cand.len() as f32 - mean).abs() < 1e-6);
            }
        }
        for ((prompt, cands), scores) in prompts.iter().zip(&candidates).zip(&packed) {
            assert_eq!(scores.len(), cands.len());
            for (cand, &score) in cands.iter().zip(scores) {
                let mut row = prompt.clone();
                row.extend(cand);
                let full = score_rows(&model.lm, &[row], None).unwrap().remove(0);
                let expected: f32 = full[full.len() - cand.len()..].iter().sum();
                assert!((score - expected).abs() < 1e-5, "packed {score} vs full {expected}");
            }
        }
    }
}
