//! A decoding step's attention as one kernel: each row's one new query against its cache, over
//! one part (each row's own keys and values) or two (its group's prompt held once, then its own:
//! `runtime.prompt_cache: shared`, [`crate::model::prompt_cache`]).
//!
//! At a decoding step the attention is launch-bound: its two products and the softmax kernel
//! between them ([`super::attention`]) are three launches a layer, and over a shared prompt the
//! two parts' products, the layout copies putting a group's rows side by side and back, the
//! scores' join and the values' sum made it fourteen. Here one cube takes one query row (a
//! row's query head), walks its keys in tiles of the cube's size (the prompt's first, read
//! from the row's group, then the row's own), and keeps a running maximum, sum and weighted sum
//! of values (the online softmax of FlashAttention): one launch a layer, no scores written. Each
//! unit scores one key of a tile; the units below `head_dim` then each add one column of the
//! tile's values. The values are the materialized attention's (the same scale, the same
//! exponential, the same division), the sums in another order; a query that sees no key gets
//! zeros, as the softmax kernel gives.
//!
//! It reads every key of its row for each query head, where the products read a key/value head
//! once for its folded query heads; at one query position a row, that is a few reads of a
//! cache the products read anyway, and the cache's slots the mask hides (a reserved room not yet
//! written) are skipped. For more query positions (prefill, scoring) the products run.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::Cube;
use burn::tensor::{Bool, DType, Int, Shape, Tensor};
use burn_cubecl::kernel::untile;

use super::{empty_of, rounded_output, row_launch, Primitive};

/// The most query positions a row may have for [`decode_attention`] to run: a decoding step's
/// one.
pub const MAX_QUERIES: usize = 1;

