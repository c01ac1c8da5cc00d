//! Masked grouped-query attention, `softmax(q k^T / sqrt(d) + mask) v`, as one parallel pass
//! forward and one backward.
//!
//! burn's differentiable attention is a chain of tensor operations (two batched products, a
//! scale, a mask fill, a max, a subtraction, an exponential, a sum and a division), each with
//! its backward, the element-wise ones on one thread with a scalar `exp`, and it needs every
//! key/value head repeated for its query heads first. Here each (batch row, key/value head) is
//! one task: its query heads share the keys and values in place, the scores come from the GEMM
//! over only the keys some query of a block may see (the causal half and padding are skipped),
//! and the softmax runs on the vectorized `exp`. The probabilities are kept for the backward,
//! which forms `dv = p^T do`, `ds = p (do v^T - rowsum(p do v^T))`, `dq = ds k / sqrt(d)` and
//! `dk = ds^T q / sqrt(d)` with the same products. A query that may see no key gets zeros, as
//! burn's masked softmax gives. The sums run in another order than burn's: values and gradients
//! agree within float rounding (tested against burn's attention).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Tensor, TensorData};
use rayon::prelude::*;

use super::flash::FlashRefusal;
use super::vexp::exp_in_place;
use super::{gemm_f32, on_flex};
use crate::model::AttentionKernel;

/// Query positions per block: the keys a block computes are those any of its queries may see.
const QUERY_BLOCK: usize = 64;

/// An attention mask on the host, with each query's span of visible keys.
#[derive(Debug)]
pub struct HostMask {
    /// `[batch, seq, keys]`: `true` where a query must NOT see a key.
    hidden: Vec<bool>,
    /// `[batch, seq]`: the first visible key and one past the last (`(0, 0)` when none is).
    spans: Vec<(u32, u32)>,
    batch: usize,
    seq: usize,
    keys: usize,
}

impl HostMask {
    /// The mask `hidden` (`[batch, seq, keys]`, row-major; `true`: hidden).
    pub fn new(hidden: Vec<bool>, [batch, seq, keys]: [usize; 3]) -> Self {
        assert_eq!(hidden.len(), batch * seq * keys, "HostMask: {batch} x {seq} x {keys} values");
        let spans = (0..batch * seq)
            .map(|r| {
                let row = &hidden[r * keys..(r + 1) * keys];
                match row.iter().position(|h| !h) {
                    None => (0, 0),
                    Some(first) => (first as u32, (keys - row.iter().rev().position(|h| !h).unwrap_or(0)) as u32),
                }
            })
            .collect();
        Self { hidden, spans, batch, seq, keys }
    }

    /// `[batch, seq, keys]`
    pub fn dims(&self) -> [usize; 3] {
        [self.batch, self.seq, self.keys]
    }

    /// The mask as a burn tensor, `[batch, 1, seq, keys]`.
    pub fn tensor(&self, device: &burn::tensor::Device) -> Tensor<4, Bool> {
        Tensor::from_data(TensorData::new(self.hidden.clone(), [self.batch, 1, self.seq, self.keys]), device)
    }

    /// Row `i` of batch row `b`.
    fn row(&self, b: usize, i: usize) -> &[bool] {
        let start = (b * self.seq + i) * self.keys;
        &self.hidden[start..start + self.keys]
    }

