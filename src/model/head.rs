//! The LM head's log-probabilities of target tokens: `log softmax(x W^T)[target]` per row, the
//! scorer's last step, run over the vocabulary a chunk of rows at a time.
//!
//! Differentiated through burn's autodiff, every chunk's vocabulary-wide logits (or their
//! exponentials) would be kept for the backward, `rows x vocab` f32 in all: 1.2 GB for 2048
//! reply tokens of a Qwen3 vocabulary, per micro-batch, and the backward would make several more
//! tensors of that size. Here, when `x` is tracked, the forward runs outside autodiff and, per
//! chunk, computes beside each row's log-probability its gradient with respect to the row:
//! `direction = (1[v = t] - softmax(x W^T)[v]) W` (`[rows, hidden]`;
//! [`token_logprobs_and_complement`], then [`dense_linear_backward`], the product the backward
//! would make). The result joins the graph as `logprob + (s - detach(s))` with `s = sum x *
//! direction` over the hidden dimension: its value is exactly the log-probability (`s - s` is
//! 0) and the gradient it gives `x` is `g * direction`, the backward of burn's composite with
//! each row's factor `g` applied after the product instead of before. Nothing vocabulary-wide
//! outlives its chunk, and the FLOPs are the composite's, the backward's product moved into the
//! forward.

use burn::tensor::{Device, Tensor};

use super::fused::linear::dense_linear_backward;
use super::fused::token_logprob::token_logprobs_and_complement;
use super::fused::token_logprobs;
use super::layers::{FrozenLinear, LinearWeight};

/// Logit elements (rows x vocabulary) per chunk on the CPU: large enough for efficient GEMMs,
/// small enough that the log-softmax's temporaries stay near the caches.
const CPU_CHUNK_ELEMENTS: usize = 8 << 20;

/// Logit elements per chunk on a GPU: products of a few hundred rows by a Qwen3 vocabulary
/// (128 MB of f32 logits per temporary), where the CPU's chunk would be 55 rows.
const GPU_CHUNK_ELEMENTS: usize = 32 << 20;

/// Rows per chunk for a vocabulary of `vocab` on `device`.
fn chunk_rows(vocab: usize, device: &Device) -> usize {
    let elements = if *device == Device::flex() { CPU_CHUNK_ELEMENTS } else { GPU_CHUNK_ELEMENTS };
    (elements / vocab.max(1)).max(1)
}

/// `log softmax(head(x))[targets[r]]` for each row `r` of `x`, differentiable in `x`: without a
/// vocabulary-wide tensor kept for the backward when `x` is tracked and the head is a dense
/// projection without bias (the module docs), through the head and
/// [`token_logprobs`] otherwise.
///
/// # Shapes
/// `x`: `[rows, hidden]`, `targets`: one id below the vocabulary per row -> `[rows]`
pub fn head_logprobs(head: &FrozenLinear, x: Tensor<2>, targets: &[u32]) -> Tensor<1> {
    let [rows, _] = x.dims();
    assert_eq!(rows, targets.len(), "head_logprobs: one target per row");
    if rows == 0 {
        return Tensor::zeros([0], &x.device());
    }
    let chunk = chunk_rows(head.dims()[0], &x.device());
    let starts = (0..rows).step_by(chunk).map(|start| (start, chunk.min(rows - start)));
    let weight = match (&head.weight, &head.bias) {
        (LinearWeight::Dense(weight), None) if x.is_tracked() => weight,
        _ => {
            let parts: Vec<Tensor<1>> = starts
                .map(|(start, n)| {
                    token_logprobs(head.forward_2d(x.clone().narrow(0, start, n)), &targets[start..start + n])
                })
                .collect();
            return join(parts);
        }
    };
    let plain = x.clone().without_autodiff();
    let (logprobs, mut directions): (Vec<Tensor<1>>, Vec<Tensor<2>>) = starts
        .map(|(start, n)| {
            let logits = head.forward_2d(plain.clone().narrow(0, start, n));
            let (logprobs, complement) = token_logprobs_and_complement(logits, &targets[start..start + n]);
            (logprobs, dense_linear_backward(complement, weight))
        })
        .unzip();
    let direction = if directions.len() == 1 { directions.remove(0) } else { Tensor::cat(directions, 0) };
    let s = (x * direction).sum_dim(1).reshape([rows]);
    (s.clone() - s.detach()) + join(logprobs)
}

/// The chunks' values in order.
fn join(mut parts: Vec<Tensor<1>>) -> Tensor<1> {
    if parts.len() == 1 {
        parts.remove(0)
    } else {
        Tensor::cat(parts, 0)
    }
}
