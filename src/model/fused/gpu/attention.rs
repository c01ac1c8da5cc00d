//! Masked grouped-query attention without gradients as two products around one softmax kernel.
//!
//! burn's materialized attention is the two products and nine kernels between them (the scale,
//! the mask, a max, a clamp of the max, the shift, the exponential, a sum, a clamp of the sum,
//! the division: `burn_backend`'s `attention_fallback`), and the grouped-query heads' boolean
//! mask is repeated for the folded query rows (a copy). Here one cube takes one row of scores:
//! its units scale it, hide the masked keys, reduce the row's maximum and the sum of the
//! exponentials in shared memory, and write the probabilities; a row that sees no key gets zeros,
//! as burn's clamps give. The mask is read through its strides, each score row's mask row being
//! its row modulo the mask's rows, so the folded heads share the mask as it is. The values are
//! burn's (the same products, the same scale, exponential and division); the sums run in another
//! order.
//!
//! Under autodiff (the update) the same forward is one autodiff node over the queries, keys and
//! values ([`attention_tracked`]) that keeps only them and the mask: its backward recomputes the
//! probabilities (the scores' product and the softmax kernel, as FlashAttention's backward does,
//! so no `[rows, heads, seq, keys]` tensor is held between a layer's forward and its backward),
//! then four products around one kernel: `dv = p^T do`, `dp = do v^T`,
//! `ds = scale p (dp - rowsum(p dp))` (the kernel, one cube a row), `dq = ds k`, `dk = ds^T q`.
//! burn differentiates its composite one operation at a time, keeping each of the nine kernels'
//! intermediates, and repeats the mask.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Cube};
use burn::tensor::{Bool, Tensor};
use burn_cubecl::cubecl::ir::ElemType;
use burn_cubecl::kernel::{into_contiguous, untile};

use super::{apply_tracked, empty_like, into_primitive, row_launch, Primitive, TrackedOp};

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{cube_reduce, cube_row};

    /// One cube per row of `scores` (`[batch, heads, rows, keys]`, any strides): `out`
    /// (contiguous, `scores`' shape) gets `softmax(scores * scale)` over the keys the mask
    /// (`[batch or 1, 1, mask rows, keys]`, nonzero where hidden, any strides) leaves visible,
    /// zeros where it hides every key. Score row `r` reads mask row `r % mask rows`. `units` is
    /// the cube's size, a power of two.
    #[cube(launch, create_dummy_kernel)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn masked_softmax_kernel<M: Numeric>(
        scores: &Tensor<f32>,
        mask: &Tensor<M>,
        out: &mut Tensor<f32>,
        rows: usize,
        scale: f32,
        #[comptime] units: usize,
        #[define(M)] _mask_type: ElemType,
    ) {
        let row = cube_row();
        let unit = UNIT_POS_X as usize;
        let stride = CUBE_DIM_X as usize;
        // Every unit of a cube takes the same branch, so the barriers below stay uniform.
        if row < rows {
            let keys = scores.shape(3);
            let r = row % scores.shape(2);
            let h = (row / scores.shape(2)) % scores.shape(1);
            let b = row / (scores.shape(2) * scores.shape(1));
            let start = b * scores.stride(0) + h * scores.stride(1) + r * scores.stride(2);
            let step = scores.stride(3);
            let mask_start = (b % mask.shape(0)) * mask.stride(0)
                + (h % mask.shape(1)) * mask.stride(1)
                + (r % mask.shape(2)) * mask.stride(2);
            let mask_step = mask.stride(3);
            let hidden = M::from_int(0);

            // The largest visible score (f32::MIN while none is).
            let lowest = f32::new(-3.402_823_5e38f32);
            let mut largest = lowest;
            let mut i = unit;
            while i < keys {
                if mask[mask_start + i * mask_step] == hidden {
                    largest = max(largest, scores[start + i * step] * scale);
                }
                i += stride;
            }
            let mut partial = Shared::<[f32]>::new_slice(units);
            let row_max = cube_reduce(&mut partial, largest, true);

            let mut sum = 0.0f32;
            let mut i = unit;
            while i < keys {
                if mask[mask_start + i * mask_step] == hidden {
                    sum += f32::exp(scores[start + i * step] * scale - row_max);
                }
                i += stride;
            }
            let total = cube_reduce(&mut partial, sum, false);

            let mut i = unit;
            while i < keys {
                let visible = mask[mask_start + i * mask_step] == hidden && total > 0.0;
                let p = if visible { f32::exp(scores[start + i * step] * scale - row_max) / total } else { 0.0f32 };
                out[row * keys + i] = p;
                i += stride;
            }
        }
    }

    /// The softmax's backward, one cube per row of `p` (contiguous `[rows, keys]`, the forward's
    /// probabilities): `ds` (contiguous, `p`'s shape) gets `scale * p * (dp - sum(p * dp))` for
    /// the probabilities' gradient `dp` (contiguous, `p`'s shape). Hidden keys have `p = 0`, so
    /// their gradient is zero. `units` is the cube's size, a power of two.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn softmax_backward_kernel(
        p: &Tensor<f32>,
        dp: &Tensor<f32>,
        ds: &mut Tensor<f32>,
        rows: usize,
        keys: usize,
        scale: f32,
        #[comptime] units: usize,
    ) {
        let row = cube_row();
        let unit = UNIT_POS_X as usize;
        let stride = CUBE_DIM_X as usize;
        // Every unit of a cube takes the same branch, so the barrier below stays uniform.
        if row < rows {
            let start = row * keys;
            let mut dot = 0.0f32;
            let mut i = unit;
            while i < keys {
                dot += p[start + i] * dp[start + i];
                i += stride;
            }
            let mut partial = Shared::<[f32]>::new_slice(units);
            let total = cube_reduce(&mut partial, dot, false);
            let mut i = unit;
            while i < keys {
                ds[start + i] = scale * p[start + i] * (dp[start + i] - total);
                i += stride;
            }
        }
    }
}