    /// The keys any query of `[i0, i1)` in batch row `b` may see, or `None` when none may.
    fn block_span(&self, b: usize, i0: usize, i1: usize) -> Option<(usize, usize)> {
        let spans = &self.spans[b * self.seq + i0..b * self.seq + i1];
        let visible = spans.iter().filter(|(lo, hi)| lo < hi);
        let lo = visible.clone().map(|s| s.0).min()?;
        let hi = visible.map(|s| s.1).max()?;
        Some((lo as usize, hi as usize))
    }
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
struct Dims {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq: usize,
    keys: usize,
    head_dim: usize,
    scale: f32,
}

impl Dims {
    fn of(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor, mask: &HostMask) -> Self {
        let [batch, heads, seq, head_dim] = q.layout().shape().dims::<4>();
        let [kb, kv_heads, keys, kd] = k.layout().shape().dims::<4>();
        assert_eq!(
            v.layout().shape().dims::<4>(),
            [kb, kv_heads, keys, kd],
            "attention: keys and values differ in shape"
        );
        assert!(kb == batch && kd == head_dim, "attention: queries and keys differ in batch or head size");
        assert!(kv_heads > 0 && heads % kv_heads == 0, "attention: {heads} query heads over {kv_heads} key heads");
        assert_eq!(mask.dims(), [batch, seq, keys], "attention: the mask's shape");
        let scale = (1.0 / (head_dim as f64).sqrt()) as f32;
        Self { batch, heads, kv_heads, seq, keys, head_dim, scale }
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Values of one task's queries (or outputs): its group of heads.
    fn group_len(&self) -> usize {
        self.group() * self.seq * self.head_dim
    }

    /// Values of one key/value head.
    fn kv_len(&self) -> usize {
        self.keys * self.head_dim
    }

    /// The query blocks of a head: `[i0, i1)`.
    fn blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.seq).step_by(QUERY_BLOCK).map(|i0| (i0, (i0 + QUERY_BLOCK).min(self.seq)))
    }
}

/// `tensor`'s values, row-major from its first element (copied when its layout is not).
fn dense(tensor: &FlexTensor) -> FlexTensor {
    if tensor.as_slice::<f32>().is_some() {
        tensor.clone()
    } else {
        tensor.to_contiguous()
    }
}

/// The values of a tensor [`dense`] returned.
fn values(tensor: &FlexTensor) -> &[f32] {
    tensor.as_slice::<f32>().expect("a dense f32 tensor")
}

/// A single-threaded GEMM `dst (+)= lhs rhs` of strided f32 matrices (`m x k` times
/// `k x n`); strides are (row, column) in elements.
#[allow(clippy::too_many_arguments)]
fn product(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_row: usize,
    accumulate: bool,
    lhs: &[f32],
    (lhs_row, lhs_col): (usize, usize),
    rhs: &[f32],
    (rhs_row, rhs_col): (usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let reach = |rows: usize, cols: usize, (r, c): (usize, usize)| (rows - 1) * r + (cols - 1) * c + 1;
    assert!(dst.len() >= reach(m, n, (dst_row, 1)), "attention: product destination");
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * dst_row..r * dst_row + n].fill(0.0);
            }
        }
        return;
    }
    assert!(lhs.len() >= reach(m, k, (lhs_row, lhs_col)) && rhs.len() >= reach(k, n, (rhs_row, rhs_col)));
    // SAFETY: the asserts above keep every element the strides address inside its slice; the
    // destination does not alias the operands (distinct borrows).
    unsafe {
        gemm_f32(
            [m, n, k],
            dst.as_mut_ptr(),
            dst_row as isize,
            accumulate,
            lhs.as_ptr(),
            (lhs_row as isize, lhs_col as isize),
            rhs.as_ptr(),
            (rhs_row as isize, rhs_col as isize),
            gemm::Parallelism::None,
        );
    }
}

