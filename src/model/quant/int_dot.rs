//! Weight rows in block formats dotted with [`super::activations::Q16Activations`] in integers,
//! as llama.cpp's `ggml_vec_dot_*_q8_*` do with 8-bit inputs: per 32-value block the exact `i32`
//! sum of weight times activation values, then one float step per block.
//!
//! The definition ([`row_dot_scalar`]): block `b` contributes
//! `t = (d_w * d_x) * isum` (plus `m_w * s_x` for the formats with a minimum) to lane `b % 8` of
//! eight f32 accumulators, which are added at the end as
//! `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`. The SIMD versions in [`super::x86`],
//! chosen at run time ([`Level`]), compute the same exact integer sums and the same float
//! operations lane for lane (no fused multiply-add), so every level gives the same products bit
//! for bit.
//!
//! Q8_0, Q4_0 and Q4_1 are held regrouped ([`regroup`], once at load): each eight blocks of a row
//! keep their bytes, but with their f16 scales side by side ahead of their values, so that the
//! SIMD products convert eight scales with one `vcvtph2ps` and read the values in place (Q4_0 and
//! Q4_1 are unpacked to one byte per value once per weight row when several input rows share it).
//! Q5_0, Q5_1, Q4_K and Q5_K are held as stored, and [`prepare_row`] converts each row's scales to
//! f32 and unpacks its values (every 32-value sub-block of a K-quant super-block is then a block
//! with `d_w = d * scale` and `m_w = -(dmin * min)`, as ggml dequantizes it). Q6_K (16-value
//! scales) and the float types have no integer product here.

use super::activations::{padded, BLOCK};
use super::rows::{f16_at, GroupLayout, InputRow, IntForm, Scales, WeightRow};
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

/// How a format is multiplied: its form, the offset its unsigned values carry (the weight's
/// integer is `q - offset`) and whether it has a per-block minimum; `None` for the formats
/// without an integer product.
pub fn int_form(ty: GgmlType) -> Option<(IntForm, i32, bool)> {
    match ty {
        GgmlType::Q8_0 => Some((IntForm::Q8_0, 0, false)),
        GgmlType::Q4_0 => Some((IntForm::Nibbles, 8, false)),
        GgmlType::Q4_1 => Some((IntForm::Nibbles, 0, true)),
        GgmlType::Q5_0 => Some((IntForm::Unpacked, 16, false)),
        GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => Some((IntForm::Unpacked, 0, true)),
        _ => None,
    }
}

/// `bytes`, `rows` rows of `ty` as ggml stores them, regrouped ([`GroupLayout`]): the same
/// bytes, moved. `ty` must have a [`GroupLayout`].
pub fn regroup(ty: GgmlType, bytes: &[u8], rows: usize) -> Vec<u8> {
    let layout = GroupLayout::of(ty).expect("a regrouped format");
    let (bb, scales) = (layout.block_bytes, layout.scales());
    let mut out = vec![0u8; bytes.len()];
    if rows == 0 || bytes.is_empty() {
        return out;
    }
    let width = bytes.len() / rows;
    let nb = width / bb;
    for (row, dst) in bytes.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        for (b, block) in row.chunks_exact(bb).enumerate() {
            for s in 0..scales {
                let at = layout.block_scale_at(nb, b, s);
                dst[at..at + 2].copy_from_slice(&block[2 * s..2 * s + 2]);
            }
            let at = layout.block_values_at(nb, b);
            dst[at..at + layout.payload].copy_from_slice(&block[2 * scales..]);
        }
    }
    out
}

/// Block `b` of a regrouped row of `ty`, as ggml stores it, into `out` (`ty.block_bytes()`).
pub fn ungroup_block(ty: GgmlType, row: &[u8], b: usize, out: &mut [u8]) {
    let layout = GroupLayout::of(ty).expect("a regrouped format");
    let (bb, scales) = (layout.block_bytes, layout.scales());
    let nb = row.len() / bb;
    for s in 0..scales {
        let at = layout.block_scale_at(nb, b, s);
        out[2 * s..2 * s + 2].copy_from_slice(&row[at..at + 2]);
    }
    let at = layout.block_values_at(nb, b);
    out[2 * scales..bb].copy_from_slice(&row[at..at + layout.payload]);
}

/// One weight row's f32 scales and unpacked values (one per parallel task, reused row after row).
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

