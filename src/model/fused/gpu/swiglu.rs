//! The MLP's gate `silu(gate) * up` as one cubecl kernel.
//!
//! burn's composite is eight kernels on a GPU: its sigmoid is `exp(-log(1 + exp(-x)))` (two
//! negations, two exponentials, an add and a log), then the two products. Here one unit writes
//! one output value by the same formula, reading the gate and `up` through their strides (the
//! two halves of the stacked gate/up product, read in place).
//!
//! Under autodiff ([`swiglu_stacked_tracked`]) the gate and `up` are read from the stacked
//! product in place, and the backward is one kernel writing the stacked product's whole
//! gradient, both halves side by side: burn's composite differentiates its eight kernels one by
//! one, then fills a zeroed tensor for each narrowed half and adds the two.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Cube};
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::kernel::{into_contiguous, untile};
use burn_cubecl::ops::numeric::add;

use super::{
    apply_tracked, elementwise_launch, empty_like, empty_of, last_dim_slice, rounded_output, Primitive, TrackedOp,
};

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// Where the `index`-th value of `tensor` (counted in row-major order over its shape) lies
    /// in its storage: the index split over the dimensions, last first, times their strides.
    #[cube]
    fn strided_offset(tensor: &Tensor<f32>, index: usize) -> usize {
        let mut rest = index;
        let mut at = 0usize;
        let mut dim = tensor.rank();
        while dim > 0 {
            dim -= 1;
            let size = tensor.shape(dim);
            at += (rest % size) * tensor.stride(dim);
            rest /= size;
        }
        at
    }

    /// One unit per value of `out` (contiguous, `gate`'s shape): `silu(gate) * up`, `gate` and
    /// `up` of one shape and any strides; when `round`, `rounded` (contiguous, `out`'s shape)
    /// gets the value rounded to `R` too.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn swiglu_kernel<R: Float>(
        gate: &Tensor<f32>,
        up: &Tensor<f32>,
        out: &mut Tensor<f32>,
        rounded: &mut Tensor<R>,
        #[comptime] round: bool,
        #[define(R)] _rounded_type: ElemType,
    ) {
        let index = ABSOLUTE_POS;
        if index < out.len() {
            let at_gate = strided_offset(gate, index);
            let at_up = strided_offset(up, index);
            let x = gate[at_gate];
            let sigmoid = f32::exp(-f32::ln(f32::exp(-x) + 1.0f32));
            let value = x * sigmoid * up[at_up];
            out[index] = value;
            if round {
                rounded[index] = R::cast_from(value);
            }
        }
    }

    /// The backward of [`swiglu_kernel`]: one unit per value of `grad` (contiguous, `gate`'s
    /// shape `[..., width]`) writes the gate's gradient `g up s (1 + x (1 - s))` (`x` the gate,
    /// `s` its sigmoid) and `up`'s `g x s` side by side into `d_gate_up` (contiguous, `[...,
    /// 2 width]`), the stacked product's gradient.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn swiglu_backward_kernel(
        gate: &Tensor<f32>,
        up: &Tensor<f32>,
        grad: &Tensor<f32>,
        d_gate_up: &mut Tensor<f32>,
    ) {
        let index = ABSOLUTE_POS;
        if index < grad.len() {
            let at_gate = strided_offset(gate, index);
            let at_up = strided_offset(up, index);
            let width = gate.shape(gate.rank() - 1);
            let x = gate[at_gate];
            let g = grad[index];
            let sigmoid = f32::exp(-f32::ln(f32::exp(-x) + 1.0f32));
            let at = (index / width) * 2 * width + index % width;
            d_gate_up[at] = g * up[at_up] * sigmoid * (1.0f32 + x * (1.0f32 - sigmoid));
            d_gate_up[at + width] = g * x * sigmoid;
        }
    }
}

/// `silu(gate) * up` in one kernel launch, for plain f32 tensors of one shape on a cubecl device
/// ([`super::takes`]; burn's composite otherwise).
///
/// # Shapes
/// `gate`, `up`: `[..., width]` -> like `gate` (contiguous)
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    swiglu_rounded(gate, up, None).0
}

/// [`swiglu`], and given `round` (the half precision of the frozen product the gate feeds,
/// [`super::rounding`]) its output rounded to that type, written by the same kernel (`None` for
/// it where burn's composite ran).
///
/// # Shapes
/// `gate`, `up`: `[..., width]` -> like `gate` (contiguous) each
pub fn swiglu_rounded<const D: usize>(
    gate: Tensor<D>,
    up: Tensor<D>,
    round: Option<DType>,
) -> (Tensor<D>, Option<Tensor<D>>) {
    let primitives = (gate.clone().try_into_primitive::<Cube>(), up.clone().try_into_primitive::<Cube>());
    let (Ok(gp), Ok(up_p)) = primitives else {
        return (burn::tensor::activation::silu(gate) * up, None);
    };
    let (out, rounded) = forward_rounded(gp, up_p, round);
    (Tensor::from_primitive::<Cube>(out), rounded.map(Tensor::from_primitive::<Cube>))
}

/// The gate's launch: `silu(gate) * up` into a new contiguous tensor.
fn forward(gate: Primitive, up: Primitive) -> Primitive {
    forward_rounded(gate, up, None).0
}

