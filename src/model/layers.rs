//! The building blocks of the decoder: a frozen linear projection, RMSNorm, rotary embeddings,
//! and the hook through which adapters add their low-rank deltas.

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::weights::WeightSource;
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

/// Adds a per-call delta to a projection's output: how LoRA adapters (one per batch row, or
/// none) enter the frozen base without the base knowing about them.
pub trait ProjectionDelta {
    /// The delta to add to the output of `projection` in decoder layer `layer` for input `x`,
    /// or `None` when nothing applies.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in_features]` -> `[batch, seq, out_features]`
    fn delta(&self, layer: usize, projection: Projection, x: &Tensor<3>) -> Option<Tensor<3>>;
}

/// A frozen linear projection `y = x W^T + b`. The weight is kept transposed, `[in, out]`
/// row-major, which is the layout the CPU GEMM reads fastest; several projections that read the
/// same input may be stacked along `out` (q/k/v, gate/up) so they run as one GEMM.
#[derive(Clone, Debug)]
pub struct FrozenLinear {
    /// `W^T`: `[in_features, out_features]`
    pub weight_t: Tensor<2>,
    /// `[out_features]`
    pub bias: Option<Tensor<1>>,
}

/// Transposes a row-major `[rows, cols]` matrix.
pub(crate) fn transpose_host(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

impl FrozenLinear {
    /// Loads `{prefix}.weight` (and `{prefix}.bias` when `bias`).
    pub fn load(
        source: &dyn WeightSource,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        device: &Device,
    ) -> Result<Self> {
        Self::load_stacked(source, &[prefix], in_features, &[out_features], bias, device)
    }

    /// Loads several projections of the same input and stacks them along `out`
    /// (`prefixes[i]` has `out_features[i]` outputs).
    pub fn load_stacked(
        source: &dyn WeightSource,
        prefixes: &[&str],
        in_features: usize,
        out_features: &[usize],
        bias: bool,
        device: &Device,
    ) -> Result<Self> {
        let total: usize = out_features.iter().sum();
        let mut stacked = Vec::with_capacity(total * in_features);
        let mut biases = Vec::with_capacity(total);
        for (prefix, &out) in prefixes.iter().zip(out_features) {
            stacked.extend(source.read(&format!("{prefix}.weight"), &[out, in_features])?.values);
            if bias {
                biases.extend(source.read(&format!("{prefix}.bias"), &[out])?.values);
            }
        }
        let weight_t = transpose_host(&stacked, total, in_features);
        Ok(Self {
            weight_t: Tensor::from_data(TensorData::new(weight_t, [in_features, total]), device),
            bias: bias.then(|| Tensor::from_data(TensorData::new(biases, [total]), device)),
        })
    }

    /// `[out_features, in_features]`
    pub fn dims(&self) -> [usize; 2] {
        let [i, o] = self.weight_t.dims();
        [o, i]
    }

    /// # Shapes
    /// `x`: `[batch, seq, in]` -> `[batch, seq, out]`
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, seq, features] = x.dims();
        let [_, out] = self.weight_t.dims();
        // One 2-D GEMM over all rows: [batch * seq, in] x [in, out].
        let y = x.reshape([batch * seq, features]).matmul(self.weight_t.clone());
        let y = match &self.bias {
            Some(bias) => y + bias.clone().unsqueeze_dim(0),
            None => y,
        };
        y.reshape([batch, seq, out])
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
        let mean_square = x.clone().square().mean_dim(D - 1);
        let normed = x * (mean_square + self.eps).sqrt().recip();
        let mut shape = [1usize; D];
        shape[D - 1] = self.weight.dims()[0];
        normed * self.weight.clone().reshape(shape)
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
        let half = x.dims()[3] / 2;
        let first = x.clone().narrow(3, 0, half);
        let second = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![second.neg(), first], 3);
        x * cos.clone() + rotated * sin.clone()
    }
}
