//! The update's gradient phase: a [`TrainBatch`] scored in mixed-adapter micro-batches (every
//! row on its own agent's adapter), each micro-batch's loss from the [`Objective`], one
//! backward per micro-batch, gradients summed per adapter. Nothing is stepped here; the
//! optimizer is its own phase ([`super::optimizer`]).

use std::collections::BTreeMap;
use std::time::Instant;

use burn::tensor::{Gradients, Tensor, TensorData};

use super::credit::batch::{TrainBatch, TrainRow};
use super::flops::FlopModel;
use super::objective::{LossStats, Objective, RowTerms};
use crate::adapters::optim::{summed_adapter_grads, zero_grads, AdapterGrads};
use crate::adapters::{AdapterMode, LoraAdapter, MultiAdapterManager};
use crate::error::{Result, RunError, TroupeError};
use crate::generate::choice::{
    candidate_logliks, checkpointed_choice_loss, choice_log_policy, chosen_indices, ChoiceScore, PackedChoices,
};
use crate::generate::{checkpointed_completion_loss, completion_logprobs, ScoringBatch};
use crate::model::checkpoint::Checkpointed;
use crate::model::Model;
use crate::profile::{self, Phase};
use crate::readback::{self, Stage};

/// Log-probability given to absent candidates of a padded `choice` row (far below any present).
const ABSENT_LOGPROB: f32 = -1.0e9;

/// What scoring a batch needs besides the batch: the model and adapters, and the settings that
/// make a row's log-probability what the rollout sampled from.
pub struct Scorer<'a> {
    /// The frozen base.
    pub model: &'a Model,
    /// The agents' adapters.
    pub manager: &'a MultiAdapterManager,
    /// Rows per forward/backward micro-batch (`runtime.micro_batch_rows`).
    pub micro_batch_rows: usize,
    /// Tokens per micro-batch (`runtime.micro_batch_tokens`): when set, micro-batches are
    /// packed by tokens instead of cut every `micro_batch_rows` rows ([`Scorer::split`]).
    pub micro_batch_tokens: Option<usize>,
    /// Recompute each decoder layer's activations in the backward pass
    /// (`runtime.gradient_checkpointing`, [`crate::model::checkpoint`]).
    pub gradient_checkpointing: bool,
    /// The `choice` policy's temperature.
    pub temperature: f64,
    /// How a `choice` candidate is scored.
    pub choice_score: ChoiceScore,
    /// The longest reply (`action.max_new_tokens`; the `constant` normalisation's unit count).
    pub max_new_tokens: usize,
    /// Leave out of the forward and backward passes the rows that carry no gradient: those of
    /// zero advantage when the KL penalty is off ([`Scorer::gradients`]). `false` scores every
    /// row (the reference the skipping is tested against).
    pub skip_zero_advantage: bool,
}

/// What one gradient pass over a batch produced.
pub struct GradientPass {
    /// Per adapter name: the summed gradients.
    pub grads: BTreeMap<String, AdapterGrads>,
    /// Useful FLOPs of the forward and backward passes run.
    pub flops: f64,
    /// The summed loss.
    pub loss: f64,
    /// KL and ratio statistics.
    pub stats: LossStats,
    /// Per agent: units (reply tokens or decisions) trained on.
    pub units_per_agent: BTreeMap<usize, usize>,
}

