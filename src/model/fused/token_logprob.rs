//! `log softmax(logits)[target]` for each row, the scorer's inner step, as one parallel pass
//! forward and one backward.
//!
//! Forward, per row: the maximum, `lse = max + ln sum e^(x - max)` and `x[target] - lse`. The
//! logits stay saved with the row's `lse`; the backward writes
//! `d x[v] = g (1[v = target] - e^(x[v] - lse))` in one pass. burn's composite (subtract,
//! exponentiate, sum, log, gather, each with its backward, the exponential computed again for
//! it) makes about ten single-threaded passes over a `rows x vocabulary` tensor.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};
use rayon::prelude::*;

use super::vexp::{exp_shifted_sum, scaled_exp};
use super::{on_flex, rows_per_task, with_rows, Rows};

/// The target token of each row.
pub type Targets = Arc<[u32]>;

/// The fused token log-probability, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait TokenLogprobBackend: burn::backend::Backend {
    /// `log softmax(logits[r])[targets[r]]` for each row `r`.
    ///
    /// # Shapes
    /// `logits`: `[rows, vocab]` -> `[rows]`
    fn token_logprobs(logits: FloatTensor<Self>, targets: Targets) -> FloatTensor<Self>;
}

/// `log sum e^values`, as the scorer computes it: the maximum, then the vectorized `exp` of the
/// shifted values summed in lanes.
pub fn log_sum_exp(values: &[f32]) -> f32 {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max + exp_shifted_sum(values, max, None).ln()
}

/// Each row's log-sum-exp and its target's log-probability.
fn forward(logits: &Rows<'_>, targets: &[u32]) -> (Vec<f32>, Vec<f32>) {
    (0..logits.rows)
        .into_par_iter()
        .with_min_len(rows_per_task(logits.width))
        .map(|r| {
            let row = logits.row(r);
            let lse = log_sum_exp(row);
            (lse, row[targets[r] as usize] - lse)
        })
        .unzip()
}

fn check(logits: &FlexTensor, targets: &[u32]) -> [usize; 2] {
    let [rows, vocab] = logits.layout().shape().dims::<2>();
    assert_eq!(rows, targets.len(), "token_logprobs: one target per row");
    assert!(targets.iter().all(|&t| (t as usize) < vocab), "token_logprobs: a target past the vocabulary");
    [rows, vocab]
}

impl TokenLogprobBackend for Flex {
    fn token_logprobs(logits: FlexTensor, targets: Targets) -> FlexTensor {
        let [rows, _] = check(&logits, &targets);
        let (_, logprobs) = with_rows(&logits, |l: &Rows<'_>| forward(l, &targets));
        FlexTensor::from_data(TensorData::new(logprobs, [rows]))
    }
}

/// The backward of [`TokenLogprobBackend::token_logprobs`]: the logits' gradient.
#[derive(Debug)]
struct TokenLogprobBackward;

/// What the backward needs: the logits, each row's log-sum-exp, the targets.
#[derive(Clone, Debug)]
struct Saved {
    logits: FlexTensor,
    lse: Arc<[f32]>,
    targets: Targets,
}

impl Backward<Flex, 1> for TokenLogprobBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_logits] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let Some(node) = node_logits else { return };
        let Saved { logits, lse, targets } = ops.state;
        let grad: Vec<f32> = with_rows(&grad, |g: &Rows<'_>| (0..g.rows).flat_map(|r| g.row(r)).copied().collect());
        let [rows, vocab] = logits.layout().shape().dims::<2>();
        let mut d_logits = vec![0.0f32; rows * vocab];
        with_rows(&logits, |l: &Rows<'_>| {
            d_logits.par_chunks_mut(vocab).with_min_len(rows_per_task(vocab)).enumerate().for_each(|(r, out)| {
                scaled_exp(l.row(r), lse[r], -grad[r], out);
                out[targets[r] as usize] += grad[r];
            });
        });
        grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(d_logits, [rows, vocab])));
    }
}