/// Whether [`attention`] runs here: plain f32 queries, keys and values on a cubecl device
/// ([`super::takes`]) and a mask stored as integers.
pub fn applies(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>, mask: &Tensor<4, Bool>) -> bool {
    [q, k, v].into_iter().all(super::takes) && integer_mask(mask)
}

/// Whether `mask` is stored as integers, the form the softmax kernel reads.
pub(super) fn integer_mask(mask: &Tensor<4, Bool>) -> bool {
    matches!(dtype_to_storage_type(mask.dtype()), ElemType::UInt(_))
}

/// Masked grouped-query attention, scale `1 / sqrt(head_dim)`: the query heads of each
/// key/value head folded into its rows (`fused::attention`'s `fold_query_heads`), the scores'
/// product, [`masked_softmax`] reading the mask as it is, the values' product. For tensors
/// [`applies`] accepts; burn's materialized attention otherwise.
///
/// # Shapes
/// `q`: `[batch, heads, seq, head_dim]`, `k`/`v`: `[batch, kv_heads, keys, head_dim]`, `mask`:
/// `[batch, 1, seq, keys]` (`true`: hidden) -> `[batch, heads, seq, head_dim]`
pub fn attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: &Tensor<4, Bool>) -> Tensor<4> {
    let scale = (1.0 / (q.dims()[3] as f64).sqrt()) as f32;
    super::super::attention::fold_query_heads(q, k, v, |q, k, v, _group| {
        masked_softmax(q.matmul(k.transpose()), mask, scale).matmul(v)
    })
}

/// `softmax(scores * scale)` over the keys `mask` leaves visible, one kernel launch.
///
/// # Shapes
/// `scores`: `[batch, heads, rows, keys]`, `mask`: `[batch, 1, mask_rows, keys]` with `rows` a
/// multiple of `mask_rows` (score row `r` reads mask row `r % mask_rows`) -> like `scores`
pub fn masked_softmax(scores: Tensor<4>, mask: &Tensor<4, Bool>, scale: f32) -> Tensor<4> {
    let [batch, heads, rows, keys] = scores.dims();
    let primitives = (scores.clone().try_into_primitive::<Cube>(), mask.clone().try_into_primitive::<Cube>());
    let (Ok(sp), Ok(mp), true) = (primitives.0, primitives.1, integer_mask(mask)) else {
        let hidden = mask.clone().repeat_dim(2, rows / mask.dims()[2]);
        return burn::tensor::activation::softmax((scores * scale).mask_fill(hidden, f32::NEG_INFINITY), 3);
    };
    let (sp, mp) = (untile(sp), untile(mp));
    let mask_type = dtype_to_storage_type(mp.dtype);
    let out = empty_like(&sp);
    let all_rows = batch * heads * rows;
    if all_rows == 0 || keys == 0 {
        return Tensor::from_primitive::<Cube>(out);
    }
    let (count, cube_dim, units) = row_launch(all_rows, keys);
    let client = sp.client.clone();
    kernel::masked_softmax_kernel::launch(
        &client,
        count,
        cube_dim,
        sp.into_tensor_arg(),
        mp.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        all_rows,
        scale,
        units,
        mask_type,
    );
    Tensor::from_primitive::<Cube>(out)
}

/// [`attention`] for f32 queries, keys and values under autodiff on a cubecl device
/// ([`super::takes_tracked`]), one autodiff node whose backward is four products and one kernel
/// ([`AttendBackward`]). `None`, with nothing run, when the tensors are not of that form or the
/// mask is not stored as integers. The mask takes no gradient.
///
/// # Shapes
/// `q`: `[batch, heads, seq, head_dim]`, `k`/`v`: `[batch, kv_heads, keys, head_dim]`, `mask`:
/// `[batch, 1, seq, keys]` (`true`: hidden) -> `[batch, heads, seq, head_dim]`
pub fn attention_tracked(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>, mask: &Tensor<4, Bool>) -> Option<Tensor<4>> {
    let mask = mask.clone().without_autodiff();
    if !integer_mask(&mask) || mask.clone().try_into_primitive::<Cube>().is_err() {
        return None;
    }
    let [batch, heads, seq, head_dim] = q.dims();
    let kv_heads = k.dims()[1];
    if kv_heads == 0 || heads % kv_heads != 0 {
        return None;
    }
    let scale = (1.0 / (head_dim as f64).sqrt()) as f32;
    // `fused::attention`'s folding: query head `h` reads key/value head `h / group`.
    let folded = q.clone().reshape([batch, kv_heads, heads / kv_heads * seq, head_dim]);
    let out = apply_tracked(Attend { mask, scale }, [folded, k.clone(), v.clone()])?;
    Some(out.reshape([batch, heads, seq, head_dim]))
}