/// The forward over every (batch row, key/value head): the outputs `[batch, heads, seq,
/// head_dim]`, and the probabilities `[batch, heads, seq, keys]` when `keep_probs` (zeros where
/// a query sees no key).
fn forward(q: &[f32], k: &[f32], v: &[f32], mask: &HostMask, dims: Dims, keep_probs: bool) -> (Vec<f32>, Vec<f32>) {
    let Dims { kv_heads, seq, keys, head_dim: d, scale, .. } = dims;
    let mut out = vec![0.0f32; dims.batch * dims.heads * seq * d];
    let probs_len = if keep_probs { dims.batch * dims.heads * seq * keys } else { 0 };
    let mut probs = vec![0.0f32; probs_len];
    let task_probs = dims.group() * seq * keys;
    let mut prob_chunks: Vec<&mut [f32]> = if keep_probs { probs.chunks_mut(task_probs).collect() } else { Vec::new() };
    prob_chunks.resize_with(dims.batch * kv_heads, Default::default);
    out.par_chunks_mut(dims.group_len()).zip(prob_chunks.into_par_iter()).enumerate().for_each_init(
        || vec![0.0f32; QUERY_BLOCK * keys],
        |scratch, (task, (out, kept))| {
            let b = task / kv_heads;
            let (k, v) = (&k[task * dims.kv_len()..][..dims.kv_len()], &v[task * dims.kv_len()..][..dims.kv_len()]);
            for g in 0..dims.group() {
                let head = (task * dims.group() + g) * seq * d;
                let (q, out) = (&q[head..head + seq * d], &mut out[g * seq * d..(g + 1) * seq * d]);
                for (i0, i1) in dims.blocks() {
                    let Some((lo, hi)) = mask.block_span(b, i0, i1) else { continue };
                    let (rows, width) = (i1 - i0, hi - lo);
                    // The block's probabilities: in the kept tensor (row stride `keys`), or in
                    // the scratch (row stride `width`).
                    let (p, p_row): (&mut [f32], usize) = if keep_probs {
                        (&mut kept[(g * seq + i0) * keys + lo..], keys)
                    } else {
                        (&mut scratch[..], width)
                    };
                    // Scores q k^T over the block's keys, into the block's probability rows.
                    product(rows, width, d, p, p_row, false, &q[i0 * d..], (d, 1), &k[lo * d..], (1, d));
                    softmax_rows(p, p_row, [rows, width], |r| &mask.row(b, i0 + r)[lo..hi], scale);
                    product(rows, d, width, &mut out[i0 * d..], d, false, p, (p_row, 1), &v[lo * d..], (d, 1));
                }
            }
        },
    );
    (out, probs)
}

/// `row = softmax(row * scale)` for each of the block's `rows` rows of `width` scores (`p_row`
/// apart in `p`), over the visible keys (`hidden(r)` marks row `r`'s others, which get 0); a row
/// is all zeros when none is visible.
fn softmax_rows<'m>(
    p: &mut [f32],
    p_row: usize,
    [rows, width]: [usize; 2],
    hidden: impl Fn(usize) -> &'m [bool],
    scale: f32,
) {
    assert!(rows <= QUERY_BLOCK, "attention: a block of {rows} queries");
    let mut visible = [false; QUERY_BLOCK];
    for (r, seen) in visible.iter_mut().enumerate().take(rows) {
        let row = &mut p[r * p_row..r * p_row + width];
        for (s, &h) in row.iter_mut().zip(hidden(r)) {
            *s = if h { f32::NEG_INFINITY } else { *s * scale };
        }
        let max = max_of(row);
        if max == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        *seen = true;
        for s in row.iter_mut() {
            *s -= max;
        }
        // e^-inf = 0 for the hidden keys.
        exp_in_place(row);
    }
    let mut sums = [0.0f32; QUERY_BLOCK];
    row_sums(&mut sums[..rows], width, (p, p_row), None);
    for r in (0..rows).filter(|&r| visible[r]) {
        let inverse = 1.0 / sums[r];
        for v in &mut p[r * p_row..r * p_row + width] {
            *v *= inverse;
        }
    }
}

/// The largest of `values` (`-inf` when empty), as a left-to-right `f32::max` fold gives it:
/// the maximum does not depend on the order, so eight lanes take it at once.
fn max_of(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; SUM_LANES];
    let chunks = values.chunks_exact(SUM_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v);
        }
    }
    lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// Rows whose sums [`row_sums`] runs side by side.
const SUM_LANES: usize = 8;

