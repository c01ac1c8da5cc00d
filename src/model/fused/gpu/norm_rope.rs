//! Qwen3's per-head RMS norm of the queries and keys and their rotary embedding as one cubecl
//! kernel, for the forwards without gradients.
//!
//! Apart, they are two launches for the queries and two for the keys in every layer of every
//! decoded token ([`super::rms_norm`], then [`super::rope`]); here one cube takes one head of
//! one position: it normalises the head's values as the norm's kernel does (the same units,
//! sums and order of operations), keeps them in shared memory, and writes each value rotated
//! as the rotation's kernel does, heads first. The values are those of the two kernels apart.
//! [`rms_norm_rope_pair`] takes a layer's queries and keys in one launch, each cube one head of
//! either.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::Cube;
use burn::tensor::{Shape, Tensor};
use burn_cubecl::kernel::{into_contiguous, untile};

use super::{empty_of, row_launch, Primitive};

/// The longest head this kernel takes: the cube's units hold the normalised head.
const MAX_HEAD_DIM: usize = 256;

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{cube_row, inverse_rms};

    /// Row `row` of the output, `(b, h, s)` of `x` (`[batch, seq, heads, head_dim]`, any
    /// strides), normalised, `x / sqrt(mean(x^2) + eps) * weight` (when `normed`; as it is
    /// otherwise, `weight` unread), then rotated, `n cos + rotate_half(n) sin` with `cos` and
    /// `sin` `[batch, 1, seq, head_dim]` of any strides, cast to `C` and written to
    /// `out[out_start + j * out_step]`. Every unit of the cube must call it; `partial` holds at
    /// least `head_dim` values.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn norm_rope_row<C: Float>(
        x: &Tensor<f32>,
        weight: &Tensor<f32>,
        cos: &Tensor<f32>,
        sin: &Tensor<f32>,
        out: &mut Tensor<C>,
        out_start: usize,
        out_step: usize,
        row: usize,
        eps: f32,
        partial: &mut Shared<[f32]>,
        #[comptime] normed: bool,
    ) {
        let unit = UNIT_POS_X as usize;
        let units_here = CUBE_DIM_X as usize;
        let dim = x.shape(3);
        let heads = x.shape(2);
        let seq = x.shape(1);
        let s = row % seq;
        let h = (row / seq) % heads;
        let b = row / (seq * heads);
        let start = b * x.stride(0) + s * x.stride(1) + h * x.stride(2);
        let step = x.stride(3);

        // The normalised head, in the slots the reduction is done with.
        if normed {
            let inverse = inverse_rms(x, start, step, dim, eps, partial);
            let mut i = unit;
            while i < dim {
                partial[i] = x[start + i * step] * inverse * weight[i * weight.stride(0)];
                i += units_here;
            }
        } else {
            let mut i = unit;
            while i < dim {
                partial[i] = x[start + i * step];
                i += units_here;
            }
        }
        sync_cube();

        let half = dim / 2;
        let cos_row = b * cos.stride(0) + s * cos.stride(2);
        let sin_row = b * sin.stride(0) + s * sin.stride(2);
        let mut j = unit;
        while j < dim {
            let rotated = if j < half { -partial[j + half] } else { partial[j - half] };
            let c = cos[cos_row + j * cos.stride(3)];
            let n = sin[sin_row + j * sin.stride(3)];
            out[out_start + j * out_step] = C::cast_from(partial[j] * c + rotated * n);
            j += units_here;
        }
    }

    /// One cube per row of `out` ([`norm_rope_row`]). `units`, the cube's size, is a power of two
    /// at least `head_dim`.
    #[cube(launch, create_dummy_kernel)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm_rope_kernel(
        x: &Tensor<f32>,
        weight: &Tensor<f32>,
        cos: &Tensor<f32>,
        sin: &Tensor<f32>,
        out: &mut Tensor<f32>,
        rows: usize,
        eps: f32,
        #[comptime] units: usize,
    ) {
        let row = cube_row();
        // Every unit of a cube takes the same branch, so the barriers stay uniform.
        if row < rows {
            let mut partial = Shared::<[f32]>::new_slice(units);
            norm_rope_row(x, weight, cos, sin, out, row * x.shape(3), 1, row, eps, &mut partial, true);
        }
    }

    /// The queries' and the keys' rows in one launch: cubes `0..q_rows` take the rows of `q_out`
    /// from `q` with `q_weight`, the next `k_rows` those of `k_out` from `k` with `k_weight`
    /// ([`norm_rope_row`], the same tables and `eps`).
    #[cube(launch, create_dummy_kernel)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm_rope_pair_kernel(
        q: &Tensor<f32>,
        q_weight: &Tensor<f32>,
        k: &Tensor<f32>,
        k_weight: &Tensor<f32>,
        cos: &Tensor<f32>,
        sin: &Tensor<f32>,
        q_out: &mut Tensor<f32>,
        k_out: &mut Tensor<f32>,
        q_rows: usize,
        k_rows: usize,
        eps: f32,
        #[comptime] units: usize,
    ) {
        let row = cube_row();
        // Every unit of a cube takes the same branch, so the barriers stay uniform.
        if row < q_rows {
            let mut partial = Shared::<[f32]>::new_slice(units);
            norm_rope_row(q, q_weight, cos, sin, q_out, row * q.shape(3), 1, row, eps, &mut partial, true);
        } else if row < q_rows + k_rows {
            let mut partial = Shared::<[f32]>::new_slice(units);
            let k_row = row - q_rows;
            norm_rope_row(k, k_weight, cos, sin, k_out, k_row * k.shape(3), 1, k_row, eps, &mut partial, true);
        }
    }

    /// A layer's queries rotated, and its keys rotated and values copied into slots `start..`
    /// of a reserved cache's rooms, in one launch: cubes `0..q_rows` take the rows of `q_out`
    /// (contiguous, `[batch, heads, seq, head_dim]`) from `q` with `q_weight`; the next `k_rows`
    /// the keys' rows from `k` with `k_weight`, each written to its slot of `key_room`; the next
    /// `k_rows` the values' rows of `v` (`[batch, kv_heads, seq, head_dim]`, any strides), copied
    /// to theirs of `value_room` ([`norm_rope_row`], normalised when `normed`, the same tables
    /// and `eps`). The rooms are `[batch, kv_heads, room, head_dim]` of any non-overlapping
    /// strides, each value cast to `C` as it is written.
    #[cube(launch, create_dummy_kernel)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_into_room_kernel<C: Float>(
        q: &Tensor<f32>,
        q_weight: &Tensor<f32>,
        k: &Tensor<f32>,
        k_weight: &Tensor<f32>,
        v: &Tensor<f32>,
        cos: &Tensor<f32>,
        sin: &Tensor<f32>,
        q_out: &mut Tensor<f32>,
        key_room: &mut Tensor<C>,
        value_room: &mut Tensor<C>,
        q_rows: usize,
        k_rows: usize,
        start: usize,
        eps: f32,
        #[comptime] units: usize,
        #[comptime] normed: bool,
        #[define(C)] _room_type: ElemType,
    ) {
        let row = cube_row();
        // Every unit of a cube takes the same branch, so the barriers stay uniform.
        if row < q_rows {
            let mut partial = Shared::<[f32]>::new_slice(units);
            norm_rope_row(q, q_weight, cos, sin, q_out, row * q.shape(3), 1, row, eps, &mut partial, normed);
        } else if row < q_rows + 2 * k_rows {
            let is_value = row >= q_rows + k_rows;
            let r = if is_value { row - q_rows - k_rows } else { row - q_rows };
            let seq = k.shape(1);
            let heads = k.shape(2);
            let s = r % seq;
            let h = (r / seq) % heads;
            let b = r / (seq * heads);
            if is_value {
                let at = b * value_room.stride(0) + h * value_room.stride(1) + (start + s) * value_room.stride(2);
                let from = b * v.stride(0) + h * v.stride(1) + s * v.stride(2);
                let out_step = value_room.stride(3);
                let mut j = UNIT_POS_X as usize;
                while j < v.shape(3) {
                    value_room[at + j * out_step] = C::cast_from(v[from + j * v.stride(3)]);
                    j += CUBE_DIM_X as usize;
                }
            } else {
                let at = b * key_room.stride(0) + h * key_room.stride(1) + (start + s) * key_room.stride(2);
                let out_step = key_room.stride(3);
                let mut partial = Shared::<[f32]>::new_slice(units);
                norm_rope_row(k, k_weight, cos, sin, key_room, at, out_step, r, eps, &mut partial, normed);
            }
        }
    }
}