/// [`forward`], and given `round` the output rounded to it, from the same launch.
fn forward_rounded(gate: Primitive, up: Primitive, round: Option<DType>) -> (Primitive, Option<Primitive>) {
    let (gate, up) = (untile(gate), untile(up));
    let out = empty_like(&gate);
    let (rounded, rounded_type, writes) = rounded_output(&gate, gate.meta.shape().clone(), round);
    let count = gate.meta.shape().num_elements();
    if count > 0 {
        let (cube_count, cube_dim) = elementwise_launch(&gate, count);
        let client = gate.client.clone();
        kernel::swiglu_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rounded.clone().into_tensor_arg(),
            writes,
            rounded_type,
        );
    }
    (out, writes.then_some(rounded))
}

/// `silu(gate) * up` with `[gate, up]` the halves of `gate_up`'s last dimension, each plus its
/// adapter delta when given, for f32 tensors under autodiff on a cubecl device
/// ([`super::takes_tracked`]); its backward is one kernel ([`StackedBackward`]). `None`, with
/// nothing run, when the tensors are not of that form. A missing delta of two counts as zero.
///
/// # Shapes
/// `gate_up`: `[..., 2 width]`, `delta_gate`, `delta_up`: `[..., width]` -> `[..., width]`
/// (contiguous)
pub fn swiglu_stacked_tracked<const D: usize>(
    gate_up: &Tensor<D>,
    delta_gate: Option<&Tensor<D>>,
    delta_up: Option<&Tensor<D>>,
) -> Option<Tensor<D>> {
    if delta_gate.is_none() && delta_up.is_none() {
        return apply_tracked(Stacked, [gate_up.clone()]);
    }
    let mut half = gate_up.dims();
    half[D - 1] /= 2;
    let zeros = || Tensor::<D>::zeros(half, &gate_up.device());
    let delta = |d: Option<&Tensor<D>>| d.cloned().unwrap_or_else(zeros);
    apply_tracked(Stacked, [gate_up.clone(), delta(delta_gate), delta(delta_up)])
}

/// The stacked gate, as an autodiff node over the stacked product (and the two deltas).
#[derive(Clone, Copy, Debug)]
struct Stacked;

/// The gate and `up` halves of a stacked product (views, not copies, where the alignment allows).
fn halves(gate_up: Primitive) -> (Primitive, Primitive) {
    let gate_up = untile(gate_up);
    let width = gate_up.meta.shape().as_slice().last().copied().unwrap_or(0) / 2;
    (last_dim_slice(&gate_up, 0, width), last_dim_slice(&gate_up, width, width))
}

impl TrackedOp<1> for Stacked {
    fn apply<C: CheckpointStrategy>(self, [ga]: [FloatTensor<Autodiff<Cube, C>>; 1]) -> FloatTensor<Autodiff<Cube, C>> {
        let node = ga.node();
        let (gate, up) = halves(ga.into_primitive());
        let out = forward(gate.clone(), up.clone());
        match StackedBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(Saved { gate, up }, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

impl TrackedOp<3> for Stacked {
    fn apply<C: CheckpointStrategy>(
        self,
        [ga, dg, du]: [FloatTensor<Autodiff<Cube, C>>; 3],
    ) -> FloatTensor<Autodiff<Cube, C>> {
        let parents = [ga.node(), dg.node(), du.node()];
        let (gate, up) = halves(ga.into_primitive());
        let (gate, up) = (add(gate, dg.into_primitive()), add(up, du.into_primitive()));
        let out = forward(gate.clone(), up.clone());
        match StackedDeltaBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(Saved { gate, up }, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// What the stacked gate's backward reads: the gate and `up` as the forward read them.
#[derive(Clone, Debug)]
struct Saved {
    gate: Primitive,
    up: Primitive,
}

/// The stacked product's gradient `[..., 2 width]` for the gate's gradient `grad` `[..., width]`,
/// in one kernel.
fn stacked_gradient(Saved { gate, up }: Saved, grad: Primitive) -> Primitive {
    let grad = into_contiguous(untile(grad));
    let mut dims = grad.meta.shape().as_slice().to_vec();
    let count: usize = dims.iter().product();
    if let Some(last) = dims.last_mut() {
        *last *= 2;
    }
    let d_gate_up = empty_of(&grad, Shape::from(dims));
    if count > 0 {
        let (cube_count, cube_dim) = elementwise_launch(&grad, count);
        let client = grad.client.clone();
        kernel::swiglu_backward_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            grad.into_tensor_arg(),
            d_gate_up.clone().into_tensor_arg(),
        );
    }
    d_gate_up
}

/// The backward of the stacked gate without deltas.
#[derive(Debug)]
struct StackedBackward;

impl Backward<Cube, 1> for StackedBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        if let Some(node) = node {
            grads.register::<Cube>(node.id, stacked_gradient(ops.state, grad));
        }
    }
}

/// The backward of the stacked gate with its deltas: each delta's gradient is its half of the
/// stacked product's.
#[derive(Debug)]
struct StackedDeltaBackward;

impl Backward<Cube, 3> for StackedDeltaBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_gate_up, node_gate, node_up] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        if node_gate_up.is_none() && node_gate.is_none() && node_up.is_none() {
            return;
        }
        let d_gate_up = stacked_gradient(ops.state, grad);
        let (d_gate, d_up) = halves(d_gate_up.clone());
        if let Some(node) = node_gate {
            grads.register::<Cube>(node.id, d_gate);
        }
        if let Some(node) = node_up {
            grads.register::<Cube>(node.id, d_up);
        }
        if let Some(node) = node_gate_up {
            grads.register::<Cube>(node.id, d_gate_up);
        }
    }
}
