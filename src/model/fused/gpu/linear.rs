//! A frozen projection `x W^T` on a cubecl device, its product written in f32.
//!
//! With the base held in bf16 or f16 (`model.dtype`), burn's composite is three launches a
//! product: `x` rounded to the weight's type, the product (accumulated in f32, written in the
//! weight's type) and a cast of it back to f32; its backward is three more (the gradient
//! rounded, the product, the cast back). burn's matmul writes any output type its accumulator
//! converts to, so here the product writes f32 directly: two launches each way, and the
//! product's value is its f32 accumulation, not rounded to the weight's type on the way (the
//! residual stream it joins is f32). Under autodiff the projection is one node that keeps only
//! the weight (a frozen weight needs no gradient, so the input is not kept).
//!
//! A weight in f32 takes the same node and one launch each way, as burn's matmul does.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Cube};
use burn::tensor::{DType, Tensor};
use burn_cubecl::kernel::matmul::{init_matmul_output, matmul, MatmulStrategy};
use burn_cubecl::kernel::{cast, untile};
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::launch_ref;
use cubek::std::InputBinding;

use crate::model::MatmulKernel;

use super::{apply_tracked, Primitive, TrackedOp};

/// `x W^T` (`transposed`) or `x W`, `x` f32 rounded to `weight`'s type when that is not f32,
/// written in f32 by the routine `TROUPE_MATMUL` names ([`kernel`]; burn's rule where that
/// routine cannot launch it); `None` where burn's matmul cannot write f32 from that type on this
/// device.
fn product(x: Primitive, weight: &Primitive, transposed: bool) -> Option<Primitive> {
    product_with(kernel(), x, weight, transposed)
}

/// [`product`] by `chosen`'s routine (`auto` where it cannot launch the product).
fn product_with(chosen: MatmulKernel, x: Primitive, weight: &Primitive, transposed: bool) -> Option<Primitive> {
    let (lhs, rhs) = operands(x, weight, transposed);
    if chosen != MatmulKernel::Auto {
        match product_by(chosen, lhs.clone(), rhs.clone()) {
            Ok(out) => return Some(out),
            Err(reason) => warn_once(chosen, &lhs, &rhs, &reason),
        }
    }
    product_by(MatmulKernel::Auto, lhs, rhs).ok()
}

/// `x W^T` (`transposed`) or `x W` for a frozen `W` (`[out, in]`, in f32, bf16 or f16) on a
/// cubecl device, in f32, by `kernel`'s routine alone, with no fallback: for comparing the
/// routines (`benches/gemm.rs`). `x` is rounded to the weight's type first unless it is in it.
/// The routine's refusal where it cannot launch the product; an error too for an operand off a
/// cubecl device.
///
/// # Shapes
/// `x`: `[rows, in]` (`transposed`) or `[rows, out]`, `weight`: `[out, in]` -> `[rows, out]` or
/// `[rows, in]`
pub fn frozen_product_by(
    kernel: MatmulKernel,
    x: &Tensor<2>,
    weight: &Tensor<2>,
    transposed: bool,
) -> Result<Tensor<2>, String> {
    let on_cube =
        |t: &Tensor<2>| t.clone().try_into_primitive::<Cube>().map_err(|_| "not on a cubecl device".to_string());
    let (lhs, rhs) = operands(on_cube(x)?, &on_cube(weight)?, transposed);
    product_by(kernel, lhs, rhs).map(Tensor::from_primitive::<Cube>)
}

/// The routine of the frozen products: `TROUPE_MATMUL`, read once (the binary refuses a value
/// it does not know before any work; elsewhere an unknown one is `auto`).
fn kernel() -> MatmulKernel {
    static KERNEL: OnceLock<MatmulKernel> = OnceLock::new();
    *KERNEL.get_or_init(|| crate::device::matmul_kernel().unwrap_or_default())
}