impl Scorer<'_> {
    /// The row order of a pass, cut into micro-batches ([`Scorer::split`]): replies first, then
    /// `choice` decisions, each in batch order; on the agents' adapters (`by_adapter`, with an
    /// adapter per agent) each agent's rows together, agents ascending, batch order within each.
    /// A micro-batch then holds one adapter's rows wherever an agent's rows fill it, and runs
    /// that adapter's factors as they are, where rows of several adapters would stack their
    /// factors and mask each row's rank columns ([`crate::adapters::MixedLora`]): fewer kernels
    /// and half the rank's products per site for two agents. The sum of the micro-batches'
    /// gradients is the same either way, up to the order of its float additions. A group's
    /// replies on one agent stay together, so their shared prompt is still computed once.
    fn chunks<'b>(&self, batch: &'b TrainBatch, by_adapter: bool) -> (Vec<Vec<&'b TrainRow>>, Vec<Vec<&'b TrainRow>>) {
        let (mut choices, mut replies): (Vec<&TrainRow>, Vec<&TrainRow>) =
            batch.rows.iter().partition(|r| r.choice.is_some());
        if by_adapter && self.manager.mode() == AdapterMode::PerAgent {
            // Stable: batch order within each agent.
            replies.sort_by_key(|r| r.agent);
            choices.sort_by_key(|r| r.agent);
        }
        (self.split(&replies), self.split(&choices))
    }

    /// Cuts `rows` (in order) into micro-batches: every `micro_batch_rows` rows, or, with
    /// `micro_batch_tokens`, packed greedily while the rows' tokens ([`packed_tokens`]) stay
    /// within the budget (a row longer than the budget goes alone).
    fn split<'b>(&self, rows: &[&'b TrainRow]) -> Vec<Vec<&'b TrainRow>> {
        let Some(budget) = self.micro_batch_tokens else {
            return rows.chunks(self.micro_batch_rows.max(1)).map(<[_]>::to_vec).collect();
        };
        let mut out: Vec<Vec<&TrainRow>> = Vec::new();
        let mut current: Vec<&TrainRow> = Vec::new();
        let mut used = 0;
        for &row in rows {
            let tokens = packed_tokens(row);
            if !current.is_empty() && used + tokens > budget {
                out.push(std::mem::take(&mut current));
                used = 0;
            }
            current.push(row);
            used += tokens;
        }
        if !current.is_empty() {
            out.push(current);
        }
        out
    }

    /// Fills every row's [`TrainRow::reference_logprobs`] with the base model's (adapters off):
    /// per completion token, or the log-policy over a decision's candidates.
    pub fn attach_reference(&self, batch: &mut TrainBatch) -> Result<()> {
        // The base alone scores every row: batch order, so rows of several agents after one
        // prompt share it.
        let (replies, choices) = self.chunks(batch, false);
        let mut values: Vec<Vec<f32>> = Vec::new();
        for chunk in replies {
            let tokens: Vec<Vec<u32>> = chunk.iter().map(|r| r.tokens.clone()).collect();
            let from: Vec<usize> = chunk.iter().map(|r| r.prompt_len).collect();
            let scoring = ScoringBatch::new(&self.model.lm, &tokens)?;
            let logprobs = completion_logprobs(&self.model.lm, &scoring, &from, None)?.detach();
            let [_, width] = logprobs.dims();
            let host = readback::to_vec(logprobs, Stage::Scoring)?;
            for (i, row) in chunk.iter().enumerate() {
                values.push(host[i * width..i * width + row.units()].to_vec());
            }
        }
        for chunk in choices {
            let decisions = decisions(&chunk);
            let packed = PackedChoices::new(&self.model.lm, &decisions)?;
            let logliks = candidate_logliks(&self.model.lm, &packed, self.choice_score, None)?;
            let policy = choice_log_policy(logliks, self.temperature).detach();
            let width = policy.dims()[1];
            let host = readback::to_vec(policy, Stage::Scoring)?;
            for (i, &count) in packed.counts().iter().enumerate() {
                values.push(host[i * width..i * width + count].to_vec());
            }
        }
        // `chunks` keeps replies then decisions; put the values back in batch order.
        let (reply_rows, choice_rows): (Vec<usize>, Vec<usize>) =
            (0..batch.rows.len()).partition(|&i| batch.rows[i].choice.is_none());
        for (index, value) in reply_rows.into_iter().chain(choice_rows).zip(values) {
            batch.rows[index].reference_logprobs = Some(value);
        }
        Ok(())
    }

    /// The micro-batches a gradient pass runs, each with the index that seeds its dropout
    /// masks: today's chunks ([`Scorer::chunks`]) of replies then decisions, less the rows that
    /// carry no gradient when `skip`. Without dropout the kept rows are chunked afresh, so
    /// fewer micro-batches run; with dropout only chunks whose every row is skipped are left
    /// out, so every kept row sees the masks it would have seen.
    #[allow(clippy::type_complexity)]
    fn planned<'b>(
        &self,
        batch: &'b TrainBatch,
        skip: bool,
    ) -> (Vec<(usize, Vec<&'b TrainRow>)>, Vec<(usize, Vec<&'b TrainRow>)>) {
        let (replies, choices) = self.chunks(batch, true);
        let dropout = self.has_dropout(batch.rows.iter());
        let plan = |chunks: Vec<Vec<&'b TrainRow>>| -> Vec<(usize, Vec<&'b TrainRow>)> {
            if !skip {
                return chunks.into_iter().enumerate().collect();
            }
            if dropout {
                return chunks.into_iter().enumerate().filter(|(_, c)| c.iter().any(|r| r.advantage != 0.0)).collect();
            }
            let kept: Vec<&TrainRow> = chunks.into_iter().flatten().filter(|r| r.advantage != 0.0).collect();
            self.split(&kept).into_iter().enumerate().collect()
        };
        (plan(replies), plan(choices))
    }

    /// The summed gradients of `objective`'s loss over `batch`. `seed` drives adapter dropout.
    ///
    /// With the KL penalty off, a row of zero advantage adds exactly zero to the loss and to
    /// every gradient (MAGRPO's `-A log p` and the clipped surrogate are both 0 at `A = 0`;
    /// the normalising denominators count every row's units either way). With
    /// [`Scorer::skip_zero_advantage`] such rows are not scored, a micro-batch left empty is
    /// not run, and a batch of zero advantages runs no forward or backward pass at all. Every
    /// adapter that scoring every row would have given a gradient still gets one (zeros for an
    /// agent none of whose rows was run), so the optimizer steps the same adapters: AdamW with
    /// a zero gradient still decays its moments and moves by them, and that step is kept
    /// byte for byte. A skipped row's non-finite sampled log-prob stops the pass as its loss
    /// would have (the adapter that scores it is the one that sampled it). The clipped
    /// objective counts a skipped row's units as measured and unclipped (as TRL counts a zero
    /// advantage: never clipped); on the first epoch its ratio is 1, so nothing changes there.
    pub fn gradients(&self, batch: &TrainBatch, objective: &Objective, seed: u64) -> Result<GradientPass> {
        let units_per_agent = batch.units_per_agent();
        let rows_per_agent = batch.rows_per_agent();
        let sharing = match self.manager.mode() {
            AdapterMode::Shared => units_per_agent.len().max(1),
            AdapterMode::PerAgent => 1,
        };
        let denominator = |row: &TrainRow| {
            let max_units = if row.choice.is_some() { 1 } else { self.max_new_tokens };
            objective.config.denominator(
                units_per_agent[&row.agent],
                rows_per_agent[&row.agent],
                row.units(),
                max_units,
                sharing,
            )
        };
        let with_reference = objective.kl.coef > 0.0;
        let mut pass = GradientPass {
            grads: BTreeMap::new(),
            flops: 0.0,
            loss: 0.0,
            stats: LossStats::default(),
            units_per_agent: units_per_agent.clone(),
        };
        self.check_sampled(&batch.rows.iter().collect::<Vec<_>>(), objective)?;
        let skip = self.skip_zero_advantage && !with_reference;
        for row in batch.rows.iter().filter(|r| skip && r.advantage == 0.0) {
            if let Some(value) = row.sampling_logprobs.iter().find(|v| !v.is_finite()) {
                return Err(TroupeError::Run(RunError::NonFinite {
                    message: format!(
                        "a reply of agent {} was sampled with log-prob {value}; stopped before any update",
                        row.agent
                    ),
                }));
            }
            if objective.config.kind == super::objective::ObjectiveKind::Clipped {
                pass.stats.ratio_units += row.units();
            }
        }
        let (replies, choices) = self.planned(batch, skip);
        // The forward and backward passes of the rows run.
        let trained = self.flop_model().with_backward();
        pass.flops = replies.iter().map(|(_, c)| self.replies_flops(c, true, &trained)).sum::<f64>()
            + choices.iter().flat_map(|(_, c)| c).map(|r| self.row_flops(r, &trained)).sum::<f64>();
        for (chunk_index, chunk) in &replies {
            let started = Instant::now();
            let agents: Vec<Option<usize>> = chunk.iter().map(|r| Some(r.agent)).collect();
            let (delta, used) = self.manager.mixed_for_training(&agents, seed ^ *chunk_index as u64)?;
            let tokens: Vec<Vec<u32>> = chunk.iter().map(|r| r.tokens.clone()).collect();
            let from: Vec<usize> = chunk.iter().map(|r| r.prompt_len).collect();
            let scoring = ScoringBatch::new(&self.model.lm, &tokens)?;
            let loss_of = |logprobs: Tensor<2>| -> Result<(Tensor<1>, LossStats)> {
                let positions = logprobs.dims()[1];
                let mut terms = RowTerms {
                    advantage: chunk.iter().map(|r| r.advantage).collect(),
                    denominator: chunk.iter().map(|r| denominator(r)).collect(),
                    counted: Vec::with_capacity(chunk.len()),
                    sampled: Vec::with_capacity(chunk.len()),
                };
                let mut reference = Vec::with_capacity(chunk.len() * positions);
                for row in chunk {
                    let counted: Vec<bool> = (0..positions).map(|j| j < row.units()).collect();
                    let at = |values: &[f32]| -> Vec<f32> {
                        (0..positions)
                            .map(|j| if counted[j] { values.get(j).copied().unwrap_or(0.0) } else { 0.0 })
                            .collect()
                    };
                    terms.sampled.push(at(&row.sampling_logprobs));
                    if with_reference {
                        reference.extend(at(row.reference_logprobs.as_deref().unwrap_or_default()));
                    }
                    terms.counted.push(counted);
                }
                let reference = with_reference.then(|| {
                    Tensor::<2>::from_data(TensorData::new(reference, [chunk.len(), positions]), &logprobs.device())
                });
                objective.token_loss(logprobs, &terms, reference)
            };
            if self.gradient_checkpointing {
                let mut stats = LossStats::default();
                let run = checkpointed_completion_loss(&self.model.lm, &scoring, &from, Some(&delta), |logprobs| {
                    let (loss, got) = loss_of(logprobs)?;
                    stats = got;
                    Ok(loss)
                })?;
                pass.stats.add(&stats);
                accumulate_checkpointed(&mut pass, run, &used, started)?;
                continue;
            }
            // The LM head runs only at completion positions: position j scores reply token j.
            let logprobs = completion_logprobs(&self.model.lm, &scoring, &from, Some(&delta))?;
            let (loss, stats) = loss_of(logprobs)?;
            pass.stats.add(&stats);
            accumulate(&mut pass, loss, &used, started)?;
        }
        for (chunk_index, chunk) in &choices {
            let started = Instant::now();
            let agents: Vec<Option<usize>> = chunk.iter().map(|r| Some(r.agent)).collect();
            let (delta, used) = self.manager.mixed_for_training(&agents, seed ^ (1 << 32) ^ *chunk_index as u64)?;
            let decisions = decisions(chunk);
            let packed = PackedChoices::new(&self.model.lm, &decisions)?;
            let loss_of = |logliks: Tensor<2>| -> Result<(Tensor<1>, LossStats)> {
                let log_policy = choice_log_policy(logliks, self.temperature);
                let device = log_policy.device();
                let width = log_policy.dims()[1];
                let chosen: Vec<usize> = chunk.iter().map(|r| r.choice.as_ref().map_or(0, |c| c.chosen)).collect();
                let terms = RowTerms {
                    advantage: chunk.iter().map(|r| r.advantage).collect(),
                    denominator: chunk.iter().map(|r| denominator(r)).collect(),
                    counted: vec![vec![true]; chunk.len()],
                    sampled: chunk.iter().map(|r| vec![r.sampling_logprobs.first().copied().unwrap_or(0.0)]).collect(),
                };
                let reference = with_reference.then(|| {
                    let mut values = Vec::with_capacity(chunk.len() * width);
                    for row in chunk {
                        let present = row.reference_logprobs.as_deref().unwrap_or_default();
                        values.extend((0..width).map(|k| present.get(k).copied().unwrap_or(ABSENT_LOGPROB)));
                    }
                    Tensor::<2>::from_data(TensorData::new(values, [chunk.len(), width]), &device)
                });
                objective.choice_loss(log_policy, chosen_indices(&chosen, &device), &terms, reference)
            };
            if self.gradient_checkpointing {
                let mut stats = LossStats::default();
                let run = checkpointed_choice_loss(&self.model.lm, &packed, self.choice_score, Some(&delta), |l| {
                    let (loss, got) = loss_of(l)?;
                    stats = got;
                    Ok(loss)
                })?;
                pass.stats.add(&stats);
                accumulate_checkpointed(&mut pass, run, &used, started)?;
                continue;
            }
            let (loss, stats) = loss_of(candidate_logliks(&self.model.lm, &packed, self.choice_score, Some(&delta))?)?;
            pass.stats.add(&stats);
            accumulate(&mut pass, loss, &used, started)?;
        }
        // Scoring every row gives every adapter with a row a gradient, zero where none of its
        // rows carries any: keep that, so the optimizer steps the same adapters.
        for row in &batch.rows {
            let name = self.manager.adapter_name(row.agent)?;
            if !pass.grads.contains_key(name) {
                let adapter = self.manager.adapter(row.agent)?;
                pass.grads.insert(name.to_string(), zero_grads(adapter));
            }
        }
        Ok(pass)
    }

    /// The clipped objective reads each row's sampling log-probs: refuse rows without them.
    fn check_sampled(&self, chunk: &[&TrainRow], objective: &Objective) -> Result<()> {
        if objective.config.kind == super::objective::ObjectiveKind::Magrpo {
            return Ok(());
        }
        match chunk.iter().find(|r| r.sampling_logprobs.len() != r.units()) {
            Some(row) => Err(TroupeError::setting(
                "training.objective.kind",
                format!(
                    "the clipped objective needs a sampling log-prob per unit, but a row of agent {} has {} for {} units",
                    row.agent,
                    row.sampling_logprobs.len(),
                    row.units()
                ),
            )),
            None => Ok(()),
        }
    }

    /// Forward FLOPs of scoring every row of `batch` once with the base alone (what
    /// [`Scorer::attach_reference`] costs).
    pub fn forward_flops(&self, batch: &TrainBatch) -> f64 {
        let (replies, choices) = self.chunks(batch, false);
        let forward = self.flop_model();
        replies.iter().map(|c| self.replies_flops(c, false, &forward)).sum::<f64>()
            + choices.iter().flatten().map(|r| self.row_flops(r, &forward)).sum::<f64>()
    }

    /// The forward costs of the model scored.
    fn flop_model(&self) -> FlopModel {
        FlopModel::new(&self.model.lm.config)
    }

    /// Whether any of `rows` is scored by an adapter with dropout (whose rows then draw their
    /// own masks).
    fn has_dropout<'b>(&self, mut rows: impl Iterator<Item = &'b TrainRow>) -> bool {
        rows.any(|r| self.manager.adapter(r.agent).is_ok_and(|a| a.config.lora_dropout > 0.0))
    }

    /// FLOPs, at `model`'s costs, of scoring one micro-batch of replies, where rows that share
    /// everything before their last prompt token (on one adapter, when `on_adapters`) compute it
    /// once ([`crate::generate::completion_logprobs`]); under adapter dropout nothing is shared.
    fn replies_flops(&self, chunk: &[&TrainRow], on_adapters: bool, model: &FlopModel) -> f64 {
        let dropout = on_adapters && self.has_dropout(chunk.iter().copied());
        if dropout {
            return chunk.iter().map(|r| self.row_flops(r, model)).sum();
        }
        model.shared_prefixes(chunk.iter().map(|r| {
            let prefix = r.prompt_len.saturating_sub(1);
            let key = (if on_adapters { Some(r.agent) } else { None }, &r.tokens[..prefix]);
            (key, prefix, r.tokens.len() - prefix, r.units())
        }))
    }

    /// FLOPs, at `model`'s costs, of scoring one row.
    fn row_flops(&self, row: &TrainRow, model: &FlopModel) -> f64 {
        match &row.choice {
            Some(choice) => {
                model.packed_choice(row.prompt_len, &choice.candidates.iter().map(Vec::len).collect::<Vec<_>>())
            }
            None => model.causal(row.tokens.len(), row.tokens.len() - row.prompt_len),
        }
    }
}

