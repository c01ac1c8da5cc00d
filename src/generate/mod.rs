//! Batched generation with a KV cache over prompts of different lengths (left-padded), optionally
//! constrained per row to a set of token sequences ([`constrained`]), and scoring: the
//! log-probability of each token given those before it.

pub mod choice;
pub mod constrained;
pub mod prefix;
pub mod sampler;

use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TroupeError};
use crate::model::checkpoint::{Checkpointed, Continues, Stream};
use crate::model::fused::token_logprob::log_sum_exp;
use crate::model::head::head_logprobs;
use crate::model::prompt_cache::GroupLayout;
use crate::model::{CausalLm, ForwardArgs, KvCache, ProjectionDelta, SequenceLayout};
use crate::readback::{self, Stage};
pub use constrained::{NodeId, TokenTrie, TrieStep};
use prefix::SharedPrefixes;
pub use sampler::SamplingConfig;

/// Options of one generation call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateOptions {
    /// Stop a row after this many new tokens.
    pub max_new_tokens: usize,
    /// How to pick each token.
    pub sampling: SamplingConfig,
    /// Seed of the sampler's `ChaCha8Rng`.
    pub seed: u64,
    /// Stop a row at its first end-of-sequence token (kept in the output).
    pub stop_at_eos: bool,
    /// Reuse keys and values across steps (the fast path); `false` recomputes the whole
    /// sequence at every step, which is slow and exists to check the cache against.
    pub use_cache: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { max_new_tokens: 64, sampling: SamplingConfig::default(), seed: 0, stop_at_eos: true, use_cache: true }
    }
}

/// What one row generated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// The new tokens (ending with the EOS token when `finished_by_eos`).
    pub output_ids: Vec<u32>,
    /// `log p(token)` of each new token under the model's full next-token distribution
    /// (log-softmax of the raw logits: temperature 1, no top-k/top-p, no constraint), recorded
    /// as it was sampled: the quantity the trainer scores, so an importance ratio between the
    /// policy that sampled and the policy being trained is `exp(new - logprobs)`.
    #[serde(default)]
    pub logprobs: Vec<f32>,
    /// Whether an EOS token ended the row (else `max_new_tokens` did, or for a constrained row
    /// the completion of a sequence that does not end with EOS).
    pub finished_by_eos: bool,
    /// For a constrained row, the index of the constraint's sequence it spelled (`output_ids` is
    /// that sequence, plus the EOS that ended it when it is a prefix of another); `None` for an
    /// unconstrained row.
    #[serde(default)]
    pub sequence: Option<usize>,
}

/// New tokens a generation reserves KV-cache room for before its first step; the cache grows
/// (doubling) when rows go on past them.
const RESERVED_NEW_TOKENS: usize = 128;

/// The KV-cache room of a generation is a multiple of this many slots, so that generations of
/// prompts of nearby lengths decode with the same shapes (attention always reads the whole room,
/// the unwritten slots masked) and a backend that compiles kernels per shape reuses them.
pub const KV_ROOM_STEP: usize = 64;

/// The KV-cache room reserved for a generation from prompts `prompt_width` slots wide (after
/// left padding) that may add `max_new_tokens`: the prompts plus at most
/// `RESERVED_NEW_TOKENS` (128) new tokens, rounded up to a multiple of [`KV_ROOM_STEP`].
pub fn decode_room(prompt_width: usize, max_new_tokens: usize) -> usize {
    (prompt_width + max_new_tokens.clamp(1, RESERVED_NEW_TOKENS)).next_multiple_of(KV_ROOM_STEP)
}

/// Pads rows on the left with `pad` to the width `lm` pads the longest row to
/// ([`CausalLm::padded_width`]). Returns the padded rows and each slot's validity.
fn left_pad(lm: &CausalLm, rows: &[Vec<u32>], pad: u32) -> (Vec<Vec<u32>>, Vec<Vec<bool>>) {
    let width = lm.padded_width(rows.iter().map(Vec::len).max().unwrap_or(0));
    rows.iter()
        .map(|row| {
            let n = width - row.len();
            let mut tokens = vec![pad; n];
            tokens.extend_from_slice(row);
            let mut valid = vec![false; n];
            valid.extend(std::iter::repeat_n(true, row.len()));
            (tokens, valid)
        })
        .unzip()
}

/// Pads rows on the right with `pad` to the width `lm` pads the longest row to
/// ([`CausalLm::padded_width`]). Returns the padded rows and each slot's validity.
fn right_pad<R: AsRef<[u32]>>(lm: &CausalLm, rows: &[R], pad: u32) -> (Vec<Vec<u32>>, Vec<Vec<bool>>) {
    let width = lm.padded_width(rows.iter().map(|r| r.as_ref().len()).max().unwrap_or(0));
    rows.iter()
        .map(|row| {
            let row = row.as_ref();
            let mut tokens = row.to_vec();
            tokens.resize(width, pad);
            let mut valid = vec![true; row.len()];
            valid.resize(width, false);
            (tokens, valid)
        })
        .unzip()
}

/// The logits at the last slot of every row after a forward over `tokens`, read to the host.
///
/// # Shapes
/// `tokens`: `[batch, seq]` -> `batch` rows of `vocab`
fn last_logits_rows(lm: &CausalLm, tokens: &[Vec<u32>], args: ForwardArgs<'_>) -> Result<LogitRows> {
    LogitRows::read(last_logits_tensor(lm, tokens, args)?)
}

