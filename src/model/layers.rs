//! The building blocks of the decoder: a frozen linear projection, RMSNorm, rotary embeddings,
//! and the hook through which adapters add their low-rank deltas.

use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};

use super::fused::dense_linear;
use super::host::transpose_host;
use super::quant::{self, BaseFormat, QuantizedWeight};
use super::weights::{BlockMatrix, WeightSource};
use crate::error::Result;

/// The seven projections an adapter may target, named as in Hugging Face checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Projection {
    /// `self_attn.q_proj`
    #[serde(rename = "q_proj")]
    Q,
    /// `self_attn.k_proj`
    #[serde(rename = "k_proj")]
    K,
    /// `self_attn.v_proj`
    #[serde(rename = "v_proj")]
    V,
    /// `self_attn.o_proj`
    #[serde(rename = "o_proj")]
    O,
    /// `mlp.gate_proj`
    #[serde(rename = "gate_proj")]
    Gate,
    /// `mlp.up_proj`
    #[serde(rename = "up_proj")]
    Up,
    /// `mlp.down_proj`
    #[serde(rename = "down_proj")]
    Down,
}

impl Projection {
    /// All seven, in checkpoint order.
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// The module name (`q_proj`, ..., `down_proj`), as PEFT's `target_modules` writes it.
    pub fn module_name(self) -> &'static str {
        match self {
            Projection::Q => "q_proj",
            Projection::K => "k_proj",
            Projection::V => "v_proj",
            Projection::O => "o_proj",
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }

    /// The path of the module inside a layer (`self_attn.q_proj`, `mlp.gate_proj`, ...).
    pub fn path(self) -> &'static str {
        match self {
            Projection::Q => "self_attn.q_proj",
            Projection::K => "self_attn.k_proj",
            Projection::V => "self_attn.v_proj",
            Projection::O => "self_attn.o_proj",
            Projection::Gate => "mlp.gate_proj",
            Projection::Up => "mlp.up_proj",
            Projection::Down => "mlp.down_proj",
        }
    }

    /// `(in_features, out_features)` of this projection in a model of `config`.
    pub fn dims(self, config: &super::ModelConfig) -> (usize, usize) {
        let h = config.hidden_size;
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let i = config.intermediate_size;
        match self {
            Projection::Q => (h, q),
            Projection::K | Projection::V => (h, kv),
            Projection::O => (q, h),
            Projection::Gate | Projection::Up => (h, i),
            Projection::Down => (i, h),
        }
    }

    /// Parses a module name (`q_proj`, ...).
    pub fn from_module_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.module_name() == name)
    }
}

/// A projection's adapter delta as factors outside autodiff ([`ProjectionDelta::low_rank`]):
/// the delta of input `x` (`[batch, seq, in]`) is `((x A^T) * mask[b]) B_scaled^T`.
#[derive(Clone, Debug)]
pub struct LowRank {
    /// `[rank, in]`.
    pub a: Tensor<2>,
    /// `B` with each adapter's scale applied: `[out, rank]`.
    pub b_scaled: Tensor<2>,
    /// The rank columns each batch row keeps (1) or drops (0), `[batch, rank]`; `None` where
    /// every row keeps every column.
    pub mask: Option<Tensor<2>>,
}

/// Adds a per-call delta to a projection's output: how LoRA adapters (one per batch row, or
/// none) enter the frozen base without the base knowing about them.
pub trait ProjectionDelta {
    /// The delta to add to the output of `projection` in decoder layer `layer` for input `x`,
    /// or `None` when nothing applies.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in_features]` -> `[batch, seq, out_features]`
    fn delta(&self, layer: usize, projection: Projection, x: &Tensor<3>) -> Option<Tensor<3>>;

    /// The deltas of the projections `parts` (each with its output width), which read the same
    /// input `x` and are stacked along their outputs in that order (q/k/v), as one tensor laid
    /// out like the stacked output: each part's [`ProjectionDelta::delta`] in its columns, zeros
    /// where none applies. `None` (the default) when this delta does not join these parts for
    /// this input; callers then add each part's own delta.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in_features]` -> `[batch, seq, sum of the parts' widths]`
    fn joint_delta(&self, layer: usize, parts: &[(Projection, usize)], x: &Tensor<3>) -> Option<Tensor<3>> {
        let _ = (layer, parts, x);
        None
    }

    /// The stacked output `base()` (called only when the parts join) plus the parts'
    /// [`ProjectionDelta::joint_delta`], where a delta may add the two in one pass; `None` when
    /// this delta does not join these parts for this input. The default adds the joint delta.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in_features]`, `base()`: `[batch, seq, sum of the parts' widths]` ->
    /// like `base()`
    fn joint_sum(
        &self,
        layer: usize,
        parts: &[(Projection, usize)],
        x: &Tensor<3>,
        base: &dyn Fn() -> Tensor<3>,
    ) -> Option<Tensor<3>> {
        self.joint_delta(layer, parts, x).map(|delta| base() + delta)
    }

