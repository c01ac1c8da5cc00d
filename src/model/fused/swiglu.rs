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
use burn::tensor::{DType, Tensor, TensorData};
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

/// `out = silu(gate) * up` for one row.
fn swiglu_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    exp_negated(gate, out);
    for ((o, &gv), &uv) in out.iter_mut().zip(gate).zip(up) {
        *o = (gv / (1.0 + *o)) * uv;
    }
}

/// One row's gradients: `d_gate` and `d_up` from the output's gradient `d_out`.
fn swiglu_row_backward(gate: &[f32], up: &[f32], d_out: &[f32], d_gate: &mut [f32], d_up: &mut [f32]) {
    exp_negated(gate, d_gate);
    for j in 0..gate.len() {
        let (gv, uv, dv) = (gate[j], up[j], d_out[j]);
        let s = 1.0 / (1.0 + d_gate[j]);
        // out = silu * up, with silu = g * s.
        let d_silu = dv * uv;
        d_up[j] = dv * (gv * s);
        // silu = g * s: the gate directly, and through the sigmoid.
        let d_s = d_silu * gv;
        d_gate[j] = d_silu * s + d_s * s * (1.0 - s);
    }
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
                par_rows(&mut out, g.width, |r, row| swiglu_row(g.row(r), u.row(r), row));
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
                                let r = first + i;
                                swiglu_row_backward(g.row(r), u.row(r), d.row(r), dg_row, du_row);
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

/// `silu(gate) * up`: fused on the CPU, one kernel on a GPU without gradients
/// ([`super::gpu::swiglu`], burn's formula), burn's composite elsewhere; the same values within
/// float rounding.
///
/// # Shapes
/// `gate`, `up`: `[..., width]` (the same) -> `[..., width]`
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if gate.dims() == up.dims() && [&gate, &up].into_iter().all(super::gpu::takes) {
        return super::gpu::swiglu(gate, up);
    }
    if !on_flex(&gate) || gate.dims() != up.dims() {
        return silu(gate) * up;
    }
    Tensor::from_dispatch(<Dispatch as SwiGluBackend>::swiglu(gate.into_dispatch(), up.into_dispatch()))
}

/// The inputs of one stacked call: the stacked gate/up projection's output and, when adapters
/// apply, their deltas to the gate and to `up`.
#[derive(Clone, Debug)]
struct StackedInputs {
    gate_up: FlexTensor,
    deltas: Option<(FlexTensor, FlexTensor)>,
}

/// [`StackedInputs`] seen as rows: the stacked output's, and the deltas' when present.
struct StackedRows<'a> {
    gate_up: &'a Rows<'a>,
    deltas: Option<(&'a Rows<'a>, &'a Rows<'a>)>,
}

impl StackedInputs {
    /// Runs `f` over the inputs as rows (each copied first if its layout is not rows).
    fn with_rows<R>(&self, f: impl FnOnce(&StackedRows<'_>) -> R) -> R {
        with_rows(&self.gate_up, |gate_up: &Rows<'_>| match &self.deltas {
            None => f(&StackedRows { gate_up, deltas: None }),
            Some((gate, up)) => with_rows(gate, |gate: &Rows<'_>| {
                with_rows(up, |up: &Rows<'_>| f(&StackedRows { gate_up, deltas: Some((gate, up)) }))
            }),
        })
    }

    /// `[gate + delta_gate, up + delta_up]`, shaped as the stacked output.
    fn summed(&self) -> FlexTensor {
        let shape = self.gate_up.layout().shape().as_slice().to_vec();
        let values = self.with_rows(|rows| {
            let width = rows.width();
            let mut summed = vec![0.0f32; rows.gate_up.rows * 2 * width];
            par_rows(&mut summed, 2 * width, |r, row| {
                let (gate, up) = row.split_at_mut(width);
                rows.gate_up_row(r, gate, up);
            });
            summed
        });
        FlexTensor::from_data(TensorData::new(values, shape))
    }

    /// The shape of the output (and of each delta): the stacked shape, half as wide.
    fn half_shape(&self) -> Vec<usize> {
        let mut shape = self.gate_up.layout().shape().as_slice().to_vec();
        if let Some(last) = shape.last_mut() {
            *last /= 2;
        }
        shape
    }
}

