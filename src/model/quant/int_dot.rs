//! Weight rows in block formats dotted with [`Q16Activations`] in integers, as llama.cpp's
//! `ggml_vec_dot_*_q8_*` do with 8-bit inputs: per 32-value block the exact `i32` sum of weight
//! times activation values, then one float step per block.
//!
//! The definition ([`row_dot_scalar`]): block `b` contributes
//! `t = (d_w * d_x) * isum` (plus `m_w * s_x` for the formats with a minimum) to lane `b % 8` of
//! eight f32 accumulators, which are added at the end as
//! `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`. The SIMD versions in [`super::x86`],
//! chosen at run time ([`Level`]), compute the same exact integer sums and the same float
//! operations lane for lane (no fused multiply-add), so every level gives the same products bit
//! for bit.
//!
//! Once per weight row, whatever the number of input rows, [`prepare_row`] converts the row's
//! scales to f32 and, where the values are not bytes in place, unpacks them to one byte per value:
//! Q8_0 is read in place; Q4_0 and Q4_1 in place for one input row and unpacked for several;
//! Q5_0, Q5_1, Q4_K and Q5_K always unpacked (every 32-value sub-block of a K-quant super-block
//! is then a block with `d_w = d * scale` and `m_w = -(dmin * min)`, as ggml dequantizes it). Q6_K
//! (16-value scales) and the float types have no integer product here.

use super::activations::{padded, Q16Activations, BLOCK};
use crate::model::gguf::dequant::{scale_min_k4, GgmlType, QK_K};

/// The instruction set the integer products run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2 (with F16C).
    Avx2,
    /// x86-64 AVX-512 VNNI on 256-bit registers (with AVX512VL, AVX2, F16C).
    Avx512Vnni,
}

impl Level {
    /// The best level this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("f16c") {
                if has!("avx512vnni") && has!("avx512vl") {
                    return Level::Avx512Vnni;
                }
                return Level::Avx2;
            }
        }
        Level::Scalar
    }

    /// Every level this CPU runs, the portable one first.
    pub fn available() -> Vec<Self> {
        let best = Self::detect();
        [Level::Scalar, Level::Avx2, Level::Avx512Vnni].into_iter().filter(|l| *l <= best).collect()
    }
}

/// How a block format's weight row is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntForm {
    /// Q8_0 in place: 34-byte blocks, signed bytes at 2.
    Q8_0,
    /// Q4_0 / Q4_1 in place: `stride`-byte blocks, 16 bytes of nibbles at `at` (value j the low
    /// nibble of byte j, value j + 16 its high nibble).
    Nibbles {
        /// Bytes per block.
        stride: usize,
        /// Where the nibbles start in a block.
        at: usize,
    },
    /// Unpacked by [`prepare_row`] to one unsigned byte per value and f32 scales.
    Unpacked,
}

/// How a format is multiplied: its form, the offset its unsigned values carry (the weight's
/// integer is `q - offset`) and whether it has a per-block minimum; `None` for the formats
/// without an integer product.
pub fn int_form(ty: GgmlType) -> Option<(IntForm, i32, bool)> {
    match ty {
        GgmlType::Q8_0 => Some((IntForm::Q8_0, 0, false)),
        GgmlType::Q4_0 => Some((IntForm::Nibbles { stride: 18, at: 2 }, 8, false)),
        GgmlType::Q4_1 => Some((IntForm::Nibbles { stride: 20, at: 4 }, 0, true)),
        GgmlType::Q5_0 => Some((IntForm::Unpacked, 16, false)),
        GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => Some((IntForm::Unpacked, 0, true)),
        _ => None,
    }
}

/// One weight row, ready to be dotted.
#[derive(Clone, Copy, Debug)]
pub struct WeightRow<'a> {
    /// The row's bytes as stored (in-place forms).
    pub bytes: &'a [u8],
    /// How its values are read.
    pub form: IntForm,
    /// The weight's integer is `q - offset` (8 for Q4_0, 16 for Q5_0, else 0).
    pub offset: i32,
    /// Whether the format has a per-block minimum.
    pub has_min: bool,
    /// `[cols]`: the unpacked values (`IntForm::Unpacked`).
    pub unpacked: &'a [u8],
    /// `[padded(blocks)]`: `d_w` per block, zero in the padding.
    pub dw: &'a [f32],
    /// `[padded(blocks)]`: `m_w` per block (formats with a minimum), zero in the padding.
    pub mw: &'a [f32],
}

