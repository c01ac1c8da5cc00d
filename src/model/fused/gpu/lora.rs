//! A LoRA delta `((x A^T) * mask) B_scaled^T` over a few rows (a decoding step's) as one cubecl
//! kernel, added to the projection's output in the same kernel where the caller gives it.
//!
//! Composed of burn's operations it is two products and a multiply by the rows' rank mask
//! (stacked adapters), three launches for each adapted site at every decoded token, each doing
//! little: the ranks are a few dozen. Here one cube takes one row and a block of [`COLUMNS`]
//! output columns: its units first compute the row's product with every row of `A` into shared
//! memory, each rank column's sum split over a group of units (pairs the mask zeroes are
//! skipped), then each unit writes its columns of the row's delta. A row's cubes each compute
//! the first product again, a product of `rank x fan_in` against the block's `rank x COLUMNS`:
//! so the delta of a Qwen3-4B q/k/v projection (6,144 columns) over 16 rows runs in 48 cubes,
//! where one cube per few rows would leave most of a GPU's multiprocessors idle and give each
//! unit thousands of steps.

use burn::backend::Cube;
use burn::tensor::{Shape, Tensor};
use burn_cubecl::cubecl::prelude::{CubeCount, CubeDim};
use burn_cubecl::kernel::untile;

use super::{empty_of, low_rank_group, Primitive, MAX_GRID};

/// Output columns a cube takes: its row's first product is computed once for them.
pub(super) const COLUMNS: usize = 2048;

/// Units a cube has.
pub(super) const UNITS: usize = 256;

/// The most rows the kernel is for: past a decoding batch, two products use the device better.
pub const MAX_ROWS: usize = 64;

/// The largest total rank the kernel takes (a cube's shared memory holds the rank's slots).
pub(super) const MAX_RANK: usize = 256;

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{low_rank_down, low_rank_up};

    /// One cube per (row, block of `columns` columns) of the output, `blocks` blocks a row,
    /// for `x` (`[n, in]`, any strides): `out[row, c]` (`[n, out]`, contiguous) gets `sum_j
    /// (x[row] . a[j]) mask[row / seq, j] b[c, j]` for `a` `[rank, in]`, `b` `[out, rank]` and
    /// `mask` `[n / seq, rank]` (read only `masked`), any strides, added to `base[row, c]`
    /// (`[n, out]`, any strides; read only `onto`). `slots` is the rank's power of two, `group`
    /// the units a rank column's sum is split over ([`super::low_rank_group`]); the cube has
    /// `units` units.
    #[cube(launch, create_dummy_kernel)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lora_delta_kernel(
        x: &Tensor<f32>,
        a: &Tensor<f32>,
        b: &Tensor<f32>,
        mask: &Tensor<f32>,
        base: &Tensor<f32>,
        out: &mut Tensor<f32>,
        n: usize,
        seq: usize,
        blocks: usize,
        #[comptime] columns: usize,
        #[comptime] units: usize,
        #[comptime] slots: usize,
        #[comptime] group: usize,
        #[comptime] masked: bool,
        #[comptime] onto: bool,
    ) {
        let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
        let (row, block) = (cube / blocks, cube % blocks);
        let unit = UNIT_POS_X as usize;
        let rank = a.shape(0);
        let fan_out = b.shape(0);
        let mut partial = Shared::<[f32]>::new_slice(units);
        let mut down = Shared::<[f32]>::new_slice(slots);
        // A whole cube takes one row: its units all reach the first product's barriers.
        if row < n {
            let mask_start = (row / seq) * mask.stride(0);
            low_rank_down(
                x,
                row * x.stride(0),
                x.stride(1),
                a,
                mask,
                mask_start,
                &mut partial,
                &mut down,
                slots,
                group,
                masked,
            );

            // Each unit takes columns of the block, reading `B`'s row for each.
            let mut end = (block + 1) * columns;
            if end > fan_out {
                end = fan_out;
            }
            let mut c = block * columns + unit;
            while c < end {
                let mut sum = low_rank_up(&down, rank, b, c);
                if onto {
                    sum += base[row * base.stride(0) + c * base.stride(1)];
                }
                out[row * fan_out + c] = sum;
                c += units;
            }
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
    let blocks = fan_out.div_ceil(COLUMNS);
    let cubes = n * blocks;
    let count = CubeCount::Static(cubes.min(MAX_GRID) as u32, cubes.div_ceil(MAX_GRID) as u32, 1);
    let client = x.client.clone();
    let slots = rank.next_power_of_two();
    kernel::lora_delta_kernel::launch(
        &client,
        count,
        CubeDim::new_1d(UNITS as u32),
        x.into_tensor_arg(),
        a.into_tensor_arg(),
        b.into_tensor_arg(),
        mask.into_tensor_arg(),
        base.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        n,
        seq.max(1),
        blocks,
        COLUMNS,
        UNITS,
        slots,
        low_rank_group(slots),
        masked,
        onto,
    );
    Tensor::from_primitive::<Cube>(out)
}
