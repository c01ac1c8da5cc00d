//! [`super::int_dot`]'s row products on x86-64 SIMD: AVX2 (`vpmaddwd`) and AVX-512 VNNI
//! (`vpdpwssd` on 256-bit registers), F16C for the eight f16 scales of a regrouped group at once,
//! and the nibbles unpacked. The callers check the CPU's features first.
//!
//! A block's weights are widened to two vectors of 16 `i16`; its 32 products with the 16-bit
//! inputs land in eight `i32` lanes; eight blocks' vectors are reduced
//! together (two rounds of `vphaddd` and one cross-lane add) into one vector of eight exact block
//! sums, which then takes the float step of [`super::int_dot::row_dot_scalar`] in its eight lanes
//! (block b in lane b % 8), with the same operations in the same order: the result is the
//! portable one, bit for bit.

use std::arch::x86_64::*;

use super::activations::BLOCK;
use super::rows::{GroupLayout, InputRow, IntForm, Scales, WeightRow, GROUP};

/// `[sum(v0), sum(v1), sum(v2), sum(v3)]` of four eight-lane vectors.
#[target_feature(enable = "avx2")]
#[inline]
fn reduce4(v0: __m256i, v1: __m256i, v2: __m256i, v3: __m256i) -> __m128i {
    let s = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
}

/// A block's 32 weights (two vectors of 16 `i16`) times its 32 inputs, products summed in pairs
/// into eight `i32` lanes (exact: a pair is at most 2 * 128 * 32767).
#[target_feature(enable = "avx2")]
#[inline]
fn dot_avx2(w: (__m256i, __m256i), x: (__m256i, __m256i)) -> __m256i {
    _mm256_add_epi32(_mm256_madd_epi16(w.0, x.0), _mm256_madd_epi16(w.1, x.1))
}

/// [`dot_avx2`] in two `vpdpwssd`.
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
fn dot_vnni(w: (__m256i, __m256i), x: (__m256i, __m256i)) -> __m256i {
    _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w.0, x.0), w.1, x.1)
}

/// Sixteen unsigned bytes widened to `i16`.
#[target_feature(enable = "avx2")]
#[inline]
fn widen_u8(v: __m128i) -> __m256i {
    _mm256_cvtepu8_epi16(v)
}

/// 32 bytes at `bytes[at..at + 32]`.
#[target_feature(enable = "avx2")]
#[inline]
fn load32(bytes: &[u8], at: usize) -> __m256i {
    let chunk: &[u8; 32] = bytes[at..at + 32].try_into().expect("32 bytes");
    // SAFETY: `chunk` is 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(chunk.as_ptr().cast()) }
}

/// 16 bytes at `bytes[at..at + 16]`.
#[target_feature(enable = "avx2")]
#[inline]
fn load16(bytes: &[u8], at: usize) -> __m128i {
    let chunk: &[u8; 16] = bytes[at..at + 16].try_into().expect("16 bytes");
    // SAFETY: `chunk` is 16 readable bytes; the load is unaligned.
    unsafe { _mm_loadu_si128(chunk.as_ptr().cast()) }
}

/// Eight f32 at `values[first..first + 8]` (the padded scale arrays).
#[target_feature(enable = "avx2")]
#[inline]
fn f32x8(values: &[f32], first: usize) -> __m256 {
    let chunk: &[f32; 8] = values[first..first + 8].try_into().expect("a padded group of 8");
    // SAFETY: `chunk` is 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_ps(chunk.as_ptr()) }
}

/// Eight i32 at `values[first..first + 8]`.
#[target_feature(enable = "avx2")]
#[inline]
fn i32x8(values: &[i32], first: usize) -> __m256i {
    let chunk: &[i32; 8] = values[first..first + 8].try_into().expect("a padded group of 8");
    // SAFETY: `chunk` is 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(chunk.as_ptr().cast()) }
}

/// The values of every block of a regrouped Q4_0 / Q4_1 row into `out`, low nibbles first.
#[target_feature(enable = "avx2")]
pub(super) fn unpack_nibbles(bytes: &[u8], layout: GroupLayout, out: &mut [u8]) {
    let mask = _mm_set1_epi8(0x0F);
    let nb = out.len() / BLOCK;
    for (b, values) in out.chunks_exact_mut(BLOCK).enumerate() {
        let q = load16(bytes, layout.block_values_at(nb, b));
        let v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), mask), _mm_and_si128(q, mask));
        let values: &mut [u8; 32] = values.try_into().expect("32 values");
        // SAFETY: `values` is 32 writable bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(values.as_mut_ptr().cast(), v) };
    }
}

