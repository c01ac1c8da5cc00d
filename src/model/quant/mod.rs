//! A frozen base kept quantized (QLoRA-style): the projection matrices, the token embedding and
//! the LM head stay in a ggml block format (a GGUF file's own types, or Q8_0 made by
//! [`quantize_q8_0`] for a float checkpoint) and are multiplied with directly.
//!
//! The product `y = x W^T` is a burn backend extension ([`QuantizedLinearBackend`]) on the CPU
//! (`flex`) backend, with a hand-written autodiff backward: the base gets no gradient, the input
//! gets `dx = dy W`, so LoRA adapters on top of the quantized base train as on the f32 one.
//!
//! - Few rows (decoding, `m <= FUSED_MAX_ROWS`): the inputs are rounded to 16-bit blocks
//!   ([`activations`]) and each weight row, read once in its block format (the memory traffic
//!   that bounds decoding), is dotted with every input row in integers ([`int_dot`], SIMD in
//!   `x86`, both over the operands of [`rows`]): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K;
//!   Q6_K and the float types through one dequantized row in an L1-resident buffer and f32
//!   inputs.
//! - Many rows (prefill, scoring, training): the matrix is dequantized into a transient f32
//!   buffer and multiplied by burn's f32 GEMM, whose cost then dominates.
//!
//! Dequantization is ggml's, bit for bit ([`super::gguf::dequant`]), so the kept-quantized base
//! computes with exactly the weights of the dequantized one: with many rows only the order of the
//! sums differs, with few rows also the inputs' rounding to 16 bits.

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

use super::gguf::dequant::{dequantize, dequantize_block, GgmlType};
use super::weights::BlockMatrix;
use crate::error::{Result, TroupeError};

pub mod activations;
pub mod int_dot;
pub mod rows;
#[cfg(target_arch = "x86_64")]
mod x86;

use activations::Q16Activations;
use int_dot::Level;
use rows::InputRow;

/// How the frozen base holds its weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BaseFormat {
    /// Float matrices: f32 (the default), or bf16 / f16 as `model.dtype` asks; the name is
    /// kept from before the precision was a choice.
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
/// stacked parts in block formats (stacked q/k/v may each have their own type). Q8_0, Q4_0 and
/// Q4_1 parts are held regrouped ([`int_dot::regroup`]: the same bytes, each eight blocks'
/// scales side by side), the others as stored.
#[derive(Clone, Debug)]
pub struct QuantizedWeight {
    parts: Arc<Vec<BlockMatrix>>,
    rows: usize,
    cols: usize,
}

impl QuantizedWeight {
    /// Stacks `parts` (block bytes as ggml stores them) along the rows; every part must have the
    /// same `cols`.
    pub fn new(parts: Vec<BlockMatrix>) -> Self {
        let cols = parts.first().map_or(0, |p| p.cols);
        debug_assert!(parts.iter().all(|p| p.cols == cols), "stacked parts share their columns");
        let rows = parts.iter().map(|p| p.rows).sum();
        let parts = parts
            .into_iter()
            .map(|mut p| {
                if rows::GroupLayout::of(p.ggml_type).is_some() {
                    p.bytes = int_dot::regroup(p.ggml_type, &p.bytes, p.rows);
                }
                p
            })
            .collect();
        Self { parts: Arc::new(parts), rows, cols }
    }

