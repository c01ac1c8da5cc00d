//! The frozen projection `x W^T` through the GEMM directly into a fresh output buffer.
//!
//! burn's CPU matmul makes the same GEMM call but first allocates its output zeroed and then
//! copies it to a more strictly aligned buffer: two passes over every projection's output
//! (262 MB for the LM head of a 16 x 128 prefill) on one thread. Here the GEMM writes the
//! output once. The call (`gemm::gemm`, the same strides, the same parallelism threshold) and
//! the backward (`dx = dy W` through a transposed view, as `burn-autodiff` forms it) are burn's,
//! so the results are identical bit for bit (tested).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};

use super::on_flex;

/// Products of at least this many multiply-adds (`m n k`) run on every core: burn's threshold.
const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;

/// Products with at most this many rows (a decoding step's) take the few-rows kernel.
pub const FEW_ROWS: usize = 16;

/// The frozen projection, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait DenseLinearBackend: burn::backend::Backend {
    /// `x W^T` from `W^T`; only `x` is differentiated (the weight is frozen).
    ///
    /// # Shapes
    /// `x`: `[m, in]`, `weight_t`: `[in, out]` -> `[m, out]`
    fn dense_linear(x: FloatTensor<Self>, weight_t: FloatTensor<Self>) -> FloatTensor<Self>;
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
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                lhs.values.as_ptr(),
                lhs.col_stride,
                lhs.row_stride,
                rhs.values.as_ptr(),
                rhs.col_stride,
                rhs.row_stride,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                parallelism,
            );
            out.set_len(m * n);
        }
    }
    FlexTensor::from_data(TensorData::new(out, [m, n]))
}

/// `tensor`, copied to a contiguous layout if a stride is negative (a flipped view), so that
/// its values run forward from its start offset.
fn positive_strides(tensor: FlexTensor) -> FlexTensor {
    if tensor.layout().has_positive_strides() {
        tensor
    } else {
        tensor.to_contiguous()
    }
}

impl DenseLinearBackend for Flex {
    fn dense_linear(x: FlexTensor, weight_t: FlexTensor) -> FlexTensor {
        let (x, weight_t) = (positive_strides(x), positive_strides(weight_t));
        let (lhs, rhs) = (Operand::of(&x), Operand::of(&weight_t));
        if lhs.rows <= FEW_ROWS && lhs.col_stride == 1 && rhs.col_stride == 1 {
            if let Some(out) = few_rows::product(&lhs, &rhs) {
                return out;
            }
        }
        product(lhs, rhs)
    }
}

/// A product with few rows (decoding), where the GEMM is bound by reading the weight: the
/// weight is streamed once from memory, in column panels that run in parallel, each panel
/// multiplied with every row while it sits in cache (the GEMM packs a copy of the whole weight
/// first). Each output is one fused multiply-add chain over `k`, as the GEMM's is when `k` fits
/// its blocking; past it (`k` = 1536 here) the sums differ from the GEMM's in the last bits.
mod few_rows {
    use burn::backend::flex::FlexTensor;
    use burn::tensor::TensorData;
    use rayon::prelude::*;

    use super::Operand;

    /// Output columns per panel: four 16-lane vectors.
    const PANEL: usize = 64;
    /// Rows per register block: 4 rows x 4 vectors of accumulators.
    const BLOCK_ROWS: usize = 4;
    /// Panels per rayon task.
    const PANELS_PER_TASK: usize = 4;

