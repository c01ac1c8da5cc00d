//! A frozen base kept quantized (QLoRA-style): the projection matrices, the token embedding and
//! the LM head stay in a ggml block format (a GGUF file's own types, or Q8_0 made by
//! [`quantize_q8_0`] for a float checkpoint) and are multiplied with directly.
//!
//! The product `y = x W^T` is a burn backend extension ([`QuantizedLinearBackend`]) on the CPU
//! (`flex`) backend, with a hand-written autodiff backward: the base gets no gradient, the input
//! gets `dx = dy W`, so LoRA adapters on top of the quantized base train as on the f32 one.
//!
//! - Few rows (decoding, `m <= FUSED_MAX_ROWS`): each weight row is read once, in its block
//!   format only (the memory traffic that bounds decoding), and dotted with every input row:
//!   Q8_0, Q4_0 and Q4_1 directly on their blocks, the other types through one dequantized row
//!   in an L1-resident buffer.
//! - Many rows (prefill, scoring, training): the matrix is dequantized into a transient f32
//!   buffer and multiplied by burn's f32 GEMM, whose cost then dominates.
//!
//! Dequantization is ggml's, bit for bit ([`super::gguf::dequant`]), so the kept-quantized base
//! computes with exactly the weights of the dequantized one; only the order of the sums differs.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::{Device, Int, Tensor, TensorData};
use half::f16;
use rayon::prelude::*;

use super::gguf::dequant::{dequantize, GgmlType};
use super::gguf::BlockMatrix;
use crate::error::{Result, TroupeError};

/// How the frozen base holds its weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BaseFormat {
    /// Every weight dequantized to f32 (the default).
    #[default]
    F32,
    /// Projections, embedding and LM head kept in a block format (`--quantized`).
    Quantized,
}

impl BaseFormat {
    /// `Quantized` when `quantized`, else `F32`.
    pub fn from_flag(quantized: bool) -> Self {
        if quantized {
            BaseFormat::Quantized
        } else {
            BaseFormat::F32
        }
    }
}

/// Input rows up to which the product runs fused on the blocks (above: dequantize + f32 GEMM).
pub const FUSED_MAX_ROWS: usize = 16;

/// Output rows each parallel task of the fused product takes.
const ROWS_PER_TASK: usize = 32;

/// Quantizes a row-major `[rows, cols]` matrix to Q8_0 as ggml's `quantize_row_q8_0_ref` does
/// (per 32 values: `d = max|x| / 127` stored as f16, `q = round(x / d)`); `cols` must be a
/// multiple of 32.
pub fn quantize_q8_0(values: &[f32], rows: usize, cols: usize) -> BlockMatrix {
    debug_assert!(cols.is_multiple_of(32) && values.len() == rows * cols);
    let mut bytes = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        bytes.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        bytes.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
    }
    BlockMatrix { ggml_type: GgmlType::Q8_0, rows, cols, bytes }
}

/// The form a float matrix takes in a kept-quantized base: Q8_0 when its rows are whole
/// 32-value blocks, else f32 as it is.
pub fn quantize_float_matrix(values: &[f32], rows: usize, cols: usize) -> BlockMatrix {
    if cols.is_multiple_of(32) {
        quantize_q8_0(values, rows, cols)
    } else {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        BlockMatrix { ggml_type: GgmlType::F32, rows, cols, bytes }
    }
}

/// A frozen matrix `W` (`[rows, cols]` = `[out_features, in_features]`) kept as one or more
/// stacked parts in block formats (stacked q/k/v may each have their own type).
#[derive(Clone, Debug)]
pub struct QuantizedWeight {
    parts: Arc<Vec<BlockMatrix>>,
    rows: usize,
    cols: usize,
}

impl QuantizedWeight {
    /// Stacks `parts` along the rows; every part must have the same `cols`.
    pub fn new(parts: Vec<BlockMatrix>) -> Self {
        let cols = parts.first().map_or(0, |p| p.cols);
        debug_assert!(parts.iter().all(|p| p.cols == cols), "stacked parts share their columns");
        let rows = parts.iter().map(|p| p.rows).sum();
        Self { parts: Arc::new(parts), rows, cols }
    }