/// The logits at the last slot of every row after a forward over `tokens`, where the model is.
///
/// # Shapes
/// `tokens`: `[batch, seq]` -> `[batch, vocab]`
fn last_logits_tensor(lm: &CausalLm, tokens: &[Vec<u32>], args: ForwardArgs<'_>) -> Result<Tensor<2>> {
    let hidden = lm.hidden_states(lm.token_tensor(tokens)?, args)?;
    let seq = hidden.dims()[1];
    Ok(lm.logits(hidden.narrow(1, seq - 1, 1)).squeeze_dim::<2>(1))
}

/// A decoding step's logits as the forward left them: one row per distinct prefix on the first
/// step of shared prompts (`of_row` maps each row to its row here), else one per row.
struct StepLogits {
    /// `[rows or distinct prefixes, vocab]`, on the model's device.
    logits: Tensor<2>,
    /// Row `r`'s row of `logits`, when they are the distinct prefixes'.
    of_row: Option<Vec<usize>>,
}

impl StepLogits {
    /// The logits on the host, one entry per row.
    fn read(self) -> Result<LogitRows> {
        let rows = LogitRows::read(self.logits)?;
        Ok(match self.of_row {
            Some(of_row) => rows.gather(&of_row),
            None => rows,
        })
    }

    /// One `[rows, vocab]` tensor on the device, the distinct prefixes' rows repeated.
    fn per_row(self) -> Tensor<2> {
        match self.of_row {
            Some(of_row) => {
                let device = self.logits.device();
                let index: Vec<i64> = of_row.iter().map(|&r| r as i64).collect();
                let len = index.len();
                self.logits.select(0, Tensor::<1, Int>::from_data(TensorData::new(index, [len]), &device))
            }
            None => self.logits,
        }
    }
}

/// Rows of logits on the host, as read from the device in one buffer (a decoding step's
/// `[batch, vocab]`: 39 MB at batch 64 over a Qwen3 vocabulary, not copied again row by row).
#[derive(Clone, Debug, PartialEq)]
struct LogitRows {
    /// `[unique rows, vocab]`, row-major.
    values: Vec<f32>,
    vocab: usize,
    /// Row `r`'s place in `values`.
    of_row: Vec<usize>,
}

impl LogitRows {
    /// Reads a `[batch, vocab]` tensor.
    fn read(logits: Tensor<2>) -> Result<Self> {
        let [batch, vocab] = logits.dims();
        let values = readback::to_vec(logits, Stage::Decoding)?;
        Ok(Self { values, vocab, of_row: (0..batch).collect() })
    }

    /// Rows that repeat these: row `r` of the result is row `rows[r]` of `self` (no copy).
    fn gather(self, rows: &[usize]) -> Self {
        let of_row = rows.iter().map(|&r| self.of_row[r]).collect();
        Self { of_row, ..self }
    }

    /// The number of rows.
    fn len(&self) -> usize {
        self.of_row.len()
    }

    /// Row `r`.
    fn row(&self, r: usize) -> &[f32] {
        let at = self.of_row[r] * self.vocab;
        &self.values[at..at + self.vocab]
    }

    /// Every row, in order.
    fn iter(&self) -> impl Iterator<Item = &[f32]> {
        (0..self.len()).map(|r| self.row(r))
    }
}

/// `log softmax(logits)[token]`, as the update's scorer computes it
/// ([`crate::model::fused::token_logprobs`]: a vectorized `exp`, summed in lanes).
fn token_logprob(logits: &[f32], token: u32) -> f32 {
    logits[token as usize] - log_sum_exp(logits)
}

/// Generates a continuation of every prompt in one batch. Rows may have different lengths;
/// each row stops at an EOS id (when `options.stop_at_eos`) or after `max_new_tokens`.
/// `delta` applies adapters (LoRA) per row.
pub fn generate(
    lm: &CausalLm,
    eos_token_ids: &[u32],
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
    delta: Option<&dyn ProjectionDelta>,
) -> Result<Vec<Generation>> {
    generate_constrained(lm, eos_token_ids, prompts, &[], options, delta)
}

/// [`generate`] where some rows may only spell one of a set of token sequences:
/// `constraints` is empty (no row constrained, exactly [`generate`]) or holds one entry per
/// prompt. A constrained row samples each token among those its [`TokenTrie`] allows
/// ([`TokenTrie::pick`]: the configured temperature, top-k and top-p over the allowed tokens)
/// and ends when it has spelled a whole sequence (reported in [`Generation::sequence`]),
/// whatever `max_new_tokens` and `stop_at_eos` say: the trie's depth bounds its length.
/// Every step is still one batched forward of all live rows, each on its own adapter in `delta`.
/// Unconstrained rows decode as in [`generate`], and with no row constrained the output is
/// exactly [`generate`]'s. Constrained rows draw from the same seeded generator (except at
/// nodes with a single allowed token), so with sampling on they shift the draws of later rows.
pub fn generate_constrained(
    lm: &CausalLm,
    eos_token_ids: &[u32],
    prompts: &[Vec<u32>],
    constraints: &[Option<&TokenTrie>],
    options: &GenerateOptions,
    delta: Option<&dyn ProjectionDelta>,
) -> Result<Vec<Generation>> {
    generate_rows(lm, eos_token_ids, prompts, constraints, options, &[], delta)
}