/// The widest head [`decode_attention`] takes: one unit a column of the head, at most a cube's
/// 256 units.
const MAX_HEAD_DIM: usize = 256;

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{cube_reduce, cube_row};

    /// The score of query `q[q_start..]` (`head_dim` values, step `q_step`) against the key at
    /// `keys[start..]` (step `step`), times `scale`.
    #[cube]
    fn score<K: Float>(
        q: &Tensor<f32>,
        q_start: usize,
        q_step: usize,
        keys: &Tensor<K>,
        start: usize,
        step: usize,
        head_dim: usize,
        scale: f32,
    ) -> f32 {
        let mut dot = 0.0f32;
        let mut i = 0usize;
        while i < head_dim {
            dot += q[q_start + i * q_step] * f32::cast_from(keys[start + i * step]);
            i += 1;
        }
        dot * scale
    }

    /// One cube per query row of `q` (`[rows, kv_heads, folded, head_dim]`, any strides; query row
    /// `(r, h, f)` reads key/value head `h`, mask row `f % mask rows`): `out` (contiguous, `q`'s
    /// shape) gets the attention of the query over its keys, `softmax(q k^T * scale) v` over the
    /// keys the mask (`[rows or 1, 1, mask rows, prompt + own]`, nonzero where hidden, any
    /// strides) leaves visible, zeros where it hides every key. The keys are, when `two_parts`,
    /// the prompt of the row's group (`prompt_k`/`prompt_v`: `[groups, kv_heads, prompt,
    /// head_dim]`, the group `group[r]`), then the row's own (`own_k`/`own_v`: `[rows, kv_heads,
    /// own, head_dim]`); without `two_parts` only its own (the prompt's tensors and `group` are
    /// not read). When `round`, `rounded` (contiguous, `out`'s shape) gets the output rounded to
    /// `R` too. The keys and values are in `K` (f32, or the half precision a cache is held in),
    /// each widened to f32 as it is read. `units` is the cube's size, a power of two, at least
    /// `head_dim`.
    #[cube(launch, create_dummy_kernel)]
    // The mask is read only for a key of the row (nested ifs: a kernel's `&&` need not stop early).
    #[allow(clippy::too_many_arguments, clippy::collapsible_if)]
    pub(crate) fn decode_attention_kernel<M: Numeric, G: Numeric, R: Float, K: Float>(
        q: &Tensor<f32>,
        prompt_k: &Tensor<K>,
        prompt_v: &Tensor<K>,
        group: &Tensor<G>,
        own_k: &Tensor<K>,
        own_v: &Tensor<K>,
        mask: &Tensor<M>,
        out: &mut Tensor<f32>,
        rounded: &mut Tensor<R>,
        query_rows: usize,
        scale: f32,
        #[comptime] two_parts: bool,
        #[comptime] round: bool,
        #[comptime] units: usize,
        #[define(M)] _mask_type: ElemType,
        #[define(G)] _group_type: ElemType,
        #[define(R)] _rounded_type: ElemType,
        #[define(K)] _cache_type: ElemType,
    ) {
        let query = cube_row();
        let unit = UNIT_POS_X as usize;
        // Every unit of a cube takes the same branch, so the barriers below stay uniform.
        if query < query_rows {
            let head_dim = q.shape(3);
            let folded = q.shape(2);
            let f = query % folded;
            let h = (query / folded) % q.shape(1);
            let r = query / (folded * q.shape(1));
            let q_start = r * q.stride(0) + h * q.stride(1) + f * q.stride(2);
            let q_step = q.stride(3);
            let mask_start = (r % mask.shape(0)) * mask.stride(0) + (f % mask.shape(2)) * mask.stride(2);
            let mask_step = mask.stride(3);
            let hidden = M::from_int(0);

            let mut prompt_len = 0usize;
            let mut g = 0usize;
            if two_parts {
                prompt_len = prompt_k.shape(2);
                g = usize::cast_from(group[r * group.stride(0)]);
            }
            let own_len = own_k.shape(2);
            let keys = prompt_len + own_len;

            let mut partial = Shared::<[f32]>::new_slice(units);
            let mut weights = Shared::<[f32]>::new_slice(units);
            let lowest = f32::new(-3.402_823_5e38f32);
            // The running maximum of the visible scores, the sum of their exponentials from it,
            // and (unit `c < head_dim`) column `c` of their values weighted so.
            let mut running_max = lowest;
            let mut running_sum = 0.0f32;
            let mut column = 0.0f32;

            let mut tile = 0usize;
            while tile < keys {
                let key = tile + unit;
                let mut visible = false;
                let mut s = lowest;
                if key < keys {
                    if mask[mask_start + key * mask_step] == hidden {
                        visible = true;
                        if key < prompt_len {
                            let start = g * prompt_k.stride(0) + h * prompt_k.stride(1) + key * prompt_k.stride(2);
                            s = score::<K>(q, q_start, q_step, prompt_k, start, prompt_k.stride(3), head_dim, scale);
                        } else {
                            let own = key - prompt_len;
                            let start = r * own_k.stride(0) + h * own_k.stride(1) + own * own_k.stride(2);
                            s = score::<K>(q, q_start, q_step, own_k, start, own_k.stride(3), head_dim, scale);
                        }
                    }
                }
                let tile_max = cube_reduce(&mut partial, s, true);
                let new_max = max(running_max, tile_max);
                let w = if visible { f32::exp(s - new_max) } else { 0.0f32 };
                weights[unit] = w;
                // The reduction's first barrier also publishes `weights`.
                let tile_sum = cube_reduce(&mut partial, w, false);
                let rescale = f32::exp(running_max - new_max);
                running_sum = running_sum * rescale + tile_sum;
                running_max = new_max;
                if unit < head_dim {
                    let mut acc = column * rescale;
                    let end = min(tile + units, keys);
                    // The tile's prompt keys, then its own.
                    let mut key = tile;
                    let prompt_end = min(end, prompt_len);
                    while key < prompt_end {
                        let at = g * prompt_v.stride(0) + h * prompt_v.stride(1) + key * prompt_v.stride(2);
                        acc += weights[key - tile] * f32::cast_from(prompt_v[at + unit * prompt_v.stride(3)]);
                        key += 1;
                    }
                    key = max(tile, prompt_len);
                    while key < end {
                        let own = key - prompt_len;
                        let at = r * own_v.stride(0) + h * own_v.stride(1) + own * own_v.stride(2);
                        acc += weights[key - tile] * f32::cast_from(own_v[at + unit * own_v.stride(3)]);
                        key += 1;
                    }
                    column = acc;
                }
                // Every unit has read `weights` before the next tile writes it.
                sync_cube();
                tile += units;
            }
            if unit < head_dim {
                let value = if running_sum > 0.0 { column / running_sum } else { 0.0f32 };
                out[query * head_dim + unit] = value;
                if round {
                    rounded[query * head_dim + unit] = R::cast_from(value);
                }
            }
        }
    }
}

