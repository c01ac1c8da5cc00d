//! The decoder-only transformer shared by Llama, Qwen2 and Qwen3: embedding, N layers of
//! (RMSNorm, grouped-query attention with RoPE, RMSNorm, SwiGLU MLP), final norm, LM head.
//!
//! The base is frozen: its tensors are plain tensors that never require a gradient. Everything
//! that differs per call (token positions, the attention mask, the KV cache, which adapter each
//! row uses) is passed in, so one model serves many sequences and many agents at once.

use std::sync::Arc;

use burn::tensor::{Bool, DType, Device, FloatDType, Int, Tensor, TensorData};

use super::attention_kernel::AttentionKernel;
use super::config::{ModelConfig, ModelType};
use super::fused::attention::in_dtype;
use super::fused::{add_rms_norm_rounded, attention_rounded, swiglu_stacked_rounded, HostMask};
use super::kv_cache_dtype::KvCacheDtype;
use super::layers::{FrozenLinear, LinearWeight, Projection, ProjectionDelta, RmsNorm, RotaryEmbedding, WeightLoader};
use super::prompt_cache::{self, GroupLayout, PromptCache, SharedPrompt};
use super::quant::{self, BaseFormat, QuantizedWeight, TokenEmbedding};
use super::weights::WeightSource;
use crate::error::{Result, TroupeError};

/// Where each row's tokens sit for one forward call: their RoPE positions and which keys each
/// query may attend to (causal, padding excluded). Built by [`SequenceLayout::step`].
#[derive(Clone, Debug)]
pub struct AttentionLayout {
    /// `[batch, seq]`: the position of every new token within its own sequence.
    pub positions: Tensor<2, Int>,
    /// `[batch, 1, seq, keys]`: `true` where a query must NOT see a key.
    pub mask: Tensor<4, Bool>,
    /// The same mask on the host, for the CPU's fused attention.
    pub host_mask: Arc<HostMask>,
}

impl AttentionLayout {
    /// The layout of `positions` (`[batch, seq]`) and `hidden` (`[batch, seq, keys]`, row-major;
    /// `true` where a query must NOT see a key).
    pub fn new(positions: Vec<i64>, hidden: Vec<bool>, [batch, seq, keys]: [usize; 3], device: &Device) -> Self {
        let host_mask = Arc::new(HostMask::new(hidden, [batch, seq, keys]));
        Self {
            positions: Tensor::from_data(TensorData::new(positions, [batch, seq]), device),
            mask: host_mask.tensor(device),
            host_mask,
        }
    }
}

/// Tracks, per batch row, which slots of the (cached) sequence hold real tokens, so that rows of
/// different lengths can share one batch (left padding) and one KV cache.
#[derive(Clone, Debug, Default)]
pub struct SequenceLayout {
    /// Per row: whether each slot so far is a real token (`false` for padding).
    valid: Vec<Vec<bool>>,
}

impl SequenceLayout {
    /// An empty layout for `batch` rows.
    pub fn new(batch: usize) -> Self {
        Self { valid: vec![Vec::new(); batch] }
    }

    /// Number of slots (cached plus appended) per row.
    pub fn len(&self) -> usize {
        self.valid.first().map_or(0, Vec::len)
    }

    /// Whether no slot has been appended yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of real tokens of each row so far.
    pub fn real_lengths(&self) -> Vec<usize> {
        self.valid.iter().map(|row| row.iter().filter(|v| **v).count()).collect()
    }

    /// Appends `new_valid[row].len()` slots to every row, as [`SequenceLayout::step`] does,
    /// without building a forward's layout: for slots whose keys and values another forward
    /// computed (a prompt prefilled once for several rows, [`KvCache::select_rows`]).
    pub fn extend(&mut self, new_valid: &[Vec<bool>]) {
        for (row, fresh) in self.valid.iter_mut().zip(new_valid) {
            row.extend_from_slice(fresh);
        }
    }

    /// Appends `new_valid[row].len()` slots to every row (all rows the same count) and returns
    /// the attention layout for a forward over exactly those new slots.
    pub fn step(&mut self, new_valid: &[Vec<bool>], device: &Device) -> AttentionLayout {
        let keys = self.len() + new_valid.first().map_or(0, Vec::len);
        self.step_within(new_valid, keys, device)
    }

    /// [`SequenceLayout::step`] for a cache that presents `keys` slots to attention, at least
    /// the slots so far: the slots past them (a reserved cache's unwritten room,
    /// [`KvCache::with_capacity`]) are masked.
    pub fn step_within(&mut self, new_valid: &[Vec<bool>], keys: usize, device: &Device) -> AttentionLayout {
        let batch = self.valid.len();
        let seq = new_valid.first().map_or(0, Vec::len);
        let past = self.len();
        debug_assert!(keys >= past + seq, "the keys cover every slot");
        let mut positions = Vec::with_capacity(batch * seq);
        let mut mask = Vec::with_capacity(batch * seq * keys);
        for (row, fresh) in self.valid.iter_mut().zip(new_valid) {
            debug_assert_eq!(fresh.len(), seq, "every row appends the same number of slots");
            let mut real_before = row.iter().filter(|v| **v).count();
            row.extend_from_slice(fresh);
            for (i, &is_real) in fresh.iter().enumerate() {
                positions.push(if is_real { real_before as i64 } else { 0 });
                real_before += usize::from(is_real);
                let query_slot = past + i;
                mask.extend((0..keys).map(|key| key > query_slot || !row.get(key).copied().unwrap_or(false)));
            }
        }
        AttentionLayout::new(positions, mask, [batch, seq, keys], device)
    }
}

/// Cached keys and values of every layer, grown by each forward call that is given it.
///
/// A cache made by [`KvCache::new`] concatenates each call's keys and values to the past ones
/// (differentiable; what scoring uses). One made by [`KvCache::with_capacity`] reserves room
/// and writes each call's slots in place (generation: no copy of the whole cache per token),
/// presenting attention all its room ([`KvCache::keys_after`]); the caller masks the unwritten
/// slots ([`SequenceLayout::step_within`]). One made by [`KvCache::sharing_prompts`] holds the
/// prompts its rows share once per group before each row's own slots
/// ([`super::prompt_cache`]).
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    /// Per layer: keys and values, each `[batch, kv_heads, slots, head_dim]` (`slots` is the
    /// room when reserved, else the cached length).
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    /// Per layer: slots written so far.
    filled: Vec<usize>,
    /// Slots to reserve at the first write, when writing in place.
    capacity: Option<usize>,
    /// The prompts the rows share, before every row's own slots.
    prompt: Option<SharedPrompt>,
    /// The element type a reserved room (and a shared prompt) is held in, when not its keys'
    /// ([`KvCache::holding`]).
    dtype: Option<DType>,
}

