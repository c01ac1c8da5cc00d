//! The two-part attention under autodiff (the update's scoring of a group's replies) as one
//! autodiff node over the queries, the prompts' keys and values and each row's own.
//!
//! Differentiated operation by operation, the attention would keep its scores, probabilities
//! and the softmax's intermediates, `[rows, kv_heads, folded, prompt + reply]` each, for every
//! layer until the backward; the copied cache's attention keeps the probabilities and every
//! row's copy of its prompt's keys and values. This node keeps only its inputs (each prompt's
//! keys and values once per group) and recomputes the probabilities in its backward (two
//! products and the masked softmax, as FlashAttention's backward does), then
//!
//! - `d own_v = p_own^T do`, `d prompt_v = p_prompt^T do` summed over each group's rows,
//! - `dp = do v^T` for both parts, `ds = scale p (dp - rowsum(p dp))` over the joined keys,
//! - `dq = ds_prompt prompt_k + ds_own own_k`, `d prompt_k = ds_prompt^T q` summed over each
//!   group's rows, `d own_k = ds_own^T q`.
//!
//! The products against a group's prompt are batched over the group's rows with the prompt
//! broadcast to them (no copy of it, nor of the rows side by side); those that sum over a
//! group's rows sum the rows' products after, a place of the group layout that repeats a row
//! (a group short of the widest) left out, so each row counts once. On a GPU the softmax and its
//! backward are troupe's kernels; elsewhere burn's operations.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex};
use burn::tensor::{Bool, Tensor};

use super::{GroupLayout, TwoParts};

/// A backend the node runs on: its float primitives to and from burn's tensors.
trait Inner: Backend {
    fn wrap(primitive: FloatTensor<Self>) -> Tensor<4>;
    fn unwrap(tensor: Tensor<4>) -> FloatTensor<Self>;
    /// `primitive` in the layout the node's products read without a copy of their own: a
    /// view (the values' heads swapped out of the projection's rows) copied once here, where
    /// each product reading it would copy it again. The CPU's products read any layout.
    fn settled(primitive: FloatTensor<Self>) -> FloatTensor<Self> {
        primitive
    }
}

impl Inner for Flex {
    fn wrap(primitive: FloatTensor<Self>) -> Tensor<4> {
        Tensor::from_primitive::<Flex>(primitive)
    }
    fn unwrap(tensor: Tensor<4>) -> FloatTensor<Self> {
        tensor.try_into_primitive::<Flex>().expect("the attention's operations stay on the CPU")
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl Inner for burn::backend::Cube {
    fn wrap(primitive: FloatTensor<Self>) -> Tensor<4> {
        Tensor::from_primitive::<burn::backend::Cube>(primitive)
    }
    fn unwrap(tensor: Tensor<4>) -> FloatTensor<Self> {
        tensor.try_into_primitive::<burn::backend::Cube>().expect("the attention's operations stay on their device")
    }
    fn settled(primitive: FloatTensor<Self>) -> FloatTensor<Self> {
        burn_cubecl::kernel::into_contiguous(primitive)
    }
}

/// [`super::attend`] under autodiff: `inputs` (`[q, prompt_k, prompt_v, own_k, own_v]`, the
/// queries folded) as one node. `None`, with nothing run, when they are not f32 autodiff
/// tensors of one backend the node runs on.
///
/// # Shapes
/// as [`TwoParts::forward`]
pub(super) fn attend(parts: &TwoParts<'_>, inputs: &[Tensor<4>; 5]) -> Option<Tensor<4>> {
    if inputs.iter().any(|t| t.dtype() != burn::tensor::DType::F32) {
        return None;
    }
    let owned = Owned {
        groups: parts.groups.without_autodiff(),
        mask: parts.mask.clone().without_autodiff(),
        scale: parts.scale,
    };
    // burn converts to each backend and checkpointing strategy by name, not generically.
    macro_rules! on {
        ($inner:ty, $strategy:ty) => {{
            type Tracked = Autodiff<$inner, $strategy>;
            let primitives: Option<Vec<_>> =
                inputs.iter().map(|t| t.clone().try_into_primitive::<Tracked>().ok()).collect();
            if let Some(Ok(primitives)) = primitives.map(<[_; 5]>::try_from) {
                return Some(Tensor::from_primitive::<Tracked>(apply::<$inner, $strategy>(owned, primitives)));
            }
        }};
    }
    on!(Flex, NoCheckpointing);
    on!(Flex, BalancedCheckpointing);
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        on!(burn::backend::Cube, NoCheckpointing);
        on!(burn::backend::Cube, BalancedCheckpointing);
    }
    None
}

/// [`TwoParts`] with what it borrows owned, without autodiff: what the node keeps.
#[derive(Clone, Debug)]
struct Owned {
    groups: GroupLayout,
    /// `[rows, 1, seq, prompt + reply]` (`true`: hidden)
    mask: Tensor<4, Bool>,
    scale: f32,
}

impl Owned {
    fn parts(&self) -> TwoParts<'_> {
        TwoParts { groups: &self.groups, mask: &self.mask, scale: self.scale }
    }
}