/// `rope(rms_norm(x, weight).swap_dims(1, 2), cos, sin)` in one kernel launch, for plain f32
/// tensors on a cubecl device ([`super::takes`], which the caller checks); `None`, with nothing
/// run, for heads of an odd number or more than [`MAX_HEAD_DIM`] values, tables of another
/// shape, or a tensor that is not a cubecl primitive.
///
/// # Shapes
/// `x`: `[batch, seq, heads, head_dim]` (`head_dim` even), `weight`: `[head_dim]`,
/// `cos`/`sin`: `[batch, 1, seq, head_dim]` -> `[batch, heads, seq, head_dim]` (contiguous)
pub fn rms_norm_rope(
    x: &Tensor<4>,
    weight: &Tensor<1>,
    eps: f64,
    cos: &Tensor<4>,
    sin: &Tensor<4>,
) -> Option<Tensor<4>> {
    let dims = x.dims();
    let [batch, seq, _, dim] = dims;
    let fits = cos.dims() == [batch, 1, seq, dim] && sin.dims() == cos.dims() && dim % 2 == 0 && dim <= MAX_HEAD_DIM;
    if !fits {
        return None;
    }
    let xp = x.clone().try_into_primitive::<Cube>().ok()?;
    let wp = weight.clone().try_into_primitive::<Cube>().ok()?;
    let cp = cos.clone().try_into_primitive::<Cube>().ok()?;
    let sp = sin.clone().try_into_primitive::<Cube>().ok()?;
    let out = forward(dims, untile(xp), into_contiguous(wp), untile(cp), untile(sp), eps as f32);
    Some(Tensor::from_primitive::<Cube>(out))
}

