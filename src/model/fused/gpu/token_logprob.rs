//! `log softmax(logits)[target]` for each row as one cubecl kernel, the scorer's step.
//!
//! burn's composite is a maximum, a subtraction, an exponential, a sum, a logarithm, an addition,
//! a gather and a subtraction: eight kernels for each block of rows the scorer takes. Here one
//! cube takes one row: its units reduce the row's maximum, then the sum of `e^(x - max)`, in
//! shared memory, and one unit writes `x[target] - (ln sum + max)`, the composite's order of
//! operations; only the sums run in another order.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::Cube;
use burn::tensor::{Int, Shape, Tensor};
use burn_cubecl::cubecl::ir::ElemType;
use burn_cubecl::kernel::untile;

use super::{empty_of, row_launch, Primitive};

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{cube_row, row_max_lse};

    /// One cube per row of `logits` (`[rows, vocab]`, any strides): `out[row]` (`[rows]`,
    /// contiguous) gets `logits[row, targets[row]] - ln sum_v e^(logits[row, v])`. `units` is the
    /// cube's size, a power of two.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn token_logprob_kernel<T: Numeric>(
        logits: &Tensor<f32>,
        targets: &Tensor<T>,
        out: &mut Tensor<f32>,
        rows: usize,
        #[comptime] units: usize,
        #[define(T)] _target_type: ElemType,
    ) {
        let row = cube_row();
        // Every unit of a cube takes the same branch, so the barriers below stay uniform.
        if row < rows {
            let start = row * logits.stride(0);
            let step = logits.stride(1);
            let mut partial = Shared::<[f32]>::new_slice(units);
            let (_, lse) = row_max_lse(logits, start, step, &mut partial);
            if UNIT_POS_X == 0 {
                let target = usize::cast_from(targets[row * targets.stride(0)]);
                out[row] = logits[start + target * step] - lse;
            }
        }
    }

    /// [`token_logprob_kernel`], and `complement[row, v] = 1[v = targets[row]] - e^(logits[row, v]
    /// - lse)` (`[rows, vocab]`, contiguous): the log-probability's gradient in the row's logits.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn token_logprob_complement_kernel<T: Numeric>(
        logits: &Tensor<f32>,
        targets: &Tensor<T>,
        out: &mut Tensor<f32>,
        complement: &mut Tensor<f32>,
        rows: usize,
        #[comptime] units: usize,
        #[define(T)] _target_type: ElemType,
    ) {
        let row = cube_row();
        if row < rows {
            let vocab = logits.shape(1);
            let start = row * logits.stride(0);
            let step = logits.stride(1);
            let mut partial = Shared::<[f32]>::new_slice(units);
            let (_, lse) = row_max_lse(logits, start, step, &mut partial);
            let target = usize::cast_from(targets[row * targets.stride(0)]);
            let mut i = UNIT_POS_X as usize;
            while i < vocab {
                let mut value = -f32::exp(logits[start + i * step] - lse);
                if i == target {
                    value += 1.0;
                }
                complement[row * vocab + i] = value;
                i += CUBE_DIM_X as usize;
            }
            if UNIT_POS_X == 0 {
                out[row] = logits[start + target * step] - lse;
            }
        }
    }
}

/// The logits and targets of one launch as cubecl primitives, the log-probabilities' empty
/// output, and the shape.
struct Launch {
    logits: Primitive,
    targets: Primitive,
    target_type: ElemType,
    out: Primitive,
    rows: usize,
    vocab: usize,
}

impl Launch {
    /// The launch, or `None` when either tensor is not on a cubecl device.
    fn of(logits: &Tensor<2>, targets: &Tensor<1, Int>) -> Option<Self> {
        let [rows, vocab] = logits.dims();
        let logits = untile(logits.clone().try_into_primitive::<Cube>().ok()?);
        let targets = targets.clone().try_into_primitive::<Cube>().ok()?;
        let target_type = dtype_to_storage_type(targets.dtype);
        let out = empty_of(&logits, Shape::new([rows]));
        Some(Self { logits, targets, target_type, out, rows, vocab })
    }

    /// Whether there is nothing to compute.
    fn is_empty(&self) -> bool {
        self.rows == 0 || self.vocab == 0
    }
}

/// Each row's `log softmax(logits)[target]` in one kernel launch, for plain f32 logits on a
/// cubecl device ([`super::takes`]; burn's composite otherwise). `targets` must hold column
/// indices below `vocab` (the scorer's token ids).
///
/// # Shapes
/// `logits`: `[rows, vocab]`, `targets`: `[rows]` -> `[rows]`
pub fn token_logprobs(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let Some(launch) = Launch::of(&logits, &targets) else {
        return super::super::token_logprob::composite(logits, targets);
    };
    let out = launch.out.clone();
    if !launch.is_empty() {
        let (count, cube_dim, units) = row_launch(launch.rows, launch.vocab);
        let client = launch.logits.client.clone();
        kernel::token_logprob_kernel::launch(
            &client,
            count,
            cube_dim,
            launch.logits.into_tensor_arg(),
            launch.targets.into_tensor_arg(),
            launch.out.into_tensor_arg(),
            launch.rows,
            units,
            launch.target_type,
        );
    }
    Tensor::from_primitive::<Cube>(out)
}

/// Each row's `log softmax(logits)[target]` and its gradient in the row's logits
/// (`1[v = target] - softmax(logits)[v]`, [`crate::model::fused::token_logprob::token_logprobs_and_complement`])
/// in one kernel launch, for plain f32 logits on a cubecl device ([`super::takes`]; burn's
/// composite otherwise).
///
/// # Shapes
/// `logits`: `[rows, vocab]`, `targets`: `[rows]` -> (`[rows]`, `[rows, vocab]`)
pub fn token_logprobs_and_complement(logits: Tensor<2>, targets: Tensor<1, Int>) -> (Tensor<1>, Tensor<2>) {
    let Some(launch) = Launch::of(&logits, &targets) else {
        return super::super::token_logprob::composite_complement(logits, targets);
    };
    let out = launch.out.clone();
    let complement = empty_of(&launch.logits, Shape::new([launch.rows, launch.vocab]));
    if !launch.is_empty() {
        let (count, cube_dim, units) = row_launch(launch.rows, launch.vocab);
        let client = launch.logits.client.clone();
        kernel::token_logprob_complement_kernel::launch(
            &client,
            count,
            cube_dim,
            launch.logits.into_tensor_arg(),
            launch.targets.into_tensor_arg(),
            launch.out.into_tensor_arg(),
            complement.clone().into_tensor_arg(),
            launch.rows,
            units,
            launch.target_type,
        );
    }
    (Tensor::from_primitive::<Cube>(out), Tensor::from_primitive::<Cube>(complement))
}