/// `lhs rhs` written in f32 by `kernel`'s cubek routine, as burn's matmul launches one
/// (`burn_cubecl::kernel::matmul::launch_matmul`, for operands of one type, neither quantized);
/// the routine's refusal, with nothing written, where it cannot launch the product here.
///
/// # Shapes
/// `lhs`: `[m, k]`, `rhs`: `[k, n]` (any strides) -> `[m, n]`
fn product_by(kernel: MatmulKernel, lhs: Primitive, rhs: Primitive) -> Result<Primitive, String> {
    if kernel == MatmulKernel::Auto {
        return matmul(lhs, rhs, None, MatmulStrategy::default(), DType::F32).map_err(|e| format!("{e:?}"));
    }
    let out = init_matmul_output(&lhs, &rhs, DType::F32);
    let (lhs_type, rhs_type) = (dtype_to_storage_type(lhs.dtype), dtype_to_storage_type(rhs.dtype));
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: lhs_type,
        rhs: rhs_type,
        out: dtype_to_storage_type(DType::F32),
    });
    let client = out.client.clone();
    launch_ref(
        &kernel.cubek(),
        &client,
        InputBinding::new(lhs.binding(), lhs_type),
        InputBinding::new(rhs.binding(), rhs_type),
        out.clone().binding(),
        &mut dtypes,
    )
    .map_err(|e| format!("{e:?}"))?;
    Ok(out)
}

/// Warns, once per routine in a process, that `TROUPE_MATMUL`'s routine could not launch a
/// product, which burn's rule ran instead.
fn warn_once(kernel: MatmulKernel, lhs: &Primitive, rhs: &Primitive, reason: &str) {
    static WARNED: Mutex<Option<HashSet<MatmulKernel>>> = Mutex::new(None);
    let mut warned = WARNED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if warned.get_or_insert_with(HashSet::new).insert(kernel) {
        let reason: String = reason.split_whitespace().collect::<Vec<_>>().join(" ");
        tracing::warn!(
            "TROUPE_MATMUL={}: a product {:?} x {:?} ({:?}) ran burn's rule instead (this routine's later refusals are not reported): {reason}",
            kernel.name(),
            lhs.meta.shape().as_slice(),
            rhs.meta.shape().as_slice(),
            lhs.dtype,
        );
    }
}

/// The product's operands: `x` rounded to `weight`'s type when that is not f32 (an `x` already
/// in it was rounded by the kernel that wrote it), and `weight` or its transposed view.
fn operands(x: Primitive, weight: &Primitive, transposed: bool) -> (Primitive, Primitive) {
    let low = weight.dtype;
    let lhs = if low == DType::F32 || x.dtype == low { x } else { cast(untile(x), low) };
    (lhs, if transposed { transpose(weight) } else { weight.clone() })
}

/// A 2-D primitive's transposed view.
fn transpose(weight: &Primitive) -> Primitive {
    Tensor::<2>::from_primitive::<Cube>(weight.clone())
        .transpose()
        .try_into_primitive::<Cube>()
        .expect("a view of a cubecl tensor stays on its device")
}

/// Whether burn's matmul writes f32 from operands of `dtype` on `weight`'s device, found once
/// per dtype by a product of one row (a runtime's matmul may refuse a combination of types).
fn writes_f32(weight: &Primitive) -> bool {
    static KNOWN: Mutex<Option<HashMap<DType, bool>>> = Mutex::new(None);
    let dtype = weight.dtype;
    if dtype == DType::F32 {
        return true;
    }
    let mut known = KNOWN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    *known.get_or_insert_with(HashMap::new).entry(dtype).or_insert_with(|| {
        let device = Tensor::<2>::from_primitive::<Cube>(weight.clone()).device();
        let fan_in = weight.meta.shape().as_slice()[1];
        let row = Tensor::<2>::zeros([1, fan_in], &device)
            .try_into_primitive::<Cube>()
            .expect("a tensor made on a cubecl device is a cubecl primitive");
        // burn's rule, which every other routine falls back to.
        product_with(MatmulKernel::Auto, row, weight, true).is_some()
    })
}

/// `weight`'s primitive where the products here take it: plain, on a cubecl device, in f32, bf16
/// or f16, of a type burn's matmul writes f32 from there ([`writes_f32`]).
fn frozen_weight(weight: &Tensor<2>) -> Option<Primitive> {
    let wp = weight.clone().try_into_primitive::<Cube>().ok()?;
    (matches!(wp.dtype, DType::F32 | DType::BF16 | DType::F16) && writes_f32(&wp)).then_some(wp)
}