/// The tokens a row puts through the model in a micro-batch: prompt and reply, or a `choice`
/// decision's prompt and every candidate.
fn packed_tokens(row: &TrainRow) -> usize {
    match &row.choice {
        Some(choice) => row.prompt_len + choice.candidates.iter().map(Vec::len).sum::<usize>(),
        None => row.tokens.len(),
    }
}

/// Each decision's prompt and candidates.
fn decisions<'b>(chunk: &[&'b TrainRow]) -> Vec<(&'b [u32], &'b [Vec<u32>])> {
    chunk
        .iter()
        .map(|r| (&r.tokens[..r.prompt_len], r.choice.as_ref().map_or(&[][..], |c| c.candidates.as_slice())))
        .collect()
}

/// Checks `loss`, adds it to `pass` and its gradients to the adapters' sums. The forward pass
/// (begun at `started`) ends when the loss is read; the rest is the backward pass.
fn accumulate(
    pass: &mut GradientPass,
    loss: Tensor<1>,
    used: &BTreeMap<String, LoraAdapter>,
    started: Instant,
) -> Result<()> {
    let value = readback::to_scalar(loss.clone(), Stage::Update)?;
    profile::since(Phase::UpdateForward, started);
    let backward_started = Instant::now();
    check_finite(value)?;
    pass.loss += f64::from(value);
    add_grads(pass, std::slice::from_ref(&loss.backward()), used);
    profile::since(Phase::Backward, backward_started);
    Ok(())
}