impl<C: CheckpointStrategy> TokenLogprobBackend for Autodiff<Flex, C> {
    fn token_logprobs(logits: FloatTensor<Self>, targets: Targets) -> FloatTensor<Self> {
        match TokenLogprobBackward.prepare::<C>([logits.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let saved = logits.primitive().clone();
                let [rows, _] = check(&saved, &targets);
                let (lse, logprobs) = with_rows(&saved, |l: &Rows<'_>| forward(l, &targets));
                let out = FlexTensor::from_data(TensorData::new(logprobs, [rows]));
                prep.finish(Saved { logits: saved, lse: lse.into(), targets }, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::token_logprobs(logits.into_primitive(), targets)),
        }
    }
}

/// `log softmax(logits[r])[targets[r]]` for each row: fused on the CPU, one kernel on a GPU
/// without gradients ([`super::gpu::token_logprobs`]), burn's composite elsewhere
/// ([`composite`]). Differentiable in `logits`.
///
/// # Shapes
/// `logits`: `[rows, vocab]`, `targets`: one id below `vocab` per row -> `[rows]`
pub fn token_logprobs(logits: Tensor<2>, targets: &[u32]) -> Tensor<1> {
    if !on_flex(&logits) {
        let [rows, _] = logits.dims();
        let ids: Vec<i64> = targets.iter().map(|&t| i64::from(t)).collect();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [rows]), &logits.device());
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if super::gpu::takes(&logits) {
            return super::gpu::token_logprobs(logits, ids);
        }
        return composite(logits, ids);
    }
    let targets: Targets = targets.into();
    Tensor::from_dispatch(<Dispatch as TokenLogprobBackend>::token_logprobs(logits.into_dispatch(), targets))
}

/// burn's composite of [`token_logprobs`], with the targets on the logits' device: the maximum
/// (detached), `lse = ln sum e^(x - max) + max`, the gathered targets minus `lse`.
///
/// # Shapes
/// `logits`: `[rows, vocab]`, `targets`: `[rows]` -> `[rows]`
pub fn composite(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [rows, _] = logits.dims();
    let max = logits.clone().detach().max_dim(1);
    let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
    (logits.gather(1, targets.reshape([rows, 1])) - lse).reshape([rows])
}

/// Each row's `log softmax(logits[r])[targets[r]]` and the gradient of it with respect to the
/// row's logits, `1[v = target] - softmax(logits[r])[v]`: what the scorer's backward would
/// multiply by each row's incoming gradient, computed in the forward so that the logits need
/// not be kept for it ([`crate::model::head`]). Outside autodiff: fused on the CPU, one kernel
/// on a GPU ([`super::gpu::token_logprobs_and_complement`]), burn's ops elsewhere.
///
/// # Shapes
/// `logits`: `[rows, vocab]`, `targets`: one id below `vocab` per row -> (`[rows]`, `[rows, vocab]`)
pub fn token_logprobs_and_complement(logits: Tensor<2>, targets: &[u32]) -> (Tensor<1>, Tensor<2>) {
    let [rows, vocab] = logits.dims();
    assert_eq!(rows, targets.len(), "token_logprobs_and_complement: one target per row");
    assert!(
        targets.iter().all(|&t| (t as usize) < vocab),
        "token_logprobs_and_complement: a target past the vocabulary"
    );
    let logits = logits.without_autodiff();
    if on_flex(&logits) && logits.dtype() == DType::F32 {
        if let Ok(primitive) = logits.clone().try_into_primitive::<Flex>() {
            let (logprobs, complement) = complement_rows(&primitive, targets);
            return (
                Tensor::from_primitive::<Flex>(FlexTensor::from_data(TensorData::new(logprobs, [rows]))),
                Tensor::from_primitive::<Flex>(FlexTensor::from_data(TensorData::new(complement, [rows, vocab]))),
            );
        }
    }
    let device = logits.device();
    let ids: Vec<i64> = targets.iter().map(|&t| i64::from(t)).collect();
    let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [rows]), &device);
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if super::gpu::takes(&logits) {
        return super::gpu::token_logprobs_and_complement(logits, ids);
    }
    composite_complement(logits, ids)
}

/// burn's composite of [`token_logprobs_and_complement`], with the targets on the logits' device.
///
/// # Shapes
/// `logits`: `[rows, vocab]`, `targets`: `[rows]` -> (`[rows]`, `[rows, vocab]`)
pub fn composite_complement(logits: Tensor<2>, targets: Tensor<1, Int>) -> (Tensor<1>, Tensor<2>) {
    let [rows, _] = logits.dims();
    let max = logits.clone().max_dim(1);
    let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let targets = targets.reshape([rows, 1]);
    let logprobs = (logits.clone().gather(1, targets.clone()) - lse.clone()).reshape([rows]);
    let ones = Tensor::<2>::ones([rows, 1], &logits.device());
    let complement = (logits - lse).exp().neg().scatter(1, targets, ones, IndexingUpdateOp::Add);
    (logprobs, complement)
}

