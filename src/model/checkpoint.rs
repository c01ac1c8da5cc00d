//! Activation checkpointing per decoder layer (`runtime.gradient_checkpointing`).
//!
//! A plain backward pass keeps, from the forward, every activation each layer's backward reads
//! (the normed inputs, the q/k/v projections, the attention's inputs and weights, the MLP's
//! gate and up products, the LoRA factors' inputs): for all layers at once. Here the forward
//! runs outside autodiff and keeps only each layer's input (the residual stream, `[rows, seq,
//! hidden]` per layer). The head (final norm, LM head, the loss) is differentiated from the
//! last layer's output; then, from the last layer down, each layer is run again on its kept
//! input with autodiff and differentiated alone: the backward of `sum(output * grad_output)`
//! gives the gradient of its input (the next layer down's `grad_output`) and of its LoRA
//! factors. At most one layer's activations are alive at a time, for one more forward pass of
//! the layers. The frozen embedding needs no gradient, so the first layer's input is not one.
//!
//! A forward may run in [`Stream`]s where a later stream attends after an earlier one's keys and
//! values (a prompt computed once and shared by the rows that continue it, copied to each of
//! them, [`crate::model::KvCache::select_rows`], or read in place by each group's rows,
//! [`crate::model::KvCache::sharing_prompts`]): each layer is then recomputed for every stream
//! together, the earlier stream's keys and values feeding the later one's attention, as in the
//! forward. Adapter dropout draws the same masks in the recomputation (the delta's random
//! stream is rewound to where each layer's forward found it).

use burn::tensor::Gradients;
use burn::tensor::{Int, Tensor};

use super::layers::ProjectionDelta;
use super::prompt_cache::GroupLayout;
use super::transformer::{AttentionLayout, CausalLm, ForwardArgs, KvCache};
use crate::error::{Result, TroupeError};

/// One batch of sequences run through the layers together.
pub struct Stream<'a> {
    /// `[rows, seq]` token ids.
    pub tokens: Tensor<2, Int>,
    /// Positions and mask of the tokens (covering the earlier stream's slots when `after`).
    pub layout: &'a AttentionLayout,
    /// The adapters' deltas, if any.
    pub delta: Option<&'a dyn ProjectionDelta>,
    /// `Some((s, how))`: this stream's rows continue rows of the earlier stream `s`, attending
    /// after their keys and values at every layer.
    pub after: Option<(usize, Continues)>,
    /// Whether the stream's final hidden states are read; `false` for a stream run only for
    /// its keys and values (its last layer then computes those alone).
    pub output: bool,
}

/// Which rows of an earlier [`Stream`] a later one's rows continue, and how they read them.
#[allow(clippy::large_enum_variant)] // one a stream, made once a micro-batch
pub enum Continues {
    /// Each row continues an earlier row, on a copy of its keys and values.
    Copied {
        /// Row `i` continues row `rows[i]`.
        rows: Vec<usize>,
        /// [`KvCache::row_index`]`(rows)`, made once for every layer (`[rows]`).
        index: Tensor<1, Int>,
    },
    /// Each row continues its group's row, read in place ([`KvCache::sharing_prompts`]; a
    /// group's prompt held once).
    Shared(GroupLayout),
}

/// What a checkpointed forward and backward produced.
pub struct Checkpointed {
    /// The head's loss.
    pub loss: f32,
    /// The gradients, one set per backward pass run (the head's, then each layer's): summed,
    /// they are the gradients of the loss. Empty when the loss is not finite (no backward ran).
    pub grads: Vec<Gradients>,
}