/// `sums[r] = sum_i a[r, i] (* b[r, i])` over `i < width`, for `a` (and `b`) given as values
/// and row stride. Each row is summed from `i = 0` up, one rounding per step, as
/// `iter().sum()` sums it (bit for bit); eight rows' sums run interleaved, so that each
/// addition does not wait on the previous one.
fn row_sums(sums: &mut [f32], width: usize, (a, a_row): (&[f32], usize), b: Option<(&[f32], usize)>) {
    fn row(values: &[f32], stride: usize, r: usize, width: usize) -> &[f32] {
        &values[r * stride..r * stride + width]
    }
    let mut r0 = 0;
    while r0 < sums.len() {
        let lanes = SUM_LANES.min(sums.len() - r0);
        let mut acc = [0.0f32; SUM_LANES];
        if lanes == SUM_LANES {
            let a: [&[f32]; SUM_LANES] = std::array::from_fn(|j| row(a, a_row, r0 + j, width));
            match b {
                None => {
                    for i in 0..width {
                        for (acc, a) in acc.iter_mut().zip(&a) {
                            *acc += a[i];
                        }
                    }
                }
                Some((b, b_row)) => {
                    let b: [&[f32]; SUM_LANES] = std::array::from_fn(|j| row(b, b_row, r0 + j, width));
                    for i in 0..width {
                        for ((acc, a), b) in acc.iter_mut().zip(&a).zip(&b) {
                            *acc += a[i] * b[i];
                        }
                    }
                }
            }
        } else {
            for (j, acc) in acc.iter_mut().enumerate().take(lanes) {
                let a = row(a, a_row, r0 + j, width);
                *acc = match b {
                    None => a.iter().sum(),
                    Some((b, b_row)) => a.iter().zip(row(b, b_row, r0 + j, width)).map(|(x, y)| x * y).sum(),
                };
            }
        }
        sums[r0..r0 + lanes].copy_from_slice(&acc[..lanes]);
        r0 += lanes;
    }
}

/// What the backward needs: the forward's inputs (dense), the probabilities and the mask.
#[derive(Clone, Debug)]
struct Saved {
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    probs: Arc<Vec<f32>>,
    mask: Arc<HostMask>,
}

/// The gradients of the queries, keys and values from the outputs' gradient `grad`.
fn backward(saved: &Saved, grad: &[f32], dims: Dims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let Dims { kv_heads, seq, keys, head_dim: d, scale, .. } = dims;
    let (q, k, v, probs, mask) = (values(&saved.q), values(&saved.k), values(&saved.v), &saved.probs, &saved.mask);
    let mut dq = vec![0.0f32; dims.batch * dims.heads * seq * d];
    let mut dk = vec![0.0f32; dims.batch * kv_heads * keys * d];
    let mut dv = vec![0.0f32; dk.len()];
    let kv_len = dims.kv_len();
    dq.par_chunks_mut(dims.group_len())
        .zip(dk.par_chunks_mut(kv_len).zip(dv.par_chunks_mut(kv_len)))
        .enumerate()
        .for_each_init(
            || vec![0.0f32; QUERY_BLOCK * keys],
            |ds, (task, (dq, (dk, dv)))| {
                let b = task / kv_heads;
                let (k, v) = (&k[task * kv_len..][..kv_len], &v[task * kv_len..][..kv_len]);
                for g in 0..dims.group() {
                    let head = task * dims.group() + g;
                    let (q, dout) = (&q[head * seq * d..][..seq * d], &grad[head * seq * d..][..seq * d]);
                    let p = &probs[head * seq * keys..][..seq * keys];
                    let dq = &mut dq[g * seq * d..(g + 1) * seq * d];
                    for (i0, i1) in dims.blocks() {
                        let Some((lo, hi)) = mask.block_span(b, i0, i1) else { continue };
                        let (rows, width) = (i1 - i0, hi - lo);
                        let p = &p[i0 * keys + lo..];
                        let dout = &dout[i0 * d..];
                        // dv += p^T do
                        product(width, d, rows, &mut dv[lo * d..], d, true, p, (1, keys), dout, (d, 1));
                        // dp = do v^T, then ds = p (dp - rowsum(p dp)) scale, in place.
                        product(rows, width, d, ds, width, false, dout, (d, 1), &v[lo * d..], (1, d));
                        let mut dots = [0.0f32; QUERY_BLOCK];
                        row_sums(&mut dots[..rows], width, (p, keys), Some((ds, width)));
                        for (r, &dot) in dots[..rows].iter().enumerate() {
                            let (p_row, ds_row) = (&p[r * keys..r * keys + width], &mut ds[r * width..(r + 1) * width]);
                            for (s, &pv) in ds_row.iter_mut().zip(p_row) {
                                *s = pv * (*s - dot) * scale;
                            }
                        }
                        // dq = ds k; dk += ds^T q
                        product(rows, d, width, &mut dq[i0 * d..], d, false, ds, (width, 1), &k[lo * d..], (d, 1));
                        product(width, d, rows, &mut dk[lo * d..], d, true, ds, (1, width), &q[i0 * d..], (d, 1));
                    }
                }
            },
        );
    (dq, dk, dv)
}

