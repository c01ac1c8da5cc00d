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

impl DenseLinearBackend for Flex {
    fn dense_linear(x: FlexTensor, weight_t: FlexTensor) -> FlexTensor {
        product(Operand::of(&x), Operand::of(&weight_t))
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
                prep.finish(weight, out)
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
