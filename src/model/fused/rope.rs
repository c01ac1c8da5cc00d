//! Rotary position embedding (`x cos + rotate_half(x) sin`) as one parallel pass forward and
//! one backward.
//!
//! burn's composite (two narrows, a negation, a concatenation, two products and a sum, and the
//! backward of each) makes about a dozen single-threaded passes over the queries and keys per
//! layer. The arithmetic here is the composite's, product for product: each output is
//! `x[j] cos[j] + r[j] sin[j]` with `r` the rotated half (a negation is exact), and each input
//! gradient `g[j] cos[j]` plus its one rotated term (the composite's other terms are the exact
//! zeros of its padding). So values and gradients equal burn's bit for bit (tested).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::{Tensor, TensorData};

use super::{on_flex, par_rows};

/// The fused rotary embedding, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait RopeBackend: burn::backend::Backend {
    /// `x cos + rotate_half(x) sin`, differentiable in `x` only.
    ///
    /// # Shapes
    /// `x`: `[batch, heads, seq, head_dim]`, `cos`/`sin`: `[batch, 1, seq, head_dim]` -> like `x`
    fn rope(x: FloatTensor<Self>, cos: FloatTensor<Self>, sin: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// A 4-D f32 tensor whose last dimension is contiguous: its values and the strides of the
/// first three dimensions.
struct Rows4<'a> {
    values: &'a [f32],
    offset: usize,
    strides: [usize; 3],
}

impl<'a> Rows4<'a> {
    /// The view, or `None` for a layout with a strided last dimension or negative strides.
    fn of(tensor: &'a FlexTensor) -> Option<Self> {
        let layout = tensor.layout();
        let s = layout.strides();
        if s.len() != 4 || s[3] != 1 || !layout.has_positive_strides() {
            return None;
        }
        Some(Self {
            values: tensor.storage::<f32>(),
            offset: layout.start_offset(),
            strides: [s[0] as usize, s[1] as usize, s[2] as usize],
        })
    }

    /// The `width` values at `[b, h, t, ..]`.
    fn row(&self, b: usize, h: usize, t: usize, width: usize) -> &'a [f32] {
        let start = self.offset + b * self.strides[0] + h * self.strides[1] + t * self.strides[2];
        &self.values[start..start + width]
    }
}

/// Applies `f(b, h, t, out_row)` to every `[b, h, t]` row of a new `[batch, heads, seq, dim]`
/// buffer, in parallel.
fn map_rows(dims: [usize; 4], f: impl Fn(usize, usize, usize, &mut [f32]) + Sync) -> Vec<f32> {
    let [batch, heads, seq, dim] = dims;
    let mut out = vec![0.0f32; batch * heads * seq * dim];
    par_rows(&mut out, dim, |r, row| f(r / (heads * seq), (r / seq) % heads, r % seq, row));
    out
}

/// Runs `f` with row views of `x`, `cos` and `sin` (copied to contiguous first if need be).
fn with_views<R>(x: &FlexTensor, cos: &FlexTensor, sin: &FlexTensor, f: impl FnOnce(&Rows4, &Rows4, &Rows4) -> R) -> R {
    let own = |t: &FlexTensor| if Rows4::of(t).is_some() { t.clone() } else { t.to_contiguous() };
    let (x, cos, sin) = (own(x), own(cos), own(sin));
    let view = |t| Rows4::of(t).expect("a contiguous tensor has row views");
    f(&view(&x), &view(&cos), &view(&sin))
}

fn forward(x: &FlexTensor, cos: &FlexTensor, sin: &FlexTensor) -> FlexTensor {
    let dims = x.layout().shape().dims::<4>();
    let (dim, half) = (dims[3], dims[3] / 2);
    let values = with_views(x, cos, sin, |xv, cv, sv| {
        map_rows(dims, |b, h, t, out| {
            let (x, c, s) = (xv.row(b, h, t, dim), cv.row(b, 0, t, dim), sv.row(b, 0, t, dim));
            for j in 0..dim {
                let rotated = if j < half { -x[j + half] } else { x[j - half] };
                out[j] = x[j] * c[j] + rotated * s[j];
            }
        })
    });
    FlexTensor::from_data(TensorData::new(values, dims.to_vec()))
}

impl RopeBackend for Flex {
    fn rope(x: FlexTensor, cos: FlexTensor, sin: FlexTensor) -> FlexTensor {
        forward(&x, &cos, &sin)
    }
}

/// The backward of [`RopeBackend::rope`]: the gradient of `x`.
#[derive(Debug)]
struct RopeBackward;

impl Backward<Flex, 1> for RopeBackward {
    /// The tables.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let Some(node) = node_x else { return };
        let (cos, sin) = ops.state;
        let dims = grad.layout().shape().dims::<4>();
        let (dim, half) = (dims[3], dims[3] / 2);
        let values = with_views(&grad, &cos, &sin, |gv, cv, sv| {
            map_rows(dims, |b, h, t, out| {
                let (g, c, s) = (gv.row(b, h, t, dim), cv.row(b, 0, t, dim), sv.row(b, 0, t, dim));
                for j in 0..dim {
                    // x[j] feeds output j directly and output j -/+ half through the rotation.
                    let rotated = if j < half { g[j + half] * s[j + half] } else { -(g[j - half] * s[j - half]) };
                    out[j] = g[j] * c[j] + rotated;
                }
            })
        });
        grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(values, dims.to_vec())));
    }
}

