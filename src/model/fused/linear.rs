//! The frozen projection `x W^T` through the GEMM directly into a fresh output buffer.
//!
//! The weight is kept as `W` (`[out, in]`, as checkpoints store it), which the GEMM reads as a
//! transposed view and a few-row product (decoding) reads as contiguous rows.
//!
//! burn's CPU matmul makes the same GEMM call but first allocates its output zeroed and then
//! copies it to a more strictly aligned buffer: two passes over every projection's output
//! (262 MB for the LM head of a 16 x 128 prefill) on one thread. Here the GEMM writes the
//! output once. The call (`gemm::gemm`, the same parallelism threshold) and the backward
//! (`dx = dy W`) are burn's, so the results are identical bit for bit to `x.matmul(W^T)`
//! (tested).
//!
//! A weight held in bf16 or f16 (`model.dtype`) is widened to f32 per product (in parallel; the
//! CPU has no faster bf16 GEMM here), and the product is that of burn's matmul in the weight's
//! type on CUDA: the input rounded to it, f32 accumulation, the result rounded to it and handed
//! back in f32. The backward multiplies by the widened weight.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::{bf16, f16, DType, FloatDType, Tensor, TensorData};
use rayon::prelude::*;

use super::{gemm_f32, on_flex, positive_strides, MIN_PARALLEL_ELEMENTS};

/// Products of at least this many multiply-adds (`m n k`) run on every core: burn's threshold.
const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;

/// Products with at most this many rows (a decoding step's) take the few-rows kernel.
pub const FEW_ROWS: usize = 16;

/// The frozen projection, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait DenseLinearBackend: burn::backend::Backend {
    /// `x W^T`; only `x` is differentiated (the weight is frozen).
    ///
    /// # Shapes
    /// `x`: `[m, in]`, `weight`: `[out, in]` -> `[m, out]`
    fn dense_linear(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// A 2-D f32 operand: its values from the start offset, and its row and column strides.
struct Operand<'a> {
    values: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: isize,
    col_stride: isize,
}

impl<'a> Operand<'a> {
    /// The operand view of a flex tensor with non-negative strides (see [`positive_strides`]).
    fn of(tensor: &'a FlexTensor) -> Self {
        let layout = tensor.layout();
        let [rows, cols] = layout.shape().dims::<2>();
        let strides = layout.strides();
        Self {
            values: &tensor.storage::<f32>()[layout.start_offset()..],
            rows,
            cols,
            row_stride: strides[0],
            col_stride: strides[1],
        }
    }

    /// The transposed view (no copy).
    fn transposed(self) -> Self {
        Self { rows: self.cols, cols: self.rows, row_stride: self.col_stride, col_stride: self.row_stride, ..self }
    }
}

