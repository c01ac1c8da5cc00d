//! The parts of a stacked frozen projection (queries, keys and values) under autodiff, each
//! with a backward of its own.
//!
//! burn differentiates a narrowed part by writing its gradient into a zeroed tensor the width
//! of the whole stacked product, and adds the parts' tensors before the product's backward: a
//! zero fill, a slice write and an add a part, each over `[rows, q + k + v]`. Here each part is
//! a node whose parent is the projection's input, and its backward is the part's own product
//! `dy_part W_part`, the weight's rows for the part read in place: the same FLOPs as the stacked
//! backward, and only the input's `[rows, hidden]` gradients are added.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Cube};
use burn::tensor::Tensor;
use burn_cubecl::kernel::untile;

use super::{apply_tracked, into_primitive, last_dim_slice, Primitive, TrackedOp};
use crate::model::fused::linear::dense_linear_backward;

/// The parts of `stacked`, the product of `x` and a frozen dense `weight` (any bias added),
/// along its last dimension, `widths` wide in turn; each part differentiable in `x` through its
/// own rows of `weight`. `None`, with nothing run, when `x` is not a tracked f32 tensor on a
/// cubecl device or `stacked` not a plain one there.
///
/// # Shapes
/// `x`: `[batch, seq, hidden]`, `stacked`: `[batch, seq, sum(widths)]` (computed without
/// autodiff), `weight`: `[sum(widths), hidden]` -> `[batch, seq, widths[i]]` each (views of
/// `stacked`)
pub fn stacked_parts_tracked(
    x: &Tensor<3>,
    stacked: Tensor<3>,
    weight: &Tensor<2>,
    widths: &[usize],
) -> Option<Vec<Tensor<3>>> {
    let stacked = untile(stacked.try_into_primitive::<Cube>().ok()?);
    let weight = weight.clone().without_autodiff();
    let mut start = 0;
    let mut parts = Vec::with_capacity(widths.len());
    for &width in widths {
        let part =
            Part { value: last_dim_slice(&stacked, start, width), weight: weight.clone().narrow(0, start, width) };
        parts.push(apply_tracked(part, [x.clone()])?);
        start += width;
    }
    Some(parts)
}

/// One part: its value (computed without autodiff) and its rows of the weight.
#[derive(Clone, Debug)]
struct Part {
    value: Primitive,
    weight: Tensor<2>,
}

impl TrackedOp<1> for Part {
    fn apply<C: CheckpointStrategy>(self, [xa]: [FloatTensor<Autodiff<Cube, C>>; 1]) -> FloatTensor<Autodiff<Cube, C>> {
        match PartBackward.prepare::<C>([xa.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(self.weight, self.value),
            OpsKind::UnTracked(prep) => prep.finish(self.value),
        }
    }
}

/// The backward of a [`Part`]: the input's gradient through the part's rows of the weight.
#[derive(Debug)]
struct PartBackward;

impl Backward<Cube, 1> for PartBackward {
    /// The part's rows of the weight.
    type State = Tensor<2>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Some(node) = node_x else { return };
        let grad = Tensor::<3>::from_primitive::<Cube>(grad);
        let [batch, seq, width] = grad.dims();
        let dx = dense_linear_backward(grad.reshape([batch * seq, width]), &ops.state);
        let hidden = dx.dims()[1];
        grads.register::<Cube>(node.id, into_primitive(dx.reshape([batch, seq, hidden])));
    }
}