    /// `[rows, cols]`: `[out_features, in_features]`.
    pub fn dims(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// The stacked parts.
    pub fn parts(&self) -> &[BlockMatrix] {
        &self.parts
    }

    /// Bytes the blocks take in memory.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.bytes.len()).sum()
    }

    /// The part holding row `row`, and the row's index within it.
    fn part_row(&self, mut row: usize) -> (&BlockMatrix, usize) {
        for part in self.parts.iter() {
            if row < part.rows {
                return (part, row);
            }
            row -= part.rows;
        }
        panic!("row {row} past the end of a {}-row matrix", self.rows);
    }

    /// Dequantizes row `row` into `out` (`cols` values).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let (part, local) = self.part_row(row);
        let width = part.row_bytes();
        dequantize(part.ggml_type, &part.bytes[local * width..(local + 1) * width], out);
    }

    /// All of `W`, row-major `[rows, cols]`, dequantized in parallel.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols > 0 {
            out.par_chunks_mut(self.cols).enumerate().for_each(|(r, row)| self.dequantize_row(r, row));
        }
        out
    }

    /// `W^T`, row-major `[cols, rows]`.
    pub fn dequantize_t(&self) -> Vec<f32> {
        super::layers::transpose_host(&self.dequantize(), self.rows, self.cols)
    }

    /// Rows `ids` of `W`, dequantized (an embedding lookup).
    ///
    /// # Shapes
    /// -> `[ids.len(), cols]`
    pub fn gather_rows(&self, ids: &[usize]) -> Vec<f32> {
        let mut out = vec![0.0f32; ids.len() * self.cols];
        if self.cols > 0 {
            out.par_chunks_mut(self.cols).zip(ids.par_iter()).for_each(|(row, &id)| self.dequantize_row(id, row));
        }
        out
    }

    /// `x W^T` for few input rows, on the blocks.
    ///
    /// # Shapes
    /// `x`: `[m, cols]` -> `[m, rows]`
    fn fused_xwt(&self, x: &[f32], m: usize) -> Vec<f32> {
        let (rows, cols) = (self.rows, self.cols);
        // [rows, m]: each task writes a contiguous tile; transposed back at the end.
        let mut out_t = vec![0.0f32; rows * m];
        out_t.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each(|(task, tile)| {
            let mut buf = vec![0.0f32; cols];
            let first = task * ROWS_PER_TASK;
            fused_tile(self, x, m, first, tile, &mut buf);
        });
        if m == 1 {
            out_t
        } else {
            super::layers::transpose_host(&out_t, rows, m)
        }
    }
}

/// One task of the fused product: output rows `first..` (as many as `tile` holds) for all `m`
/// inputs, compiled for AVX2 + FMA when the CPU has them.
fn fused_tile(w: &QuantizedWeight, x: &[f32], m: usize, first: usize, tile: &mut [f32], buf: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above), which is all the
        // `target_feature` function requires.
        unsafe { fused_tile_avx2(w, x, m, first, tile, buf) };
        return;
    }
    fused_tile_generic(w, x, m, first, tile, buf);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fused_tile_avx2(w: &QuantizedWeight, x: &[f32], m: usize, first: usize, tile: &mut [f32], buf: &mut [f32]) {
    fused_tile_generic(w, x, m, first, tile, buf);
}

/// Input rows up to which Q8_0 / Q4_0 / Q4_1 rows are dotted on their blocks; above, one
/// dequantized row serves all inputs (its unpacking then costs less than redoing it per input).
const DIRECT_MAX_ROWS: usize = 2;

