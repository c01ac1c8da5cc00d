//! The MLP's gate `silu(gate) * up` as one cubecl kernel.
//!
//! burn's composite is eight kernels on a GPU: its sigmoid is `exp(-log(1 + exp(-x)))` (two
//! negations, two exponentials, an add and a log), then the two products. Here one unit writes
//! one output value by the same formula, reading the gate and `up` through their strides (the
//! two halves of the stacked gate/up product, read in place).

use burn::backend::Cube;
use burn::tensor::Tensor;
use burn_cubecl::kernel::untile;

use super::{elementwise_launch, empty_like};

/// The kernel, with cubecl's `Tensor` (not burn's) in scope.
mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// One unit per value of `out` (contiguous, `gate`'s shape): `silu(gate) * up`, `gate` and
    /// `up` of one shape and any strides.
    #[cube(launch)]
    pub(super) fn swiglu_kernel(gate: &Tensor<f32>, up: &Tensor<f32>, out: &mut Tensor<f32>) {
        let index = ABSOLUTE_POS;
        if index < out.len() {
            // The value's index split over the dimensions, last first.
            let mut rest = index;
            let mut at_gate = 0usize;
            let mut at_up = 0usize;
            let mut dim = gate.rank();
            while dim > 0 {
                dim -= 1;
                let size = gate.shape(dim);
                let coordinate = rest % size;
                at_gate += coordinate * gate.stride(dim);
                at_up += coordinate * up.stride(dim);
                rest /= size;
            }
            let x = gate[at_gate];
            let sigmoid = f32::exp(-f32::ln(f32::exp(-x) + 1.0f32));
            out[index] = x * sigmoid * up[at_up];
        }
    }
}

/// `silu(gate) * up` in one kernel launch, for plain f32 tensors of one shape on a cubecl device
/// ([`super::takes`]; burn's composite otherwise).
///
/// # Shapes
/// `gate`, `up`: `[..., width]` -> like `gate` (contiguous)
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    let primitives = (gate.clone().try_into_primitive::<Cube>(), up.clone().try_into_primitive::<Cube>());
    let (Ok(gp), Ok(up_p)) = primitives else {
        return burn::tensor::activation::silu(gate) * up;
    };
    let (gp, up_p) = (untile(gp), untile(up_p));
    let out = empty_like(&gp);
    let count = gate.dims().iter().product::<usize>();
    if count == 0 {
        return Tensor::from_primitive::<Cube>(out);
    }
    let (cube_count, cube_dim) = elementwise_launch(&gp, count);
    let client = gp.client.clone();
    kernel::swiglu_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        gp.into_tensor_arg(),
        up_p.into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    Tensor::from_primitive::<Cube>(out)
}
