//! Root-mean-square norm `x / sqrt(mean(x^2) + eps) * w` over the last dimension, as one
//! parallel pass forward and one backward.
//!
//! burn's composite (square, mean, add, square root, reciprocal and two products, each with its
//! backward) makes about a dozen single-threaded passes over the residual stream per norm. Here
//! each row's mean square is summed in eight lanes and the row written once; the backward forms
//! `dx = r (g - n mean(g n))` with `n = x r`, `g = dy w` and `r = 1 / sqrt(mean(x^2) + eps)`
//! (and `dw = sum over rows of dy n` when the weight is differentiated). The sums run in another
//! order than burn's: values and gradients agree within float rounding (tested).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::{on_flex, par_rows, rows_per_task, with_rows, Rows};

/// The fused RMS norm, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait RmsNormBackend: burn::backend::Backend {
    /// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension.
    ///
    /// # Shapes
    /// `x`: `[..., width]`, `weight`: `[width]` -> like `x`
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self>;
}

/// `1 / sqrt(mean(row^2) + eps)`, the squares summed in eight lanes.
fn inverse_rms(row: &[f32], eps: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA, the only features the function enables.
        return unsafe { inverse_rms_avx2(row, eps) };
    }
    inverse_rms_impl(row, eps)
}

/// [`inverse_rms`] with the fused multiply-adds as instructions instead of `fmaf` calls (the
/// same values: a fused multiply-add rounds once either way) and the lanes in AVX registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn inverse_rms_avx2(row: &[f32], eps: f32) -> f32 {
    inverse_rms_impl(row, eps)
}

#[inline(always)]
fn inverse_rms_impl(row: &[f32], eps: f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = v.mul_add(v, *lane);
        }
    }
    let mut sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for &v in tail {
        sum = v.mul_add(v, sum);
    }
    1.0 / (sum / row.len() as f32 + eps).sqrt()
}

/// The weight's values.
fn weight_values(weight: &FlexTensor) -> Vec<f32> {
    with_rows(weight, |w: &Rows<'_>| w.row(0).to_vec())
}

/// The normed rows, and each row's `1 / rms`.
fn forward(x: &Rows<'_>, weight: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(weight.len(), x.width, "rms_norm: the weight's width");
    let inverse: Vec<f32> =
        (0..x.rows).into_par_iter().with_min_len(rows_per_task(x.width)).map(|r| inverse_rms(x.row(r), eps)).collect();
    let mut out = vec![0.0f32; x.rows * x.width];
    par_rows(&mut out, x.width, |r, row| {
        for ((o, &v), &w) in row.iter_mut().zip(x.row(r)).zip(weight) {
            *o = v * inverse[r] * w;
        }
    });
    (out, inverse)
}

impl RmsNormBackend for Flex {
    fn rms_norm(x: FlexTensor, weight: FlexTensor, eps: f32) -> FlexTensor {
        let shape = x.layout().shape().as_slice().to_vec();
        let weight = weight_values(&weight);
        let (out, _) = with_rows(&x, |rows: &Rows<'_>| forward(rows, &weight, eps));
        FlexTensor::from_data(TensorData::new(out, shape))
    }
}

/// What the backward needs: the input, the weight, each row's `1 / rms`.
#[derive(Clone, Debug)]
struct Saved {
    x: FlexTensor,
    weight: Vec<f32>,
    inverse: Vec<f32>,
}

/// The backward of [`RmsNormBackend::rms_norm`].
#[derive(Debug)]
struct RmsNormBackward;

impl Backward<Flex, 2> for RmsNormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let Saved { x, weight, inverse } = ops.state;
        let shape = x.layout().shape().as_slice().to_vec();
        let width = weight.len();
        with_rows(&x, |xs: &Rows<'_>| {
            with_rows(&grad, |dy: &Rows<'_>| {
                if let Some(node) = node_x {
                    let mut dx = vec![0.0f32; xs.rows * width];
                    par_rows(&mut dx, width, |r, out| {
                        let (x, dy, inv) = (xs.row(r), dy.row(r), inverse[r]);
                        // mean(g n) with g = dy w and n = x inv.
                        let dot: f32 = x.iter().zip(dy).zip(&weight).map(|((&x, &d), &w)| d * w * (x * inv)).sum();
                        let mean = dot / width as f32;
                        for (((o, &x), &d), &w) in out.iter_mut().zip(x).zip(dy).zip(&weight) {
                            *o = inv * (d * w - x * inv * mean);
                        }
                    });
                    grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(dx, shape.clone())));
                }
                if let Some(node) = node_w {
                    let dw = (0..xs.rows)
                        .into_par_iter()
                        .with_min_len(rows_per_task(width))
                        .fold(
                            || vec![0.0f32; width],
                            |mut acc, r| {
                                for ((a, &x), &d) in acc.iter_mut().zip(xs.row(r)).zip(dy.row(r)) {
                                    *a += d * x * inverse[r];
                                }
                                acc
                            },
                        )
                        .reduce(|| vec![0.0f32; width], |a, b| a.iter().zip(&b).map(|(x, y)| x + y).collect());
                    grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(dw, [width])));
                }
            })
        });
    }
}