impl CausalLm {
    /// The loss `head` computes from the final hidden states (after the last norm) of the
    /// streams whose `output` is read, in stream order, and its gradients, with every decoder
    /// layer's activations recomputed in the backward pass instead of kept (module docs).
    pub fn checkpointed_backward(
        &self,
        streams: &[Stream<'_>],
        head: impl FnOnce(Vec<Tensor<3>>) -> Result<Tensor<1>>,
    ) -> Result<Checkpointed> {
        for stream in streams {
            let keys = stream.layout.mask.dims()[3];
            if keys > self.max_positions() {
                return Err(TroupeError::invalid(
                    "tokens",
                    format!("sequence of {keys} tokens exceeds max_position_embeddings {}", self.max_positions()),
                ));
            }
        }
        let ropes: Vec<(Tensor<4>, Tensor<4>)> = streams.iter().map(|s| self.rope_tables(s.layout)).collect();
        let untracked = streams
            .iter()
            .map(|s| match s.delta {
                Some(d) => d.untracked().map(Some).ok_or_else(|| {
                    TroupeError::invalid("runtime.gradient_checkpointing", "these adapters cannot run outside autodiff")
                }),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let untracked: Vec<Option<&dyn ProjectionDelta>> = untracked.iter().map(|d| d.as_deref()).collect();
        let tracked: Vec<Option<&dyn ProjectionDelta>> = streams.iter().map(|s| s.delta).collect();

        // The forward, outside autodiff, keeping each layer's input.
        let mut x: Vec<Option<Tensor<3>>> =
            streams.iter().map(|s| Some(self.embed_tokens.forward(s.tokens.clone()))).collect();
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut positions = Vec::with_capacity(self.layers.len());
        for layer in 0..self.layers.len() {
            let (out, seen) = self.layer_step(layer, &x, streams, &ropes, &untracked, None);
            inputs.push(std::mem::replace(&mut x, out));
            positions.push(seen);
        }
        let end: Vec<Option<u128>> = untracked.iter().map(|d| d.and_then(|d| d.random_position())).collect();

        // The head, from the last layer's output as a leaf.
        let leaves: Vec<Option<Tensor<3>>> = x
            .into_iter()
            .zip(streams)
            .map(|(x, s)| if s.output { x.map(|x| x.autodiff().require_grad()) } else { None })
            .collect();
        let hidden: Vec<Tensor<3>> = leaves.iter().flatten().map(|x| self.norm.forward(x.clone())).collect();
        let loss = head(hidden)?;
        let value = crate::readback::to_scalar(loss.clone(), crate::readback::Stage::Update)?;
        if !value.is_finite() {
            return Ok(Checkpointed { loss: value, grads: Vec::new() });
        }
        let mut grads = Vec::with_capacity(self.layers.len() + 1);
        let mut upstream: Vec<Option<Tensor<3>>> = if loss.is_tracked() {
            let mut g = loss.backward();
            let upstream = leaves.iter().map(|l| l.as_ref().and_then(|l| l.grad_remove(&mut g))).collect();
            grads.push(g);
            upstream
        } else {
            vec![None; streams.len()]
        };

        // Each layer again, from the last, differentiated alone.
        for layer in (0..self.layers.len()).rev() {
            let kept = inputs.pop().expect("one input per layer");
            let leaves: Vec<Option<Tensor<3>>> =
                kept.into_iter().map(|x| x.map(|x| if layer == 0 { x } else { x.autodiff().require_grad() })).collect();
            let (out, _) = self.layer_step(layer, &leaves, streams, &ropes, &tracked, Some(&positions[layer]));
            let surrogate = out
                .into_iter()
                .zip(&upstream)
                .filter_map(|(o, g)| Some((o?, g.clone()?)))
                .map(|(o, g)| (o * g).sum())
                .reduce(|a, b| a + b);
            upstream = vec![None; streams.len()];
            let Some(surrogate) = surrogate.filter(|s| s.is_tracked()) else { continue };
            let mut g = surrogate.backward();
            if layer > 0 {
                upstream = leaves.iter().map(|l| l.as_ref().and_then(|l| l.grad_remove(&mut g))).collect();
            }
            grads.push(g);
        }
        // Leave the random streams where the forward left them.
        for (delta, end) in untracked.iter().zip(end) {
            if let (Some(delta), Some(end)) = (delta, end) {
                delta.rewind(end);
            }
        }
        Ok(Checkpointed { loss: value, grads })
    }

    /// Decoder layer `layer` over every stream (`x[s]`, `None` for a stream that has ended),
    /// in order, each later stream attending after the earlier stream it continues. Returns the
    /// outputs (`None` for a stream whose hidden states end here) and where each delta's random
    /// stream stood before its stream ran; `rewind` sets those positions first.
    #[allow(clippy::type_complexity)]
    fn layer_step(
        &self,
        layer: usize,
        x: &[Option<Tensor<3>>],
        streams: &[Stream<'_>],
        ropes: &[(Tensor<4>, Tensor<4>)],
        deltas: &[Option<&dyn ProjectionDelta>],
        rewind: Option<&Vec<Option<u128>>>,
    ) -> (Vec<Option<Tensor<3>>>, Vec<Option<u128>>) {
        let last = layer + 1 == self.layers.len();
        let mut caches: Vec<Option<KvCache>> = vec![None; streams.len()];
        let mut out = Vec::with_capacity(streams.len());
        let mut seen = Vec::with_capacity(streams.len());
        for (s, stream) in streams.iter().enumerate() {
            let delta = deltas[s];
            if let (Some(d), Some(Some(at))) = (delta, rewind.map(|r| r[s])) {
                d.rewind(at);
            }
            seen.push(delta.and_then(|d| d.random_position()));
            let Some(input) = x[s].clone() else {
                out.push(None);
                continue;
            };
            let read_later = streams[s + 1..].iter().any(|t| t.after.as_ref().is_some_and(|(e, _)| *e == s));
            let mut cache = match &stream.after {
                Some((earlier, Continues::Copied { rows, index })) => caches[*earlier].clone().map(|mut c| {
                    c.select_rows_by(rows, index);
                    c
                }),
                Some((earlier, Continues::Shared(groups))) => {
                    caches[*earlier].clone().map(|c| KvCache::sharing_layers_of(c, groups.clone()))
                }
                None => read_later.then(|| KvCache::new(self.layers.len())),
            };
            let rope = (&ropes[s].0, &ropes[s].1);
            let mut args = ForwardArgs { layout: stream.layout, cache: cache.as_mut(), delta };
            let decoder = &self.layers[layer];
            if last && !stream.output {
                decoder.fill_cache(input.into(), layer, rope, &mut args);
                out.push(None);
            } else {
                out.push(Some(decoder.forward(input, layer, rope, &mut args)));
            }
            caches[s] = cache;
        }
        (out, seen)
    }
}