impl<C: CheckpointStrategy> RopeBackend for Autodiff<Flex, C> {
    fn rope(x: FloatTensor<Self>, cos: FloatTensor<Self>, sin: FloatTensor<Self>) -> FloatTensor<Self> {
        let (cos, sin) = (cos.primitive().clone(), sin.primitive().clone());
        match RopeBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = forward(x.primitive(), &cos, &sin);
                prep.finish((cos, sin), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(&x.into_primitive(), &cos, &sin)),
        }
    }
}

/// `x cos + rotate_half(x) sin` (rotate-half layout): fused on the CPU, one kernel on a GPU
/// ([`super::gpu::rope`], within the last bit of burn's; under autodiff
/// [`super::gpu::rope_tracked`], its backward one kernel too), burn's ops elsewhere; the same
/// values on the CPU either way. Differentiable in `x` (the tables are constants).
///
/// # Shapes
/// `x`: `[batch, heads, seq, head_dim]`, `cos`/`sin`: `[batch, 1, seq, head_dim]` -> like `x`
pub fn rope(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    let [batch, _, seq, dim] = x.dims();
    let fits = cos.dims() == [batch, 1, seq, dim] && sin.dims() == cos.dims() && dim % 2 == 0;
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if fits && [&x, cos, sin].into_iter().all(super::gpu::takes) {
        return super::gpu::rope(x, cos, sin);
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if fits && super::gpu::takes_tracked(&x) {
        return super::gpu::rope_tracked(x, cos, sin);
    }
    if !on_flex(&x) || !fits {
        return composite(x, cos, sin);
    }
    Tensor::from_dispatch(<Dispatch as RopeBackend>::rope(
        x.into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
    ))
}

/// The per-head RMS norm (Qwen3's queries and keys) and then the rotary embedding, heads first:
/// `rope(rms_norm(x, weight, eps).swap_dims(1, 2), cos, sin)`, as one kernel on a GPU without
/// gradients ([`super::gpu::rms_norm_rope`]) with the values of the two apart, and as those two
/// elsewhere.
///
/// # Shapes
/// `x`: `[batch, seq, heads, head_dim]` (`head_dim` even), `weight`: `[head_dim]`,
/// `cos`/`sin`: `[batch, 1, seq, head_dim]` -> `[batch, heads, seq, head_dim]`
pub fn rms_norm_rope(x: Tensor<4>, weight: &Tensor<1>, eps: f64, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if [&x, cos, sin].into_iter().all(super::gpu::takes) && super::gpu::takes(weight) {
        if let Some(out) = super::gpu::rms_norm_rope(&x, weight, eps, cos, sin) {
            return out;
        }
    }
    rope(super::rms_norm(x, weight, eps).swap_dims(1, 2), cos, sin)
}

/// [`rms_norm_rope`] of a layer's queries and of its keys, each with its norm's weight and
/// `eps`: one kernel launch for both on a GPU without gradients (when the two norms' `eps`
/// agree), the two calls elsewhere.
///
/// # Shapes
/// `q`: `[batch, seq, heads, head_dim]`, `k`: `[batch, seq, kv_heads, head_dim]`, weights
/// `[head_dim]`, `cos`/`sin`: `[batch, 1, seq, head_dim]` -> `[batch, heads, seq, head_dim]`,
/// `[batch, kv_heads, seq, head_dim]`
pub fn rms_norm_rope_pair(
    (q, q_weight, q_eps): (Tensor<4>, &Tensor<1>, f64),
    (k, k_weight, k_eps): (Tensor<4>, &Tensor<1>, f64),
    cos: &Tensor<4>,
    sin: &Tensor<4>,
) -> (Tensor<4>, Tensor<4>) {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if q_eps == k_eps
        && [&q, &k, cos, sin].into_iter().all(super::gpu::takes)
        && [q_weight, k_weight].into_iter().all(super::gpu::takes)
    {
        if let Some(pair) = super::gpu::rms_norm_rope_pair((&q, q_weight), (&k, k_weight), q_eps, cos, sin) {
            return pair;
        }
    }
    (rms_norm_rope(q, q_weight, q_eps, cos, sin), rms_norm_rope(k, k_weight, k_eps, cos, sin))
}

/// burn's composite rotary embedding: two narrows, a negation, a concatenation, two products
/// and a sum.
///
/// # Shapes
/// `x`: `[batch, heads, seq, head_dim]`, `cos`/`sin`: broadcastable to `x` -> like `x`
pub fn composite(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    let half = x.dims()[3] / 2;
    let first = x.clone().narrow(3, 0, half);
    let second = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![second.neg(), first], 3);
    x * cos.clone() + rotated * sin.clone()
}