    /// [`ProjectionDelta::delta`] for `projection` in `layer` and input `x` as its low-rank
    /// factors, where it is one outside autodiff: `((x A^T) * mask[b]) B_scaled^T`, for a
    /// caller that computes it in the kernel that adds it to something else (the residual
    /// sum's, for the output projection on a GPU). `None` (the default) when the delta is not
    /// of that form for this input (under autodiff, under dropout, no adapter at the site);
    /// callers then take [`ProjectionDelta::delta`].
    fn low_rank(&self, layer: usize, projection: Projection, x: &Tensor<3>) -> Option<LowRank> {
        let _ = (layer, projection, x);
        None
    }

    /// Which adapter row `row` applies, as a key: rows with equal keys get equal deltas for
    /// equal inputs, so work on a prompt they share may be done once for them. `None` (the
    /// default) when rows cannot be told apart this way (or a row's delta is random, as under
    /// dropout): then nothing is shared.
    fn row_key(&self, row: usize) -> Option<u64> {
        let _ = row;
        None
    }

    /// The same deltas for a batch made of some of this batch's rows: row `i` of the returned
    /// delta applies what row `rows[i]` applies here. `None` (the default) when this delta
    /// cannot be narrowed; callers then share no work between rows.
    fn select_rows(&self, rows: &[usize]) -> Option<Box<dyn ProjectionDelta + '_>> {
        let _ = rows;
        None
    }

    /// The same deltas computed outside autodiff (no graph, nothing kept for a backward pass),
    /// sharing this delta's random stream: what activation checkpointing's first forward runs
    /// ([`crate::model::checkpoint`]). `None` (the default) when this delta cannot.
    fn untracked(&self) -> Option<Box<dyn ProjectionDelta + '_>> {
        None
    }

    /// Where this delta's random stream (dropout masks) stands, or `None` when its deltas draw
    /// nothing: a recomputation rewinds to it ([`ProjectionDelta::rewind`]) to draw the masks
    /// again.
    fn random_position(&self) -> Option<u128> {
        None
    }

    /// Sets the random stream to a position [`ProjectionDelta::random_position`] returned.
    fn rewind(&self, position: u128) {
        let _ = position;
    }
}

/// The weight of a frozen linear projection.
// A burn tensor handle is large (256 bytes), but a model holds only a few of these per layer.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum LinearWeight {
    /// `W` in f32, bf16 or f16 (`model.dtype`): `[out_features, in_features]` row-major, as
    /// checkpoints store it (the GEMM reads it as a transposed view; a decoding step's few-row
    /// product reads its rows).
    Dense(Tensor<2>),
    /// `W` (`[out_features, in_features]`) kept in block formats ([`super::quant`]).
    Quantized(QuantizedWeight),
}

/// A frozen linear projection `y = x W^T + b`. Several projections that read the same input may
/// be stacked along `out` (q/k/v, gate/up) so they run as one product.
#[derive(Clone, Debug)]
pub struct FrozenLinear {
    /// The weight, in floats or kept quantized.
    pub weight: LinearWeight,
    /// `[out_features]`, in f32 (added to the f32 result).
    pub bias: Option<Tensor<1>>,
}

/// Where a base's weights are read from, onto which device, and in which form.
#[derive(Clone, Copy)]
pub struct WeightLoader<'a> {
    /// The tensors.
    pub source: &'a dyn WeightSource,
    /// Where the weights go.
    pub device: &'a Device,
    /// Floats, or kept quantized.
    pub format: BaseFormat,
    /// The dtype of the float matrices (projections, embedding, LM head); f32 when quantized.
    pub dtype: FloatDType,
}

/// `values` (row-major `shape`) on `device` in `dtype` (rounded to nearest, ties to even).
pub(crate) fn float_tensor<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &Device,
    dtype: FloatDType,
) -> Tensor<D> {
    let data = TensorData::new(values, shape);
    match dtype {
        FloatDType::F32 => Tensor::from_data(data, device),
        other => {
            let dtype = DType::from(other);
            Tensor::from_data(data.convert_dtype(dtype), (device, dtype))
        }
    }
}

