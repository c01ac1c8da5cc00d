//! The rotary embedding `x cos + rotate_half(x) sin` as one cubecl kernel.
//!
//! burn's composite is six kernels a rotation on a GPU (a negation, two slice writes for the
//! concatenation, two products and a sum), twice a layer (queries and keys). Here one unit
//! writes one output value, `x[j] cos[j] + r[j] sin[j]` with `r` the rotated half, reading the
//! queries or keys through their strides (the per-head views of the stacked q/k/v product) and
//! the tables broadcast over the heads. The GPU compiler may contract the product and the sum
//! into one fused multiply-add, so values may differ from the composite's in the last bit.

use burn::backend::Cube;
use burn::tensor::Tensor;
use burn_cubecl::kernel::untile;

use super::{elementwise_launch, empty_like};

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// One unit per value of `out` (contiguous, `x`'s shape `[batch, heads, seq, head_dim]`):
    /// `x cos + rotate_half(x) sin`, `x` of any strides, `cos` and `sin` `[batch, 1, seq,
    /// head_dim]` of any strides.
    #[cube(launch)]
    pub(super) fn rope_kernel(x: &Tensor<f32>, cos: &Tensor<f32>, sin: &Tensor<f32>, out: &mut Tensor<f32>) {
        let index = ABSOLUTE_POS;
        if index < out.len() {
            let dim = x.shape(3);
            let seq = x.shape(2);
            let heads = x.shape(1);
            let j = index % dim;
            let s = (index / dim) % seq;
            let h = (index / (dim * seq)) % heads;
            let b = index / (dim * seq * heads);
            let half = dim / 2;
            let row = b * x.stride(0) + h * x.stride(1) + s * x.stride(2);
            let step = x.stride(3);
            let rotated = if j < half { -x[row + (j + half) * step] } else { x[row + (j - half) * step] };
            let c = cos[b * cos.stride(0) + s * cos.stride(2) + j * cos.stride(3)];
            let n = sin[b * sin.stride(0) + s * sin.stride(2) + j * sin.stride(3)];
            out[index] = x[row + j * step] * c + rotated * n;
        }
    }
}

/// `x cos + rotate_half(x) sin` in one kernel launch, for plain f32 tensors on a cubecl device
/// ([`super::takes`]; burn's composite otherwise).
///
/// # Shapes
/// `x`: `[batch, heads, seq, head_dim]` (`head_dim` even), `cos`/`sin`: `[batch, 1, seq,
/// head_dim]` -> like `x` (contiguous)
pub fn rope(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    let primitives = (
        x.clone().try_into_primitive::<Cube>(),
        cos.clone().try_into_primitive::<Cube>(),
        sin.clone().try_into_primitive::<Cube>(),
    );
    let (Ok(xp), Ok(cp), Ok(sp)) = primitives else {
        return super::super::rope::composite(x, cos, sin);
    };
    let (xp, cp, sp) = (untile(xp), untile(cp), untile(sp));
    let out = empty_like(&xp);
    let count = x.dims().iter().product::<usize>();
    if count == 0 {
        return Tensor::from_primitive::<Cube>(out);
    }
    let (cube_count, cube_dim) = elementwise_launch(&xp, count);
    let client = xp.client.clone();
    kernel::rope_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        xp.into_tensor_arg(),
        cp.into_tensor_arg(),
        sp.into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    Tensor::from_primitive::<Cube>(out)
}
