//! The rotary embedding `x cos + rotate_half(x) sin` as one cubecl kernel.
//!
//! burn's composite is six kernels a rotation on a GPU (a negation, two slice writes for the
//! concatenation, two products and a sum), twice a layer (queries and keys). Here one unit
//! writes one output value, `x[j] cos[j] + r[j] sin[j]` with `r` the rotated half, reading the
//! queries or keys through their strides (the per-head views of the stacked q/k/v product) and
//! the tables broadcast over the heads. The GPU compiler may contract the product and the sum
//! into one fused multiply-add, so values may differ from the composite's in the last bit.
//!
//! Under autodiff the backward is one kernel too: each input gradient is `g[j] cos[j]` plus its
//! one rotated term, and only the tables are kept for it (burn's composite keeps the rotated
//! copy and, in its backward, fills zeroed tensors for the narrows of the two halves).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Cube};
use burn::tensor::Tensor;
use burn_cubecl::kernel::{into_contiguous, untile};

use super::{apply_tracked, elementwise_launch, empty_like, Primitive, TrackedOp};

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// One unit per value of `out` (contiguous, `x`'s shape `[batch, heads, seq, head_dim]`):
    /// `x cos + rotate_half(x) sin`, `x` of any strides, `cos` and `sin` `[batch, 1, seq,
    /// head_dim]` of any strides.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn rope_kernel(x: &Tensor<f32>, cos: &Tensor<f32>, sin: &Tensor<f32>, out: &mut Tensor<f32>) {
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

    /// The backward of [`rope_kernel`] in `x`: one unit per value of `dx` (contiguous, `grad`'s
    /// shape `[batch, heads, seq, head_dim]`), `g[j] cos[j] + g[j + half] sin[j + half]` in the
    /// first half and `g[j] cos[j] - g[j - half] sin[j - half]` in the second; `grad` contiguous,
    /// `cos` and `sin` as in the forward.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn rope_backward_kernel(grad: &Tensor<f32>, cos: &Tensor<f32>, sin: &Tensor<f32>, dx: &mut Tensor<f32>) {
        let index = ABSOLUTE_POS;
        if index < dx.len() {
            let dim = grad.shape(3);
            let seq = grad.shape(2);
            let heads = grad.shape(1);
            let j = index % dim;
            let s = (index / dim) % seq;
            let b = index / (dim * seq * heads);
            let half = dim / 2;
            let row = index - j;
            let table = b * sin.stride(0) + s * sin.stride(2);
            let c = cos[b * cos.stride(0) + s * cos.stride(2) + j * cos.stride(3)];
            // x[j] feeds output j directly and output j -/+ half through the rotation.
            let rotated = if j < half {
                grad[row + j + half] * sin[table + (j + half) * sin.stride(3)]
            } else {
                -(grad[row + j - half] * sin[table + (j - half) * sin.stride(3)])
            };
            dx[index] = grad[index] * c + rotated;
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
    Tensor::from_primitive::<Cube>(forward(xp, &untile(cp), &untile(sp)))
}

/// [`rope`] for an f32 `x` under autodiff on a cubecl device ([`super::takes_tracked`]), its
/// backward one kernel too ([`RopeBackward`]); burn's composite when `x` or the tables are not of
/// that form. The tables are constants (no gradient).
///
/// # Shapes
/// `x`: `[batch, heads, seq, head_dim]` (`head_dim` even), `cos`/`sin`: `[batch, 1, seq,
/// head_dim]` -> like `x` (contiguous)
pub fn rope_tracked(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    let tables = (
        cos.clone().without_autodiff().try_into_primitive::<Cube>(),
        sin.clone().without_autodiff().try_into_primitive::<Cube>(),
    );
    let (Ok(cp), Ok(sp)) = tables else {
        return super::super::rope::composite(x, cos, sin);
    };
    let rotation = Rotation { cos: untile(cp), sin: untile(sp) };
    apply_tracked(rotation, [x.clone()]).unwrap_or_else(|| super::super::rope::composite(x, cos, sin))
}

/// The rotation by its tables, as an autodiff node whose backward is [`RopeBackward`] (the
/// tables are all it keeps).
#[derive(Clone, Debug)]
struct Rotation {
    cos: Primitive,
    sin: Primitive,
}

impl TrackedOp<1> for Rotation {
    fn apply<C: CheckpointStrategy>(self, [xa]: [FloatTensor<Autodiff<Cube, C>>; 1]) -> FloatTensor<Autodiff<Cube, C>> {
        let node = xa.node();
        let out = forward(xa.into_primitive(), &self.cos, &self.sin);
        match RopeBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(self, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// The rotation's launch (tables not tiled).
fn forward(xp: Primitive, cp: &Primitive, sp: &Primitive) -> Primitive {
    let xp = untile(xp);
    let out = empty_like(&xp);
    let count = xp.meta.shape().num_elements();
    if count == 0 {
        return out;
    }
    let (cube_count, cube_dim) = elementwise_launch(&xp, count);
    let client = xp.client.clone();
    kernel::rope_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        xp.into_tensor_arg(),
        cp.clone().into_tensor_arg(),
        sp.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    out
}

/// The backward of [`rope_tracked`]: `x`'s gradient in one kernel.
#[derive(Debug)]
struct RopeBackward;

impl Backward<Cube, 1> for RopeBackward {
    type State = Rotation;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Some(node) = node_x else { return };
        let Rotation { cos, sin } = ops.state;
        let grad = into_contiguous(untile(grad));
        let dx = empty_like(&grad);
        let count = grad.meta.shape().num_elements();
        if count > 0 {
            let (cube_count, cube_dim) = elementwise_launch(&grad, count);
            let client = grad.client.clone();
            kernel::rope_backward_kernel::launch(
                &client,
                cube_count,
                cube_dim,
                grad.into_tensor_arg(),
                cos.into_tensor_arg(),
                sin.into_tensor_arg(),
                dx.clone().into_tensor_arg(),
            );
        }
        grads.register::<Cube>(node.id, dx);
    }
}
