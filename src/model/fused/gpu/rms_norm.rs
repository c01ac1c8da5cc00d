//! The RMS norm as one cubecl kernel.
//!
//! burn's composite is seven kernels a norm on a GPU (square, mean, add, square root,
//! reciprocal, two products), and a decoded token of a Qwen3 layer runs four norms: 28 of the
//! layer's 71 launches at `small` (`examples/kernel_counts.rs`). Here one cube normalises one
//! row: its units sum the row's squares in f32, a tree in shared memory adds the partial sums,
//! and each unit writes its share of `x * (1 / sqrt(mean + eps)) * w`, the composite's order of
//! operations. Rows are addressed through the input's strides, so a narrowed or split view (the
//! per-head q and k norms read the stacked q/k/v product's columns) is read in place.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Cube};
use burn::tensor::{DType, Tensor};
use burn_cubecl::cubecl::prelude::{CubeCount, CubeDim};
use burn_cubecl::kernel::{into_contiguous, untile};

use super::{apply_tracked, empty_like, low_rank_group, rounded_output, row_launch, Primitive, TrackedOp};
use crate::model::LowRank;

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{cube_reduce, cube_row, inverse_rms, inverse_rms_of, low_rank_down, low_rank_up};

    /// Where row `row` of `x` (`[..., width]`, any strides) starts: its index split over the
    /// leading dimensions.
    #[cube]
    fn row_start(x: &Tensor<f32>, row: usize) -> usize {
        let mut rest = row;
        let mut start = 0usize;
        let mut dim = x.rank() - 1;
        while dim > 0 {
            dim -= 1;
            let size = x.shape(dim);
            start += (rest % size) * x.stride(dim);
            rest /= size;
        }
        start
    }

    /// One cube per row: `sum = x + (y + extra)` (`extra` read only `with_extra`) and
    /// `out = sum / sqrt(mean(sum^2) + eps) * weight`, the residual stream's sum and its norm as
    /// the two sums and [`rms_norm_kernel`] apart give them, and when `round`, `rounded` (of
    /// `out`'s shape, contiguous) `out` rounded to `R`. `x`, `y` and `extra` are `[..., width]`
    /// of any strides; `sum` and `out` contiguous, of their shape.
    ///
    /// When `low_rank`, `extra` is not read but computed, a LoRA delta over the row's `input`
    /// (`[..., fan_in]`, any strides): `((input A^T) * mask[row / seq]) B^T` for `a` `[rank,
    /// fan_in]`, `b` `[width, rank]` and `mask` `[rows / seq, rank]` (read only `masked`), any
    /// strides, each product summed in f32 as [`super::super::lora`]'s kernel sums it
    /// ([`low_rank_down`], its rank columns split over groups of `group` units); `slots` is the
    /// rank's power of two.
    #[cube(launch, create_dummy_kernel)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_rms_norm_kernel<R: Float>(
        x: &Tensor<f32>,
        y: &Tensor<f32>,
        extra: &Tensor<f32>,
        input: &Tensor<f32>,
        a: &Tensor<f32>,
        b: &Tensor<f32>,
        mask: &Tensor<f32>,
        weight: &Tensor<f32>,
        sum: &mut Tensor<f32>,
        out: &mut Tensor<f32>,
        rounded: &mut Tensor<R>,
        rows: usize,
        seq: usize,
        eps: f32,
        #[comptime] units: usize,
        #[comptime] with_extra: bool,
        #[comptime] low_rank: bool,
        #[comptime] masked: bool,
        #[comptime] slots: usize,
        #[comptime] group: usize,
        #[comptime] round: bool,
        #[define(R)] _rounded_type: ElemType,
    ) {
        let row = cube_row();
        let unit = UNIT_POS_X as usize;
        let units_here = CUBE_DIM_X as usize;
        if row < rows {
            let width = x.shape(x.rank() - 1);
            let (x_start, y_start, e_start) = (row_start(x, row), row_start(y, row), row_start(extra, row));
            let (x_step, y_step, e_step) =
                (x.stride(x.rank() - 1), y.stride(y.rank() - 1), extra.stride(extra.rank() - 1));
            let base = row * width;

            // The row's product with each of `A`'s rows, masked, each rank column's sum split
            // over a group of units as the few-row LoRA kernel splits it.
            let mut partial = Shared::<[f32]>::new_slice(units);
            let mut down = Shared::<[f32]>::new_slice(slots);
            let rank = a.shape(0);
            if low_rank {
                let (in_start, in_step) = (row_start(input, row), input.stride(input.rank() - 1));
                let mask_start = (row / seq) * mask.stride(0);
                low_rank_down(
                    input,
                    in_start,
                    in_step,
                    a,
                    mask,
                    mask_start,
                    &mut partial,
                    &mut down,
                    slots,
                    group,
                    masked,
                );
            }

            let mut squares = 0.0f32;
            let mut i = unit;
            while i < width {
                let mut added = y[y_start + i * y_step];
                if with_extra {
                    added += extra[e_start + i * e_step];
                }
                if low_rank {
                    added += low_rank_up(&down, rank, b, i);
                }
                let v = x[x_start + i * x_step] + added;
                sum[base + i] = v;
                squares += v * v;
                i += units_here;
            }
            let inverse = inverse_rms_of(squares, width, eps, &mut partial);

            // Each unit reads back the values it wrote.
            let mut i = unit;
            while i < width {
                let normed = sum[base + i] * inverse * weight[i * weight.stride(0)];
                out[base + i] = normed;
                if round {
                    rounded[base + i] = R::cast_from(normed);
                }
                i += units_here;
            }
        }
    }

    /// One cube per row of `x` (`[..., width]`, any strides): `out` (contiguous, `x`'s shape) gets
    /// `x / sqrt(mean(x^2) + eps) * weight`. `units` is the cube's size, a power of two.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn rms_norm_kernel(
        x: &Tensor<f32>,
        weight: &Tensor<f32>,
        out: &mut Tensor<f32>,
        rows: usize,
        eps: f32,
        #[comptime] units: usize,
    ) {
        let row = cube_row();
        let unit = UNIT_POS_X as usize;
        let units_here = CUBE_DIM_X as usize;
        // Every unit of a cube takes the same branch, so the barriers below stay uniform.
        if row < rows {
            let width = x.shape(x.rank() - 1);
            let start = row_start(x, row);
            let step = x.stride(x.rank() - 1);
            let mut partial = Shared::<[f32]>::new_slice(units);
            let inverse = inverse_rms(x, start, step, width, eps, &mut partial);

            let mut i = unit;
            while i < width {
                out[row * width + i] = x[start + i * step] * inverse * weight[i * weight.stride(0)];
                i += units_here;
            }
        }
    }

    /// The backward of [`rms_norm_kernel`] in `x` (the weight is frozen): one cube per row,
    /// `dx = g w r - x r^3 (sum g w x) / width` with `r = 1 / sqrt(mean(x^2) + eps)`. `grad` and
    /// `dx` are contiguous, `x`'s shape; `x` has any strides.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn rms_norm_backward_kernel(
        x: &Tensor<f32>,
        weight: &Tensor<f32>,
        grad: &Tensor<f32>,
        dx: &mut Tensor<f32>,
        rows: usize,
        eps: f32,
        #[comptime] units: usize,
    ) {
        let row = cube_row();
        let unit = UNIT_POS_X as usize;
        let units_here = CUBE_DIM_X as usize;
        if row < rows {
            let width = x.shape(x.rank() - 1);
            let start = row_start(x, row);
            let step = x.stride(x.rank() - 1);
            let w_step = weight.stride(0);
            let base = row * width;

            let mut squares = 0.0f32;
            let mut dot = 0.0f32;
            let mut i = unit;
            while i < width {
                let v = x[start + i * step];
                squares += v * v;
                dot += grad[base + i] * weight[i * w_step] * v;
                i += units_here;
            }
            let mut partial = Shared::<[f32]>::new_slice(units);
            let total = cube_reduce(&mut partial, squares, false);
            let dot_total = cube_reduce(&mut partial, dot, false);
            let n = f32::cast_from(width);
            let inverse = 1.0f32 / f32::sqrt(total / n + eps);
            let coefficient = inverse * inverse * inverse * dot_total / n;

            let mut i = unit;
            while i < width {
                dx[base + i] = grad[base + i] * weight[i * w_step] * inverse - x[start + i * step] * coefficient;
                i += units_here;
            }
        }
    }
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension in one kernel launch, for plain
/// f32 tensors on a cubecl device ([`super::takes`]; burn's composite otherwise).
///
/// # Shapes
/// `x`: `[..., width]`, `weight`: `[width]` -> like `x` (contiguous)
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: &Tensor<1>, eps: f64) -> Tensor<D> {
    let (Ok(xp), Ok(wp)) = (x.clone().try_into_primitive::<Cube>(), weight.clone().try_into_primitive::<Cube>()) else {
        return super::super::rms_norm::composite(x, weight, eps);
    };
    Tensor::from_primitive::<Cube>(forward(xp, into_contiguous(wp), eps as f32))
}

