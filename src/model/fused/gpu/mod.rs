//! cubecl kernels on a GPU, where burn's composites launch a kernel per operation and a decoded
//! token is a few hundred small launches (`examples/kernel_counts.rs`). For the forwards without
//! gradients (rollouts, scoring, evaluation):
//!
//! - [`frozen_linear()`]: a frozen projection's product written in f32 from a bf16 or f16
//!   weight, without the cast of its output (and, under autodiff, of its input's gradient).
//! - [`rms_norm()`]: one kernel per norm instead of seven; [`add_rms_norm()`], the residual
//!   stream's sum before the MLP's norm in the same kernel.
//! - [`rope()`]: one kernel per rotation instead of six.
//! - [`attention()`]: the two products around one softmax kernel instead of nine kernels, and
//!   the grouped-query heads' mask read in place instead of repeated.
//! - [`decode_attention()`]: a decoding step's attention, over one cache part or a shared
//!   prompt and each row's own, as one kernel instead of three (or fourteen over two parts).
//! - [`cache_write()`]: a step's keys and values written into a reserved cache's room as one
//!   kernel, in place, where burn's slice writes are one a tensor.
//! - [`rms_norm_rope()`]: Qwen3's per-head norm of the queries and keys and their rotation as
//!   one kernel, where the two above are two launches; [`rope_into_room()`], a layer's queries
//!   and keys rotated (normed or not) with the keys and values written into a reserved cache's
//!   room, one kernel where those and [`cache_write()`] are two or three.
//! - [`swiglu()`]: one kernel for the MLP's gate instead of eight.
//! - [`token_logprobs()`]: one kernel for the scorer's log-softmax at the targets instead of
//!   eight.
//! - [`lora_delta()`]: an adapter's delta over a decoding step's few rows, both products and
//!   the rows' rank mask, as one kernel instead of three.
//! - [`sample_rows()`]: a decoding step's tokens drawn on the device (temperature, top-k,
//!   top-p), two numbers a row read back instead of the row's logits.
//!
//! Each takes plain (non-autodiff) f32 tensors on a cubecl device ([`takes`]). Under autodiff
//! (the update, [`takes_tracked`]) these have backwards of their own, each an autodiff node
//! (`TrackedOp`):
//!
//! - [`rms_norm_tracked`]: the norm's backward in its input as one kernel (frozen weight).
//! - [`rope_tracked`]: the rotation's backward as one kernel, only the tables kept.
//! - [`swiglu_stacked_tracked`]: the gate read from the stacked gate/up product, its backward
//!   one kernel writing that product's whole gradient.
//! - [`stacked_parts_tracked`]: the stacked q/k/v projection's parts, each differentiated
//!   through its own rows of the weight.
//! - [`attention_tracked`]: the attention's two products around the softmax kernel as one node
//!   keeping no probabilities, its backward recomputing them, then four products around one
//!   kernel.
//!
//! With the base in bf16 or f16 the residual sum with its norm, the gate and a decoding step's
//! attention also write their output rounded for the frozen product it feeds ([`rounding`],
//! [`frozen_linear_rounded`]), in place of that product's cast.
//!
//! For other dtypes and with `TROUPE_GPU_KERNELS=burn`, burn's composites run.

use std::sync::OnceLock;

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Cube, DispatchDevice};
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::cubecl::calculate_cube_count_elemwise;
use burn_cubecl::cubecl::ir::ElemType;
use burn_cubecl::cubecl::prelude::{CubeCount, CubeDim};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

mod attention;
mod cache_write;
#[cfg(feature = "cuda")]
pub mod cuda_source;
mod decode_attention;
mod linear;
mod lora;
mod norm_rope;
mod rms_norm;
mod rope;
mod sample;
mod split;
mod swiglu;
mod token_logprob;

pub(super) use attention::applies as attention_applies;
pub use attention::{attention, attention_tracked, masked_softmax, softmax_grad};
pub use cache_write::cache_write;
pub use decode_attention::decode_attention;
pub use linear::{frozen_linear, frozen_linear_backward, frozen_linear_rounded, frozen_product_by, rounding};
pub use lora::{lora_delta, takes as lora_delta_takes, MAX_ROWS as LORA_DELTA_MAX_ROWS};
pub use norm_rope::{rms_norm_rope, rms_norm_rope_pair, rope_into_room};
pub use rms_norm::{add_low_rank_rms_norm, add_rms_norm, rms_norm, rms_norm_tracked};
pub use rope::{rope, rope_tracked};
pub use sample::{sample_rows, samples};
pub use split::stacked_parts_tracked;
pub use swiglu::{swiglu, swiglu_rounded, swiglu_stacked_tracked};
pub use token_logprob::{token_logprobs, token_logprobs_and_complement};

/// The most cubes a grid dimension holds on every cubecl runtime (Vulkan's minimum).
const MAX_GRID: usize = 65_535;