// Plain index loops throughout: iterator adaptors here are outlined by the compiler and then
// miss the AVX2 code generation of the caller.
#[inline(always)]
fn fused_tile_generic(w: &QuantizedWeight, x: &[f32], m: usize, first: usize, tile: &mut [f32], buf: &mut [f32]) {
    let cols = w.cols;
    let rows = tile.len() / m;
    for j in 0..rows {
        let (part, local) = w.part_row(first + j);
        let width = part.row_bytes();
        let bytes = &part.bytes[local * width..(local + 1) * width];
        let out = &mut tile[j * m..(j + 1) * m];
        let direct = m <= DIRECT_MAX_ROWS;
        match part.ggml_type {
            // The formats llama.cpp files hold most, dotted on their blocks directly.
            GgmlType::Q8_0 if direct => {
                for i in 0..m {
                    out[i] = q8_0_row_dot(bytes, &x[i * cols..(i + 1) * cols]);
                }
            }
            GgmlType::Q4_0 if direct => {
                for i in 0..m {
                    out[i] = q4_0_row_dot(bytes, &x[i * cols..(i + 1) * cols]);
                }
            }
            GgmlType::Q4_1 if direct => {
                for i in 0..m {
                    out[i] = q4_1_row_dot(bytes, &x[i * cols..(i + 1) * cols]);
                }
            }
            // Otherwise the row dequantized once into an L1-resident buffer.
            other => {
                dequantize(other, bytes, buf);
                for i in 0..m {
                    out[i] = dot(&x[i * cols..(i + 1) * cols], buf);
                }
            }
        }
    }
}

/// An f16 stored little-endian at `bytes[at..at + 2]`, as f32, converted inline (a call out to
/// a conversion routine inside the block loops would spill the SIMD accumulators): the f16's
/// exponent and mantissa moved into an f32's place and scaled by 2^112, exact for normal and
/// subnormal values alike, with infinities and NaNs kept.
#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([bytes[at], bytes[at + 1]]) as u32;
    let sign = (h & 0x8000) << 16;
    let magnitude = h & 0x7FFF;
    let bits = if magnitude >= 0x7C00 {
        0x7F80_0000 | ((magnitude & 0x03FF) << 13)
    } else {
        (f32::from_bits(magnitude << 13) * f32::from_bits(0x7780_0000)).to_bits()
    };
    f32::from_bits(sign | bits)
}

/// One Q8_0 row (`d * q` per 32 values) dotted with `x`, in 16 lanes across blocks.
#[inline(always)]
fn q8_0_row_dot(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for b in 0..x.len() / 32 {
        let (block, xb) = (&row[b * 34..(b + 1) * 34], &x[b * 32..(b + 1) * 32]);
        let d = f16_at(block, 0);
        let q: &[u8; 32] = block[2..34].try_into().expect("a 34-byte block");
        let xb: &[f32; 32] = xb.try_into().expect("32 values");
        for l in 0..16 {
            acc[l] += d * ((q[l] as i8) as f32 * xb[l] + (q[l + 16] as i8) as f32 * xb[l + 16]);
        }
    }
    let mut sum = 0.0f32;
    for lane in acc {
        sum += lane;
    }
    sum
}

/// One Q4_0 row (`d * (q - 8)`; value j < 16 the low nibble of byte j, j + 16 its high one).
#[inline(always)]
fn q4_0_row_dot(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for b in 0..x.len() / 32 {
        let (block, xb) = (&row[b * 18..(b + 1) * 18], &x[b * 32..(b + 1) * 32]);
        let d = f16_at(block, 0);
        let qs: &[u8; 16] = block[2..18].try_into().expect("an 18-byte block");
        let xb: &[f32; 32] = xb.try_into().expect("32 values");
        for j in 0..16 {
            let lo = ((qs[j] & 0x0F) as i32 - 8) as f32;
            let hi = ((qs[j] >> 4) as i32 - 8) as f32;
            acc[j] += d * (lo * xb[j] + hi * xb[j + 16]);
        }
    }
    let mut sum = 0.0f32;
    for lane in acc {
        sum += lane;
    }
    sum
}

/// One Q4_1 row (`d * q + m`).
#[inline(always)]
fn q4_1_row_dot(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for b in 0..x.len() / 32 {
        let (block, xb) = (&row[b * 20..(b + 1) * 20], &x[b * 32..(b + 1) * 32]);
        let (d, m) = (f16_at(block, 0), f16_at(block, 2));
        let qs: &[u8; 16] = block[4..20].try_into().expect("a 20-byte block");
        let xb: &[f32; 32] = xb.try_into().expect("32 values");
        for j in 0..16 {
            let (lo, hi) = ((qs[j] & 0x0F) as f32, (qs[j] >> 4) as f32);
            acc[j] += d * (lo * xb[j] + hi * xb[j + 16]) + m * (xb[j] + xb[j + 16]);
        }
    }
    let mut sum = 0.0f32;
    for lane in acc {
        sum += lane;
    }
    sum
}