/// The fused masked attention, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait MaskedAttentionBackend: burn::backend::Backend {
    /// `softmax(q k^T / sqrt(head_dim) + mask) v`, each key/value head shared by
    /// `heads / kv_heads` consecutive query heads; differentiable in `q`, `k` and `v`.
    ///
    /// # Shapes
    /// `q`: `[batch, heads, seq, head_dim]`, `k`/`v`: `[batch, kv_heads, keys, head_dim]`, `mask`:
    /// `[batch, seq, keys]` -> `[batch, heads, seq, head_dim]`
    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: Arc<HostMask>,
    ) -> FloatTensor<Self>;
}

impl MaskedAttentionBackend for Flex {
    fn masked_attention(q: FlexTensor, k: FlexTensor, v: FlexTensor, mask: Arc<HostMask>) -> FlexTensor {
        let dims = Dims::of(&q, &k, &v, &mask);
        let (q, k, v) = (dense(&q), dense(&k), dense(&v));
        let (out, _) = forward(values(&q), values(&k), values(&v), &mask, dims, false);
        FlexTensor::from_data(TensorData::new(out, [dims.batch, dims.heads, dims.seq, dims.head_dim]))
    }
}

/// The backward of [`MaskedAttentionBackend::masked_attention`].
#[derive(Debug)]
struct MaskedAttentionBackward;

impl Backward<Flex, 3> for MaskedAttentionBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = dense(&grads.consume::<Flex>(&ops.node));
        let saved = ops.state;
        let dims = Dims::of(&saved.q, &saved.k, &saved.v, &saved.mask);
        let (dq, dk, dv) = backward(&saved, values(&grad), dims);
        let kv_shape = [dims.batch, dims.kv_heads, dims.keys, dims.head_dim];
        for (node, values, shape) in [
            (node_q, dq, [dims.batch, dims.heads, dims.seq, dims.head_dim]),
            (node_k, dk, kv_shape),
            (node_v, dv, kv_shape),
        ] {
            if let Some(node) = node {
                grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(values, shape)));
            }
        }
    }
}

impl<C: CheckpointStrategy> MaskedAttentionBackend for Autodiff<Flex, C> {
    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: Arc<HostMask>,
    ) -> FloatTensor<Self> {
        match MaskedAttentionBackward.prepare::<C>([q.node(), k.node(), v.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (q, k, v) = (dense(q.primitive()), dense(k.primitive()), dense(v.primitive()));
                let dims = Dims::of(&q, &k, &v, &mask);
                let (out, probs) = forward(values(&q), values(&k), values(&v), &mask, dims, true);
                let out =
                    FlexTensor::from_data(TensorData::new(out, [dims.batch, dims.heads, dims.seq, dims.head_dim]));
                prep.finish(Saved { q, k, v, probs: Arc::new(probs), mask }, out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(Flex::masked_attention(q.into_primitive(), k.into_primitive(), v.into_primitive(), mask))
            }
        }
    }
}