    /// `[rows, cols]`: `[out_features, in_features]`.
    pub fn dims(&self) -> [usize; 2] {
        [self.rows, self.cols]
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
        let bytes = &part.bytes[local * width..(local + 1) * width];
        let ty = part.ggml_type;
        if rows::GroupLayout::of(ty).is_some() {
            // Block by block, each put back as ggml stores it.
            let mut block = [0u8; 34];
            let block = &mut block[..ty.block_bytes()];
            for (b, values) in out.chunks_exact_mut(ty.block_size()).enumerate() {
                int_dot::ungroup_block(ty, bytes, b, block);
                dequantize_block(ty, block, values);
            }
        } else {
            dequantize(ty, bytes, out);
        }
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
        super::host::transpose_host(&self.dequantize(), self.rows, self.cols)
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

    /// `x W^T` for few input rows, on the blocks, on the best instruction set this CPU has.
    ///
    /// # Shapes
    /// `x`: `[m, cols]` -> `[m, rows]`
    fn fused_xwt(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.fused_xwt_on(Level::detect(), x, m)
    }

    /// [`Self::fused_xwt`] with the integer sums on `level`.
    fn fused_xwt_on(&self, level: Level, x: &[f32], m: usize) -> Vec<f32> {
        let (rows, cols) = (self.rows, self.cols);
        // The inputs in 16-bit blocks, once for every part that multiplies in integers.
        let integer = self.parts.iter().any(|p| int_dot::int_form(p.ggml_type).is_some());
        let xq = if integer { Q16Activations::quantize(x, cols) } else { Q16Activations::default() };
        let rows_q = if integer { (0..m).map(|i| InputRow::of(&xq, i)).collect() } else { Vec::new() };
        let inputs = Inputs { x, rows: rows_q, m, level };
        // [rows, m]: each task writes a contiguous tile; transposed back at the end.
        let mut out_t = vec![0.0f32; rows * m];
        out_t.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each_init(
            || (int_dot::Scratch::new(cols), vec![0.0f32; cols]),
            |(scratch, buf), (task, tile)| self.fused_tile(&inputs, task * ROWS_PER_TASK, tile, scratch, buf),
        );
        if m == 1 {
            return out_t;
        }
        // Tile by tile, so that both sides stay in cache.
        let mut out = vec![0.0f32; m * rows];
        for (task, tile) in out_t.chunks(ROWS_PER_TASK * m).enumerate() {
            let first = task * ROWS_PER_TASK;
            for (j, values) in tile.chunks_exact(m).enumerate() {
                for (i, v) in values.iter().enumerate() {
                    out[i * rows + first + j] = *v;
                }
            }
        }
        out
    }

    /// One task of the fused product: output rows `first..` (as many as `tile` holds, `[rows, m]`)
    /// for all inputs. Each weight row is read once and dotted with every input row while it is
    /// in L1 (unpacked once, where its format needs it); with one input row, the rows of a
    /// regrouped part are looped over inside the SIMD code.
    fn fused_tile(
        &self,
        inputs: &Inputs<'_>,
        first: usize,
        tile: &mut [f32],
        scratch: &mut int_dot::Scratch,
        buf: &mut [f32],
    ) {
        let (cols, m) = (self.cols, inputs.m);
        let mut j = 0;
        while j < tile.len() / m {
            let (part, local) = self.part_row(first + j);
            let width = part.row_bytes();
            let ty = part.ggml_type;
            if m == 1 && rows::GroupLayout::of(ty).is_some() {
                // The rest of this part within the tile, in one call.
                let n = (part.rows - local).min(tile.len() - j);
                let bytes = &part.bytes[local * width..(local + n) * width];
                int_dot::rows_dot_one(inputs.level, ty, bytes, &inputs.rows[0], &mut tile[j..j + n]);
                j += n;
                continue;
            }
            let out = &mut tile[j * m..(j + 1) * m];
            let bytes = &part.bytes[local * width..(local + 1) * width];
            if int_dot::int_form(ty).is_some() {
                let row = int_dot::prepare_row(inputs.level, ty, bytes, m, scratch);
                int_dot::rows_dot(inputs.level, &row, &inputs.rows, out);
            } else {
                // Q6_K and the float types: the row dequantized into an L1-resident buffer,
                // dotted with the f32 inputs.
                dequantize(ty, bytes, buf);
                for (i, o) in out.iter_mut().enumerate() {
                    *o = float_dot(inputs.level, &inputs.x[i * cols..(i + 1) * cols], buf);
                }
            }
            j += 1;
        }
    }
}

/// The inputs of one fused product.
struct Inputs<'a> {
    /// `[m, cols]` in f32 (for the formats without an integer product).
    x: &'a [f32],
    /// `x` in 16-bit blocks, row by row (for the others).
    rows: Vec<InputRow<'a>>,
    /// Input rows.
    m: usize,
    /// The instruction set of the integer sums.
    level: Level,
}

