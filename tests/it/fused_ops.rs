//! The fused CPU kernels (`troupe::model::fused`) against the burn compositions they replace:
//! the frozen projection (past decoding's few rows) and the rotary embedding equal burn's bit for
//! bit, values and gradients, and the SwiGLU gate on a stacked projection equals the gate on its
//! narrowed halves plus their deltas bit for bit; the few-row products match an f64 sum, and the SwiGLU gate, the
//! RMS norm, the attention, the token log-probability and the log-sum-exp match burn's
//! composites within float rounding; the RMS norm, the rotary embedding and the SwiGLU gate without
//! gradients match an f64 reference on the test device (`TROUPE_TEST_DEVICE`), where a GPU runs
//! each as one kernel.

use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe::model::fused::{dense_linear, rope, swiglu, swiglu_stacked, token_logprobs};

fn random(rng: &mut ChaCha8Rng, dims: [usize; 2], scale: f32, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..dims[0] * dims[1]).map(|_| rng.random_range(-scale..scale)).collect();
    Tensor::from_data(TensorData::new(values, dims), device)
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.without_autodiff().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32")
}

/// The largest `|got - want| / max(|want|, 1)` over the pairs.
fn worst_relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0.0f32, f32::max)
}

#[test]
fn dense_linear_equals_burn_matmul_bit_for_bit() {
    let device = Device::flex();
    let grad_device = device.clone().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    // Small (one thread) and large (parallel) products; x also as a non-contiguous view, the
    // weight `[out, in]` also as a transposed view of `[in, out]` storage.
    for (m, k, n) in [(17, 8, 5), (300, 256, 384)] {
        let weight = random(&mut rng, [n, k], 0.5, &device);
        let stored_t = random(&mut rng, [k, n], 0.5, &device).transpose();
        let x = random(&mut rng, [m, k], 1.0, &device);
        let wide = random(&mut rng, [k, m], 1.0, &device).transpose();
        for weight in [&weight, &stored_t] {
            let burn = |x: &Tensor<2>| values(x.clone().matmul(weight.clone().transpose()));
            assert_eq!(values(dense_linear(x.clone(), weight)), burn(&x), "{m}x{k}x{n}");
            assert_eq!(values(dense_linear(wide.clone(), weight)), burn(&wide), "{m}x{k}x{n}, strided x");
        }

        let dy = random(&mut rng, [m, n], 1.0, &grad_device);
        let input = |x: &Tensor<2>| Tensor::<2>::from_data(x.to_data(), &grad_device).require_grad();
        let (ours, theirs) = (input(&x), input(&x));
        let grads = (dense_linear(ours.clone(), &weight) * dy.clone()).sum().backward();
        let got = ours.grad(&grads).expect("x gets a gradient");
        let grads = (theirs.clone().matmul(weight.clone().transpose()) * dy).sum().backward();
        let want = theirs.grad(&grads).expect("x gets a gradient");
        assert_eq!(values(got), values(want), "dx, {m}x{k}x{n}");
    }
}

/// A weight held in bf16 or f16 (`model.dtype`): the CPU's product is burn's own matmul in that
/// dtype (input rounded to it, f32 accumulation, result rounded to it; burn's flex backend widens
/// both operands and calls the same GEMM), bit for bit above the few-row sizes, and within one
/// rounding step of it below; the backward is `dy W` with the widened weight.
#[test]
fn a_bf16_or_f16_weight_multiplies_as_burn_matmul_in_its_dtype() {
    let device = Device::flex();
    let grad_device = device.clone().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for dtype in [burn::tensor::DType::BF16, burn::tensor::DType::F16] {
        for (m, k, n) in [(40, 64, 24), (300, 256, 384), (3, 64, 50)] {
            let weight = random(&mut rng, [n, k], 0.5, &device).cast(dtype);
            let x = random(&mut rng, [m, k], 1.0, &device);
            let got = dense_linear(x.clone(), &weight);
            assert_eq!(got.dtype(), burn::tensor::DType::F32, "the result is in x's dtype");
            let want = values(x.clone().cast(dtype).matmul(weight.clone().transpose()).cast(burn::tensor::DType::F32));
            let got = values(got);
            if m > troupe::model::fused::linear::FEW_ROWS {
                assert_eq!(got, want, "{dtype:?} {m}x{k}x{n}");
            } else {
                // The few-row kernel sums in another order: at most one step of the dtype apart.
                let step = if dtype == burn::tensor::DType::BF16 { 1.0 / 128.0 } else { 1.0 / 1024.0 };
                let worst = worst_relative_error(&got, &want);
                assert!(worst <= step, "{dtype:?} {m}x{k}x{n}: {worst}");
            }
            let dy = random(&mut rng, [m, n], 1.0, &grad_device);
            let input = Tensor::<2>::from_data(x.to_data(), &grad_device).require_grad();
            let grads = (dense_linear(input.clone(), &weight) * dy.clone()).sum().backward();
            let dx = values(input.grad(&grads).expect("x gets a gradient"));
            let widened = Tensor::<2>::from_data(weight.clone().cast(burn::tensor::DType::F32).to_data(), &grad_device);
            assert_eq!(dx, values(dy.matmul(widened)), "dx, {dtype:?} {m}x{k}x{n}");
        }
    }
}