/// Masked grouped-query attention (scale `1 / sqrt(head_dim)`): fused on the CPU; elsewhere
/// (and for any dtype but f32) burn's attention, through [`grouped_attention`] except where
/// burn's CPU attention shares the key/value heads itself, or, for a forward without gradients
/// on a GPU, burn-cubecl's flash kernel when `kernel` asks for it
/// ([`super::flash::grouped_flash_attention`]; where it cannot run, the materialized kernel with a
/// warning per reason), else for a decoding step's one query a row one kernel
/// (`super::gpu::decode_attention`), else the materialized products around one softmax kernel
/// (`super::gpu::attention`), and under autodiff on a GPU that kernel's node with a backward of
/// its own (`super::gpu::attention_tracked`). `mask` and `host_mask` are the same mask.
///
/// # Shapes
/// `q`: `[batch, heads, seq, head_dim]`, `k`/`v`: `[batch, kv_heads, keys, head_dim]`, `mask`:
/// `[batch, 1, seq, keys]` -> `[batch, heads, seq, head_dim]`
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &Tensor<4, Bool>,
    host_mask: &Arc<HostMask>,
    kernel: AttentionKernel,
) -> Tensor<4> {
    attention_rounded(q, k, v, mask, host_mask, kernel, None).0
}

/// [`attention`], and given `round` (the half precision of the output projection's product,
/// [`crate::model::layers::FrozenLinear::input_rounding`]) its output rounded to it where the
/// decoding step's kernel wrote that too (`None` for it elsewhere).
///
/// # Shapes
/// as [`attention`], the rounded output like the output
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
pub fn attention_rounded(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &Tensor<4, Bool>,
    host_mask: &Arc<HostMask>,
    kernel: AttentionKernel,
    round: Option<DType>,
) -> (Tensor<4>, Option<Tensor<4>>) {
    if let Some(both) = decoding_step(&q, &k, &v, mask, kernel, round) {
        return both;
    }
    // A cache held in half precision ([`crate::model::KvCache::holding`]) is read in f32.
    let (k, v) = (in_dtype(k, q.dtype()), in_dtype(v, q.dtype()));
    (attention_without_rounding(q, k, v, mask, host_mask, kernel), None)
}

/// `t` in `dtype` (a cast where it is held in another).
pub(crate) fn in_dtype(t: Tensor<4>, dtype: DType) -> Tensor<4> {
    if t.dtype() == dtype {
        t
    } else {
        t.cast(dtype)
    }
}

/// A decoding step's one kernel on a GPU (`super::gpu::decode_attention`), unless `kernel` runs
/// flash; `None` where it does not run.
#[allow(clippy::type_complexity)]
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
fn decoding_step(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    mask: &Tensor<4, Bool>,
    kernel: AttentionKernel,
    round: Option<DType>,
) -> Option<(Tensor<4>, Option<Tensor<4>>)> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if !kernel.runs_flash() {
        return super::gpu::decode_attention(q, None, (k, v), mask, round);
    }
    None
}