/// `d_w` and `m_w` (zero without a minimum) of the `g` blocks from `first` of a row of `nb`
/// blocks, in lanes `0..g` (zero past them): one `vcvtph2ps` each for a regrouped group (a macro
/// so that it compiles inside the caller's `target_feature` function).
macro_rules! group_scales {
    ($w:expr, $nb:expr, $first:expr, $g:expr) => {{
        let (w, nb, first, g): (&WeightRow<'_>, usize, usize, usize) = ($w, $nb, $first, $g);
        match w.scales {
            Scales::F32 { dw, mw } => {
                (f32x8(dw, first), if w.has_min { f32x8(mw, first) } else { _mm256_setzero_ps() })
            }
            Scales::Grouped(layout) => {
                let (base, _) = layout.group(nb, first);
                if g == GROUP {
                    let d = _mm256_cvtph_ps(load16(w.bytes, base));
                    let m = if w.has_min { _mm256_cvtph_ps(load16(w.bytes, base + 16)) } else { _mm256_setzero_ps() };
                    (d, m)
                } else {
                    short_group_scales(w.bytes, base, g, w.has_min)
                }
            }
        }
    }};
}

/// [`group_scales!`] for a regrouped group of `g < 8` blocks at byte `base` (the row's last):
/// eight f16 read from its scales on (the group's values follow them, so the reads stay in the
/// row), lanes `g..` cleared after the conversion.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn short_group_scales(bytes: &[u8], base: usize, g: usize, has_min: bool) -> (__m256, __m256) {
    const LANES: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];
    let keep = _mm256_castsi256_ps(i32x8(&LANES, GROUP - g));
    let d = _mm256_and_ps(_mm256_cvtph_ps(load16(bytes, base)), keep);
    let m =
        if has_min { _mm256_and_ps(_mm256_cvtph_ps(load16(bytes, base + 2 * g)), keep) } else { _mm256_setzero_ps() };
    (d, m)
}

/// The float step of blocks `first..first + 8` with their exact sums `isums` and weight scales
/// `(dw, mw)` (zero past the row's last block, where the input scales are zero too): lane k gains
/// `(d_w * d_x) * (isum - offset * sum(q)) (+ m_w * s_x)`.
#[target_feature(enable = "avx2")]
#[inline]
fn step(
    acc: __m256,
    w: &WeightRow<'_>,
    scales: (__m256, __m256),
    x: &InputRow<'_>,
    first: usize,
    isums: __m256i,
) -> __m256 {
    let mut isums = isums;
    if w.offset != 0 {
        let offsets = _mm256_mullo_epi32(i32x8(x.sums, first), _mm256_set1_epi32(w.offset));
        isums = _mm256_sub_epi32(isums, offsets);
    }
    let mut t = _mm256_mul_ps(_mm256_mul_ps(scales.0, f32x8(x.d, first)), _mm256_cvtepi32_ps(isums));
    if w.has_min {
        t = _mm256_add_ps(t, _mm256_mul_ps(scales.1, f32x8(x.s, first)));
    }
    _mm256_add_ps(acc, t)
}

/// `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`, as the portable definition adds its lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn finish(acc: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s)))
}

/// The products of one weight row with `R` input rows, a group of eight blocks at a time:
/// `$weights` reads block `first + $k` of the row (a group of `$g` blocks at byte `$base`)
/// once, `$product` multiplies it with each input's bytes `$xv`; a group cut short at the row's
/// end is filled up with zero vectors (a macro, not a function taking closures, so that
/// everything compiles inside the caller's `target_feature` function).
macro_rules! run {
    ($w:expr, $xs:expr, $out:expr, |$base:ident, $g:ident, $b:ident, $k:ident| $weights:expr, |$wv:ident, $xv:ident| $product:expr) => {{
        let (w, xs, out): (&WeightRow<'_>, &[InputRow<'_>; R], &mut [f32; R]) = ($w, $xs, $out);
        let nb = xs[0].q.len() / BLOCK;
        let xbs: [&[u8]; R] = std::array::from_fn(|r| i16_bytes(xs[r].q));
        let block_bytes = match w.scales {
            Scales::Grouped(layout) => layout.block_bytes,
            Scales::F32 { .. } => 0,
        };
        let mut acc = [_mm256_setzero_ps(); R];
        let mut first = 0;
        while first < nb {
            let $g = (nb - first).min(GROUP);
            let $base = first * block_bytes;
            let scales = group_scales!(w, nb, first, $g);
            let mut sums = [[_mm_setzero_si128(); 2]; R];
            for half in 0..2 {
                if 4 * half >= $g {
                    break;
                }
                let mut v = [[_mm256_setzero_si256(); 4]; R];
                for k4 in 0..4 {
                    let $k = 4 * half + k4;
                    if $g == GROUP || $k < $g {
                        let $b = first + $k;
                        let $wv = $weights;
                        for r in 0..R {
                            let $xv = (load32(xbs[r], $b * 2 * BLOCK), load32(xbs[r], $b * 2 * BLOCK + 32));
                            v[r][k4] = $product;
                        }
                    }
                }
                for r in 0..R {
                    sums[r][half] = reduce4(v[r][0], v[r][1], v[r][2], v[r][3]);
                }
            }
            for r in 0..R {
                acc[r] = step(acc[r], w, scales, &xs[r], first, _mm256_set_m128i(sums[r][1], sums[r][0]));
            }
            first += GROUP;
        }
        for r in 0..R {
            out[r] = finish(acc[r]);
        }
    }};
}

