//! The tensor types troupe reads from GGUF files and their dequantization to f32, following
//! ggml's block definitions (`ggml-common.h`, `dequantize_row_*` in `ggml-quants.c`).
//!
//! Every formula is evaluated in f32 with the same operations in the same order as ggml (and as
//! the `gguf` Python package's `quants.dequantize`), so the results are bit-for-bit identical:
//! `d * q` for the symmetric formats, `d * q + m` for the ones with a minimum, and for the
//! K-quants the sub-block scale `d * sc` (and minimum `dmin * m`) first, then `scale * q - min`.
//! No fused multiply-add is used (Rust never contracts `a * b + c` on its own).

use half::{bf16, f16};

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

/// The ggml tensor types troupe reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32 values: f16 scale `d`, 32 x i8; `x = d * q`.
    Q8_0,
    /// 32 values: f16 `d`, 16 bytes of nibbles; `x = d * (q - 8)`.
    Q4_0,
    /// 32 values: f16 `d`, f16 `m`, 16 bytes of nibbles; `x = d * q + m`.
    Q4_1,
    /// 32 values: f16 `d`, 32 high bits, 16 bytes of nibbles; `x = d * (q - 16)`.
    Q5_0,
    /// 32 values: f16 `d`, f16 `m`, 32 high bits, 16 bytes of nibbles; `x = d * q + m`.
    Q5_1,
    /// 256 values: f16 `d`, f16 `dmin`, 8 six-bit scales and minimums, 128 bytes of nibbles.
    Q4_K,
    /// 256 values: like Q4_K plus 32 bytes of fifth bits.
    Q5_K,
    /// 256 values: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 i8 scales, f16 `d`.
    Q6_K,
}

impl GgmlType {
    /// Every type troupe reads.
    pub const ALL: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The type's number in ggml's `enum ggml_type` (what a GGUF file stores).
    pub fn ggml_id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// The type with ggml number `id`, if troupe reads it.
    pub fn from_ggml_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// The name ggml gives the type (`Q4_K`).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// Values per block (1 for the float types).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => 32,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
        }
    }

    /// Whether the type is a block format (not a plain float type).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes that `values` values take, or `None` when `values` is not a whole number of blocks.
    pub fn bytes_for(self, values: usize) -> Option<usize> {
        values.is_multiple_of(self.block_size()).then(|| values / self.block_size() * self.block_bytes())
    }
}

/// An f16 stored little-endian at `bytes[at..at + 2]`, as f32.
#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Dequantizes `bytes` (whole blocks of type `ty`) into `out`.
///
/// # Panics
/// If `bytes.len()` is not exactly the size of `out.len()` values of `ty` (callers check the
/// sizes against the file first).
#[inline]
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let expected = ty.bytes_for(out.len()).expect("a whole number of blocks");
    assert_eq!(bytes.len(), expected, "{} bytes for {} values of {}", bytes.len(), out.len(), ty.name());
    let (block, size) = (ty.block_size(), ty.block_bytes());
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            for (o, b) in out.chunks_exact_mut(block).zip(bytes.chunks_exact(size)) {
                dequantize_block(ty, b, o);
            }
        }
    }
}

/// Dequantizes one block of a block format (`bytes`: `ty.block_bytes()`, `out`: `ty.block_size()`).
#[inline]
pub fn dequantize_block(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::Q8_0 => q8_0(bytes, out),
        GgmlType::Q4_0 => q4_0(bytes, out),
        GgmlType::Q4_1 => q4_1(bytes, out),
        GgmlType::Q5_0 => q5_0(bytes, out),
        GgmlType::Q5_1 => q5_1(bytes, out),
        GgmlType::Q4_K => q4_k(bytes, out),
        GgmlType::Q5_K => q5_k(bytes, out),
        GgmlType::Q6_K => q6_k(bytes, out),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => dequantize(ty, bytes, out),
    }
}

