//! `runtime.attention: flash` (`troupe::model::fused::flash`): burn-cubecl's flash kernel against
//! burn's materialized attention and an f64 reference, on the device of `TROUPE_TEST_DEVICE`.
//!
//! On a GPU (`TROUPE_TEST_DEVICE=cuda cargo test --features cuda --test it flash_attention::`) the
//! flash kernel must run (no fallback) and give the reference's values within 1e-3 (f32 tiles and
//! accumulators), the materialized kernel within the GPU tolerance (`common::tolerance`: its
//! products run in TF32), for grouped-query heads (and one key/value head, and one per query
//! head), left padding, a causal mask, queries that see no key (zeros), prefill shapes and
//! decoding steps (one query over a reserved cache room whose unwritten slots are masked); and a
//! model's generations and logits must not change beyond that tolerance. On the CPU troupe's fused
//! attention runs whatever the choice: every kernel gives the same bits, the fused kernel's within
//! 1e-5 of the reference, and the flash entry reports why it ran the materialized kernel. The
//! materialized kernel (on a GPU, troupe's softmax kernel between burn's products; at a decoding
//! step troupe's one-kernel attention, which must run there) matches burn's own attention within
//! 1e-5 on any device; on `wgpu`, which has no flash kernel, the flash entry
//! says so and runs burn's attention.

use burn::tensor::{Bool, Device, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use troupe::generate::{generate, GenerateOptions, SamplingConfig};
use troupe::model::fused::{attention, grouped_attention, grouped_flash_attention, FlashRefusal, HostMask};
use troupe::model::{AttentionKernel, ForwardArgs, LoadOptions, Model, Precision, SequenceLayout};

use crate::common::{self, test_device, tolerance};

/// One attention call's shape: `past` cached slots, `seq` new ones, `room` key slots presented
/// (slots past `past + seq` are an unwritten cache room, masked); row `b` left-padded by `3 b`.
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq: usize,
    past: usize,
    room: usize,
    dim: usize,
}

const CASES: [Case; 7] = [
    // Prefill: grouped heads, causal, padded rows whose first queries see nothing.
    Case { batch: 3, heads: 4, kv_heads: 2, seq: 70, past: 0, room: 70, dim: 16 },
    // A prompt's suffix after a cached prefix, one key/value head for all query heads.
    Case { batch: 2, heads: 4, kv_heads: 1, seq: 9, past: 20, room: 29, dim: 64 },
    // One key/value head per query head (nothing to fold).
    Case { batch: 1, heads: 3, kv_heads: 3, seq: 5, past: 0, room: 5, dim: 8 },
    // Decoding steps: one query over a reserved room (generate::decode_room's multiple of 64),
    // Qwen3-0.6B's heads (16 over 8, 128 wide), then a small model's.
    Case { batch: 2, heads: 16, kv_heads: 8, seq: 1, past: 37, room: 64, dim: 128 },
    Case { batch: 4, heads: 4, kv_heads: 2, seq: 1, past: 10, room: 64, dim: 16 },
    // A decoding step whose third row is all padding (its query sees nothing), then one over
    // several of the decoding kernel's tiles with heads of a width not a power of two.
    Case { batch: 3, heads: 4, kv_heads: 2, seq: 1, past: 5, room: 64, dim: 16 },
    Case { batch: 2, heads: 6, kv_heads: 3, seq: 1, past: 200, room: 320, dim: 96 },
];

impl Case {
    /// `[batch, seq, room]`, `true` where a query must not see a key: a later slot, a padding
    /// slot, or an unwritten one.
    fn hidden(&self) -> Vec<bool> {
        let mut hidden = Vec::with_capacity(self.batch * self.seq * self.room);
        for b in 0..self.batch {
            for i in 0..self.seq {
                let slot = self.past + i;
                hidden.extend((0..self.room).map(|key| key > slot || key < 3 * b || key >= self.past + self.seq));
            }
        }
        hidden
    }