impl StackedRows<'_> {
    /// The gate's (and `up`'s) width.
    fn width(&self) -> usize {
        self.gate_up.width / 2
    }

    /// Row `r`'s gate and `up` into `gate` and `up`: the stacked output's halves, plus the
    /// deltas when present (the same sums as adding the deltas to the narrowed halves).
    fn gate_up_row(&self, r: usize, gate: &mut [f32], up: &mut [f32]) {
        let (row, width) = (self.gate_up.row(r), self.width());
        let (stacked_gate, stacked_up) = row.split_at(width);
        match self.deltas {
            None => {
                gate.copy_from_slice(stacked_gate);
                up.copy_from_slice(stacked_up);
            }
            Some((delta_gate, delta_up)) => {
                for ((g, &s), &d) in gate.iter_mut().zip(stacked_gate).zip(delta_gate.row(r)) {
                    *g = s + d;
                }
                for ((u, &s), &d) in up.iter_mut().zip(stacked_up).zip(delta_up.row(r)) {
                    *u = s + d;
                }
            }
        }
    }

    /// `silu(gate) * up` for every row: `[rows, width]`.
    fn forward(&self) -> Vec<f32> {
        let width = self.width();
        let per_task = rows_per_task(width);
        let mut out = vec![0.0f32; self.gate_up.rows * width];
        out.par_chunks_mut(width * per_task).enumerate().for_each_init(
            || vec![0.0f32; 2 * width],
            |scratch, (task, chunk)| {
                let (gate, up) = scratch.split_at_mut(width);
                for (i, row) in chunk.chunks_exact_mut(width).enumerate() {
                    self.gate_up_row(task * per_task + i, gate, up);
                    swiglu_row(gate, up, row);
                }
            },
        );
        out
    }

    /// The gradient of the stacked output, `[rows, 2 width]` (the gate's, then `up`'s), from
    /// the output's gradient `d_out`; it is also each delta's (that half of it).
    fn backward(&self, d_out: &Rows<'_>) -> Vec<f32> {
        let width = self.width();
        let per_task = rows_per_task(2 * width);
        let mut d_stacked = vec![0.0f32; self.gate_up.rows * 2 * width];
        d_stacked.par_chunks_mut(2 * width * per_task).enumerate().for_each_init(
            || vec![0.0f32; 2 * width],
            |scratch, (task, chunk)| {
                let (gate, up) = scratch.split_at_mut(width);
                for (i, d_row) in chunk.chunks_exact_mut(2 * width).enumerate() {
                    let r = task * per_task + i;
                    self.gate_up_row(r, gate, up);
                    let (d_gate, d_up) = d_row.split_at_mut(width);
                    swiglu_row_backward(gate, up, d_out.row(r), d_gate, d_up);
                }
            },
        );
        d_stacked
    }
}

/// Half of each row of `stacked` (`[rows, 2 width]`): the first half, or the second.
fn half(stacked: &[f32], width: usize, second: bool) -> Vec<f32> {
    let start = if second { width } else { 0 };
    let mut out = Vec::with_capacity(stacked.len() / 2);
    for row in stacked.chunks_exact(2 * width) {
        out.extend_from_slice(&row[start..start + width]);
    }
    out
}