/// `block_q8_0 { ggml_half d; int8_t qs[32]; }`
#[inline]
fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = (q as i8) as f32 * d;
    }
}

/// `block_q4_0 { ggml_half d; uint8_t qs[16]; }`: value j < 16 is the low nibble of `qs[j]`,
/// value j + 16 its high nibble.
#[inline]
fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        out[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
        out[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

/// `block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }`
#[inline]
fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        out[j] = d * (qs[j] & 0x0F) as f32 + m;
        out[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

/// `block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }`: bit j of `qh` is value j's
/// fifth bit.
#[inline]
fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let lo = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
        let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        out[j] = d * (lo as i32 - 16) as f32;
        out[j + 16] = d * (hi as i32 - 16) as f32;
    }
}

/// `block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }`
#[inline]
fn q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let lo = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
        let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        out[j] = d * lo as f32 + m;
        out[j + 16] = d * hi as f32 + m;
    }
}

/// ggml's `get_scale_min_k4`: the six-bit scale and minimum of sub-block `j` (0..8) of a Q4_K /
/// Q5_K super-block from its 12 packed bytes.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// `block_q4_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]; }`: four
/// chunks of 64 values; chunk c reads `qs[32c..32c+32]`, low nibbles for sub-block 2c, high
/// nibbles for sub-block 2c+1.
#[inline]
fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for chunk in 0..4 {
        let q = &qs[32 * chunk..32 * chunk + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let o = &mut out[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            o[l] = d1 * (q[l] & 0x0F) as f32 - min1;
            o[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

/// `block_q5_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; }`:
/// as Q4_K, with bit s of `qh[l]` the fifth bit of value l of sub-block s.
#[inline]
fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for chunk in 0..4 {
        let q = &qs[32 * chunk..32 * chunk + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let (bit1, bit2) = (2 * chunk, 2 * chunk + 1);
        let o = &mut out[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            let lo = (q[l] & 0x0F) | (((qh[l] >> bit1) & 1) << 4);
            let hi = (q[l] >> 4) | (((qh[l] >> bit2) & 1) << 4);
            o[l] = d1 * lo as f32 - min1;
            o[l + 32] = d2 * hi as f32 - min2;
        }
    }
}

/// `block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }`: two halves
/// of 128 values; in half h, value 32s + l (s in 0..4) takes nibble s/2 of `ql[64h + 32(s%2) + l]`
/// and bits 2s..2s+2 of `qh[32h + l]`, minus 32, scaled by `d * scales[8h + 2s + l/16]`.
#[inline]
fn q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let o = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            o[l] = (d * (sc[is] as i8) as f32) * q1 as f32;
            o[l + 32] = (d * (sc[is + 2] as i8) as f32) * q2 as f32;
            o[l + 64] = (d * (sc[is + 4] as i8) as f32) * q3 as f32;
            o[l + 96] = (d * (sc[is + 6] as i8) as f32) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_matches_ggml() {
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_ggml_id(ty.ggml_id()), Some(ty));
        }
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4_0.bytes_for(48), None);
        assert_eq!(GgmlType::from_ggml_id(16), None, "IQ2_XXS is not read");
    }

    #[test]
    fn q8_0_and_q4_1_by_hand() {
        // d = 0.5 (f16 0x3800), q = -2, 3, then zeros.
        let mut block = vec![0x00, 0x38, 0xFE, 0x03];
        block.resize(34, 0);
        let mut out = [0.0f32; 32];
        dequantize(GgmlType::Q8_0, &block, &mut out);
        assert_eq!(&out[..3], &[-1.0, 1.5, 0.0]);
        // d = 1, m = -8: value j is its nibble minus 8.
        let mut block = vec![0x00, 0x3C, 0x00, 0xC8, 0x21];
        block.resize(20, 0);
        dequantize(GgmlType::Q4_1, &block, &mut out);
        assert_eq!((out[0], out[16], out[1]), (-7.0, -6.0, -8.0));
    }
}