impl<C: CheckpointStrategy> RmsNormBackend for Autodiff<Flex, C> {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        match RmsNormBackward.prepare::<C>([x.node(), weight.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (x, w) = (x.primitive().clone(), weight_values(weight.primitive()));
                let shape = x.layout().shape().as_slice().to_vec();
                let (out, inverse) = with_rows(&x, |rows: &Rows<'_>| forward(rows, &w, eps));
                prep.finish(Saved { x, weight: w, inverse }, FlexTensor::from_data(TensorData::new(out, shape)))
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::rms_norm(x.into_primitive(), weight.into_primitive(), eps)),
        }
    }
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension: fused on the CPU, one kernel
/// on a GPU without gradients ([`super::gpu::rms_norm`]), burn's composite elsewhere (and for any
/// dtype but f32).
///
/// # Shapes
/// `x`: `[..., width]`, `weight`: `[width]` -> like `x`
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: &Tensor<1>, eps: f64) -> Tensor<D> {
    if on_flex(&x) && x.dtype() == DType::F32 && weight.dtype() == DType::F32 {
        return Tensor::from_dispatch(<Dispatch as RmsNormBackend>::rms_norm(
            x.into_dispatch(),
            weight.clone().into_dispatch(),
            eps as f32,
        ));
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if super::gpu::takes(&x) && super::gpu::takes(weight) {
        return super::gpu::rms_norm(x, weight, eps);
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if super::gpu::takes_tracked(&x) && super::gpu::takes(weight) {
        return super::gpu::rms_norm_tracked(x, weight, eps);
    }
    composite(x, weight, eps)
}

/// The residual stream's sum `x + (y + extra)` (`extra`, when given, added to `y` first) and
/// its RMS norm: one kernel on a GPU without gradients ([`super::gpu::add_rms_norm`]), with the
/// values of the sums and the norm apart; the sums and [`rms_norm`] elsewhere.
///
/// # Shapes
/// `x`, `y`, `extra`: `[..., width]`, `weight`: `[width]` -> (the sum, its norm), like `x`
pub fn add_rms_norm<const D: usize>(
    x: Tensor<D>,
    y: Tensor<D>,
    extra: Option<Tensor<D>>,
    weight: &Tensor<1>,
    eps: f64,
) -> (Tensor<D>, Tensor<D>) {
    let (sum, normed, _) = add_rms_norm_rounded(x, y, extra, weight, eps, None);
    (sum, normed)
}

/// [`add_rms_norm`], and given `round` (the half precision of the frozen product the norm
/// feeds, [`crate::model::layers::FrozenLinear::input_rounding`]) the norm rounded to it, written
/// by the same kernel on a GPU; `None` for it where no kernel wrote it (the product then rounds
/// the norm itself).
///
/// # Shapes
/// `x`, `y`, `extra`: `[..., width]`, `weight`: `[width]` -> (the sum, its norm, the norm
/// rounded), like `x`
#[allow(clippy::type_complexity)]
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
pub fn add_rms_norm_rounded<const D: usize>(
    x: Tensor<D>,
    y: Tensor<D>,
    extra: Option<Tensor<D>>,
    weight: &Tensor<1>,
    eps: f64,
    round: Option<DType>,
) -> (Tensor<D>, Tensor<D>, Option<Tensor<D>>) {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if [&x, &y].into_iter().chain(extra.as_ref()).all(super::gpu::takes) && super::gpu::takes(weight) {
        if let Some(all) = super::gpu::add_rms_norm(&x, &y, extra.as_ref(), weight, eps, round) {
            return all;
        }
    }
    let y = match extra {
        Some(extra) => y + extra,
        None => y,
    };
    let sum = x + y;
    (sum.clone(), rms_norm(sum, weight, eps), None)
}

/// burn's composite RMS norm: square, mean, add, square root, reciprocal, two products.
///
/// # Shapes
/// `x`: `[..., width]`, `weight`: `[width]` -> like `x`
pub fn composite<const D: usize>(x: Tensor<D>, weight: &Tensor<1>, eps: f64) -> Tensor<D> {
    let mean_square = x.clone().square().mean_dim(D - 1);
    let normed = x * (mean_square + eps).sqrt().recip();
    let mut shape = [1usize; D];
    shape[D - 1] = weight.dims()[0];
    normed * weight.clone().reshape(shape)
}