#[test]
fn few_row_products_match_burn_matmul() {
    let device = Device::flex();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    // Decoding's products (up to 16 rows): rows and columns not multiples of the register
    // block, sums not a multiple of the vector width, one long enough to be blocked by the
    // GEMM; x and the weight also as views whose rows are longer than k.
    for (m, k, n) in [(1, 64, 64), (3, 40, 70), (5, 13, 7), (7, 512, 200), (16, 1536, 515)] {
        let weight = random(&mut rng, [n, k], 0.5, &device);
        let wide_weight = random(&mut rng, [n, k + 5], 0.5, &device).narrow(1, 2, k);
        let x = random(&mut rng, [m, k], 1.0, &device);
        let wide = random(&mut rng, [m, k + 9], 1.0, &device).narrow(1, 3, k);
        for weight in [weight, wide_weight] {
            let w = values(weight.clone());
            for x in [x.clone(), wide.clone()] {
                let xs = values(x.clone());
                let got = values(dense_linear(x.clone(), &weight));
                let burn = values(x.matmul(weight.clone().transpose()));
                for r in 0..m {
                    for c in 0..n {
                        // Against the f64 sum, within f32 rounding of the sum of the terms' sizes.
                        let terms = (0..k).map(|i| f64::from(xs[r * k + i]) * f64::from(w[c * k + i]));
                        let (exact, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                        let bound = 1e-6 * size;
                        for (what, value) in [("few-row kernel", got[r * n + c]), ("burn", burn[r * n + c])] {
                            let error = (f64::from(value) - exact).abs();
                            assert!(
                                error <= bound,
                                "{what} {m}x{k}x{n} [{r}, {c}]: {value} vs {exact} (bound {bound})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn swiglu_matches_silu_times_up() {
    let device = Device::flex().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (rows, width) = (37, 96);
    // The gate as the models make it: a narrowed half of one stacked product.
    let stacked = random(&mut rng, [rows, 2 * width], 6.0, &device);
    let out_grad = random(&mut rng, [rows, width], 1.0, &device);
    let run = |fused: bool| {
        let stacked = Tensor::<2>::from_data(stacked.to_data(), &device).require_grad();
        let (gate, up) = (stacked.clone().narrow(1, 0, width), stacked.clone().narrow(1, width, width));
        let out = if fused { swiglu(gate, up) } else { silu(gate) * up };
        let grads = (out.clone() * out_grad.clone()).sum().backward();
        (values(out), values(stacked.grad(&grads).expect("a gradient")))
    };
    let close = |got: &[f32], want: &[f32], what: &str| {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{what}: {g} vs {w}");
        }
    };
    let (fused, composite) = (run(true), run(false));
    close(&fused.0, &composite.0, "values");
    close(&fused.1, &composite.1, "gradients of gate and up");
    // Without autodiff too, with gates far out on both sides (the exponential saturates).
    let (gate, up) = (random(&mut rng, [5, 7], 3.0, &Device::flex()), random(&mut rng, [5, 7], 3.0, &Device::flex()));
    let far = Tensor::<2>::from_data(
        TensorData::new(vec![-200.0f32, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0], [1, 7]),
        &Device::flex(),
    );
    for gate in [gate, far] {
        let up = up.clone().narrow(0, 0, gate.dims()[0]);
        close(&values(swiglu(gate.clone(), up.clone())), &values(silu(gate) * up), "values without autodiff");
    }
}

#[test]
fn swiglu_stacked_equals_swiglu_on_narrowed_halves_bit_for_bit() {
    let device = Device::flex().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    // Enough rows for several parallel tasks; the stacked output also as a strided view.
    let (rows, width) = (400, 96);
    let stacked = random(&mut rng, [rows, 2 * width], 4.0, &device);
    let strided = random(&mut rng, [2 * width, rows], 4.0, &device);
    let (delta_gate, delta_up) =
        (random(&mut rng, [rows, width], 1.0, &device), random(&mut rng, [rows, width], 1.0, &device));
    let out_grad = random(&mut rng, [rows, width], 1.0, &device);
    let leaf = |t: &Tensor<2>| Tensor::<2>::from_data(t.to_data(), &device).require_grad();
    for (gate_on, up_on) in [(true, true), (false, false), (true, false)] {
        for transposed in [false, true] {
            let run = |fused: bool| {
                let stacked = if transposed { leaf(&strided) } else { leaf(&stacked) };
                let gate_up = if transposed { stacked.clone().transpose() } else { stacked.clone() };
                let (dg, du) = (leaf(&delta_gate), leaf(&delta_up));
                let (dg_in, du_in) = (gate_on.then(|| dg.clone()), up_on.then(|| du.clone()));
                let out = if fused {
                    swiglu_stacked(gate_up, dg_in, du_in)
                } else {
                    let gate = gate_up.clone().narrow(1, 0, width);
                    let up = gate_up.narrow(1, width, width);
                    let gate = dg_in.map_or(gate.clone(), |d| gate + d);
                    let up = du_in.map_or(up.clone(), |d| up + d);
                    swiglu(gate, up)
                };
                let grads = (out.clone() * out_grad.clone()).sum().backward();
                let grad = |t: &Tensor<2>| t.grad(&grads).map(values);
                (values(out), grad(&stacked), grad(&dg), grad(&du))
            };
            let what = format!("deltas ({gate_on}, {up_on}), transposed {transposed}");
            let (fused, composite) = (run(true), run(false));
            assert_eq!(fused.0, composite.0, "values, {what}");
            assert_eq!(fused.1, composite.1, "gradient of the stacked output, {what}");
            assert_eq!(fused.2, composite.2, "gradient of the gate's delta, {what}");
            assert_eq!(fused.3, composite.3, "gradient of up's delta, {what}");
            assert!(fused.1.is_some() && fused.2.is_some() == gate_on && fused.3.is_some() == up_on, "{what}");
        }
    }
    // Without autodiff.
    let plain = stacked.without_autodiff();
    let (gate, up) = (plain.clone().narrow(1, 0, width), plain.clone().narrow(1, width, width));
    assert_eq!(values(swiglu_stacked(plain, None, None)), values(swiglu(gate, up)), "values without autodiff");
}

#[test]
fn token_logprobs_match_log_softmax() {
    let device = Device::flex().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (rows, vocab) = (19, 5003);
    let logits = random(&mut rng, [rows, vocab], 12.0, &device);
    let targets: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
    let weights = Tensor::<1>::from_data(
        TensorData::new((0..rows).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>(), [rows]),
        &device,
    );
    let ours = Tensor::<2>::from_data(logits.to_data(), &device).require_grad();
    let got = token_logprobs(ours.clone(), &targets);
    let grads = (got.clone() * weights.clone()).sum().backward();
    let got_grad = values(ours.grad(&grads).expect("a gradient"));

    let theirs = Tensor::<2>::from_data(logits.to_data(), &device).require_grad();
    let ids: Vec<i64> = targets.iter().map(|&t| i64::from(t)).collect();
    let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [rows]), &device).reshape([rows, 1]);
    let want = log_softmax(theirs.clone(), 1).gather(1, ids).reshape([rows]);
    let grads = (want.clone() * weights).sum().backward();
    let want_grad = values(theirs.grad(&grads).expect("a gradient"));

    let (got, want) = (values(got.reshape([1, rows])), values(want.reshape([1, rows])));
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "log-prob {g} vs {w}");
    }
    for (g, w) in got_grad.iter().zip(&want_grad) {
        assert!((g - w).abs() <= 1e-6, "gradient {g} vs {w}");
    }
    // A row whose logits are all equal: log(1 / vocab).
    let flat = Tensor::<2>::zeros([1, vocab], &Device::flex());
    let uniform = values(token_logprobs(flat, &[7]).reshape([1, 1]))[0];
    assert!((uniform + (vocab as f32).ln()).abs() < 1e-5, "{uniform}");
}

#[test]
fn rope_equals_the_rotate_half_composite_bit_for_bit() {
    let device = Device::flex().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (batch, heads, seq, dim) = (2, 3, 5, 8);
    let four = |rng: &mut ChaCha8Rng, dims: [usize; 4], scale: f32| {
        let values: Vec<f32> = (0..dims.iter().product()).map(|_| rng.random_range(-scale..scale)).collect();
        Tensor::<4>::from_data(TensorData::new(values, dims), &device)
    };
    let (cos, sin) = (four(&mut rng, [batch, 1, seq, dim], 1.0), four(&mut rng, [batch, 1, seq, dim], 1.0));
    // The queries as the attention makes them: [batch, seq, heads, dim] with heads and seq swapped.
    let x = four(&mut rng, [batch, seq, heads, dim], 2.0);
    let out_grad = four(&mut rng, [batch, heads, seq, dim], 1.0);
    let run = |fused: bool| {
        let x = Tensor::<4>::from_data(x.to_data(), &device).require_grad();
        let swapped = x.clone().swap_dims(1, 2);
        let out = if fused {
            rope(swapped, &cos, &sin)
        } else {
            let half = dim / 2;
            let rotated =
                Tensor::cat(vec![swapped.clone().narrow(3, half, half).neg(), swapped.clone().narrow(3, 0, half)], 3);
            swapped * cos.clone() + rotated * sin.clone()
        };
        let grads = (out.clone() * out_grad.clone()).sum().backward();
        let flat = |t: Tensor<4>| t.without_autodiff().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        (flat(out), flat(x.grad(&grads).expect("a gradient")))
    };
    let (fused, composite) = (run(true), run(false));
    assert_eq!(fused.0, composite.0, "values");
    assert_eq!(fused.1, composite.1, "gradients");
}

/// The SwiGLU gate without gradients, on the device of `TROUPE_TEST_DEVICE` (the CPU's fused
/// kernel by default, one GPU kernel under `cuda` or `wgpu`), against an f64 reference: the two
/// halves of a stacked gate/up product, read in place, and large gates of both signs.
#[test]
fn swiglu_without_gradients_matches_f64_on_the_test_device() {
    let device = crate::common::test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (rows, width) in [(3, 40), (17, 1024)] {
        let stacked: Vec<f32> = (0..rows * 2 * width).map(|_| rng.random_range(-30.0f32..30.0)).collect();
        let gate_up = Tensor::<2>::from_data(TensorData::new(stacked.clone(), [rows, 2 * width]), &device);
        let got = values(swiglu(gate_up.clone().narrow(1, 0, width), gate_up.narrow(1, width, width)));
        let want: Vec<f32> = (0..rows * width)
            .map(|i| {
                let (r, j) = (i / width, i % width);
                let (g, u) = (f64::from(stacked[r * 2 * width + j]), f64::from(stacked[r * 2 * width + width + j]));
                (g / (1.0 + (-g).exp()) * u) as f32
            })
            .collect();
        let worst = worst_relative_error(&got, &want);
        assert!(worst < 1e-5, "{rows} x {width}: {worst}");
    }
}

/// The rotary embedding without gradients, on the device of `TROUPE_TEST_DEVICE` (the CPU's
/// fused kernel by default, one GPU kernel under `cuda` or `wgpu`), against an f64 reference:
/// queries as the attention makes them (heads and positions swapped, strided), a decoding
/// step's single position, and Qwen3-0.6B's head width.
#[test]
fn rope_without_gradients_matches_f64_on_the_test_device() {
    let device = crate::common::test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    for (batch, heads, seq, dim) in [(2, 3, 5, 8), (3, 16, 1, 128), (1, 2, 70, 64)] {
        let host = |rng: &mut ChaCha8Rng, n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(-scale..scale)).collect()
        };
        let (cos, sin) = (host(&mut rng, batch * seq * dim, 1.0), host(&mut rng, batch * seq * dim, 1.0));
        let x = host(&mut rng, batch * seq * heads * dim, 2.0);
        let tensor =
            |values: &[f32], dims: [usize; 4]| Tensor::<4>::from_data(TensorData::new(values.to_vec(), dims), &device);
        let table = [batch, 1, seq, dim];
        let swapped = tensor(&x, [batch, seq, heads, dim]).swap_dims(1, 2);
        let got = rope(swapped, &tensor(&cos, table), &tensor(&sin, table))
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32");
        let half = dim / 2;
        let mut want = Vec::with_capacity(x.len());
        for b in 0..batch {
            for h in 0..heads {
                for s in 0..seq {
                    let row = &x[((b * seq + s) * heads + h) * dim..][..dim];
                    let t = (b * seq + s) * dim;
                    for j in 0..dim {
                        let rotated = if j < half { -f64::from(row[j + half]) } else { f64::from(row[j - half]) };
                        let value = f64::from(row[j]) * f64::from(cos[t + j]) + rotated * f64::from(sin[t + j]);
                        want.push(value as f32);
                    }
                }
            }
        }
        let worst = worst_relative_error(&got, &want);
        assert!(worst < 1e-6, "{batch} x {heads} heads x {seq} x {dim}: {worst}");
    }
}

/// Qwen3's per-head norm and rotation of the queries or keys without gradients on the test
/// device (on a GPU troupe's one kernel, `rms_norm_rope`) against an f64 reference and against
/// the norm then the rotation apart: heads read as the model reads them, a view of the stacked
/// q/k/v output's columns, at a decoding step (one position, batch 16) and over a sequence.
#[test]
fn rms_norm_rope_without_gradients_matches_f64_and_the_two_apart_on_the_test_device() {
    use troupe::model::fused::{rms_norm, rms_norm_rope};

    let device = crate::common::test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let eps = 1e-6;
    // (batch, seq, heads, head dim, stacked columns before these heads, after them)
    for (batch, seq, heads, dim, before, after) in
        [(2, 5, 3, 8, 16, 8), (16, 1, 4, 128, 512, 256), (1, 33, 2, 64, 0, 64)]
    {
        let host = |rng: &mut ChaCha8Rng, n: usize, low: f32, high: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(low..high)).collect()
        };
        let columns = before + heads * dim + after;
        let stacked = host(&mut rng, batch * seq * columns, -3.0, 3.0);
        let w = host(&mut rng, dim, 0.5, 1.5);
        let (cos, sin) = (host(&mut rng, batch * seq * dim, -1.0, 1.0), host(&mut rng, batch * seq * dim, -1.0, 1.0));
        let table =
            |values: &[f32]| Tensor::<4>::from_data(TensorData::new(values.to_vec(), [batch, 1, seq, dim]), &device);
        let (cos_t, sin_t) = (table(&cos), table(&sin));
        let weight = Tensor::<1>::from_data(TensorData::new(w.clone(), [dim]), &device);
        let x = Tensor::<2>::from_data(TensorData::new(stacked.clone(), [batch * seq, columns]), &device)
            .narrow(1, before, heads * dim)
            .reshape([batch, seq, heads, dim]);
        let flat = |t: Tensor<4>| t.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        let got = flat(rms_norm_rope(x.clone(), &weight, eps, &cos_t, &sin_t));
        let apart = flat(rope(rms_norm(x, &weight, eps).swap_dims(1, 2), &cos_t, &sin_t));
        let half = dim / 2;
        let mut want = Vec::with_capacity(got.len());
        for b in 0..batch {
            for h in 0..heads {
                for s in 0..seq {
                    let row = &stacked[(b * seq + s) * columns + before + h * dim..][..dim];
                    let mean = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / dim as f64;
                    let inverse = 1.0 / (mean + eps).sqrt();
                    let normed: Vec<f64> =
                        row.iter().zip(&w).map(|(&v, &w)| f64::from(v) * inverse * f64::from(w)).collect();
                    let t = (b * seq + s) * dim;
                    for j in 0..dim {
                        let rotated = if j < half { -normed[j + half] } else { normed[j - half] };
                        want.push((normed[j] * f64::from(cos[t + j]) + rotated * f64::from(sin[t + j])) as f32);
                    }
                }
            }
        }
        let case = format!("{batch} x {seq} x {heads} heads x {dim}");
        let worst = worst_relative_error(&got, &want);
        assert!(worst < 1e-5, "{case}, against f64: {worst}");
        let worst = worst_relative_error(&got, &apart);
        assert!(worst < 1e-6, "{case}, against the norm then the rotation: {worst}");
    }
}