/// One input row in 16-bit blocks.
#[derive(Clone, Copy, Debug)]
pub struct InputRow<'a> {
    /// `[cols]`: the values.
    pub q: &'a [i16],
    /// `[padded(blocks)]`: the scales `d_x`, zero in the padding.
    pub d: &'a [f32],
    /// `[padded(blocks)]`: `s_x = d_x * sum(q)`.
    pub s: &'a [f32],
    /// `[padded(blocks)]`: `sum(q)`.
    pub sums: &'a [i32],
}

impl<'a> InputRow<'a> {
    /// Row `i` of `xq`.
    pub fn of(xq: &'a Q16Activations, i: usize) -> Self {
        let (d, s, sums) = xq.row_scales(i);
        Self { q: xq.row(i), d, s, sums }
    }
}

/// An f16 stored little-endian at `bytes[at..at + 2]`, as f32, converted inline: the f16's
/// exponent and mantissa moved into an f32's place and scaled by 2^112, exact for normal and
/// subnormal values alike (as F16C's `vcvtph2ps`), with infinities and NaNs kept.
#[inline(always)]
pub fn f16_at(bytes: &[u8], at: usize) -> f32 {
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

/// One weight row's scales and unpacked values (one per parallel task, reused row after row).
#[derive(Debug, Default)]
pub struct Scratch {
    /// `[padded(blocks)]`: `d_w` per block.
    pub dw: Vec<f32>,
    /// `[padded(blocks)]`: `m_w` per block.
    pub mw: Vec<f32>,
    /// `[cols]`: the unpacked values.
    pub unpacked: Vec<u8>,
}

impl Scratch {
    /// Buffers for rows of `cols` values.
    pub fn new(cols: usize) -> Self {
        let nb = padded(cols / BLOCK);
        Self { dw: vec![0.0; nb], mw: vec![0.0; nb], unpacked: vec![0; cols] }
    }
}

/// Row `bytes` of type `ty` ready to be dotted with `inputs` input rows: its scales in f32 and,
/// where its form needs it, its values unpacked, in `scratch` (on `level`; every level writes the
/// same values).
pub fn prepare_row<'a>(
    level: Level,
    ty: GgmlType,
    bytes: &'a [u8],
    inputs: usize,
    scratch: &'a mut Scratch,
) -> WeightRow<'a> {
    let (mut form, offset, has_min) = int_form(ty).expect("a format with an integer product");
    let nb = bytes.len() / ty.block_bytes() * (ty.block_size() / BLOCK);
    match form {
        IntForm::Q8_0 => f16_scales(level, bytes, 34, 0, &mut scratch.dw[..nb]),
        IntForm::Nibbles { stride, at } => {
            f16_scales(level, bytes, stride, 0, &mut scratch.dw[..nb]);
            if has_min {
                f16_scales(level, bytes, stride, 2, &mut scratch.mw[..nb]);
            }
            // Unpacked once rather than once per input row.
            if inputs > 1 {
                unpack_nibbles(level, bytes, stride, at, &mut scratch.unpacked[..nb * BLOCK]);
                form = IntForm::Unpacked;
            }
        }
        IntForm::Unpacked => unpack(ty, bytes, scratch),
    }
    WeightRow { bytes, form, offset, has_min, unpacked: &scratch.unpacked, dw: &scratch.dw, mw: &scratch.mw }
}

/// The f16 at byte `at` of every `stride`-byte block of `bytes`, as f32, into `out`.
fn f16_scales(level: Level, bytes: &[u8], stride: usize, at: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        // SAFETY: every level above `Scalar` was detected with avx2 and f16c.
        unsafe { super::x86::f16_scales(bytes, stride, at, out) };
        return;
    }
    let _ = level;
    for (b, d) in out.iter_mut().enumerate() {
        *d = f16_at(bytes, b * stride + at);
    }
}

/// The 32 values of every Q4_0 / Q4_1 block (16 bytes of nibbles at `at` of each `stride`-byte
/// block; value j the low nibble of byte j, value j + 16 its high nibble) into `out`.
fn unpack_nibbles(level: Level, bytes: &[u8], stride: usize, at: usize, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        // SAFETY: every level above `Scalar` was detected with avx2.
        unsafe { super::x86::unpack_nibbles(bytes, stride, at, out) };
        return;
    }
    let _ = level;
    for (b, values) in out.chunks_exact_mut(BLOCK).enumerate() {
        let q = &bytes[b * stride + at..b * stride + at + 16];
        for j in 0..16 {
            values[j] = q[j] & 0x0F;
            values[j + 16] = q[j] >> 4;
        }
    }
}