/// A burn tensor primitive on a cubecl device (its float and bool tensors alike).
type Primitive = burn_cubecl::tensor::CubeTensor;

/// Whether these kernels run at all: `TROUPE_GPU_KERNELS` ([`crate::device::fused_gpu_kernels`],
/// read once; the binary refuses a value it does not know before any work).
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| crate::device::fused_gpu_kernels().unwrap_or(true))
}

/// Whether these kernels take `tensor`: they are [`enabled`] and it is a plain (non-autodiff)
/// f32 tensor on a cubecl device.
pub fn takes<const D: usize>(tensor: &Tensor<D>) -> bool {
    enabled()
        && !tensor.is_autodiff()
        && tensor.dtype() == DType::F32
        && matches!(tensor.device().as_dispatch(), DispatchDevice::Cube(_))
}

/// Whether the kernels with a backward of their own take `tensor` under autodiff: they are
/// [`enabled`] and it is an f32 tensor with autodiff on a cubecl device.
pub fn takes_tracked<const D: usize>(tensor: &Tensor<D>) -> bool {
    enabled()
        && tensor.is_autodiff()
        && tensor.dtype() == DType::F32
        && matches!(tensor.device().without_autodiff().as_dispatch(), DispatchDevice::Cube(_))
}

/// An operation with a backward of its own under autodiff on a cubecl device, over `N` inputs.
trait TrackedOp<const N: usize> {
    /// The operation's autodiff node over `inputs`, under the checkpointing strategy `C`.
    fn apply<C: CheckpointStrategy>(
        self,
        inputs: [FloatTensor<Autodiff<Cube, C>>; N],
    ) -> FloatTensor<Autodiff<Cube, C>>;
}

/// `op` over `inputs` as autodiff tensors on a cubecl device, under whichever checkpointing
/// strategy they carry; `None`, with nothing run, when they are not of that form.
fn apply_tracked<const D: usize, const N: usize>(op: impl TrackedOp<N>, inputs: [Tensor<D>; N]) -> Option<Tensor<D>> {
    // burn converts to each strategy's autodiff backend by name, not generically.
    type Plain = Autodiff<Cube, NoCheckpointing>;
    type Balanced = Autodiff<Cube, BalancedCheckpointing>;
    let plain: Option<Vec<_>> = inputs.iter().map(|t| t.clone().try_into_primitive::<Plain>().ok()).collect();
    if let Some(Ok(plain)) = plain.map(<[_; N]>::try_from) {
        return Some(Tensor::from_primitive::<Plain>(op.apply::<NoCheckpointing>(plain)));
    }
    let balanced: Vec<_> =
        inputs.iter().map(|t| t.clone().try_into_primitive::<Balanced>().ok()).collect::<Option<_>>()?;
    let balanced = <[_; N]>::try_from(balanced).ok()?;
    Some(Tensor::from_primitive::<Balanced>(op.apply::<BalancedCheckpointing>(balanced)))
}

/// Columns `start..start + width` of `tensor`'s last dimension: a view where burn-cubecl's
/// `slice` can make one (an aligned start), a copy otherwise.
fn last_dim_slice(tensor: &Primitive, start: usize, width: usize) -> Primitive {
    let dims = tensor.meta.shape().as_slice();
    let mut ranges: Vec<_> = dims.iter().map(|&d| 0..d).collect();
    if let Some(last) = ranges.last_mut() {
        *last = start..start + width;
    }
    burn_cubecl::kernel::slice(tensor.clone(), &ranges)
}

/// A plain tensor's primitive on its cubecl device, for a backward that computed it there from
/// primitives of that device (a product stays on the device of its operands).
fn into_primitive<const D: usize>(tensor: Tensor<D>) -> Primitive {
    tensor.try_into_primitive::<Cube>().expect("a cubecl product stays on its device")
}

/// An empty contiguous f32 tensor of `like`'s shape on its device, for a kernel's output.
fn empty_like(like: &Primitive) -> Primitive {
    empty_of(like, like.meta.shape().clone())
}

/// An empty contiguous f32 tensor of `shape` on `like`'s device, for a kernel's output.
fn empty_of(like: &Primitive, shape: Shape) -> Primitive {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, DType::F32)
}

/// A kernel's second output, its first rounded to `dtype` (the half precision of the frozen
/// product it feeds, [`rounding`]): an empty contiguous tensor of `shape` in `dtype`, or, with
/// no rounding asked, a one-value f32 tensor the kernel is given and does not write. Returns the
/// tensor, its element type for the kernel's definition, and whether the kernel writes it.
fn rounded_output(like: &Primitive, shape: Shape, dtype: Option<DType>) -> (Primitive, ElemType, bool) {
    let (shape, dtype, writes) = match dtype {
        Some(dtype) => (shape, dtype, true),
        None => (Shape::new([1]), DType::F32, false),
    };
    let out = empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype);
    (out, dtype_to_storage_type(dtype), writes)
}