impl KvCache {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self { layers: vec![None; num_layers], filled: vec![0; num_layers], capacity: None, prompt: None, dtype: None }
    }

    /// The cache with its reserved room and shared prompt (if any) held in `dtype`, when given
    /// (a GPU's half-precision cache, [`CausalLm::cache_dtype`]): each step's keys and values
    /// are cast to it as they are written and widened back to f32 as attention reads them. A
    /// cache that appends ([`KvCache::new`]) keeps its keys' type.
    pub fn holding(mut self, dtype: Option<DType>) -> Self {
        if let (Some(dtype), Some(prompt)) = (dtype, self.prompt.as_mut()) {
            for (keys, values) in prompt.layers.iter_mut().flatten() {
                if keys.dtype() != dtype {
                    *keys = keys.clone().cast(dtype);
                    *values = values.clone().cast(dtype);
                }
            }
        }
        self.dtype = dtype;
        self
    }

    /// An empty cache that reserves `capacity` slots per row and writes in place; it grows
    /// (doubling) if a call needs more.
    pub fn with_capacity(num_layers: usize, capacity: usize) -> Self {
        Self { capacity: Some(capacity), ..Self::new(num_layers) }
    }

    /// A cache whose rows continue the rows of `prompts` (every layer filled, one row per
    /// group), row `r` group `group_of_row[r]`'s, holding each group's keys and values once and
    /// reserving `capacity` slots of each row's own, written in place as
    /// [`KvCache::with_capacity`] writes them (without a capacity, each call's keys and values
    /// are appended as [`KvCache::new`]'s are). Attention then reads both parts
    /// ([`super::prompt_cache::attend`]). Differentiable: the prompts' gradients sum their
    /// rows'.
    pub fn sharing_prompts(
        prompts: KvCache,
        group_of_row: &[usize],
        capacity: Option<usize>,
        device: &Device,
    ) -> Result<Self> {
        if prompts.layers.iter().any(Option::is_none) {
            return Err(TroupeError::invalid("prompts", "a layer holds no prompt"));
        }
        let groups = prompts.layers.first().and_then(|l| l.as_ref()).map_or(0, |(k, _)| k.dims()[0]);
        let groups = GroupLayout::new(group_of_row, groups, device)?;
        let own = match capacity {
            Some(capacity) => Self::with_capacity(prompts.layers.len(), capacity),
            None => Self::new(prompts.layers.len()),
        };
        Ok(Self { prompt: Some(Self::shared(prompts, groups)), ..own })
    }

    /// A cache whose rows read, at the layers `prompts` holds, its rows in place as
    /// [`KvCache::sharing_prompts`] does, each row's group given by `groups`: one layer
    /// recomputed alone under activation checkpointing ([`super::checkpoint`]), where the other
    /// layers are not run.
    pub(crate) fn sharing_layers_of(prompts: KvCache, groups: GroupLayout) -> Self {
        let num_layers = prompts.layers.len();
        Self { prompt: Some(Self::shared(prompts, groups)), ..Self::new(num_layers) }
    }

    /// The slots `prompts` holds as a shared prompt read by `groups`' rows.
    fn shared(prompts: KvCache, groups: GroupLayout) -> SharedPrompt {
        let layers = prompts.layers.into_iter().zip(prompts.filled);
        let layers = layers.map(|(l, slots)| l.map(|(k, v)| (k.narrow(2, 0, slots), v.narrow(2, 0, slots))));
        SharedPrompt { layers: layers.collect(), groups }
    }

    /// Number of cached slots per row (a shared prompt's included).
    pub fn len(&self) -> usize {
        self.prompt.as_ref().map_or(0, SharedPrompt::len) + self.filled.first().copied().unwrap_or(0)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of key slots attention sees once `seq` more slots are appended: the cached
    /// length plus `seq`, or the room a reserved cache will have.
    pub fn keys_after(&self, seq: usize) -> usize {
        self.prompt.as_ref().map_or(0, SharedPrompt::len) + self.slots_after(0, seq)
    }

    /// The prompts `layer` shares (keys, values) and which rows read which, for a cache made by
    /// [`KvCache::sharing_prompts`].
    fn shared_prompt(&self, layer: usize) -> Option<((Tensor<4>, Tensor<4>), &GroupLayout)> {
        let prompt = self.prompt.as_ref()?;
        Some((prompt.layers[layer].clone()?, &prompt.groups))
    }

    /// A layer's own slots: [`KvCache::keys_after`] for `layer`, without a shared prompt.
    fn slots_after(&self, layer: usize, seq: usize) -> usize {
        let needed = self.filled.get(layer).copied().unwrap_or(0) + seq;
        match self.capacity {
            None => needed,
            Some(capacity) => {
                let room = self.layers.get(layer).and_then(|l| l.as_ref()).map_or(capacity, |(k, _)| k.dims()[2]);
                if needed <= room {
                    room
                } else {
                    needed.max(2 * room)
                }
            }
        }
    }

    /// Rebuilds the cache for a new batch whose row `i` continues this cache's row `rows[i]`
    /// (a row may be taken several times: a prompt prefilled once, then decoded or scored for
    /// several rows). Differentiable: gradients of the new rows add up in the rows they came from.
    ///
    /// The rows are given on the host, so nothing is read back from `device` (where a GPU's
    /// earlier failure would surface as a panic).
    ///
    /// # Shapes
    /// `rows`: `new_batch` indices; every layer `[batch, kv_heads, slots, head_dim]` ->
    /// `[new_batch, kv_heads, slots, head_dim]`
    pub fn select_rows(&mut self, rows: &[usize], device: &Device) {
        self.select_rows_by(rows, &Self::row_index(rows, device));
    }

    /// `rows` as the index tensor [`KvCache::select_rows_by`] takes, for a caller that selects
    /// the same rows at every layer (made once, not uploaded a layer).
    ///
    /// # Shapes
    /// -> `[rows]`
    pub fn row_index(rows: &[usize], device: &Device) -> Tensor<1, Int> {
        let index: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        Tensor::from_data(TensorData::new(index, [rows.len()]), device)
    }

    /// [`KvCache::select_rows`] with `index` already [`KvCache::row_index`]`(rows)`.
    pub fn select_rows_by(&mut self, rows: &[usize], index: &Tensor<1, Int>) {
        if let Some(prompt) = self.prompt.as_mut() {
            prompt.groups = prompt.groups.pick(rows, &index.device());
        }
        for layer in self.layers.iter_mut() {
            if let Some((keys, values)) = layer.take() {
                *layer = Some((keys.select(0, index.clone()), values.select(0, index.clone())));
            }
        }
    }

    /// Appends this call's keys and values for `layer` and returns what attention reads: the
    /// full sequence's, or a reserved cache's whole room.
    fn append(&mut self, layer: usize, keys: Tensor<4>, values: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let [batch, heads, seq, dim] = keys.dims();
        if let Some((rooms, start)) = self.take_room(layer, [batch, heads, seq, dim], &keys.device(), keys.dtype()) {
            return self.keep_room(layer, seq, write_room(rooms, keys, values, start));
        }
        let merged = match self.layers[layer].take() {
            Some((past_k, past_v)) => (Tensor::cat(vec![past_k, keys], 2), Tensor::cat(vec![past_v, values], 2)),
            None => (keys, values),
        };
        self.keep_room(layer, seq, merged)
    }

    /// A reserved cache's rooms for `layer` (keys', values'), made or grown to take `seq` more
    /// slots of `[batch, heads, _, head_dim]`, and the slot the new ones start at; the rooms are
    /// taken out of the cache, so that a kernel may write them in place, until
    /// [`KvCache::keep_room`] puts them back. `None`, with nothing taken, for a cache that
    /// appends. A room is made in the cache's type ([`KvCache::holding`]), else in `dtype`.
    fn take_room(
        &mut self,
        layer: usize,
        [batch, heads, seq, dim]: [usize; 4],
        device: &Device,
        dtype: DType,
    ) -> Option<((Tensor<4>, Tensor<4>), usize)> {
        self.capacity?;
        let (start, room) = (self.filled[layer], self.slots_after(layer, seq));
        let dtype = self.dtype.unwrap_or(dtype);
        let reserve = |past: Option<Tensor<4>>| -> Tensor<4> {
            match past {
                Some(past) if past.dims()[2] == room => past,
                Some(past) => {
                    let fresh = Tensor::zeros([batch, heads, room - start, dim], (device, dtype));
                    Tensor::cat(vec![past.narrow(2, 0, start), fresh], 2)
                }
                None => Tensor::zeros([batch, heads, room, dim], (device, dtype)),
            }
        };
        let (past_k, past_v) = self.layers[layer].take().unzip();
        Some(((reserve(past_k), reserve(past_v)), start))
    }

    /// Holds `merged` as `layer`'s keys and values after `seq` more slots were written (by
    /// [`KvCache::take_room`]'s caller, or appended), and returns them: what attention reads.
    fn keep_room(&mut self, layer: usize, seq: usize, merged: (Tensor<4>, Tensor<4>)) -> (Tensor<4>, Tensor<4>) {
        self.filled[layer] += seq;
        self.layers[layer] = Some(merged.clone());
        merged
    }
}

