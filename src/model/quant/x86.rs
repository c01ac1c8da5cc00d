//! The block integer sums of [`super::int_dot`] on x86-64 SIMD: AVX2 (`vpmaddubsw` +
//! `vpmaddwd`) and AVX-512 VNNI (`vpdpbusd` on 256-bit registers). Each function computes, per
//! 32-value block, the exact `i32` sum of weight times activation that the scalar functions of
//! [`super::int_dot`] compute; the callers check the CPU's features first.
//!
//! A block's 32 byte products land in eight `i32` lanes; eight blocks' vectors are then reduced
//! together (two rounds of `vphaddd` and one cross-lane add) into one vector of eight block sums,
//! so no block pays a horizontal sum of its own.

use std::arch::x86_64::*;

use super::activations::BLOCK;

/// Sums the four 8-lane vectors' lanes: `[sum(v0), sum(v1), sum(v2), sum(v3)]`.
#[target_feature(enable = "avx2")]
#[inline]
fn reduce4(v0: __m256i, v1: __m256i, v2: __m256i, v3: __m256i) -> __m128i {
    let s = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
}

/// The sum of one vector's eight lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Unsigned bytes `w` (each at most 127, so pairs never saturate) times signed bytes `x`, four
/// adjacent products summed into each of eight `i32` lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn dot_avx2(w: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
}

/// [`dot_avx2`] in one `vpdpbusd`.
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
fn dot_vnni(w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
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

/// Writes eight (or, for the last group, fewer) block sums.
#[target_feature(enable = "avx2")]
#[inline]
fn store_sums(out: &mut [i32], lo: __m128i, hi: __m128i) {
    let mut sums = [0i32; 8];
    // SAFETY: `sums` is 32 writable bytes, two unaligned 16-byte stores.
    unsafe {
        _mm_storeu_si128(sums.as_mut_ptr().cast(), lo);
        _mm_storeu_si128(sums.as_mut_ptr().add(4).cast(), hi);
    }
    out.copy_from_slice(&sums[..out.len()]);
}

/// Runs `$block` (a block index to its eight-lane products) over every block, writing each
/// block's lane sum to `$out`, eight blocks at a time (a macro, not a function taking a closure,
/// so that everything is compiled inside the caller's `target_feature` function).
macro_rules! groups {
    ($out:expr, |$b:ident| $block:expr) => {{
        let out: &mut [i32] = $out;
        let nb = out.len();
        let mut first = 0;
        while first + 8 <= nb {
            let v = |k: usize| {
                let $b = first + k;
                $block
            };
            let lo = reduce4(v(0), v(1), v(2), v(3));
            let hi = reduce4(v(4), v(5), v(6), v(7));
            store_sums(&mut out[first..first + 8], lo, hi);
            first += 8;
        }
        while first < nb {
            let $b = first;
            out[first] = hsum($block);
            first += 1;
        }
    }};
}

/// The three kernels, for one way of multiplying a block's bytes (`$dot`).
macro_rules! kernels {
    ($features:literal, $dot:ident, $i8:ident, $nibbles:ident, $u8:ident) => {
        /// Block sums of a Q8_0 row (`row`: 34-byte blocks, signed weights) with `x`.
        #[target_feature(enable = $features)]
        pub(super) fn $i8(row: &[u8], x: &[i8], out: &mut [i32]) {
            let x = i8_bytes(x);
            groups!(out, |b| {
                let w = load32(row, b * 34 + 2);
                let xv = load32(x, b * BLOCK);
                // |w| times x carrying w's sign: unsigned times signed, as the product needs.
                $dot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
            });
        }

        /// Block sums of a Q4_0 / Q4_1 row (`stride`-byte blocks with 16 bytes of nibbles at
        /// `at`: value j the low nibble of byte j, value j + 16 its high nibble) with `x`.
        #[target_feature(enable = $features)]
        pub(super) fn $nibbles(row: &[u8], stride: usize, at: usize, x: &[i8], out: &mut [i32]) {
            let x = i8_bytes(x);
            let mask = _mm_set1_epi8(0x0F);
            groups!(out, |b| {
                let q = load16(row, b * stride + at);
                let lo = _mm_and_si128(q, mask);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
                $dot(_mm256_set_m128i(hi, lo), load32(x, b * BLOCK))
            });
        }

        /// Block sums of unpacked unsigned weights `w` (each at most 127) with `x`.
        #[target_feature(enable = $features)]
        pub(super) fn $u8(w: &[u8], x: &[i8], out: &mut [i32]) {
            let x = i8_bytes(x);
            groups!(out, |b| $dot(load32(w, b * BLOCK), load32(x, b * BLOCK)));
        }
    };
}

/// The activations' bytes, for the byte loads.
fn i8_bytes(x: &[i8]) -> &[u8] {
    // SAFETY: i8 and u8 have the same size and alignment, and every bit pattern is valid in both.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len()) }
}

kernels!("avx2", dot_avx2, q8_0_avx2, nibbles_avx2, u8_avx2);
kernels!("avx2,avx512vnni,avx512vl", dot_vnni, q8_0_vnni, nibbles_vnni, u8_vnni);