/// The residual stream's sum `x + (y + extra)` and its RMS norm in one kernel launch, for plain
/// f32 tensors on a cubecl device ([`super::takes`], which the caller checks), and given
/// `round`, the norm rounded to that type too (for the frozen product it feeds,
/// [`super::rounding`]); `None`, with nothing run, when a tensor is not a cubecl primitive or
/// the shapes differ.
///
/// # Shapes
/// `x`, `y`, `extra`: `[..., width]`, `weight`: `[width]` -> (the sum, its norm, the norm
/// rounded), like `x` (contiguous)
#[allow(clippy::type_complexity)]
pub fn add_rms_norm<const D: usize>(
    x: &Tensor<D>,
    y: &Tensor<D>,
    extra: Option<&Tensor<D>>,
    weight: &Tensor<1>,
    eps: f64,
    round: Option<DType>,
) -> Option<(Tensor<D>, Tensor<D>, Option<Tensor<D>>)> {
    if y.dims() != x.dims() || extra.is_some_and(|e| e.dims() != x.dims()) {
        return None;
    }
    let extra = match extra {
        Some(extra) => Extra::Added(primitive(extra)?),
        None => Extra::Nothing,
    };
    let (sum, out, rounded) = launch((primitive(x)?, primitive(y)?), extra, weight, eps, round, 1)?;
    let back = Tensor::<D>::from_primitive::<Cube>;
    Some((back(sum), back(out), rounded.map(back)))
}

