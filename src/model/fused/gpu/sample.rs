//! Each row's next token drawn on the device, one cube per row, so that a decoding step reads
//! back two numbers a row instead of the row's logits.
//!
//! On the host a step reads `[rows, vocab]` logits back (39 MB at 64 rows over a Qwen3
//! vocabulary) and every row then selects its nucleus among 151,936 weights, while the GPU
//! waits. Here one cube takes one row and, over passes through the row (each weight recomputed
//! from its logit, nothing vocabulary-wide written):
//!
//! 1. reduces the row's maximum and `ln sum e^(x - max) + max`, the log-softmax's normaliser;
//! 2. greedy (temperature 0 or top-k 1): takes the first index of the maximum;
//! 3. else finds the kept set of temperature, top-k and top-p as a boundary weight `tau` and a
//!    number `need`: every token of weight above `tau` is kept, and the first `need` tokens (in
//!    id order) of weight exactly `tau`, the set the host's key order (weight down, id up)
//!    keeps. Each boundary is a radix select over the bits of a weight in `[0, 1]` (the
//!    weights are `e^((x - max) / t)`, so at most 1, and order as their bits do), three bits a
//!    pass, ten passes a boundary;
//! 4. walks the kept tokens in id order to the uniform draw's share of their mass: each unit
//!    takes a contiguous chunk of ids and, in one pass, its mass above `tau` and its ties at
//!    `tau` (the ties in the chunks before it tell how many of those are kept), the cube adds
//!    the chunks' kept masses in order, and the unit whose range holds the draw walks its chunk.
//!
//! At temperature 1 the weights' sum is the normaliser's, so no pass sums them again.
//!
//! The result is `[rows, 2]`: the token (as f32, exact below 2^24) and `x[token] - lse`, the
//! log-probability the scorer computes ([`super::token_logprobs`]'s order of operations).

use burn::backend::Cube;
use burn::tensor::{Shape, Tensor, TensorData};
use burn_cubecl::kernel::untile;

use super::{empty_of, row_launch};

