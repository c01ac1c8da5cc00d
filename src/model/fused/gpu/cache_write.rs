//! A step's keys and values written into a reserved KV cache's room as one kernel, in place.
//!
//! A reserved cache ([`crate::model::KvCache::with_capacity`]) keeps each layer's keys and
//! values in a room of fixed size and writes every step's new slots into it. burn's slice write
//! is one launch per tensor, two a layer at every decoding step; here one unit moves one key
//! value and the value beside it, a launch a layer. The room's element type is the kernel's
//! parameter: each value is cast to it as it is written (an f32 room copies the values as they
//! are).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::Cube;
use burn::tensor::Tensor;
use burn_cubecl::kernel::untile;

use super::{elementwise_launch, Primitive};

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
// `create_dummy_kernel`: each kernel built without a device, for `cuda_source`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// One unit per value of `keys` (`[batch, heads, seq, head_dim]`, any strides, as `values`):
    /// slot `start + s` of `key_room` and `value_room` (`[batch, heads, room, head_dim]`, any
    /// non-overlapping strides) gets the keys' and the values' slot `s`, cast to `C`.
    #[cube(launch, create_dummy_kernel)]
    pub(crate) fn cache_write_kernel<C: Float>(
        keys: &Tensor<f32>,
        values: &Tensor<f32>,
        key_room: &mut Tensor<C>,
        value_room: &mut Tensor<C>,
        start: usize,
        #[define(C)] _room_type: ElemType,
    ) {
        let index = ABSOLUTE_POS;
        let dim = keys.shape(3);
        let seq = keys.shape(2);
        let heads = keys.shape(1);
        if index < keys.shape(0) * heads * seq * dim {
            let j = index % dim;
            let s = (index / dim) % seq;
            let h = (index / (dim * seq)) % heads;
            let b = index / (dim * seq * heads);
            let slot = start + s;
            let key = keys[b * keys.stride(0) + h * keys.stride(1) + s * keys.stride(2) + j * keys.stride(3)];
            let value =
                values[b * values.stride(0) + h * values.stride(1) + s * values.stride(2) + j * values.stride(3)];
            let key_at =
                b * key_room.stride(0) + h * key_room.stride(1) + slot * key_room.stride(2) + j * key_room.stride(3);
            let value_at = b * value_room.stride(0)
                + h * value_room.stride(1)
                + slot * value_room.stride(2)
                + j * value_room.stride(3);
            key_room[key_at] = C::cast_from(key);
            value_room[value_at] = C::cast_from(value);
        }
    }
}

/// Writes `keys` and `values` into slots `start..start + seq` of `rooms` (keys', values') in
/// one kernel launch, in place, and returns the rooms. For plain f32 keys and values on a cubecl
/// device ([`super::takes`]) and rooms of one float type that nothing else holds (as a reserved
/// cache holds its rooms); otherwise nothing is run and the rooms come back as `Err`, for burn's
/// slice writes.
///
/// # Shapes
/// `rooms`: `[batch, heads, room, head_dim]` each; `keys`, `values`: `[batch, heads, seq,
/// head_dim]`, `start + seq <= room` -> `rooms`
#[allow(clippy::result_large_err)]
pub fn cache_write(
    rooms: (Tensor<4>, Tensor<4>),
    keys: &Tensor<4>,
    values: &Tensor<4>,
    start: usize,
) -> Result<(Tensor<4>, Tensor<4>), (Tensor<4>, Tensor<4>)> {
    let [batch, heads, seq, dim] = keys.dims();
    if !(values.dims() == keys.dims() && super::takes(keys) && super::takes(values)) {
        return Err(rooms);
    }
    let (key_room, value_room) = writable_rooms(rooms, [batch, heads, seq, dim], start, keys)?;
    let cube = |t: &Tensor<4>| untile(t.clone().try_into_primitive::<Cube>().expect("checked by `takes`"));
    let (kp, vp) = (cube(keys), cube(values));
    let count = batch * heads * seq * dim;
    if count > 0 {
        let (cube_count, cube_dim) = elementwise_launch(&kp, count);
        let room_type = dtype_to_storage_type(key_room.dtype);
        kernel::cache_write_kernel::launch(
            &kp.client.clone(),
            cube_count,
            cube_dim,
            kp.into_tensor_arg(),
            vp.into_tensor_arg(),
            key_room.clone().into_tensor_arg(),
            value_room.clone().into_tensor_arg(),
            start,
            room_type,
        );
    }
    Ok((Tensor::from_primitive::<Cube>(key_room), Tensor::from_primitive::<Cube>(value_room)))
}

/// `rooms` (keys', values') as primitives a kernel may write in place, for `[batch, heads, seq,
/// head_dim]` new slots from `start`: plain rooms of one float type on `like`'s device (a
/// cubecl device, which the caller checks), `[batch, heads, room, head_dim]` with `start + seq
/// <= room`, untiled, not overlapping, and held nowhere else (as a reserved cache holds its
/// rooms while it writes them). Otherwise the rooms come back as they were, as `Err`. `like`
/// is a tensor [`super::takes`] takes.
#[allow(clippy::result_large_err)]
pub(super) fn writable_rooms(
    rooms: (Tensor<4>, Tensor<4>),
    [batch, heads, seq, dim]: [usize; 4],
    start: usize,
    like: &Tensor<4>,
) -> Result<(Primitive, Primitive), (Tensor<4>, Tensor<4>)> {
    let [room_batch, room_heads, room, room_dim] = rooms.0.dims();
    let fits = rooms.1.dims() == rooms.0.dims()
        && [room_batch, room_heads, room_dim] == [batch, heads, dim]
        && start + seq <= room
        && rooms.0.dtype() == rooms.1.dtype()
        && rooms.0.dtype().is_float();
    let beside = |t: &Tensor<4>| !t.is_autodiff() && t.device() == like.device();
    if !(fits && beside(&rooms.0) && beside(&rooms.1)) {
        return Err(rooms);
    }
    let primitive = |t: Tensor<4>| t.try_into_primitive::<Cube>().expect("a plain tensor on a cubecl device");
    let (key_room, value_room) = (primitive(rooms.0), primitive(rooms.1));
    let writable = |p: &Primitive| !p.meta.is_tiled() && p.can_mut() && p.is_nonoverlapping();
    if !(writable(&key_room) && writable(&value_room)) {
        let back = |p: Primitive| Tensor::<4>::from_primitive::<Cube>(p);
        return Err((back(key_room), back(value_room)));
    }
    Ok((key_room, value_room))
}
