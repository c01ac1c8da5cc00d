//! Weight rows in block formats dotted with [`Q8Activations`] in integers, as llama.cpp's
//! `ggml_vec_dot_*_q8_*` do: per 32-value block the exact `i32` sum of weight times activation
//! bytes, then one float step per block, `acc += (d_w * d_x) * isum (+ m_w * s_x)`.
//!
//! The integer sums have a portable scalar definition here and SIMD versions in [`super::x86`]
//! chosen at run time ([`Level`]); they are exact, so every level gives the same sums, and the
//! float step is one function ([`combine`]) shared by all levels: the products are identical, bit
//! for bit, whatever the CPU.
//!
//! Formats: Q8_0, Q4_0 and Q4_1 are read in place; Q5_0, Q5_1, Q4_K and Q5_K are first unpacked,
//! once per weight row, into one byte per value (every 32-value sub-block of a K-quant super-block
//! is then a block with its own `d_w = d * scale` and `m_w = -dmin * min`). Q6_K (16-value scales)
//! and the float types have no integer product here.

use super::activations::{Q8Activations, BLOCK};
use crate::model::gguf::dequant::{scale_min_k4, GgmlType, QK_K};

/// The instruction set the integer sums run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2.
    Avx2,
    /// x86-64 AVX-512 VNNI on 256-bit registers (AVX512VL).
    Avx512Vnni,
}

impl Level {
    /// The best level this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx2")
            {
                return Level::Avx512Vnni;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Level::Avx2;
            }
        }
        Level::Scalar
    }

    /// Every level this CPU runs, the portable one first.
    pub fn available() -> Vec<Self> {
        let best = Self::detect();
        [Level::Scalar, Level::Avx2, Level::Avx512Vnni].into_iter().filter(|l| *l as u8 <= best as u8).collect()
    }
}

/// How a block format's weight row is dotted in integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntForm {
    /// Q8_0 in place: signed bytes.
    Q8_0,
    /// Q4_0 / Q4_1 in place: `stride`-byte blocks, 16 bytes of nibbles at `at`.
    Nibbles {
        /// Bytes per block.
        stride: usize,
        /// Where the nibbles start in a block.
        at: usize,
    },
    /// Unpacked to one unsigned byte per value first.
    Unpacked,
}

/// A weight row's per-block scales and the form of its values, ready for [`row_dot`].
pub struct PreparedRow<'a> {
    /// The row's bytes as stored.
    pub bytes: &'a [u8],
    /// How its values are read.
    pub form: IntForm,
    /// `q - offset` is the weight's integer (8 for Q4_0, 16 for Q5_0, else 0).
    pub offset: i32,
    /// Whether the format has a per-block minimum (`m_w`).
    pub has_min: bool,
}

/// Whether `ty` has an integer product, and the offset its unsigned values carry.
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

/// An f16 stored little-endian at `bytes[at..at + 2]`, as f32.
#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Per-row work buffers (one per parallel task).
#[derive(Debug, Default)]
pub struct Scratch {
    /// `[blocks]`: `d_w` per 32-value block.
    pub dw: Vec<f32>,
    /// `[blocks]`: `m_w` per 32-value block (formats with a minimum).
    pub mw: Vec<f32>,
    /// `[blocks]`: the integer sums of one row with one input.
    pub isums: Vec<i32>,
    /// `[cols]`: an unpacked row.
    pub unpacked: Vec<u8>,
}

impl Scratch {
    /// Buffers for rows of `cols` values.
    pub fn new(cols: usize) -> Self {
        let nb = cols / BLOCK;
        Self { dw: vec![0.0; nb], mw: vec![0.0; nb], isums: vec![0; nb], unpacked: vec![0; cols] }
    }
}