/// Every vocabulary index must be exact in an f32 (the kernel counts and returns ids as f32).
const MAX_VOCAB: usize = 1 << 24;

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{cube_reduce, cube_row, row_max_sum};

    /// The bits of 1.0f32: no weight `e^((x - max) / t)` exceeds it.
    const ONE_BITS: u32 = 0x3F80_0000;

    /// The weight of logit `x`: `e^((x - max) / t)`, the host's (unnormalised) probability.
    #[cube]
    fn weight_of(x: f32, row_max: f32, temperature: f32) -> f32 {
        f32::exp((x - row_max) / temperature)
    }

    /// Whether a token of weight `w` is kept: above the boundary `tau`, or at it and among the
    /// first `need` such tokens (`rank` of them come before it).
    #[cube]
    fn is_kept(w: f32, tau: f32, rank: f32, need: f32) -> bool {
        w > tau || (w == tau && rank < need)
    }

    /// The ties at the boundary in the chunks of the units before `unit` (`ties`, one a unit).
    #[cube]
    fn ties_before(ties: &Shared<[f32]>, unit: usize) -> f32 {
        let mut rank = 0.0f32;
        let mut v = 0usize;
        while v < unit {
            rank += ties[v];
            v += 1;
        }
        rank
    }

    /// The cube's sum of the weights at least `threshold` over the row. Every unit of the cube
    /// must call it.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn measure_from(
        logits: &Tensor<f32>,
        start: usize,
        step: usize,
        vocab: usize,
        row_max: f32,
        temperature: f32,
        threshold: f32,
        partial: &mut Shared<[f32]>,
    ) -> f32 {
        let mut sum = 0.0f32;
        let mut i = UNIT_POS_X as usize;
        while i < vocab {
            let w = weight_of(logits[start + i * step], row_max, temperature);
            if w >= threshold {
                sum += w;
            }
            i += CUBE_DIM_X as usize;
        }
        cube_reduce(partial, sum, false)
    }

    /// The bits of a weight one pass of [`boundary`] resolves, and the bins it sorts them into.
    const DIGIT_BITS: u32 = 3;
    const BINS: usize = 8;
    const DIGIT_MASK: u32 = 7;
    /// The passes that resolve a weight's 30 low bits (bits 30 and 31 are 0 in `[0, 1]`).
    const LEVELS: u32 = 10;

    /// The largest weight `tau` whose tokens at or above it measure at least `goal` (their count,
    /// or their mass), and the measure of the tokens above it; `0` if even every token measures
    /// less (rounding). Only tokens of weight above `floor` are measured (pass `-1` for all).
    ///
    /// A radix select over the weight's bits (a weight in `[0, 1]` orders as its bits do), three
    /// bits a pass from the top: each pass sorts the tokens that share the bits chosen so far into
    /// eight bins by their next three bits, each unit its own bins (`hist`, `[BINS, units]`, a
    /// unit's column), the cube adds the columns as a tree, and every unit takes the highest bin
    /// whose tokens, with those above it, reach the goal. Ten passes over the row, in a fixed
    /// order of additions. Every unit must call it.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn boundary(
        logits: &Tensor<f32>,
        start: usize,
        step: usize,
        vocab: usize,
        row_max: f32,
        temperature: f32,
        goal: f32,
        floor: f32,
        hist: &mut Shared<[f32]>,
        #[comptime] units: usize,
        #[comptime] count: bool,
    ) -> (f32, f32) {
        let unit = UNIT_POS_X as usize;
        let mut prefix = u32::new(0);
        let mut above = f32::new(0.0);
        let mut level = u32::new(0);
        while level < LEVELS {
            let shift = (LEVELS - 1 - level) * DIGIT_BITS;
            let high = shift + DIGIT_BITS;
            let mut b = 0usize;
            while b < BINS {
                hist[b * units + unit] = 0.0;
                b += 1;
            }
            let mut i = unit;
            while i < vocab {
                let w = weight_of(logits[start + i * step], row_max, temperature);
                let bits = u32::reinterpret(w);
                if w > floor && (bits >> high) == (prefix >> high) {
                    let slot = usize::cast_from((bits >> shift) & DIGIT_MASK) * units + unit;
                    let mut add = w;
                    if count {
                        add = 1.0;
                    }
                    let sum = hist[slot] + add;
                    hist[slot] = sum;
                }
                i += units;
            }
            let mut half = CUBE_DIM_X as usize / 2;
            while half > 0 {
                sync_cube();
                if unit < half {
                    let mut b = 0usize;
                    while b < BINS {
                        let pair = hist[b * units + unit] + hist[b * units + unit + half];
                        hist[b * units + unit] = pair;
                        b += 1;
                    }
                }
                half /= 2;
            }
            sync_cube();
            // From the highest bin down: the first whose tokens and those above reach the goal.
            let mut reached = above;
            let mut chosen = 0usize;
            let mut chosen_above = above;
            let mut found = false;
            let mut down = 0usize;
            while down < BINS {
                let d = BINS - 1 - down;
                let next = reached + hist[d * units];
                if !found && (next >= goal || d == 0) {
                    found = true;
                    chosen = d;
                    chosen_above = reached;
                }
                reached = next;
                down += 1;
            }
            prefix |= u32::cast_from(chosen) << shift;
            above = chosen_above;
            // Every unit has read the bins before the next pass clears its own.
            sync_cube();
            level += 1;
        }
        // A goal of 0 or below is met past every weight: the boundary is the largest weight, 1.
        if prefix > ONE_BITS {
            prefix = ONE_BITS;
            above = 0.0;
        }
        (f32::from_bits(prefix), above)
    }

    /// One cube per row of `logits` (`[rows, vocab]`, any strides): `out[row, 0]` (`[rows, 2]`,
    /// contiguous) gets the drawn token as f32 and `out[row, 1]` its `x - ln sum_v e^(x_v)`.
    /// `uniforms[row]` in `[0, 1)` is the row's draw (unused when greedy). `top_k` 0 or at least
    /// `vocab` keeps every token, `top_p` at least 1 the whole mass. `units` is the cube's size, a
    /// power of two.
    #[cube(launch, create_dummy_kernel)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sample_kernel(
        logits: &Tensor<f32>,
        uniforms: &Tensor<f32>,
        out: &mut Tensor<f32>,
        rows: usize,
        temperature: f32,
        top_k: u32,
        top_p: f32,
        #[comptime] greedy: bool,
        #[comptime] units: usize,
    ) {
        let row = cube_row();
        let unit = UNIT_POS_X as usize;
        let units_here = CUBE_DIM_X as usize;
        // Every unit of a cube takes the same branch, so the barriers below stay uniform.
        if row < rows {
            let vocab = logits.shape(1);
            let start = row * logits.stride(0);
            let step = logits.stride(1);
            let mut partial = Shared::<[f32]>::new_slice(units);
            let (row_max, sum) = row_max_sum(logits, start, step, &mut partial);
            let lse = f32::ln(sum) + row_max;

            if greedy {
                // The first index of the maximum: the largest of the negated indices.
                let mut first = -f32::cast_from(vocab);
                let mut i = unit;
                while i < vocab {
                    if logits[start + i * step] == row_max {
                        first = max(first, -f32::cast_from(i));
                    }
                    i += units_here;
                }
                let token = -cube_reduce(&mut partial, first, true);
                if unit == 0 {
                    out[row * 2] = token;
                    out[row * 2 + 1] = logits[start + usize::cast_from(token) * step] - lse;
                }
            } else {
                let size = f32::cast_from(vocab);
                // At temperature 1 the weights are the normaliser's terms, already summed.
                let mut total = sum;
                if temperature != 1.0 {
                    total = measure_from(logits, start, step, vocab, row_max, temperature, 0.0, &mut partial);
                }
                // The kept set: weights above `tau`, and the first `need` of those equal to it.
                let mut tau = f32::new(0.0);
                let mut need = size;
                let mut kept_mass = total;
                let mut mass_above = f32::new(0.0);
                let mut hist = Shared::<[f32]>::new_slice(units * BINS);
                let with_top_k = top_k > 0 && usize::cast_from(top_k) < vocab;
                if with_top_k {
                    let k = f32::cast_from(top_k);
                    let (at, above) =
                        boundary(logits, start, step, vocab, row_max, temperature, k, -1.0, &mut hist, units, true);
                    tau = at;
                    need = k - above;
                    mass_above = measure_from(
                        logits,
                        start,
                        step,
                        vocab,
                        row_max,
                        temperature,
                        f32::from_bits(u32::reinterpret(at) + 1),
                        &mut partial,
                    );
                    kept_mass = mass_above + need * at;
                }
                if top_p < 1.0 {
                    let goal = top_p * kept_mass;
                    let mut floor = f32::new(-1.0);
                    if with_top_k {
                        floor = tau;
                    }
                    let (mut at, mut above) = boundary(
                        logits,
                        start,
                        step,
                        vocab,
                        row_max,
                        temperature,
                        goal,
                        floor,
                        &mut hist,
                        units,
                        false,
                    );
                    // At or below the top-k boundary every threshold measures the whole top-k set.
                    if with_top_k && at <= tau {
                        at = tau;
                        above = mass_above;
                    }
                    let mut ties = size;
                    if at > 0.0 {
                        ties = max(f32::ceil((goal - above) / at), 1.0);
                    }
                    if with_top_k && at == tau {
                        need = min(need, ties);
                    } else {
                        tau = at;
                        need = ties;
                    }
                }

                // Contiguous chunks of ids, one a unit, in one pass: each chunk's ties at `tau` and
                // the mass above it; the ties before a chunk tell how many of its own are kept,
                // and the chunks' kept masses are added in unit order.
                let chunk = vocab.div_ceil(units_here);
                let first = min(unit * chunk, vocab);
                let end = min(first + chunk, vocab);
                let mut ties_here = 0.0f32;
                let mut above_here = 0.0f32;
                let mut i = first;
                while i < end {
                    let w = weight_of(logits[start + i * step], row_max, temperature);
                    if w > tau {
                        above_here += w;
                    }
                    if w == tau {
                        ties_here += 1.0;
                    }
                    i += 1;
                }
                let mut ties = Shared::<[f32]>::new_slice(units);
                let mut masses = Shared::<[f32]>::new_slice(units);
                ties[unit] = ties_here;
                sync_cube();
                let kept_ties = min(max(need - ties_before(&ties, unit), 0.0), ties_here);
                let mass_here = above_here + kept_ties * tau;
                masses[unit] = mass_here;
                sync_cube();
                // Every unit adds the masses in the same order, so all agree on the ranges.
                let mut before = 0.0f32;
                let mut whole = 0.0f32;
                let mut last = 0usize;
                let mut v = 0usize;
                while v < units_here {
                    let m = masses[v];
                    if v < unit {
                        before += m;
                    }
                    whole += m;
                    if m > 0.0 {
                        last = v;
                    }
                    v += 1;
                }
                let target = uniforms[row * uniforms.stride(0)] * whole;
                let owns = mass_here > 0.0 && before <= target && (target < before + mass_here || unit == last);
                if owns {
                    // Walk the chunk as its mass was added; rounding that leaves the draw past
                    // the chunk's last kept token takes that token.
                    let mut rank = ties_before(&ties, unit);
                    let mut running = 0.0f32;
                    let mut token = end;
                    let mut last_kept = first;
                    let mut i = first;
                    while i < end {
                        let w = weight_of(logits[start + i * step], row_max, temperature);
                        let kept = is_kept(w, tau, rank, need);
                        if w == tau {
                            rank += 1.0;
                        }
                        if kept && w > 0.0 {
                            running += w;
                            last_kept = i;
                            if token == end && target < before + running {
                                token = i;
                            }
                        }
                        i += 1;
                    }
                    if token == end {
                        token = last_kept;
                    }
                    out[row * 2] = f32::cast_from(token);
                    out[row * 2 + 1] = logits[start + token * step] - lse;
                }
            }
        }
    }
}

