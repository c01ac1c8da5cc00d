//! The operands of the integer row products: a weight row as it is read ([`WeightRow`]: its
//! [`IntForm`], and its scales in the regrouped [`GroupLayout`] of Q8_0, Q4_0 and Q4_1 or as f32)
//! and one 16-bit input row ([`InputRow`]). The portable products (`int_dot`) and their SIMD
//! versions (`x86`) both read them.

use super::activations::Q16Activations;
use crate::model::gguf::dequant::GgmlType;

/// How a block format's weight row is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntForm {
    /// Q8_0 regrouped, read in place: 32 signed bytes per block.
    Q8_0,
    /// Q4_0 / Q4_1 regrouped, read in place: 16 bytes of nibbles per block (value j the low
    /// nibble of byte j, value j + 16 its high nibble).
    Nibbles,
    /// Unpacked by `int_dot::prepare_row` to one unsigned byte per value.
    Unpacked,
}

/// Blocks per group of the regrouped layout (and lanes of the SIMD float step).
pub const GROUP: usize = 8;

/// Where the parts of a block lie in a row regrouped by `int_dot::regroup`: each group of up to
/// eight blocks (`g` blocks, fewer only at the row's end) takes the bytes its blocks take as
/// stored, the `g` scales `d` (f16) first, then the `g` minimums `m` (f16; Q4_1), then the `g`
/// blocks' values, each block's as ggml stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLayout {
    /// Bytes per block (as stored by ggml).
    pub block_bytes: usize,
    /// Bytes of values per block (the rest are its f16 scales).
    pub payload: usize,
}

impl GroupLayout {
    /// The layout of `ty`; `None` for the formats held as stored.
    pub fn of(ty: GgmlType) -> Option<Self> {
        let payload = match ty {
            GgmlType::Q8_0 => 32,
            GgmlType::Q4_0 | GgmlType::Q4_1 => 16,
            _ => return None,
        };
        Some(Self { block_bytes: ty.block_bytes(), payload })
    }

    /// f16 scales per block.
    pub(super) fn scales(&self) -> usize {
        (self.block_bytes - self.payload) / 2
    }

    /// The group that starts at block `first` (a multiple of 8) of a row of `nb` blocks: its
    /// first byte and its number of blocks.
    #[inline(always)]
    pub fn group(&self, nb: usize, first: usize) -> (usize, usize) {
        (first * self.block_bytes, (nb - first).min(GROUP))
    }

    /// From a group's first byte: block `k`'s f16 scale `s` (0: `d`, 1: `m`) in a group of `g`.
    #[inline(always)]
    pub fn scale_at(&self, g: usize, k: usize, s: usize) -> usize {
        2 * (s * g + k)
    }

    /// From a group's first byte: block `k`'s values in a group of `g`.
    #[inline(always)]
    pub fn values_at(&self, g: usize, k: usize) -> usize {
        g * (self.block_bytes - self.payload) + k * self.payload
    }

    /// Block `b`'s values in a row of `nb` blocks.
    #[inline(always)]
    pub fn block_values_at(&self, nb: usize, b: usize) -> usize {
        let first = b / GROUP * GROUP;
        let (base, g) = self.group(nb, first);
        base + self.values_at(g, b - first)
    }

    /// Block `b`'s f16 scale `s` in a row of `nb` blocks.
    #[inline(always)]
    pub fn block_scale_at(&self, nb: usize, b: usize, s: usize) -> usize {
        let first = b / GROUP * GROUP;
        let (base, g) = self.group(nb, first);
        base + self.scale_at(g, b - first, s)
    }
}

/// Where a weight row's block scales are read.
#[derive(Clone, Copy, Debug)]
pub enum Scales<'a> {
    /// In the regrouped row's bytes, as f16.
    Grouped(GroupLayout),
    /// Converted by `int_dot::prepare_row`.
    F32 {
        /// `[padded(blocks)]`: `d_w` per block, zero in the padding.
        dw: &'a [f32],
        /// `[padded(blocks)]`: `m_w` per block (formats with a minimum), zero in the padding.
        mw: &'a [f32],
    },
}

/// One weight row, ready to be dotted.
#[derive(Clone, Copy, Debug)]
pub struct WeightRow<'a> {
    /// The row's bytes as held (regrouped for Q8_0, Q4_0 and Q4_1).
    pub bytes: &'a [u8],
    /// How its values are read.
    pub form: IntForm,
    /// The weight's integer is `q - offset` (8 for Q4_0, 16 for Q5_0, else 0).
    pub offset: i32,
    /// Whether the format has a per-block minimum.
    pub has_min: bool,
    /// `[cols]`: the unpacked values (`IntForm::Unpacked`).
    pub unpacked: &'a [u8],
    /// Where its block scales are.
    pub scales: Scales<'a>,
}

impl WeightRow<'_> {
    /// Block `b`'s `d_w` and `m_w` (zero without a minimum), in a row of `nb` blocks.
    #[inline(always)]
    pub fn block_scales(&self, nb: usize, b: usize) -> (f32, f32) {
        match self.scales {
            Scales::F32 { dw, mw } => (dw[b], if self.has_min { mw[b] } else { 0.0 }),
            Scales::Grouped(layout) => {
                let d = f16_at(self.bytes, layout.block_scale_at(nb, b, 0));
                let m = if self.has_min { f16_at(self.bytes, layout.block_scale_at(nb, b, 1)) } else { 0.0 };
                (d, m)
            }
        }
    }

    /// Where block `b`'s values are in `bytes` (the regrouped forms), in a row of `nb` blocks.
    #[inline(always)]
    pub(super) fn values_at(&self, nb: usize, b: usize) -> usize {
        match self.scales {
            Scales::Grouped(layout) => layout.block_values_at(nb, b),
            Scales::F32 { .. } => unreachable!("the in-place forms are regrouped"),
        }
    }
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