/// [`generate_constrained`] where every row samples from its own generator, seeded with
/// `row_seeds[row]` (one seed per prompt; `options.seed` is not used): a row's tokens then
/// depend only on its prompt, its adapter and its seed, never on which other rows share the
/// batch, so work split across processes samples what one batch would. An empty `row_seeds` is
/// [`generate_constrained`] (one generator for the batch, seeded with `options.seed`).
pub fn generate_rows(
    lm: &CausalLm,
    eos_token_ids: &[u32],
    prompts: &[Vec<u32>],
    constraints: &[Option<&TokenTrie>],
    options: &GenerateOptions,
    row_seeds: &[u64],
    delta: Option<&dyn ProjectionDelta>,
) -> Result<Vec<Generation>> {
    if !row_seeds.is_empty() && row_seeds.len() != prompts.len() {
        return Err(TroupeError::invalid(
            "row_seeds",
            format!("{} seeds for {} prompts: give none or one per prompt", row_seeds.len(), prompts.len()),
        ));
    }
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(TroupeError::invalid("prompts", "every prompt needs at least one token"));
    }
    if !constraints.is_empty() && constraints.len() != prompts.len() {
        return Err(TroupeError::invalid(
            "constraints",
            format!("{} constraints for {} prompts: give none or one per prompt", constraints.len(), prompts.len()),
        ));
    }
    let vocab = lm.config.vocab_size;
    if let Some(trie) = constraints.iter().flatten().find(|t| t.max_token() as usize >= vocab) {
        return Err(TroupeError::invalid(
            "constraints",
            format!("token {} is beyond the vocabulary ({vocab})", trie.max_token()),
        ));
    }
    let constraint = |row: usize| constraints.get(row).copied().flatten();
    let device = lm.device().clone();
    let batch = prompts.len();
    // One generator for the batch, or one per row.
    let shared_rng = row_seeds.is_empty();
    let mut rngs: Vec<ChaCha8Rng> = if shared_rng {
        vec![ChaCha8Rng::seed_from_u64(options.seed)]
    } else {
        row_seeds.iter().map(|&seed| ChaCha8Rng::seed_from_u64(seed)).collect()
    };
    let (padded, valid) = left_pad(lm, prompts, 0);
    let mut outputs: Vec<Generation> =
        vec![
            Generation { output_ids: Vec::new(), logprobs: Vec::new(), finished_by_eos: false, sequence: None };
            batch
        ];
    let mut done: Vec<bool> = (0..batch).map(|row| constraint(row).is_none() && options.max_new_tokens == 0).collect();
    // Each constrained row's place in its trie.
    let mut nodes = vec![TokenTrie::ROOT; batch];
    // Keys and values written in place: room for the prompts and the new tokens, reserved for
    // at most `RESERVED_NEW_TOKENS` of them up front (a long `max_new_tokens` whose replies stop
    // early must not hold a cache for all of it) and grown by doubling past that; rounded to
    // `KV_ROOM_STEP` slots so that every decoding step of this call, and of calls with prompts of
    // nearby lengths, has one shape.
    let room = decode_room(padded[0].len(), options.max_new_tokens);
    let mut cache = KvCache::with_capacity(lm.config.num_hidden_layers, room).holding(lm.cache_dtype());
    let mut layout = SequenceLayout::new(batch);
    // Full token history (kept only for the uncached path) and the step's new slots.
    let (mut history, mut history_valid) =
        if options.use_cache { (Vec::new(), Vec::new()) } else { (padded.clone(), valid.clone()) };
    let mut step_tokens = padded;
    let mut step_valid = valid;
    let mut phase = crate::profile::Phase::Prefill;
    // Rows with the same prompt on the same adapter (a GRPO group) prefill it once.
    let mut shared = if options.use_cache {
        SharedPrefixes::find(&prompts.iter().map(Vec::as_slice).collect::<Vec<_>>(), delta)
    } else {
        None
    };
    while done.iter().any(|d| !d) {
        let step_started = std::time::Instant::now();
        let step = match shared.take() {
            Some(share) => {
                let unique_tokens: Vec<Vec<u32>> = share.unique.iter().map(|&r| step_tokens[r].clone()).collect();
                let unique_valid: Vec<Vec<bool>> = share.unique.iter().map(|&r| step_valid[r].clone()).collect();
                // The prompts once per group: into a cache of their own when the rows will share
                // it beside each row's own room for its reply, else into the reserved cache, then
                // copied to each row.
                let shares = lm.shares_prompts();
                let mut prompts =
                    if shares { KvCache::new(lm.config.num_hidden_layers) } else { std::mem::take(&mut cache) };
                let keys = prompts.keys_after(unique_valid[0].len());
                let attention = SequenceLayout::new(share.unique.len()).step_within(&unique_valid, keys, &device);
                let args = ForwardArgs { layout: &attention, cache: Some(&mut prompts), delta: share.unique_delta() };
                let logits = last_logits_tensor(lm, &unique_tokens, args)?;
                cache = if shares {
                    KvCache::sharing_prompts(
                        prompts,
                        &share.group_of_row,
                        Some(decode_room(0, options.max_new_tokens)),
                        &device,
                    )?
                    .holding(lm.cache_dtype())
                } else {
                    prompts.select_rows(&share.group_of_row, &device);
                    prompts
                };
                layout.extend(&step_valid);
                StepLogits { logits, of_row: Some(share.group_of_row) }
            }
            None if options.use_cache => {
                let attention = layout.step_within(&step_valid, cache.keys_after(step_valid[0].len()), &device);
                let args = ForwardArgs { layout: &attention, cache: Some(&mut cache), delta };
                StepLogits { logits: last_logits_tensor(lm, &step_tokens, args)?, of_row: None }
            }
            None => {
                let attention = SequenceLayout::new(batch).step(&history_valid, &device);
                let args = ForwardArgs { layout: &attention, cache: None, delta };
                StepLogits { logits: last_logits_tensor(lm, &history, args)?, of_row: None }
            }
        };
        step_tokens = Vec::with_capacity(batch);
        step_valid = Vec::with_capacity(batch);
        // On a GPU, unconstrained rows draw where the logits are (one uniform each from the
        // row's generator, as the host's draw takes); on the host, each live row's token and
        // its log-prob, rows with their own generators in parallel (what a row draws depends
        // only on its logits and its generator).
        let on_device = constraints.iter().all(Option::is_none) && sampler::on_device(&step.logits, &options.sampling);
        let picks: Vec<Option<(u32, f32)>> = if on_device {
            let greedy = options.sampling.is_greedy();
            let uniforms: Vec<f32> = (0..batch)
                .map(|row| {
                    if done[row] || greedy {
                        return 0.0;
                    }
                    let rng = if shared_rng { &mut rngs[0] } else { &mut rngs[row] };
                    rng.random::<f32>()
                })
                .collect();
            let drawn = sampler::sample_on_device(&step.per_row(), &uniforms, &options.sampling)?;
            drawn.into_iter().enumerate().map(|(row, pick)| (!done[row]).then_some(pick)).collect()
        } else {
            let rows = step.read()?;
            let pick = |row: usize, logits: &[f32], rng: &mut ChaCha8Rng| -> Option<(u32, f32)> {
                if done[row] {
                    return None;
                }
                let token = match constraint(row) {
                    Some(trie) => trie.pick(nodes[row], logits, &options.sampling, rng),
                    None => sampler::sample(logits, &options.sampling, rng),
                };
                Some((token, token_logprob(logits, token)))
            };
            if shared_rng {
                rows.iter().enumerate().map(|(row, logits)| pick(row, logits, &mut rngs[0])).collect()
            } else {
                rngs.par_iter_mut().enumerate().map(|(row, rng)| pick(row, rows.row(row), rng)).collect()
            }
        };
        for (row, picked) in picks.into_iter().enumerate() {
            let (token, real) = match picked {
                None => (0, false),
                Some((token, logprob)) => {
                    let out = &mut outputs[row];
                    out.output_ids.push(token);
                    out.logprobs.push(logprob);
                    if let Some(trie) = constraint(row) {
                        match trie.advance(nodes[row], token).expect("`pick` returns an allowed token") {
                            TrieStep::Continue(node) => nodes[row] = node,
                            TrieStep::Complete { sequence } => {
                                out.sequence = Some(sequence);
                                out.finished_by_eos = eos_token_ids.contains(&token);
                                done[row] = true;
                            }
                        }
                    } else if options.stop_at_eos && eos_token_ids.contains(&token) {
                        out.finished_by_eos = true;
                        done[row] = true;
                    } else if out.output_ids.len() >= options.max_new_tokens {
                        done[row] = true;
                    }
                    (token, true)
                }
            };
            step_tokens.push(vec![token]);
            step_valid.push(vec![real]);
            if !options.use_cache {
                history[row].push(token);
                history_valid[row].push(real);
            }
        }
        crate::profile::since(phase, step_started);
        phase = crate::profile::Phase::Decode;
    }
    Ok(outputs)
}

