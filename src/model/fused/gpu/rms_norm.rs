//! The RMS norm as one cubecl kernel.
//!
//! burn's composite is seven kernels a norm on a GPU (square, mean, add, square root,
//! reciprocal, two products), and a decoded token of a Qwen3 layer runs four norms: 28 of the
//! layer's 71 launches at `small` (`examples/kernel_counts.rs`). Here one cube normalises one
//! row: its units sum the row's squares in f32, a tree in shared memory adds the partial sums,
//! and each unit writes its share of `x * (1 / sqrt(mean + eps)) * w`, the composite's order of
//! operations. Rows are addressed through the input's strides, so a narrowed or split view (the
//! per-head q and k norms read the stacked q/k/v product's columns) is read in place.

use burn::backend::Cube;
use burn::tensor::Tensor;
use burn_cubecl::kernel::{into_contiguous, untile};

use super::{empty_like, row_launch};

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{cube_reduce, cube_row};

    /// One cube per row of `x` (`[..., width]`, any strides): `out` (contiguous, `x`'s shape) gets
    /// `x / sqrt(mean(x^2) + eps) * weight`. `units` is the cube's size, a power of two.
    #[cube(launch)]
    pub(super) fn rms_norm_kernel(
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
            let rank = x.rank();
            let width = x.shape(rank - 1);
            // The row's first value in `x`: its index split over the leading dimensions.
            let mut rest = row;
            let mut start = 0usize;
            let mut dim = rank - 1;
            while dim > 0 {
                dim -= 1;
                let size = x.shape(dim);
                start += (rest % size) * x.stride(dim);
                rest /= size;
            }
            let step = x.stride(rank - 1);

            let mut sum = 0.0f32;
            let mut i = unit;
            while i < width {
                let v = x[start + i * step];
                sum += v * v;
                i += units_here;
            }
            let mut partial = Shared::<[f32]>::new_slice(units);
            let total = cube_reduce(&mut partial, sum, false);
            let inverse = 1.0f32 / f32::sqrt(total / f32::cast_from(width) + eps);

            let mut i = unit;
            while i < width {
                out[row * width + i] = x[start + i * step] * inverse * weight[i * weight.stride(0)];
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
    let dims = x.dims();
    let width = dims[D - 1];
    let rows: usize = dims[..D - 1].iter().product();
    let (Ok(xp), Ok(wp)) = (x.clone().try_into_primitive::<Cube>(), weight.clone().try_into_primitive::<Cube>()) else {
        return super::super::rms_norm::composite(x, weight, eps);
    };
    // A matmul's output may be stored in tiles; the kernel reads rows.
    let (xp, wp) = (untile(xp), into_contiguous(wp));
    let out = empty_like(&xp);
    if rows == 0 || width == 0 {
        return Tensor::from_primitive::<Cube>(out);
    }
    let (count, cube_dim, units) = row_launch(rows, width);
    let client = xp.client.clone();
    kernel::rms_norm_kernel::launch(
        &client,
        count,
        cube_dim,
        xp.into_tensor_arg(),
        wp.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        eps as f32,
        units,
    );
    Tensor::from_primitive::<Cube>(out)
}