/// [`attention`] but for a decoding step's kernel on a GPU.
fn attention_without_rounding(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &Tensor<4, Bool>,
    host_mask: &Arc<HostMask>,
    kernel: AttentionKernel,
) -> Tensor<4> {
    let flex = on_flex(&q);
    let f32s = [&q, &k, &v].iter().all(|t| t.dtype() == DType::F32);
    if flex && f32s {
        return Tensor::from_dispatch(<Dispatch as MaskedAttentionBackend>::masked_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            host_mask.clone(),
        ));
    }
    let differentiable = q.is_autodiff() || k.is_autodiff() || v.is_autodiff();
    if flex && !differentiable {
        // burn's CPU attention shares each key/value head among its query heads itself.
        return burn_attention(q, k, v, Some(mask.clone()), None, OPTIONS);
    }
    if kernel.runs_flash() && !differentiable {
        let (out, refusal) = super::flash::grouped_flash_attention(q, k, v, mask);
        if let Some(refusal) = refusal {
            warn_once(refusal);
        }
        return out;
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if super::gpu::attention_applies(&q, &k, &v, mask) {
        return super::gpu::attention(q, k, v, mask);
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if differentiable && super::gpu::takes_tracked(&q) {
        if let Some(out) = super::gpu::attention_tracked(&q, &k, &v, mask) {
            return out;
        }
    }
    grouped_attention(q, k, v, mask)
}

/// Warns that `runtime.attention: flash` ran the materialized kernel, once per reason in a
/// process.
fn warn_once(refusal: FlashRefusal) {
    static WARNED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let reason = refusal.to_string();
    if WARNED.lock().unwrap_or_else(|e| e.into_inner()).insert(reason.clone()) {
        tracing::warn!("runtime.attention: flash: using the materialized kernel: {reason}");
    }
}

/// burn's attention: scale `1 / sqrt(head_dim)`, the mask given, not causal by itself.
pub(super) const OPTIONS: AttentionModuleOptions =
    AttentionModuleOptions { scale: None, softcap: None, is_causal: false };

/// Grouped-query attention through burn's attention, for backends whose attention wants as many
/// key/value heads as query heads (CUDA's; burn's differentiable fallback), without repeating
/// the key/value heads (`fold_query_heads`).
///
/// # Shapes
/// `q`: `[batch, heads, seq, head_dim]`, `k`/`v`: `[batch, kv_heads, keys, head_dim]`, `mask`:
/// `[batch, 1, seq, keys]` -> `[batch, heads, seq, head_dim]`
pub fn grouped_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: &Tensor<4, Bool>) -> Tensor<4> {
    fold_query_heads(q, k, v, |q, k, v, group| burn_attention(q, k, v, Some(folded_mask(mask, group)), None, OPTIONS))
}

/// Runs `attend`, an attention that wants as many key/value heads as query heads (or one), on
/// grouped-query inputs without repeating the key/value heads: the `group` query heads of each
/// key/value head are folded into its query positions, so keys and values are read once as they
/// are. No key/value copy forward, no sum over the copies backward. `attend` also gets `group`:
/// folded query row `g * seq + i` is query `i` of the group's head `g`, so it sees mask row `i`
/// (row `r % seq`, or [`folded_mask`]'s row `r`).
///
/// # Shapes
/// `q`: `[batch, heads, seq, head_dim]`, `k`/`v`: `[batch, kv_heads, keys, head_dim]` ->
/// `[batch, heads, seq, head_dim]`; `attend` takes `[batch, kv_heads, group * seq, head_dim]`
/// queries, the keys and values, and returns `[batch, kv_heads, group * seq, head_dim]`
pub(super) fn fold_query_heads(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    attend: impl FnOnce(Tensor<4>, Tensor<4>, Tensor<4>, usize) -> Tensor<4>,
) -> Tensor<4> {
    let [batch, heads, seq, head_dim] = q.dims();
    let kv_heads = k.dims()[1];
    let group = heads / kv_heads;
    if group == 1 {
        return attend(q, k, v, 1);
    }
    // Query head `h` reads key/value head `h / group`: `[batch, kv_heads, group, seq]` rows.
    let q = q.reshape([batch, kv_heads, group * seq, head_dim]);
    attend(q, k, v, group).reshape([batch, heads, seq, head_dim])
}

/// The mask of [`fold_query_heads`]' folded queries: its rows repeated `group` times (a copy), for
/// attentions that want one mask row per query row.
///
/// # Shapes
/// `mask`: `[batch, 1, seq, keys]` -> `[batch, 1, group * seq, keys]`
pub(super) fn folded_mask(mask: &Tensor<4, Bool>, group: usize) -> Tensor<4, Bool> {
    if group == 1 {
        return mask.clone();
    }
    let [batch, _, seq, keys] = mask.dims();
    mask.clone().unsqueeze_dim::<5>(2).expand([batch, 1, group, seq, keys]).reshape([batch, 1, group * seq, keys])
}