/// Each row's target log-probability and its complement row (`1[v = target] - e^(x[v] - lse)`),
/// rows in parallel; the targets checked by the caller.
fn complement_rows(logits: &FlexTensor, targets: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let [rows, vocab] = logits.layout().shape().dims::<2>();
    let mut complement = vec![0.0f32; rows * vocab];
    let logprobs = with_rows(logits, |l: &Rows<'_>| {
        complement
            .par_chunks_mut(vocab.max(1))
            .with_min_len(rows_per_task(vocab))
            .enumerate()
            .map(|(r, out)| {
                let row = l.row(r);
                let lse = log_sum_exp(row);
                let target = targets[r] as usize;
                scaled_exp(row, lse, -1.0, out);
                out[target] += 1.0;
                row[target] - lse
            })
            .collect::<Vec<f32>>()
    });
    (logprobs, complement)
}

/// Each row's `log sum e^x`, as a burn backend extension (the other half of a log-softmax
/// whose targets are gathered separately).
#[backend_extension(Autodiff, Flex)]
pub trait LogSumExpBackend: burn::backend::Backend {
    /// `log sum_v e^(logits[r, v])` for each row `r`.
    ///
    /// # Shapes
    /// `logits`: `[rows, vocab]` -> `[rows]`
    fn logsumexp(logits: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// Each row's log-sum-exp, in parallel.
fn row_lse(logits: &Rows<'_>) -> Vec<f32> {
    (0..logits.rows)
        .into_par_iter()
        .with_min_len(rows_per_task(logits.width))
        .map(|r| log_sum_exp(logits.row(r)))
        .collect()
}

impl LogSumExpBackend for Flex {
    fn logsumexp(logits: FlexTensor) -> FlexTensor {
        let lse = with_rows(&logits, row_lse);
        let rows = lse.len();
        FlexTensor::from_data(TensorData::new(lse, [rows]))
    }
}

/// The backward of [`LogSumExpBackend::logsumexp`]: `d logits[r, v] = g[r] e^(logits[r, v] -
/// lse[r])`.
#[derive(Debug)]
struct LogSumExpBackward;

impl Backward<Flex, 1> for LogSumExpBackward {
    /// The logits and each row's log-sum-exp.
    type State = (FlexTensor, Arc<[f32]>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_logits] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let Some(node) = node_logits else { return };
        let (logits, lse) = ops.state;
        let grad: Vec<f32> = with_rows(&grad, |g: &Rows<'_>| (0..g.rows).flat_map(|r| g.row(r)).copied().collect());
        let [rows, vocab] = logits.layout().shape().dims::<2>();
        let mut d_logits = vec![0.0f32; rows * vocab];
        with_rows(&logits, |l: &Rows<'_>| {
            d_logits.par_chunks_mut(vocab).with_min_len(rows_per_task(vocab)).enumerate().for_each(|(r, out)| {
                scaled_exp(l.row(r), lse[r], grad[r], out);
            });
        });
        grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(d_logits, [rows, vocab])));
    }
}

impl<C: CheckpointStrategy> LogSumExpBackend for Autodiff<Flex, C> {
    fn logsumexp(logits: FloatTensor<Self>) -> FloatTensor<Self> {
        match LogSumExpBackward.prepare::<C>([logits.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let saved = logits.primitive().clone();
                let lse = with_rows(&saved, row_lse);
                let out = FlexTensor::from_data(TensorData::new(lse.clone(), [lse.len()]));
                prep.finish((saved, lse.into()), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::logsumexp(logits.into_primitive())),
        }
    }
}

/// `log sum_v e^(logits[r, v])` for each row: fused on the CPU, burn's ops elsewhere.
/// Differentiable.
///
/// # Shapes
/// `logits`: `[rows, vocab]` -> `[rows]`
pub fn logsumexp(logits: Tensor<2>) -> Tensor<1> {
    if !on_flex(&logits) {
        let [rows, _] = logits.dims();
        let max = logits.clone().detach().max_dim(1);
        return ((logits - max.clone()).exp().sum_dim(1).log() + max).reshape([rows]);
    }
    Tensor::from_dispatch(<Dispatch as LogSumExpBackend>::logsumexp(logits.into_dispatch()))
}