/// `keys` and `values` written into slots `start..` of a reserved cache's rooms (keys', values'),
/// cast to the rooms' element type: one kernel for both on a GPU, a slice write each elsewhere.
///
/// # Shapes
/// `rooms`: `[batch, heads, room, head_dim]` each; `keys`, `values`: `[batch, heads, seq,
/// head_dim]` -> `rooms`
fn write_room(
    rooms: (Tensor<4>, Tensor<4>),
    keys: Tensor<4>,
    values: Tensor<4>,
    start: usize,
) -> (Tensor<4>, Tensor<4>) {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    let rooms = match super::fused::gpu::cache_write(rooms, &keys, &values, start) {
        Ok(written) => return written,
        Err(rooms) => rooms,
    };
    let [batch, heads, seq, dim] = keys.dims();
    let dtype = rooms.0.dtype();
    let at = [0..batch, 0..heads, start..start + seq, 0..dim];
    (rooms.0.slice_assign(at.clone(), in_dtype(keys, dtype)), rooms.1.slice_assign(at, in_dtype(values, dtype)))
}

/// Grouped-query self-attention with rotary embeddings (and Qwen3's per-head q/k norms).
#[derive(Clone, Debug)]
pub struct Attention {
    /// `self_attn.q_proj`, `k_proj` and `v_proj` stacked along the output (one GEMM).
    pub qkv_proj: FrozenLinear,
    /// `self_attn.o_proj`
    pub o_proj: FrozenLinear,
    /// `self_attn.q_norm` (Qwen3)
    pub q_norm: Option<RmsNorm>,
    /// `self_attn.k_norm` (Qwen3)
    pub k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    /// The kernel of a forward without gradients off the CPU (`runtime.attention`).
    kernel: AttentionKernel,
}

/// The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `mlp.gate_proj` and `mlp.up_proj` stacked along the output (one GEMM).
    pub gate_up_proj: FrozenLinear,
    /// `mlp.down_proj`
    pub down_proj: FrozenLinear,
}

/// One pre-norm decoder layer.
#[derive(Clone, Debug)]
pub struct DecoderLayer {
    /// `input_layernorm`
    pub input_layernorm: RmsNorm,
    /// `self_attn`
    pub self_attn: Attention,
    /// `post_attention_layernorm`
    pub post_attention_layernorm: RmsNorm,
    /// `mlp`
    pub mlp: Mlp,
}

/// A frozen causal language model.
#[derive(Clone, Debug)]
pub struct CausalLm {
    /// The resolved configuration.
    pub config: ModelConfig,
    /// `model.embed_tokens`: `[vocab, hidden]`
    pub embed_tokens: TokenEmbedding,
    /// `model.layers`
    pub layers: Vec<DecoderLayer>,
    /// `model.norm`
    pub norm: RmsNorm,
    /// `lm_head`: `hidden -> vocab` (the embedding's matrix when tied).
    pub lm_head: FrozenLinear,
    rope: RotaryEmbedding,
    device: Device,
    /// The fingerprint of the f32 weights, taken from the weight source at load
    /// ([`super::fingerprint::base_fingerprint`]) for a base held in bf16 or f16 or on a GPU;
    /// `None` for an f32 base on the CPU or one kept quantized.
    source_fingerprint: Option<String>,
    /// Batches of rows are padded to a multiple of this many slots ([`CausalLm::width_step`]).
    width_step: usize,
    /// How a generation's cache holds a prompt several rows share (`runtime.prompt_cache`).
    prompt_cache: PromptCache,
    /// What a generation's reserved cache holds its keys and values in (`runtime.kv_cache`).
    kv_cache: KvCacheDtype,
}

/// On a GPU the widths of a batch's rows (prompts, prefixes, replies, packed decisions) are
/// padded to a multiple of this many slots, the padding masked: a backend that compiles a kernel
/// per shape class (burn's matrix products choose their vector widths and bounds checks by how
/// the dimensions divide) then meets a few widths instead of one per length, and batches of
/// nearby lengths reuse its kernels.
pub const GPU_WIDTH_STEP: usize = 8;

/// Per-call inputs besides the tokens.
pub struct ForwardArgs<'a> {
    /// Positions and mask for the new tokens.
    pub layout: &'a AttentionLayout,
    /// The cache to read and extend, if decoding incrementally.
    pub cache: Option<&'a mut KvCache>,
    /// Adapter deltas (LoRA), if any.
    pub delta: Option<&'a dyn ProjectionDelta>,
}