/// The row products for one way of multiplying a block's bytes (`$dot`).
macro_rules! rows_dot {
    ($name:ident, $one:ident, $blocked:ident, $features:literal, $dot:ident) => {
        /// `w` dotted with every row of `xs`, into `out` (see
        /// [`super::int_dot::row_dot_scalar`]), four input rows per pass over the weights.
        #[target_feature(enable = $features)]
        pub(super) fn $name(w: &WeightRow<'_>, xs: &[InputRow<'_>], out: &mut [f32]) {
            let mut fours = xs.chunks_exact(4).zip(out.chunks_exact_mut(4));
            for (x, o) in fours.by_ref() {
                $blocked::<4>(w, x.try_into().expect("4 rows"), o.try_into().expect("4 rows"));
            }
            let done = xs.len() / 4 * 4;
            for (x, o) in xs[done..].iter().zip(&mut out[done..]) {
                let mut one = [0.0f32];
                $blocked::<1>(w, std::slice::from_ref(x).try_into().expect("1 row"), &mut one);
                *o = one[0];
            }
        }

        /// The rows of `bytes` (`width` bytes each, one per value of `out`; `w` gives their
        /// format) each dotted with `x`, into `out`.
        #[target_feature(enable = $features)]
        pub(super) fn $one(w: &WeightRow<'_>, bytes: &[u8], width: usize, x: &InputRow<'_>, out: &mut [f32]) {
            let xs: &[InputRow<'_>; 1] = std::slice::from_ref(x).try_into().expect("1 row");
            for (row, o) in bytes.chunks_exact(width).zip(out) {
                let mut one = [0.0f32];
                $blocked::<1>(&WeightRow { bytes: row, ..*w }, xs, &mut one);
                *o = one[0];
            }
        }

        /// `w` dotted with `R` input rows.
        #[target_feature(enable = $features)]
        #[inline]
        fn $blocked<const R: usize>(w: &WeightRow<'_>, xs: &[InputRow<'_>; R], out: &mut [f32; R]) {
            match w.form {
                IntForm::Q8_0 => run!(
                    w,
                    xs,
                    out,
                    |base, g, b, k| {
                        let at = base + 2 * g + 32 * k;
                        (_mm256_cvtepi8_epi16(load16(w.bytes, at)), _mm256_cvtepi8_epi16(load16(w.bytes, at + 16)))
                    },
                    |wv, xv| $dot(wv, xv)
                ),
                IntForm::Nibbles => {
                    let mask = _mm_set1_epi8(0x0F);
                    // Q4_0: two bytes of scales per block; Q4_1: four.
                    let head = if w.has_min { 4 } else { 2 };
                    run!(
                        w,
                        xs,
                        out,
                        |base, g, b, k| {
                            let q = load16(w.bytes, base + head * g + 16 * k);
                            let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
                            (widen_u8(_mm_and_si128(q, mask)), widen_u8(hi))
                        },
                        |wv, xv| $dot(wv, xv)
                    )
                }
                IntForm::Unpacked => run!(
                    w,
                    xs,
                    out,
                    |base, g, b, k| {
                        let _ = (base, g, k);
                        (widen_u8(load16(w.unpacked, b * BLOCK)), widen_u8(load16(w.unpacked, b * BLOCK + 16)))
                    },
                    |wv, xv| $dot(wv, xv)
                ),
            }
        }
    };
}

/// The activations' bytes, for the byte loads.
fn i16_bytes(x: &[i16]) -> &[u8] {
    // SAFETY: the `2 * x.len()` bytes of `x` are initialised and readable, u8 has no alignment
    // requirement, and every bit pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), 2 * x.len()) }
}

rows_dot!(rows_dot_avx2, rows_one_avx2, blocked_avx2, "avx2,f16c", dot_avx2);
rows_dot!(rows_dot_vnni, rows_one_vnni, blocked_vnni, "avx2,f16c,avx512vnni,avx512vl", dot_vnni);