/// The launch of an element-wise kernel over `count` values: one unit per value, 256 a cube.
fn elementwise_launch(like: &Primitive, count: usize) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new_1d(256);
    (calculate_cube_count_elemwise(&like.client, count, cube_dim), cube_dim)
}

/// The launch of a row kernel over `rows` rows of `width` values: one cube per row (the grid
/// split over two dimensions past [`MAX_GRID`] rows), its size the power of two from 32 to 256
/// nearest above `width`. Returns the cube count, the cube's size and its units.
fn row_launch(rows: usize, width: usize) -> (CubeCount, CubeDim, usize) {
    let units = width.next_power_of_two().clamp(32, 256);
    let count = CubeCount::Static(rows.min(MAX_GRID) as u32, rows.div_ceil(MAX_GRID) as u32, 1);
    (count, CubeDim::new_1d(units as u32), units)
}

/// The units each rank column's sum is split over in [`cube::low_rank_down`] for a total rank
/// of `slots` (a power of two): as many as fill 256 units with every column, 1 to 32. A
/// function of the rank alone, so that every kernel computing a LoRA delta sums it in one order
/// (the few-row LoRA kernel and the residual sum's, whose cubes differ in size); it divides
/// every cube's units (32 to 256, a power of two), so no group straddles two rounds.
fn low_rank_group(slots: usize) -> usize {
    (256 / slots.max(1)).clamp(1, 32)
}