impl WeightLoader<'_> {
    /// The float matrix `name` (`[rows, cols]`) on the device in the loader's dtype.
    pub(crate) fn dense(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor<2>> {
        Ok(float_tensor(self.source.read(name, &[rows, cols])?.values, [rows, cols], self.device, self.dtype))
    }

    /// The matrix `name` (`[rows, cols]`) as the base keeps it: f32 `W^T`, or its stored block
    /// format (a float matrix becomes Q8_0, see [`quant::quantize_float_matrix`]).
    pub(crate) fn matrix_part(&self, name: &str, rows: usize, cols: usize) -> Result<BlockMatrix> {
        match self.source.read_blocks(name, rows, cols)? {
            Some(blocks) => Ok(blocks),
            None => Ok(quant::quantize_float_matrix(&self.source.read(name, &[rows, cols])?.values, rows, cols)),
        }
    }
}

impl FrozenLinear {
    /// Loads `{prefix}.weight` (and `{prefix}.bias` when `bias`).
    pub fn load(
        loader: &WeightLoader<'_>,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        Self::load_stacked(loader, &[prefix], in_features, &[out_features], bias)
    }

    /// Loads several projections of the same input and stacks them along `out`
    /// (`prefixes[i]` has `out_features[i]` outputs).
    pub fn load_stacked(
        loader: &WeightLoader<'_>,
        prefixes: &[&str],
        in_features: usize,
        out_features: &[usize],
        bias: bool,
    ) -> Result<Self> {
        let total: usize = out_features.iter().sum();
        let mut biases = Vec::with_capacity(total);
        if bias {
            for (prefix, &out) in prefixes.iter().zip(out_features) {
                biases.extend(loader.source.read(&format!("{prefix}.bias"), &[out])?.values);
            }
        }
        let weight = match loader.format {
            BaseFormat::F32 => {
                let mut stacked = Vec::with_capacity(total * in_features);
                for (prefix, &out) in prefixes.iter().zip(out_features) {
                    stacked.extend(loader.source.read(&format!("{prefix}.weight"), &[out, in_features])?.values);
                }
                LinearWeight::Dense(float_tensor(stacked, [total, in_features], loader.device, loader.dtype))
            }
            BaseFormat::Quantized => {
                let parts = prefixes
                    .iter()
                    .zip(out_features)
                    .map(|(prefix, &out)| loader.matrix_part(&format!("{prefix}.weight"), out, in_features))
                    .collect::<Result<Vec<_>>>()?;
                LinearWeight::Quantized(QuantizedWeight::new(parts))
            }
        };
        Ok(Self { weight, bias: bias.then(|| Tensor::from_data(TensorData::new(biases, [total]), loader.device)) })
    }

    /// `[out_features, in_features]`
    pub fn dims(&self) -> [usize; 2] {
        match &self.weight {
            LinearWeight::Dense(weight) => weight.dims(),
            LinearWeight::Quantized(weight) => weight.dims(),
        }
    }

    /// `W^T` (`[in_features, out_features]`) as held (f32 or `model.dtype`), dequantized to f32
    /// when kept quantized.
    pub fn dense_t(&self) -> Tensor<2> {
        match &self.weight {
            LinearWeight::Dense(weight) => weight.clone().transpose(),
            LinearWeight::Quantized(weight) => {
                let [rows, cols] = weight.dims();
                let device = self.bias.as_ref().map_or_else(Device::flex, |b| b.device());
                Tensor::from_data(TensorData::new(weight.dequantize_t(), [cols, rows]), &device)
            }
        }
    }

    /// The first `n` output columns of `W^T`, row-major `[in_features, n]` (dequantized when
    /// kept quantized).
    pub fn first_columns(&self, n: usize) -> Vec<f32> {
        let rows = match &self.weight {
            LinearWeight::Dense(weight) => {
                let [_, i] = weight.dims();
                weight
                    .clone()
                    .slice([0..n, 0..i])
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .unwrap_or_default()
            }
            LinearWeight::Quantized(weight) => weight.gather_rows(&(0..n).collect::<Vec<_>>()),
        };
        transpose_host(&rows, n, self.dims()[1])
    }

    /// Bytes the weight and bias take in memory.
    pub fn bytes(&self) -> usize {
        let weight = match &self.weight {
            LinearWeight::Dense(weight) => weight.dtype().size() * weight.dims().iter().product::<usize>(),
            LinearWeight::Quantized(weight) => weight.bytes(),
        };
        weight + self.bias.as_ref().map_or(0, |b| 4 * b.dims()[0])
    }

    /// `x` in f32 and so is the result; a weight held in bf16 or f16 multiplies `x` rounded to
    /// its type, accumulating in f32, the product rounded to it ([`dense_linear`]).
    ///
    /// # Shapes
    /// `x`: `[rows, in]` -> `[rows, out]`
    pub fn forward_2d(&self, x: Tensor<2>) -> Tensor<2> {
        let y = match &self.weight {
            LinearWeight::Dense(weight) => dense_linear(x, weight),
            LinearWeight::Quantized(weight) => quant::quantized_linear(x, weight),
        };
        match &self.bias {
            Some(bias) => y + bias.clone().unsqueeze_dim(0),
            None => y,
        }
    }