/// `lhs rhs` into a new row-major tensor.
fn product(lhs: Operand<'_>, rhs: Operand<'_>) -> FlexTensor {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert_eq!(k, rhs.rows, "dense_linear: inner dimensions differ");
    assert!(lhs.values.as_ptr().is_aligned() && rhs.values.as_ptr().is_aligned(), "dense_linear: f32 operands");
    let mut out = Vec::<f32>::with_capacity(m * n);
    if k == 0 {
        out.resize(m * n, 0.0);
    } else {
        let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_THRESHOLD {
            gemm::Parallelism::Rayon(0)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: `out` has room for the m x n row-major result, which the GEMM writes in full
        // without reading it (`read_dst` false, k > 0); the operands' strides address only their
        // own storage (they come from valid burn layouts of these shapes).
        unsafe {
            gemm_f32(
                [m, n, k],
                out.as_mut_ptr(),
                n as isize,
                false,
                lhs.values.as_ptr(),
                (lhs.row_stride, lhs.col_stride),
                rhs.values.as_ptr(),
                (rhs.row_stride, rhs.col_stride),
                parallelism,
            );
            out.set_len(m * n);
        }
    }
    FlexTensor::from_data(TensorData::new(out, [m, n]))
}

/// `weight` widened to f32 (a new row-major tensor) when held in bf16 or f16; as it is in f32.
fn widened(weight: FlexTensor) -> FlexTensor {
    fn widen<T: Copy + Sync>(values: &[T], to_f32: impl Fn(T) -> f32 + Sync) -> Vec<f32> {
        let mut out = vec![0.0f32; values.len()];
        out.par_chunks_mut(MIN_PARALLEL_ELEMENTS).zip(values.par_chunks(MIN_PARALLEL_ELEMENTS)).for_each(
            |(out, values)| {
                for (o, &v) in out.iter_mut().zip(values) {
                    *o = to_f32(v);
                }
            },
        );
        out
    }
    let dtype = weight.dtype();
    if dtype == DType::F32 {
        return weight;
    }
    let weight = if weight.is_contiguous() { weight } else { weight.to_contiguous() };
    let shape = weight.layout().shape().clone();
    let span = weight.layout().start_offset()..weight.layout().start_offset() + shape.num_elements();
    let values = match dtype {
        DType::BF16 => widen(&weight.storage::<bf16>()[span], bf16::to_f32),
        DType::F16 => widen(&weight.storage::<f16>()[span], f16::to_f32),
        other => unreachable!("dense_linear takes weights in f32, bf16 or f16, not {other:?}"),
    };
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// Rounds every value of `values` to the nearest `dtype` value (bf16 or f16; ties to even), in
/// parallel.
fn round_to(values: &mut [f32], dtype: DType) {
    let round: fn(f32) -> f32 = match dtype {
        DType::BF16 => |v| bf16::from_f32(v).to_f32(),
        DType::F16 => |v| f16::from_f32(v).to_f32(),
        _ => return,
    };
    values.par_chunks_mut(MIN_PARALLEL_ELEMENTS).for_each(|chunk| chunk.iter_mut().for_each(|v| *v = round(*v)));
}

/// `x` as a new row-major tensor with its values rounded to `dtype`.
fn rounded(x: FlexTensor, dtype: DType) -> FlexTensor {
    let x = x.to_contiguous();
    let shape = x.layout().shape().clone();
    let start = x.layout().start_offset();
    let mut values = x.storage::<f32>()[start..start + shape.num_elements()].to_vec();
    round_to(&mut values, dtype);
    FlexTensor::from_data(TensorData::new(values, shape))
}

impl DenseLinearBackend for Flex {
    fn dense_linear(x: FlexTensor, weight: FlexTensor) -> FlexTensor {
        let dtype = weight.dtype();
        if dtype == DType::F32 {
            return dense_linear_f32(x, weight);
        }
        // The products of a weight held in bf16 or f16, as on CUDA: operands in its type, f32
        // accumulation, the result rounded to it.
        let mut out = dense_linear_f32(rounded(x, dtype), widened(weight));
        round_to(out.storage_mut::<f32>(), dtype);
        out
    }
}

/// `x W^T` for f32 operands.
fn dense_linear_f32(x: FlexTensor, weight: FlexTensor) -> FlexTensor {
    let (x, weight) = (positive_strides(x), positive_strides(weight));
    let (lhs, weight) = (Operand::of(&x), Operand::of(&weight));
    if lhs.rows <= FEW_ROWS && lhs.col_stride == 1 && weight.col_stride == 1 {
        if let Some(out) = few_rows::product(&lhs, &weight) {
            return out;
        }
    }
    product(lhs, weight.transposed())
}

/// A product with few rows (decoding), where the GEMM spends as long packing the weight as
/// multiplying by it: each output is the dot product of an input row with a weight row, the
/// weight streamed once from memory in contiguous rows (blocks of columns run in parallel), each
/// block of three weight rows multiplied with four input rows while it sits in cache. Each output
/// sums eight lanes of fused multiply-adds, so it differs from the GEMM's single chain in the
/// last bits.
mod few_rows {
    use burn::backend::flex::FlexTensor;
    use burn::tensor::TensorData;
    use rayon::prelude::*;

    use super::super::SendPtr;
    use super::Operand;

    /// Input rows per register block.
    const BLOCK_ROWS: usize = 4;
    /// Weight rows (output columns) per register block.
    const BLOCK_COLS: usize = 3;
    /// Output columns per rayon task: sixteen register blocks.
    const TASK_COLS: usize = 16 * BLOCK_COLS;

    /// `x W^T` for `x` (`m x k`, rows contiguous) and `W` (`n x k`, rows contiguous), or `None`
    /// where the CPU lacks AVX2 and FMA (the GEMM then runs).
    pub(super) fn product(x: &Operand<'_>, weight: &Operand<'_>) -> Option<FlexTensor> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            let (m, k, n) = (x.rows, x.cols, weight.rows);
            let (x_stride, w_stride) = (x.row_stride as usize, weight.row_stride as usize);
            let mut out = vec![0.0f32; m * n];
            let out_ptr = SendPtr(out.as_mut_ptr());
            (0..n.div_ceil(TASK_COLS)).into_par_iter().for_each(|task| {
                let (c0, c1) = (task * TASK_COLS, ((task + 1) * TASK_COLS).min(n));
                // SAFETY: the CPU has AVX2 and FMA; each task writes only its own columns
                // [c0, c1) of `out` (m x n), and reads the operands within their shapes and
                // strides.
                unsafe { avx2::columns(x.values, x_stride, weight.values, w_stride, out_ptr.get(), m, k, n, c0, c1) };
            });
            return Some(FlexTensor::from_data(TensorData::new(out, [m, n])));
        }
        let _ = (x, weight);
        None
    }

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use std::arch::x86_64::*;

        use super::{BLOCK_COLS, BLOCK_ROWS};

        /// The sum of a vector's eight lanes.
        #[target_feature(enable = "avx2,fma")]
        fn lane_sum(v: __m256) -> f32 {
            let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
            _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)))
        }

        /// Columns `[c0, c1)` of `out = x W^T` (`x`: `m x k`, `W`: `n x k`, both row-major
        /// with the given row strides; `out`: `m x n`), in blocks of up to `BLOCK_ROWS` rows
        /// and `BLOCK_COLS` columns.
        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) unsafe fn columns(
            x: &[f32],
            x_stride: usize,
            w: &[f32],
            w_stride: usize,
            out: *mut f32,
            m: usize,
            k: usize,
            n: usize,
            c0: usize,
            c1: usize,
        ) {
            let mut c = c0;
            while c < c1 {
                let cols = (c1 - c).min(BLOCK_COLS);
                let mut r = 0;
                while r < m {
                    let rows = (m - r).min(BLOCK_ROWS);
                    // The second row block (which finds this block's weight rows in cache)
                    // pulls the next columns' rows in while it computes; with one row block,
                    // the first.
                    let pulls = r == BLOCK_ROWS || (r == 0 && m < 2 * BLOCK_ROWS);
                    let next = (pulls && c + 2 * BLOCK_COLS <= n).then(|| w.as_ptr().add((c + BLOCK_COLS) * w_stride));
                    if rows == BLOCK_ROWS && cols == BLOCK_COLS {
                        block::<BLOCK_ROWS, BLOCK_COLS>(x, x_stride, w, w_stride, out, n, k, r, c, next);
                    } else if cols == BLOCK_COLS {
                        for rr in r..r + rows {
                            let next = next.filter(|_| rr == r);
                            block::<1, BLOCK_COLS>(x, x_stride, w, w_stride, out, n, k, rr, c, next);
                        }
                    } else {
                        for rr in r..r + rows {
                            for cc in c..c + cols {
                                block::<1, 1>(x, x_stride, w, w_stride, out, n, k, rr, cc, None);
                            }
                        }
                    }
                    r += rows;
                }
                c += cols;
            }
        }

        /// `out[r..r + R, c..c + C]`: eight-lane partial dot products over `k`, summed, then
        /// the last `k % 8` terms one by one. `prefetch`: the start of `C` more weight rows
        /// (`w_stride` apart) to bring into cache on the way.
        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        #[inline]
        unsafe fn block<const R: usize, const C: usize>(
            x: &[f32],
            x_stride: usize,
            w: &[f32],
            w_stride: usize,
            out: *mut f32,
            n: usize,
            k: usize,
            r: usize,
            c: usize,
            prefetch: Option<*const f32>,
        ) {
            let vectors = k / 8 * 8;
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            let mut i = 0;
            while i < vectors {
                // SAFETY (whole loop): rows r..r + R of x and c..c + C of W have k values from
                // their row starts; i + 8 <= k.
                if let Some(next) = prefetch.filter(|_| i % 16 == 0) {
                    for q in 0..C {
                        _mm_prefetch::<_MM_HINT_T0>(next.add(q * w_stride + i).cast());
                    }
                }
                let mut wv = [_mm256_setzero_ps(); C];
                for (q, wv) in wv.iter_mut().enumerate() {
                    *wv = _mm256_loadu_ps(w.as_ptr().add((c + q) * w_stride + i));
                }
                for (rr, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.as_ptr().add((r + rr) * x_stride + i));
                    for q in 0..C {
                        acc[q] = _mm256_fmadd_ps(xv, wv[q], acc[q]);
                    }
                }
                i += 8;
            }
            for (rr, acc) in acc.iter().enumerate() {
                for (q, acc) in acc.iter().enumerate() {
                    let (x_row, w_row) = ((r + rr) * x_stride, (c + q) * w_stride);
                    let mut sum = lane_sum(*acc);
                    for i in vectors..k {
                        sum = x.get_unchecked(x_row + i).mul_add(*w.get_unchecked(w_row + i), sum);
                    }
                    *out.add((r + rr) * n + c + q) = sum;
                }
            }
        }
    }
}