/// Reads row `bytes` of type `ty` into `scratch` (its scales, and its values where the format is
/// unpacked): the part of the product shared by every input row.
pub fn prepare_row(ty: GgmlType, bytes: &[u8], scratch: &mut Scratch) {
    let Scratch { dw, mw, unpacked, .. } = scratch;
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 => {
            let stride = ty.block_bytes();
            for (b, d) in dw.iter_mut().enumerate() {
                *d = f16_at(bytes, b * stride);
            }
        }
        GgmlType::Q4_1 => {
            for b in 0..dw.len() {
                (dw[b], mw[b]) = (f16_at(bytes, b * 20), f16_at(bytes, b * 20 + 2));
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (stride, qh_at) = if ty == GgmlType::Q5_0 { (22, 2) } else { (24, 4) };
            for b in 0..dw.len() {
                let block = &bytes[b * stride..(b + 1) * stride];
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
            let stride = ty.block_bytes();
            for (s, block) in bytes.chunks_exact(stride).enumerate() {
                let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
                let scales = &block[4..16];
                let (qh, qs) = if ty == GgmlType::Q5_K { (&block[16..48], &block[48..176]) } else { (&[][..], &block[16..144]) };
                for sub in 0..QK_K / BLOCK {
                    // As ggml's dequantization: `(d * sc) * q - dmin * m`.
                    let (sc, m) = scale_min_k4(sub, scales);
                    let b = s * (QK_K / BLOCK) + sub;
                    dw[b] = d * sc as f32;
                    mw[b] = -(dmin * m as f32);
                    let q = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
                    let out = &mut unpacked[b * BLOCK..(b + 1) * BLOCK];
                    for l in 0..BLOCK {
                        let nibble = if sub % 2 == 0 { q[l] & 0x0F } else { q[l] >> 4 };
                        let high = if qh.is_empty() { 0 } else { ((qh[l] >> sub) & 1) << 4 };
                        out[l] = nibble | high;
                    }
                }
            }
        }
        _ => unreachable!("{} has no integer product (int_form is None)", ty.name()),
    }
}

/// The row's integer block sums with input row `x`, into `isums` (offset not yet applied).
pub fn block_sums(level: Level, row: &PreparedRow<'_>, unpacked: &[u8], x: &[i8], isums: &mut [i32]) {
    match level {
        Level::Scalar => scalar_sums(row, unpacked, x, isums),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => {
            use super::x86::*;
            // SAFETY: `Level::Avx2` is only made by `Level::detect` / `available` after
            // `is_x86_feature_detected!("avx2")`.
            unsafe {
                match row.form {
                    IntForm::Q8_0 => q8_0_avx2(row.bytes, x, isums),
                    IntForm::Nibbles { stride, at } => nibbles_avx2(row.bytes, stride, at, x, isums),
                    IntForm::Unpacked => u8_avx2(unpacked, x, isums),
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Level::Avx512Vnni => {
            use super::x86::*;
            // SAFETY: `Level::Avx512Vnni` is only made after `is_x86_feature_detected!` found
            // avx2, avx512vnni and avx512vl.
            unsafe {
                match row.form {
                    IntForm::Q8_0 => q8_0_vnni(row.bytes, x, isums),
                    IntForm::Nibbles { stride, at } => nibbles_vnni(row.bytes, stride, at, x, isums),
                    IntForm::Unpacked => u8_vnni(unpacked, x, isums),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => scalar_sums(row, unpacked, x, isums),
    }
}

/// The portable definition of [`block_sums`].
fn scalar_sums(row: &PreparedRow<'_>, unpacked: &[u8], x: &[i8], isums: &mut [i32]) {
    for (b, sum) in isums.iter_mut().enumerate() {
        let xb = &x[b * BLOCK..(b + 1) * BLOCK];
        let mut acc = 0i32;
        match row.form {
            IntForm::Q8_0 => {
                let q = &row.bytes[b * 34 + 2..b * 34 + 34];
                for l in 0..BLOCK {
                    acc += (q[l] as i8) as i32 * xb[l] as i32;
                }
            }
            IntForm::Nibbles { stride, at } => {
                let q = &row.bytes[b * stride + at..b * stride + at + 16];
                for l in 0..16 {
                    acc += (q[l] & 0x0F) as i32 * xb[l] as i32 + (q[l] >> 4) as i32 * xb[l + 16] as i32;
                }
            }
            IntForm::Unpacked => {
                let q = &unpacked[b * BLOCK..(b + 1) * BLOCK];
                for l in 0..BLOCK {
                    acc += q[l] as i32 * xb[l] as i32;
                }
            }
        }
        *sum = acc;
    }
}

/// The float step, shared by every level: per block `(d_w * d_x) * isum (+ m_w * s_x)`, summed
/// in eight lanes (block b in lane b % 8) and the lanes added in a fixed order.
#[inline(always)]
pub fn combine(dw: &[f32], mw: Option<&[f32]>, dx: &[f32], sx: &[f32], isums: &[i32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let nb = isums.len();
    for b in 0..nb {
        let mut t = (dw[b] * dx[b]) * isums[b] as f32;
        if let Some(mw) = mw {
            t += mw[b] * sx[b];
        }
        acc[b % 8] += t;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// One prepared weight row dotted with activation row `i`.
pub fn row_dot(level: Level, row: &PreparedRow<'_>, scratch: &mut Scratch, xq: &Q8Activations, i: usize) -> f32 {
    let Scratch { dw, mw, isums, unpacked } = scratch;
    block_sums(level, row, unpacked, xq.row(i), isums);
    let (dx, sx, sums) = xq.row_scales(i);
    if row.offset != 0 {
        for (s, x) in isums.iter_mut().zip(sums) {
            *s -= row.offset * x;
        }
    }
    combine(dw, row.has_min.then_some(&mw[..]), dx, sx, isums)
}