/// [`add_rms_norm`] with `extra` an adapter's low-rank delta that the same launch computes from
/// `input` (the output projection's input, for its delta): `((input A^T) * mask[b]) B_scaled^T`
/// as [`super::lora_delta`] computes it, each product summed in f32 in order along its shared
/// dimension. One launch where the delta's kernel and the sum's were two. For plain f32 tensors
/// on a cubecl device ([`super::takes`]), at most [`super::LORA_DELTA_MAX_ROWS`] rows and a total
/// rank of 1 to 256; `None`, with nothing run, otherwise.
///
/// # Shapes
/// `x`, `y`: `[batch, seq, width]`, `input`: `[batch, seq, fan_in]`, `factors`: `a` `[rank,
/// fan_in]`, `b_scaled` `[width, rank]`, `mask` `[batch, rank]`, `weight`: `[width]` -> (the sum,
/// its norm, the norm rounded), `[batch, seq, width]` (contiguous)
#[allow(clippy::type_complexity)]
pub fn add_low_rank_rms_norm(
    x: &Tensor<3>,
    y: &Tensor<3>,
    (input, factors): (&Tensor<3>, &LowRank),
    weight: &Tensor<1>,
    eps: f64,
    round: Option<DType>,
) -> Option<(Tensor<3>, Tensor<3>, Option<Tensor<3>>)> {
    let [batch, seq, width] = x.dims();
    let [rank, fan_in] = factors.a.dims();
    let fits = y.dims() == x.dims()
        && input.dims() == [batch, seq, fan_in]
        && factors.b_scaled.dims() == [width, rank]
        && factors.mask.as_ref().is_none_or(|m| m.dims() == [batch, rank])
        && (1..=super::lora::MAX_RANK).contains(&rank)
        && batch * seq <= super::LORA_DELTA_MAX_ROWS;
    let tensors = [x, y, input];
    let taken = tensors.iter().all(|t| super::takes(*t))
        && [&factors.a, &factors.b_scaled].into_iter().chain(factors.mask.as_ref()).all(super::takes)
        && super::takes(weight);
    if !(fits && taken) {
        return None;
    }
    let mask = match &factors.mask {
        Some(mask) => Some(primitive(mask)?),
        None => None,
    };
    let extra = Extra::LowRank((primitive(input)?, primitive(&factors.a)?, primitive(&factors.b_scaled)?, mask));
    let (sum, out, rounded) = launch((primitive(x)?, primitive(y)?), extra, weight, eps, round, seq)?;
    let back = Tensor::<3>::from_primitive::<Cube>;
    Some((back(sum), back(out), rounded.map(back)))
}