/// A dot product in 16 independent lanes (so it vectorizes without reassociating a sum).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let n = a.len().min(b.len());
    let whole = n / 16 * 16;
    for c in 0..whole / 16 {
        let (ca, cb): (&[f32; 16], &[f32; 16]) =
            (a[c * 16..c * 16 + 16].try_into().expect("16"), b[c * 16..c * 16 + 16].try_into().expect("16"));
        for k in 0..16 {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut tail = 0.0f32;
    for k in whole..n {
        tail += a[k] * b[k];
    }
    let mut sum = 0.0f32;
    for lane in acc {
        sum += lane;
    }
    sum + tail
}

/// A contiguous f32 copy of a flex tensor's values.
fn host_values(tensor: &FlexTensor) -> std::borrow::Cow<'_, [f32]> {
    match tensor.as_slice::<f32>() {
        Some(values) => std::borrow::Cow::Borrowed(values),
        None => std::borrow::Cow::Owned(
            tensor.to_contiguous().into_data().convert::<f32>().try_into_vec::<f32>().expect("an f32 tensor"),
        ),
    }
}

/// The product with a kept-quantized matrix, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait QuantizedLinearBackend: burn::backend::Backend {
    /// `x W^T` for `W` kept quantized.
    ///
    /// # Shapes
    /// `x`: `[m, in_features]` -> `[m, out_features]`
    fn quantized_linear(x: FloatTensor<Self>, weight: QuantizedWeight) -> FloatTensor<Self>;
}

impl QuantizedLinearBackend for Flex {
    fn quantized_linear(x: FlexTensor, weight: QuantizedWeight) -> FlexTensor {
        let m = x.layout().shape()[0];
        let [rows, cols] = weight.dims();
        if m > FUSED_MAX_ROWS {
            // `W^T` as a transposed view: burn's GEMM reads strides, so no copy is made.
            let w = FlexTensor::from_data(TensorData::new(weight.dequantize(), [rows, cols]));
            return Flex::float_matmul(x, w.transpose(0, 1));
        }
        let out = weight.fused_xwt(&host_values(&x), m);
        FlexTensor::from_data(TensorData::new(out, [m, rows]))
    }
}

/// `dx = dy W`, through a transient dequantized `W`.
///
/// # Shapes
/// `dy`: `[m, out_features]` -> `[m, in_features]`
fn backward_dx(dy: FlexTensor, weight: &QuantizedWeight) -> FlexTensor {
    let [rows, cols] = weight.dims();
    let w = FlexTensor::from_data(TensorData::new(weight.dequantize(), [rows, cols]));
    Flex::float_matmul(dy, w)
}

/// The backward of [`QuantizedLinearBackend::quantized_linear`]: the input's gradient only.
#[derive(Debug)]
struct QuantizedLinearBackward;

impl Backward<Flex, 1> for QuantizedLinearBackward {
    type State = QuantizedWeight;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let dy = grads.consume::<Flex>(&ops.node);
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, backward_dx(dy, &ops.state));
        }
    }
}

impl<C: CheckpointStrategy> QuantizedLinearBackend for Autodiff<Flex, C> {
    fn quantized_linear(x: FloatTensor<Self>, weight: QuantizedWeight) -> FloatTensor<Self> {
        match QuantizedLinearBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = Flex::quantized_linear(x.primitive().clone(), weight.clone());
                prep.finish(weight, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::quantized_linear(x.into_primitive(), weight)),
        }
    }
}

/// `x W^T` with `W` kept quantized; differentiable in `x`.
///
/// # Shapes
/// `x`: `[m, in_features]` -> `[m, out_features]`
pub fn quantized_linear(x: Tensor<2>, weight: &QuantizedWeight) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as QuantizedLinearBackend>::quantized_linear(x.into_dispatch(), weight.clone()))
}

/// Refuses a kept-quantized base on a device other than the CPU (its kernels are CPU ones).
pub fn check_device(device: &Device) -> Result<()> {
    if *device == Device::flex() {
        Ok(())
    } else {
        Err(TroupeError::invalid(
            "model.quantized",
            format!("a kept-quantized base runs on the CPU only, not on {device:?} (drop --quantized)"),
        ))
    }
}

