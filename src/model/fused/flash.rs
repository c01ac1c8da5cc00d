//! Flash attention on CUDA (`runtime.attention: flash`): burn-cubecl's flash kernel, called
//! directly, for a forward without gradients.
//!
//! burn's own `attention` reaches this kernel only through its autotuner, which troupe keeps off
//! (`docs/gpu.md`); without it burn runs the materialized fallback. burn-cubecl's kernel entry
//! is public, so the tensors are taken to their cubecl primitives (burn-dispatch's `Cube`
//! backend) and the kernel is launched with cubek's `unit` routine: f32 tiles, accumulators and
//! softmax (the `blackbox_accelerated` routine multiplies f16 tiles on the tensor cores, which
//! would break the f32 attention of DESIGN.md, and needs the queries in whole stages, which a
//! decoding step's are not).
//!
//! What the kernel takes (cubek-attention 0.3.1): queries, keys, values `[batch, heads, rows,
//! head_dim]` with the keys and values on as many heads as the queries or one (each reader
//! offsets by the query's head, and a size-1 head dimension is broadcast:
//! `components/global/layout.rs`), so grouped-query heads are folded into the query rows first
//! (`fused::attention`'s `fold_query_heads`); a mask of any numeric type, nonzero where a key
//! is hidden (burn's booleans; `multi_level/tile/variants/unit.rs` of cubek-matmul), its head
//! dimension broadcast; scale `1 / sqrt(head_dim)`; a row that sees no key gets zeros
//! (`variants/row_wise.rs`, `recip_inplace`), as the materialized kernel gives. A shape the
//! routine cannot tile, or a device it cannot run on, gets the materialized kernel instead and
//! the reason ([`FlashRefusal`]).

use burn::tensor::{Bool, Tensor};

use super::attention::grouped_attention;

/// Why [`grouped_flash_attention`] ran the materialized kernel instead of the flash kernel.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlashRefusal {
    /// troupe was built without a GPU backend (the `cuda` feature).
    #[error("troupe was built without the `cuda` feature")]
    NotBuilt,
    /// The tensors are not plain (non-autodiff) tensors on a cubecl device.
    #[error("the inputs are not plain tensors on a GPU")]
    NotOnGpu,
    /// The kernel refused the launch: a shape its routine cannot tile, or a missing device feature.
    #[error("{0}")]
    Launch(String),
}

/// Masked grouped-query attention (scale `1 / sqrt(head_dim)`) by burn-cubecl's flash kernel,
/// the query heads of each key/value head folded into its rows
/// (`fused::attention`'s `fold_query_heads`); where the flash kernel cannot run, the materialized
/// kernel ([`grouped_attention`]) and the reason.
///
/// # Shapes
/// `q`: `[batch, heads, seq, head_dim]`, `k`/`v`: `[batch, kv_heads, keys, head_dim]`, `mask`:
/// `[batch, 1, seq, keys]` (`true`: hidden) -> `[batch, heads, seq, head_dim]`
pub fn grouped_flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &Tensor<4, Bool>,
) -> (Tensor<4>, Option<FlashRefusal>) {
    #[cfg(feature = "cuda")]
    if cube::plain_on_cube([&q, &k, &v]) {
        let mut refusal = None;
        let out = super::attention::fold_query_heads(q, k, v, |q, k, v, group| {
            let (out, refused) = cube::flash(q, k, v, super::attention::folded_mask(mask, group));
            refusal = refused;
            out
        });
        return (out, refusal);
    }
    let refusal = if cfg!(feature = "cuda") { FlashRefusal::NotOnGpu } else { FlashRefusal::NotBuilt };
    (grouped_attention(q, k, v, mask), Some(refusal))
}

/// The cubecl side, in builds with a GPU backend.
#[cfg(feature = "cuda")]
mod cube {
    use burn::backend::ops::attention::attention_fallback;
    use burn::backend::{Cube, DispatchDevice};
    use burn::tensor::{Bool, Tensor};
    use burn_cubecl::kernel::attention::flash_attention;
    use burn_cubecl::kernel::into_contiguous;
    use cubek::attention::forward::launch::{BlueprintStrategy, Strategy};

    use super::super::attention::OPTIONS;
    use super::FlashRefusal;

    /// Whether every tensor is a plain (non-autodiff) tensor on a cubecl device (CUDA in this
    /// build).
    pub(super) fn plain_on_cube(tensors: [&Tensor<4>; 3]) -> bool {
        tensors.into_iter().all(|t| !t.is_autodiff() && matches!(t.device().as_dispatch(), DispatchDevice::Cube(_)))
    }

    /// One flash launch over heads that need no folding, or burn's materialized kernel on the
    /// same primitives (and why) if the launch is refused.
    ///
    /// # Shapes
    /// `q`: `[batch, heads, rows, head_dim]`, `k`/`v`: `[batch, heads or 1, keys, head_dim]`,
    /// `mask`: `[batch, 1, rows, keys]` -> `[batch, heads, rows, head_dim]`
    pub(super) fn flash(
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        mask: Tensor<4, Bool>,
    ) -> (Tensor<4>, Option<FlashRefusal>) {
        let primitives = (
            q.clone().try_into_primitive::<Cube>(),
            k.clone().try_into_primitive::<Cube>(),
            v.clone().try_into_primitive::<Cube>(),
            mask.clone().try_into_primitive::<Cube>(),
        );
        let (Ok(q), Ok(k), Ok(v), Ok(mask)) = primitives else {
            // A mask not on the queries' plain device: burn's attention takes any.
            let out = burn::tensor::module::attention(q, k, v, Some(mask), None, OPTIONS);
            return (out, Some(FlashRefusal::NotOnGpu));
        };
        // The kernel picks its vector widths from the shapes alone, as if row-major.
        let [q, k, v, mask] = [q, k, v, mask].map(into_contiguous);
        let unit = Strategy::Unit(BlueprintStrategy::Inferred(()));
        match flash_attention(q.clone(), k.clone(), v.clone(), Some(mask.clone()), None, OPTIONS, unit) {
            Ok(out) => (Tensor::from_primitive::<Cube>(out), None),
            Err(refused) => {
                let out = attention_fallback::<Cube>(q, k, v, Some(mask), None, OPTIONS);
                let reason = refused.to_string().trim().to_string();
                (Tensor::from_primitive::<Cube>(out), Some(FlashRefusal::Launch(reason)))
            }
        }
    }
}