/// The forward on the inner backend and the node that differentiates it.
fn apply<B: Inner, C: CheckpointStrategy>(
    owned: Owned,
    inputs: [FloatTensor<Autodiff<B, C>>; 5],
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = inputs.each_ref().map(|t| t.node());
    let plain = inputs.map(|t| B::wrap(B::settled(t.into_primitive())));
    let out = B::unwrap(owned.parts().forward(&plain));
    match <SharedAttentionBackward as Backward<B, 5>>::prepare::<C>(SharedAttentionBackward, nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(Saved { owned, inputs: plain }, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// What the backward reads: the inputs, the layout, the mask.
#[derive(Clone, Debug)]
struct Saved {
    owned: Owned,
    /// `[q, prompt_k, prompt_v, own_k, own_v]`, as [`TwoParts::forward`] takes them.
    inputs: [Tensor<4>; 5],
}

/// The backward of the two-part attention.
#[derive(Debug)]
struct SharedAttentionBackward;

impl<B: Inner> Backward<B, 5> for SharedAttentionBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_prompt_k, node_prompt_v, node_own_k, node_own_v] = ops.parents;
        let grad = B::wrap(grads.consume::<B>(&ops.node));
        let Saved { owned, inputs: [q, prompt_k, prompt_v, own_k, own_v] } = ops.state;
        let parts = owned.parts();
        let groups = parts.groups;
        let prompt_len = prompt_k.dims()[2];
        let keys = prompt_len + own_k.dims()[2];
        let probs = parts.probabilities(&q, &prompt_k, &own_k);
        let (p_prompt, p_own) =
            (probs.clone().narrow(3, 0, prompt_len), probs.clone().narrow(3, prompt_len, keys - prompt_len));
        // Each group's rows along a dimension of their own, its prompt broadcast over them.
        let grad_grouped = groups.grouped(grad.clone());
        if let Some(node) = node_own_v {
            grads.register::<B>(node.id, B::unwrap(p_own.clone().swap_dims(2, 3).matmul(grad.clone())));
        }
        if let Some(node) = node_prompt_v {
            let per_row = groups.grouped(p_prompt).swap_dims(3, 4).matmul(grad_grouped.clone());
            grads.register::<B>(node.id, B::unwrap(groups.sum_over_group(per_row)));
        }
        if node_q.is_none() && node_prompt_k.is_none() && node_own_k.is_none() {
            return;
        }
        let prompt_v = GroupLayout::per_group(prompt_v).swap_dims(3, 4);
        let dp_prompt = groups.ungrouped(grad_grouped.matmul(prompt_v));
        let dp_own = grad.matmul(own_v.swap_dims(2, 3));
        let ds = softmax_grad(probs, Tensor::cat(vec![dp_prompt, dp_own], 3), parts.scale);
        let (ds_prompt, ds_own) = (ds.clone().narrow(3, 0, prompt_len), ds.narrow(3, prompt_len, keys - prompt_len));
        let ds_prompt = groups.grouped(ds_prompt);
        if let Some(node) = node_q {
            let from_prompt = groups.ungrouped(ds_prompt.clone().matmul(GroupLayout::per_group(prompt_k)));
            grads.register::<B>(node.id, B::unwrap(from_prompt + ds_own.clone().matmul(own_k)));
        }
        if let Some(node) = node_prompt_k {
            let per_row = ds_prompt.swap_dims(3, 4).matmul(groups.grouped(q.clone()));
            grads.register::<B>(node.id, B::unwrap(groups.sum_over_group(per_row)));
        }
        if let Some(node) = node_own_k {
            grads.register::<B>(node.id, B::unwrap(ds_own.swap_dims(2, 3).matmul(q)));
        }
    }
}

/// The scores' gradient from the probabilities `p` and their gradient `dp`:
/// `scale * p * (dp - rowsum(p * dp))` (one kernel on a GPU). Hidden keys have `p = 0`.
///
/// # Shapes
/// `p`, `dp`: `[rows, kv_heads, folded, keys]` -> like `p`
fn softmax_grad(p: Tensor<4>, dp: Tensor<4>, scale: f32) -> Tensor<4> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if crate::model::fused::gpu::takes(&p) {
        return crate::model::fused::gpu::softmax_grad(p, dp, scale);
    }
    let dot = (p.clone() * dp.clone()).sum_dim(3);
    p * (dp - dot) * scale
}