/// [`rms_norm_rope`] of the queries and of the keys (each with its own weight, one `eps`) in
/// one kernel launch: what the two calls give, one launch a layer fewer. `None`, with nothing
/// run, where either call would refuse, or for queries and keys of other widths or positions.
///
/// # Shapes
/// `q`: `[batch, seq, heads, head_dim]`, `k`: `[batch, seq, kv_heads, head_dim]`, weights
/// `[head_dim]`, `cos`/`sin`: `[batch, 1, seq, head_dim]` -> `[batch, heads, seq, head_dim]`,
/// `[batch, kv_heads, seq, head_dim]` (contiguous)
pub fn rms_norm_rope_pair(
    (q, q_weight): (&Tensor<4>, &Tensor<1>),
    (k, k_weight): (&Tensor<4>, &Tensor<1>),
    eps: f64,
    cos: &Tensor<4>,
    sin: &Tensor<4>,
) -> Option<(Tensor<4>, Tensor<4>)> {
    let [batch, seq, heads, dim] = q.dims();
    let [k_batch, k_seq, kv_heads, k_dim] = k.dims();
    let fits = (k_batch, k_seq, k_dim) == (batch, seq, dim)
        && cos.dims() == [batch, 1, seq, dim]
        && sin.dims() == cos.dims()
        && dim % 2 == 0
        && dim <= MAX_HEAD_DIM;
    if !fits {
        return None;
    }
    let cube = |t: &Tensor<4>| t.clone().try_into_primitive::<Cube>().ok().map(untile);
    let weight = |w: &Tensor<1>| w.clone().try_into_primitive::<Cube>().ok().map(into_contiguous);
    let (qp, kp, cp, sp) = (cube(q)?, cube(k)?, cube(cos)?, cube(sin)?);
    let (qw, kw) = (weight(q_weight)?, weight(k_weight)?);
    let q_out = empty_of(&qp, Shape::new([batch, heads, seq, dim]));
    let k_out = empty_of(&qp, Shape::new([batch, kv_heads, seq, dim]));
    let (q_rows, k_rows) = (batch * heads * seq, batch * kv_heads * seq);
    if q_rows + k_rows > 0 && dim > 0 {
        let (count, cube_dim, units) = row_launch(q_rows + k_rows, dim);
        let client = qp.client.clone();
        kernel::rms_norm_rope_pair_kernel::launch(
            &client,
            count,
            cube_dim,
            qp.into_tensor_arg(),
            qw.into_tensor_arg(),
            kp.into_tensor_arg(),
            kw.into_tensor_arg(),
            cp.into_tensor_arg(),
            sp.into_tensor_arg(),
            q_out.clone().into_tensor_arg(),
            k_out.clone().into_tensor_arg(),
            q_rows,
            k_rows,
            eps as f32,
            units,
        );
    }
    Some((Tensor::from_primitive::<Cube>(q_out), Tensor::from_primitive::<Cube>(k_out)))
}