/// Applies a stacked projection to `x`, splits its output into its parts (along the last
/// dimension), each as heads of `head_dim` values, and adds each part's adapter delta, computed
/// from `x` (for q/k/v, the parts' deltas joined into one where the adapters give them so,
/// [`ProjectionDelta::joint_delta`]). On a GPU under autodiff each part of a dense projection is
/// differentiated through its own rows of the weight
/// ([`super::fused::gpu::stacked_parts_tracked`]); elsewhere the parts are views of the output.
/// `rounded`, when a kernel wrote it, is `x` rounded for the product
/// ([`FrozenLinear::forward_rounded`]).
///
/// # Shapes
/// `x`, `rounded`: `[batch, seq, hidden]` -> `[batch, seq, width / head_dim, head_dim]` for each
/// part's width
fn split_project(
    linear: &FrozenLinear,
    (x, rounded): (&Tensor<3>, Option<Tensor<3>>),
    parts: &[(Projection, usize)],
    layer: usize,
    delta: Option<&dyn ProjectionDelta>,
    head_dim: usize,
) -> Vec<Tensor<4>> {
    let widths: Vec<usize> = parts.iter().map(|&(_, width)| width).collect();
    let base = || linear.forward_rounded(x.clone(), rounded.clone());
    if let Some(sum) = delta.and_then(|d| d.joint_sum(layer, parts, x, &base)) {
        // The joint delta added to the stacked output, then the parts as views of it.
        return head_parts(sum, &widths, head_dim);
    }
    let values = stacked_parts(linear, (x, rounded), &widths, head_dim);
    values
        .into_iter()
        .zip(parts)
        .map(|(part, &(projection, _))| match delta.and_then(|d| d.delta(layer, projection, x)) {
            Some(extra) => {
                let dims = part.dims();
                part + extra.reshape(dims)
            }
            None => part,
        })
        .collect()
}

/// The parts of `linear`'s output for `x`, `widths` wide in turn along the last dimension, as
/// heads of `head_dim` values (`rounded` as for [`split_project`]).
///
/// # Shapes
/// `x`, `rounded`: `[batch, seq, hidden]` -> `[batch, seq, widths[i] / head_dim, head_dim]` each
fn stacked_parts(
    linear: &FrozenLinear,
    (x, rounded): (&Tensor<3>, Option<Tensor<3>>),
    widths: &[usize],
    head_dim: usize,
) -> Vec<Tensor<4>> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if let LinearWeight::Dense(weight) = &linear.weight {
        if super::fused::gpu::takes_tracked(x) {
            let stacked = linear.forward(x.clone().without_autodiff());
            if let Some(parts) = super::fused::gpu::stacked_parts_tracked(x, stacked, weight, widths) {
                return parts
                    .into_iter()
                    .map(|part| {
                        let [batch, seq, width] = part.dims();
                        part.reshape([batch, seq, width / head_dim, head_dim])
                    })
                    .collect();
            }
        }
    }
    head_parts(linear.forward_rounded(x.clone(), rounded), widths, head_dim)
}

/// `stacked`'s parts, `widths` wide in turn along the last dimension, as views split into heads
/// of `head_dim` values. The columns are narrowed on the `[batch * seq, width]` view and split
/// from there: burn's reshape copies a narrowed part whose shape has a unit dimension before the
/// one it splits (`[batch, 1, width]` when a batch decodes, `[1, seq, width]` for one row)
/// rather than split it, three copies a layer.
///
/// # Shapes
/// `stacked`: `[batch, seq, sum of widths]` -> `[batch, seq, widths[i] / head_dim, head_dim]` each
fn head_parts(stacked: Tensor<3>, widths: &[usize], head_dim: usize) -> Vec<Tensor<4>> {
    let [batch, seq, total] = stacked.dims();
    let flat = stacked.reshape([batch * seq, total]);
    let mut start = 0;
    widths
        .iter()
        .map(|&width| {
            start += width;
            flat.clone().narrow(1, start - width, width).reshape([batch, seq, width / head_dim, head_dim])
        })
        .collect()
}

/// Applies a projection plus the adapter delta for it, if any (`rounded` as for
/// [`split_project`]).
fn project(
    linear: &FrozenLinear,
    x: Rounded,
    layer: usize,
    projection: Projection,
    delta: Option<&dyn ProjectionDelta>,
) -> Tensor<3> {
    match project_apart(linear, x, layer, projection, delta) {
        (base, Some(extra)) => base + extra,
        (base, None) => base,
    }
}

/// A projection's output and the adapter delta for it, if any, apart (for a caller that adds
/// both to something else in one kernel; `rounded` as for [`split_project`]).
///
/// # Shapes
/// `x`, `rounded`: `[batch, seq, in]` -> `[batch, seq, out]` each
fn project_apart(
    linear: &FrozenLinear,
    (x, rounded): Rounded,
    layer: usize,
    projection: Projection,
    delta: Option<&dyn ProjectionDelta>,
) -> (Tensor<3>, Option<Tensor<3>>) {
    let extra = delta.and_then(|d| d.delta(layer, projection, &x));
    (linear.forward_rounded(x, rounded), extra)
}

impl Attention {
    fn load(loader: &WeightLoader<'_>, prefix: &str, config: &ModelConfig) -> Result<Self> {
        let (source, device) = (loader.source, loader.device);
        let h = config.hidden_size;
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let norm = |name: &str| -> Result<Option<RmsNorm>> {
            if config.model_type == ModelType::Qwen3 {
                Ok(Some(RmsNorm::load(
                    source,
                    &format!("{prefix}.{name}"),
                    config.head_dim,
                    config.rms_norm_eps,
                    device,
                )?))
            } else {
                Ok(None)
            }
        };
        let names = [format!("{prefix}.q_proj"), format!("{prefix}.k_proj"), format!("{prefix}.v_proj")];
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        Ok(Self {
            qkv_proj: FrozenLinear::load_stacked(loader, &names, h, &[q, kv, kv], config.qkv_bias)?,
            o_proj: FrozenLinear::load(loader, &format!("{prefix}.o_proj"), q, h, config.o_bias)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            kernel: AttentionKernel::default(),
        })
    }

    /// A projection's output split into heads, with the per-head norm (Qwen3) if any, heads
    /// first.
    ///
    /// # Shapes
    /// `t`: `[batch, seq, heads, head_dim]` -> `[batch, heads, seq, head_dim]`
    fn heads(t: Tensor<4>, norm: &Option<RmsNorm>) -> Tensor<4> {
        let t = match norm {
            Some(norm) => norm.forward(t),
            None => t,
        };
        t.swap_dims(1, 2)
    }

    /// Queries or keys as rotated heads, heads first: the per-head norm (Qwen3) if any, then the
    /// rotary embedding (one kernel on a GPU without gradients, [`super::fused::rms_norm_rope`]).
    ///
    /// # Shapes
    /// `t`: `[batch, seq, heads, head_dim]` -> `[batch, heads, seq, head_dim]`
    fn rotated_heads(t: Tensor<4>, norm: &Option<RmsNorm>, rope: (&Tensor<4>, &Tensor<4>)) -> Tensor<4> {
        match norm {
            Some(norm) => super::fused::rms_norm_rope(t, &norm.weight, norm.eps, rope.0, rope.1),
            None => RotaryEmbedding::apply(t.swap_dims(1, 2), rope.0, rope.1),
        }
    }