/// A layer's queries and keys normed and rotated together (`rms_norm_rope_pair`: on a GPU one
/// kernel launch for both) against each normed and rotated alone (`rms_norm_rope`), bit for bit:
/// both read as views of one stacked q/k/v output, each with its own norm weight, at a decoding
/// step (batch 16, Qwen3-0.6B's 16 query heads over 8 key heads of 128) and over a sequence. On
/// a GPU the pair's kernel must be the one that ran.
#[test]
fn rms_norm_rope_pair_equals_the_queries_and_keys_apart_on_the_test_device() {
    use troupe::model::fused::{rms_norm_rope, rms_norm_rope_pair};

    let device = crate::common::test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    let eps = 1e-6;
    // (batch, seq, query heads, key heads, head dim)
    for (batch, seq, heads, kv_heads, dim) in [(16, 1, 16, 8, 128), (2, 7, 4, 2, 16)] {
        let columns = (heads + 2 * kv_heads) * dim;
        let stacked = random(&mut rng, [batch * seq, columns], 3.0, &device);
        let part =
            |start: usize, n: usize| stacked.clone().narrow(1, start * dim, n * dim).reshape([batch, seq, n, dim]);
        let (q, k) = (part(0, heads), part(heads, kv_heads));
        let weight = |rng: &mut ChaCha8Rng| random(rng, [1, dim], 0.5, &device).reshape([dim]) + 1.0;
        let (qw, kw) = (weight(&mut rng), weight(&mut rng));
        let table = |rng: &mut ChaCha8Rng| random(rng, [batch * seq, dim], 1.0, &device).reshape([batch, 1, seq, dim]);
        let (cos, sin) = (table(&mut rng), table(&mut rng));
        let (pair_q, pair_k) = rms_norm_rope_pair((q.clone(), &qw, eps), (k.clone(), &kw, eps), &cos, &sin);
        let flat = |t: Tensor<4>| t.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        let case = format!("{batch} x {seq} x {heads}/{kv_heads} heads x {dim}");
        assert_eq!(pair_q.dims(), [batch, heads, seq, dim], "{case}");
        assert_eq!(pair_k.dims(), [batch, kv_heads, seq, dim], "{case}");
        assert_eq!(flat(pair_q), flat(rms_norm_rope(q.clone(), &qw, eps, &cos, &sin)), "{case}: queries");
        assert_eq!(flat(pair_k), flat(rms_norm_rope(k.clone(), &kw, eps, &cos, &sin)), "{case}: keys");
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if device != Device::flex() {
            let ran = troupe::model::fused::gpu::rms_norm_rope_pair((&q, &qw), (&k, &kw), eps, &cos, &sin);
            assert!(ran.is_some(), "{case}: the pair's kernel runs");
        }
    }
}

/// The attention with gradients on the device of `TROUPE_TEST_DEVICE` (the CPU's fused kernel by
/// default; under `cuda` or `wgpu`, troupe's node of two products around the softmax kernel,
/// whose backward is four products around one kernel) against burn's attention with the
/// key/value heads repeated: values, `dq`, `dk` and `dv`, with the values strided as the model
/// passes them.
#[test]
fn attention_with_gradients_matches_burns_on_the_test_device() {
    use burn::tensor::module::attention as burn_attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::Bool;
    use std::sync::Arc;
    use troupe::model::fused::{attention, grouped_attention, HostMask};
    use troupe::model::AttentionKernel;

    let plain = crate::common::test_device();
    // CUDA multiplies in TF32 (a 10-bit mantissa): the two backwards multiply different
    // intermediates, so they agree only to TF32's rounding there. The CPU and wgpu multiply in f32.
    let bound = if troupe::device::is_cuda(&plain) { crate::common::tolerance(2e-5) } else { 2e-5 };
    let device = plain.autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    // Grouped heads (4 over 2), queries past one block (64) after a cache of 20 slots, left
    // padding, a block-structured row, a query that may see nothing, and one decoding step.
    for (batch, heads, kv_heads, seq, past, dim) in [(3, 4, 2, 70, 20, 16), (2, 2, 1, 1, 9, 8), (1, 3, 3, 5, 0, 4)] {
        let keys = past + seq;
        let mut hidden = Vec::with_capacity(batch * seq * keys);
        for b in 0..batch {
            let pad = 3 * b;
            for i in 0..seq {
                let slot = past + i;
                for key in 0..keys {
                    let blocked = b == 1 && key >= past && (key - past) / 7 != i / 7;
                    let nothing = b == 2 && i == 4;
                    hidden.push(key > slot || key < pad || blocked || nothing);
                }
            }
        }
        let four = |rng: &mut ChaCha8Rng, dims: [usize; 4]| {
            let values: Vec<f32> = (0..dims.iter().product()).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            Tensor::<4>::from_data(TensorData::new(values, dims), &device)
        };
        let q = four(&mut rng, [batch, heads, seq, dim]);
        let k = four(&mut rng, [batch, kv_heads, keys, dim]);
        let v = four(&mut rng, [batch, kv_heads, keys, dim]);
        let out_grad = four(&mut rng, [batch, heads, seq, dim]);
        let mask = Tensor::<4, Bool>::from_data(TensorData::new(hidden.clone(), [batch, 1, seq, keys]), &device);
        let host = Arc::new(HostMask::new(hidden, [batch, seq, keys]));
        // 0: the fused kernel; 1: burn's attention with the query heads folded (other backends);
        // 2: burn's attention with the key/value heads repeated (the reference).
        let run = |path: usize| {
            let leaf = |t: &Tensor<4>| Tensor::<4>::from_data(t.to_data(), &device).require_grad();
            // The model's values are its projection's heads swapped in: a strided view.
            let (q, k, v_rows) = (leaf(&q), leaf(&k), leaf(&v.clone().swap_dims(1, 2)));
            let v = v_rows.clone().swap_dims(1, 2);
            let out = if path == 0 {
                attention(q.clone(), k.clone(), v.clone(), &mask, &host, AttentionKernel::Auto)
            } else if path == 1 {
                grouped_attention(q.clone(), k.clone(), v.clone(), &mask)
            } else {
                let group = heads / kv_heads;
                let repeat = |t: Tensor<4>| {
                    t.unsqueeze_dim::<5>(2)
                        .expand([batch, kv_heads, group, keys, dim])
                        .reshape([batch, heads, keys, dim])
                };
                let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: false };
                burn_attention(q.clone(), repeat(k.clone()), repeat(v.clone()), Some(mask.clone()), None, options)
            };
            let grads = (out.clone() * out_grad.clone()).sum().backward();
            let flat =
                |t: Tensor<4>| t.without_autodiff().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
            let grad = |t: &Tensor<4>| flat(t.grad(&grads).expect("a gradient"));
            [flat(out), grad(&q), grad(&k), grad(&v_rows)]
        };
        let (fused, folded, burn) = (run(0), run(1), run(2));
        for (what, (got, want)) in ["values", "dq", "dk", "dv"].iter().zip(fused.iter().zip(&burn)) {
            let worst = worst_relative_error(got, want);
            assert!(worst < bound, "{what} ({batch} x {heads}/{kv_heads} x {seq} + {past}): {worst}");
            assert!(got.iter().all(|x| x.is_finite()), "{what}: finite");
        }
        // Folding the query heads reorders nothing but the rows: the same sums as repeating.
        for (what, (got, want)) in ["values", "dq", "dk", "dv"].iter().zip(folded.iter().zip(&burn)) {
            let worst = worst_relative_error(got, want);
            assert!(worst < 1e-6, "folded {what} ({batch} x {heads}/{kv_heads} x {seq} + {past}): {worst}");
        }
        // The query that sees nothing gets zeros, as burn's masked softmax gives.
        if batch == 3 {
            let row = (2 * heads * seq + 4) * dim;
            assert!(fused[0][row..row + dim].iter().all(|&x| x == 0.0));
        }
    }
}

/// The RMS norm with gradients against burn's composite on the test device (the CPU's fused
/// kernel by default; under `cuda` or `wgpu`, with a frozen weight, the GPU's one-kernel norm and
/// its one-kernel backward, and with a weight that takes a gradient, burn's composite): values,
/// `dx` and (when the weight takes one) `dw`, over per-head rows of a narrowed projection output.
#[test]
fn rms_norm_matches_the_composite() {
    use troupe::model::fused::rms_norm;

    let device = crate::common::test_device();
    let autodiff = device.clone().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (batch, seq, heads, dim) = (3, 5, 4, 37);
    let three = |rng: &mut ChaCha8Rng, dims: [usize; 3]| {
        let values: Vec<f32> = (0..dims.iter().product()).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        Tensor::<3>::from_data(TensorData::new(values, dims), &autodiff)
    };
    let weight_values: Vec<f32> = (0..dim).map(|_| rng.random_range(0.5f32..1.5)).collect();
    let x = three(&mut rng, [batch, seq, heads * dim + 6]);
    let out_grad = three(&mut rng, [batch * seq, heads, dim]);
    let eps = 1e-6;
    let run = |fused: bool, frozen: bool| {
        let x = Tensor::<3>::from_data(x.to_data(), &autodiff).require_grad();
        let weight = TensorData::new(weight_values.clone(), [dim]);
        let weight = if frozen {
            Tensor::<1>::from_data(weight, &device)
        } else {
            Tensor::<1>::from_data(weight, &autodiff).require_grad()
        };
        // Per-head rows of a narrowed projection output, as the Qwen3 q/k norms see them.
        let heads_view = x.clone().narrow(2, 6, heads * dim).reshape([batch * seq, heads, dim]);
        let out = if fused {
            rms_norm(heads_view, &weight, eps)
        } else {
            let mean_square = heads_view.clone().square().mean_dim(2);
            heads_view * (mean_square + eps).sqrt().recip() * weight.clone().reshape([1, 1, dim])
        };
        let grads = (out.clone() * out_grad.clone()).sum().backward();
        let values3 =
            |t: Tensor<3>| t.without_autodiff().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        let dw = weight.grad(&grads).map_or_else(Vec::new, |dw| {
            dw.without_autodiff().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32")
        });
        [values3(out), values3(x.grad(&grads).expect("dx")), dw]
    };
    for frozen in [false, true] {
        let (fused, composite) = (run(true, frozen), run(false, frozen));
        assert_eq!(fused[2].is_empty(), frozen, "a gradient for the weight exactly when it takes one");
        for (what, (got, want)) in ["values", "dx", "dw"].iter().zip(fused.iter().zip(&composite)) {
            let worst = worst_relative_error(got, want);
            assert!(worst < 1e-5, "{what} (frozen weight: {frozen}): {worst}");
        }
    }
}