/// The backward of [`DenseLinearBackend::dense_linear`]: `dx = dy W`.
#[derive(Debug)]
struct DenseLinearBackward;

impl Backward<Flex, 2> for DenseLinearBackward {
    /// `W`.
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, _] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, backward_product(grad, ops.state));
        }
    }
}

/// `dy W` on the CPU, the backward's product: `W` widened to f32 and negative strides made
/// positive first.
///
/// # Shapes
/// `dy`: `[rows, out]`, `weight`: `[out, in]` -> `[rows, in]`
fn backward_product(dy: FlexTensor, weight: FlexTensor) -> FlexTensor {
    let (dy, weight) = (positive_strides(dy), positive_strides(widened(weight)));
    product(Operand::of(&dy), Operand::of(&weight))
}

impl<C: CheckpointStrategy> DenseLinearBackend for Autodiff<Flex, C> {
    fn dense_linear(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        let node = weight.node();
        let weight = weight.primitive().clone();
        match DenseLinearBackward.prepare::<C>([x.node(), node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = Flex::dense_linear(x.primitive().clone(), weight.clone());
                prep.finish(positive_strides(weight), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::dense_linear(x.into_primitive(), weight)),
        }
    }
}

/// `x W^T` for a frozen `W`: straight into its output on the CPU, burn's matmul elsewhere (and
/// for an input in another dtype than f32); the same values either way, but for products of at
/// most [`FEW_ROWS`] rows on the CPU, whose sums are ordered differently (within float
/// rounding). A weight held in bf16 or f16 multiplies `x` rounded to its type (f32
/// accumulation); on the CPU the product is rounded to that type, the result in `x`'s dtype; on
/// a GPU with troupe's kernels on the product is written in f32 without that rounding
/// ([`super::gpu::frozen_linear`]). The weight gets no gradient.
///
/// # Shapes
/// `x`: `[m, in]`, `weight`: `[out, in]` -> `[m, out]`
pub fn dense_linear(x: Tensor<2>, weight: &Tensor<2>) -> Tensor<2> {
    // On a GPU: the product written in f32, one autodiff node ([`super::gpu::frozen_linear`]).
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if let Some(y) = super::gpu::frozen_linear(&x, weight) {
        return y;
    }
    let low_precision = matches!(weight.dtype(), DType::BF16 | DType::F16);
    if !on_flex(&x) || x.dtype() != DType::F32 || !(weight.dtype() == DType::F32 || low_precision) {
        if weight.dtype() == x.dtype() {
            return x.matmul(weight.clone().transpose());
        }
        // burn's matmul in the weight's dtype (on CUDA: f32 accumulation), the result back in x's.
        let dtype = FloatDType::from(x.dtype());
        return x.cast(weight.dtype()).matmul(weight.clone().transpose()).cast(dtype);
    }
    Tensor::from_dispatch(<Dispatch as DenseLinearBackend>::dense_linear(
        x.into_dispatch(),
        weight.clone().into_dispatch(),
    ))
}

/// `dy W` for a frozen `W`: the product [`dense_linear`]'s backward computes for the input's
/// gradient, outside autodiff. On the CPU it is that backward's own product (f32, the weight
/// widened when held in bf16 or f16); elsewhere burn's matmul in the weight's dtype, the result
/// back in `dy`'s, as burn's autodiff differentiates [`dense_linear`]'s composite there.
///
/// # Shapes
/// `dy`: `[m, out]`, `weight`: `[out, in]` -> `[m, in]`
pub fn dense_linear_backward(dy: Tensor<2>, weight: &Tensor<2>) -> Tensor<2> {
    let dy = dy.without_autodiff();
    let weight = weight.clone().without_autodiff();
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if let Some(dx) = super::gpu::frozen_linear_backward(&dy, &weight) {
        return dx;
    }
    if on_flex(&dy) && dy.dtype() == DType::F32 {
        if let (Ok(dy), Ok(weight)) =
            (dy.clone().try_into_primitive::<Flex>(), weight.clone().try_into_primitive::<Flex>())
        {
            return Tensor::from_primitive::<Flex>(backward_product(dy, weight));
        }
    }
    if weight.dtype() == dy.dtype() {
        return dy.matmul(weight);
    }
    let dtype = FloatDType::from(dy.dtype());
    dy.cast(weight.dtype()).matmul(weight).cast(dtype)
}