/// The attention as an autodiff node over the (folded) queries, keys and values.
#[derive(Clone, Debug)]
struct Attend {
    /// `[batch, 1, seq, keys]`, without autodiff.
    mask: Tensor<4, Bool>,
    scale: f32,
}

/// A primitive as a plain tensor on its cubecl device.
fn plain(primitive: Primitive) -> Tensor<4> {
    Tensor::from_primitive::<Cube>(primitive)
}

impl TrackedOp<3> for Attend {
    fn apply<C: CheckpointStrategy>(
        self,
        [qa, ka, va]: [FloatTensor<Autodiff<Cube, C>>; 3],
    ) -> FloatTensor<Autodiff<Cube, C>> {
        let parents = [qa.node(), ka.node(), va.node()];
        let (q, k, v) = (plain(qa.into_primitive()), plain(ka.into_primitive()), plain(va.into_primitive()));
        let out = into_primitive(self.probabilities(&q, &k).matmul(v.clone()));
        match AttendBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(Saved { q, k, v, attend: self }, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

impl Attend {
    /// The attention's probabilities, the forward's and the backward's alike.
    ///
    /// # Shapes
    /// `q`: `[batch, kv_heads, rows, head_dim]`, `k`: `[batch, kv_heads, keys, head_dim]` ->
    /// `[batch, kv_heads, rows, keys]`, contiguous
    fn probabilities(&self, q: &Tensor<4>, k: &Tensor<4>) -> Tensor<4> {
        masked_softmax(q.clone().matmul(k.clone().transpose()), &self.mask, self.scale)
    }
}

/// What the attention's backward reads: its inputs and the mask.
#[derive(Clone, Debug)]
struct Saved {
    /// `[batch, kv_heads, rows, head_dim]` (the folded queries)
    q: Tensor<4>,
    /// `[batch, kv_heads, keys, head_dim]`
    k: Tensor<4>,
    /// `[batch, kv_heads, keys, head_dim]`
    v: Tensor<4>,
    attend: Attend,
}

/// The backward of [`Attend`].
#[derive(Debug)]
struct AttendBackward;

impl Backward<Cube, 3> for AttendBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = plain(grads.consume::<Cube>(&ops.node));
        let Saved { q, k, v, attend } = ops.state;
        let (p, scale) = (attend.probabilities(&q, &k), attend.scale);
        if let Some(node) = node_v {
            grads.register::<Cube>(node.id, into_primitive(p.clone().transpose().matmul(grad.clone())));
        }
        if node_q.is_none() && node_k.is_none() {
            return;
        }
        let ds = plain(softmax_backward(into_primitive(p), into_primitive(grad.matmul(v.transpose())), scale));
        if let Some(node) = node_q {
            grads.register::<Cube>(node.id, into_primitive(ds.clone().matmul(k)));
        }
        if let Some(node) = node_k {
            grads.register::<Cube>(node.id, into_primitive(ds.transpose().matmul(q)));
        }
    }
}

/// The scores' gradient `scale * p * (dp - rowsum(p * dp))` from plain f32 tensors on a cubecl
/// device ([`super::takes`]), one launch.
///
/// # Shapes
/// `p`, `dp`: `[batch, heads, rows, keys]` -> like `p` (contiguous)
pub fn softmax_grad(p: Tensor<4>, dp: Tensor<4>, scale: f32) -> Tensor<4> {
    plain(softmax_backward(into_primitive(p), into_primitive(dp), scale))
}

/// The scores' gradient `scale * p * (dp - rowsum(p * dp))`, one launch.
///
/// # Shapes
/// `p`, `dp`: `[batch, heads, rows, keys]` (`p` contiguous) -> like `p` (contiguous)
fn softmax_backward(p: Primitive, dp: Primitive, scale: f32) -> Primitive {
    let (p, dp) = (into_contiguous(untile(p)), into_contiguous(untile(dp)));
    let ds = empty_like(&p);
    let dims = p.meta.shape().as_slice();
    let keys = dims.last().copied().unwrap_or(0);
    let rows: usize = dims.iter().rev().skip(1).product();
    if rows == 0 || keys == 0 {
        return ds;
    }
    let (count, cube_dim, units) = row_launch(rows, keys);
    let client = p.client.clone();
    kernel::softmax_backward_kernel::launch(
        &client,
        count,
        cube_dim,
        p.into_tensor_arg(),
        dp.into_tensor_arg(),
        ds.clone().into_tensor_arg(),
        rows,
        keys,
        scale,
        units,
    );
    ds
}