/// Right-padded token rows as a tensor with their layout; `lengths` are the real lengths.
pub struct ScoringBatch {
    /// `[batch, seq]`
    pub tokens: Tensor<2, Int>,
    /// The same padded tokens on the host, row-major (`batch * seq`): the scorers read their
    /// targets here instead of reading the tensor back from the device.
    pub host_tokens: Vec<u32>,
    /// Validity of every slot (`false` for right padding).
    pub valid: Vec<Vec<bool>>,
    /// Real length of each row.
    pub lengths: Vec<usize>,
}

impl ScoringBatch {
    /// Right-pads `rows` (each at least 2 tokens) to one length: the longest row's, rounded up
    /// to a multiple of the model's [`CausalLm::width_step`].
    pub fn new(lm: &CausalLm, rows: &[Vec<u32>]) -> Result<Self> {
        if rows.is_empty() || rows.iter().any(|r| r.len() < 2) {
            return Err(TroupeError::invalid("rows", "scoring needs at least two tokens per row"));
        }
        let (padded, valid) = right_pad(lm, rows, 0);
        Ok(Self {
            tokens: lm.token_tensor(&padded)?,
            host_tokens: padded.concat(),
            valid,
            lengths: rows.iter().map(Vec::len).collect(),
        })
    }
}