/// `x W^T` for a frozen `W` (`[out, in]`, held in f32, bf16 or f16) on a cubecl device, in f32,
/// with a node of its own under autodiff ([`super::takes`], [`super::takes_tracked`]); `None`
/// (nothing run) where burn's composite should run: troupe's kernels off, `x` not f32 on a
/// cubecl device, or a weight type burn's matmul cannot write f32 from there.
///
/// # Shapes
/// `x`: `[rows, in]`, `weight`: `[out, in]` -> `[rows, out]`
pub fn frozen_linear(x: &Tensor<2>, weight: &Tensor<2>) -> Option<Tensor<2>> {
    if !(super::takes(x) || super::takes_tracked(x)) || weight.is_autodiff() {
        return None;
    }
    let wp = frozen_weight(weight)?;
    if !x.is_autodiff() {
        let xp = x.clone().try_into_primitive::<Cube>().ok()?;
        return product(xp, &wp, true).map(Tensor::from_primitive::<Cube>);
    }
    apply_tracked(Frozen { weight: wp }, [x.clone()])
}

/// The half precision a frozen product by `weight` rounds its input to ([`frozen_linear`]), for
/// a kernel before the product to write its output rounded so too, in place of the product's
/// cast; `None` for a weight in f32, with troupe's kernels off, or where [`frozen_linear`] would
/// not run.
pub fn rounding(weight: &Tensor<2>) -> Option<DType> {
    if !super::enabled() || weight.is_autodiff() {
        return None;
    }
    let dtype = frozen_weight(weight)?.dtype;
    (dtype != DType::F32).then_some(dtype)
}

/// [`frozen_linear`] of an `x` already rounded to the weight's type ([`rounding`]: a kernel
/// before the product wrote it so), written in f32: the product's one launch. `None`, with
/// nothing run, for an `x` of another type, under autodiff, or where [`frozen_linear`] would not
/// run.
///
/// # Shapes
/// `x`: `[rows, in]`, `weight`: `[out, in]` -> `[rows, out]`
pub fn frozen_linear_rounded(x: &Tensor<2>, weight: &Tensor<2>) -> Option<Tensor<2>> {
    if x.is_autodiff() || rounding(weight) != Some(x.dtype()) {
        return None;
    }
    let wp = frozen_weight(weight)?;
    let xp = x.clone().try_into_primitive::<Cube>().ok()?;
    product(xp, &wp, true).map(Tensor::from_primitive::<Cube>)
}

/// `dy W` for a frozen `W` (`[out, in]`) on a cubecl device, in f32 (`dy` rounded to `W`'s
/// type when that is not f32): [`frozen_linear`]'s backward, for a caller outside autodiff;
/// `None` where [`frozen_linear`] would not run.
///
/// # Shapes
/// `dy`: `[rows, out]`, `weight`: `[out, in]` -> `[rows, in]`
pub fn frozen_linear_backward(dy: &Tensor<2>, weight: &Tensor<2>) -> Option<Tensor<2>> {
    if !super::takes(dy) {
        return None;
    }
    let wp = frozen_weight(weight)?;
    let dyp = dy.clone().try_into_primitive::<Cube>().ok()?;
    product(dyp, &wp, false).map(Tensor::from_primitive::<Cube>)
}

/// The projection by a frozen weight, as an autodiff node whose backward is
/// [`FrozenBackward`] (the weight is all it keeps).
#[derive(Clone, Debug)]
struct Frozen {
    weight: Primitive,
}

impl TrackedOp<1> for Frozen {
    fn apply<C: CheckpointStrategy>(self, [xa]: [FloatTensor<Autodiff<Cube, C>>; 1]) -> FloatTensor<Autodiff<Cube, C>> {
        let node = xa.node();
        let out = product(xa.into_primitive(), &self.weight, true).expect("`writes_f32` checked the product");
        match FrozenBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(self, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// The backward of [`frozen_linear`]: `x`'s gradient `dy W`, in f32.
#[derive(Debug)]
struct FrozenBackward;

impl Backward<Cube, 1> for FrozenBackward {
    type State = Frozen;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Some(node) = node_x else { return };
        let dx = product(grad, &ops.state.weight, false).expect("`writes_f32` checked the product");
        grads.register::<Cube>(node.id, dx);
    }
}