/// The SwiGLU gate on a stacked gate/up projection, as a burn backend extension: the gate and
/// `up` are read from their halves of the stacked output, so the backward writes one stacked
/// gradient (burn's `narrow` would zero a stacked-width gradient per half and add them).
#[backend_extension(Autodiff, Flex)]
pub trait StackedSwiGluBackend: burn::backend::Backend {
    /// `silu(gate) * up` with `[gate, up] = gate_up` along the last dimension.
    ///
    /// # Shapes
    /// `gate_up`: `[..., 2 width]` -> `[..., width]`
    fn swiglu_stacked(gate_up: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `silu(gate + delta_gate) * (up + delta_up)` with `[gate, up] = gate_up`.
    ///
    /// # Shapes
    /// `gate_up`: `[..., 2 width]`, `delta_gate`, `delta_up`: `[..., width]` -> `[..., width]`
    fn swiglu_stacked_delta(
        gate_up: FloatTensor<Self>,
        delta_gate: FloatTensor<Self>,
        delta_up: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// The forward of either stacked call, as a tensor.
fn stacked_forward(inputs: &StackedInputs) -> FlexTensor {
    let out = inputs.with_rows(|rows| rows.forward());
    FlexTensor::from_data(TensorData::new(out, inputs.half_shape()))
}

impl StackedSwiGluBackend for Flex {
    fn swiglu_stacked(gate_up: FlexTensor) -> FlexTensor {
        stacked_forward(&StackedInputs { gate_up, deltas: None })
    }

    fn swiglu_stacked_delta(gate_up: FlexTensor, delta_gate: FlexTensor, delta_up: FlexTensor) -> FlexTensor {
        stacked_forward(&StackedInputs { gate_up, deltas: Some((delta_gate, delta_up)) })
    }
}

/// The stacked gradient of a stacked call, from its output's gradient `grad`.
fn stacked_backward(inputs: &StackedInputs, grad: &FlexTensor) -> Vec<f32> {
    inputs.with_rows(|rows| with_rows(grad, |d_out: &Rows<'_>| rows.backward(d_out)))
}

/// The backward of [`StackedSwiGluBackend::swiglu_stacked`].
#[derive(Debug)]
struct StackedSwiGluBackward;

impl Backward<Flex, 1> for StackedSwiGluBackward {
    type State = StackedInputs;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_gate_up] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        if let Some(node) = node_gate_up {
            let shape = ops.state.gate_up.layout().shape().as_slice().to_vec();
            let d_stacked = stacked_backward(&ops.state, &grad);
            grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(d_stacked, shape)));
        }
    }
}

/// The backward of [`StackedSwiGluBackend::swiglu_stacked_delta`].
#[derive(Debug)]
struct StackedSwiGluDeltaBackward;

impl Backward<Flex, 3> for StackedSwiGluDeltaBackward {
    type State = StackedInputs;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_gate, node_gate_up, node_up] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let inputs = ops.state;
        let d_stacked = stacked_backward(&inputs, &grad);
        let half_shape = inputs.half_shape();
        let width = half_shape.last().copied().unwrap_or(0);
        for (node, second) in [(node_gate, false), (node_up, true)] {
            if let Some(node) = node {
                let values = half(&d_stacked, width, second);
                grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(values, half_shape.clone())));
            }
        }
        if let Some(node) = node_gate_up {
            let shape = inputs.gate_up.layout().shape().as_slice().to_vec();
            grads.register::<Flex>(node.id, FlexTensor::from_data(TensorData::new(d_stacked, shape)));
        }
    }
}

impl<C: CheckpointStrategy> StackedSwiGluBackend for Autodiff<Flex, C> {
    fn swiglu_stacked(gate_up: FloatTensor<Self>) -> FloatTensor<Self> {
        match StackedSwiGluBackward.prepare::<C>([gate_up.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let inputs = StackedInputs { gate_up: gate_up.primitive().clone(), deltas: None };
                let out = stacked_forward(&inputs);
                prep.finish(inputs, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::swiglu_stacked(gate_up.into_primitive())),
        }
    }

    fn swiglu_stacked_delta(
        gate_up: FloatTensor<Self>,
        delta_gate: FloatTensor<Self>,
        delta_up: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // burn runs the backward steps of one graph depth in the order of its depth-first walk
        // from the loss, which takes a node's last parent first. With the stacked output between
        // the deltas, the walk meets the three products that feed the input's gradient (`up`'s
        // delta, the stacked projection, the gate's delta) in the order it met them when the
        // halves were narrowed and added to their deltas, so the input's gradient sums them in
        // the same order, bit for bit.
        let parents = [delta_gate.node(), gate_up.node(), delta_up.node()];
        match StackedSwiGluDeltaBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                // The backward keeps the sums (as wide as the stacked output), not the stacked
                // output and both deltas.
                let deltas = Some((delta_gate.primitive().clone(), delta_up.primitive().clone()));
                let inputs = StackedInputs { gate_up: gate_up.primitive().clone(), deltas };
                let summed = StackedInputs { gate_up: inputs.summed(), deltas: None };
                let out = stacked_forward(&summed);
                prep.finish(summed, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::swiglu_stacked_delta(
                gate_up.into_primitive(),
                delta_gate.into_primitive(),
                delta_up.into_primitive(),
            )),
        }
    }
}