/// The RMS norm without gradients, on the device of `TROUPE_TEST_DEVICE` (the CPU's fused kernel
/// by default, the one-kernel GPU norm under `cuda` or `wgpu`), against an f64 reference: rows
/// wider and narrower than a cube, a per-head view of a narrowed projection output (strided rows),
/// and more rows than one grid dimension holds.
#[test]
fn rms_norm_without_gradients_matches_f64_on_the_test_device() {
    use troupe::model::fused::rms_norm;

    let device = crate::common::test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let eps = 1e-6;
    // (rows, heads, width, leading columns narrowed away)
    for (rows, heads, width, skip) in [(3, 1, 1024, 0), (5, 4, 37, 6), (2, 2, 3000, 17), (70_000, 1, 8, 0)] {
        let columns = skip + heads * width;
        let x: Vec<f32> = (0..rows * columns).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let w: Vec<f32> = (0..width).map(|_| rng.random_range(0.5f32..1.5)).collect();
        let stored = Tensor::<2>::from_data(TensorData::new(x.clone(), [rows, columns]), &device);
        let weight = Tensor::<1>::from_data(TensorData::new(w.clone(), [width]), &device);
        let view = stored.narrow(1, skip, heads * width).reshape([rows, heads, width]);
        let got = rms_norm(view, &weight, eps).into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        let mut want = Vec::with_capacity(rows * heads * width);
        for r in 0..rows {
            for h in 0..heads {
                let row = &x[r * columns + skip + h * width..][..width];
                let mean = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / width as f64;
                let inverse = 1.0 / (mean + eps).sqrt();
                want.extend(row.iter().zip(&w).map(|(&v, &w)| (f64::from(v) * inverse * f64::from(w)) as f32));
            }
        }
        let worst = worst_relative_error(&got, &want);
        assert!(worst < 1e-5, "rows {rows} x {heads} heads x {width}: {worst}");
    }
}

/// The residual stream's sum and its RMS norm without gradients on the test device (on a GPU
/// troupe's one kernel, `add_rms_norm`) against an f64 reference and against the sums and the
/// norm apart: with and without an adapter's delta, rows wider than a cube, a strided addend.
#[test]
fn add_rms_norm_without_gradients_matches_f64_and_the_sums_and_norm_apart_on_the_test_device() {
    use troupe::model::fused::{add_rms_norm, rms_norm};

    let device = crate::common::test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let eps = 1e-6;
    for (rows, width, with_extra) in [(3, 1024, true), (16, 37, false), (70, 600, true)] {
        let host = |rng: &mut ChaCha8Rng, n: usize, low: f32, high: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(low..high)).collect()
        };
        let (x, y, e) = (
            host(&mut rng, rows * width, -3.0, 3.0),
            host(&mut rng, rows * 2 * width, -1.0, 1.0),
            host(&mut rng, rows * width, -0.1, 0.1),
        );
        let w = host(&mut rng, width, 0.5, 1.5);
        let tensor =
            |values: &[f32], dims: [usize; 3]| Tensor::<3>::from_data(TensorData::new(values.to_vec(), dims), &device);
        let x_t = tensor(&x, [1, rows, width]);
        // The addend is every other row-half of a wider tensor: a strided view.
        let y_t = tensor(&y, [1, rows, 2 * width]).narrow(2, width, width);
        let e_t = with_extra.then(|| tensor(&e, [1, rows, width]));
        let weight = Tensor::<1>::from_data(TensorData::new(w.clone(), [width]), &device);
        let flat = |t: Tensor<3>| t.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        let (sum, normed) = add_rms_norm(x_t.clone(), y_t.clone(), e_t.clone(), &weight, eps);
        let (sum, normed) = (flat(sum), flat(normed));
        let added = match e_t {
            Some(e_t) => y_t + e_t,
            None => y_t,
        };
        let apart_sum = x_t + added;
        let apart_normed = flat(rms_norm(apart_sum.clone(), &weight, eps));
        let apart_sum = flat(apart_sum);
        let (mut want_sum, mut want_normed) = (Vec::new(), Vec::new());
        for r in 0..rows {
            let row: Vec<f64> = (0..width)
                .map(|i| {
                    let extra = if with_extra { f64::from(e[r * width + i]) } else { 0.0 };
                    f64::from(x[r * width + i]) + (f64::from(y[r * 2 * width + width + i]) + extra)
                })
                .collect();
            let inverse = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / width as f64 + eps).sqrt();
            want_normed.extend(row.iter().zip(&w).map(|(v, &w)| (v * inverse * f64::from(w)) as f32));
            want_sum.extend(row.iter().map(|&v| v as f32));
        }
        let case = format!("{rows} x {width}, delta: {with_extra}");
        assert!(worst_relative_error(&sum, &want_sum) < 1e-6, "{case}: the sum against f64");
        assert!(worst_relative_error(&normed, &want_normed) < 1e-5, "{case}: the norm against f64");
        assert_eq!(sum, apart_sum, "{case}: the sum against the sums apart");
        let worst = worst_relative_error(&normed, &apart_normed);
        assert!(worst < 1e-6, "{case}: the norm against the sums and the norm apart: {worst}");
    }
}

/// The scorer's log-probabilities without gradients on the test device (on a GPU troupe's one
/// kernel) against an f64 reference: rows wider than a cube, logits read through a narrowed
/// (strided) view, a row whose logits are all equal, and the first and last ids.
#[test]
fn token_logprobs_without_gradients_match_f64_on_the_test_device() {
    let device = crate::common::test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    // (rows, vocab, leading columns narrowed away)
    for (rows, vocab, skip) in [(7, 5003, 0), (3, 40, 9), (2, 151_936, 0)] {
        let columns = skip + vocab;
        let mut x: Vec<f32> = (0..rows * columns).map(|_| rng.random_range(-12.0f32..12.0)).collect();
        x[skip..columns].fill(0.5);
        let mut targets: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
        targets[0] = 0;
        targets[rows - 1] = vocab as u32 - 1;
        let stored = Tensor::<2>::from_data(TensorData::new(x.clone(), [rows, columns]), &device);
        let got = token_logprobs(stored.narrow(1, skip, vocab), &targets);
        let got = got.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        for (r, (&got, &target)) in got.iter().zip(&targets).enumerate() {
            let row = &x[r * columns + skip..][..vocab];
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
            let lse = row.iter().map(|&v| (f64::from(v) - max).exp()).sum::<f64>().ln() + max;
            let want = f64::from(row[target as usize]) - lse;
            assert!(
                (f64::from(got) - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{rows} x {vocab}, row {r}: {got} against {want}"
            );
        }
    }
}

#[test]
fn logsumexp_matches_the_composite() {
    use troupe::model::fused::logsumexp;

    let device = Device::flex().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (rows, vocab) = (13, 3001);
    let logits = random(&mut rng, [rows, vocab], 12.0, &device);
    let weights = random(&mut rng, [1, rows], 1.0, &device).reshape([rows]);
    let run = |fused: bool| {
        let x = Tensor::<2>::from_data(logits.to_data(), &device).require_grad();
        let lse = if fused {
            logsumexp(x.clone())
        } else {
            let max = x.clone().detach().max_dim(1);
            ((x.clone() - max.clone()).exp().sum_dim(1).log() + max).reshape([rows])
        };
        let grads = (lse.clone() * weights.clone()).sum().backward();
        (values(lse.reshape([1, rows])), values(x.grad(&grads).expect("a gradient")))
    };
    let ((got, got_grad), (want, want_grad)) = (run(true), run(false));
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
    }
    for (g, w) in got_grad.iter().zip(&want_grad) {
        assert!((g - w).abs() <= 1e-6, "gradient {g} vs {w}");
    }
}

#[test]
fn batched_matmul_equals_burn_matmul_bit_for_bit() {
    use troupe::model::fused::batched_matmul;

    let device = Device::flex().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let three = |rng: &mut ChaCha8Rng, dims: [usize; 3]| {
        let values: Vec<f32> = (0..dims.iter().product()).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Tensor::<3>::from_data(TensorData::new(values, dims), &device)
    };
    // One small product (serial), a batch of small ones (serial: too little work in all), a
    // batch of larger ones (parallel over the batch), one large (parallel inside the GEMM), and
    // LoRA's tall thin products (rows split between up to three tasks: the forward and `d lhs`
    // of all three, `d rhs` of the last two, over depths 2000 and 1500); the right operand as a
    // transposed view, as LoRA passes it.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a thread pool");
    for (batch, m, k, n) in [
        (1, 9, 7, 5),
        (6, 65, 96, 8),
        (8, 128, 128, 128),
        (1, 300, 256, 260),
        (1, 4100, 128, 8),
        (1, 2000, 260, 8),
        (1, 1500, 400, 8),
    ] {
        let lhs = three(&mut rng, [batch, m, k]);
        let rhs_stored = three(&mut rng, [batch, n, k]);
        let out_grad = three(&mut rng, [batch, m, n]);
        let run = |fused: bool| {
            let lhs = Tensor::<3>::from_data(lhs.to_data(), &device).require_grad();
            let stored = Tensor::<3>::from_data(rhs_stored.to_data(), &device).require_grad();
            let rhs = stored.clone().swap_dims(1, 2);
            let out = if fused { batched_matmul(lhs.clone(), rhs) } else { lhs.clone().matmul(rhs) };
            let grads = (out.clone() * out_grad.clone()).sum().backward();
            let flat =
                |t: Tensor<3>| t.without_autodiff().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
            [flat(out), flat(lhs.grad(&grads).expect("d lhs")), flat(stored.grad(&grads).expect("d rhs"))]
        };
        assert_eq!(pool.install(|| run(true)), run(false), "{batch} x {m}x{k}x{n}");
    }
}

