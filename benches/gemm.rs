//! The f32 GEMM rate on this machine, against what the CPU can do at all: the frozen projection
//! `x W^T` (`troupe::model::fused::dense_linear`, burn's GEMM call) at every product shape of the
//! `small` preset's forward, for a 1 x 128 prefill's 128 rows and a 16 x 128 prefill's 2048
//! (`gemm_t128`, `gemm_t2048`); burn's matmul at the tiny model's widest shape and a square 1024
//! one (`gemm`: the denominator of the README's achieved-FLOP fractions for the Hanabi main job);
//! and the cores' fused multiply-add peak, from a loop that keeps its operands in registers.
//!
//! Throughput is in floating-point operations (criterion's `elem/s` = FLOP/s: `2 t out in` per
//! product, 16 per 8-lane multiply-add). The same products in PyTorch, same threads:
//! `python tools/peer_bench.py --gemm` (`torch.nn.functional.linear`).
//!
//! On a GPU (`TROUPE_DEVICE=cuda`, a `--features cuda` build) the `frozen_<preset>_t<rows>`
//! groups time instead the frozen products of each preset in `TROUPE_BENCH_PRESETS` (default
//! `small`), in the base's dtype (`TROUPE_DTYPE`, default bf16 on CUDA), by every cubek routine
//! `TROUPE_MATMUL` can name (`troupe::model::matmul_kernel`; `TROUPE_GEMM_KERNELS`, names
//! separated by commas, takes fewer): `x W^T` (`fwd_`) at a decoding step's 64 rows and an
//! update micro-batch's 2048 (16 replies of 128 tokens; `TROUPE_GEMM_ROWS` takes other counts),
//! and the input's gradient `dy W` (`bwd_`) at the most rows when that is past 64. A routine that
//! cannot launch a shape there is left out with a line on stderr saying why. The same products in PyTorch (cuBLAS) on the same GPU:
//! `python tools/peer_bench.py MODEL_DIR --gemm --device cuda --dtype bf16`.
//! `tools/gpu_figures.py --gemm` runs both and picks the fastest routine.
//!
//! `cargo bench --bench gemm` (`-- fma_peak`, `-- gemm_t128`, `-- 'frozen_small_t2048/fwd_qkv'`, ...).

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use burn::tensor::{Distribution, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rayon::prelude::*;
use troupe::model::fused::dense_linear;
use troupe::model::{Preset, Projection};

/// The products of one layer's forward and the LM head, `(name, out, in)`, stacked as troupe
/// runs them (q/k/v in one product, gate/up in one).
fn product_shapes(preset: Preset) -> Vec<(&'static str, usize, usize)> {
    let config = preset.config();
    let dims = |projection: Projection| projection.dims(&config);
    let stacked = |projections: &[Projection]| {
        let (input, _) = dims(projections[0]);
        (projections.iter().map(|&p| dims(p).1).sum::<usize>(), input)
    };
    let single = |projection: Projection| {
        let (input, output) = dims(projection);
        (output, input)
    };
    [
        ("qkv", stacked(&[Projection::Q, Projection::K, Projection::V])),
        ("o", single(Projection::O)),
        ("gate_up", stacked(&[Projection::Gate, Projection::Up])),
        ("down", single(Projection::Down)),
        ("lm_head", (config.vocab_size, config.hidden_size)),
    ]
    .into_iter()
    .map(|(name, (out, inner))| (name, out, inner))
    .collect()
}

fn bench_gemm(c: &mut Criterion) {
    troupe::device::tune_allocator();
    let device = troupe::device::default_device().expect("TROUPE_DEVICE");
    for rows in [128usize, 2048] {
        let mut group = c.benchmark_group(format!("gemm_t{rows}"));
        group.sample_size(10);
        for (name, out, inner) in product_shapes(Preset::Small) {
            let x: Tensor<2> = Tensor::random([rows, inner], Distribution::Default, &device);
            let weight: Tensor<2> = Tensor::random([out, inner], Distribution::Default, &device);
            group.throughput(Throughput::Elements((2 * rows * out * inner) as u64));
            group.bench_function(BenchmarkId::from_parameter(format!("{name}_{out}x{inner}")), |b| {
                b.iter(|| {
                    let y = dense_linear(x.clone(), &weight);
                    device.sync().unwrap();
                    y.dims()
                })
            });
        }
        group.finish();
    }
    let mut group = c.benchmark_group("gemm");
    group.sample_size(20);
    for (m, k, n) in [(4096usize, 128usize, 768usize), (1024, 1024, 1024)] {
        let a: Tensor<2> = Tensor::random([m, k], Distribution::Default, &device);
        let b: Tensor<2> = Tensor::random([k, n], Distribution::Default, &device);
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        group.bench_function(format!("{m}x{k}x{n}"), |bench| {
            bench.iter(|| {
                let y = a.clone().matmul(b.clone());
                device.sync().unwrap();
                y.dims()
            })
        });
    }
    group.finish();
}

/// Multiply-adds per call of [`fma_loop`]: 10 accumulators of 8 lanes, `ITERATIONS` times.
const ITERATIONS: usize = 1 << 20;
const FLOP_PER_CALL: u64 = (ITERATIONS * 10 * 8 * 2) as u64;

/// Ten independent chains of 8-lane fused multiply-adds held in registers (enough in flight to
/// cover the instruction's latency on both FMA pipes); returns a lane so the work is kept.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop(seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(seed); 10];
    let (a, b) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-4));
    for _ in 0..ITERATIONS {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    let mut sum = _mm256_setzero_ps();
    for v in acc {
        sum = _mm256_add_ps(sum, v);
    }
    _mm256_cvtss_f32(sum)
}

