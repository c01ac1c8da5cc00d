//! The SwiGLU gate `silu(gate) * up` as one parallel pass forward and one backward.
//!
//! `silu(g) = g * sigmoid(g)` with `sigmoid(g) = 1 / (1 + e^-g)`, the exponentials of a row on
//! the vectorized `exp` ([`super::vexp`]; within 2 ulp, and it saturates instead of
//! overflowing, so one formula serves both signs); the backward forms `d up = dy silu(g)` and
//! `d g = dy up (s + g s (1 - s))`. burn's composite (a sigmoid with libm's scalar `exp`, two
//! products, and the backward of each) makes about eight single-threaded passes. Values and
//! gradients agree with it within float rounding (tested).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Dispatch, Flex};
use burn::tensor::activation::silu;
use burn::tensor::{Tensor, TensorData};
use rayon::prelude::*;

use super::vexp::exp_in_place;
use super::{on_flex, par_rows, rows_per_task, with_rows, Rows};

/// `out[j] = e^-gate[j]`, vectorized.
fn exp_negated(gate: &[f32], out: &mut [f32]) {
    for (o, &g) in out.iter_mut().zip(gate) {
        *o = -g;
    }
    exp_in_place(out);
}

/// The fused SwiGLU gate, as a burn backend extension.
#[backend_extension(Autodiff, Flex)]
pub trait SwiGluBackend: burn::backend::Backend {
    /// `silu(gate) * up`.
    ///
    /// # Shapes
    /// `gate`, `up`: `[..., width]` (the same) -> `[..., width]`
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl SwiGluBackend for Flex {
    fn swiglu(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
        let shape = gate.layout().shape().clone();
        let values = with_rows(&gate, |g: &Rows<'_>| {
            with_rows(&up, |u: &Rows<'_>| {
                let mut out = vec![0.0f32; g.rows * g.width];
                par_rows(&mut out, g.width, |r, row| {
                    let (g_row, u_row) = (g.row(r), u.row(r));
                    exp_negated(g_row, row);
                    for ((o, &gv), &uv) in row.iter_mut().zip(g_row).zip(u_row) {
                        *o = (gv / (1.0 + *o)) * uv;
                    }
                });
                out
            })
        });
        FlexTensor::from_data(TensorData::new(values, shape.as_slice().to_vec()))
    }
}

/// The backward of [`SwiGluBackend::swiglu`]: gradients for the gate and for `up`.
#[derive(Debug)]
struct SwiGluBackward;

impl Backward<Flex, 2> for SwiGluBackward {
    /// The forward's inputs.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let (gate, up) = ops.state;
        let shape = gate.layout().shape().as_slice().to_vec();
        let (d_gate, d_up) = with_rows(&gate, |g: &Rows<'_>| {
            with_rows(&up, |u: &Rows<'_>| {
                with_rows(&grad, |d: &Rows<'_>| {
                    let width = g.width;
                    let mut d_gate = vec![0.0f32; g.rows * width];
                    let mut d_up = vec![0.0f32; g.rows * width];
                    let tasks = width * rows_per_task(width);
                    d_gate.par_chunks_mut(tasks).zip(d_up.par_chunks_mut(tasks)).enumerate().for_each(
                        |(task, (dg_chunk, du_chunk))| {
                            let first = task * rows_per_task(width);
                            let rows = dg_chunk.chunks_exact_mut(width).zip(du_chunk.chunks_exact_mut(width));
                            for (i, (dg_row, du_row)) in rows.enumerate() {
                                let (g_row, u_row, d_row) = (g.row(first + i), u.row(first + i), d.row(first + i));
                                exp_negated(g_row, dg_row);
                                for j in 0..width {
                                    let (gv, uv, dv) = (g_row[j], u_row[j], d_row[j]);
                                    let s = 1.0 / (1.0 + dg_row[j]);
                                    // out = silu * up, with silu = g * s.
                                    let d_silu = dv * uv;
                                    du_row[j] = dv * (gv * s);
                                    // silu = g * s: the gate directly, and through the sigmoid.
                                    let d_s = d_silu * gv;
                                    dg_row[j] = d_silu * s + d_s * s * (1.0 - s);
                                }
                            }
                        },
                    );
                    (d_gate, d_up)
                })
            })
        });
        let tensor = |values: Vec<f32>| FlexTensor::from_data(TensorData::new(values, shape.clone()));
        if let Some(node) = node_gate {
            grads.register::<Flex>(node.id, tensor(d_gate));
        }
        if let Some(node) = node_up {
            grads.register::<Flex>(node.id, tensor(d_up));
        }
    }
}

impl<C: CheckpointStrategy> SwiGluBackend for Autodiff<Flex, C> {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        match SwiGluBackward.prepare::<C>([gate.node(), up.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (g, u) = (gate.primitive().clone(), up.primitive().clone());
                let out = Flex::swiglu(g.clone(), u.clone());
                prep.finish((g, u), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::swiglu(gate.into_primitive(), up.into_primitive())),
        }
    }
}

/// `silu(gate) * up`: fused on the CPU, burn's composite elsewhere; the same values within
/// float rounding.
///
/// # Shapes
/// `gate`, `up`: `[..., width]` (the same) -> `[..., width]`
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    if !on_flex(&gate) || gate.dims() != up.dims() {
        return silu(gate) * up;
    }
    Tensor::from_dispatch(<Dispatch as SwiGluBackend>::swiglu(gate.into_dispatch(), up.into_dispatch()))
}