/// Log-probability of every next token: entry `[b, t]` is `log p(tokens[b, t+1] | tokens[b, ..=t])`.
/// Differentiable when the adapters in `delta` require gradients.
///
/// # Shapes
/// `batch.tokens`: `[batch, seq]` -> `[batch, seq - 1]`
pub fn next_token_logprobs(
    lm: &CausalLm,
    batch: &ScoringBatch,
    delta: Option<&dyn ProjectionDelta>,
) -> Result<Tensor<2>> {
    let [rows, seq] = batch.tokens.dims();
    let layout = SequenceLayout::new(rows).step(&batch.valid, lm.device());
    let hidden = lm.hidden_states(batch.tokens.clone(), ForwardArgs { layout: &layout, cache: None, delta })?;
    let size = hidden.dims()[2];
    let hidden = hidden.narrow(1, 0, seq - 1).reshape([rows * (seq - 1), size]);
    let tokens = &batch.host_tokens;
    let targets: Vec<u32> = (0..rows).flat_map(|b| tokens[b * seq + 1..(b + 1) * seq].iter().copied()).collect();
    Ok(head_logprobs(&lm.lm_head, hidden, &targets).reshape([rows, seq - 1]))
}

/// Log-probability of each row's completion tokens only: entry `[b, j]` is
/// `log p(tokens[b, from[b] + j] | tokens[b, ..from[b] + j])` for `j < lengths[b] - from[b]`,
/// and 0 beyond a row's completion. The values are [`next_token_logprobs`]'s at those positions,
/// but the LM head (a vocabulary-wide product per position) runs only where a completion token
/// is scored, not over the prompt. Differentiable when the adapters in `delta` require gradients.
///
/// # Shapes
/// `batch.tokens`: `[batch, seq]` -> `[batch, max over rows of (lengths[b] - from[b])]`
pub fn completion_logprobs(
    lm: &CausalLm,
    batch: &ScoringBatch,
    from: &[usize],
    delta: Option<&dyn ProjectionDelta>,
) -> Result<Tensor<2>> {
    let [rows, seq] = batch.tokens.dims();
    let row_tokens = completion_rows(batch, from)?;
    // Rows that share everything before their last prompt token (a GRPO group's prompt)
    // compute it once: the forward runs over each distinct prefix, then over every row's
    // rest (its last prompt token, which predicts the first reply token, and its reply).
    let prefixes: Vec<&[u32]> = row_tokens.iter().zip(from).map(|(row, &f)| &row[..f - 1]).collect();
    if let Some(share) = SharedPrefixes::find(&prefixes, delta) {
        return shared_completion_logprobs(lm, &row_tokens, from, &share, delta);
    }
    let device = lm.device().clone();
    let layout = SequenceLayout::new(rows).step(&batch.valid, &device);
    let hidden = lm.hidden_states(batch.tokens.clone(), ForwardArgs { layout: &layout, cache: None, delta })?;
    // Token f + j is predicted at position f + j - 1.
    let predictor = |b: usize, j: usize| b * seq + from[b] + j - 1;
    reply_logprobs(lm, hidden, &row_tokens, from, predictor)
}

/// Each row's tokens of `batch` (its padding cut), once `from` is checked: one completion start
/// per row, after its first token and before its end.
fn completion_rows<'b>(batch: &'b ScoringBatch, from: &[usize]) -> Result<Vec<&'b [u32]>> {
    let [rows, seq] = batch.tokens.dims();
    if from.len() != rows || from.iter().zip(&batch.lengths).any(|(&f, &n)| f == 0 || f >= n) {
        return Err(TroupeError::invalid(
            "from",
            "one completion start per row, after its first token and before its end",
        ));
    }
    let tokens = &batch.host_tokens;
    Ok((0..rows).map(|b| &tokens[b * seq..b * seq + batch.lengths[b]]).collect())
}

/// [`completion_logprobs`] turned into a loss by `loss_of` and differentiated with activation
/// checkpointing ([`crate::model::checkpoint`]): the same passes (each distinct prefix once
/// when rows share one), the same log-probabilities, each decoder layer's activations
/// recomputed in the backward pass instead of kept.
pub fn checkpointed_completion_loss(
    lm: &CausalLm,
    batch: &ScoringBatch,
    from: &[usize],
    delta: Option<&dyn ProjectionDelta>,
    loss_of: impl FnOnce(Tensor<2>) -> Result<Tensor<1>>,
) -> Result<Checkpointed> {
    let [rows, seq] = batch.tokens.dims();
    let row_tokens = completion_rows(batch, from)?;
    let prefixes: Vec<&[u32]> = row_tokens.iter().zip(from).map(|(row, &f)| &row[..f - 1]).collect();
    let device = lm.device().clone();
    if let Some(share) = SharedPrefixes::find(&prefixes, delta) {
        // As `shared_completion_logprobs`: the prefixes, then every row's suffix after them.
        let prefixes: Vec<&[u32]> = share.unique.iter().map(|&r| &row_tokens[r][..from[r] - 1]).collect();
        let (prefix_tokens, prefix_valid) = right_pad(lm, &prefixes, 0);
        let prefix_layout = SequenceLayout::new(share.unique.len()).step(&prefix_valid, &device);
        let mut layout = SequenceLayout::new(rows);
        layout.extend(&share.group_of_row.iter().map(|&g| prefix_valid[g].clone()).collect::<Vec<_>>());
        let suffixes: Vec<&[u32]> = row_tokens.iter().zip(from).map(|(row, &f)| &row[f - 1..]).collect();
        let (suffix_tokens, suffix_valid) = right_pad(lm, &suffixes, 0);
        let attention = layout.step(&suffix_valid, &device);
        let continues = if lm.shares_prompts() {
            Continues::Shared(GroupLayout::new(&share.group_of_row, share.unique.len(), &device)?)
        } else {
            Continues::Copied {
                rows: share.group_of_row.clone(),
                index: KvCache::row_index(&share.group_of_row, &device),
            }
        };
        let streams = [
            Stream {
                tokens: lm.token_tensor(&prefix_tokens)?,
                layout: &prefix_layout,
                delta: share.unique_delta(),
                after: None,
                output: false,
            },
            Stream {
                tokens: lm.token_tensor(&suffix_tokens)?,
                layout: &attention,
                delta,
                after: Some((0, continues)),
                output: true,
            },
        ];
        let width = suffix_tokens[0].len();
        return lm.checkpointed_backward(&streams, |mut hidden| {
            loss_of(reply_logprobs(lm, hidden.remove(0), &row_tokens, from, |b, j| b * width + j)?)
        });
    }
    let layout = SequenceLayout::new(rows).step(&batch.valid, &device);
    let streams = [Stream { tokens: batch.tokens.clone(), layout: &layout, delta, after: None, output: true }];
    lm.checkpointed_backward(&streams, |mut hidden| {
        loss_of(reply_logprobs(lm, hidden.remove(0), &row_tokens, from, |b, j| b * seq + from[b] + j - 1)?)
    })
}