/// The token embedding of a frozen base.
// A burn tensor handle is large (256 bytes), but a model holds only a few of these per layer.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum TokenEmbedding {
    /// `[vocab, hidden]` in f32.
    Dense(Tensor<2>),
    /// `[vocab, hidden]` kept quantized (shared with a tied LM head).
    Quantized(QuantizedWeight),
}

impl TokenEmbedding {
    /// `[vocab, hidden]`
    pub fn dims(&self) -> [usize; 2] {
        match self {
            TokenEmbedding::Dense(table) => table.dims(),
            TokenEmbedding::Quantized(table) => table.dims(),
        }
    }

    /// The vectors of `tokens`.
    ///
    /// # Shapes
    /// `tokens`: `[batch, seq]` -> `[batch, seq, hidden]`
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        match self {
            TokenEmbedding::Dense(table) => burn::tensor::module::embedding(table.clone(), tokens),
            TokenEmbedding::Quantized(table) => {
                let [batch, seq] = tokens.dims();
                let device = tokens.device();
                let ids: Vec<usize> = tokens
                    .into_data()
                    .convert::<i64>()
                    .try_into_vec::<i64>()
                    .expect("int token ids")
                    .into_iter()
                    .map(|id| id as usize)
                    .collect();
                let values = table.gather_rows(&ids);
                Tensor::from_data(TensorData::new(values, [batch, seq, table.dims()[1]]), &device)
            }
        }
    }

    /// The first `rows` rows, row-major (dequantized when kept quantized).
    pub fn first_rows(&self, rows: usize) -> Vec<f32> {
        match self {
            TokenEmbedding::Dense(table) => {
                let hidden = table.dims()[1];
                table
                    .clone()
                    .slice([0..rows, 0..hidden])
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .unwrap_or_default()
            }
            TokenEmbedding::Quantized(table) => table.gather_rows(&(0..rows).collect::<Vec<_>>()),
        }
    }

    /// Bytes the table takes in memory.
    pub fn bytes(&self) -> usize {
        match self {
            TokenEmbedding::Dense(table) => 4 * table.dims().iter().product::<usize>(),
            TokenEmbedding::Quantized(table) => table.bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(rows: usize, cols: usize, seed: u32) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn q8_0_round_trip_is_within_half_a_step_and_the_scale_rounding() {
        let values = matrix(3, 64, 1);
        let q = quantize_q8_0(&values, 3, 64);
        assert_eq!(q.bytes.len(), 3 * 2 * 34);
        let back = q.dequantize();
        for (block, (v, b)) in values.chunks(32).zip(back.chunks(32)).enumerate() {
            let step = block_step(v);
            for (x, y) in v.iter().zip(b) {
                // Half a step, plus what rounding the scale to f16 moves the largest q (127).
                assert!((x - y).abs() <= 0.5 * step + 127.0 * step / 2048.0, "block {block}: {x} vs {y}");
            }
        }
    }

    fn block_step(block: &[f32]) -> f32 {
        f16::from_f32(block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0).to_f32()
    }

    #[test]
    fn inline_f16_conversion_is_exact() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32();
            let got = f16_at(&h.to_le_bytes(), 0);
            assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()), "{h:#06x}: {got} vs {want}");
        }
    }

    #[test]
    fn fused_product_matches_the_dequantized_one() {
        let (rows, cols) = (70, 96);
        let parts = vec![quantize_q8_0(&matrix(40, cols, 3), 40, cols), quantize_q8_0(&matrix(30, cols, 4), 30, cols)];
        let w = QuantizedWeight::new(parts);
        let dense = w.dequantize();
        for m in [1, 3, 16] {
            let x = matrix(m, cols, 9);
            let fused = w.fused_xwt(&x, m);
            for i in 0..m {
                for r in 0..rows {
                    let want: f32 = (0..cols).map(|k| x[i * cols + k] * dense[r * cols + k]).sum();
                    let got = fused[i * rows + r];
                    assert!((want - got).abs() < 1e-4, "m {m} [{i}, {r}]: {got} vs {want}");
                }
            }
        }
    }
}