/// `t` as an untiled cubecl primitive, or `None` on another device.
fn primitive<const D: usize>(t: &Tensor<D>) -> Option<Primitive> {
    t.clone().try_into_primitive::<Cube>().ok().map(untile)
}

/// What [`add_rms_norm_kernel`](kernel::add_rms_norm_kernel) adds to `y` besides. (Made and
/// taken apart in one call: the variants' sizes do not matter.)
#[allow(clippy::large_enum_variant)]
enum Extra {
    Nothing,
    /// A tensor of `y`'s shape.
    Added(Primitive),
    /// A LoRA delta computed in the launch: its input, `A`, scaled `B` and rank mask.
    LowRank((Primitive, Primitive, Primitive, Option<Primitive>)),
}

/// The sum's and the norm's launch over `(x, y)` with `extra`, the rows' mask row being `row /
/// seq`: (the sum, the norm, the norm rounded where `round` asks).
#[allow(clippy::type_complexity)]
fn launch(
    (xp, yp): (Primitive, Primitive),
    extra: Extra,
    weight: &Tensor<1>,
    eps: f64,
    round: Option<DType>,
    seq: usize,
) -> Option<(Primitive, Primitive, Option<Primitive>)> {
    let wp = into_contiguous(weight.clone().try_into_primitive::<Cube>().ok()?);
    let (sum, out) = (empty_like(&xp), empty_like(&xp));
    let (rounded, rounded_type, writes) = rounded_output(&xp, xp.meta.shape().clone(), round);
    if let Some(grid) = RowGrid::of(&xp) {
        let client = xp.client.clone();
        // Operands the launch does not read: any f32 tensor of the device stands in for them.
        let (with_extra, extra, low_rank) = match extra {
            Extra::Nothing => (false, yp.clone(), None),
            Extra::Added(extra) => (true, extra, None),
            Extra::LowRank(parts) => (false, yp.clone(), Some(parts)),
        };
        let with_low_rank = low_rank.is_some();
        let ((input, a, b, mask), masked, slots) = match low_rank {
            Some((input, a, b, mask)) => {
                let slots = a.meta.shape().as_slice()[0].next_power_of_two();
                let masked = mask.is_some();
                ((input, a, b.clone(), mask.unwrap_or(b)), masked, slots)
            }
            None => ((yp.clone(), yp.clone(), yp.clone(), yp.clone()), false, 1),
        };
        kernel::add_rms_norm_kernel::launch(
            &client,
            grid.count,
            grid.cube_dim,
            xp.into_tensor_arg(),
            yp.into_tensor_arg(),
            extra.into_tensor_arg(),
            input.into_tensor_arg(),
            a.into_tensor_arg(),
            b.into_tensor_arg(),
            mask.into_tensor_arg(),
            wp.into_tensor_arg(),
            sum.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rounded.clone().into_tensor_arg(),
            grid.rows,
            seq.max(1),
            eps as f32,
            grid.units,
            with_extra,
            with_low_rank,
            masked,
            slots,
            low_rank_group(slots),
            writes,
            rounded_type,
        );
    }
    Some((sum, out, writes.then_some(rounded)))
}