/// The LM head's log-probabilities with gradients (`troupe::model::head`: the forward outside
/// autodiff, each row's gradient direction computed there) against the head's product followed
/// by burn's `log_softmax` and `gather` under autodiff, on the test device: values and the
/// input's gradient, for a weight in f32 and (where the device has it) bf16, in one chunk and in
/// many; and the same values untracked, bit for bit.
#[test]
fn head_logprobs_match_log_softmax_with_gradients_on_the_test_device() {
    use burn::tensor::DType;
    use troupe::model::fused::dense_linear;
    use troupe::model::head::head_logprobs;
    use troupe::model::layers::{FrozenLinear, LinearWeight};

    let device = crate::common::test_device();
    let autodiff = device.clone().autodiff();
    let cuda = troupe::device::is_cuda(&device);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // (rows, hidden, vocab): one chunk; a Qwen3 vocabulary in several chunks.
    for (rows, hidden, vocab) in [(19, 48, 5003), (300, 16, 151_936)] {
        let x = random(&mut rng, [rows, hidden], 1.0, &device);
        let w = random(&mut rng, [vocab, hidden], 0.5, &device);
        let targets: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
        let weights = random(&mut rng, [1, rows], 1.0, &autodiff).reshape([rows]);
        // wgpu's shaders have no bf16.
        let dtypes: &[DType] =
            if troupe::device::is_wgpu(&device) { &[DType::F32] } else { &[DType::F32, DType::BF16] };
        for &dtype in dtypes {
            let w = if dtype == DType::F32 { w.clone() } else { w.clone().cast(dtype) };
            let head = FrozenLinear { weight: LinearWeight::Dense(w.clone()), bias: None };
            let ours = Tensor::<2>::from_data(x.to_data(), &autodiff).require_grad();
            let got = head_logprobs(&head, ours.clone(), &targets);
            let grads = (got.clone() * weights.clone()).sum().backward();
            let got_grad = values(ours.grad(&grads).expect("a gradient"));
            let got = values(got.reshape([1, rows]));

            // The reference in blocks of rows (wgpu's buffers hold at most 128 MiB).
            let (mut want, mut want_grad) = (Vec::new(), Vec::new());
            for start in (0..rows).step_by(64) {
                let n = 64.min(rows - start);
                let block = x.clone().narrow(0, start, n);
                let theirs = Tensor::<2>::from_data(block.to_data(), &autodiff).require_grad();
                let ids: Vec<i64> = targets[start..start + n].iter().map(|&t| i64::from(t)).collect();
                let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), &autodiff).reshape([n, 1]);
                let lp = log_softmax(dense_linear(theirs.clone(), &w), 1).gather(1, ids).reshape([n]);
                let grads = (lp.clone() * weights.clone().narrow(0, start, n)).sum().backward();
                want_grad.extend(values(theirs.grad(&grads).expect("a gradient")));
                want.extend(values(lp.reshape([1, n])));
            }

            let case = format!("{rows} x {hidden} x {vocab} in {dtype:?}");
            assert!(worst_relative_error(&got, &want) <= 1e-5, "{case}: log-probs {got:?} vs {want:?}");
            // The reference scales each row before the product over the vocabulary and this code
            // after it: the CPU's GEMM sums in the same order either way, a GPU's need not (and
            // CUDA multiplies f32 in TF32 and rounds a bf16 product's operands).
            let bound = match (cuda, dtype) {
                (false, _) if device == Device::flex() => 1e-5,
                (false, _) => 1e-4,
                (true, DType::F32) => 5e-3,
                (true, _) => 3e-2,
            };
            let scale = want_grad.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let worst = got_grad.iter().zip(&want_grad).map(|(g, w)| (g - w).abs()).fold(0.0f32, f32::max);
            assert!(worst <= bound * scale, "{case}: gradient off by {worst} at scale {scale}");

            let untracked = head_logprobs(&head, Tensor::<2>::from_data(x.to_data(), &device), &targets);
            assert_eq!(values(untracked.reshape([1, rows])), got, "{case}: untracked");
        }
    }
}

/// The rotary embedding under autodiff on the device of `TROUPE_TEST_DEVICE` (the CPU's fused
/// kernel by default, one GPU kernel each way under `cuda` or `wgpu`) against burn's rotate-half
/// composite: values and the input's gradient, for queries as the attention makes them (heads
/// and positions swapped, strided) with the tables on the plain device and under autodiff.
#[test]
fn rope_with_gradients_matches_the_composite_on_the_test_device() {
    let device = crate::common::test_device();
    let autodiff = device.clone().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let four = |rng: &mut ChaCha8Rng, dims: [usize; 4], scale: f32, on: &Device| {
        let values: Vec<f32> = (0..dims.iter().product()).map(|_| rng.random_range(-scale..scale)).collect();
        Tensor::<4>::from_data(TensorData::new(values, dims), on)
    };
    let flat = |t: Tensor<4>| t.without_autodiff().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
    for (batch, heads, seq, dim) in [(2, 3, 5, 8), (2, 16, 33, 128)] {
        for tables_tracked in [false, true] {
            let on = if tables_tracked { &autodiff } else { &device };
            let table = [batch, 1, seq, dim];
            let (cos, sin) = (four(&mut rng, table, 1.0, on), four(&mut rng, table, 1.0, on));
            let x = four(&mut rng, [batch, seq, heads, dim], 2.0, &device);
            let out_grad = four(&mut rng, [batch, heads, seq, dim], 1.0, &autodiff);
            let run = |fused: bool| {
                let x = Tensor::<4>::from_data(x.to_data(), &autodiff).require_grad();
                let swapped = x.clone().swap_dims(1, 2);
                let out = if fused {
                    rope(swapped, &cos, &sin)
                } else {
                    let half = dim / 2;
                    let (first, second) = (swapped.clone().narrow(3, 0, half), swapped.clone().narrow(3, half, half));
                    swapped * cos.clone() + Tensor::cat(vec![second.neg(), first], 3) * sin.clone()
                };
                let grads = (out.clone() * out_grad.clone()).sum().backward();
                [flat(out), flat(x.grad(&grads).expect("a gradient"))]
            };
            let (fused, composite) = (run(true), run(false));
            for (what, (got, want)) in ["values", "dx"].iter().zip(fused.iter().zip(&composite)) {
                let worst = worst_relative_error(got, want);
                let case = format!("{batch} x {heads} heads x {seq} x {dim}, tables tracked: {tables_tracked}");
                assert!(worst < 1e-5, "{what}, {case}: {worst}");
            }
        }
    }
}

/// The SwiGLU gate on a stacked gate/up product under autodiff on the device of
/// `TROUPE_TEST_DEVICE` (the CPU's fused kernel by default, one GPU kernel each way under `cuda`
/// or `wgpu`) against burn's `silu(gate) * up` on the narrowed halves plus their deltas: values
/// and the gradients of the stacked product and of each delta given, for widths whose second
/// half does and does not start at an aligned address.
#[test]
fn swiglu_stacked_with_gradients_matches_the_composite_on_the_test_device() {
    let device = crate::common::test_device();
    let autodiff = device.clone().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for (rows, width) in [(37, 96), (20, 37)] {
        let stacked = random(&mut rng, [rows, 2 * width], 6.0, &device);
        let (delta_gate, delta_up) =
            (random(&mut rng, [rows, width], 1.0, &device), random(&mut rng, [rows, width], 1.0, &device));
        let out_grad = random(&mut rng, [rows, width], 1.0, &autodiff);
        let leaf = |t: &Tensor<2>| Tensor::<2>::from_data(t.to_data(), &autodiff).require_grad();
        for (gate_on, up_on) in [(false, false), (true, true), (true, false)] {
            let run = |fused: bool| {
                // As the MLP sees them: [batch, seq, 2 width].
                let (gate_up, dg, du) = (leaf(&stacked), leaf(&delta_gate), leaf(&delta_up));
                let three = |t: Tensor<2>| {
                    let [n, w] = t.dims();
                    t.reshape([1, n, w])
                };
                let (dg_in, du_in) = (gate_on.then(|| three(dg.clone())), up_on.then(|| three(du.clone())));
                let input = three(gate_up.clone());
                let out = if fused {
                    swiglu_stacked(input, dg_in, du_in)
                } else {
                    let gate = input.clone().narrow(2, 0, width);
                    let up = input.narrow(2, width, width);
                    let gate = dg_in.map_or(gate.clone(), |d| gate + d);
                    let up = du_in.map_or(up.clone(), |d| up + d);
                    silu(gate) * up
                };
                let out = out.reshape([rows, width]);
                let grads = (out.clone() * out_grad.clone()).sum().backward();
                let grad = |t: &Tensor<2>| t.grad(&grads).map(values);
                (values(out), grad(&gate_up), grad(&dg), grad(&du))
            };
            let case = format!("{rows} x {width}, deltas ({gate_on}, {up_on})");
            let (fused, composite) = (run(true), run(false));
            assert!(fused.2.is_some() == gate_on && fused.3.is_some() == up_on, "{case}: delta gradients");
            let pairs = [
                ("values", Some(fused.0), Some(composite.0)),
                ("stacked gradient", fused.1, composite.1),
                ("gate delta gradient", fused.2, composite.2),
                ("up delta gradient", fused.3, composite.3),
            ];
            for (what, got, want) in pairs {
                let (got, want) = match (got, want) {
                    (Some(got), Some(want)) => (got, want),
                    (None, None) => continue,
                    _ => panic!("{case}: {what} on one side only"),
                };
                let worst = worst_relative_error(&got, &want);
                assert!(worst < 1e-5, "{what}, {case}: {worst}");
            }
        }
    }
}