/// Functions the kernels share, with cubecl's `Tensor` (not burn's) in scope.
mod cube {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// The row a cube of a [`super::row_launch`] takes.
    #[cube]
    pub(super) fn cube_row() -> usize {
        (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
    }

    /// Stores `value`, this unit's share, in `partial` (one slot per unit of the cube, a power of
    /// two) and returns the whole cube's sum, or its maximum if `take_max`, reduced as a tree in
    /// shared memory. Every unit of the cube must call it; `partial` may be reused afterwards.
    #[cube]
    pub(super) fn cube_reduce(partial: &mut Shared<[f32]>, value: f32, #[comptime] take_max: bool) -> f32 {
        let unit = UNIT_POS_X as usize;
        partial[unit] = value;
        sync_cube();
        let mut half = CUBE_DIM_X as usize / 2;
        while half > 0 {
            if unit < half {
                let a = partial[unit];
                let b = partial[unit + half];
                let pair = if take_max { max(a, b) } else { a + b };
                partial[unit] = pair;
            }
            sync_cube();
            half /= 2;
        }
        let whole = partial[0];
        // Every unit has read the result before any writes `partial` again.
        sync_cube();
        whole
    }

    /// The maximum of a row of `logits` (`[rows, vocab]`, the row's values `logits[start + i *
    /// step]`) and its `ln sum_v e^(logits[v])`: the maximum, then the sum of `e^(x - max)`, each
    /// reduced in `partial` (one slot per unit). The scorer's log-softmax and decoding's draw
    /// share it, so the draw records the log-probability the scorer computes. Every unit of the
    /// cube must call it; `partial` may be reused afterwards.
    #[cube]
    pub(super) fn row_max_lse(
        logits: &Tensor<f32>,
        start: usize,
        step: usize,
        partial: &mut Shared<[f32]>,
    ) -> (f32, f32) {
        let (row_max, total) = row_max_sum(logits, start, step, partial);
        (row_max, f32::ln(total) + row_max)
    }

    /// The maximum of a row of `logits` (as for [`row_max_lse`]) and `sum_v e^(logits[v] - max)`,
    /// the two reductions [`row_max_lse`] makes. Every unit of the cube must call it; `partial`
    /// may be reused afterwards.
    #[cube]
    pub(super) fn row_max_sum(
        logits: &Tensor<f32>,
        start: usize,
        step: usize,
        partial: &mut Shared<[f32]>,
    ) -> (f32, f32) {
        let unit = UNIT_POS_X as usize;
        let stride = CUBE_DIM_X as usize;
        let vocab = logits.shape(1);
        let mut largest = f32::new(-3.402_823_5e38f32);
        let mut i = unit;
        while i < vocab {
            largest = max(largest, logits[start + i * step]);
            i += stride;
        }
        let row_max = cube_reduce(partial, largest, true);

        let mut sum = 0.0f32;
        let mut i = unit;
        while i < vocab {
            sum += f32::exp(logits[start + i * step] - row_max);
            i += stride;
        }
        let total = cube_reduce(partial, sum, false);
        (row_max, total)
    }

    /// `1 / sqrt(mean(v^2) + eps)` over a row of `width` values `x[start + i * step]`: each unit
    /// sums the squares of every `CUBE_DIM_X`-th value from its own position, and the cube adds
    /// the partial sums ([`cube_reduce`], in `partial`). Every unit of the cube must call it;
    /// `partial` may be reused afterwards. The norm kernels share it, so that each gives the
    /// values the others give for the same row.
    #[cube]
    pub(super) fn inverse_rms(
        x: &Tensor<f32>,
        start: usize,
        step: usize,
        width: usize,
        eps: f32,
        partial: &mut Shared<[f32]>,
    ) -> f32 {
        let units_here = CUBE_DIM_X as usize;
        let mut sum = 0.0f32;
        let mut i = UNIT_POS_X as usize;
        while i < width {
            let v = x[start + i * step];
            sum += v * v;
            i += units_here;
        }
        inverse_rms_of(sum, width, eps, partial)
    }

    /// `1 / sqrt(total / width + eps)`, `total` the cube's sum of each unit's `squares` (its
    /// share of a row's squares, summed as [`inverse_rms`] sums them), added in `partial`.
    /// Every unit of the cube must call it; `partial` may be reused afterwards.
    #[cube]
    pub(super) fn inverse_rms_of(squares: f32, width: usize, eps: f32, partial: &mut Shared<[f32]>) -> f32 {
        let total = cube_reduce(partial, squares, false);
        1.0f32 / f32::sqrt(total / f32::cast_from(width) + eps)
    }

    /// A LoRA delta's first product for one row, every rank column at once: `down[j] =
    /// (x . a[j]) * keep_j` for each of `a`'s rows `j` (`a` `[rank, fan_in]`, any strides), the
    /// row of `x` starting at `start` with values `step` apart, `keep_j` the row's rank mask
    /// `mask[mask_start + j * mask.stride(1)]` (read only `masked`; 1 otherwise), and 0 for the
    /// slots from the rank to `slots`. Each rank column's sum is split over a group of `group`
    /// units ([`low_rank_group`]): unit `g` of the group sums terms `g, g + group, ...` in order
    /// along `fan_in`, adjacent units reading adjacent values, and the group's partial sums are
    /// added as a tree in `partial` (one slot per unit). A column the mask zeroes is not summed.
    /// So a row's whole product takes `fan_in / group` steps of each unit instead of `fan_in`
    /// (a Qwen3-4B output projection's fan-in is 4,096). Every unit of the cube must call it;
    /// `partial` may be reused afterwards, and `down` is written when it returns.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn low_rank_down(
        x: &Tensor<f32>,
        start: usize,
        step: usize,
        a: &Tensor<f32>,
        mask: &Tensor<f32>,
        mask_start: usize,
        partial: &mut Shared<[f32]>,
        down: &mut Shared<[f32]>,
        #[comptime] slots: usize,
        #[comptime] group: usize,
        #[comptime] masked: bool,
    ) {
        let unit = UNIT_POS_X as usize;
        let units = CUBE_DIM_X as usize;
        let rank = a.shape(0);
        let fan_in = a.shape(1);
        // Each round gives every unit one (rank column, share) pair: `units / group` columns.
        let mut first = 0usize;
        while first < slots * group {
            let pair = first + unit;
            let j = pair / group;
            let g = pair % group;
            let mut keep = 0.0f32;
            if j < rank {
                keep = 1.0f32;
                if masked {
                    keep = mask[mask_start + j * mask.stride(1)];
                }
            }
            let mut sum = 0.0f32;
            if keep != 0.0 {
                let mut i = g;
                while i < fan_in {
                    sum += x[start + i * step] * a[j * a.stride(0) + i * a.stride(1)];
                    i += group;
                }
            }
            partial[unit] = sum;
            sync_cube();
            // A runtime counter (a comptime value would not take the halving below).
            let mut half = (group / 2).runtime();
            while half > 0 {
                if g < half {
                    let mine = partial[unit];
                    let theirs = partial[unit + half];
                    partial[unit] = mine + theirs;
                }
                sync_cube();
                half /= 2;
            }
            if g == 0 && j < slots {
                let whole = partial[unit];
                down[j] = whole * keep;
            }
            // Every group has read its sum before the next round writes `partial`.
            sync_cube();
            first += units;
        }
    }

    /// A LoRA delta's column `c` for one row: `sum_j down[j] b[c, j]` over the `rank`
    /// columns of `b` (`[fan_out, rank]`, any strides), in order, the zero terms skipped.
    #[cube]
    pub(super) fn low_rank_up(down: &Shared<[f32]>, rank: usize, b: &Tensor<f32>, c: usize) -> f32 {
        let mut sum = 0.0f32;
        let mut j = 0usize;
        while j < rank {
            let d = down[j];
            if d != 0.0 {
                sum += d * b[c * b.stride(0) + j * b.stride(1)];
            }
            j += 1;
        }
        sum
    }
}
