//! `e^x` over slices of f32, written so the compiler vectorizes it (libm's `expf` is one call
//! per value): Cody-Waite range reduction by `ln 2` and Cephes' degree-6 polynomial, with plain
//! multiplies and adds only (no fused multiply-add, no libm), so every instruction-set level
//! gives the same bits. Relative error within 2 ulp of the exact value over the range used
//! here (`x <= 0`, tested against f64), and exactly 0 below `e^-87.3`.

/// Below this, `e^x` is under f32's smallest normal value and taken as 0.
const MIN_INPUT: f32 = -87.336_54;
/// Above this, `2^n` would overflow the exponent; inputs are clamped to it.
const MAX_INPUT: f32 = 88.0;
/// 1.5 * 2^23: adding it rounds an f32 of magnitude below 2^22 to the nearest integer (ties to
/// even), and the integer then sits in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `e^x`, branch-free. Exact to within 2 ulp for `x` in `[-87.3, 88]`; 0 below, clamped above.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n * LN2_HI is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let clamped = x.clamp(MIN_INPUT, MAX_INPUT);
    let shifted = clamped * LOG2_E + ROUND_MAGIC;
    let n = shifted - ROUND_MAGIC;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = (p * r) * r + r + 1.0;
    // 2^n from n's bits: the integer sits in the low mantissa bits of `shifted`.
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let scale = f32::from_bits(((n_int + 127) << 23) as u32);
    if x < MIN_INPUT {
        0.0
    } else {
        y * scale
    }
}

/// `out[i] = e^(x[i] - shift)`, returning the sum of the results (in 16 lanes, then added).
pub fn exp_shifted_sum(x: &[f32], shift: f32, out: Option<&mut [f32]>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the only feature the function enables.
        return unsafe { exp_shifted_sum_avx2(x, shift, out) };
    }
    exp_shifted_sum_impl(x, shift, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn exp_shifted_sum_avx2(x: &[f32], shift: f32, out: Option<&mut [f32]>) -> f32 {
    exp_shifted_sum_impl(x, shift, out)
}

#[inline(always)]
fn exp_shifted_sum_impl(x: &[f32], shift: f32, out: Option<&mut [f32]>) -> f32 {
    let mut lanes = [0.0f32; 16];
    let whole = x.len() / 16 * 16;
    match out {
        Some(out) => {
            let out = &mut out[..x.len()];
            for (xs, os) in x[..whole].chunks_exact(16).zip(out[..whole].chunks_exact_mut(16)) {
                for k in 0..16 {
                    let e = exp(xs[k] - shift);
                    os[k] = e;
                    lanes[k] += e;
                }
            }
            for i in whole..x.len() {
                let e = exp(x[i] - shift);
                out[i] = e;
                lanes[i - whole] += e;
            }
        }
        None => {
            for xs in x[..whole].chunks_exact(16) {
                for k in 0..16 {
                    lanes[k] += exp(xs[k] - shift);
                }
            }
            for i in whole..x.len() {
                lanes[i - whole] += exp(x[i] - shift);
            }
        }
    }
    lanes.iter().sum()
}

/// `out[i] = scale * e^(x[i] - shift)`.
pub fn scaled_exp(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the only feature the function enables.
        return unsafe { scaled_exp_avx2(x, shift, scale, out) };
    }
    scaled_exp_impl(x, shift, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn scaled_exp_avx2(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
    scaled_exp_impl(x, shift, scale, out)
}

#[inline(always)]
fn scaled_exp_impl(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = scale * exp(v - shift);
    }
}

/// `values[i] = e^values[i]`.
pub fn exp_in_place(values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the only feature the function enables.
        return unsafe { exp_in_place_avx2(values) };
    }
    exp_in_place_impl(values)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn exp_in_place_avx2(values: &mut [f32]) {
    exp_in_place_impl(values)
}

#[inline(always)]
fn exp_in_place_impl(values: &mut [f32]) {
    for v in values.iter_mut() {
        *v = exp(*v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let exact = (x as f64).exp() as f32;
            worst = worst.max(ulps(exp(x), exact));
            x += 0.000_731;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn slice_forms_match_the_scalar_one() {
        let x: Vec<f32> = (0..1037).map(|i| (i as f32 * 0.37).sin() * 30.0 - 10.0).collect();
        let mut out = vec![0.0; x.len()];
        let sum = exp_shifted_sum(&x, 3.0, Some(&mut out));
        for (o, v) in out.iter().zip(&x) {
            assert_eq!(*o, exp(v - 3.0));
        }
        assert_eq!(sum, exp_shifted_sum(&x, 3.0, None));
        let exact: f64 = x.iter().map(|&v| ((v - 3.0) as f64).exp()).sum();
        assert!((sum as f64 - exact).abs() / exact < 1e-5);
        let mut in_place: Vec<f32> = x.iter().map(|v| v - 3.0).collect();
        exp_in_place(&mut in_place);
        assert_eq!(in_place, out);
        let mut scaled = vec![0.0; x.len()];
        scaled_exp(&x, 3.0, -0.5, &mut scaled);
        for (s, o) in scaled.iter().zip(&out) {
            assert_eq!(*s, -0.5 * o);
        }
    }
}