    /// Random queries, keys and values in [-2, 2) and the case's mask, on the host and on `device`.
    fn inputs(&self, rng: &mut ChaCha8Rng, device: &Device) -> Inputs {
        let Case { batch, heads, kv_heads, seq, room, dim, .. } = *self;
        let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
        let (q, k, v) = (
            random(batch * heads * seq * dim),
            random(batch * kv_heads * room * dim),
            random(batch * kv_heads * room * dim),
        );
        let hidden = self.hidden();
        let tensor =
            |values: &[f32], dims: [usize; 4]| Tensor::<4>::from_data(TensorData::new(values.to_vec(), dims), device);
        Inputs {
            qt: tensor(&q, [batch, heads, seq, dim]),
            kt: tensor(&k, [batch, kv_heads, room, dim]),
            vt: tensor(&v, [batch, kv_heads, room, dim]),
            mask: Tensor::<4, Bool>::from_data(TensorData::new(hidden.clone(), [batch, 1, seq, room]), device),
            host_mask: Arc::new(HostMask::new(hidden.clone(), [batch, seq, room])),
            want: reference(self, &q, &k, &v, &hidden),
        }
    }

    /// Asserts that the queries of a padded row that see no key got zeros in `got` (`[batch,
    /// heads, seq, dim]`).
    fn assert_blind_queries_are_zero(&self, got: &[f32], what: &str) {
        let Case { batch, heads, seq, dim, .. } = *self;
        for b in 1..batch {
            for h in 0..heads {
                for i in (0..seq).filter(|&i| self.past + i < 3 * b) {
                    let row = ((b * heads + h) * seq + i) * dim;
                    assert!(
                        got[row..row + dim].iter().all(|&x| x == 0.0),
                        "{}: {what}: row {b}, query {i} sees nothing",
                        self.label()
                    );
                }
            }
        }
    }

    fn label(&self) -> String {
        let Case { batch, heads, kv_heads, seq, past, room, dim } = self;
        format!("{batch} x {heads}/{kv_heads} heads x {seq} queries after {past}, {room} keys, dim {dim}")
    }
}

/// A case's inputs on the test device and the f64 reference's output for them.
struct Inputs {
    qt: Tensor<4>,
    kt: Tensor<4>,
    vt: Tensor<4>,
    /// `[batch, 1, seq, room]`, `true` where hidden.
    mask: Tensor<4, Bool>,
    host_mask: Arc<HostMask>,
    want: Vec<f32>,
}

/// `softmax(q k^T / sqrt(dim) + mask) v` in f64, query head `h` reading key/value head
/// `h / (heads / kv_heads)`; zeros for a query that sees no key.
fn reference(case: &Case, q: &[f32], k: &[f32], v: &[f32], hidden: &[bool]) -> Vec<f32> {
    let Case { batch, heads, kv_heads, seq, room, dim, .. } = *case;
    let group = heads / kv_heads;
    let scale = 1.0 / (dim as f64).sqrt();
    let mut out = vec![0.0f32; batch * heads * seq * dim];
    for b in 0..batch {
        for h in 0..heads {
            let kv = (b * kv_heads + h / group) * room * dim;
            for i in 0..seq {
                let query = &q[((b * heads + h) * seq + i) * dim..][..dim];
                let seen: Vec<usize> = (0..room).filter(|&j| !hidden[(b * seq + i) * room + j]).collect();
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&j| {
                        let key = &k[kv + j * dim..][..dim];
                        query.iter().zip(key).map(|(&a, &c)| a as f64 * c as f64).sum::<f64>() * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                let row = &mut out[((b * heads + h) * seq + i) * dim..][..dim];
                for (d, x) in row.iter_mut().enumerate() {
                    let sum: f64 = seen.iter().zip(&weights).map(|(&j, w)| w * v[kv + j * dim + d] as f64).sum();
                    *x = (sum / total) as f32;
                }
            }
        }
    }
    out
}

/// The largest `|got - want| / max(|want|, 1)`.
fn worst_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0.0f32, f32::max)
}