/// An adapter's delta over a decoding step's few rows (one kernel on a GPU, at most 64 rows)
/// equals the same rows' delta in a batch past that (burn's products): stacked adapters of
/// different ranks and sites, rows without an adapter, one position and three, and the q/k/v
/// parts' joined delta where the device joins them, alone and added to the stacked output.
#[test]
fn few_row_adapter_deltas_equal_the_products_of_a_larger_batch_on_the_test_device() {
    use troupe::adapters::MultiAdapterManager;
    use troupe::model::{LoadOptions, Model, Precision, Projection, ProjectionDelta};

    let device = crate::common::test_device();
    let dir = crate::common::models_dir().join("tiny-qwen3");
    let model = Model::load(&LoadOptions::path(&dir).dtype(Precision::F32), &device).unwrap();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.load_adapters(&dir.join("adapters")).unwrap();
    let config = &model.lm.config;
    let (q, kv) = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim);
    // agent 0: r4 on all seven sites; agent 1: r8 on q and v.
    let few_agents = [Some(0), Some(1), None, Some(1), Some(0)];
    let many_agents: Vec<Option<usize>> =
        few_agents.iter().copied().chain((0..65).map(|i| [Some(1), None, Some(0)][i % 3])).collect();
    let (few, _) = manager.mixed(&few_agents, false).unwrap();
    let (many, _) = manager.mixed(&many_agents, false).unwrap();
    let (few, many) = (few.untracked().unwrap(), many.untracked().unwrap());
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let flat = |t: Tensor<3>| t.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
    let close = |got: Vec<f32>, want: Vec<f32>, what: &str| {
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{what}: the adapters change these rows");
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst <= 1e-5 * scale.max(1.0), "{what}: off by {worst} at scale {scale}");
    };
    for seq in [1, 3] {
        for (layer, projection, width) in [
            (0, Projection::Q, config.hidden_size),
            (1, Projection::O, q),
            (0, Projection::Down, config.intermediate_size),
        ] {
            let x = random(&mut rng, [many_agents.len() * seq, width], 2.0, &device).reshape([
                many_agents.len(),
                seq,
                width,
            ]);
            let rows = x.clone().narrow(0, 0, few_agents.len());
            let want = many.delta(layer, projection, &x).unwrap().narrow(0, 0, few_agents.len());
            let got = few.delta(layer, projection, &rows).unwrap();
            close(flat(got), flat(want), &format!("{projection:?}, layer {layer}, {seq} positions"));
        }
        let parts = [(Projection::Q, q), (Projection::K, kv), (Projection::V, kv)];
        let x = random(&mut rng, [many_agents.len() * seq, config.hidden_size], 2.0, &device).reshape([
            many_agents.len(),
            seq,
            config.hidden_size,
        ]);
        let rows = x.clone().narrow(0, 0, few_agents.len());
        match (few.joint_delta(0, &parts, &rows), many.joint_delta(0, &parts, &x)) {
            (Some(got), Some(want)) => {
                close(flat(got), flat(want.narrow(0, 0, few_agents.len())), &format!("joined q/k/v, {seq} positions"))
            }
            (None, None) => assert!(device == Device::flex(), "a GPU joins these adapters' q/k/v factors"),
            _ => panic!("both batches join the q/k/v factors or neither does"),
        }
        // The joint delta added to the stacked output (one kernel over few rows on a GPU).
        let width = q + 2 * kv;
        let base =
            random(&mut rng, [many_agents.len() * seq, width], 2.0, &device).reshape([many_agents.len(), seq, width]);
        let few_base = || base.clone().narrow(0, 0, few_agents.len());
        let many_base = || base.clone();
        match (few.joint_sum(0, &parts, &rows, &few_base), many.joint_sum(0, &parts, &x, &many_base)) {
            (Some(got), Some(want)) => close(
                flat(got),
                flat(want.narrow(0, 0, few_agents.len())),
                &format!("joined q/k/v added to the output, {seq} positions"),
            ),
            (None, None) => {}
            _ => panic!("both batches join the q/k/v factors or neither does"),
        }
    }
}

/// The kernels before a frozen product in half precision write their output rounded for it
/// (`*_rounded`): on a GPU the residual sum with its norm, the gate, and a decoding step's
/// attention each give that rounding bit for bit as a cast of their f32 output gives it, and a
/// frozen product fed it (`FrozenLinear::forward_rounded`) gives bit for bit the product of the
/// f32 input, which rounds it itself: so a model's outputs do not change, one launch a product
/// fewer. In bf16 on CUDA, in f16 on wgpu (whose shaders have no bf16); on the CPU no rounding
/// is asked for (`input_rounding` is `None`) and none is written.
#[test]
fn kernels_before_a_half_precision_product_write_its_rounded_input_as_a_cast_does_on_the_test_device() {
    use burn::tensor::{Bool, DType};
    use troupe::model::fused::{add_rms_norm_rounded, attention_rounded, swiglu_stacked_rounded, HostMask};
    use troupe::model::{AttentionKernel, LoadOptions, Model, Precision};

    let device = crate::common::test_device();
    let low = if troupe::device::is_cuda(&device) { Precision::Bf16 } else { Precision::F16 };
    let model = Model::load(&LoadOptions::builtin(troupe::model::Preset::Tiny, 3).dtype(low), &device).unwrap();
    let layer = &model.lm.layers[0];
    let (qkv, gate_up, down, o) =
        (&layer.self_attn.qkv_proj, &layer.mlp.gate_up_proj, &layer.mlp.down_proj, &layer.self_attn.o_proj);
    let round = qkv.input_rounding();
    if device == Device::flex() {
        assert_eq!(round, None, "the CPU asks for no rounding");
        return;
    }
    let dtype = round.expect("a half-precision weight on a GPU asks for its input rounded");
    assert!(matches!(dtype, DType::BF16 | DType::F16));
    let bits = |t: Tensor<3>| t.into_data().as_bytes().to_vec();
    let rounded_as_cast = |f32s: &Tensor<3>, rounded: Option<Tensor<3>>, what: &str| {
        let rounded = rounded.unwrap_or_else(|| panic!("{what}: the kernel wrote the rounding"));
        assert_eq!(rounded.dtype(), dtype, "{what}");
        assert_eq!(bits(rounded), bits(f32s.clone().cast(dtype)), "{what}: the rounding is a cast's");
    };
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let hidden = model.lm.config.hidden_size;
    let random3 =
        |rng: &mut ChaCha8Rng, dims: [usize; 3]| random(rng, [dims[0] * dims[1], dims[2]], 2.0, &device).reshape(dims);

    // The residual sum and its norm, over a decoding step's rows and a prefill's.
    for dims in [[16, 1, hidden], [2, 37, hidden]] {
        let (x, y) = (random3(&mut rng, dims), random3(&mut rng, dims));
        let norm = &layer.post_attention_layernorm;
        let (_, normed, rounded) = add_rms_norm_rounded(x, y, None, &norm.weight, norm.eps, Some(dtype));
        rounded_as_cast(&normed, rounded.clone(), "residual sum and norm");
        let fed = gate_up.forward_rounded(normed.clone(), rounded);
        assert_eq!(bits(fed), bits(gate_up.forward(normed)), "the gate/up product fed the rounding");
    }
    // The gate, from the stacked gate/up output.
    let width = model.lm.config.intermediate_size;
    let gate_up_out = random3(&mut rng, [4, 3, 2 * width]);
    let (gated, rounded) = swiglu_stacked_rounded(gate_up_out, None, None, Some(dtype));
    rounded_as_cast(&gated, rounded.clone(), "gate");
    assert_eq!(bits(down.forward_rounded(gated.clone(), rounded)), bits(down.forward(gated)), "the down product");

    // A decoding step's attention, over a cache room whose last slots are not written yet.
    let config = &model.lm.config;
    let (rows, heads, kv_heads, dim, keys) =
        (5, config.num_attention_heads, config.num_key_value_heads, config.head_dim, 40);
    let q = random(&mut rng, [rows * heads, dim], 2.0, &device).reshape([rows, heads, 1, dim]);
    let kv = |rng: &mut ChaCha8Rng| {
        random(rng, [rows * kv_heads * keys, dim], 2.0, &device).reshape([rows, kv_heads, keys, dim])
    };
    let (k, v) = (kv(&mut rng), kv(&mut rng));
    let hidden_keys: Vec<bool> = (0..rows).flat_map(|r| (0..keys).map(move |j| j >= 30 + r)).collect();
    let mask = Tensor::<4, Bool>::from_data(TensorData::new(hidden_keys.clone(), [rows, 1, 1, keys]), &device);
    let host_mask = std::sync::Arc::new(HostMask::new(hidden_keys, [rows, 1, keys]));
    let (out, rounded) = attention_rounded(q, k, v, &mask, &host_mask, AttentionKernel::Materialized, Some(dtype));
    let merged = |t: Tensor<4>| t.swap_dims(1, 2).reshape([rows, 1, heads * dim]);
    let out = merged(out);
    rounded_as_cast(&out, rounded.clone().map(merged), "decoding attention");
    let rounded = rounded.map(merged);
    assert_eq!(bits(o.forward_rounded(out.clone(), rounded)), bits(o.forward(out)), "the output product");
}

/// A reserved cache's one-kernel write of a step's keys and values (`fused::gpu::cache_write`)
/// against burn's slice writes, bit for bit: into f32 rooms and into rooms in half precision
/// (bf16 under CUDA, f16 elsewhere: wgpu's shaders have no bf16), the values strided as the
/// q/k/v product's view gives them, at a decoding step and over several slots. Rooms another
/// tensor still holds are refused, nothing written.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
#[test]
fn a_reserved_caches_one_kernel_write_equals_burns_slice_writes_on_the_test_device() {
    use burn::tensor::DType;
    use troupe::model::fused::gpu::cache_write;

    let device = crate::common::test_device();
    if device == Device::flex() {
        return;
    }
    let half = if troupe::device::is_cuda(&device) { DType::BF16 } else { DType::F16 };
    let mut rng = ChaCha8Rng::seed_from_u64(18);
    let bits = |t: Tensor<4>| t.into_data().as_bytes().to_vec();
    // (batch, heads, room, head dim, new slots, first new slot)
    for (batch, heads, room, dim, seq, start) in [(16, 8, 40, 128, 1, 17), (3, 2, 12, 8, 5, 6), (2, 1, 4, 4, 4, 0)] {
        let case = format!("{batch} x {heads} heads x {seq} of {room} slots from {start} x {dim}");
        let room_data = |rng: &mut ChaCha8Rng| random(rng, [batch * heads * room, dim], 2.0, &device).into_data();
        let (key_room, value_room) = (room_data(&mut rng), room_data(&mut rng));
        let keys = random(&mut rng, [batch * heads * seq, dim], 2.0, &device).reshape([batch, heads, seq, dim]);
        // The values as a view of `[batch, seq, heads, head_dim]`, heads first.
        let values = random(&mut rng, [batch * seq * heads, dim], 2.0, &device)
            .reshape([batch, seq, heads, dim])
            .swap_dims(1, 2);
        for dtype in [DType::F32, half] {
            let room = |data: &TensorData| {
                Tensor::<2>::from_data(data.clone(), &device).reshape([batch, heads, room, dim]).cast(dtype)
            };
            let at = [0..batch, 0..heads, start..start + seq, 0..dim];
            let want_k = room(&key_room).slice_assign(at.clone(), keys.clone().cast(dtype));
            let want_v = room(&value_room).slice_assign(at, values.clone().cast(dtype));
            let Ok((got_k, got_v)) = cache_write((room(&key_room), room(&value_room)), &keys, &values, start) else {
                panic!("{case}, {dtype:?}: the kernel takes rooms nothing else holds");
            };
            assert_eq!((got_k.dtype(), got_v.dtype()), (dtype, dtype), "{case}");
            assert_eq!(bits(got_k), bits(want_k), "{case}, {dtype:?}: keys");
            assert_eq!(bits(got_v), bits(want_v), "{case}, {dtype:?}: values");
        }
        let (held_k, held_v) =
            (Tensor::<2>::from_data(key_room.clone(), &device), Tensor::<2>::from_data(value_room, &device));
        let shape = [batch, heads, room, dim];
        let refused =
            cache_write((held_k.clone().reshape(shape), held_v.clone().reshape(shape)), &keys, &values, start);
        let (back_k, _) = refused.expect_err("rooms another tensor holds are not written in place");
        assert_eq!(bits(back_k), bits(held_k.reshape(shape)), "{case}: a refused room is unchanged");
    }
}