/// Whether [`decode_attention`] runs for these tensors: plain f32 queries on a cubecl device
/// ([`super::takes`]), plain keys and values of one float type on the same device (f32, or a
/// cache's half precision), at most [`MAX_QUERIES`] query positions a row, heads of at
/// most 256 columns, and a mask stored as integers.
///
/// # Shapes
/// `q`: `[rows, heads, seq, head_dim]`, `mask`: `[rows, 1, seq, keys]`
pub fn applies(q: &Tensor<4>, keys: &[&Tensor<4>], mask: &Tensor<4, Bool>) -> bool {
    let [_, _, seq, head_dim] = q.dims();
    let dtype = keys.first().map_or(DType::F32, |t| t.dtype());
    seq <= MAX_QUERIES
        && head_dim <= MAX_HEAD_DIM
        && super::takes(q)
        && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        && keys.iter().all(|t| t.dtype() == dtype && !t.is_autodiff() && t.device() == q.device())
        && super::attention::integer_mask(mask)
}

/// Masked grouped-query attention of a few query positions a row (a decoding step), scale
/// `1 / sqrt(head_dim)`, in one kernel launch: over each row's own keys and values, or, given
/// `prompt` (each group's prompt keys and values, and each row's group), over its group's prompt
/// followed by its own, as attention over each row's copy of the prompt joined to its own keys
/// computes; given `round` (the half precision of the output projection's product,
/// [`super::rounding`]), also the output rounded to it. For tensors [`applies`] accepts; `None`
/// (nothing run) otherwise.
///
/// # Shapes
/// `q`: `[rows, heads, seq, head_dim]`; `prompt`: `[groups, kv_heads, prompt, head_dim]` each
/// and `[rows]`; `own`: `[rows, kv_heads, own, head_dim]` each; `mask`: `[rows, 1, seq, prompt +
/// own]` (`true`: hidden) -> `[rows, heads, seq, head_dim]` (and rounded, the same)
#[allow(clippy::type_complexity)]
pub fn decode_attention(
    q: &Tensor<4>,
    prompt: Option<(&Tensor<4>, &Tensor<4>, &Tensor<1, Int>)>,
    own: (&Tensor<4>, &Tensor<4>),
    mask: &Tensor<4, Bool>,
    round: Option<DType>,
) -> Option<(Tensor<4>, Option<Tensor<4>>)> {
    let mut keys = vec![own.0, own.1];
    if let Some((k, v, _)) = prompt {
        keys.extend([k, v]);
    }
    if !applies(q, &keys, mask) {
        return None;
    }
    let [rows, heads, seq, head_dim] = q.dims();
    let kv_heads = own.0.dims()[1];
    if kv_heads == 0 || heads % kv_heads != 0 {
        return None;
    }
    let cube = |t: &Tensor<4>| t.clone().try_into_primitive::<Cube>().ok().map(untile);
    // Query head `h` reads key/value head `h / (heads / kv_heads)`: `[rows, kv_heads, folded, d]`.
    let folded = heads / kv_heads * seq;
    let qp: Primitive = cube(&q.clone().reshape([rows, kv_heads, folded, head_dim]))?;
    let (own_k, own_v) = (cube(own.0)?, cube(own.1)?);
    let mp = untile(mask.clone().try_into_primitive::<Cube>().ok()?);
    let mask_type = dtype_to_storage_type(mp.dtype);
    let (prompt_k, prompt_v, group, two_parts) = match prompt {
        Some((k, v, group)) => (cube(k)?, cube(v)?, group.clone().try_into_primitive::<Cube>().ok()?, true),
        // Not read without the prompt: the row's own tensors and the mask stand in.
        None => (own_k.clone(), own_v.clone(), mp.clone(), false),
    };
    let group_type = dtype_to_storage_type(group.dtype);
    let cache_type = dtype_to_storage_type(own_k.dtype);
    let out = empty_of(&qp, Shape::new([rows, kv_heads, folded, head_dim]));
    let (rounded, rounded_type, writes) = rounded_output(&qp, out.meta.shape().clone(), round);
    let query_rows = rows * kv_heads * folded;
    if query_rows > 0 && head_dim > 0 {
        let (count, cube_dim, units) = row_launch(query_rows, head_dim);
        let client = qp.client.clone();
        kernel::decode_attention_kernel::launch(
            &client,
            count,
            cube_dim,
            qp.into_tensor_arg(),
            prompt_k.into_tensor_arg(),
            prompt_v.into_tensor_arg(),
            group.into_tensor_arg(),
            own_k.into_tensor_arg(),
            own_v.into_tensor_arg(),
            mp.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rounded.clone().into_tensor_arg(),
            query_rows,
            (1.0 / (head_dim as f64).sqrt()) as f32,
            two_parts,
            writes,
            units,
            mask_type,
            group_type,
            rounded_type,
            cache_type,
        );
    }
    let shaped = |t: Primitive| Tensor::<4>::from_primitive::<Cube>(t).reshape([rows, heads, seq, head_dim]);
    Some((shaped(out), writes.then(|| shaped(rounded))))
}