fn host(t: Tensor<4>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32")
}

fn on_gpu(device: &Device) -> bool {
    *device != Device::flex()
}

#[test]
fn flash_matches_the_materialized_kernel_and_an_f64_reference() {
    let device = test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for case in CASES {
        let label = case.label();
        let Inputs { qt, kt, vt, mask, host_mask, want } = case.inputs(&mut rng, &device);
        let (flash, refusal) = grouped_flash_attention(qt.clone(), kt.clone(), vt.clone(), &mask);
        let flash = host(flash);
        let by_kernel = [AttentionKernel::Auto, AttentionKernel::Flash, AttentionKernel::Materialized]
            .map(|kernel| host(attention(qt.clone(), kt.clone(), vt.clone(), &mask, &host_mask, kernel)));
        let [auto, dispatched_flash, materialized] = &by_kernel;
        for (what, got) in
            [("flash", &flash), ("auto", auto), ("dispatched flash", dispatched_flash), ("materialized", materialized)]
        {
            assert!(got.iter().all(|x| x.is_finite()), "{label}: {what}: finite");
            // A padded row's first queries see no key: zeros, in every kernel.
            case.assert_blind_queries_are_zero(got, what);
        }
        if troupe::device::is_cuda(&device) {
            assert_eq!(refusal, None, "{label}: the flash kernel must run");
            let worst = worst_error(&flash, &want);
            assert!(worst < 1e-3, "{label}: flash against the f64 reference: {worst}");
            let worst = worst_error(materialized, &want);
            assert!(worst < tolerance(1e-5), "{label}: materialized against the f64 reference: {worst}");
            assert!(worst_error(&flash, materialized) < tolerance(1e-5), "{label}: flash against materialized");
            assert_eq!(dispatched_flash, &flash, "{label}: runtime.attention: flash runs the flash kernel");
            assert_eq!(auto, materialized, "{label}: auto is the materialized kernel");
        } else {
            assert!(
                matches!(refusal, Some(FlashRefusal::NotBuilt | FlashRefusal::NotOnGpu)),
                "{label}: on the CPU the flash entry says why it did not run: {refusal:?}"
            );
            assert_eq!(
                flash,
                host(grouped_attention(qt.clone(), kt.clone(), vt.clone(), &mask)),
                "{label}: its fallback"
            );
            assert_eq!(auto, materialized, "{label}: auto is the materialized kernel");
            if on_gpu(&device) {
                // wgpu: no flash kernel; its entry falls back to burn's attention.
                let worst = worst_error(dispatched_flash, materialized);
                assert!(worst < 1e-5, "{label}: burn's attention against the materialized kernel: {worst}");
            } else {
                assert_eq!(auto, dispatched_flash, "{label}: the CPU ignores the choice");
            }
            let worst = worst_error(auto, &want);
            assert!(worst < tolerance(1e-5), "{label}: the materialized kernel against the f64 reference: {worst}");
        }
    }
}