/// The values and scales of a Q5_0 / Q5_1 / Q4_K / Q5_K row, following ggml's dequantization.
fn unpack(ty: GgmlType, bytes: &[u8], scratch: &mut Scratch) {
    let Scratch { dw, mw, unpacked } = scratch;
    match ty {
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (stride, qh_at) = if ty == GgmlType::Q5_0 { (22, 2) } else { (24, 4) };
            for (b, block) in bytes.chunks_exact(stride).enumerate() {
                dw[b] = f16_at(block, 0);
                if ty == GgmlType::Q5_1 {
                    mw[b] = f16_at(block, 2);
                }
                let qh = u32::from_le_bytes([block[qh_at], block[qh_at + 1], block[qh_at + 2], block[qh_at + 3]]);
                let qs = &block[qh_at + 4..qh_at + 20];
                let out = &mut unpacked[b * BLOCK..(b + 1) * BLOCK];
                for j in 0..16 {
                    out[j] = (qs[j] & 0x0F) | ((((qh >> j) & 1) << 4) as u8);
                    out[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) << 4) as u8);
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let subs = QK_K / BLOCK;
            for (s, block) in bytes.chunks_exact(ty.block_bytes()).enumerate() {
                let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
                let scales = &block[4..16];
                let (qh, qs) =
                    if ty == GgmlType::Q5_K { (&block[16..48], &block[48..176]) } else { (&[][..], &block[16..144]) };
                for sub in 0..subs {
                    let (sc, m) = scale_min_k4(sub, scales);
                    let b = s * subs + sub;
                    dw[b] = d * sc as f32;
                    mw[b] = -(dmin * m as f32);
                    let q = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
                    let shift = 4 * (sub % 2);
                    let out = &mut unpacked[b * BLOCK..(b + 1) * BLOCK];
                    for l in 0..BLOCK {
                        let high = if qh.is_empty() { 0 } else { ((qh[l] >> sub) & 1) << 4 };
                        out[l] = ((q[l] >> shift) & 0x0F) | high;
                    }
                }
            }
        }
        _ => unreachable!("{} is not an unpacked form", ty.name()),
    }
}

/// `w` dotted with every row of `xs`, into `out`, on `level`.
pub fn rows_dot(level: Level, w: &WeightRow<'_>, xs: &[InputRow<'_>], out: &mut [f32]) {
    match level {
        Level::Scalar => {
            for (x, o) in xs.iter().zip(out) {
                *o = row_dot_scalar(w, x);
            }
        }
        // SAFETY: `Level::Avx2` is only made by `Level::detect` / `available` after
        // `is_x86_feature_detected!` found avx2 and f16c.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { super::x86::rows_dot_avx2(w, xs, out) },
        // SAFETY: `Level::Avx512Vnni` is only made after `is_x86_feature_detected!` found avx2,
        // f16c, avx512vnni and avx512vl.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512Vnni => unsafe { super::x86::rows_dot_vnni(w, xs, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => {
            for (x, o) in xs.iter().zip(out) {
                *o = row_dot_scalar(w, x);
            }
        }
    }
}

/// Block `b`'s exact integer sum of `w`'s values (offset not applied) times `x`'s.
#[inline(always)]
fn block_sum(w: &WeightRow<'_>, x: &[i16], b: usize) -> i32 {
    let xb = &x[b * BLOCK..(b + 1) * BLOCK];
    let mut acc = 0i32;
    match w.form {
        IntForm::Q8_0 => {
            let q = &w.bytes[b * 34 + 2..b * 34 + 34];
            for l in 0..BLOCK {
                acc += (q[l] as i8) as i32 * xb[l] as i32;
            }
        }
        IntForm::Nibbles { stride, at } => {
            let q = &w.bytes[b * stride + at..b * stride + at + 16];
            for l in 0..16 {
                acc += (q[l] & 0x0F) as i32 * xb[l] as i32 + (q[l] >> 4) as i32 * xb[l + 16] as i32;
            }
        }
        IntForm::Unpacked => {
            let q = &w.unpacked[b * BLOCK..(b + 1) * BLOCK];
            for l in 0..BLOCK {
                acc += q[l] as i32 * xb[l] as i32;
            }
        }
    }
    acc
}

/// The portable definition of the product (see the module documentation).
pub fn row_dot_scalar(w: &WeightRow<'_>, x: &InputRow<'_>) -> f32 {
    let mut acc = [0.0f32; 8];
    for b in 0..x.q.len() / BLOCK {
        let isum = block_sum(w, x.q, b) - w.offset * x.sums[b];
        let mut t = (w.dw[b] * x.d[b]) * isum as f32;
        if w.has_min {
            t += w.mw[b] * x.s[b];
        }
        acc[b % 8] += t;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}