    /// The queries and keys as rotated heads ([`Attention::rotated_heads`]), with Qwen3's
    /// per-head norms in one kernel for both on a GPU ([`super::fused::rms_norm_rope_pair`]).
    ///
    /// # Shapes
    /// `q`: `[batch, seq, heads, head_dim]`, `k`: `[batch, seq, kv_heads, head_dim]` ->
    /// `[batch, heads, seq, head_dim]`, `[batch, kv_heads, seq, head_dim]`
    fn rotated_queries_and_keys(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        rope: (&Tensor<4>, &Tensor<4>),
    ) -> (Tensor<4>, Tensor<4>) {
        match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => {
                super::fused::rms_norm_rope_pair((q, &qn.weight, qn.eps), (k, &kn.weight, kn.eps), rope.0, rope.1)
            }
            _ => (Self::rotated_heads(q, &self.q_norm, rope), Self::rotated_heads(k, &self.k_norm, rope)),
        }
    }

    /// The q/k/v projection (one product): the queries and keys as projected, the values heads
    /// first.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, hidden]` -> `[batch, seq, heads, head_dim]` (queries),
    /// `[batch, seq, kv_heads, head_dim]` (keys), `[batch, kv_heads, seq, head_dim]` (values)
    fn project_qkv(
        &self,
        (x, rounded): Rounded,
        layer: usize,
        delta: Option<&dyn ProjectionDelta>,
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let (q_width, kv_width) = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim);
        let parts = [(Projection::Q, q_width), (Projection::K, kv_width), (Projection::V, kv_width)];
        let mut qkv = split_project(&self.qkv_proj, (&x, rounded), &parts, layer, delta, self.head_dim).into_iter();
        let (q, k, v) = (qkv.next().expect("q"), qkv.next().expect("k"), qkv.next().expect("v"));
        (q, k, Self::heads(v, &None))
    }

    /// Appends `x`'s keys and values to the cache without attending (nothing reads this
    /// layer's output).
    ///
    /// # Shapes
    /// `x`: `[batch, seq, hidden]`
    fn fill_cache(&self, x: Rounded, layer: usize, rope: (&Tensor<4>, &Tensor<4>), args: &mut ForwardArgs<'_>) {
        let (_, k, v) = self.project_qkv(x, layer, args.delta);
        if let Some(cache) = args.cache.as_deref_mut() {
            self.rotate_and_append(cache, layer, None, k, v, rope);
        }
    }

    /// The queries (when given) as rotated heads, and the keys rotated and the values appended
    /// to `cache`: the rotated queries and what attention reads of the cache
    /// ([`KvCache::append`]). On a GPU without gradients, into a reserved cache, one kernel
    /// rotates both and writes the cache's room ([`super::fused::gpu::rope_into_room`]).
    ///
    /// # Shapes
    /// `q`: `[batch, seq, heads, head_dim]`, `k`: `[batch, seq, kv_heads, head_dim]`, `v`:
    /// `[batch, kv_heads, seq, head_dim]` -> `[batch, heads, seq, head_dim]` and the layer's
    /// cached `[batch, kv_heads, slots, head_dim]` keys and values
    #[allow(clippy::type_complexity)]
    fn rotate_and_append(
        &self,
        cache: &mut KvCache,
        layer: usize,
        q: Option<Tensor<4>>,
        k: Tensor<4>,
        v: Tensor<4>,
        rope: (&Tensor<4>, &Tensor<4>),
    ) -> (Option<Tensor<4>>, (Tensor<4>, Tensor<4>)) {
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if let Some(done) = self.rotate_into_room(cache, layer, q.as_ref(), &k, &v, rope) {
            return done;
        }
        let (q, k) = match q {
            Some(q) => {
                let (q, k) = self.rotated_queries_and_keys(q, k, rope);
                (Some(q), k)
            }
            None => (None, Self::rotated_heads(k, &self.k_norm, rope)),
        };
        (q, cache.append(layer, k, v))
    }

    /// [`Attention::rotate_and_append`] as one kernel into a reserved cache's room; `None`, the
    /// cache as it was, where the kernel does not take the tensors (or the cache appends).
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    #[allow(clippy::type_complexity)]
    fn rotate_into_room(
        &self,
        cache: &mut KvCache,
        layer: usize,
        q: Option<&Tensor<4>>,
        k: &Tensor<4>,
        v: &Tensor<4>,
        rope: (&Tensor<4>, &Tensor<4>),
    ) -> Option<(Option<Tensor<4>>, (Tensor<4>, Tensor<4>))> {
        let norms = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) if qn.eps == kn.eps => Some((&qn.weight, &kn.weight, qn.eps)),
            (None, None) => None,
            _ => return None,
        };
        if !super::fused::gpu::takes(k) {
            return None;
        }
        let [batch, seq, kv_heads, dim] = k.dims();
        let (rooms, start) = cache.take_room(layer, [batch, kv_heads, seq, dim], &k.device(), k.dtype())?;
        match super::fused::gpu::rope_into_room((q, k, v), norms, rope, rooms, start) {
            Ok((q, rooms)) => Some((q, cache.keep_room(layer, seq, rooms))),
            Err(rooms) => {
                // Made or grown for these slots, none of them written yet.
                cache.layers[layer] = Some(rooms);
                None
            }
        }
    }

    /// The attention's output projection and its adapter delta, apart: the layer adds both to
    /// the residual stream.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, hidden]` -> `[batch, seq, hidden]`, and the delta's (or its input's,
    /// `[batch, seq, heads * head_dim]`)
    fn forward(
        &self,
        x: Rounded,
        layer: usize,
        rope: (&Tensor<4>, &Tensor<4>),
        args: &mut ForwardArgs<'_>,
    ) -> (Tensor<3>, OutputDelta) {
        let [batch, seq, _] = x.0.dims();
        let (q, k, v) = self.project_qkv(x, layer, args.delta);
        let mask = &args.layout.mask;
        // A decoding step's kernel on a GPU also writes its output rounded for o's product.
        let round = self.o_proj.input_rounding();
        let (out, rounded) = match args.cache.as_deref_mut() {
            Some(cache) => {
                let (q, (k, v)) = self.rotate_and_append(cache, layer, Some(q), k, v, rope);
                let q = q.expect("queries given");
                match cache.shared_prompt(layer) {
                    Some((prompt, groups)) => prompt_cache::attend_rounded(q, prompt, groups, (k, v), mask, round),
                    None => attention_rounded(q, k, v, mask, &args.layout.host_mask, self.kernel, round),
                }
            }
            None => {
                let (q, k) = self.rotated_queries_and_keys(q, k, rope);
                attention_rounded(q, k, v, mask, &args.layout.host_mask, self.kernel, round)
            }
        };
        let merged = |t: Tensor<4>| t.swap_dims(1, 2).reshape([batch, seq, self.num_heads * self.head_dim]);
        let (out, rounded) = (merged(out), rounded.map(merged));
        // On a GPU, over a decoding step's few rows, the residual sum's kernel computes the delta.
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if batch * seq <= super::fused::gpu::LORA_DELTA_MAX_ROWS && super::fused::gpu::takes(&out) {
            if let Some(factors) = args.delta.and_then(|d| d.low_rank(layer, Projection::O, &out)) {
                let projected = self.o_proj.forward_rounded(out.clone(), rounded);
                return (projected, OutputDelta::LowRank(out, factors));
            }
        }
        let (projected, delta) = project_apart(&self.o_proj, (out, rounded), layer, Projection::O, args.delta);
        (projected, OutputDelta::Computed(delta))
    }
}