/// Whether [`sample_rows`] takes `logits` under `temperature` and `top_p`: plain f32 logits on a
/// cubecl device ([`super::takes`]) of at least one row and a vocabulary whose ids an f32 holds
/// exactly, and a finite temperature and top-p (a greedy temperature, 0 or below, reads neither).
pub fn samples(logits: &Tensor<2>, temperature: f32, top_p: f32) -> bool {
    let [rows, vocab] = logits.dims();
    super::takes(logits)
        && rows > 0
        && vocab > 0
        && vocab < MAX_VOCAB
        && (temperature <= 0.0 || (temperature.is_finite() && !top_p.is_nan()))
}

/// Each row's next token and its log-probability (`log softmax(logits)[token]`, temperature 1),
/// drawn on the device in one kernel launch, for logits [`samples`] takes. The kept tokens are
/// those of [`crate::generate::sampler::sample`] (temperature, top-k, top-p; ties at the
/// boundary by lowest id), walked in id order to `uniforms[row]` of their mass: the same
/// distribution, another walk than the host's, so a seed gives other tokens on a GPU. Greedy
/// configurations (temperature 0 or below, top-k 1) take the first maximum and read no uniform.
/// `uniforms` holds one value in `[0, 1)` per row.
///
/// # Panics
/// If [`samples`] does not take `logits`, or `uniforms` is not one value a row.
///
/// # Shapes
/// `logits`: `[rows, vocab]`, `uniforms`: `rows` -> `rows` (token, log-prob) pairs
///
/// # Errors
/// [`crate::TroupeError::Device`] when the device failed (this or an earlier kernel).
pub fn sample_rows(
    logits: &Tensor<2>,
    uniforms: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> crate::Result<Vec<(u32, f32)>> {
    assert!(samples(logits, temperature, top_p), "device sampling takes plain f32 logits on a cubecl device");
    let [rows, vocab] = logits.dims();
    assert_eq!(uniforms.len(), rows, "one uniform a row");
    let greedy = temperature <= 0.0 || top_k == 1;
    let device = logits.device();
    let logits = untile(logits.clone().try_into_primitive::<Cube>().expect("`takes` checked the device"));
    let uniforms = Tensor::<1>::from_data(TensorData::new(uniforms.to_vec(), [rows]), &device)
        .try_into_primitive::<Cube>()
        .expect("a tensor made on a cubecl device is a cubecl primitive");
    let out = empty_of(&logits, Shape::new([rows, 2]));
    let (count, cube_dim, units) = row_launch(rows, vocab);
    let client = logits.client.clone();
    kernel::sample_kernel::launch(
        &client,
        count,
        cube_dim,
        logits.into_tensor_arg(),
        uniforms.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        if greedy { 1.0 } else { temperature },
        u32::try_from(top_k).unwrap_or(u32::MAX),
        top_p,
        greedy,
        units,
    );
    let values = crate::readback::to_vec(Tensor::<2>::from_primitive::<Cube>(out), crate::readback::Stage::Decoding)?;
    Ok(values.chunks_exact(2).map(|pair| (pair[0] as u32, pair[1])).collect())
}
