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
/// A matrix below burn's threshold but with at least this many multiply-adds has its rows split
/// between the cores (a LoRA factor's product over a whole batch of tokens: `[tokens, in]` by
/// `[in, r]`, which burn runs on one core).
const ROW_SPLIT_THRESHOLD: usize = 1 << 20;
/// The fewest rows one task of a row split takes. Above 64, so that no part falls to the
/// GEMM's path for products of at most 64 x 64 values, which blocks the depth differently.
const ROW_SPLIT_MIN_ROWS: usize = 128;
/// The most output values a GEMM call takes the GEMM's small-product path for (a different
/// summation order): a row split keeps every part above it, so values stay bit for bit.
const SMALL_PRODUCT_VALUES: usize = 16 * 16;

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
    // Rows `rows` of matrix b.
    let run_rows = |b: usize, rows: std::ops::Range<usize>, parallelism: gemm::Parallelism| {
        // SAFETY: rows `rows` of matrix b of the output (m x n, row-major) have room in `out`
        // and are written in full without being read (`read_dst` false, k > 0); the operands'
        // strides address only their own storage (valid burn layouts of these shapes,
        // non-negative strides), and `rows` lies within the m rows.
        unsafe {
            gemm_f32(
                [rows.len(), n, k],
                out_ptr.get().add(b * size + rows.start * n),
                n as isize,
                false,
                lhs_values.as_ptr().add(b * ls[0] as usize + rows.start * ls[1] as usize),
                (ls[1], ls[2]),
                rhs_values.as_ptr().add(b * rs[0] as usize),
                (rs[1], rs[2]),
                parallelism,
            )
        }
    };
    let run = |b: usize, parallelism: gemm::Parallelism| run_rows(b, 0..m, parallelism);
    let per_matrix = m.saturating_mul(n).saturating_mul(k);
    let total = batch.saturating_mul(per_matrix);
    let batch_parallel = batch >= 4 && total >= BATCH_PARALLEL_THRESHOLD;
    // A row split into `parts` near-equal parts of at least ROW_SPLIT_MIN_ROWS rows: the GEMM
    // then blocks the depth by k alone, so each value is summed as in one call.
    let parts = rayon::current_num_threads().min(m / ROW_SPLIT_MIN_ROWS);
    let row_split = per_matrix >= ROW_SPLIT_THRESHOLD && parts > 1 && n >= 2 && (m / parts) * n > SMALL_PRODUCT_VALUES;
    if per_matrix >= PARALLEL_THRESHOLD && !batch_parallel {
        (0..batch).for_each(|b| run(b, gemm::Parallelism::Rayon(0)));
    } else if total >= BATCH_PARALLEL_THRESHOLD && batch > 1 {
        (0..batch).into_par_iter().for_each(|b| run(b, gemm::Parallelism::None));
    } else if row_split {
        (0..batch * parts).into_par_iter().for_each(|task| {
            let (b, part) = (task / parts, task % parts);
            run_rows(b, part * m / parts..(part + 1) * m / parts, gemm::Parallelism::None)
        });
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