/// `silu(gate) * up` where `[gate, up]` are the halves of a stacked projection's output along
/// the last dimension, each plus its adapter delta when given (a missing one counts as zero).
/// Fused on the CPU (the same values as [`swiglu`] on the narrowed halves plus their deltas);
/// on a GPU under autodiff one kernel each way ([`super::gpu::swiglu_stacked_tracked`]), without
/// gradients [`swiglu`]'s kernel on the halves read in place; burn's composite elsewhere.
///
/// # Shapes
/// `gate_up`: `[..., 2 width]`, `delta_gate`, `delta_up`: `[..., width]` -> `[..., width]`
pub fn swiglu_stacked<const D: usize>(
    gate_up: Tensor<D>,
    delta_gate: Option<Tensor<D>>,
    delta_up: Option<Tensor<D>>,
) -> Tensor<D> {
    swiglu_stacked_rounded(gate_up, delta_gate, delta_up, None).0
}

/// [`swiglu_stacked`], and given `round` (the half precision of the frozen product the gate
/// feeds, [`crate::model::layers::FrozenLinear::input_rounding`]) its output rounded to it,
/// written by the gate's kernel on a GPU without gradients; `None` for it elsewhere (the product
/// then rounds the output itself).
///
/// # Shapes
/// `gate_up`: `[..., 2 width]`, `delta_gate`, `delta_up`: `[..., width]` -> `[..., width]` each
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
pub fn swiglu_stacked_rounded<const D: usize>(
    gate_up: Tensor<D>,
    delta_gate: Option<Tensor<D>>,
    delta_up: Option<Tensor<D>>,
    round: Option<DType>,
) -> (Tensor<D>, Option<Tensor<D>>) {
    let mut half_dims = gate_up.dims();
    half_dims[D - 1] /= 2;
    let width = half_dims[D - 1];
    let fits = |t: &Option<Tensor<D>>| t.as_ref().is_none_or(|t| t.dims() == half_dims && t.dtype() == DType::F32);
    let shapes_fit = gate_up.dims()[D - 1] == 2 * width && fits(&delta_gate) && fits(&delta_up);
    let fused = on_flex(&gate_up) && gate_up.dtype() == DType::F32 && shapes_fit;
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if shapes_fit && super::gpu::takes_tracked(&gate_up) {
        if let Some(out) = super::gpu::swiglu_stacked_tracked(&gate_up, delta_gate.as_ref(), delta_up.as_ref()) {
            return (out, None);
        }
    }
    if !fused {
        let gate = gate_up.clone().narrow(D - 1, 0, width);
        let up = gate_up.narrow(D - 1, width, width);
        let gate = match delta_gate {
            Some(d) => gate + d,
            None => gate,
        };
        let up = match delta_up {
            Some(d) => up + d,
            None => up,
        };
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if gate.dims() == up.dims() && [&gate, &up].into_iter().all(super::gpu::takes) {
            return super::gpu::swiglu_rounded(gate, up, round);
        }
        return (swiglu(gate, up), None);
    }
    let out = match (delta_gate, delta_up) {
        (None, None) => <Dispatch as StackedSwiGluBackend>::swiglu_stacked(gate_up.into_dispatch()),
        (gate, up) => {
            let device = gate_up.device();
            let zeros = || Tensor::<D>::zeros(half_dims, &device);
            <Dispatch as StackedSwiGluBackend>::swiglu_stacked_delta(
                gate_up.into_dispatch(),
                gate.unwrap_or_else(zeros).into_dispatch(),
                up.unwrap_or_else(zeros).into_dispatch(),
            )
        }
    };
    (Tensor::from_dispatch(out), None)
}
