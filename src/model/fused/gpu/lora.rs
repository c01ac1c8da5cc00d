//! A LoRA delta `((x A^T) * mask) B_scaled^T` over a few rows (a decoding step's) as one cubecl
//! kernel, added to the projection's output in the same kernel where the caller gives it.
//!
//! Composed of burn's operations it is two products and a multiply by the rows' rank mask
//! (stacked adapters), three launches for each adapted site at every decoded token, each doing
//! little: the ranks are a few dozen. Here one cube takes a block of [`ROWS`] rows: its units
//! first reduce each (row, rank) pair's product with `A` into shared memory, masked (pairs the
//! mask zeroes are skipped), then each unit writes its columns of the rows' deltas, reading `B`'s
//! rows once for the block. Each product is summed in f32 in order along the shared dimension.

use burn::backend::Cube;
use burn::tensor::{Shape, Tensor};
use burn_cubecl::cubecl::prelude::{CubeCount, CubeDim};
use burn_cubecl::kernel::untile;

use super::{empty_of, Primitive, MAX_GRID};

/// Rows a cube takes: they share its reads of `B`.
const ROWS: usize = 4;

/// The most rows the kernel is for: past a decoding batch, two products use the device better.
pub const MAX_ROWS: usize = 64;

/// The largest total rank the kernel takes (a cube's shared memory holds `ROWS` x the rank).
pub(super) const MAX_RANK: usize = 256;

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{low_rank_down, low_rank_up};

    /// One cube per block of `rows_per_cube` rows of `x` (`[n, in]`, any strides): `out[row]`
    /// (`[n, out]`, contiguous) gets `sum_j (x[row] . a[j]) mask[row / seq, j] b[:, j]` for `a`
    /// `[rank, in]`, `b` `[out, rank]` and `mask` `[n / seq, rank]` (read only `masked`), any
    /// strides, added to `base[row]` (`[n, out]`, any strides; read only `onto`). `slots` is at
    /// least the rank.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lora_delta_kernel(
        x: &Tensor<f32>,
        a: &Tensor<f32>,
        b: &Tensor<f32>,
        mask: &Tensor<f32>,
        base: &Tensor<f32>,
        out: &mut Tensor<f32>,
        n: usize,
        seq: usize,
        #[comptime] rows_per_cube: usize,
        #[comptime] slots: usize,
        #[comptime] masked: bool,
        #[comptime] onto: bool,
    ) {
        let first_row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * rows_per_cube;
        let unit = UNIT_POS_X as usize;
        let units_here = CUBE_DIM_X as usize;
        let rank = a.shape(0);
        let fan_out = b.shape(0);
        let mut down = Shared::<[f32]>::new_slice(rows_per_cube * slots);

        // Each unit takes (row, rank) pairs: the row's product with `A`'s row, masked.
        let pairs = rows_per_cube * rank;
        let mut p = unit;
        while p < pairs {
            let r = p / rank;
            let j = p % rank;
            let row = first_row + r;
            let mut value = 0.0f32;
            if row < n {
                let mut weight = 1.0f32;
                if masked {
                    weight = mask[(row / seq) * mask.stride(0) + j * mask.stride(1)];
                }
                value = low_rank_down(x, row * x.stride(0), x.stride(1), a, j, weight);
            }
            down[r * slots + j] = value;
            p += units_here;
        }
        sync_cube();

        // Each unit takes columns: the block's rows read `B`'s row for the column once.
        let mut c = unit;
        while c < fan_out {
            let mut r = 0usize;
            while r < rows_per_cube {
                let row = first_row + r;
                if row < n {
                    let mut sum = low_rank_up(&down, r * slots, rank, b, c);
                    if onto {
                        sum += base[row * base.stride(0) + c * base.stride(1)];
                    }
                    out[row * fan_out + c] = sum;
                }
                r += 1;
            }
            c += units_here;
        }
    }
}

/// Whether [`lora_delta`] takes these operands: plain f32 tensors on a cubecl device
/// ([`super::takes`]), at most [`MAX_ROWS`] rows and a total rank of at most 256.
pub fn takes(
    x: &Tensor<2>,
    a: &Tensor<2>,
    b_scaled: &Tensor<2>,
    mask: Option<&Tensor<2>>,
    base: Option<&Tensor<2>>,
) -> bool {
    let [rows, _] = x.dims();
    let [rank, _] = a.dims();
    super::takes(x)
        && super::takes(a)
        && super::takes(b_scaled)
        && mask.is_none_or(super::takes)
        && base.is_none_or(super::takes)
        && rows > 0
        && rows <= MAX_ROWS
        && rank > 0
        && rank <= MAX_RANK
}

/// `((x A^T) * mask[row / seq]) B_scaled^T`, added to `base` when given, as one kernel launch,
/// for operands [`takes`] takes (`mask` `None`: every rank column kept).
///
/// # Panics
/// If [`takes`] does not take the operands.
///
/// # Shapes
/// `x`: `[n, in]`, `a`: `[rank, in]`, `b_scaled`: `[out, rank]`, `mask`: `[n / seq, rank]`,
/// `base`: `[n, out]` -> `[n, out]`
pub fn lora_delta(
    x: &Tensor<2>,
    a: &Tensor<2>,
    b_scaled: &Tensor<2>,
    mask: Option<&Tensor<2>>,
    seq: usize,
    base: Option<&Tensor<2>>,
) -> Tensor<2> {
    assert!(takes(x, a, b_scaled, mask, base), "the few-row LoRA kernel takes plain f32 operands on a cubecl device");
    let [n, _] = x.dims();
    let [rank, _] = a.dims();
    let [fan_out, _] = b_scaled.dims();
    let primitive = |t: &Tensor<2>| -> Primitive {
        untile(t.clone().try_into_primitive::<Cube>().expect("`takes` checked the device"))
    };
    let (x, a, b) = (primitive(x), primitive(a), primitive(b_scaled));
    let (masked, onto) = (mask.is_some(), base.is_some());
    // Without a mask or a base the kernel reads none; any f32 tensor stands in for the argument.
    let mask = mask.map_or_else(|| a.clone(), primitive);
    let base = base.map_or_else(|| a.clone(), primitive);
    let out = empty_of(&x, Shape::new([n, fan_out]));
    let cubes = n.div_ceil(ROWS);
    let count = CubeCount::Static(cubes.min(MAX_GRID) as u32, cubes.div_ceil(MAX_GRID) as u32, 1);
    let client = x.client.clone();
    kernel::lora_delta_kernel::launch(
        &client,
        count,
        CubeDim::new_1d(256),
        x.into_tensor_arg(),
        a.into_tensor_arg(),
        b.into_tensor_arg(),
        mask.into_tensor_arg(),
        base.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        n,
        seq.max(1),
        ROWS,
        rank.next_power_of_two(),
        masked,
        onto,
    );
    Tensor::from_primitive::<Cube>(out)
}