/// Row `bytes` of type `ty` (regrouped for Q8_0, Q4_0 and Q4_1) ready to be dotted with `inputs`
/// input rows: where its form needs it, its scales in f32 and its values unpacked into `scratch`
/// (on `level`; every level writes the same values).
pub fn prepare_row<'a>(
    level: Level,
    ty: GgmlType,
    bytes: &'a [u8],
    inputs: usize,
    scratch: &'a mut Scratch,
) -> WeightRow<'a> {
    let (mut form, offset, has_min) = int_form(ty).expect("a format with an integer product");
    let scales = match GroupLayout::of(ty) {
        Some(layout) => {
            // Nibbles unpacked once rather than once per input row.
            if form == IntForm::Nibbles && inputs > 1 {
                let nb = bytes.len() / layout.block_bytes;
                unpack_nibbles(level, bytes, layout, &mut scratch.unpacked[..nb * BLOCK]);
                form = IntForm::Unpacked;
            }
            Scales::Grouped(layout)
        }
        None => {
            unpack(ty, bytes, scratch);
            Scales::F32 { dw: &scratch.dw, mw: &scratch.mw }
        }
    };
    WeightRow { bytes, form, offset, has_min, unpacked: &scratch.unpacked, scales }
}

/// The 32 values of every block of a regrouped Q4_0 / Q4_1 row (value j the low nibble of byte
/// j, value j + 16 its high nibble) into `out`.
fn unpack_nibbles(level: Level, bytes: &[u8], layout: GroupLayout, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        // SAFETY: every level above `Scalar` was detected with avx2.
        unsafe { super::x86::unpack_nibbles(bytes, layout, out) };
        return;
    }
    let _ = level;
    let nb = out.len() / BLOCK;
    for (b, values) in out.chunks_exact_mut(BLOCK).enumerate() {
        let at = layout.block_values_at(nb, b);
        let q = &bytes[at..at + 16];
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

/// Consecutive rows of a regrouped `ty` (`bytes`, `out.len()` rows of equal width) each dotted
/// with the one input row `x`, into `out`, on `level`: [`rows_dot`] row by row, with the loop
/// over the rows inside the SIMD code.
pub fn rows_dot_one(level: Level, ty: GgmlType, bytes: &[u8], x: &InputRow<'_>, out: &mut [f32]) {
    let (form, offset, has_min) = int_form(ty).expect("a format with an integer product");
    let layout = GroupLayout::of(ty).expect("a regrouped format");
    let w = WeightRow { bytes: &[], form, offset, has_min, unpacked: &[], scales: Scales::Grouped(layout) };
    let width = bytes.len() / out.len().max(1);
    match level {
        // SAFETY: `Level::Avx2` is only made by `Level::detect` / `available` after
        // `is_x86_feature_detected!` found avx2 and f16c.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { super::x86::rows_one_avx2(&w, bytes, width, x, out) },
        // SAFETY: `Level::Avx512Vnni` is only made after `is_x86_feature_detected!` found avx2,
        // f16c, avx512vnni and avx512vl.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512Vnni => unsafe { super::x86::rows_one_vnni(&w, bytes, width, x, out) },
        _ => {
            for (row, o) in bytes.chunks_exact(width.max(1)).zip(out) {
                *o = row_dot_scalar(&WeightRow { bytes: row, ..w }, x);
            }
        }
    }
}

/// Block `b`'s exact integer sum of `w`'s values (offset not applied) times `x`'s.
#[inline(always)]
fn block_sum(w: &WeightRow<'_>, x: &[i16], b: usize) -> i32 {
    let nb = x.len() / BLOCK;
    let xb = &x[b * BLOCK..(b + 1) * BLOCK];
    let mut acc = 0i32;
    match w.form {
        IntForm::Q8_0 => {
            let at = w.values_at(nb, b);
            let q = &w.bytes[at..at + 32];
            for l in 0..BLOCK {
                acc += (q[l] as i8) as i32 * xb[l] as i32;
            }
        }
        IntForm::Nibbles => {
            let at = w.values_at(nb, b);
            let q = &w.bytes[at..at + 16];
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
    let nb = x.q.len() / BLOCK;
    for b in 0..nb {
        let isum = block_sum(w, x.q, b) - w.offset * x.sums[b];
        let (dw, mw) = w.block_scales(nb, b);
        let mut t = (dw * x.d[b]) * isum as f32;
        if w.has_min {
            t += mw * x.s[b];
        }
        acc[b % 8] += t;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}