/// One kernel rotating a layer's queries and keys (Qwen3's per-head norms first, or the rotation
/// alone) and writing the keys and values into a reserved cache's rooms gives what the kernels
/// apart give, on the device of `TROUPE_TEST_DEVICE` (nothing to check on the CPU): with the
/// norms, the queries and the rooms bit for bit those of the pair's kernel and the cache's
/// write; without, within 1e-6 of the rotation's kernel (whose product and sum a compiler may
/// contract differently), the values bit for bit; rooms in f32 and in half precision, the
/// queries, keys and values strided as the q/k/v product's views give them, at a decoding step
/// and over several slots, with and without queries. Rooms another tensor holds are refused,
/// nothing written.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
#[test]
fn one_kernel_rotating_into_a_reserved_cache_equals_the_kernels_apart_on_the_test_device() {
    use burn::tensor::DType;
    use troupe::model::fused::gpu::{cache_write, rms_norm_rope_pair, rope_into_room};

    let device = crate::common::test_device();
    if device == Device::flex() {
        return;
    }
    let half = if troupe::device::is_cuda(&device) { DType::BF16 } else { DType::F16 };
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    let bits = |t: Tensor<4>| t.into_data().as_bytes().to_vec();
    let values_of = |t: Tensor<4>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    // (batch, seq, heads, kv heads, head dim, room, first new slot)
    for (batch, seq, heads, kv_heads, dim, room, start) in
        [(16, 1, 4, 2, 128, 40, 17), (3, 5, 4, 2, 8, 12, 6), (2, 4, 2, 1, 4, 4, 0)]
    {
        let case = format!("{batch} x {seq} of {room} slots from {start}, {heads}/{kv_heads} heads x {dim}");
        // The parts as views of the stacked q/k/v product `[batch, seq, heads + 2 kv_heads, dim]`.
        let width = heads + 2 * kv_heads;
        let stacked = random(&mut rng, [batch * seq * width, dim], 2.0, &device).reshape([batch, seq, width, dim]);
        let q = stacked.clone().narrow(2, 0, heads);
        let k = stacked.clone().narrow(2, heads, kv_heads);
        let v = stacked.narrow(2, heads + kv_heads, kv_heads).swap_dims(1, 2);
        let table = |rng: &mut ChaCha8Rng| random(rng, [batch * seq, dim], 1.0, &device).reshape([batch, 1, seq, dim]);
        let (cos, sin) = (table(&mut rng), table(&mut rng));
        let weight = |rng: &mut ChaCha8Rng| random(rng, [1, dim], 1.5, &device).reshape([dim]);
        let (q_weight, k_weight) = (weight(&mut rng), weight(&mut rng));
        let room_data = |rng: &mut ChaCha8Rng| random(rng, [batch * kv_heads * room, dim], 2.0, &device).into_data();
        let (key_room, value_room) = (room_data(&mut rng), room_data(&mut rng));
        for (normed, dtype, with_q) in [
            (true, DType::F32, true),
            (true, half, true),
            (false, DType::F32, true),
            (false, half, true),
            (true, half, false),
        ] {
            let case = format!("{case}, normed {normed}, {dtype:?}, queries {with_q}");
            let room = |data: &TensorData| {
                Tensor::<2>::from_data(data.clone(), &device).reshape([batch, kv_heads, room, dim]).cast(dtype)
            };
            let (want_q, want_k) = if normed {
                rms_norm_rope_pair((&q, &q_weight), (&k, &k_weight), 1e-6, &cos, &sin).expect("the pair's kernel")
            } else {
                (rope(q.clone().swap_dims(1, 2), &cos, &sin), rope(k.clone().swap_dims(1, 2), &cos, &sin))
            };
            let (want_rooms_k, want_rooms_v) =
                cache_write((room(&key_room), room(&value_room)), &want_k, &v, start).expect("the cache's write");
            let norms = normed.then_some((&q_weight, &k_weight, 1e-6));
            let got = rope_into_room(
                (with_q.then_some(&q), &k, &v),
                norms,
                (&cos, &sin),
                (room(&key_room), room(&value_room)),
                start,
            );
            let Ok((got_q, (got_k, got_v))) = got else {
                panic!("{case}: the kernel takes rooms nothing else holds");
            };
            assert_eq!((got_k.dtype(), got_v.dtype()), (dtype, dtype), "{case}");
            assert_eq!(got_q.is_some(), with_q, "{case}");
            assert_eq!(bits(got_v), bits(want_rooms_v), "{case}: values");
            if normed {
                if let Some(got_q) = got_q {
                    assert_eq!(bits(got_q), bits(want_q), "{case}: queries");
                }
                assert_eq!(bits(got_k), bits(want_rooms_k), "{case}: keys");
            } else {
                let close = |got: Vec<f32>, want: Vec<f32>, what: &str| {
                    let worst =
                        got.iter().zip(&want).map(|(g, w)| (g - w).abs() / w.abs().max(1.0)).fold(0.0, f32::max);
                    assert!(worst <= 1e-6, "{case}: {what} off by {worst}");
                };
                if let Some(got_q) = got_q {
                    close(values_of(got_q), values_of(want_q), "queries");
                }
                // A key rounded to half precision may round the other way after a contracted sum.
                let tolerance_room = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
                let worst = values_of(got_k)
                    .iter()
                    .zip(&values_of(want_rooms_k))
                    .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
                    .fold(0.0, f32::max);
                assert!(worst <= tolerance_room, "{case}: keys off by {worst}");
            }
        }
        let held = Tensor::<2>::from_data(key_room, &device).reshape([batch, kv_heads, room, dim]);
        let other = Tensor::<2>::from_data(value_room, &device).reshape([batch, kv_heads, room, dim]);
        let refused = rope_into_room((Some(&q), &k, &v), None, (&cos, &sin), (held.clone(), other), start);
        let (back_k, _) = refused.expect_err("rooms another tensor holds are not written in place");
        assert_eq!(bits(back_k), bits(held), "{case}: a refused room is unchanged");
    }
}