/// [`rms_norm`] for an f32 `x` under autodiff on a cubecl device ([`super::takes_tracked`]), its
/// backward one kernel too ([`RmsNormBackward`]); burn's composite when `x` or `weight` is not
/// of that form (a weight under autodiff, which the norm's frozen weights never are).
///
/// # Shapes
/// `x`: `[..., width]`, `weight`: `[width]` -> like `x` (contiguous)
pub fn rms_norm_tracked<const D: usize>(x: Tensor<D>, weight: &Tensor<1>, eps: f64) -> Tensor<D> {
    let Ok(wp) = weight.clone().try_into_primitive::<Cube>() else {
        return super::super::rms_norm::composite(x, weight, eps);
    };
    let norm = RmsNorm { weight: into_contiguous(wp), eps: eps as f32 };
    apply_tracked(norm, [x.clone()]).unwrap_or_else(|| super::super::rms_norm::composite(x, weight, eps))
}

/// The norm by a frozen weight (contiguous), as an autodiff node whose backward is
/// [`RmsNormBackward`].
#[derive(Clone, Debug)]
struct RmsNorm {
    weight: Primitive,
    eps: f32,
}

impl TrackedOp<1> for RmsNorm {
    fn apply<C: CheckpointStrategy>(self, [xa]: [FloatTensor<Autodiff<Cube, C>>; 1]) -> FloatTensor<Autodiff<Cube, C>> {
        let node = xa.node();
        let xp = untile(xa.into_primitive());
        let out = forward(xp.clone(), self.weight.clone(), self.eps);
        match RmsNormBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(Saved { x: xp, norm: self }, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// The norm's forward launch (`weight` contiguous).
fn forward(xp: Primitive, wp: Primitive, eps: f32) -> Primitive {
    // A matmul's output may be stored in tiles; the kernel reads rows.
    let xp = untile(xp);
    let out = empty_like(&xp);
    let Some(grid) = RowGrid::of(&xp) else { return out };
    let client = xp.client.clone();
    kernel::rms_norm_kernel::launch(
        &client,
        grid.count,
        grid.cube_dim,
        xp.into_tensor_arg(),
        wp.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        grid.rows,
        eps,
        grid.units,
    );
    out
}

/// The launch of a norm kernel over a tensor's rows (its last dimension): one cube a row.
struct RowGrid {
    rows: usize,
    count: CubeCount,
    cube_dim: CubeDim,
    units: usize,
}

impl RowGrid {
    /// The launch over `x`'s rows, or `None` when it has no values.
    fn of(x: &Primitive) -> Option<Self> {
        let dims = x.meta.shape().as_slice();
        let width = dims.last().copied().unwrap_or(1);
        let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
        if rows == 0 || width == 0 {
            return None;
        }
        let (count, cube_dim, units) = row_launch(rows, width);
        Some(Self { rows, count, cube_dim, units })
    }
}

/// The backward of [`rms_norm_tracked`]: `x`'s gradient in one kernel.
#[derive(Debug)]
struct RmsNormBackward;

/// What the backward reads: the input (as the forward read it), the weight and `eps`.
#[derive(Clone, Debug)]
struct Saved {
    x: Primitive,
    norm: RmsNorm,
}

impl Backward<Cube, 1> for RmsNormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Some(node) = node_x else { return };
        let Saved { x, norm: RmsNorm { weight, eps } } = ops.state;
        let grad = into_contiguous(untile(grad));
        let dx = empty_like(&x);
        if let Some(grid) = RowGrid::of(&x) {
            let client = x.client.clone();
            kernel::rms_norm_backward_kernel::launch(
                &client,
                grid.count,
                grid.cube_dim,
                x.into_tensor_arg(),
                weight.into_tensor_arg(),
                grad.into_tensor_arg(),
                dx.clone().into_tensor_arg(),
                grid.rows,
                eps,
                grid.units,
            );
        }
        grads.register::<Cube>(node.id, dx);
    }
}
