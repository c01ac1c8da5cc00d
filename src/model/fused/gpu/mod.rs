//! cubecl kernels for the forwards without gradients on a GPU (rollouts, scoring, evaluation),
//! where burn's composites launch a kernel per operation and a decoded token is a few hundred
//! small launches (`examples/kernel_counts.rs`):
//!
//! - [`rms_norm()`]: one kernel per norm instead of seven.
//! - [`rope()`]: one kernel per rotation instead of six.
//! - [`attention()`]: the two products around one softmax kernel instead of nine kernels, and
//!   the grouped-query heads' mask read in place instead of repeated.
//!
//! - [`swiglu()`]: one kernel for the MLP's gate instead of eight.
//!
//! Each takes plain (non-autodiff) f32 tensors on a cubecl device ([`takes`]); under autodiff,
//! for other dtypes, and with `TROUPE_GPU_KERNELS=burn`, burn's composites run.

use std::sync::OnceLock;

use burn::backend::DispatchDevice;
use burn::tensor::{DType, Tensor};

mod attention;
mod rms_norm;
mod rope;
mod swiglu;

pub(super) use attention::applies as attention_applies;
pub use attention::attention;
pub use rms_norm::rms_norm;
pub use rope::rope;
pub use swiglu::swiglu;

/// The most cubes a grid dimension holds on every cubecl runtime (Vulkan's minimum).
const MAX_GRID: usize = 65_535;

/// Whether these kernels run at all: `TROUPE_GPU_KERNELS` ([`crate::device::fused_gpu_kernels`],
/// read once; the binary refuses a value it does not know before any work).
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| crate::device::fused_gpu_kernels().unwrap_or(true))
}

/// Whether these kernels take `tensor`: they are [`enabled`] and it is a plain (non-autodiff)
/// f32 tensor on a cubecl device.
pub fn takes<const D: usize>(tensor: &Tensor<D>) -> bool {
    enabled()
        && !tensor.is_autodiff()
        && tensor.dtype() == DType::F32
        && matches!(tensor.device().as_dispatch(), DispatchDevice::Cube(_))
}