/// The few-row LoRA kernel (`lora_delta`) gives `((x A^T) * mask[row / seq]) B^T + base` as an
/// f64 sum of the same operands does, within 1e-6 of the sum of the terms' magnitudes: at a
/// decoding step's row counts, ranks from 1 to 256 (each rank column's sum split over 32 to 1
/// units), fan-ins shorter than a split group and as long as a Qwen3-4B output projection's,
/// outputs wider than one cube's block of columns (a Qwen3 q/k/v projection's), with and without
/// a rank mask over rows of several adapters and an output to add to, the input a view of other
/// strides; on the device of `TROUPE_TEST_DEVICE` (nothing to check on the CPU).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
#[test]
fn the_few_row_lora_kernel_matches_an_f64_sum_on_the_test_device() {
    use troupe::model::fused::gpu::lora_delta;

    let device = crate::common::test_device();
    if device == Device::flex() {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    let host = |t: &Tensor<2>| values(t.clone());
    let mut largest = 0f64;
    // (rows, seq, fan in, fan out, rank, masked, onto)
    for (rows, seq, fan_in, fan_out, rank, masked, onto) in [
        (16, 1, 1000, 4500, 48, true, true),
        (1, 1, 4096, 64, 16, false, false),
        (5, 1, 7, 2049, 1, false, true),
        (64, 2, 96, 300, 256, true, false),
        (9, 3, 50, 100, 24, true, true),
    ] {
        let case = format!(
            "{rows} rows of {seq}, fan in {fan_in}, fan out {fan_out}, rank {rank}, masked {masked}, onto {onto}"
        );
        let x = random(&mut rng, [fan_in, rows], 1.0, &device).transpose();
        let a = random(&mut rng, [rank, fan_in], 0.5, &device);
        let b_scaled = random(&mut rng, [fan_out, rank], 0.5, &device);
        let groups = rows.div_ceil(seq);
        // Each group of rows keeps a few adapters' columns: a pattern of zeros and ones.
        let keep: Vec<f32> = (0..groups).flat_map(|g| (0..rank).map(move |j| f32::from((j + g) % 3 != 0))).collect();
        let mask = masked.then(|| Tensor::<2>::from_data(TensorData::new(keep.clone(), [groups, rank]), &device));
        let base = onto.then(|| random(&mut rng, [rows, fan_out], 2.0, &device));
        let got = host(&lora_delta(&x, &a, &b_scaled, mask.as_ref(), seq, base.as_ref()));

        let (xs, as_, bs) = (host(&x), host(&a), host(&b_scaled));
        let bases = base.as_ref().map(host);
        for r in 0..rows {
            // The first product in f64, and the magnitudes its terms sum to.
            let (mut down, mut size) = (vec![0f64; rank], vec![0f64; rank]);
            for j in 0..rank {
                let kept = if masked { f64::from(keep[(r / seq) * rank + j]) } else { 1.0 };
                for i in 0..fan_in {
                    let term = f64::from(xs[r * fan_in + i]) * f64::from(as_[j * fan_in + i]);
                    down[j] += term * kept;
                    size[j] += term.abs() * kept;
                }
            }
            for c in 0..fan_out {
                let mut want = bases.as_ref().map_or(0.0, |b| f64::from(b[r * fan_out + c]));
                let mut magnitude = want.abs();
                for j in 0..rank {
                    let bj = f64::from(bs[c * rank + j]);
                    want += down[j] * bj;
                    magnitude += size[j] * bj.abs();
                }
                let off = (f64::from(got[r * fan_out + c]) - want).abs() / magnitude.max(1.0);
                assert!(off <= 1e-6, "{case}: row {r}, column {c}: {} against {want}", got[r * fan_out + c]);
                largest = largest.max(off);
            }
        }
    }
    eprintln!("the few-row LoRA kernel against an f64 sum: {largest:.2e} of the terms' magnitudes");
}

/// The residual sum's kernel computing the output projection's adapter delta itself
/// (`add_low_rank_rms_norm`) gives what the delta's kernel and the sum's kernel apart give
/// (`lora_delta`, then `add_rms_norm`), within 1e-6 (a compiler may contract a product and a
/// sum differently in the two): the sum, the norm and the norm rounded to half precision; with
/// a rank mask over rows of two adapters (some columns zeroed) and without one; over a decoding
/// step's rows and a few slots each; in cubes narrower than the kernel's (a row of 40 or 64
/// values) and as wide (300), so each rank column's sum is split over the same units in more or
/// fewer rounds; on the device of `TROUPE_TEST_DEVICE` (nothing to check on the CPU). Past the
/// decoding kernel's rows it runs nothing.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
#[test]
fn the_residual_sum_computing_the_output_deltas_low_rank_product_equals_the_kernels_apart_on_the_test_device() {
    use burn::tensor::DType;
    use troupe::model::fused::gpu::{add_low_rank_rms_norm, add_rms_norm, lora_delta, LORA_DELTA_MAX_ROWS};
    use troupe::model::LowRank;

    let device = crate::common::test_device();
    if device == Device::flex() {
        return;
    }
    let half = if troupe::device::is_cuda(&device) { DType::BF16 } else { DType::F16 };
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let values_of = |t: Tensor<3>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let worst = |got: Vec<f32>, want: Vec<f32>| {
        assert_eq!(got.len(), want.len());
        got.iter().zip(&want).map(|(g, w)| (g - w).abs() / w.abs().max(1.0)).fold(0.0f32, f32::max)
    };
    let mut largest = 0f32;
    // (batch, seq, width, fan in, rank, masked)
    for (batch, seq, width, fan_in, rank, masked) in [
        (16, 1, 64, 48, 16, true),
        (16, 1, 64, 48, 16, false),
        (3, 2, 40, 24, 24, true),
        (1, 1, 256, 128, 1, false),
        (4, 1, 300, 1100, 32, true),
    ] {
        let case = format!("{batch} x {seq}, width {width}, fan in {fan_in}, rank {rank}, masked {masked}");
        let rows = batch * seq;
        let x = random(&mut rng, [rows, width], 2.0, &device).reshape([batch, seq, width]);
        let y = random(&mut rng, [rows, width], 2.0, &device).reshape([batch, seq, width]);
        // The projection's input as attention's merged heads give it: a view of other strides.
        let input = random(&mut rng, [fan_in, rows], 1.0, &device).transpose().reshape([batch, seq, fan_in]);
        let a = random(&mut rng, [rank, fan_in], 0.5, &device);
        let b_scaled = random(&mut rng, [width, rank], 0.5, &device);
        let mask = masked.then(|| {
            // Two adapters' columns side by side: even rows keep the first half, odd the rest.
            let keep: Vec<f32> =
                (0..batch).flat_map(|b| (0..rank).map(move |j| f32::from((j < rank / 2) == (b % 2 == 0)))).collect();
            Tensor::<2>::from_data(TensorData::new(keep, [batch, rank]), &device)
        });
        let weight = random(&mut rng, [1, width], 1.5, &device).reshape([width]);
        let factors = LowRank { a: a.clone(), b_scaled: b_scaled.clone(), mask: mask.clone() };
        for round in [None, Some(half)] {
            let case = format!("{case}, rounded to {round:?}");
            let delta = lora_delta(&input.clone().reshape([rows, fan_in]), &a, &b_scaled, mask.as_ref(), seq, None)
                .reshape([batch, seq, width]);
            let (want_sum, want_norm, want_rounded) =
                add_rms_norm(&x, &y, Some(&delta), &weight, 1e-6, round).expect("the sum's kernel");
            let (sum, norm, rounded) =
                add_low_rank_rms_norm(&x, &y, (&input, &factors), &weight, 1e-6, round).expect("the fused kernel");
            for (what, got, want) in [("sum", sum, want_sum), ("norm", norm, want_norm)] {
                let off = worst(values_of(got), values_of(want));
                assert!(off <= 1e-6, "{case}: {what} off by {off}");
                largest = largest.max(off);
            }
            assert_eq!(rounded.is_some(), round.is_some(), "{case}");
            if let (Some(got), Some(want)) = (rounded, want_rounded) {
                assert_eq!(got.dtype(), want.dtype(), "{case}");
                // A norm within 1e-6 may round to the neighbouring half-precision value.
                let off = worst(values_of(got), values_of(want));
                assert!(off <= 1e-2, "{case}: rounded norm off by {off}");
            }
        }
    }
    eprintln!("the fused low-rank residual sum against the kernels apart: {largest:.2e}");

    // Past a decoding step's rows, nothing runs.
    let (batch, width, fan_in, rank) = (LORA_DELTA_MAX_ROWS + 1, 16, 8, 4);
    let tall = |rng: &mut ChaCha8Rng, cols: usize| random(rng, [batch, cols], 1.0, &device).reshape([batch, 1, cols]);
    let (x, y, input) = (tall(&mut rng, width), tall(&mut rng, width), tall(&mut rng, fan_in));
    let factors = LowRank {
        a: random(&mut rng, [rank, fan_in], 1.0, &device),
        b_scaled: random(&mut rng, [width, rank], 1.0, &device),
        mask: None,
    };
    let weight = random(&mut rng, [1, width], 1.0, &device).reshape([width]);
    assert!(add_low_rank_rms_norm(&x, &y, (&input, &factors), &weight, 1e-6, None).is_none());
}

/// Every routine `TROUPE_MATMUL` can name either computes a frozen product as an f64 sum of its
/// rounded operands does, or refuses it before writing anything, on the device of
/// `TROUPE_TEST_DEVICE` (nothing to check on the CPU, whose products are troupe's own): `x W^T`
/// and `dy W`, in f32 and in the half precision the device has (bf16 on CUDA, f16 on wgpu), at
/// shapes whose sides divide the tiles and shapes whose sides do not. `auto` and the routine
/// without tile-matrix units (`simple-unit`, burn's fallback) launch everywhere. Which routines
/// refuse, and why, is printed (`--nocapture`).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
#[test]
fn every_matmul_routine_computes_a_frozen_product_or_refuses_it_on_the_test_device() {
    use burn::tensor::DType;
    use troupe::model::fused::gpu::frozen_product_by;
    use troupe::model::MatmulKernel;

    let device = crate::common::test_device();
    if device == Device::flex() {
        return;
    }
    let half = if troupe::device::is_cuda(&device) { DType::BF16 } else { DType::F16 };
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    // Per routine: the products it launched, those it refused, and its first refusal.
    let mut tally = std::collections::BTreeMap::<String, (usize, usize, String)>::new();
    for dtype in [DType::F32, half] {
        for (rows, out, inner) in [(64, 256, 128), (37, 200, 72), (256, 512, 384)] {
            let weight = random(&mut rng, [out, inner], 1.0, &device).cast(dtype);
            let w: Vec<f64> = values(weight.clone().cast(DType::F32)).into_iter().map(f64::from).collect();
            for transposed in [true, false] {
                let width = if transposed { inner } else { out };
                let x = random(&mut rng, [rows, width], 1.0, &device);
                // The product rounds `x` to the weight's type; the reference sums the rounded values.
                let xs: Vec<f64> = values(x.clone().cast(dtype).cast(DType::F32)).into_iter().map(f64::from).collect();
                let cols = if transposed { out } else { inner };
                // `x W^T`: w[j, i]; `dy W`: w[i, j]. Each output's sum, and the sum of its terms' sizes.
                let reference: Vec<(f64, f64)> = (0..rows * cols)
                    .map(|idx| {
                        let (r, c) = (idx / cols, idx % cols);
                        (0..width).fold((0.0, 0.0), |(sum, size), i| {
                            let term = xs[r * width + i] * if transposed { w[c * inner + i] } else { w[i * inner + c] };
                            (sum + term, size + term.abs())
                        })
                    })
                    .collect();
                // f32 operands multiply in TF32 on CUDA's tile units (a 10-bit mantissa); half
                // operands' products are exact in f32; every routine accumulates in f32.
                let tolerance = if dtype == DType::F32 && troupe::device::is_cuda(&device) { 2e-3 } else { 1e-5 };
                for &kernel in MatmulKernel::all() {
                    let what = format!(
                        "{} {dtype:?} {rows}x{width} {} [{out}, {inner}]",
                        kernel.name(),
                        if transposed { "W^T" } else { "W" }
                    );
                    match frozen_product_by(kernel, &x, &weight, transposed) {
                        Ok(y) => {
                            assert_eq!(y.dims(), [rows, cols], "{what}");
                            assert_eq!(y.dtype(), DType::F32, "{what}: written in f32");
                            let got = values(y);
                            let worst = got
                                .iter()
                                .zip(&reference)
                                .map(|(&g, &(sum, size))| (f64::from(g) - sum).abs() / size.max(1e-30))
                                .fold(0.0, f64::max);
                            assert!(worst < tolerance, "{what}: {worst}");
                            tally.entry(kernel.name()).or_default().0 += 1;
                        }
                        Err(reason) => {
                            assert!(
                                !matches!(kernel, MatmulKernel::Auto | MatmulKernel::SimpleUnit),
                                "{what}: {reason}"
                            );
                            assert!(!reason.trim().is_empty(), "{what}: a refusal says why");
                            let entry = tally.entry(kernel.name()).or_default();
                            entry.1 += 1;
                            if entry.2.is_empty() {
                                entry.2 = format!("{what}: {reason}");
                            }
                        }
                    }
                }
            }
        }
    }
    for (kernel, (launched, refused, first)) in &tally {
        let first: String = first.split_whitespace().collect::<Vec<_>>().join(" ").chars().take(200).collect();
        let first = if first.is_empty() { String::new() } else { format!(" (first: {first})") };
        eprintln!("{kernel}: {launched} launched, {refused} refused{first}");
    }
}
