//! A batched product `lhs rhs` differentiable in both operands, through the GEMM directly into a
//! fresh output (the LoRA factors' products).
//!
//! burn's CPU matmul allocates its output zeroed and copies it once more before the GEMM writes
//! it, and its backward does the same for both gradients. Here every product is burn's own
//! GEMM call (the same strides, the same per-matrix and per-batch parallelism thresholds)
//! written once, so values and gradients equal burn's bit for bit (tested).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::{gemm_f32, on_flex, positive_strides, SendPtr};

/// Products of at least this many multiply-adds (`m n k`) run on every core: burn's threshold.
const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;
/// Batches of smaller products with at least this much work in all run their matrices in
/// parallel: burn's threshold.
const BATCH_PARALLEL_THRESHOLD: usize = 128 * 128 * 128;

/// The batched product, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait BatchedMatmulBackend: burn::backend::Backend {
    /// `lhs[b] rhs[b]` for every `b`.
    ///
    /// # Shapes
    /// `lhs`: `[batch, m, k]`, `rhs`: `[batch, k, n]` -> `[batch, m, n]`
    fn batched_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `lhs[b] rhs[b]` into a new row-major `[batch, m, n]` tensor.
fn product(lhs: &FlexTensor, rhs: &FlexTensor) -> FlexTensor {
    let [batch, m, k] = lhs.layout().shape().dims::<3>();
    let [rhs_batch, rhs_k, n] = rhs.layout().shape().dims::<3>();
    assert!(rhs_batch == batch && rhs_k == k, "batched_matmul: [{batch}, {m}, {k}] x [{rhs_batch}, {rhs_k}, {n}]");
    let (ls, rs) = (lhs.layout().strides(), rhs.layout().strides());
    let (lhs_values, rhs_values) =
        (&lhs.storage::<f32>()[lhs.layout().start_offset()..], &rhs.storage::<f32>()[rhs.layout().start_offset()..]);
    let size = m * n;
    let mut out = Vec::<f32>::with_capacity(batch * size);
    if k == 0 || size == 0 {
        out.resize(batch * size, 0.0);
        return FlexTensor::from_data(TensorData::new(out, [batch, m, n]));
    }
    let out_ptr = SendPtr(out.as_mut_ptr());
    let run = |b: usize, parallelism: gemm::Parallelism| {
        // SAFETY: matrix b of the output (m x n, row-major) has room in `out` and is written in
        // full without being read (`read_dst` false, k > 0); the operands' strides address only
        // their own storage (valid burn layouts of these shapes, non-negative strides).
        unsafe {
            gemm_f32(
                [m, n, k],
                out_ptr.get().add(b * size),
                n as isize,
                false,
                lhs_values.as_ptr().add(b * ls[0] as usize),
                (ls[1], ls[2]),
                rhs_values.as_ptr().add(b * rs[0] as usize),
                (rs[1], rs[2]),
                parallelism,
            )
        }
    };
    let per_matrix = m.saturating_mul(n).saturating_mul(k);
    let total = batch.saturating_mul(per_matrix);
    let batch_parallel = batch >= 4 && total >= BATCH_PARALLEL_THRESHOLD;
    if per_matrix >= PARALLEL_THRESHOLD && !batch_parallel {
        (0..batch).for_each(|b| run(b, gemm::Parallelism::Rayon(0)));
    } else if total >= BATCH_PARALLEL_THRESHOLD && batch > 1 {
        (0..batch).into_par_iter().for_each(|b| run(b, gemm::Parallelism::None));
    } else {
        (0..batch).for_each(|b| run(b, gemm::Parallelism::None));
    }
    // SAFETY: every matrix was written in full above.
    unsafe { out.set_len(batch * size) };
    FlexTensor::from_data(TensorData::new(out, [batch, m, n]))
}

impl BatchedMatmulBackend for Flex {
    fn batched_matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
        product(&positive_strides(lhs), &positive_strides(rhs))
    }
}

/// The backward of [`BatchedMatmulBackend::batched_matmul`]: `d lhs = dy rhs^T`,
/// `d rhs = lhs^T dy`.
#[derive(Debug)]
struct BatchedMatmulBackward;

impl Backward<Flex, 2> for BatchedMatmulBackward {
    /// The operands (non-negative strides).
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_lhs, node_rhs] = ops.parents;
        let grad = positive_strides(grads.consume::<Flex>(&ops.node));
        let (lhs, rhs) = ops.state;
        if let Some(node) = node_lhs {
            grads.register::<Flex>(node.id, product(&grad, &rhs.transpose(1, 2)));
        }
        if let Some(node) = node_rhs {
            grads.register::<Flex>(node.id, product(&lhs.transpose(1, 2), &grad));
        }
    }
}

impl<C: CheckpointStrategy> BatchedMatmulBackend for Autodiff<Flex, C> {
    fn batched_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        match BatchedMatmulBackward.prepare::<C>([lhs.node(), rhs.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (l, r) = (positive_strides(lhs.primitive().clone()), positive_strides(rhs.primitive().clone()));
                let out = product(&l, &r);
                prep.finish((l, r), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::batched_matmul(lhs.into_primitive(), rhs.into_primitive())),
        }
    }
}

/// `lhs[b] rhs[b]` for every `b`, differentiable in both: the GEMM straight into its output on
/// the CPU, burn's matmul elsewhere (and for any dtype but f32); the same values either way.
///
/// # Shapes
/// `lhs`: `[batch, m, k]`, `rhs`: `[batch, k, n]` -> `[batch, m, n]`
pub fn batched_matmul(lhs: Tensor<3>, rhs: Tensor<3>) -> Tensor<3> {
    if !on_flex(&lhs) || lhs.dtype() != DType::F32 || rhs.dtype() != DType::F32 || lhs.dims()[0] != rhs.dims()[0] {
        return lhs.matmul(rhs);
    }
    Tensor::from_dispatch(<Dispatch as BatchedMatmulBackend>::batched_matmul(lhs.into_dispatch(), rhs.into_dispatch()))
}
