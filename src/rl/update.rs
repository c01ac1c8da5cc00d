//! The update's gradient phase: a [`TrainBatch`] scored in mixed-adapter micro-batches (every
//! row on its own agent's adapter), each micro-batch's loss from the [`Objective`], one
//! backward per micro-batch, gradients summed per adapter. Nothing is stepped here; the
//! optimizer is its own phase ([`super::optimizer`]).

use std::collections::BTreeMap;

use burn::tensor::{Tensor, TensorData};

use super::batch::{TrainBatch, TrainRow};
use super::flops::FlopModel;
use super::objective::{LossStats, Objective, RowTerms};
use crate::adapters::optim::{adapter_grads, AdapterGrads};
use crate::adapters::{AdapterMode, LoraAdapter, MultiAdapterManager};
use crate::error::{Result, TroupeError};
use crate::generate::choice::{candidate_logliks, choice_log_policy, chosen_indices, ChoiceScore, PackedChoices};
use crate::generate::{completion_logprobs, ScoringBatch};
use crate::model::Model;

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
    /// The `choice` policy's temperature.
    pub temperature: f64,
    /// How a `choice` candidate is scored.
    pub choice_score: ChoiceScore,
    /// The longest reply (`action.max_new_tokens`; the `constant` normalisation's unit count).
    pub max_new_tokens: usize,
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
    /// The row order of a pass: replies first, then `choice` decisions, each in batch order,
    /// chunked by `micro_batch_rows`.
    fn chunks<'b>(&self, batch: &'b TrainBatch) -> (Vec<Vec<&'b TrainRow>>, Vec<Vec<&'b TrainRow>>) {
        let (choices, replies): (Vec<&TrainRow>, Vec<&TrainRow>) = batch.rows.iter().partition(|r| r.choice.is_some());
        let micro = self.micro_batch_rows.max(1);
        (replies.chunks(micro).map(<[_]>::to_vec).collect(), choices.chunks(micro).map(<[_]>::to_vec).collect())
    }

    /// Fills every row's [`TrainRow::reference_logprobs`] with the base model's (adapters off):
    /// per completion token, or the log-policy over a decision's candidates.
    pub fn attach_reference(&self, batch: &mut TrainBatch) -> Result<()> {
        let (replies, choices) = self.chunks(batch);
        let mut values: Vec<Vec<f32>> = Vec::new();
        for chunk in replies {
            let tokens: Vec<Vec<u32>> = chunk.iter().map(|r| r.tokens.clone()).collect();
            let from: Vec<usize> = chunk.iter().map(|r| r.prompt_len).collect();
            let scoring = ScoringBatch::new(&self.model.lm, &tokens)?;
            let logprobs = completion_logprobs(&self.model.lm, &scoring, &from, None)?.detach();
            let [_, width] = logprobs.dims();
            let host = logprobs.into_data().try_into_vec::<f32>().expect("log-probs are f32");
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
            let host = policy.into_data().try_into_vec::<f32>().expect("log-probs are f32");
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

    /// The summed gradients of `objective`'s loss over `batch`. `seed` drives adapter dropout.
    /// Every row is scored, even one with zero advantage: its log-probs are what reveal a
    /// diverged (non-finite) adapter before any update.
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
        // Forward, then a backward of twice its work.
        pass.flops = 3.0 * self.forward_flops(batch);
        let (replies, choices) = self.chunks(batch);
        for (chunk_index, chunk) in replies.iter().enumerate() {
            let agents: Vec<Option<usize>> = chunk.iter().map(|r| Some(r.agent)).collect();
            let (delta, used) = self.manager.mixed_for_training(&agents, seed ^ chunk_index as u64)?;
            let tokens: Vec<Vec<u32>> = chunk.iter().map(|r| r.tokens.clone()).collect();
            let from: Vec<usize> = chunk.iter().map(|r| r.prompt_len).collect();
            let scoring = ScoringBatch::new(&self.model.lm, &tokens)?;
            // The LM head runs only at completion positions: position j scores reply token j.
            let logprobs = completion_logprobs(&self.model.lm, &scoring, &from, Some(&delta))?;
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
            self.check_sampled(chunk, objective)?;
            let reference = with_reference.then(|| {
                Tensor::<2>::from_data(TensorData::new(reference, [chunk.len(), positions]), &logprobs.device())
            });
            let (loss, stats) = objective.token_loss(logprobs, &terms, reference)?;
            pass.stats.add(&stats);
            accumulate(&mut pass, loss, &used)?;
        }
        for (chunk_index, chunk) in choices.iter().enumerate() {
            let agents: Vec<Option<usize>> = chunk.iter().map(|r| Some(r.agent)).collect();
            let (delta, used) = self.manager.mixed_for_training(&agents, seed ^ (1 << 32) ^ chunk_index as u64)?;
            let decisions = decisions(chunk);
            let packed = PackedChoices::new(&self.model.lm, &decisions)?;
            let log_policy = choice_log_policy(
                candidate_logliks(&self.model.lm, &packed, self.choice_score, Some(&delta))?,
                self.temperature,
            );
            let device = log_policy.device();
            let width = log_policy.dims()[1];
            let chosen: Vec<usize> = chunk.iter().map(|r| r.choice.as_ref().map_or(0, |c| c.chosen)).collect();
            let terms = RowTerms {
                advantage: chunk.iter().map(|r| r.advantage).collect(),
                denominator: chunk.iter().map(|r| denominator(r)).collect(),
                counted: vec![vec![true]; chunk.len()],
                sampled: chunk.iter().map(|r| vec![r.sampling_logprobs.first().copied().unwrap_or(0.0)]).collect(),
            };
            self.check_sampled(chunk, objective)?;
            let reference = with_reference.then(|| {
                let mut values = Vec::with_capacity(chunk.len() * width);
                for row in chunk {
                    let present = row.reference_logprobs.as_deref().unwrap_or_default();
                    values.extend((0..width).map(|k| present.get(k).copied().unwrap_or(ABSENT_LOGPROB)));
                }
                Tensor::<2>::from_data(TensorData::new(values, [chunk.len(), width]), &device)
            });
            let (loss, stats) =
                objective.choice_loss(log_policy, chosen_indices(&chosen, &device), &terms, reference)?;
            pass.stats.add(&stats);
            accumulate(&mut pass, loss, &used)?;
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

    /// Forward FLOPs of scoring every row of `batch` once (what [`Scorer::attach_reference`]
    /// costs; a gradient pass costs three times as much).
    pub fn forward_flops(&self, batch: &TrainBatch) -> f64 {
        batch.rows.iter().map(|r| self.row_flops(r)).sum()
    }

    /// Forward FLOPs of scoring one row.
    fn row_flops(&self, row: &TrainRow) -> f64 {
        let model = FlopModel::new(&self.model.lm.config);
        match &row.choice {
            Some(choice) => {
                model.packed_choice(row.prompt_len, &choice.candidates.iter().map(Vec::len).collect::<Vec<_>>())
            }
            None => model.causal(row.tokens.len(), row.tokens.len() - row.prompt_len),
        }
    }
}

/// Each decision's prompt and candidates.
fn decisions<'b>(chunk: &[&'b TrainRow]) -> Vec<(&'b [u32], &'b [Vec<u32>])> {
    chunk
        .iter()
        .map(|r| (&r.tokens[..r.prompt_len], r.choice.as_ref().map_or(&[][..], |c| c.candidates.as_slice())))
        .collect()
}

/// Checks `loss`, adds it to `pass` and its gradients to the adapters' sums.
fn accumulate(pass: &mut GradientPass, loss: Tensor<1>, used: &BTreeMap<String, LoraAdapter>) -> Result<()> {
    let value: f32 = loss.clone().into_scalar();
    if !value.is_finite() {
        return Err(TroupeError::NonFinite { message: format!("the loss is {value}; stopped before any update") });
    }
    pass.loss += f64::from(value);
    let backward = loss.backward();
    for (name, adapter) in used {
        if let Some(g) = adapter_grads(adapter, &backward) {
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
    Ok(())
}