/// The output projection's adapter delta as attention leaves it for the residual sum. (One a
/// layer, made and taken apart in one step: the variants' sizes do not matter.)
#[allow(clippy::large_enum_variant)]
enum OutputDelta {
    /// The delta, or `None` where no adapter applies.
    Computed(Option<Tensor<3>>),
    /// The projection's input and the delta's factors, for the residual sum's kernel to compute
    /// it in the same launch ([`super::fused::gpu::add_low_rank_rms_norm`]).
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    LowRank(Tensor<3>, super::layers::LowRank),
}

impl Mlp {
    fn load(loader: &WeightLoader<'_>, prefix: &str, config: &ModelConfig) -> Result<Self> {
        let (h, i, bias) = (config.hidden_size, config.intermediate_size, config.mlp_bias);
        let names = [format!("{prefix}.gate_proj"), format!("{prefix}.up_proj")];
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        Ok(Self {
            gate_up_proj: FrozenLinear::load_stacked(loader, &names, h, &[i, i], bias)?,
            down_proj: FrozenLinear::load(loader, &format!("{prefix}.down_proj"), i, h, bias)?,
        })
    }

    /// # Shapes
    /// `x`: `[batch, seq, hidden]` -> `[batch, seq, hidden]`
    fn forward(&self, (x, rounded): Rounded, layer: usize, delta: Option<&dyn ProjectionDelta>) -> Tensor<3> {
        let gate_up = self.gate_up_proj.forward_rounded(x.clone(), rounded);
        let delta_gate = delta.and_then(|d| d.delta(layer, Projection::Gate, &x));
        let delta_up = delta.and_then(|d| d.delta(layer, Projection::Up, &x));
        // On a GPU the gate's kernel also writes its output rounded for down's product.
        let gated = swiglu_stacked_rounded(gate_up, delta_gate, delta_up, self.down_proj.input_rounding());
        project(&self.down_proj, gated, layer, Projection::Down, delta)
    }
}

/// An activation and, where the kernel that wrote it also wrote it rounded to the half precision
/// of the frozen product it feeds, that rounding ([`FrozenLinear::forward_rounded`]).
type Rounded = (Tensor<3>, Option<Tensor<3>>);

/// The residual stream between decoder layers: its value, and the last layer's MLP output when
/// it is not added yet. The next norm adds it (one kernel on a GPU, [`add_rms_norm_rounded`]), where a
/// sum and then the norm were two launches a layer; elsewhere the sum and the norm run apart,
/// as they did.
pub(crate) struct Residual {
    /// `[batch, seq, hidden]`
    x: Tensor<3>,
    /// `[batch, seq, hidden]`, to add to `x`.
    pending: Option<Tensor<3>>,
}

impl From<Tensor<3>> for Residual {
    fn from(x: Tensor<3>) -> Self {
        Self { x, pending: None }
    }
}

impl Residual {
    /// The stream's value.
    ///
    /// # Shapes
    /// -> `[batch, seq, hidden]`
    pub(crate) fn sum(self) -> Tensor<3> {
        match self.pending {
            Some(y) => self.x + y,
            None => self.x,
        }
    }

    /// The stream's value and its RMS norm by `norm`, with the norm rounded to `round` where the
    /// kernel adding the pending addend wrote that too.
    ///
    /// # Shapes
    /// -> `[batch, seq, hidden]` each
    fn normed(self, norm: &RmsNorm, round: Option<DType>) -> (Tensor<3>, Rounded) {
        match self.pending {
            Some(y) => {
                let (sum, normed, rounded) = add_rms_norm_rounded(self.x, y, None, &norm.weight, norm.eps, round);
                (sum, (normed, rounded))
            }
            None => (self.x.clone(), (norm.forward(self.x), None)),
        }
    }
}

impl DecoderLayer {
    /// One layer over the residual stream `x`, the cache (if any) extended with this layer's
    /// keys and values.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, hidden]` -> `[batch, seq, hidden]`
    pub(crate) fn forward(
        &self,
        x: Tensor<3>,
        layer: usize,
        rope: (&Tensor<4>, &Tensor<4>),
        args: &mut ForwardArgs<'_>,
    ) -> Tensor<3> {
        self.step(x.into(), layer, rope, args).sum()
    }

    /// [`DecoderLayer::forward`] over a stream whose last addend may be pending, leaving this
    /// layer's MLP output pending in turn.
    fn step(
        &self,
        stream: Residual,
        layer: usize,
        rope: (&Tensor<4>, &Tensor<4>),
        args: &mut ForwardArgs<'_>,
    ) -> Residual {
        let (x, normed) = stream.normed(&self.input_layernorm, self.self_attn.qkv_proj.input_rounding());
        let (attended, delta) = self.self_attn.forward(normed, layer, rope, args);
        let (x, normed, rounded) = self.sum_and_norm(x, attended, delta, layer, args);
        let fed = self.mlp.forward((normed, rounded), layer, args.delta);
        Residual { x, pending: Some(fed) }
    }

    /// The residual stream's sum `x + (attended + delta)` and the MLP's norm of it, with the
    /// norm rounded for the gate/up product where it is in half precision: one kernel on a GPU,
    /// which also computes a decoding step's delta ([`OutputDelta::LowRank`]).
    ///
    /// # Shapes
    /// `x`, `attended`: `[batch, seq, hidden]` -> (the sum, its norm, the norm rounded), like `x`
    #[allow(clippy::type_complexity)]
    fn sum_and_norm(
        &self,
        x: Tensor<3>,
        attended: Tensor<3>,
        delta: OutputDelta,
        layer: usize,
        args: &ForwardArgs<'_>,
    ) -> (Tensor<3>, Tensor<3>, Option<Tensor<3>>) {
        let norm = &self.post_attention_layernorm;
        let round = self.mlp.gate_up_proj.input_rounding();
        // Without a GPU, only a computed delta is made.
        #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
        let (OutputDelta::Computed(delta), _, _) = (delta, layer, args);
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        let delta = match delta {
            OutputDelta::Computed(delta) => delta,
            OutputDelta::LowRank(input, factors) => {
                let all = super::fused::gpu::add_low_rank_rms_norm(
                    &x,
                    &attended,
                    (&input, &factors),
                    &norm.weight,
                    norm.eps,
                    round,
                );
                if let Some(all) = all {
                    return all;
                }
                args.delta.and_then(|d| d.delta(layer, Projection::O, &input))
            }
        };
        add_rms_norm_rounded(x, attended, delta, &norm.weight, norm.eps, round)
    }