    /// `lhs rhs` for row-major operands, or `None` where the CPU lacks AVX-512 (the GEMM then
    /// runs).
    pub(super) fn product(lhs: &Operand<'_>, rhs: &Operand<'_>) -> Option<FlexTensor> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
            let (lhs_stride, rhs_stride) = (lhs.row_stride as usize, rhs.row_stride as usize);
            let mut out = vec![0.0f32; m * n];
            let task_cols = PANEL * PANELS_PER_TASK;
            let tasks = n.div_ceil(task_cols);
            let out_ptr = SendPtr(out.as_mut_ptr());
            (0..tasks).into_par_iter().for_each(|task| {
                let (c0, c1) = (task * task_cols, ((task + 1) * task_cols).min(n));
                // SAFETY: the CPU has AVX-512F; each task writes only its own columns [c0, c1)
                // of `out` (m x n), and reads the operands within their shapes and strides.
                unsafe {
                    avx512::panels(lhs.values, lhs_stride, rhs.values, rhs_stride, out_ptr.get(), m, k, n, c0, c1)
                };
            });
            return Some(FlexTensor::from_data(TensorData::new(out, [m, n])));
        }
        let _ = (lhs, rhs);
        None
    }

    /// A raw output pointer handed to rayon tasks that write disjoint columns.
    #[derive(Clone, Copy)]
    struct SendPtr(*mut f32);
    // SAFETY: the tasks sharing it write disjoint parts of one live buffer.
    unsafe impl Send for SendPtr {}
    // SAFETY: as above.
    unsafe impl Sync for SendPtr {}
    impl SendPtr {
        fn get(self) -> *mut f32 {
            self.0
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod avx512 {
        use std::arch::x86_64::*;

        use super::{BLOCK_ROWS, PANEL};

        /// Columns `[c0, c1)` of `out = lhs rhs` (`m x k` times `k x n`, row-major with the
        /// given row strides), panel by panel; a last partial panel is masked.
        #[target_feature(enable = "avx512f")]
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) unsafe fn panels(
            lhs: &[f32],
            lhs_stride: usize,
            rhs: &[f32],
            rhs_stride: usize,
            out: *mut f32,
            m: usize,
            k: usize,
            n: usize,
            c0: usize,
            c1: usize,
        ) {
            let mut c = c0;
            while c < c1 {
                let width = (c1 - c).min(PANEL);
                // One lane mask per vector of the panel (all ones but in a last partial panel).
                let mut masks = [0 as __mmask16; 4];
                for (q, mask) in masks.iter_mut().enumerate() {
                    let lanes = width.saturating_sub(q * 16).min(16);
                    *mask = ((1u32 << lanes) - 1) as __mmask16;
                }
                let mut r = 0;
                while r < m {
                    let rows = (m - r).min(BLOCK_ROWS);
                    let mut acc = [[_mm512_setzero_ps(); 4]; BLOCK_ROWS];
                    for i in 0..k {
                        // SAFETY (whole block): row i's columns [c, c + width) lie in `rhs`;
                        // masked lanes are not read.
                        let w = rhs.as_ptr().add(i * rhs_stride + c);
                        let mut wv = [_mm512_setzero_ps(); 4];
                        for q in 0..4 {
                            wv[q] = _mm512_maskz_loadu_ps(masks[q], w.add(q * 16));
                        }
                        for (rr, acc) in acc.iter_mut().enumerate().take(rows) {
                            let b = _mm512_set1_ps(*lhs.get_unchecked((r + rr) * lhs_stride + i));
                            for q in 0..4 {
                                acc[q] = _mm512_fmadd_ps(b, wv[q], acc[q]);
                            }
                        }
                    }
                    for (rr, acc) in acc.iter().enumerate().take(rows) {
                        let y = out.add((r + rr) * n + c);
                        for q in 0..4 {
                            _mm512_mask_storeu_ps(y.add(q * 16), masks[q], acc[q]);
                        }
                    }
                    r += BLOCK_ROWS;
                }
                c += width;
            }
        }
    }
}

/// The backward of [`DenseLinearBackend::dense_linear`]: `dx = dy W`.
#[derive(Debug)]
struct DenseLinearBackward;

impl Backward<Flex, 2> for DenseLinearBackward {
    /// `W^T`.
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, _] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        if let Some(node) = node_x {
            let grad = positive_strides(grad);
            let dx = product(Operand::of(&grad), Operand::of(&ops.state).transposed());
            grads.register::<Flex>(node.id, dx);
        }
    }
}

impl<C: CheckpointStrategy> DenseLinearBackend for Autodiff<Flex, C> {
    fn dense_linear(x: FloatTensor<Self>, weight_t: FloatTensor<Self>) -> FloatTensor<Self> {
        let weight = weight_t.primitive().clone();
        match DenseLinearBackward.prepare::<C>([x.node(), weight_t.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = Flex::dense_linear(x.primitive().clone(), weight.clone());
                prep.finish(positive_strides(weight), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::dense_linear(x.into_primitive(), weight)),
        }
    }
}

/// `x W^T` for a frozen `W` given as `W^T`: straight into its output on the CPU, burn's matmul
/// elsewhere (and for any dtype but f32); the same values either way. The weight gets no gradient.
///
/// # Shapes
/// `x`: `[m, in]`, `weight_t`: `[in, out]` -> `[m, out]`
pub fn dense_linear(x: Tensor<2>, weight_t: &Tensor<2>) -> Tensor<2> {
    if !on_flex(&x) || x.dtype() != DType::F32 || weight_t.dtype() != DType::F32 {
        return x.matmul(weight_t.clone());
    }
    Tensor::from_dispatch(<Dispatch as DenseLinearBackend>::dense_linear(
        x.into_dispatch(),
        weight_t.clone().into_dispatch(),
    ))
}
