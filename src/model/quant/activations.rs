//! Input rows quantized to 16 bits per 32-value block, the way llama.cpp quantizes the
//! activations it multiplies with block-format weights (`quantize_row_q8_1`) but with 16-bit
//! values: per block `d = max|x| / 32767`, `q = round(x / d)` in `-32767..=32767`, and the block's
//! integer sum for the formats whose weights carry an offset or a minimum; `d` stays f32.
//!
//! Why 16 bits and not llama.cpp's 8: the hidden states of real models carry outlier channels
//! and a block's step is its largest value / 127, so 8-bit inputs
//! flatten the other 31 values of an outlier's block. Measured on SmolLM2-135M-Instruct, 8-bit
//! inputs moved log-probs by up to 0.32 from transformers (the LM head alone by 0.14) and changed
//! greedy tokens; 16-bit inputs stay within the f32 base's tolerance (`tests/gguf_smollm2.rs`),
//! at the cost of two 16-bit multiply-adds per 32 values instead of one 8-bit one.
//!
//! One scalar implementation only: quantizing costs `m * cols` operations against the product's
//! `m * cols * rows`, and a single implementation makes every instruction set see the same bytes.

/// The largest quantized magnitude.
const MAX_Q: f32 = 32767.0;

/// Values per activation block (the block size of every 32-value weight format, and the
/// sub-block size of Q4_K / Q5_K).
pub const BLOCK: usize = 32;

/// `[m, cols]` input rows as 16-bit blocks.
#[derive(Clone, Debug, Default)]
pub struct Q16Activations {
    /// `[m, cols]`: the quantized values.
    pub q: Vec<i16>,
    /// `[m, padded_blocks]`: each block's scale `d` (zero in the padding).
    pub d: Vec<f32>,
    /// `[m, padded_blocks]`: each block's `d * sum(q)`, what a weight block's minimum multiplies.
    pub s: Vec<f32>,
    /// `[m, padded_blocks]`: each block's `sum(q)`, what a weight block's integer offset multiplies.
    pub sums: Vec<i32>,
    /// Values per row (a multiple of 32).
    pub cols: usize,
}

/// `blocks` rounded up to whole groups of eight (the SIMD products read scales eight at a time).
pub fn padded(blocks: usize) -> usize {
    blocks.div_ceil(8) * 8
}

impl Q16Activations {
    /// Quantizes `x` (`[m, cols]`, row-major, `cols` a multiple of 32).
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        debug_assert!(cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols.max(1)));
        let (nb, rows) = (cols / BLOCK, x.len().checked_div(cols).unwrap_or(0));
        let stride = padded(nb);
        let mut out = Self {
            q: vec![0; x.len()],
            d: vec![0.0; rows * stride],
            s: vec![0.0; rows * stride],
            sums: vec![0; rows * stride],
            cols,
        };
        for (index, (block, q)) in x.chunks_exact(BLOCK).zip(out.q.chunks_exact_mut(BLOCK)).enumerate() {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / MAX_Q;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, v) in q.iter_mut().zip(block) {
                // Clamped: `x * (1 / d)` may round a hair past the largest value.
                let v = (v * id).round().clamp(-MAX_Q, MAX_Q) as i16;
                *q = v;
                sum += v as i32;
            }
            let at = index / nb * stride + index % nb;
            (out.d[at], out.s[at], out.sums[at]) = (d, d * sum as f32, sum);
        }
        out
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols / BLOCK
    }

    /// Row `i`'s values.
    pub fn row(&self, i: usize) -> &[i16] {
        &self.q[i * self.cols..(i + 1) * self.cols]
    }

    /// Row `i`'s block scales, block `d * sum(q)` and block sums (`padded(blocks)` each, zero
    /// past `blocks`).
    pub fn row_scales(&self, i: usize) -> (&[f32], &[f32], &[i32]) {
        let stride = padded(self.blocks());
        let range = i * stride..(i + 1) * stride;
        (&self.d[range.clone()], &self.s[range.clone()], &self.sums[range])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_to_within_half_a_step() {
        let x: Vec<f32> = (0..96).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let a = Q16Activations::quantize(&x, 96);
        assert_eq!((a.blocks(), a.d.len()), (3, 8));
        for (b, block) in x.chunks(32).enumerate() {
            let d = a.d[b];
            let q = &a.row(0)[b * 32..(b + 1) * 32];
            assert_eq!(q.iter().map(|v| v.unsigned_abs()).max(), Some(32767));
            for (v, q) in block.iter().zip(q) {
                assert!((v - d * *q as f32).abs() <= 0.5 * d * 1.0001, "{v} vs {q} * {d}");
            }
            assert_eq!(a.sums[b], q.iter().map(|v| *v as i32).sum::<i32>());
        }
        // A zero block stays zero, with a zero scale.
        let z = Q16Activations::quantize(&[0.0; 32], 32);
        assert_eq!((z.d[0], z.sums[0]), (0.0, 0));
    }
}