/// [`completion_logprobs`] over rows grouped by `share`: each distinct prefix (`row[..from - 1]`)
/// goes through the model once, and each row's suffix (`row[from - 1..]`) runs on top, reading
/// its prefix's keys and values held once for the rows that share it when the model shares
/// prompts ([`CausalLm::shares_prompts`], [`KvCache::sharing_prompts`]), else copied to each
/// of them ([`KvCache::select_rows`]); either way the backward sums the rows' gradients into
/// the one prefix.
fn shared_completion_logprobs(
    lm: &CausalLm,
    rows: &[&[u32]],
    from: &[usize],
    share: &SharedPrefixes<'_>,
    delta: Option<&dyn ProjectionDelta>,
) -> Result<Tensor<2>> {
    let device = lm.device().clone();
    // Both parts right-padded: every query then sees at least its row's first token.
    let prefixes: Vec<&[u32]> = share.unique.iter().map(|&r| &rows[r][..from[r] - 1]).collect();
    let (prefix_tokens, prefix_valid) = right_pad(lm, &prefixes, 0);
    let mut cache = KvCache::new(lm.config.num_hidden_layers);
    let prefix_layout = SequenceLayout::new(share.unique.len()).step(&prefix_valid, &device);
    lm.fill_cache(
        lm.token_tensor(&prefix_tokens)?,
        ForwardArgs { layout: &prefix_layout, cache: Some(&mut cache), delta: share.unique_delta() },
    )?;
    let mut cache = if lm.shares_prompts() {
        KvCache::sharing_prompts(cache, &share.group_of_row, None, &device)?
    } else {
        cache.select_rows(&share.group_of_row, &device);
        cache
    };
    let mut layout = SequenceLayout::new(rows.len());
    layout.extend(&share.group_of_row.iter().map(|&g| prefix_valid[g].clone()).collect::<Vec<_>>());
    let suffixes: Vec<&[u32]> = rows.iter().zip(from).map(|(row, &f)| &row[f - 1..]).collect();
    let (suffix_tokens, suffix_valid) = right_pad(lm, &suffixes, 0);
    let attention = layout.step(&suffix_valid, &device);
    let hidden = lm.hidden_states(
        lm.token_tensor(&suffix_tokens)?,
        ForwardArgs { layout: &attention, cache: Some(&mut cache), delta },
    )?;
    // Token f + j is predicted at suffix position j.
    let width = suffix_tokens[0].len();
    reply_logprobs(lm, hidden, rows, from, |b, j| b * width + j)
}

/// The log-probability of each row's reply tokens (`row[from..]`) from the final hidden states,
/// running the LM head only at the positions that predict them (`predictor(b, j)`: the flat
/// position in `hidden` that predicts token `from[b] + j` of row `b`).
///
/// # Shapes
/// `hidden`: `[rows, seq, hidden]` -> `[rows, max over rows of (len - from)]`, 0 past a reply
fn reply_logprobs(
    lm: &CausalLm,
    hidden: Tensor<3>,
    rows: &[&[u32]],
    from: &[usize],
    predictor: impl Fn(usize, usize) -> usize,
) -> Result<Tensor<2>> {
    let [batch, seq, size] = hidden.dims();
    let longest = rows.iter().zip(from).map(|(row, &f)| row.len() - f).max().unwrap_or(0);
    // The head runs over `batch x width` positions, `width` rounded on a GPU like the rows'
    // widths (the extra positions are padding), and the result is cut back to the longest reply.
    let width = lm.padded_width(longest);
    let mut predictors = Vec::with_capacity(batch * width);
    let mut targets = Vec::with_capacity(batch * width);
    let mut present = Vec::with_capacity(batch * width);
    for (b, (row, &f)) in rows.iter().zip(from).enumerate() {
        for j in 0..width {
            let real = f + j < row.len();
            // Padding reads position 0 of its row.
            predictors.push(if real { predictor(b, j) } else { b * seq } as i64);
            targets.push(if real { row[f + j] } else { 0 });
            present.push(if real { 1.0f32 } else { 0.0 });
        }
    }
    let device = lm.device().clone();
    let flat = hidden.reshape([batch * seq, size]);
    let count = batch * width;
    let index = |values: Vec<i64>| Tensor::<1, Int>::from_data(TensorData::new(values, [count]), &device);
    let at = flat.select(0, index(predictors));
    let logprobs = head_logprobs(&lm.lm_head, at, &targets);
    let present = Tensor::<2>::from_data(TensorData::new(present, [batch, width]), &device);
    let logprobs = logprobs.reshape([batch, width]) * present;
    Ok(if width == longest { logprobs } else { logprobs.narrow(1, 0, longest) })
}