/// [`accumulate`] for a checkpointed forward and backward (begun at `started`; its
/// recomputations are counted as the backward's, which they are part of).
fn accumulate_checkpointed(
    pass: &mut GradientPass,
    run: Checkpointed,
    used: &BTreeMap<String, LoraAdapter>,
    started: Instant,
) -> Result<()> {
    profile::since(Phase::Backward, started);
    check_finite(run.loss)?;
    pass.loss += f64::from(run.loss);
    add_grads(pass, &run.grads, used);
    Ok(())
}

/// Refuses a non-finite loss.
fn check_finite(value: f32) -> Result<()> {
    if !value.is_finite() {
        return Err(TroupeError::Run(RunError::NonFinite {
            message: format!("the loss is {value}; stopped before any update"),
        }));
    }
    Ok(())
}

/// Adds the adapters' gradients in `backward` (one set a backward pass run, summed) to `pass`'s
/// sums.
fn add_grads(pass: &mut GradientPass, backward: &[Gradients], used: &BTreeMap<String, LoraAdapter>) {
    for (name, adapter) in used {
        if let Some(g) = summed_adapter_grads(adapter, backward) {
            let summed = match pass.grads.remove(name) {
                None => g,
                Some(acc) => acc
                    .into_iter()
                    .map(|(site, (a, b))| (site, (a + g[&site].0.clone(), b + g[&site].1.clone())))
                    .collect(),
            };
            pass.grads.insert(name.clone(), summed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::{AdamWConfig, AdamWState, AdapterConfig};
    use crate::model::{Model, Preset, PromptCache};
    use crate::rl::objective::{KlEstimator, KlPenalty, ObjectiveConfig, ObjectiveKind};
    use crate::rl::trainer::tests::flat;
    use burn::tensor::Device;

    /// The tiny model with two agents whose B factors are non-zero (so A gets a gradient).
    fn setup(lora_dropout: f64) -> (Model, MultiAdapterManager) {
        let device = Device::flex();
        let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
        let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
        let config = AdapterConfig { r: 4, lora_alpha: 8.0, lora_dropout, ..AdapterConfig::default() };
        manager.create_adapters(2, &config).unwrap();
        for agent in 0..2 {
            let mut adapter = manager.adapter(agent).unwrap().clone();
            for pair in adapter.pairs.values_mut() {
                pair.b = pair.b.clone().add_scalar(0.01 * (agent + 1) as f64);
            }
            manager.set_adapter(agent, adapter).unwrap();
        }
        (model, manager)
    }

    fn scorer<'a>(model: &'a Model, manager: &'a MultiAdapterManager, skip: bool) -> Scorer<'a> {
        Scorer {
            model,
            manager,
            micro_batch_rows: 3,
            micro_batch_tokens: None,
            gradient_checkpointing: false,
            temperature: 1.0,
            choice_score: ChoiceScore::Sum,
            max_new_tokens: 8,
            skip_zero_advantage: skip,
        }
    }

    /// Six replies of different lengths, agents alternating, with these advantages.
    fn batch(model: &Model, advantages: [f64; 6]) -> TrainBatch {
        let replies = ["TL;DR: the cat sat.", "It ran.", "A dog ran far away, then home", "No.", "Short one", "ok ok"];
        let rows = replies
            .iter()
            .zip(advantages)
            .enumerate()
            .map(|(i, (reply, advantage))| {
                let mut tokens = model.tokenizer.encode(&format!("Post {i}: summarise it.")).unwrap();
                let prompt_len = tokens.len();
                tokens.extend(model.tokenizer.encode(reply).unwrap());
                let units = tokens.len() - prompt_len;
                TrainRow {
                    agent: i % 2,
                    tokens,
                    prompt_len,
                    advantage,
                    sampling_logprobs: vec![-2.0; units],
                    choice: None,
                    reference_logprobs: None,
                }
            })
            .collect();
        TrainBatch { rows }
    }

    /// Records each row's log-probs under its agent's adapter as its sampling log-probs (the
    /// clipped objective's ratio is then 1 on the first epoch, as after a rollout).
    fn on_policy(model: &Model, manager: &MultiAdapterManager, batch: &mut TrainBatch) {
        for row in &mut batch.rows {
            let (delta, _) = manager.mixed(&[Some(row.agent)], false).unwrap();
            let scored =
                crate::generate::score_rows(&model.lm, std::slice::from_ref(&row.tokens), Some(&delta)).unwrap();
            row.sampling_logprobs = scored[0][row.prompt_len - 1..].to_vec();
        }
    }

    fn objective(kind: ObjectiveKind, kl_coef: f64) -> Objective {
        Objective {
            config: ObjectiveConfig { kind, ..ObjectiveConfig::default() },
            kl: KlPenalty { coef: kl_coef, estimator: KlEstimator::K3 },
        }
    }

    /// The same adapters, and per adapter gradients equal within `tolerance` of their scale.
    fn same_gradients(want: &GradientPass, got: &GradientPass, tolerance: f32) {
        assert_eq!(want.grads.keys().collect::<Vec<_>>(), got.grads.keys().collect::<Vec<_>>());
        for (name, grads) in &want.grads {
            let (w, g) = (flat(grads), flat(&got.grads[name]));
            assert_eq!(w.len(), g.len());
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in w.iter().zip(&g) {
                assert!((a - b).abs() <= tolerance * scale, "{name}: {b} vs {a} (scale {scale})");
            }
        }
    }

    #[test]
    fn skipping_zero_advantage_rows_keeps_the_loss_and_the_gradient() {
        let (model, manager) = setup(0.0);
        // Agent 0 has rows of advantage 1, -0.5, 0; agent 1 only zeros but the last.
        let mut batch = batch(&model, [1.0, 0.0, -0.5, 0.0, 0.0, 2.0]);
        on_policy(&model, &manager, &mut batch);
        for kind in [ObjectiveKind::Magrpo, ObjectiveKind::Clipped] {
            let objective = objective(kind, 0.0);
            let all = scorer(&model, &manager, false).gradients(&batch, &objective, 7).unwrap();
            let skipped = scorer(&model, &manager, true).gradients(&batch, &objective, 7).unwrap();
            assert!((all.loss - skipped.loss).abs() <= 1e-6 * all.loss.abs().max(1.0), "{kind:?}: loss");
            assert!(all.grads.values().all(|g| flat(g).iter().any(|v| *v != 0.0)), "gradients to compare");
            same_gradients(&all, &skipped, 1e-5);
            assert_eq!(all.stats, skipped.stats, "{kind:?}: the clipped statistics");
            assert!(skipped.flops < 0.6 * all.flops, "three rows of six run: {} vs {}", skipped.flops, all.flops);
        }
        // An agent whose every row has zero advantage gets exactly zero, either way.
        let batch = self::batch(&model, [1.0, 0.0, -0.5, 0.0, 0.0, 0.0]);
        let objective = objective(ObjectiveKind::Magrpo, 0.0);
        let all = scorer(&model, &manager, false).gradients(&batch, &objective, 7).unwrap();
        let skipped = scorer(&model, &manager, true).gradients(&batch, &objective, 7).unwrap();
        assert!(flat(&all.grads["agent_1"]).iter().all(|v| *v == 0.0));
        assert_eq!(flat(&all.grads["agent_1"]), flat(&skipped.grads["agent_1"]));
        same_gradients(&all, &skipped, 1e-5);
    }

    #[test]
    fn token_sized_micro_batches_give_the_loss_and_gradients_of_row_sized_ones() {
        let (model, manager) = setup(0.0);
        let mut batch = batch(&model, [1.0, -0.5, 0.25, 2.0, -1.0, 0.5]);
        on_policy(&model, &manager, &mut batch);
        let lengths: Vec<usize> = batch.rows.iter().map(|r| r.tokens.len()).collect();
        for kind in [ObjectiveKind::Magrpo, ObjectiveKind::Clipped] {
            let objective = objective(kind, 0.0);
            let rows = scorer(&model, &manager, false).gradients(&batch, &objective, 7).unwrap();
            // One row each, rows packed two or three at a time, all in one.
            let longest = *lengths.iter().max().unwrap();
            for budget in [1, longest + 1, 2 * longest, 3 * longest, 10_000] {
                let tokens = Scorer { micro_batch_tokens: Some(budget), ..scorer(&model, &manager, false) };
                let cut = tokens.split(&batch.rows.iter().collect::<Vec<_>>());
                assert_eq!(cut.iter().map(Vec::len).sum::<usize>(), 6);
                for chunk in &cut {
                    let used: usize = chunk.iter().map(|r| r.tokens.len()).sum();
                    assert!(chunk.len() == 1 || used <= budget, "budget {budget}: {used} tokens in {}", chunk.len());
                }
                let got = tokens.gradients(&batch, &objective, 7).unwrap();
                assert!((rows.loss - got.loss).abs() <= 1e-5 * rows.loss.abs().max(1.0), "{kind:?} {budget}: loss");
                same_gradients(&rows, &got, 1e-5);
                assert_eq!(rows.stats.ratio_units, got.stats.ratio_units);
            }
        }
        // Greedy packing in order: a row longer than the budget goes alone.
        let tokens = Scorer { micro_batch_tokens: Some(lengths[0] + lengths[1]), ..scorer(&model, &manager, false) };
        let cut = tokens.split(&batch.rows.iter().collect::<Vec<_>>());
        assert_eq!(cut[0].len(), 2, "the first two rows fit exactly");
        let alone = Scorer { micro_batch_tokens: Some(1), ..scorer(&model, &manager, false) };
        assert!(alone.split(&batch.rows.iter().collect::<Vec<_>>()).iter().all(|c| c.len() == 1));
    }

    #[test]
    fn on_per_agent_adapters_a_micro_batch_holds_one_agents_rows_with_the_gradients_of_one_mixed_pass() {
        let (model, manager) = setup(0.0);
        // Agents alternate, 0, 1, 0, 1, 0, 1; micro-batches of three rows.
        let mut batch = batch(&model, [1.0, -0.5, 0.25, 2.0, -1.0, 0.5]);
        on_policy(&model, &manager, &mut batch);
        let scorer = scorer(&model, &manager, false);
        let (replies, _) = scorer.planned(&batch, false);
        let agents: Vec<Vec<usize>> = replies.iter().map(|(_, c)| c.iter().map(|r| r.agent).collect()).collect();
        assert_eq!(agents, [vec![0, 0, 0], vec![1, 1, 1]], "each agent's rows together, agents ascending");
        for (agent, (_, chunk)) in replies.iter().enumerate() {
            let want: Vec<&TrainRow> = batch.rows.iter().filter(|r| r.agent == agent).collect();
            assert!(chunk.iter().zip(&want).all(|(a, b)| std::ptr::eq(*a, *b)), "batch order within an agent");
        }
        // The base alone scores every row in batch order.
        let (reference, _) = scorer.chunks(&batch, false);
        assert_eq!(reference[0].iter().map(|r| r.agent).collect::<Vec<_>>(), [0, 1, 0]);
        // Against one micro-batch of all six rows, the two adapters' factors stacked and masked.
        for kind in [ObjectiveKind::Magrpo, ObjectiveKind::Clipped] {
            let objective = objective(kind, 0.0);
            let split = scorer.gradients(&batch, &objective, 7).unwrap();
            let whole = Scorer { micro_batch_rows: 6, ..self::scorer(&model, &manager, false) }
                .gradients(&batch, &objective, 7)
                .unwrap();
            assert!((whole.loss - split.loss).abs() <= 1e-6 * whole.loss.abs().max(1.0), "{kind:?}: loss");
            assert!(whole.grads.values().all(|g| flat(g).iter().any(|v| *v != 0.0)), "gradients to compare");
            same_gradients(&whole, &split, 1e-5);
            assert_eq!(whole.stats.ratio_units, split.stats.ratio_units);
        }
        // One adapter for every agent: nothing to group, batch order.
        let mut shared = MultiAdapterManager::new(&model.lm.config, model.lm.device());
        shared.create_shared_adapter(2, &AdapterConfig::default(), 0).unwrap();
        let on_shared = Scorer { manager: &shared, ..self::scorer(&model, &manager, false) };
        let (replies, _) = on_shared.planned(&batch, false);
        assert_eq!(replies[0].1.iter().map(|r| r.agent).collect::<Vec<_>>(), [0, 1, 0]);
    }

    /// Replies where rows 0-1 and 2-3 answer one prompt each on one agent (so the prompt is
    /// computed once and shared), then two `choice` decisions.
    fn mixed_batch(model: &Model) -> TrainBatch {
        let enc = |t: &str| model.tokenizer.encode(t).unwrap();
        let mut rows = Vec::new();
        for (i, (prompt, reply, agent, advantage)) in [
            ("A long shared post about cats: summarise it.", "TL;DR: cats.", 0, 1.0),
            ("A long shared post about cats: summarise it.", "Cats sit on mats, mostly", 0, -0.5),
            ("Another post, on dogs and walks: summarise.", "Dogs walk.", 1, 0.75),
            ("Another post, on dogs and walks: summarise.", "No.", 1, -1.25),
            ("Lone post.", "ok then ok", 0, 0.5),
        ]
        .into_iter()
        .enumerate()
        {
            let mut tokens = enc(prompt);
            let prompt_len = tokens.len();
            tokens.extend(enc(reply));
            let units = tokens.len() - prompt_len;
            rows.push(TrainRow {
                agent,
                tokens,
                prompt_len,
                advantage,
                sampling_logprobs: vec![-2.0 - 0.1 * i as f32; units],
                choice: None,
                reference_logprobs: None,
            });
        }
        for (agent, prompt, advantage) in [(1, "Your turn. Legal: play 1-5", 1.5), (0, "Bid:", -0.5)] {
            let tokens = enc(prompt);
            let candidates = vec![enc("play 1"), enc("discard 3 [??]"), enc("hint red")];
            rows.push(TrainRow {
                agent,
                prompt_len: tokens.len(),
                tokens,
                advantage,
                sampling_logprobs: vec![-1.1],
                choice: Some(crate::rl::rollout::ChoiceTurn { candidates, chosen: 1, entropy: 0.0 }),
                reference_logprobs: None,
            });
        }
        TrainBatch { rows }
    }

    #[test]
    fn gradient_checkpointing_gives_the_loss_and_gradients_of_a_plain_backward() {
        // With a group's prompt copied to its rows and held once (the mixed batch's groups).
        for (dropout, prompts) in [(0.0, PromptCache::Copied), (0.2, PromptCache::Copied), (0.2, PromptCache::Shared)] {
            let (mut model, manager) = setup(dropout);
            model.lm.set_prompt_cache(prompts);
            for batch in [batch(&model, [1.0, -0.5, 0.25, 2.0, -1.0, 0.5]), mixed_batch(&model)] {
                for (kind, kl) in
                    [(ObjectiveKind::Magrpo, 0.0), (ObjectiveKind::Clipped, 0.0), (ObjectiveKind::Magrpo, 0.1)]
                {
                    let mut batch = batch.clone();
                    let objective = objective(kind, kl);
                    if kl > 0.0 {
                        scorer(&model, &manager, false).attach_reference(&mut batch).unwrap();
                    }
                    let plain = scorer(&model, &manager, false).gradients(&batch, &objective, 5).unwrap();
                    let checkpointed = Scorer { gradient_checkpointing: true, ..scorer(&model, &manager, false) }
                        .gradients(&batch, &objective, 5)
                        .unwrap();
                    let case = format!("dropout {dropout}, {prompts:?}, {kind:?}, kl {kl}");
                    assert!(
                        (plain.loss - checkpointed.loss).abs() <= 1e-5 * plain.loss.abs().max(1.0),
                        "{case}: loss {} vs {}",
                        plain.loss,
                        checkpointed.loss
                    );
                    assert!(plain.grads.values().all(|g| flat(g).iter().any(|v| *v != 0.0)), "{case}: gradients");
                    same_gradients(&plain, &checkpointed, 1e-5);
                    assert_eq!(plain.stats.ratio_units, checkpointed.stats.ratio_units, "{case}");
                    assert!((plain.stats.kl_sum - checkpointed.stats.kl_sum).abs() <= 1e-5, "{case}");
                }
            }
        }
    }

    #[test]
    fn a_batch_of_zero_advantages_runs_no_pass_and_adamw_steps_byte_for_byte_as_before() {
        let (model, mut manager) = setup(0.0);
        let objective = objective(ObjectiveKind::Magrpo, 0.0);
        // One real step first, so AdamW has moments that a zero gradient still moves by.
        let first = batch(&model, [1.0, -1.0, 0.5, 0.25, -0.5, 2.0]);
        let pass = scorer(&model, &manager, true).gradients(&first, &objective, 1).unwrap();
        let adamw = AdamWConfig { lr: 1e-2, ..AdamWConfig::default() };
        let mut states: BTreeMap<String, AdamWState> = BTreeMap::new();
        for (agent, name) in [(0, "agent_0"), (1, "agent_1")] {
            let stepped = adamw.step(
                manager.adapter(agent).unwrap(),
                &pass.grads[name],
                states.entry(name.into()).or_default(),
                1e-2,
            );
            manager.set_adapter(agent, stepped).unwrap();
        }
        let zeros = batch(&model, [0.0; 6]);
        let all = scorer(&model, &manager, false).gradients(&zeros, &objective, 2).unwrap();
        let skipped = scorer(&model, &manager, true).gradients(&zeros, &objective, 2).unwrap();
        assert_eq!((skipped.flops, skipped.loss), (0.0, 0.0), "no forward or backward pass");
        assert_eq!(all.loss, 0.0);
        assert_eq!(all.grads.keys().collect::<Vec<_>>(), skipped.grads.keys().collect::<Vec<_>>());
        for (name, grads) in &all.grads {
            assert!(flat(grads).iter().all(|v| *v == 0.0), "{name}: scoring every row gives zeros");
        }
        let step = |grads: &BTreeMap<String, AdapterGrads>| {
            let mut states = states.clone();
            let mut out = Vec::new();
            for (agent, name) in [(0, "agent_0"), (1, "agent_1")] {
                let state = states.get_mut(name).unwrap();
                let stepped = adamw.step(manager.adapter(agent).unwrap(), &grads[name], state, 1e-2);
                let moments: Vec<Vec<f32>> = state
                    .moments()
                    .values()
                    .flat_map(|(a, b)| [&a.m, &a.v, &b.m, &b.v])
                    .map(|t| t.clone().into_data().try_into_vec::<f32>().unwrap())
                    .collect();
                out.push((stepped.to_host().unwrap(), moments, state.step));
            }
            out
        };
        let (want, got) = (step(&all.grads), step(&skipped.grads));
        assert_ne!(want[0].0, manager.adapter(0).unwrap().to_host().unwrap(), "a zero gradient still moves AdamW");
        assert_eq!(want, got, "byte-identical adapters and moments");
    }

    #[test]
    fn with_dropout_only_whole_micro_batches_are_skipped_and_nothing_changes() {
        let (model, manager) = setup(0.2);
        // Micro-batches of 3: the second holds only zero advantages.
        let batch = batch(&model, [1.0, 0.0, -0.5, 0.0, 0.0, 0.0]);
        let objective = objective(ObjectiveKind::Magrpo, 0.0);
        let all = scorer(&model, &manager, false).gradients(&batch, &objective, 3).unwrap();
        let skipped = scorer(&model, &manager, true).gradients(&batch, &objective, 3).unwrap();
        assert_eq!(all.loss, skipped.loss);
        same_gradients(&all, &skipped, 0.0);
        assert!(skipped.flops < all.flops, "the second micro-batch is not run");
    }

    #[test]
    fn with_a_kl_penalty_every_row_is_scored() {
        let (model, manager) = setup(0.0);
        let mut batch = batch(&model, [1.0, 0.0, -0.5, 0.0, 0.0, 2.0]);
        let objective = objective(ObjectiveKind::Magrpo, 0.1);
        scorer(&model, &manager, true).attach_reference(&mut batch).unwrap();
        let all = scorer(&model, &manager, false).gradients(&batch, &objective, 7).unwrap();
        let skipped = scorer(&model, &manager, true).gradients(&batch, &objective, 7).unwrap();
        assert_eq!(all.flops, skipped.flops);
        assert_eq!(all.loss, skipped.loss);
        same_gradients(&all, &skipped, 0.0);
    }

    #[test]
    fn a_skipped_row_sampled_with_a_non_finite_log_prob_stops_the_pass() {
        let (model, manager) = setup(0.0);
        let mut batch = batch(&model, [1.0, 0.0, -0.5, 0.0, 0.0, 2.0]);
        batch.rows[3].sampling_logprobs[0] = f32::NAN;
        let err =
            scorer(&model, &manager, true).gradients(&batch, &objective(ObjectiveKind::Magrpo, 0.0), 7).err().unwrap();
        assert!(matches!(err, TroupeError::Run(RunError::NonFinite { .. })), "{err}");
    }
}