/// A dot product of f32 rows, compiled for AVX2 where the CPU has it (one definition, so the
/// same result on every level).
fn float_dot(level: Level, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        // SAFETY: every level above `Scalar` was detected with AVX2, all the function requires.
        return unsafe { float_dot_avx2(a, b) };
    }
    let _ = level;
    dot(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn float_dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot(a, b)
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
    /// `[vocab, hidden]` in f32, bf16 or f16 (`model.dtype`).
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
            // A table held in bf16 or f16 gives its rows widened to f32, exactly.
            TokenEmbedding::Dense(table) => {
                burn::tensor::module::embedding(table.clone(), tokens).cast(burn::tensor::FloatDType::F32)
            }
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
            TokenEmbedding::Dense(table) => table.dtype().size() * table.dims().iter().product::<usize>(),
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

    /// `rows x cols` random blocks of `ty` with finite scales (every byte pattern of the values,
    /// `-128` in Q8_0 included).
    fn random_blocks(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> BlockMatrix {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let len = ty.bytes_for(rows * cols).expect("whole blocks");
        let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        let mut scale = |block: &mut [u8], at: usize| {
            let v = f16::from_f32(((next() % 1000) as f32 + 1.0) / 40_000.0 * if next() % 2 == 0 { 1.0 } else { -1.0 });
            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
        };
        for block in bytes.chunks_exact_mut(ty.block_bytes()) {
            match ty {
                GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => scale(block, 0),
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
                    scale(block, 0);
                    scale(block, 2);
                }
                GgmlType::Q6_K => scale(block, 208),
                _ => unreachable!(),
            }
        }
        BlockMatrix { ggml_type: ty, rows, cols, bytes }
    }

    /// Every block format troupe reads (the quantized types of [`GgmlType::ALL`]).
    fn block_types() -> impl Iterator<Item = GgmlType> {
        GgmlType::ALL.into_iter().filter(|t| t.is_quantized())
    }

    #[test]
    fn every_instruction_set_gives_the_portable_products_bit_for_bit() {
        let levels = Level::available();
        eprintln!("levels on this CPU: {levels:?}");
        // 768 columns: three K-quant super-blocks, 24 blocks of 32 (three groups of eight), and
        // 800 for a group cut short (25 blocks).
        for (ty, cols) in block_types().flat_map(|t| [(t, 768usize), (t, 800)]) {
            if !cols.is_multiple_of(ty.block_size()) {
                continue;
            }
            let w = QuantizedWeight::new(vec![random_blocks(ty, 37, cols, 1), random_blocks(ty, 5, cols, 2)]);
            for m in [1, 4, 16] {
                let mut x = matrix(m, cols, 5);
                // Extreme activations: a block of one sign at full scale, and a zero block.
                x[..32].iter_mut().for_each(|v| *v = -3.0);
                x[32..64].iter_mut().for_each(|v| *v = 0.0);
                let portable = w.fused_xwt_on(Level::Scalar, &x, m);
                for &level in &levels {
                    let got = w.fused_xwt_on(level, &x, m);
                    let same = portable.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} m {m}: {level:?} differs from the portable products", ty.name());
                }
            }
        }
    }

    #[test]
    fn integer_products_are_the_dequantized_weights_times_the_quantized_inputs() {
        // Exactly what the blocks and the 16-bit inputs encode, summed in f64: only the float
        // step's rounding separates the two.
        let (rows, cols) = (9, 512);
        for ty in block_types() {
            let w = QuantizedWeight::new(vec![random_blocks(ty, rows, cols, 7)]);
            let dense = w.dequantize();
            let m = 3;
            let x = matrix(m, cols, 11);
            let xq = Q16Activations::quantize(&x, cols);
            let got = w.fused_xwt(&x, m);
            for i in 0..m {
                for r in 0..rows {
                    let (mut want, mut scale) = (0.0f64, 0.0f64);
                    for k in 0..cols {
                        // Q6_K has no integer product: it multiplies the f32 inputs.
                        let xv = if ty == GgmlType::Q6_K {
                            x[i * cols + k] as f64
                        } else {
                            xq.row_scales(i).0[k / 32] as f64 * xq.q[i * cols + k] as f64
                        };
                        want += xv * dense[r * cols + k] as f64;
                        scale += (xv * dense[r * cols + k] as f64).abs();
                    }
                    let err = (got[i * rows + r] as f64 - want).abs();
                    assert!(err <= 1e-6 * scale.max(1.0), "{} [{i}, {r}]: {} vs {want}", ty.name(), got[i * rows + r]);
                }
            }
        }
    }

    #[test]
    fn regrouped_rows_hold_the_stored_blocks_and_dequantize_alike() {
        // 25 blocks a row: three whole groups and one of a single block.
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
            let stored = random_blocks(ty, 3, 800, 3);
            let w = QuantizedWeight::new(vec![stored.clone()]);
            let regrouped = &w.parts[0].bytes;
            assert_ne!(regrouped, &stored.bytes, "{}", ty.name());
            let width = stored.row_bytes();
            let mut block = vec![0u8; ty.block_bytes()];
            for r in 0..3 {
                for (b, want) in stored.bytes[r * width..(r + 1) * width].chunks_exact(ty.block_bytes()).enumerate() {
                    int_dot::ungroup_block(ty, &regrouped[r * width..(r + 1) * width], b, &mut block);
                    assert_eq!(block, want, "{} row {r} block {b}", ty.name());
                }
            }
            let same = w.dequantize().iter().zip(stored.dequantize()).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{}", ty.name());
        }
    }

    #[test]
    fn inline_f16_conversion_is_exact() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32();
            let got = rows::f16_at(&h.to_le_bytes(), 0);
            assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()), "{h:#06x}: {got} vs {want}");
        }
    }

    #[test]
    fn fused_product_matches_the_dequantized_one() {
        // The 16-bit inputs move each product by at most half a step per input value:
        // |sum w (x - d q)| <= sum |w| d / 2.
        let (rows, cols) = (70, 96);
        let parts = vec![quantize_q8_0(&matrix(40, cols, 3), 40, cols), quantize_q8_0(&matrix(30, cols, 4), 30, cols)];
        let w = QuantizedWeight::new(parts);
        let dense = w.dequantize();
        for m in [1, 3, 16] {
            let x = matrix(m, cols, 9);
            let xq = Q16Activations::quantize(&x, cols);
            let fused = w.fused_xwt(&x, m);
            for i in 0..m {
                for r in 0..rows {
                    let want: f32 = (0..cols).map(|k| x[i * cols + k] * dense[r * cols + k]).sum();
                    let bound: f32 =
                        (0..cols).map(|k| dense[r * cols + k].abs() * xq.row_scales(i).0[k / 32] / 2.0).sum();
                    let got = fused[i * rows + r];
                    assert!((want - got).abs() <= bound + 1e-5, "m {m} [{i}, {r}]: {got} vs {want} (bound {bound})");
                }
            }
        }
    }
}