/// The materialized kernel (`runtime.attention: materialized`) without gradients, on any device:
/// on a GPU the two products around troupe's one softmax kernel, the mask read in place for the
/// folded grouped-query heads; on the CPU the fused kernel. Within 1e-5 of burn's own attention
/// on the same device (the same products; only the softmax's sums run in another order), 1e-4
/// under CUDA's TF32 products; within the device's tolerance of the f64 reference; and zeros for
/// a query that sees no key.
#[test]
fn materialized_kernel_matches_burns_attention_and_an_f64_reference() {
    let device = test_device();
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    for case in CASES {
        let label = case.label();
        let Inputs { qt, kt, vt, mask, host_mask, want } = case.inputs(&mut rng, &device);
        let got = host(attention(qt.clone(), kt.clone(), vt.clone(), &mask, &host_mask, AttentionKernel::Materialized));
        let burns = host(grouped_attention(qt, kt, vt, &mask));
        let worst = worst_error(&got, &burns);
        // CUDA multiplies in TF32: probabilities that differ in their last f32 bits (the sums'
        // order) can round to neighbouring TF32 values before the second product (1.5e-5 seen on
        // an H200). The CPU and wgpu multiply in f32.
        let bound = if troupe::device::is_cuda(&device) { 1e-4 } else { 1e-5 };
        assert!(worst < bound, "{label}: against burn's attention: {worst}");
        let worst = worst_error(&got, &want);
        assert!(worst < tolerance(1e-5), "{label}: against the f64 reference: {worst}");
        case.assert_blind_queries_are_zero(&got, "materialized");
        // A decoding step on a GPU is troupe's one-kernel attention.
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if on_gpu(&device) && case.seq == 1 {
            let Inputs { qt, kt, vt, mask, .. } = case.inputs(&mut ChaCha8Rng::seed_from_u64(22), &device);
            let kernel = troupe::model::fused::gpu::decode_attention(&qt, None, (&kt, &vt), &mask, None);
            assert!(kernel.is_some(), "{label}: the decoding kernel runs");
        }
    }
}

/// Greedy generations (prefill, then decoding steps over the reserved cache room) and a padded
/// batch's logits of the grouped-query fixture models (4 query heads over 2), under each kernel.
#[test]
fn flash_leaves_a_models_generations_and_logits_as_they_were() {
    let device = test_device();
    let prompts: Vec<Vec<u32>> = vec![vec![5, 17, 3, 9, 12], vec![7, 2, 30, 4, 8, 11, 6, 19, 23], vec![14, 3, 5]];
    let options = GenerateOptions {
        max_new_tokens: 12,
        sampling: SamplingConfig::greedy(),
        seed: 3,
        stop_at_eos: false,
        use_cache: true,
    };
    for name in ["tiny-qwen2", "tiny-qwen3"] {
        // In f32, so that only the attention kernels differ (a bf16 base would round their
        // differences up to its own steps).
        let options_f32 = LoadOptions::path(common::models_dir().join(name)).dtype(Precision::F32);
        let mut model = Model::load(&options_f32, &device).unwrap();
        let mut run = |kernel: AttentionKernel| {
            model.lm.set_attention_kernel(kernel);
            let generations = generate(&model.lm, &[], &prompts, &options, None).unwrap();
            let width = prompts.iter().map(Vec::len).max().unwrap();
            let padded: Vec<Vec<u32>> =
                prompts.iter().map(|p| [vec![0; width - p.len()], p.clone()].concat()).collect();
            let valid: Vec<Vec<bool>> =
                prompts.iter().map(|p| (0..width).map(|i| i >= width - p.len()).collect()).collect();
            let layout = SequenceLayout::new(prompts.len()).step(&valid, &device);
            let tokens = model.lm.token_tensor(&padded).unwrap();
            let logits = model.lm.forward(tokens, ForwardArgs { layout: &layout, cache: None, delta: None }).unwrap();
            let logits = logits.into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
            (generations, logits, valid)
        };
        let (materialized, materialized_logits, valid) = run(AttentionKernel::Materialized);
        let (flash, flash_logits, _) = run(AttentionKernel::Flash);
        common::assert_same_generations(&flash, &materialized, &format!("{name}: flash vs materialized"));
        // The padding positions' logits are not read by anything; compare the real ones.
        let vocab = model.lm.config.vocab_size;
        let real = |logits: &[f32]| -> Vec<f32> {
            valid
                .iter()
                .flatten()
                .zip(logits.chunks(vocab))
                .filter(|(v, _)| **v)
                .flat_map(|(_, l)| l.to_vec())
                .collect()
        };
        let diff = common::max_abs_diff(&real(&flash_logits), &real(&materialized_logits));
        if on_gpu(&device) {
            assert!(diff < tolerance(1e-4), "{name}: logits differ by {diff}");
        } else {
            assert_eq!(flash_logits, materialized_logits, "{name}: the CPU ignores the choice");
        }
    }
}