fn bench_fma_peak(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        let threads = rayon::current_num_threads();
        let mut group = c.benchmark_group("fma_peak");
        group.sample_size(10);
        group.throughput(Throughput::Elements(FLOP_PER_CALL));
        // SAFETY: AVX2 and FMA were detected above.
        group.bench_function("one_thread", |b| b.iter(|| unsafe { fma_loop(std::hint::black_box(0.5)) }));
        group.throughput(Throughput::Elements(FLOP_PER_CALL * threads as u64));
        group.bench_function(BenchmarkId::new("all_threads", threads), |b| {
            b.iter(|| {
                (0..threads)
                    .into_par_iter()
                    // SAFETY: as above; every rayon thread runs on this CPU.
                    .map(|t| unsafe { fma_loop(std::hint::black_box(t as f32)) })
                    .sum::<f32>()
            })
        });
        group.finish();
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = c;
}

/// The frozen products of each benchmarked preset's forward and backward on a GPU, by every
/// routine (module header); nothing on the CPU, whose products are troupe's own GEMM calls.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn bench_frozen(c: &mut Criterion) {
    use criterion::SamplingMode;
    use troupe::model::fused::gpu::frozen_product_by;
    use troupe::model::MatmulKernel;

    let device = troupe::device::default_device().expect("TROUPE_DEVICE");
    if device == burn::tensor::Device::flex() {
        return;
    }
    let presets = troupe::device::bench_presets(&[Preset::Small]).expect("TROUPE_BENCH_PRESETS");
    let precision = troupe::device::default_precision().expect("TROUPE_DTYPE");
    let dtype = precision.resolve(&device, false).expect("TROUPE_DTYPE on this device");
    // Only the routines and row counts asked for are tried at all: a routine's first product at
    // a shape compiles its kernel, whether or not criterion's filter then times it.
    let kernels: Vec<MatmulKernel> = match std::env::var("TROUPE_GEMM_KERNELS") {
        Ok(names) if !names.trim().is_empty() => names
            .split(',')
            .map(|name| {
                assert!(!name.trim().is_empty(), "TROUPE_GEMM_KERNELS: an empty name in {names:?}");
                troupe::device::parse_matmul_kernel(Some(name)).unwrap_or_else(|e| panic!("TROUPE_GEMM_KERNELS: {e}"))
            })
            .collect(),
        _ => MatmulKernel::all().to_vec(),
    };
    let row_counts: Vec<usize> = match std::env::var("TROUPE_GEMM_ROWS") {
        Ok(counts) if !counts.trim().is_empty() => counts
            .split(',')
            .map(|n| n.trim().parse().unwrap_or_else(|_| panic!("TROUPE_GEMM_ROWS: {n:?} is not a count of rows")))
            .collect(),
        _ => vec![64, 2048],
    };
    let most = row_counts.iter().copied().max().unwrap_or(0);
    for preset in presets {
        let name = troupe::device::preset_name(preset);
        for &rows in &row_counts {
            // The input's gradient at the most rows only: an update's, not a decoding step's.
            let directions: &[bool] = if rows == most && rows > 64 { &[true, false] } else { &[true] };
            let mut group = c.benchmark_group(format!("frozen_{name}_t{rows}"));
            group.sample_size(10).sampling_mode(SamplingMode::Flat);
            for (product, out, inner) in product_shapes(preset) {
                let weight: Tensor<2> = Tensor::<2>::random([out, inner], Distribution::Default, &device).cast(dtype)
                    / (inner as f64).sqrt();
                for &transposed in directions {
                    // `x W^T` takes `[rows, in]`; `dy W` takes `[rows, out]`. In the weight's
                    // type, as the kernel before a product writes it rounded.
                    let width = if transposed { inner } else { out };
                    let x: Tensor<2> = Tensor::<2>::random([rows, width], Distribution::Default, &device).cast(dtype);
                    let flop = (2 * rows * out * inner) as u64;
                    let direction = if transposed { "fwd" } else { "bwd" };
                    group.throughput(Throughput::Elements(flop));
                    for &kernel in &kernels {
                        let function = format!("{direction}_{product}_{out}x{inner}");
                        if let Err(reason) = frozen_product_by(kernel, &x, &weight, transposed) {
                            let reason: String = reason.split_whitespace().collect::<Vec<_>>().join(" ");
                            let reason: String = reason.chars().take(240).collect();
                            eprintln!(
                                "frozen_{name}_t{rows}/{function}/{}: cannot launch here: {reason}",
                                kernel.name()
                            );
                            continue;
                        }
                        let id = BenchmarkId::new(function, kernel.name());
                        group.bench_function(id, |b| {
                            b.iter(|| {
                                let y = frozen_product_by(kernel, &x, &weight, transposed).expect("launched once");
                                device.sync().unwrap();
                                y.dims()
                            })
                        });
                    }
                }
            }
            group.finish();
        }
    }
}

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn bench_frozen(_: &mut Criterion) {}

criterion_group!(benches, bench_fma_peak, bench_gemm, bench_frozen);
criterion_main!(benches);