    /// The half precision this projection's product rounds its input to on a GPU (its weight's
    /// type, `model.dtype`), for the kernel before it to write its output rounded so too
    /// ([`FrozenLinear::forward_rounded`]); `None` for an f32 or quantized weight, on the CPU, and
    /// with troupe's GPU kernels off.
    pub fn input_rounding(&self) -> Option<DType> {
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if let LinearWeight::Dense(weight) = &self.weight {
            return super::fused::gpu::rounding(weight);
        }
        None
    }

    /// [`FrozenLinear::forward`] where a kernel before the product also wrote `x` rounded to
    /// [`FrozenLinear::input_rounding`] (`rounded`): the product takes it in place of rounding
    /// `x` itself, one launch fewer, the same values. Without it, `forward(x)`.
    ///
    /// # Shapes
    /// `x`, `rounded`: `[batch, seq, in]` -> `[batch, seq, out]`
    #[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
    pub fn forward_rounded(&self, x: Tensor<3>, rounded: Option<Tensor<3>>) -> Tensor<3> {
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if let (Some(rounded), LinearWeight::Dense(weight)) = (&rounded, &self.weight) {
            let [batch, seq, features] = rounded.dims();
            let [out, _] = self.dims();
            if let Some(y) =
                super::fused::gpu::frozen_linear_rounded(&rounded.clone().reshape([batch * seq, features]), weight)
            {
                let y = match &self.bias {
                    Some(bias) => y + bias.clone().unsqueeze_dim(0),
                    None => y,
                };
                return y.reshape([batch, seq, out]);
            }
        }
        self.forward(x)
    }

    /// # Shapes
    /// `x`: `[batch, seq, in]` -> `[batch, seq, out]`
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, seq, features] = x.dims();
        let [out, _] = self.dims();
        // One 2-D product over all rows: [batch * seq, in] x [in, out].
        self.forward_2d(x.reshape([batch * seq, features])).reshape([batch, seq, out])
    }
}

/// Root-mean-square layer norm over the last dimension, as Llama and Qwen compute it.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// `[features]`
    pub weight: Tensor<1>,
    /// Added to the mean square.
    pub eps: f64,
}

impl RmsNorm {
    /// Loads `{prefix}.weight`.
    pub fn load(source: &dyn WeightSource, prefix: &str, features: usize, eps: f64, device: &Device) -> Result<Self> {
        Ok(Self { weight: source.load::<1>(&format!("{prefix}.weight"), [features], device)?, eps })
    }

    /// # Shapes
    /// `x`: `[..., features]` -> same
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        super::fused::rms_norm(x, &self.weight, self.eps)
    }
}

/// Precomputed rotary-embedding tables (Hugging Face's "default" RoPE, rotate-half layout).
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    /// `[max_positions, head_dim]`
    cos: Tensor<2>,
    /// `[max_positions, head_dim]`
    sin: Tensor<2>,
    head_dim: usize,
}

impl RotaryEmbedding {
    /// Tables for positions `0..max_positions`, computed in f32 as transformers does.
    pub fn new(head_dim: usize, theta: f64, max_positions: usize, device: &Device) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f32> =
            (0..half).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32)).collect();
        let mut cos = Vec::with_capacity(max_positions * head_dim);
        let mut sin = Vec::with_capacity(max_positions * head_dim);
        for pos in 0..max_positions {
            let row: Vec<f32> = inv_freq.iter().map(|f| pos as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(row.iter().map(|a| a.cos()));
                sin.extend(row.iter().map(|a| a.sin()));
            }
        }
        Self {
            cos: Tensor::from_data(TensorData::new(cos, [max_positions, head_dim]), device),
            sin: Tensor::from_data(TensorData::new(sin, [max_positions, head_dim]), device),
            head_dim,
        }
    }

    /// Longest position the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The cos and sin rows for each token's position.
    ///
    /// # Shapes
    /// `positions`: `[batch, seq]` -> two `[batch, 1, seq, head_dim]`
    pub fn tables(&self, positions: &Tensor<2, Int>) -> (Tensor<4>, Tensor<4>) {
        let [batch, seq] = positions.dims();
        let flat = positions.clone().reshape([batch * seq]);
        let gather = |table: &Tensor<2>| table.clone().select(0, flat.clone()).reshape([batch, 1, seq, self.head_dim]);
        (gather(&self.cos), gather(&self.sin))
    }

    /// Rotates `x` by the given tables.
    ///
    /// # Shapes
    /// `x`: `[batch, heads, seq, head_dim]`, `cos`/`sin`: `[batch, 1, seq, head_dim]` -> like `x`
    pub fn apply(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
        super::fused::rope(x, cos, sin)
    }
}