/// A layer's keys rotated and its values, written into slots `start..start + seq` of a
/// reserved cache's rooms in place (cast to the rooms' element type), and its queries rotated,
/// in one kernel launch: the work of [`rms_norm_rope_pair`] (or of the two rotations alone,
/// for a model without Qwen3's per-head norms) and [`super::cache_write`], one launch a layer
/// where those are two or three. `norms` are the queries' and the keys' weights and their one
/// `eps`; without `q` only the keys and values are written. Returns the rotated queries (when
/// given) and the rooms; with nothing run, `Err(rooms)` for tensors either would refuse
/// ([`super::takes`], [`super::cache_write`]'s rooms).
///
/// # Shapes
/// `q`: `[batch, seq, heads, head_dim]`, `k`: `[batch, seq, kv_heads, head_dim]`, `v`: `[batch,
/// kv_heads, seq, head_dim]` (any strides), weights `[head_dim]`, `cos`/`sin`: `[batch, 1, seq,
/// head_dim]`, `rooms`: `[batch, kv_heads, room, head_dim]` each -> `[batch, heads, seq,
/// head_dim]` (contiguous), `rooms`
#[allow(clippy::result_large_err, clippy::type_complexity)]
pub fn rope_into_room(
    (q, k, v): (Option<&Tensor<4>>, &Tensor<4>, &Tensor<4>),
    norms: Option<(&Tensor<1>, &Tensor<1>, f64)>,
    (cos, sin): (&Tensor<4>, &Tensor<4>),
    rooms: (Tensor<4>, Tensor<4>),
    start: usize,
) -> Result<(Option<Tensor<4>>, (Tensor<4>, Tensor<4>)), (Tensor<4>, Tensor<4>)> {
    let [batch, seq, kv_heads, dim] = k.dims();
    let heads = q.map_or(0, |q| q.dims()[2]);
    let fits = q.is_none_or(|q| q.dims() == [batch, seq, heads, dim])
        && v.dims() == [batch, kv_heads, seq, dim]
        && cos.dims() == [batch, 1, seq, dim]
        && sin.dims() == cos.dims()
        && dim % 2 == 0
        && dim <= MAX_HEAD_DIM;
    let taken = [Some(k), Some(v), q, Some(cos), Some(sin)].into_iter().flatten().all(super::takes)
        && norms.is_none_or(|(qw, kw, _)| super::takes(qw) && super::takes(kw));
    if !(fits && taken) {
        return Err(rooms);
    }
    let (key_room, value_room) = super::cache_write::writable_rooms(rooms, [batch, kv_heads, seq, dim], start, k)?;
    let cube = |t: &Tensor<4>| untile(t.clone().try_into_primitive::<Cube>().expect("checked by `takes`"));
    let weight = |w: &Tensor<1>| into_contiguous(w.clone().try_into_primitive::<Cube>().expect("checked by `takes`"));
    let (kp, vp, cp, sp) = (cube(k), cube(v), cube(cos), cube(sin));
    let qp = q.map(cube);
    // Without norms the weights are not read; without queries no query row is taken: any
    // tensor of the device stands in for them.
    let (qw, kw) = match norms {
        Some((qw, kw, _)) => (weight(qw), weight(kw)),
        None => (cp.clone(), cp.clone()),
    };
    let q_out = empty_of(&kp, Shape::new(if q.is_some() { [batch, heads, seq, dim] } else { [1, 1, 1, 1] }));
    let (q_rows, k_rows) = (batch * heads * seq, batch * kv_heads * seq);
    if q_rows + k_rows > 0 && dim > 0 {
        let (count, cube_dim, units) = row_launch(q_rows + 2 * k_rows, dim);
        let client = kp.client.clone();
        let room_type = dtype_to_storage_type(key_room.dtype);
        kernel::rope_into_room_kernel::launch(
            &client,
            count,
            cube_dim,
            qp.unwrap_or_else(|| kp.clone()).into_tensor_arg(),
            qw.into_tensor_arg(),
            kp.into_tensor_arg(),
            kw.into_tensor_arg(),
            vp.into_tensor_arg(),
            cp.into_tensor_arg(),
            sp.into_tensor_arg(),
            q_out.clone().into_tensor_arg(),
            key_room.clone().into_tensor_arg(),
            value_room.clone().into_tensor_arg(),
            q_rows,
            k_rows,
            start,
            norms.map_or(0.0, |(_, _, eps)| eps as f32),
            units,
            norms.is_some(),
            room_type,
        );
    }
    let rooms = (Tensor::from_primitive::<Cube>(key_room), Tensor::from_primitive::<Cube>(value_room));
    Ok((q.map(|_| Tensor::from_primitive::<Cube>(q_out)), rooms))
}

/// The kernel's launch over `x` of `dims`: one cube per output row.
fn forward(
    [batch, seq, heads, dim]: [usize; 4],
    xp: Primitive,
    wp: Primitive,
    cp: Primitive,
    sp: Primitive,
    eps: f32,
) -> Primitive {
    let out = empty_of(&xp, Shape::new([batch, heads, seq, dim]));
    let rows = batch * heads * seq;
    if rows == 0 || dim == 0 {
        return out;
    }
    let (count, cube_dim, units) = row_launch(rows, dim);
    let client = xp.client.clone();
    kernel::rms_norm_rope_kernel::launch(
        &client,
        count,
        cube_dim,
        xp.into_tensor_arg(),
        wp.into_tensor_arg(),
        cp.into_tensor_arg(),
        sp.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        eps,
        units,
    );
    out
}
