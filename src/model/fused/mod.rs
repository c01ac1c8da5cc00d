//! Fused CPU kernels for the element-wise chains around the GEMMs, as burn backend extensions
//! with hand-written backwards: one parallel pass where burn's own ops make several
//! single-threaded ones (and its autodiff saves or recomputes every intermediate).
//!
//! - [`dense_linear`]: a frozen projection `x W^T`, burn's own GEMM call written straight into
//!   its output (burn's matmul zeroes its output and copies it once more); decoding's few rows
//!   as dot products over the weight's rows.
//! - [`batched_matmul`]: a product differentiable in both operands (the LoRA factors'), the
//!   same GEMM calls as burn's matmul written once.
//! - [`rope`]: the rotary embedding, bit for bit burn's composite; [`rms_norm_rope`], Qwen3's
//!   per-head norm of the queries and keys before it (one kernel on a GPU).
//! - [`swiglu`]: the MLP's `silu(gate) * up` on the vectorized `exp` ([`vexp`]);
//!   [`swiglu_stacked`] reads both from the stacked gate/up projection, adapter deltas added.
//! - [`token_logprobs`]: `log softmax(logits)[target]` per row, the scorer's inner step, with a
//!   vectorized `exp` ([`vexp`]): no vocabulary-wide temporaries beside the logits themselves.
//! - [`logsumexp`]: each row's log-sum-exp (the choice scorer's normaliser), the same way.
//! - [`rms_norm`]: the RMS norm, one pass each way; [`add_rms_norm`], the residual stream's sum
//!   before it (one kernel on a GPU).
//! - [`attention`]: masked grouped-query attention, one task per key/value head, over only the
//!   keys a block of queries may see, with its backward.
//!
//! On a GPU (CUDA, wgpu) most run as cubecl kernels of their own (`gpu`, in builds with a GPU
//! backend), some with backwards of their own under autodiff, and attention may run
//! burn-cubecl's flash kernel ([`flash`], `runtime.attention`); elsewhere burn's composite ops.

use burn::backend::flex::FlexTensor;
use burn::tensor::{Device, Tensor};
use rayon::prelude::*;

pub mod attention;
pub mod flash;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod gpu;
pub mod linear;
pub mod matmul;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
pub mod token_logprob;
pub mod vexp;

pub use attention::{attention, attention_rounded, grouped_attention, HostMask};
pub use flash::{grouped_flash_attention, FlashRefusal};
pub use linear::dense_linear;
pub use matmul::batched_matmul;
pub use rms_norm::{add_rms_norm, add_rms_norm_rounded, rms_norm};
pub use rope::{rms_norm_rope, rms_norm_rope_pair, rope};
pub use swiglu::{swiglu, swiglu_stacked, swiglu_stacked_rounded};
pub use token_logprob::{logsumexp, token_logprobs};

/// `tensor`, copied to a contiguous layout if a stride is negative (a flipped view), so that
/// its values run forward from its start offset.
fn positive_strides(tensor: FlexTensor) -> FlexTensor {
    if tensor.layout().has_positive_strides() {
        tensor
    } else {
        tensor.to_contiguous()
    }
}

/// `dst = lhs rhs`, or `dst += lhs rhs` when `accumulate`, for f32 matrices through the GEMM
/// (`m x k` times `k x n`); strides are (row, column) in elements, the destination's columns
/// contiguous.
///
/// # Safety
/// `dst` must have room for `m` rows of `n` values `dst_row` apart, which the call writes (and
/// reads when `accumulate`); `lhs` and `rhs` must address valid values at every stride the
/// shapes reach, and not overlap `dst`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_f32(
    [m, n, k]: [usize; 3],
    dst: *mut f32,
    dst_row: isize,
    accumulate: bool,
    lhs: *const f32,
    (lhs_row, lhs_col): (isize, isize),
    rhs: *const f32,
    (rhs_row, rhs_col): (isize, isize),
    parallelism: gemm::Parallelism,
) {
    // SAFETY: as the caller promises.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_row,
            accumulate,
            lhs,
            lhs_col,
            lhs_row,
            rhs,
            rhs_col,
            rhs_row,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// A raw output pointer handed to rayon tasks that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the tasks sharing it write disjoint parts of one live buffer.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Rows handed to one rayon task: enough work to pay for the hand-off.
const MIN_PARALLEL_ELEMENTS: usize = 1 << 14;

/// Whether `tensor` lives on the CPU (`flex`) backend, with or without autodiff.
fn on_flex<const D: usize>(tensor: &Tensor<D>) -> bool {
    tensor.device() == Device::flex()
}

/// A flex tensor seen as rows of contiguous values: `rows` rows of `width`, row `r` starting at
/// `offset + r * stride` in the storage (a narrowed or sliced last dimension keeps this form).
struct Rows<'a> {
    values: &'a [f32],
    offset: usize,
    stride: usize,
    rows: usize,
    width: usize,
}

impl<'a> Rows<'a> {
    /// The view, or `None` when the layout is not rows of contiguous values.
    fn of(tensor: &'a FlexTensor) -> Option<Self> {
        let layout = tensor.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        if !layout.has_positive_strides() {
            return None;
        }
        let dims = shape.num_dims();
        let width = *shape.as_slice().last()?;
        if strides[dims - 1] != 1 && width > 1 {
            return None;
        }
        let stride = if dims >= 2 { usize::try_from(strides[dims - 2]).ok()? } else { width };
        // Leading dimensions must collapse into one row index.
        for d in 0..dims.saturating_sub(2) {
            if usize::try_from(strides[d]).ok()? != strides[d + 1] as usize * shape[d + 1] {
                return None;
            }
        }
        let rows = shape.as_slice()[..dims - 1].iter().product();
        Some(Self { values: tensor.storage::<f32>(), offset: layout.start_offset(), stride, rows, width })
    }

    /// Row `r`.
    fn row(&self, r: usize) -> &'a [f32] {
        let start = self.offset + r * self.stride;
        &self.values[start..start + self.width]
    }
}

/// `tensor` as rows of contiguous values, copying it first when its layout is not of that form.
fn with_rows<R>(tensor: &FlexTensor, f: impl FnOnce(&Rows<'_>) -> R) -> R {
    match Rows::of(tensor) {
        Some(rows) => f(&rows),
        None => f(&Rows::of(&tensor.to_contiguous()).expect("a contiguous tensor is rows")),
    }
}

/// Rows per rayon task for rows of `width` values.
fn rows_per_task(width: usize) -> usize {
    MIN_PARALLEL_ELEMENTS.div_ceil(width.max(1)).max(1)
}

/// Runs `f(row, out_row)` over every row of `out` (`width` wide) in parallel.
fn par_rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let per_task = rows_per_task(width);
    out.par_chunks_mut(width * per_task).enumerate().for_each(|(task, chunk)| {
        for (i, row) in chunk.chunks_exact_mut(width).enumerate() {
            f(task * per_task + i, row);
        }
    });
}