    /// Only this layer's keys and values of the stream, appended to the cache (what
    /// [`CausalLm::fill_cache`] runs at its last layer).
    pub(crate) fn fill_cache(
        &self,
        stream: Residual,
        layer: usize,
        rope: (&Tensor<4>, &Tensor<4>),
        args: &mut ForwardArgs<'_>,
    ) {
        let (_, normed) = stream.normed(&self.input_layernorm, self.self_attn.qkv_proj.input_rounding());
        self.self_attn.fill_cache(normed, layer, rope, args);
    }
}

impl CausalLm {
    /// Builds the model from `config` and the weights in `source` (Hugging Face tensor names),
    /// checking that every tensor exists with the shape the config implies.
    pub fn load(config: ModelConfig, source: &dyn WeightSource, device: &Device) -> Result<Self> {
        Self::load_as(config, &WeightLoader { source, device, format: BaseFormat::F32, dtype: FloatDType::F32 })
    }

    /// [`CausalLm::load`] in the form `loader.format` asks for: f32, or kept quantized (CPU only).
    pub fn load_as(config: ModelConfig, loader: &WeightLoader<'_>) -> Result<Self> {
        let (source, device) = (loader.source, loader.device);
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embedding_name = "model.embed_tokens.weight";
        let head_name = if config.tie_word_embeddings { embedding_name } else { "lm_head.weight" };
        let (embed_tokens, lm_head) = match loader.format {
            BaseFormat::F32 => {
                let table = loader.dense(embedding_name, v, h)?;
                // A tied head is the embedding's own tensor: both are `[vocab, hidden]`.
                let lm_head = if config.tie_word_embeddings {
                    FrozenLinear { weight: LinearWeight::Dense(table.clone()), bias: None }
                } else {
                    FrozenLinear::load(loader, head_name.trim_end_matches(".weight"), h, v, false)?
                };
                (TokenEmbedding::Dense(table), lm_head)
            }
            BaseFormat::Quantized => {
                quant::check_device(device)?;
                let table = QuantizedWeight::new(vec![loader.matrix_part(embedding_name, v, h)?]);
                let head = if config.tie_word_embeddings {
                    table.clone()
                } else {
                    QuantizedWeight::new(vec![loader.matrix_part(head_name, v, h)?])
                };
                let lm_head = FrozenLinear { weight: LinearWeight::Quantized(head), bias: None };
                (TokenEmbedding::Quantized(table), lm_head)
            }
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let prefix = format!("model.layers.{i}");
                Ok(DecoderLayer {
                    input_layernorm: RmsNorm::load(
                        source,
                        &format!("{prefix}.input_layernorm"),
                        h,
                        config.rms_norm_eps,
                        device,
                    )?,
                    self_attn: Attention::load(loader, &format!("{prefix}.self_attn"), &config)?,
                    post_attention_layernorm: RmsNorm::load(
                        source,
                        &format!("{prefix}.post_attention_layernorm"),
                        h,
                        config.rms_norm_eps,
                        device,
                    )?,
                    mlp: Mlp::load(loader, &format!("{prefix}.mlp"), &config)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(source, "model.norm", h, config.rms_norm_eps, device)?;
        let rope = RotaryEmbedding::new(config.head_dim, config.rope_theta, config.max_position_embeddings, device);
        // Taken from the source, not read back from the device, for a base held in half
        // precision and for any base on a GPU (where a base too big for the card would surface
        // its failed allocations at that read).
        let on_cpu = *device == Device::flex();
        let source_fingerprint = match (loader.format, loader.dtype) {
            (BaseFormat::Quantized, _) => None,
            (BaseFormat::F32, FloatDType::F32) if on_cpu => None,
            _ => Some(super::fingerprint::source_fingerprint(&config, source)?),
        };
        // On the CPU nothing is compiled: rows are padded only to the longest.
        let width_step = if on_cpu { 1 } else { crate::device::gpu_width_step()? };
        Ok(Self {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            device: device.clone(),
            source_fingerprint,
            width_step,
            prompt_cache: PromptCache::Auto,
            kv_cache: KvCacheDtype::Auto,
        })
    }

    /// The dtype the base's float matrices are held in (`model.dtype`); f32 when kept quantized.
    pub fn dtype(&self) -> DType {
        match &self.lm_head.weight {
            LinearWeight::Dense(weight) => weight.dtype(),
            LinearWeight::Quantized(_) => DType::F32,
        }
    }

    /// The attention kernel of a forward without gradients off the CPU (`runtime.attention`;
    /// `auto` at load). The CPU runs its fused attention whatever the choice.
    pub fn attention_kernel(&self) -> AttentionKernel {
        self.layers.first().map_or_else(AttentionKernel::default, |layer| layer.self_attn.kernel)
    }

    /// Sets [`CausalLm::attention_kernel`] for every layer.
    pub fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        for layer in &mut self.layers {
            layer.self_attn.kernel = kernel;
        }
    }

    /// How a generation's cache holds a prompt several rows share (`runtime.prompt_cache`;
    /// `auto` at load).
    pub fn prompt_cache(&self) -> PromptCache {
        self.prompt_cache
    }

    /// Sets [`CausalLm::prompt_cache`].
    pub fn set_prompt_cache(&mut self, choice: PromptCache) {
        self.prompt_cache = choice;
    }

    /// What a generation's reserved cache holds its keys and values in (`runtime.kv_cache`;
    /// `auto` at load).
    pub fn kv_cache(&self) -> KvCacheDtype {
        self.kv_cache
    }

    /// Sets [`CausalLm::kv_cache`].
    pub fn set_kv_cache(&mut self, choice: KvCacheDtype) {
        self.kv_cache = choice;
    }

    /// The element type a generation's reserved cache holds, when not f32
    /// ([`KvCache::holding`]): [`CausalLm::kv_cache`] for this base on this model's device.
    pub fn cache_dtype(&self) -> Option<DType> {
        self.kv_cache.held(self.dtype(), &self.device)
    }

    /// Whether a generation holds a prompt its rows share once per group
    /// ([`KvCache::sharing_prompts`]): [`CausalLm::prompt_cache`] on this model's device.
    pub fn shares_prompts(&self) -> bool {
        self.prompt_cache.shares_on(&self.device)
    }

    /// The fingerprint of the f32 weights of a base held in bf16 or f16, taken at load.
    pub(crate) fn source_fingerprint(&self) -> Option<&str> {
        self.source_fingerprint.as_deref()
    }

    /// Bytes the weights take in memory (matrices in their dtype or kept block formats; a tied
    /// LM head, which shares the embedding's tensor or blocks, counted once).
    pub fn weight_bytes(&self) -> usize {
        let norm = |n: &RmsNorm| 4 * n.weight.dims()[0];
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let attn = &l.self_attn;
                attn.qkv_proj.bytes()
                    + attn.o_proj.bytes()
                    + attn.q_norm.as_ref().map_or(0, norm)
                    + attn.k_norm.as_ref().map_or(0, norm)
                    + norm(&l.input_layernorm)
                    + norm(&l.post_attention_layernorm)
                    + l.mlp.gate_up_proj.bytes()
                    + l.mlp.down_proj.bytes()
            })
            .sum();
        let head = if self.config.tie_word_embeddings { 0 } else { self.lm_head.bytes() };
        self.embed_tokens.bytes() + layers + norm(&self.norm) + head
    }