/// [`next_token_logprobs`] read back to the host, each row cut to its real length minus one.
pub fn score_rows(lm: &CausalLm, rows: &[Vec<u32>], delta: Option<&dyn ProjectionDelta>) -> Result<Vec<Vec<f32>>> {
    // Before the batch's masks are built: their size grows with the square of the longest row.
    let context = lm.config.max_position_embeddings;
    if let Some(longest) = rows.iter().map(Vec::len).max().filter(|&len| len > context) {
        return Err(crate::error::TroupeError::invalid(
            "tokens",
            format!("sequence of {longest} tokens exceeds max_position_embeddings {context}"),
        ));
    }
    let batch = ScoringBatch::new(lm, rows)?;
    let logprobs = next_token_logprobs(lm, &batch, delta)?;
    let [_, width] = logprobs.dims();
    let values = readback::to_vec(logprobs, Stage::Scoring)?;
    Ok(values.chunks(width).zip(&batch.lengths).map(|(row, len)| row[..len - 1].to_vec()).collect())
}

/// The last position's raw logits of one sequence (for top-k inspection).
pub fn last_logits(lm: &CausalLm, tokens: &[u32], delta: Option<&dyn ProjectionDelta>) -> Result<Vec<f32>> {
    let device = lm.device().clone();
    let layout = SequenceLayout::new(1).step(&[vec![true; tokens.len()]], &device);
    Ok(last_logits_rows(lm, &[tokens.to_vec()], ForwardArgs { layout: &layout, cache: None, delta })?.row(0).to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Model, Preset};
    use burn::tensor::Device;

    fn tiny() -> (Model, Vec<Vec<u32>>) {
        let model = Model::builtin(Preset::Tiny, 0, &Device::flex()).unwrap();
        let prompts = ["Player 1 hints red.", "Your move:", "def main(xs):"]
            .iter()
            .map(|t| model.tokenizer.encode(t).unwrap())
            .collect();
        (model, prompts)
    }

    #[test]
    fn prompts_of_nearby_lengths_decode_in_the_same_room() {
        // Room for the prompts and the new tokens, a whole number of steps, the same for every
        // prompt width of a step: decoding steps of all these calls have one shape.
        for width in 1..=56 {
            assert_eq!(decode_room(width, 8), KV_ROOM_STEP, "width {width}");
        }
        assert_eq!(decode_room(57, 8), 2 * KV_ROOM_STEP);
        // At most 128 new tokens are reserved up front (the cache grows past them).
        assert_eq!(decode_room(10, 4096), 192);
        assert_eq!(decode_room(10, 0), KV_ROOM_STEP);
        for (width, new) in [(1, 1), (63, 1), (64, 1), (100, 300), (500, 7)] {
            let room = decode_room(width, new);
            assert!(room >= width + new.clamp(1, 128) && room.is_multiple_of(KV_ROOM_STEP), "{width} + {new}: {room}");
            assert!(room < width + new.clamp(1, 128) + KV_ROOM_STEP, "{width} + {new}: {room}");
        }
    }

    #[test]
    fn generation_in_a_rounded_room_gives_what_the_exact_room_gives() {
        // The same decoding with the cache's room exactly the prompts plus the new tokens (as
        // before rounding) and rounded up: the unwritten slots are masked, so the same tokens
        // and log-probs, bit for bit on the CPU.
        let (model, prompts) = tiny();
        let lm = &model.lm;
        let (padded, valid) = left_pad(lm, &prompts, 0);
        let new_tokens = 5;
        let decode = |room: usize| -> Vec<Vec<f32>> {
            let mut cache = KvCache::with_capacity(lm.config.num_hidden_layers, room);
            let mut layout = SequenceLayout::new(prompts.len());
            let (mut tokens, mut valid) = (padded.clone(), valid.clone());
            let mut out = Vec::new();
            for _ in 0..new_tokens {
                let attention = layout.step_within(&valid, cache.keys_after(valid[0].len()), &Device::flex());
                let rows = last_logits_rows(
                    lm,
                    &tokens,
                    ForwardArgs { layout: &attention, cache: Some(&mut cache), delta: None },
                )
                .unwrap();
                tokens = rows.iter().map(|r| vec![sampler::argmax(r) as u32]).collect();
                valid = vec![vec![true]; prompts.len()];
                out.extend(rows.iter().map(<[f32]>::to_vec));
            }
            out
        };
        let exact = padded[0].len() + new_tokens;
        assert_eq!(decode(exact), decode(decode_room(padded[0].len(), new_tokens)));
    }

    /// Token sequences sharing prefixes, with one sequence a prefix of another.
    fn sequences(model: &Model) -> Vec<Vec<u32>> {
        ["play card 1", "play card 2", "play", "discard card 1", "hint player 1 red"]
            .iter()
            .map(|t| model.tokenizer.encode(t).unwrap())
            .collect()
    }

    #[test]
    fn constrained_rows_spell_a_listed_sequence_and_free_rows_are_unchanged() {
        let (model, prompts) = tiny();
        let sequences = sequences(&model);
        let eos = model.tokenizer.eos_token_ids[0];
        assert!(sequences[0].starts_with(&sequences[2]) && sequences[0].len() > sequences[2].len());
        let trie = TokenTrie::new(&sequences, Some(eos)).unwrap();
        let mut seen = vec![false; sequences.len()];
        // Sampled draws until every sequence has been spelled (deterministic per seed; the
        // cap only guards against a broken sampler).
        for seed in 0..64 {
            if seen.iter().all(|&s| s) {
                break;
            }
            let options = GenerateOptions {
                max_new_tokens: 4,
                sampling: SamplingConfig { temperature: 1.5, top_k: 0, top_p: 1.0 },
                seed,
                stop_at_eos: true,
                use_cache: true,
            };
            let constraints = [None, Some(&trie), Some(&trie)];
            let out =
                generate_constrained(&model.lm, &model.tokenizer.eos_token_ids, &prompts, &constraints, &options, None)
                    .unwrap();
            assert_eq!(out[0].sequence, None);
            for row in &out[1..] {
                let k = row.sequence.expect("a constrained row always completes");
                let mut expected = sequences[k].clone();
                if row.finished_by_eos {
                    expected.push(eos);
                }
                assert_eq!(row.output_ids, expected, "the row spelled sequence {k} (max_new_tokens does not cut it)");
                assert_eq!(trie.lookup(&row.output_ids), Some(k));
                seen[k] = true;
            }
            // No constraint at all: exactly `generate`, sampled draws included.
            let free = generate(&model.lm, &model.tokenizer.eos_token_ids, &prompts, &options, None).unwrap();
            let none = generate_constrained(
                &model.lm,
                &model.tokenizer.eos_token_ids,
                &prompts,
                &[None, None, None],
                &options,
                None,
            )
            .unwrap();
            assert_eq!(free, none);
        }
        // "play" is a prefix of "play card 1": it is reached through EOS like the others.
        assert!(seen.iter().all(|&s| s), "every sequence reachable: {seen:?}");

        // Greedy free rows do not depend on the other rows' constraints.
        let greedy =
            GenerateOptions { max_new_tokens: 6, sampling: SamplingConfig::greedy(), ..GenerateOptions::default() };
        let free = generate(&model.lm, &model.tokenizer.eos_token_ids, &prompts, &greedy, None).unwrap();
        let mixed = generate_constrained(
            &model.lm,
            &model.tokenizer.eos_token_ids,
            &prompts,
            &[None, Some(&trie), None],
            &greedy,
            None,
        )
        .unwrap();
        assert_eq!((&free[0], &free[2]), (&mixed[0], &mixed[2]));
    }

    #[test]
    fn greedy_constrained_decoding_takes_the_masked_argmax_at_every_step() {
        let (model, prompts) = tiny();
        let sequences = sequences(&model);
        let eos = model.tokenizer.eos_token_ids[0];
        let trie = TokenTrie::new(&sequences, Some(eos)).unwrap();
        let greedy =
            GenerateOptions { max_new_tokens: 1, sampling: SamplingConfig::greedy(), ..GenerateOptions::default() };
        let constraints = vec![Some(&trie); prompts.len()];
        for use_cache in [true, false] {
            let options = GenerateOptions { use_cache, ..greedy.clone() };
            let out =
                generate_constrained(&model.lm, &model.tokenizer.eos_token_ids, &prompts, &constraints, &options, None)
                    .unwrap();
            for (prompt, row) in prompts.iter().zip(&out) {
                // Replay the row alone, recomputing the logits: each token is the best allowed one.
                let mut node = TokenTrie::ROOT;
                let mut context = prompt.clone();
                for &token in &row.output_ids {
                    let logits = last_logits(&model.lm, &context, None).unwrap();
                    let allowed = trie.allowed(node);
                    let best = *allowed
                        .iter()
                        .max_by(|a, b| logits[**a as usize].total_cmp(&logits[**b as usize]).then(b.cmp(a)))
                        .unwrap();
                    assert_eq!(token, best, "allowed {allowed:?}");
                    match trie.advance(node, token).unwrap() {
                        TrieStep::Continue(next) => node = next,
                        TrieStep::Complete { sequence } => assert_eq!(Some(sequence), row.sequence),
                    }
                    context.push(token);
                }
            }
        }
    }

    #[test]
    fn constraint_lists_must_match_the_prompts() {
        let (model, prompts) = tiny();
        let trie = TokenTrie::new(&[vec![1, 2]], None).unwrap();
        let options = GenerateOptions::default();
        let err = generate_constrained(&model.lm, &[], &prompts, &[Some(&trie)], &options, None).unwrap_err();
        assert!(err.to_string().contains("1 constraints for 3 prompts"), "{err}");
        let far = TokenTrie::new(&[vec![u32::MAX - 1]], None).unwrap();
        let err = generate_constrained(&model.lm, &[], &prompts[..1], &[Some(&far)], &options, None).unwrap_err();
        assert!(err.to_string().contains("beyond the vocabulary"), "{err}");
    }
}
