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

use burn::backend::Cube;
use burn::tensor::{Shape, Tensor};
use burn_cubecl::kernel::{into_contiguous, untile};

use super::{empty_of, row_launch, Primitive};

/// The longest head this kernel takes: the cube's units hold the normalised head.
const MAX_HEAD_DIM: usize = 256;

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::super::cube::{cube_row, inverse_rms};

    /// Row `row` of `out` (contiguous, `[batch, heads, seq, head_dim]`): row `(b, h, s)` of `x`
    /// (`[batch, seq, heads, head_dim]`, any strides), normalised, `x / sqrt(mean(x^2) + eps) *
    /// weight`, then rotated, `n cos + rotate_half(n) sin` with `cos` and `sin` `[batch, 1, seq,
    /// head_dim]` of any strides. Every unit of the cube must call it; `partial` holds at least
    /// `head_dim` values.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn norm_rope_row(
        x: &Tensor<f32>,
        weight: &Tensor<f32>,
        cos: &Tensor<f32>,
        sin: &Tensor<f32>,
        out: &mut Tensor<f32>,
        row: usize,
        eps: f32,
        partial: &mut Shared<[f32]>,
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
        let inverse = inverse_rms(x, start, step, dim, eps, partial);

        // The normalised head, in the slots the reduction is done with.
        let mut i = unit;
        while i < dim {
            partial[i] = x[start + i * step] * inverse * weight[i * weight.stride(0)];
            i += units_here;
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
            out[row * dim + j] = partial[j] * c + rotated * n;
            j += units_here;
        }
    }

    /// One cube per row of `out` ([`norm_rope_row`]). `units`, the cube's size, is a power of two
    /// at least `head_dim`.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_rope_kernel(
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
            norm_rope_row(x, weight, cos, sin, out, row, eps, &mut partial);
        }
    }

    /// The queries' and the keys' rows in one launch: cubes `0..q_rows` take the rows of `q_out`
    /// from `q` with `q_weight`, the next `k_rows` those of `k_out` from `k` with `k_weight`
    /// ([`norm_rope_row`], the same tables and `eps`).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_rope_pair_kernel(
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
            norm_rope_row(q, q_weight, cos, sin, q_out, row, eps, &mut partial);
        } else if row < q_rows + k_rows {
            let mut partial = Shared::<[f32]>::new_slice(units);
            norm_rope_row(k, k_weight, cos, sin, k_out, row - q_rows, eps, &mut partial);
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