    /// Whether the base is kept quantized.
    pub fn format(&self) -> BaseFormat {
        match self.lm_head.weight {
            LinearWeight::Dense(_) => BaseFormat::F32,
            LinearWeight::Quantized(_) => BaseFormat::Quantized,
        }
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The multiple of slots a batch's rows are padded to ([`GPU_WIDTH_STEP`] on a GPU unless
    /// `TROUPE_WIDTH_STEP` says otherwise, 1 on the CPU): scoring, generation and packed
    /// decisions pad their rows to the longest row's width rounded up to it. The results do not
    /// depend on it (padding is masked).
    pub fn width_step(&self) -> usize {
        self.width_step
    }

    /// The same model padding batches to a multiple of `step` slots (at least 1): for tests
    /// and measurements of the padding, on any device.
    pub fn with_width_step(mut self, step: usize) -> Self {
        self.width_step = step.max(1);
        self
    }

    /// The width a batch whose longest row is `longest` slots is padded to.
    pub fn padded_width(&self, longest: usize) -> usize {
        longest.next_multiple_of(self.width_step)
    }

    /// Token ids (`[batch][seq]`, all rows the same length) as a tensor, refusing ids outside
    /// the vocabulary.
    pub fn token_tensor(&self, tokens: &[Vec<u32>]) -> Result<Tensor<2, Int>> {
        let batch = tokens.len();
        let seq = tokens.first().map_or(0, Vec::len);
        if batch == 0 || seq == 0 {
            return Err(TroupeError::invalid("tokens", "empty batch or empty sequence"));
        }
        let mut flat = Vec::with_capacity(batch * seq);
        for row in tokens {
            if row.len() != seq {
                return Err(TroupeError::invalid("tokens", "rows must have equal length (pad them)"));
            }
            for &id in row {
                if id as usize >= self.config.vocab_size {
                    return Err(TroupeError::invalid(
                        "tokens",
                        format!("token id {id} is outside the vocabulary of {}", self.config.vocab_size),
                    ));
                }
                flat.push(id as i64);
            }
        }
        Ok(Tensor::from_data(TensorData::new(flat, [batch, seq]), &self.device))
    }

    /// Runs the decoder and returns the final hidden states (after the last norm).
    ///
    /// # Shapes
    /// `tokens`: `[batch, seq]` -> `[batch, seq, hidden]`
    pub fn hidden_states(&self, tokens: Tensor<2, Int>, mut args: ForwardArgs<'_>) -> Result<Tensor<3>> {
        let (stream, _) = self.run_layers(tokens, &mut args, self.layers.len())?;
        Ok(stream.normed(&self.norm, None).1 .0)
    }

    /// Runs `tokens` through the model only to append their keys and values to `args.cache`:
    /// the last layer computes its keys and values and nothing else (its attention, MLP and the
    /// final norm feed only the hidden states, which nothing reads here). What
    /// [`CausalLm::hidden_states`] writes to the cache, for less work; differentiable like it.
    ///
    /// # Shapes
    /// `tokens`: `[batch, seq]`
    pub fn fill_cache(&self, tokens: Tensor<2, Int>, mut args: ForwardArgs<'_>) -> Result<()> {
        if args.cache.is_none() {
            return Err(TroupeError::invalid("cache", "fill_cache needs a KV cache to fill"));
        }
        let Some(last) = self.layers.len().checked_sub(1) else { return Ok(()) };
        let (stream, (cos, sin)) = self.run_layers(tokens, &mut args, last)?;
        self.layers[last].fill_cache(stream, last, (&cos, &sin), &mut args);
        Ok(())
    }

    /// The residual stream after the first `layers` decoder layers (the cache, if any, extended
    /// for each of them), and the rotary tables of the tokens' positions.
    ///
    /// # Shapes
    /// `tokens`: `[batch, seq]` -> the stream `[batch, seq, hidden]`, two `[batch, 1, seq, head_dim]`
    #[allow(clippy::type_complexity)]
    fn run_layers(
        &self,
        tokens: Tensor<2, Int>,
        args: &mut ForwardArgs<'_>,
        layers: usize,
    ) -> Result<(Residual, (Tensor<4>, Tensor<4>))> {
        let past = args.cache.as_ref().map_or(0, |c| c.len());
        let [_, seq] = tokens.dims();
        if past + seq > self.rope.max_positions() {
            return Err(TroupeError::invalid(
                "tokens",
                format!(
                    "sequence of {} tokens exceeds max_position_embeddings {}",
                    past + seq,
                    self.rope.max_positions()
                ),
            ));
        }
        let (cos, sin) = self.rope.tables(&args.layout.positions);
        let mut stream = Residual::from(self.embed_tokens.forward(tokens));
        for (i, layer) in self.layers.iter().enumerate().take(layers) {
            stream = layer.step(stream, i, (&cos, &sin), args);
        }
        Ok((stream, (cos, sin)))
    }

    /// The rotary tables of `layout`'s positions.
    ///
    /// # Shapes
    /// -> two `[batch, 1, seq, head_dim]`
    pub(crate) fn rope_tables(&self, layout: &AttentionLayout) -> (Tensor<4>, Tensor<4>) {
        self.rope.tables(&layout.positions)
    }

    /// The longest sequence (cached plus new tokens) the rotary tables cover.
    pub(crate) fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// Logits of the LM head for the given hidden states.
    ///
    /// # Shapes
    /// `hidden`: `[batch, seq, hidden]` -> `[batch, seq, vocab]`
    pub fn logits(&self, hidden: Tensor<3>) -> Tensor<3> {
        let [batch, seq, h] = hidden.dims();
        self.lm_head.forward_2d(hidden.reshape([batch * seq, h])).reshape([batch, seq, self.config.vocab_size])
    }

    /// Full forward: logits at every position.
    ///
    /// # Shapes
    /// `tokens`: `[batch, seq]` -> `[batch, seq, vocab]`
    pub fn forward(&self, tokens: Tensor<2, Int>, args: ForwardArgs<'_>) -> Result<Tensor<3>> {
        Ok(self.logits(self.hidden_states(tokens, args)?))
    }
}
